// Residency: where weights and optimizer state live between uses, under a device budget.
//
// Modes:
//   resident  every persistent tensor lives on the device (the budget must hold them all);
//   stream    persistent tensors live in pinned host memory; the pass inserts fetch nodes
//             (copy-in lane) before their uses and write-back nodes (copy-out lane) after their
//             last write, issued `lookahead` compute nodes ahead so copies overlap compute, their
//             device bytes kept apart from the compute nodes around them (transfer_slack).
//             Which uses share one fetch follows the furthest-next-use rule over the static
//             step order (Belady), computed here at compile time.
//   mapped    persistent tensors live in pinned host memory that kernels read directly
//             (zero-copy): for devices whose memory is the host's (CL_DEVICE_HOST_UNIFIED_MEMORY).
//   automatic resident if everything fits the budget, else mapped on unified-memory devices,
//             else stream.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "ferry/graph/ir.hpp"
#include "ferry/offload/home.hpp"

namespace ferry::graph {

enum class ResidencyMode : std::uint8_t { automatic, resident, stream, mapped };
const char* residency_mode_name(ResidencyMode m);
ResidencyMode parse_residency_mode(const std::string& s);  // throws std::invalid_argument

struct ResidencyOptions {
  // An explicit stream or mapped mode with both roles' homes on the device (nothing would move)
  // is refused at planning.
  ResidencyMode mode = ResidencyMode::automatic;
  // Device bytes a step may use; 0: no limit here (a Trainer resolves 0 to the device's memory
  // less headroom first: TrainerOptions).
  std::uint64_t budget_bytes = 0;
  // Pinned host bytes the weights, optimizer state and step host buffers may take (0: no limit
  // beyond the machine's physical memory). The trainer checks the planned figure against it, and
  // against physical memory, before it allocates anything (ferry::check_host_budget).
  std::uint64_t host_budget_bytes = 0;
  std::uint32_t lookahead = 2;  // compute nodes between a fetch and its first use
  // Compute nodes around each copy whose bytes the memory plan keeps apart from the copy's
  // (MemoryPlanOptions::transfer_slack): a fetch then waits for no node just before it, nor a node
  // just after a write-back for the copy. Staged copies' pinned staging is kept apart from that of
  // the next this many (MemoryPlanOptions::staging_slack), so the host fills one while the link
  // empties another (on devices with memory of their own). The budget search gives it up (halving
  // it) before the lookahead, once no persistent copy is cached between uses (the staging's part
  // only where staging takes device memory).
  std::uint32_t transfer_slack = 4;
  // Stream mode: run optimizer updates on the host (TBB workers) instead of the device, after the
  // step's commit point, on the one host copy. Only the weights are fetched and only their
  // gradients written back; optimizer state stays on the host.
  bool host_optimizer = false;
  // With host_optimizer and one host copy of the state (HomeStoreOptions::pinned_copies 1): each
  // step's host updates run in the next step, each just before its weight's fetch, so that they
  // overlap the forward instead of following the backward with the device idle. The same bits as
  // updates after the commit point; the last step's updates run when the state is next read or
  // written (PersistentArena::read, write) or another variant runs. One rank only.
  bool overlap_host_updates = false;
  // Per role, a home replacing the mode's preset (resident: device, stream: host_pinned,
  // mapped: host_mapped), e.g. weights on the device with their optimizer state streamed from
  // pinned host memory, or compressed state. Homes without a store (host_int8), weights
  // dropped, and host_mapped on a discrete device are errors at compile time.
  std::optional<Home> weights_home, state_home;
  // Settings of the home stores: the compressed home's chunk size, zstd level and workers.
  offload::HomeStoreOptions homes;
  // Staged homes (compressed, dropped) on a device whose memory is the host's: unpack straight
  // into pinned memory the kernels read (no fetch or write-back copies). false: stage and copy as
  // on a discrete device (for tests and measurements).
  bool zero_copy_staging = true;
  // Staged host memory (offload::HostMemory::staged): transfers smaller than this copy straight
  // from pageable memory, where the two hand-offs between host and device a staged copy takes
  // would cost more than the pinned rate saves (biases, LayerNorm gains). 0: stage every one.
  std::uint64_t staging_min_bytes = 1u << 20;
  // Staged host memory: 0 fetches through unpack nodes (host-lane work, then the copy); above 0,
  // each staged fetch of what the step did not write copies itself through a ring of four pinned
  // chunks of this many bytes (rounded up to KiB), host copy and link in a pipeline, when it is
  // enqueued (graph/passes/staging.cpp). Write-backs stay staged through pack nodes. Within
  // [min_staging_chunk_bytes, max_staging_chunk_bytes], and only with staged host memory and,
  // under an explicit mode, a role homed in host memory: else planning throws
  // std::invalid_argument.
  std::uint64_t staging_chunk_bytes = 0;
  // A resident step's adjacent Adam updates as one launch per up to 8 parameters
  // (adam_update_group; the same bits). TrainerOptions::fuse sets it.
  bool group_updates = true;
  // The host optimizer under mixed precision: a weight gradient the device widens from f16 or
  // bf16 crosses the link narrow and is widened on the host (the same bits, half the bytes of the
  // copy). false only to measure or compare.
  bool narrow_gradient_copies = true;
  static constexpr std::uint64_t min_staging_chunk_bytes = std::uint64_t{4} << 10;
  static constexpr std::uint64_t max_staging_chunk_bytes = std::uint64_t{256} << 20;
};

struct ResidencyReport {
  ResidencyMode mode = ResidencyMode::resident;  // the one chosen
  std::uint32_t fetches = 0, write_backs = 0;    // per step
  std::uint64_t fetch_bytes = 0, write_back_bytes = 0;
  std::uint32_t host_updates = 0;        // optimizer updates run on the host
  std::uint32_t unpacks = 0, packs = 0;  // staged homes' host-lane nodes (stage_home_transfers)
  std::uint64_t cache_limit_bytes = 0;   // device bytes the eviction rule was allowed for persistent copies
  std::uint32_t lookahead = 0;
  std::uint32_t transfer_slack = 0;    // as the budget search left it
  std::uint64_t min_budget_bytes = 0;  // the smallest budget this graph can run in (stream mode)
};

// Thrown when no residency plan fits the budget; says the minimum budget.
class BudgetError : public std::runtime_error {
 public:
  BudgetError(const std::string& what, std::uint64_t min_budget) : std::runtime_error(what), min_budget_(min_budget) {}
  std::uint64_t min_budget() const noexcept { return min_budget_; }

 private:
  std::uint64_t min_budget_;
};

}  // namespace ferry::graph
