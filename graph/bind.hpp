// Binding: the passes that read the op table's rows for a device (scratch, dtype checks) and the
// binding of each node's kernels to its planned operands.
#pragma once

#include <functional>

#include "ferry/graph/ir.hpp"
#include "ferry/ops/launch.hpp"
#include "ferry/ops/op_table.hpp"
#include "graph/autodiff.hpp"

namespace ferry::graph {

// Where each tensor is, once the memory plan and the arena exist.
struct TensorLocator {
  std::function<ops::DeviceSpan(TensorId)> device;
  // Host memory of a tensor whose home is the host: `write` selects where a new value goes (the
  // next copy of a streamed tensor) rather than where the current value is.
  std::function<ops::HostAddress(TensorId, bool write)> host;
  ops::DeviceSpan status;                      // the step's status word (BindContext::step_status)
  ops::StagedCopier* staged_copier = nullptr;  // the step's ring for chunked fetches, if any
};

// Checks every node's float operands against the dtypes its row accepts. Throws
// std::invalid_argument naming the node, the op, the tensor and its dtype, and what the op takes.
void check_dtypes(const Graph& g);

// Gives every node whose row asks for scratch bytes on this device (GEMM panels, im2col columns)
// a scratch tensor of that size.
void assign_scratch(Graph& g, ops::OpEnv& env);

// The launches of a device-lane node, arguments bound to the planned locations.
ops::LaunchList bind_node(const Graph& g, NodeId n, const TensorLocator& at, ops::OpEnv& env,
                          const OptimizerConfig& optimizer);

}  // namespace ferry::graph
