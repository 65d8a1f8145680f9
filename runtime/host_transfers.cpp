// What `--host-memory auto` (offload::HostMemory::automatic) means for a Trainer and for `ferry
// plan`: the host memory of streamed homes and how transfers cross the link, chosen from the
// device and the device budget (ferry::resolve_host_transfers in ferry/runtime/plan.hpp).
//
// Where pinned buffers are host memory alone, pinned: copies run as DMA beside compute. Where a
// driver backs every pinned buffer with device memory too (NVIDIA's, offload::
// pinned_buffers_take_device_memory), pinned homes would take the budget's device memory twice, so
// the homes are pageable, and the fourth GPU run (bench/RESULTS.md, "Fourth GPU run", an H200, a
// 1.0B GPT under an 8 GiB budget) decides how their transfers go:
// - through the driver from pageable memory: 7.5-9.5 GB/s; 3,526 ms a step, and 2,062 ms with the
//   host optimizer (the third run);
// - staged in chunks of 16 or 64 MiB (a ring of four pinned chunks; the host copies one while the
//   link copies the one before): 48.5 / 40.7 GB/s at 64 MiB, 31.5 / 23.6 at 16 MiB, 9.8 / 9.3 at
//   4 MiB (no better than the driver); 3,323 ms a step with 64 MiB chunks, 689 ms (64 MiB) and
//   707 ms (16 MiB) with the host optimizer, the driver's count of device memory within the
//   budget plus 421-679 MiB as with pageable homes.
// So staged with chunks wherever the budget affords chunks of at least 16 MiB: a chunk of the
// budget / 128 (the four count in the budget there: 3% of it), a power of two, at most 64 MiB;
// below a 2 GiB budget, and for a step resident by request, pageable. Staged memory also stages write-backs in pinned
// buffers as large as the two largest in flight, counted in the budget: plan_training plans pageable where the staged
// plan does not fit.
#include <bit>
#include <optional>

#include "ferry/offload/host_memory.hpp"
#include "ferry/runtime/plan.hpp"
#include "trainer_variants.hpp"

namespace ferry {

std::uint64_t auto_staging_chunk_bytes(std::uint64_t device_budget_bytes) {
  constexpr std::uint64_t least = std::uint64_t{16} << 20, most = std::uint64_t{64} << 20;
  const std::uint64_t share = device_budget_bytes / 128;
  if (share < least) return 0;
  return std::min(most, std::bit_floor(share));
}

graph::ResidencyOptions resolve_host_transfers(graph::ResidencyOptions options, const cl::DeviceInfo& device) {
  offload::HostMemory& memory = options.homes.host_memory;
  if (memory != offload::HostMemory::automatic) return options;
  if (!offload::pinned_buffers_take_device_memory(device.facts(), device.host_unified_memory)) {
    memory = offload::HostMemory::pinned;
    return options;
  }
  // Resident by request with no role homed in host memory: nothing is fetched, and a chunk would be
  // refused as unused (graph/residency.cpp).
  const auto homed_on_host = [](const std::optional<graph::Home>& h) { return h && *h == graph::Home::host_pinned; };
  const bool may_stream = options.mode != graph::ResidencyMode::resident || homed_on_host(options.weights_home) ||
                          homed_on_host(options.state_home);
  if (options.staging_chunk_bytes == 0 && may_stream) {
    options.staging_chunk_bytes = auto_staging_chunk_bytes(detail::resolve_device_budget(options.budget_bytes, device));
  }
  memory = options.staging_chunk_bytes > 0 ? offload::HostMemory::staged : offload::HostMemory::pageable;
  return options;
}

}  // namespace ferry
