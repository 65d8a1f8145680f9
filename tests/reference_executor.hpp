// Runs a step graph on the CPU with the ops' reference implementations, in any precision.
// The device step is checked against it, and autodiff is checked by finite differences on it.
#pragma once

#include <fmt/format.h>

#include <map>
#include <span>
#include <stdexcept>
#include <vector>

#include "ferry/ops/cast.hpp"
#include "ferry/ops/op_table.hpp"
#include "graph/autodiff.hpp"
#include "graph/node_view.hpp"

namespace ferry::test {

// Float tensors are held as double.
class ReferenceExecutor {
  using T = double;

 public:
  ReferenceExecutor(const graph::Graph& g, ops::OptimizerConfig optimizer) : g_(g), optimizer_(optimizer) {
    const auto& t = g_.tensors;
    values_.resize(t.size());
    ints_.resize(t.size());
    for (graph::TensorId id = 0; id < t.size(); ++id) {
      if (t.alias_of[id] != graph::no_tensor) continue;
      if (t.dtype[id] == graph::DType::i32) {
        ints_[id].assign(t.shape[id].elems(), 0);
      } else {
        values_[id].assign(t.shape[id].elems(), T(0));
      }
    }
  }

  std::vector<T>& value(graph::TensorId id) { return values_[g_.tensors.storage(id)]; }
  std::vector<std::int32_t>& ints(graph::TensorId id) { return ints_[g_.tensors.storage(id)]; }
  graph::TensorId find(const std::string& name) const {
    for (graph::TensorId id = 0; id < g_.tensors.size(); ++id) {
      if (g_.tensors.name[id] == name) return id;
    }
    throw std::invalid_argument("no tensor " + name);
  }

  // Runs nodes in order through their rows' CPU references; forward_only stops after the node
  // that produces the loss.
  void run(const ops::StepInfo& step, bool forward_only = false) {
    for (graph::NodeId n = 0; n < g_.nodes.size(); ++n) {
      exec(n, step);
      if (forward_only && produces_loss(n)) return;
    }
  }

  T loss() { return value(g_.loss)[0]; }

 private:
  bool produces_loss(graph::NodeId n) const {
    for (graph::TensorId o : g_.nodes.outputs(n)) {
      if (o == g_.loss) return true;
    }
    return false;
  }

  // The RefContext of one node over this executor's storage.
  class Node final : public graph::NodeView<ops::RefContext> {
   public:
    Node(ReferenceExecutor& x, graph::NodeId n, const ops::StepInfo& step) : NodeView(x.g_, n), x_(x), step_(step) {}
    std::span<double> real(ops::TensorRef t) override { return x_.value(t); }
    std::span<std::int32_t> ints(ops::TensorRef t) override { return x_.ints(t); }
    std::span<const ops::TensorRef> inputs() const override { return in_ids(); }
    std::span<const ops::TensorRef> outputs() const override { return out_ids(); }
    const ops::StepInfo& step() const override { return step_; }
    const ops::OptimizerConfig& optimizer() const override { return x_.optimizer_; }

   private:
    ReferenceExecutor& x_;
    const ops::StepInfo& step_;
  };

  void exec(graph::NodeId n, const ops::StepInfo& step) {
    const ops::OpInfo& row = ops::op_info(g_.nodes.op[n]);
    // The batch is set on the device-side tensors directly (value(input)): no upload or download.
    if (row.op_class == ops::OpClass::batch_transfer) return;
    if (!row.reference) {
      throw std::logic_error(fmt::format("reference executor: op '{}' has no CPU reference", row.name));
    }
    Node node(*this, n, step);
    row.reference(node);
    // A narrow output is stored rounded on the device: so it is here (f32 outputs stay double, so
    // that finite differences of f32 graphs keep their precision).
    for (graph::TensorId o : g_.nodes.outputs(n)) {
      const graph::DType t = g_.tensors.dtype[o];
      if (t != graph::DType::f16 && t != graph::DType::bf16) continue;
      for (T& v : value(o)) {
        std::uint16_t bits = 0;
        ops::ref::store_float(t, static_cast<float>(v), &bits, 0);
        v = ops::ref::load_float(t, &bits, 0);
      }
    }
  }

  const graph::Graph& g_;
  ops::OptimizerConfig optimizer_;
  std::vector<std::vector<T>> values_;
  std::vector<std::vector<std::int32_t>> ints_;
};

}  // namespace ferry::test
