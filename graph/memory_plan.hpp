// Static memory plan: every device tensor of a step gets (pool, buffer, offset) before the step
// runs, so the step's peak device bytes are known at compile time and nothing is allocated
// inside a step.
//
// Pools: `persistent` holds weights and optimizer state for the life of the trainer (shared by all
// variants of a model: training, evaluation), packed per home (each home's store has its own
// buffers); `transient` holds everything that lives within one step, packed by liveness over the
// static node order. Each pool is a list of buffers no larger than the device's largest
// allocation.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "ferry/graph/ir.hpp"

namespace ferry::graph {

// persistent: weights and optimizer state; transient: the step's device arena; host_transient:
// step-lifetime tensors whose home is the host (TensorTable::home not device), e.g. weight
// gradients that mapped mode or the host optimizer keep on the host. Staging tensors (host-side,
// Role::staged: what staged transfers pass through) are host_transient too, packed into buffers of
// their own after the others (MemoryPlan::host_staging_from), which are always pinned.
enum class Pool : std::uint8_t { persistent, transient, host_transient };

struct MemoryPlanOptions {
  std::uint64_t max_buffer_bytes = 1ull << 30;  // CL_DEVICE_MAX_MEM_ALLOC_SIZE of the device
  std::uint32_t alignment = 256;                // bytes; at least the device's base address alignment
  bool plan_persistent = true;                  // false: persistent tensors are placed already (shared)
  // Step buffers that already exist (another variant's, which never runs at the same time): the
  // transient pool is packed into them first, up to their sizes, before any new buffer.
  std::vector<std::uint64_t> existing_transient_buffers;
  // The same for the host pool of step tensors (not staging): another variant's host buffers;
  // for its pinned staging buffers (not the fetch ring); and its fetch ring's bytes (0: none).
  std::vector<std::uint64_t> existing_host_buffers, existing_staging_buffers;
  std::uint64_t existing_fetch_ring_bytes = 0;
  // Pinned staging takes device memory as well (NVIDIA's OpenCL): peak_bytes() counts it.
  bool staging_on_device = false;
  // Device copies a fetch writes hold their bytes from this many compute nodes before the fetch,
  // and tensors a write-back reads until this many compute nodes after it, so that neither shares
  // bytes with the compute nodes around the copy: a copy into bytes a node before it used waits
  // for that node to end, and a node after a write-back that reuses its source's bytes waits for
  // the copy (ResidencyOptions::transfer_slack; 0: lifetimes as the nodes touch them).
  std::uint32_t transfer_slack = 0;
  // Pinned staging tensors hold their bytes until this many staging tensors after them are in use,
  // so that this many staged copies and one more can be in flight at once: the host filling one
  // while the link empties another, where packed they would take turns (ResidencyOptions::
  // transfer_slack on a device with memory of its own; the budget search gives it up with the
  // device copies' slack only where staging takes device memory).
  std::uint32_t staging_slack = 0;
};

struct MemoryPlan {
  std::vector<Pool> pool;  // per tensor (storage owners only; views take their base's)
  // Buffer sizes in bytes. Persistent tensors are packed per home (index: offload::Home), so a
  // persistent placement's buffer counts within its home.
  std::array<std::vector<std::uint64_t>, offload::home_count> persistent_buffers;
  std::vector<std::uint64_t> transient_buffers, host_transient_buffers;
  std::uint64_t persistent_bytes = 0;         // all homes
  std::uint64_t persistent_device_bytes = 0;  // the device home's: what the device holds
  std::uint64_t transient_bytes = 0, host_transient_bytes = 0;
  // host_transient_buffers[host_staging_from..] hold the staging tensors (pinned); their bytes,
  // counted in host_transient_bytes too.
  std::size_t host_staging_from = 0;
  std::uint64_t host_staging_bytes = 0;
  // Chunked fetches' ring of pinned chunks (offload::FetchRing): the last staging buffer, of
  // FetchRing::default_slots chunks of this many bytes; 0 when the step has no chunked fetch.
  std::uint64_t fetch_ring_chunk_bytes = 0;
  bool staging_on_device = false;  // MemoryPlanOptions::staging_on_device
  // Transient bytes in buffers beyond the existing ones (what this variant adds to the device).
  std::uint64_t new_transient_bytes = 0;
  // host_transient_buffers[0..shared_host_buffers) are MemoryPlanOptions::existing_host_buffers,
  // [host_staging_from..+shared_staging_buffers) its existing_staging_buffers and, with
  // shared_fetch_ring, the last its fetch ring (each at the existing size or larger). Host bytes in
  // the others (what this variant adds to the host where it shares the existing ones), and of
  // those, the staging's and the ring's.
  std::size_t shared_host_buffers = 0, shared_staging_buffers = 0;
  bool shared_fetch_ring = false;
  std::uint64_t new_host_transient_bytes = 0, new_host_staging_bytes = 0;
  // Sum of the transient tensors' sizes: what the step would need without reuse.
  std::uint64_t transient_unshared_bytes = 0;
  // Bytes of transient tensors live while each node runs (what the memory profiler reports;
  // the arena can be larger by fragmentation).
  std::vector<std::uint64_t> live_bytes;
  // Device bytes of the step: the device home's persistent tensors and the transient pool (and
  // pinned staging where the driver backs it with device memory).
  std::uint64_t peak_bytes() const { return persistent_device_bytes + transient_bytes + staging_device_bytes(); }
  // The device memory pinned staging takes: its bytes where the driver backs it with device memory.
  std::uint64_t staging_device_bytes() const { return staging_on_device ? host_staging_bytes : 0; }
};

// Assigns tensors.placement for every tensor that nodes touch and returns the pools' sizes.
// Throws std::runtime_error if one tensor is larger than max_buffer_bytes.
MemoryPlan plan_memory(Graph& g, const MemoryPlanOptions& options);

}  // namespace ferry::graph
