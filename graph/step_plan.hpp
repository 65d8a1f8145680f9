// The device passes of a compile that decide everything before any memory is allocated: check
// dtypes, scratch, and the residency and memory plan (graph/pipeline.hpp). graph::CompiledStep
// runs them first and then allocates; ferry::plan_training (ferry/runtime/plan.hpp) runs only
// them, so a model too large for this machine can still be planned.
#pragma once

#include <memory>
#include <vector>

#include "ferry/graph/residency.hpp"
#include "graph/compiled_step.hpp"
#include "graph/memory_plan.hpp"
#include "graph/pipeline.hpp"

namespace ferry::graph {

struct StepPlan {
  MemoryPlan memory;
  ResidencyReport residency;
  std::vector<PassTiming> pass_timings;  // the three passes, in order
};

// Runs the three passes on `g` (its placements, homes and scratch tensors are set) for `device`.
// With `shared`, persistent tensors take their placements and homes from it, the residency mode
// is its, and its step buffers are packed first (a model's other variants). Throws BudgetError as
// CompiledStep does.
StepPlan plan_step(Graph& g, ops::OpEnv& env, const cl::DeviceInfo& device, const PersistentArena* shared,
                   const ResidencyOptions& residency);

// What a CompiledStep of the planned graph `g` records in its persistent arena (the mode, every
// persistent tensor's home and placement, the device and host step buffer sizes and the host
// pool's kind `host_pool`, host_pool_memory), without any home store: nothing is allocated. The
// `shared` argument of plan_step for the model's other variants, and what CompiledStep adds its
// stores and buffers to.
std::shared_ptr<PersistentArena> planned_arena(const Graph& g, const MemoryPlan& plan, ResidencyMode mode,
                                               offload::HostMemory host_pool);

}  // namespace ferry::graph
