// The optimizer pass: one in-place update node per weight that has a gradient, with its state.
#include "ferry/graph/autodiff.hpp"

namespace ferry::graph {

void append_optimizer(Graph& g, const OptimizerSpec& spec) {
  auto& t = g.tensors;
  const std::size_t count = t.size();
  auto state = [&](TensorId w, const char* suffix) {
    TensorId s = t.add(t.name[w] + suffix, t.shape[w], DType::f32, Role::optimizer_state);
    t.init[s] = {WeightInit::Kind::zeros, 0};
    return s;
  };
  // Every update reads the step's loss and skips itself when the loss is not finite.
  const TensorId stats = g.loss;
  for (TensorId w = 0; w < count; ++w) {
    if (t.role[w] != Role::weight || t.grad[w] == no_tensor) continue;
    const TensorId grad = t.grad[w];
    if (spec.kind == OptimizerSpec::Kind::sgd) {
      // Without momentum the velocity is the gradient itself, which dies at this update: use its
      // buffer rather than keeping (and, when streaming, moving) a state tensor.
      TensorId v = spec.sgd.momentum == 0.0f ? grad : state(w, ".momentum");
      const TensorId ins[] = {w, grad, v, stats};
      const TensorId outs[] = {w, v};
      g.nodes.add(builtin::sgd_update, t.name[w] + ".update", std::span(ins, stats == no_tensor ? 3 : 4), outs);
    } else {
      TensorId m = state(w, ".adam_m");
      TensorId v = state(w, ".adam_v");
      const TensorId ins[] = {w, grad, m, v, stats};
      const TensorId outs[] = {w, m, v};
      g.nodes.add(builtin::adam_update, t.name[w] + ".update", std::span(ins, stats == no_tensor ? 4 : 5), outs);
    }
  }
}

}  // namespace ferry::graph
