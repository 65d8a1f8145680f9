// The configuration search of ferry::search_configurations with the device's kind given, so that
// a test on a unified-memory CPU device can search as for a discrete GPU (no mapped candidate).
#pragma once

#include "ferry/runtime/plan.hpp"
#include "graph/memory_plan.hpp"

namespace ferry::detail {

ConfigurationSearch search_configurations(Runtime& runtime, const ModelSpec& model, const TrainerOptions& options,
                                          const PlanRates& rates, bool host_unified_memory);

// The host memory a plan is held to (check_host_budget): the smaller of the budget and this
// machine's physical memory where each applies; 0 for no limit.
std::uint64_t host_limit_bytes(std::uint64_t host_budget_bytes, HostLimit limit_by);

// The host bytes check_host_budget holds a plan to: its host bytes, the compressed chunks' bound,
// the Predict runs' restore point and evaluation's host pools (saturating).
std::uint64_t host_bytes_needed(const TrainingPlan& plan);

// The host bytes of a plan that no micro-batch split lowers: the persistent tensors' stores, the
// compressed chunks' bound and the Predict runs' restore point (a split only shrinks the step pools,
// and adds gradient sums).
std::uint64_t host_bytes_at_any_batch(const TrainingPlan& plan);

// Whether the prediction counts node n at the GEMM rate: a device compute row with a FLOP count
// (linear and its gradients, matmul, attention, convolution). count_step counts them;
// measure_step_gemm_gflops probes them.
bool at_gemm_rate(const graph::Graph& g, graph::NodeId n);
// The FLOPs of g's nodes at the GEMM rate: what a plan of g counts as PhasePlan::gemm_flops.
std::uint64_t gemm_rate_flops(const graph::Graph& g);

// The schedule of a planned step g at `rates` (runtime/plan_schedule.cpp, graph::estimate_schedule):
// each node's duration as count_step counts its work, the step's nodes in their order on their
// lanes; sets p's scheduled_* figures (left 0 where no rate is known: nothing would take time).
void schedule_step(const graph::Graph& g, const graph::MemoryPlan& memory, const PlanRates& rates,
                   std::uint32_t pinned_copies, PhasePlan& p);

// A step whose device budget cannot hold it at the recomputation given (TrainerOptions::recompute,
// not recompute_auto): `error` with what --recompute auto would choose where that fits ("; recomputing
// segments of 12 layers fits it: --recompute 12, or auto"), else `error` as it is. Plans again, so
// only on the way to an error.
graph::BudgetError with_recompute_hint(const graph::BudgetError& error, Runtime& runtime, const ModelSpec& model,
                                       const TrainerOptions& options);

}  // namespace ferry::detail
