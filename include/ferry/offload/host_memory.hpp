// Host memory for what a streamed step keeps on the host: the host_pinned home's tensors and the
// step's host buffers (spilled gradients, batch mirrors' pool).
//
// Pinned memory (a CL_MEM_ALLOC_HOST_PTR buffer, mapped) lets copies run as DMA that overlaps
// compute. Some drivers back every such buffer with device memory as well: on NVIDIA's OpenCL
// (measured on an H200) a 1B model streamed under an 8 GiB budget had 22.3 GiB of device memory in
// use, a 6.4B one under 24 GiB 82.7 GB, so pinned homes defeat the device budget there. Pageable
// memory (anonymous pages, NUMA-bound like pinned memory) takes no device memory; the driver stages
// its copies through its own pinned buffers, which on that driver ran at 7.5-9.5 GB/s (H200), a
// quarter of the link; and it read a pageable source when the copy was enqueued, so a fetch of what
// the step wrote goes through pinned staging (graph/passes/staging.cpp). Staged memory keeps the
// homes and the step's host tensors pageable and moves every copy of 1 MiB or more through a small
// pinned staging area of the step's memory plan, filled and drained by host-lane nodes on all
// cores. Staging is counted in the device budget where pinned buffers take device memory. On the
// H200 staged steps ran slower than pageable ones (bench/RESULTS.md), so `automatic` is pageable.
// Registered memory is ferry's own pages handed to the driver as buffers' memory
// (CL_MEM_USE_HOST_PTR), which a driver may pin in place without a device copy: pinned in every
// other respect (copies run as DMA at execution, steps run ahead, nothing is staged). Whether a
// driver pins them and keeps them out of device memory is the driver's: measured, not assumed
// (`ferry-bench staging`'s registered legs, bench/scale_gpu.sh's driver samples).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/cl/context.hpp"
#include "ferry/cl/device.hpp"
#include "ferry/offload/pinned_host.hpp"

namespace ferry::offload {

enum class HostMemory : std::uint8_t {
  automatic,  // pageable where pinned buffers take device memory too, else pinned (a Trainer:
              // ferry::resolve_host_transfers)
  pinned,
  pageable,
  staged,      // pageable, with copies through pinned staging
  registered,  // ferry's pages registered with the driver (CL_MEM_USE_HOST_PTR); otherwise as pinned
};
inline constexpr HostMemory all_host_memories[] = {HostMemory::automatic, HostMemory::pinned, HostMemory::pageable,
                                                   HostMemory::staged, HostMemory::registered};
const char* host_memory_name(HostMemory m);  // "auto", "pinned", "pageable", "staged", "registered"
// Every kind's name, in all_host_memories' order (the CLI's choices).
std::vector<std::string> host_memory_names();
// Throws std::invalid_argument naming the valid values.
HostMemory parse_host_memory(std::string_view s);

// Whether the driver backs each pinned host buffer with device memory as well (NVIDIA's OpenCL
// platform on a discrete GPU).
bool pinned_buffers_take_device_memory(const cl::DeviceFacts& device, bool host_unified_memory);
// `automatic` made concrete for `device`; the others are returned as given.
HostMemory resolve_host_memory(HostMemory m, const cl::DeviceInfo& device);
// Whether memory of (resolved) kind m is pinned: DMA at execution, kernels can address it (mem()).
inline bool is_pinned(HostMemory m) {
  return m == HostMemory::pinned || m == HostMemory::registered;
}
// The memory the link copies from with homes in `resolved` memory: pinned staging for staged
// memory, the homes themselves otherwise (what a link measurement should copy from).
inline HostMemory link_source_memory(HostMemory resolved) {
  return resolved == HostMemory::staged ? HostMemory::pinned : resolved;
}

// Copies `bytes` from `src` to `dst` (not overlapping) on the calling thread and TBB's workers, in
// blocks of a few MiB: one core's memcpy does not keep up with the link.
void copy_in_parallel(void* dst, const void* src, std::size_t bytes);

namespace detail {
// Returns anonymous pages to the system (HostBuffer::pageable).
struct Unmap {
  std::size_t bytes = 0;
  void operator()(void* p) const noexcept;
};
}  // namespace detail

// A block of host memory: the driver's pinned memory, ferry's pages, or ferry's pages registered
// with the driver. Kernels can address only pinned blocks (mem()): the driver's and registered ones.
class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(cl::PinnedBuffer pinned) : pinned_(std::move(pinned)) {}
  // Anonymous pages of `bytes` (transparent huge pages asked for). Throws std::runtime_error
  // naming `what` and the size when the system refuses.
  static HostBuffer pageable(std::size_t bytes, std::string_view what);
  // The pages of a pageable block registered with the context's driver (cl::Context::register_host).
  // Throws std::runtime_error naming `what` when the driver refuses.
  static HostBuffer registered(const cl::Context& context, HostBuffer pages, std::string_view what);

  void* data() const noexcept { return pinned_.mem() ? pinned_.data() : pages_.get(); }
  std::size_t bytes() const noexcept { return pinned_.mem() ? pinned_.bytes() : pages_.get_deleter().bytes; }
  bool pinned() const noexcept { return pinned_.mem() != nullptr; }
  // The OpenCL buffer of a pinned block; nullptr for pageable memory.
  cl_mem mem() const noexcept { return pinned_.mem(); }

 private:
  // Declared before pinned_ so that a registered block's buffer is released before its pages.
  std::unique_ptr<void, detail::Unmap> pages_;
  cl::PinnedBuffer pinned_;
};

// Allocates `bytes` of host memory of kind `memory` (pinned, registered, or pageable for pageable and
// staged; automatic is resolved for the context's device) bound near the device as allocate_pinned_host does. Throws
// std::runtime_error naming `what` and the size when it cannot.
HostBuffer allocate_host(const cl::Context& context, std::size_t bytes, HostMemory memory, std::string_view what,
                         HostPlacement* placement = nullptr);

}  // namespace ferry::offload
