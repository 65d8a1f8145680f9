// Binds graph nodes to op kernels: the one place that knows how each OpKind maps onto ops/.
#pragma once

#include <functional>

#include "ferry/graph/autodiff.hpp"
#include "ferry/graph/ir.hpp"
#include "ferry/ops/launch.hpp"

namespace ferry::graph {

// Where a tensor is on the device (from the memory plan and the arena buffers).
using TensorResolver = std::function<ops::DeviceSpan(TensorId)>;

// Gives every node that needs a temporary (GEMM panels, im2col columns) a scratch tensor sized
// for this device's kernels.
void assign_scratch(Graph& g, ops::OpEnv& env);

// The kernel launches of a compute node, arguments bound to the planned locations.
ops::LaunchList bind_node(const Graph& g, NodeId n, const TensorResolver& at, ops::OpEnv& env,
                          const OptimizerSpec& optimizer);

}  // namespace ferry::graph
