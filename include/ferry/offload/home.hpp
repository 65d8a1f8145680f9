// Homes: where a persistent tensor (weight, optimizer state) lives between its uses, each home
// one storage strategy. The residency pass (graph/residency.cpp) gives every persistent tensor a
// home per role; a home store owns the memory of all tensors living there.
//
//   device           device buffers; kernels use them in place.
//   host_pinned      host memory (pinned, or pageable: HomeStoreOptions::host_memory; staged
//                    memory is pageable with copies through pinned staging), one copy
//   (HomeStoreOptions::pinned_copies): a step fetches
//                    from it and writes updated tensors back in place, after its commit point (the
//                    overflow guard's last check), as the device home is updated. With two copies
//                    (when asked for) a step writes the other copy, which becomes current only
//                    when the whole step succeeded (commit).
//   host_mapped      one copy of pinned host memory that kernels use directly (zero-copy), on
//                    devices whose memory is the host's.
//   host_compressed  host memory as byte-plane shuffled, zstd-compressed chunks with checksums
//                    (offload/chunk_codec.hpp), in place of an uncompressed copy. A step unpacks a
//                    tensor into pinned staging on a host lane before its fetch and packs the
//                    written-back value after, in place after the commit point (one copy) or
//                    into new chunks that become current at commit (two copies).
//   dropped          not kept: every fetch re-initialises the tensor (zeros) and nothing is written
//                    back. For optimizer state only.
//   host_int8        block-quantized int8 with fp32 scales (the phases issue): no store yet, a
//                    clear error at compile time.
//
// Homes whose tensors kernels cannot address and that keep no plain host copy (compressed,
// dropped) are "staged": their bytes pass through step-lifetime pinned staging buffers.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

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

// Settings of the stores.
struct HomeStoreOptions {
  CodecOptions codec;  // the compressed home's
  // Copies of host_pinned memory: 1, written in place after the step's commit point (host memory
  // equals the state), or 2, written into the other copy and made current at commit (updates
  // may then run before the commit point, for twice the host memory; no default uses it: a
  // Trainer's Predict steps, which write ahead of the loss, put back a restore point instead).
  // Anything else is an error. The compressed
  // home follows it: with 1 a pack replaces a tensor's chunks at once (after the commit point),
  // with 2 the new chunks become current at commit.
  std::uint32_t pinned_copies = 1;
  // The memory of the host_pinned home (and of a step's host buffers): pinned, pageable, or
  // staged (pageable, copies through pinned staging; `automatic` is pageable where the driver's
  // pinned buffers would take device memory too, and a Trainer stages it in chunks there under a
  // budget that affords them: ferry::resolve_host_transfers; host_memory.hpp). host_mapped is always pinned: kernels
  // address it.
  HostMemory host_memory = HostMemory::automatic;
};

// Full-size pinned host copies a store of `h` made with `options` keeps of each tensor.
std::uint32_t host_copies(Home h, const HomeStoreOptions& options);

// Whether a store of `h` keeping `copies` copies (HomeStoreOptions::pinned_copies) changes a
// tensor in place: a home kernels address, or one copy of a home that keeps one or two
// (host_pinned, host_compressed). Such tensors' updates must come after the step's commit point.
bool changes_in_place(Home h, std::uint32_t copies);

}  // namespace ferry::offload
