// Home stores: the memory of every tensor living in one home (ferry/offload/home.hpp lists the
// homes), behind one interface the compiled step fetches, writes back, commits and aborts through.
// The stores themselves are in offload/homes/.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "ferry/cl/context.hpp"
#include "ferry/offload/chunk_codec.hpp"
#include "ferry/offload/home.hpp"

namespace ferry::offload {

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

class HomeStore {
 public:
  virtual ~HomeStore() = default;
  virtual Home home() const = 0;
  // The kind of host memory it keeps its tensors in (host_memory_name: "pinned", "pageable",
  // "staged", "registered"); "" when it keeps none (the device home, dropped state).
  virtual const char* host_memory() const { return ""; }
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
  // Set-up, like write: zeros over the tensor at p (the device home fills them on the device;
  // others write them like any value).
  virtual void write_zeros(const HomePlace& p, std::size_t bytes);
  // Set-up, like write: where the home keeps the tensor in host memory, `fill` writes its value
  // there in place (then copied into a second copy, if any) and this returns true; elsewhere it
  // returns false without calling `fill`, for the caller to write() a value it made. A model's
  // initial values made in a separate image and copied over touched every byte of host memory
  // twice (bench/RESULTS.md, "Set-up in seconds").
  virtual bool fill_in_place(const HomePlace&, std::size_t, const std::function<void(std::byte*)>&) { return false; }
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
