// The rows' bind and scratch rules applied to the nodes of a planned graph.
#include "ferry/graph/bind.hpp"

#include <fmt/format.h>

#include <stdexcept>

#include "ferry/graph/node_view.hpp"

namespace ferry::graph {
namespace {

class NodeBinding final : public NodeView<ops::BindContext> {
 public:
  NodeBinding(const Graph& g, NodeId n, const TensorLocator& at, ops::OpEnv& env, const OptimizerSpec& optimizer)
      : NodeView(g, n), at_(at), env_(env), optimizer_(optimizer) {}
  ops::DeviceSpan in(std::size_t i) const override { return at_.device(in_ids()[i]); }
  ops::DeviceSpan out(std::size_t i) const override { return at_.device(out_ids()[i]); }
  ops::DeviceSpan scratch() const override {
    const TensorId s = graph_.nodes.scratch[node_];
    return s == no_tensor ? ops::DeviceSpan{} : at_.device(s);
  }
  ops::OpEnv& env() const override { return env_; }
  const OptimizerSpec& optimizer() const override { return optimizer_; }
  ops::HostAddress host_in(std::size_t i) const override { return at_.host(in_ids()[i], false); }
  ops::HostAddress host_out(std::size_t i) const override { return at_.host(out_ids()[i], true); }

 private:
  const TensorLocator& at_;
  ops::OpEnv& env_;
  const OptimizerSpec& optimizer_;
};

}  // namespace

void check_dtypes(const Graph& g) {
  const auto& t = g.tensors;
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    const ops::OpInfo& row = ops::op_info(g.nodes.op[n]);
    auto check = [&](TensorId id) {
      if (id == no_tensor || !ops::dtype_is_float(t.dtype[id]) || row.float_dtypes.contains(t.dtype[id])) return;
      throw std::invalid_argument(
          fmt::format("node '{}': op '{}' does not support dtype {} (tensor '{}'); it takes {}: cast the tensor first "
                      "or keep it in "
                      "a dtype the op supports",
                      g.nodes.name[n], row.name, ops::dtype_name(t.dtype[id]), t.name[id], row.float_dtypes.str()));
    };
    for (TensorId id : g.nodes.inputs(n)) check(id);
    for (TensorId id : g.nodes.outputs(n)) check(id);
  }
}

void assign_scratch(Graph& g, ops::OpEnv& env) {
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    const ops::OpInfo& row = ops::op_info(g.nodes.op[n]);
    if (!row.scratch_bytes) continue;
    const std::size_t bytes = row.scratch_bytes(NodeView<ops::ShapeView>(g, n), env);
    if (bytes == 0) continue;
    // Stored as bytes: the memory plan only needs the size.
    g.nodes.scratch[n] =
        g.tensors.add(g.nodes.name[n] + ".scratch", Shape{static_cast<std::uint32_t>(bytes)}, DType::u8, Role::scratch);
  }
}

ops::LaunchList bind_node(const Graph& g, NodeId n, const TensorLocator& at, ops::OpEnv& env,
                          const OptimizerSpec& optimizer) {
  const ops::OpInfo& row = ops::op_info(g.nodes.op[n]);
  if (!row.bind) {
    throw std::logic_error(
        fmt::format("node '{}' ({}) has no device binding (host-only op on a device lane)", g.nodes.name[n], row.name));
  }
  return row.bind(NodeBinding(g, n, at, env, optimizer));
}

}  // namespace ferry::graph
