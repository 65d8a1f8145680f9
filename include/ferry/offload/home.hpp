// Homes: where a persistent tensor (weight, optimizer state) lives between its uses, each home
// one storage strategy. The residency pass (graph/residency.cpp) gives every persistent tensor a
// home per role; a home store owns the memory of all tensors living there.
//
//   device           device buffers; kernels use them in place.
//   host_pinned      host memory (pinned, or pageable: HomeStoreOptions::host_memory), one copy
//   (HomeStoreOptions::pinned_copies): a step fetches
//                    from it and writes updated tensors back in place, after its commit point (the
//                    overflow guard's last check), as the device home is updated. With two copies
//                    (host-lane updates: the host optimizer, hybrid phases) a step writes the other
//                    copy, which becomes current only when the whole step succeeded (commit).
//   host_mapped      one copy of pinned host memory that kernels use directly (zero-copy), on
//                    devices whose memory is the host's.
//   host_compressed  host memory as byte-plane shuffled, zstd-compressed chunks with checksums
//                    (offload/chunk_codec.hpp), in place of an uncompressed copy. A step unpacks a
//                    tensor into pinned staging on a host lane before its fetch and packs the
//                    written-back value after; the new chunks become current only at commit.
//   dropped          not kept: every fetch re-initialises the tensor (zeros) and nothing is written
//                    back. For optimizer state only.
//   host_int8        block-quantized int8 with fp32 scales (the phases issue): no store yet, a
//                    clear error at compile time.
//
// Homes whose tensors kernels cannot address and that keep no plain host copy (compressed,
// dropped) are "staged": their bytes pass through step-lifetime pinned staging buffers.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/cl/context.hpp"
#include "ferry/offload/chunk_codec.hpp"
#include "ferry/offload/host_memory.hpp"

namespace ferry::offload {

enum class Home : std::uint8_t { device, host_pinned, host_mapped, host_compressed, host_int8, dropped };
inline constexpr int home_count = 6;
const char* home_name(Home h);
Home parse_home(std::string_view s);  // throws std::invalid_argument listing the homes
// What a home asks of the step graph, known before any store exists: the residency pass reads
// these to decide which nodes a tensor living there needs.
struct HomeTraits {
  bool available = false;             // a store exists in this build
  bool addressed_in_place = false;    // kernels use the tensor where it lives (no fetch)
  bool needs_transfers = false;       // fetched before its uses, written back after its last write
  bool needs_unified_memory = false;  // only on devices whose memory is the host's
  bool commits = false;               // keeps a next copy that a successful step makes current
                                      // (host_pinned: only with two copies, HomeStoreOptions)
  bool staged = false;                // unpacked into / packed from pinned staging by host-lane nodes
  bool keeps_value = true;            // false: dropped (what is written back is discarded)
  // Full-size pinned host copies the store keeps of each tensor by default: what the planner
  // counts as the home's host bytes (runtime/plan.cpp, the host budget; host_copies() below with
  // the store's options). The compressed home's chunks are ordinary (not pinned) memory whose size
  // depends on the data: 0 here.
  std::uint32_t host_copies = 0;
};
HomeTraits home_traits(Home h);
// Whether a store exists for `h` in this build.
inline bool home_available(Home h) {
  return home_traits(h).available;
}

// Where a tensor sits inside its home's store.
struct HomePlace {
  std::uint32_t buffer = 0;
  std::uint64_t offset_bytes = 0;
};

// A persistent tensor a home store holds: where, how large, its element size (the compressed
// home shuffles byte planes by it) and its name (for errors).
struct HomeTensor {
  HomePlace place;
  std::uint64_t bytes = 0;
  std::uint32_t elem_bytes = 4;
  std::string name;
};

// Settings of the stores.
struct HomeStoreOptions {
  CodecOptions codec;  // the compressed home's
  // Copies of host_pinned memory: 1, written in place after the step's commit point (host memory
  // equals the state), or 2, written into the other copy and made current at commit (what
  // host-lane updates need, which cannot yet wait for the guard). Anything else is an error.
  std::uint32_t pinned_copies = 1;
  // The memory of the host_pinned home (and of a step's host buffers): pinned, or pageable where
  // the driver's pinned buffers would take device memory too (host_memory.hpp). host_mapped is
  // always pinned: kernels address it.
  HostMemory host_memory = HostMemory::automatic;
};

// Full-size pinned host copies a store of `h` made with `options` keeps of each tensor.
std::uint32_t host_copies(Home h, const HomeStoreOptions& options);

class HomeStore {
 public:
  virtual ~HomeStore() = default;
  virtual Home home() const = 0;
  // Kernels reach the tensors in place (device, mapped): no fetch or write-back nodes.
  virtual bool kernels_address_directly() const = 0;
  // The buffer kernels address, for homes they address directly.
  virtual cl_mem device_buffer(std::uint32_t buffer) const = 0;
  // Host memory of a tensor's current value, and of where its next value goes (the same place
  // for homes with one copy). Asking for next() means the step writes the tensor. Throws
  // std::logic_error for homes without host memory.
  virtual std::byte* current(const HomePlace& p) const = 0;
  virtual std::byte* next(const HomePlace& p) const = 0;
  // A step changes the tensors of this home where they are (device, mapped, one-copy pinned):
  // such writes come after the step's commit point, and a failure after them is a partial
  // update. false: they go into a next value that commit() makes current.
  virtual bool updates_in_place() const { return kernels_address_directly(); }
  // A step that wrote next values succeeded: they become current (only the tensors it wrote;
  // the others keep their current value).
  virtual void commit() {}
  // A step failed (or its loss was not finite): next values it wrote are discarded.
  virtual void abort() {}
  // Inside a step, for staged homes (host-lane nodes): the tensor's value as the step sees it
  // (what it wrote earlier in this step, else the current value) into `dst`, and its next value
  // from `src`. Default: read() and a copy into next().
  virtual void unpack(const HomePlace& p, void* dst, std::size_t bytes) const;
  virtual void pack(const HomePlace& p, const void* src, std::size_t bytes);
  // Set-up and inspection outside any step: write sets every copy, read reads the current one.
  virtual void write(const HomePlace& p, const void* src, std::size_t bytes) = 0;
  virtual void read(const HomePlace& p, void* dst, std::size_t bytes) const = 0;
  // The compressed home's chunks of the tensor at `p` (inspection, tests); nullptr in other
  // homes and for a tensor never written.
  virtual CompressedTensor* chunks(const HomePlace&) { return nullptr; }
  // What the home holds, for the memory profiler and reports.
  virtual std::uint64_t device_bytes() const = 0;
  virtual std::uint64_t host_bytes() const = 0;
};

// Allocates the store of `home` with buffers of the given sizes holding `tensors`. `what` names
// the tensors it holds in allocation errors. Throws std::invalid_argument for a home with no
// store, or one the device cannot serve (host_mapped on a device without unified memory), saying
// what to use.
std::unique_ptr<HomeStore> make_home_store(Home home, const cl::Context& context,
                                           std::span<const std::uint64_t> buffer_bytes,
                                           std::span<const HomeTensor> tensors, const HomeStoreOptions& options,
                                           std::string_view what);

}  // namespace ferry::offload
