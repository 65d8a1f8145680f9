// Binds graph nodes to op kernels: the one place that knows how each OpKind maps onto ops/.
#pragma once

#include <functional>

#include "ferry/graph/autodiff.hpp"
#include "ferry/graph/ir.hpp"
#include "ferry/ops/conv2d.hpp"
#include "ferry/ops/gemm.hpp"
#include "ferry/ops/launch.hpp"
#include "ferry/ops/pool.hpp"

namespace ferry::graph {

// The three GEMMs of a Linear layer with input x [B, in] and weight w [in, out]:
// y = x w;  dx = dy w^T;  dw = x^T dy.
struct LinearGemms {
  ops::GemmShape forward, grad_input, grad_param;
};
LinearGemms linear_gemms(const Shape& x, const Shape& w);
// Op shapes from tensor shapes and node attributes.
ops::Conv2dShape conv_shape(const Shape& x, const Shape& w, const NodeAttrs& a);
ops::Pool2dShape pool_shape(const Shape& x, const NodeAttrs& a);

// Where a tensor is on the device (from the memory plan and the arena buffers).
using TensorResolver = std::function<ops::DeviceSpan(TensorId)>;

// Gives every node that needs a temporary (GEMM panels, im2col columns) a scratch tensor sized
// for this device's kernels.
void assign_scratch(Graph& g, ops::OpEnv& env);

// The kernel launches of a compute node, arguments bound to the planned locations.
ops::LaunchList bind_node(const Graph& g, NodeId n, const TensorResolver& at, ops::OpEnv& env,
                          const OptimizerSpec& optimizer);

}  // namespace ferry::graph
