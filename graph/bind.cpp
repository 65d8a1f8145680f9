// The bind pass: each device-lane node's row bound to its planned operands.
#include "graph/bind.hpp"

#include <fmt/format.h>

#include <stdexcept>
#include <typeinfo>

#include "ferry/cl/error.hpp"
#include "graph/node_view.hpp"
#include "ops/attrs.hpp"

namespace ferry::graph {
namespace {

class NodeBinding final : public NodeView<ops::BindContext> {
 public:
  NodeBinding(const Graph& g, NodeId n, const TensorLocator& at, ops::OpEnv& env, const OptimizerConfig& optimizer)
      : NodeView(g, n), at_(at), env_(env), optimizer_(optimizer) {}
  ops::DeviceSpan in(std::size_t i) const override { return at_.device(in_ids()[i]); }
  ops::DeviceSpan out(std::size_t i) const override { return at_.device(out_ids()[i]); }
  ops::DeviceSpan scratch() const override {
    const TensorId s = graph_.nodes.scratch[node_];
    return s == no_tensor ? ops::DeviceSpan{} : at_.device(s);
  }
  ops::OpEnv& env() const override { return env_; }
  const OptimizerConfig& optimizer() const override { return optimizer_; }
  // A fetch marked by the stream transform (FetchAttrs::after_write_back) follows this step's write-back of its
  // tensor and reads the value written: the next copy.
  ops::HostAddress host_in(std::size_t i) const override {
    const bool written_this_step =
        graph_.nodes.op[node_] == builtin::fetch && ops::FetchAttrs::of(graph_.nodes.attrs[node_]).after_write_back;
    return at_.host(in_ids()[i], written_this_step);
  }
  ops::HostAddress host_out(std::size_t i) const override { return at_.host(out_ids()[i], true); }
  ops::DeviceSpan step_status() const override { return at_.status; }
  ops::StagedCopier* staged_copier() const override { return at_.staged_copier; }

 private:
  const TensorLocator& at_;
  ops::OpEnv& env_;
  const OptimizerConfig& optimizer_;
};

}  // namespace

ops::LaunchList bind_node(const Graph& g, NodeId n, const TensorLocator& at, ops::OpEnv& env,
                          const OptimizerConfig& optimizer) {
  const ops::OpInfo& row = ops::op_info(g.nodes.op[n]);
  if (!row.bind) {
    throw std::logic_error(
        fmt::format("node '{}' ({}) has no device binding (host-only op on a device lane)", g.nodes.name[n], row.name));
  }
  // OpenCL errors while binding (a kernel that does not build, with its build log) name the node.
  const cl::OpScope scope(g.nodes.name[n]);
  try {
    return row.bind(NodeBinding(g, n, at, env, optimizer));
  } catch (const std::exception& e) {
    // A plain standard error (a user's row's own message) gains the node; derived ones keep their
    // type for their catchers (cl::Error names the node already, a stopped tuning search ends the run).
    const std::string what = fmt::format("node '{}' ({}): {}", g.nodes.name[n], row.name, e.what());
    if (typeid(e) == typeid(std::invalid_argument)) throw std::invalid_argument(what);
    if (typeid(e) == typeid(std::logic_error)) throw std::logic_error(what);
    if (typeid(e) == typeid(std::runtime_error)) throw std::runtime_error(what);
    throw;
  }
}

}  // namespace ferry::graph
