// Pinned host memory for tensors whose home is the host (streamed or mapped weights and
// optimizer state).
//
// Allocated as CL_MEM_ALLOC_HOST_PTR and mapped for the buffer's life: drivers back it with
// page-locked memory, so copies from it are DMA that overlap compute (a malloc'ed source can make
// a driver copy synchronously), and on unified-memory devices kernels can use it directly. Its
// pages are bound, through hwloc, to the NUMA node(s) nearest the device.
#pragma once

#include <string>
#include <string_view>

#include "ferry/cl/context.hpp"

namespace ferry::offload {

struct HostPlacement {
  int numa_nodes = 1;       // NUMA nodes on this machine
  bool bound = false;       // pages were bound near the device
  std::string description;  // e.g. "1 NUMA node: no binding needed"
};

// Allocates `bytes` of pinned host memory. Throws std::runtime_error naming `what` and the size if
// the allocation fails (the usual cause: not enough host memory or a locked-memory limit).
cl::PinnedBuffer allocate_pinned_host(const cl::Context& context, std::size_t bytes, std::string_view what,
                                      HostPlacement* placement = nullptr);

}  // namespace ferry::offload
