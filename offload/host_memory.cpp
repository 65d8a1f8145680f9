// Host memory, pinned or pageable, bound to the NUMA node(s) near the device.
#include "ferry/offload/host_memory.hpp"

#include <fmt/format.h>
#include <hwloc.h>
#include <hwloc/opencl.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "cl/huge_pages.hpp"
#include "ferry/cl/error.hpp"

namespace ferry::offload {
namespace {

// One topology for the process: loading it walks sysfs, so do it once.
hwloc_topology_t topology() {
  static std::once_flag once;
  static hwloc_topology_t topo = nullptr;
  std::call_once(once, [] {
    if (hwloc_topology_init(&topo) != 0) {
      topo = nullptr;
      return;
    }
    if (hwloc_topology_load(topo) != 0) {
      hwloc_topology_destroy(topo);
      topo = nullptr;
    }
  });
  return topo;
}

HostPlacement bind_near_device(const cl::Context& context, void* ptr, std::size_t bytes) {
  HostPlacement out;
  hwloc_topology_t topo = topology();
  if (!topo) {
    out.description = "hwloc could not read the machine's topology: pages left where the driver put them";
    return out;
  }
  out.numa_nodes = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
  if (out.numa_nodes <= 1) {
    out.description = "1 NUMA node: no binding needed";
    return out;
  }
  std::unique_ptr<hwloc_bitmap_s, void (*)(hwloc_bitmap_t)> cpus(hwloc_bitmap_alloc(), hwloc_bitmap_free);
  std::unique_ptr<hwloc_bitmap_s, void (*)(hwloc_bitmap_t)> nodes(hwloc_bitmap_alloc(), hwloc_bitmap_free);
  // The CPUs near the device (its PCI locality where the driver exposes it; all CPUs otherwise).
  if (hwloc_opencl_get_device_cpuset(topo, context.device().id, cpus.get()) != 0 || hwloc_bitmap_iszero(cpus.get())) {
    hwloc_bitmap_copy(cpus.get(), hwloc_topology_get_complete_cpuset(topo));
  }
  hwloc_cpuset_to_nodeset(topo, cpus.get(), nodes.get());
  const int rc = hwloc_set_area_membind(topo, ptr, bytes, nodes.get(), HWLOC_MEMBIND_BIND,
                                        HWLOC_MEMBIND_MIGRATE | HWLOC_MEMBIND_BYNODESET);
  out.bound = rc == 0;
  char* text = nullptr;
  hwloc_bitmap_asprintf(&text, nodes.get());
  out.description =
      rc == 0 ? fmt::format("{} NUMA nodes: bound to node set {}", out.numa_nodes, text)
              : fmt::format("{} NUMA nodes: binding to node set {} was refused by the system", out.numa_nodes, text);
  std::free(text);
  return out;
}

}  // namespace

cl::PinnedBuffer allocate_pinned_host(const cl::Context& context, std::size_t bytes, std::string_view what,
                                      HostPlacement* placement) {
  cl::PinnedBuffer buffer;
  try {
    buffer = context.create_pinned(bytes, what);
  } catch (const std::exception& e) {
    throw std::runtime_error(
        fmt::format("could not allocate {} bytes of pinned host memory for {}: {} (is there "
                    "enough free host memory, and is the locked-memory limit, ulimit -l, high "
                    "enough?)",
                    bytes, what, e.what()));
  }
  HostPlacement p = bind_near_device(context, buffer.data(), bytes);
  if (placement) *placement = std::move(p);
  return buffer;
}

const char* host_memory_name(HostMemory m) {
  switch (m) {
    case HostMemory::automatic:
      return "auto";
    case HostMemory::pinned:
      return "pinned";
    case HostMemory::pageable:
      return "pageable";
    case HostMemory::staged:
      return "staged";
    case HostMemory::registered:
      return "registered";
  }
  return "?";
}

std::vector<std::string> host_memory_names() {
  std::vector<std::string> out;
  for (const HostMemory m : all_host_memories) out.emplace_back(host_memory_name(m));
  return out;
}

HostMemory parse_host_memory(std::string_view s) {
  for (const HostMemory m : all_host_memories) {
    if (s == host_memory_name(m)) return m;
  }
  throw std::invalid_argument(
      fmt::format("unknown host memory '{}': use auto, pinned, pageable, staged or registered", s));
}

bool pinned_buffers_take_device_memory(const cl::DeviceFacts& device, bool host_unified_memory) {
  return !host_unified_memory && cl::matches_selector(device, "nvidia");  // the selector's alias
}

HostMemory resolve_host_memory(HostMemory m, const cl::DeviceInfo& device) {
  if (m != HostMemory::automatic) return m;
  return pinned_buffers_take_device_memory(device.facts(), device.host_unified_memory) ? HostMemory::pageable
                                                                                       : HostMemory::pinned;
}

void copy_in_parallel(void* dst, const void* src, std::size_t bytes) {
  constexpr std::size_t block = std::size_t{4} << 20;
  if (bytes <= block) {
    std::memcpy(dst, src, bytes);
    return;
  }
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  tbb::parallel_for(std::size_t{0}, (bytes + block - 1) / block, [&](std::size_t i) {
    const std::size_t at = i * block;
    std::memcpy(d + at, s + at, std::min(block, bytes - at));
  });
}

void detail::Unmap::operator()(void* p) const noexcept {
  cl::unmap_anonymous_pages(p, std::max<std::size_t>(bytes, 1));
}

HostBuffer HostBuffer::pageable(std::size_t bytes, std::string_view what) {
  const std::size_t length = std::max<std::size_t>(bytes, 1);
  // Large blocks 2 MiB-aligned and advised into 2 MiB pages where the kernel allows (advice only):
  // fewer faults when first written, fewer TLB misses for the driver's staging copies and the host
  // lane's updates.
  void* p = cl::map_anonymous_pages(length);
  if (p == nullptr) {
    throw std::runtime_error(
        fmt::format("could not allocate {} bytes of host memory for {}: {} (is there enough free "
                    "host memory, and is the address-space limit, ulimit -v, high enough?)",
                    bytes, what, std::strerror(errno)));
  }
  HostBuffer b;
  b.pages_ = std::unique_ptr<void, detail::Unmap>(p, detail::Unmap{bytes});
  return b;
}

HostBuffer HostBuffer::registered(const cl::Context& context, HostBuffer pages, std::string_view what) {
  if (!pages.pages_ || pages.pinned()) throw std::logic_error("HostBuffer::registered takes a pageable block");
  HostBuffer b = std::move(pages);
  const std::size_t bytes = b.bytes();
  try {
    b.pinned_ = context.register_host(b.pages_.get(), bytes, what);
  } catch (const std::exception& e) {
    throw std::runtime_error(
        fmt::format("could not register {} bytes of host memory for {} with the driver (CL_MEM_USE_HOST_PTR): {}; use "
                    "--host-memory pinned or pageable (ResidencyOptions::homes.host_memory) on this driver",
                    bytes, what, e.what()));
  }
  return b;
}

HostBuffer allocate_host(const cl::Context& context, std::size_t bytes, HostMemory memory, std::string_view what,
                         HostPlacement* placement) {
  const HostMemory resolved = resolve_host_memory(memory, context.device());
  if (resolved == HostMemory::pinned) return HostBuffer(allocate_pinned_host(context, bytes, what, placement));
  // Pages are bound near the device before a driver registers them (it may pin them where they are).
  HostBuffer b = HostBuffer::pageable(bytes, what);
  HostPlacement p = bind_near_device(context, b.data(), std::max<std::size_t>(bytes, 1));
  if (placement) *placement = std::move(p);
  if (resolved == HostMemory::registered) return HostBuffer::registered(context, std::move(b), what);
  return b;
}

}  // namespace ferry::offload
