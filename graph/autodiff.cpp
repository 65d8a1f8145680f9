// Reverse-mode autodiff over the step IR.
#include "ferry/graph/autodiff.hpp"

#include <fmt/format.h>

#include <stdexcept>

namespace ferry::graph {
namespace {

class Differentiator {
 public:
  explicit Differentiator(Graph& g) : g_(g), t_(g.tensors), n_(g.nodes) {}

  void run() {
    const std::size_t forward_count = n_.size();
    mark_needs_grad(forward_count);
    NodeId loss = find_loss(forward_count);
    for (NodeId n = static_cast<NodeId>(forward_count); n-- > 0;) {
      if (n == loss) {
        emit_loss_grad(n);
      } else {
        emit(n);
      }
    }
  }

 private:
  void mark_needs_grad(std::size_t forward_count) {
    needs_.assign(t_.size(), false);
    for (TensorId t = 0; t < t_.size(); ++t) needs_[t] = t_.role[t] == Role::weight;
    for (NodeId n = 0; n < forward_count; ++n) {
      bool any = false;
      for (TensorId in : n_.inputs(n)) any = any || needs(in);
      for (TensorId out : n_.outputs(n)) needs_[out] = any;
    }
    // Views need a gradient when their base does.
    for (TensorId t = 0; t < t_.size(); ++t) {
      if (t_.alias_of[t] != no_tensor) needs_[t] = needs_[t] || needs(t_.alias_of[t]);
    }
  }

  bool needs(TensorId t) const {
    if (t >= needs_.size()) return false;
    if (needs_[t]) return true;
    return t_.alias_of[t] != no_tensor && needs(t_.alias_of[t]);
  }

  NodeId find_loss(std::size_t forward_count) const {
    for (NodeId n = 0; n < forward_count; ++n) {
      if (n_.kind[n] == OpKind::softmax_xent) return n;
    }
    throw std::invalid_argument("the step graph has no loss (softmax_xent): nothing to differentiate");
  }

  TensorId grad_tensor(TensorId of) {
    TensorId g = t_.add("d" + t_.name[of], t_.shape[of], DType::f32, Role::gradient);
    needs_.push_back(false);
    return g;
  }

  // Adds `g` to the gradient of `t` (summing when t is used more than once).
  void contribute(TensorId t, TensorId g) {
    if (!needs(t)) return;
    if (TensorId base = t_.alias_of[t]; base != no_tensor) {
      // The gradient of a view is a view of the base's gradient.
      TensorId gv = t_.add(t_.name[g] + ".view", t_.shape[base], DType::f32, Role::gradient, g);
      needs_.push_back(false);
      contribute(base, gv);
      return;
    }
    if (t_.grad[t] == no_tensor) {
      t_.grad[t] = g;
      return;
    }
    TensorId sum = grad_tensor(t);
    const TensorId ins[] = {t_.grad[t], g};
    const TensorId outs[] = {sum};
    n_.add(OpKind::add, fmt::format("{}.grad_sum", t_.name[t]), ins, outs);
    t_.grad[t] = sum;
  }

  void emit_loss_grad(NodeId n) {
    auto in = n_.inputs(n);
    auto out = n_.outputs(n);
    const TensorId logits = in[0], labels = in[1], probs = out[0];
    if (!needs(logits)) return;
    TensorId dl = grad_tensor(logits);
    const TensorId ins[] = {probs, labels};
    const TensorId outs[] = {dl};
    n_.add(OpKind::softmax_xent_grad, n_.name[n] + ".grad", ins, outs);
    contribute(logits, dl);
  }

  void emit(NodeId n) {
    const auto in = std::vector<TensorId>(n_.inputs(n).begin(), n_.inputs(n).end());
    const auto out = std::vector<TensorId>(n_.outputs(n).begin(), n_.outputs(n).end());
    const std::string name = n_.name[n];  // a copy: adding nodes below reallocates the names
    const NodeAttrs attrs = n_.attrs[n];
    switch (n_.kind[n]) {
      case OpKind::upload:
        return;
      case OpKind::linear:
      case OpKind::conv2d: {
        const TensorId dy = t_.grad[out[0]];
        if (dy == no_tensor) return;
        const bool linear = n_.kind[n] == OpKind::linear;
        const TensorId x = in[0], w = in[1];
        const bool has_bias = in.size() > 2;
        if (needs(x)) {
          TensorId dx = grad_tensor(x);
          const TensorId ins[] = {dy, w};
          const TensorId outs[] = {dx};
          n_.add(linear ? OpKind::linear_grad_input : OpKind::conv2d_grad_input, name + ".grad_input", ins, outs,
                 attrs);
          contribute(x, dx);
        }
        TensorId dw = grad_tensor(w);
        TensorId db = has_bias ? grad_tensor(in[2]) : no_tensor;
        const TensorId ins[] = {x, dy};
        const TensorId outs[] = {dw, db};
        n_.add(linear ? OpKind::linear_grad_param : OpKind::conv2d_grad_param, name + ".grad_param", ins,
               std::span(outs, has_bias ? 2 : 1), attrs);
        contribute(w, dw);
        if (has_bias) contribute(in[2], db);
        return;
      }
      case OpKind::activation: {
        const TensorId dy = t_.grad[out[0]];
        if (dy == no_tensor || !needs(in[0])) return;
        TensorId dx = grad_tensor(in[0]);
        const TensorId ins[] = {in[0], dy};
        const TensorId outs[] = {dx};
        n_.add(OpKind::activation_grad, name + ".grad", ins, outs, attrs);
        contribute(in[0], dx);
        return;
      }
      case OpKind::add: {
        const TensorId dy = t_.grad[out[0]];
        if (dy == no_tensor) return;
        contribute(in[0], dy);
        contribute(in[1], dy);
        return;
      }
      case OpKind::layernorm: {
        const TensorId dy = t_.grad[out[0]];
        if (dy == no_tensor) return;
        TensorId dx = grad_tensor(in[0]);
        TensorId dg = grad_tensor(in[1]);
        TensorId db = grad_tensor(in[2]);
        const TensorId ins[] = {in[0], in[1], out[1], out[2], dy};
        const TensorId outs[] = {dx, dg, db};
        n_.add(OpKind::layernorm_grad, name + ".grad", ins, outs, attrs);
        contribute(in[0], dx);
        contribute(in[1], dg);
        contribute(in[2], db);
        return;
      }
      case OpKind::maxpool2d: {
        const TensorId dy = t_.grad[out[0]];
        if (dy == no_tensor || !needs(in[0])) return;
        TensorId dx = grad_tensor(in[0]);
        const TensorId ins[] = {dy, out[1]};
        const TensorId outs[] = {dx};
        n_.add(OpKind::maxpool2d_grad, name + ".grad", ins, outs, attrs);
        contribute(in[0], dx);
        return;
      }
      default:
        throw std::logic_error(fmt::format("autodiff: node '{}' ({}) is not a forward op", name, op_name(n_.kind[n])));
    }
  }

  Graph& g_;
  TensorTable& t_;
  NodeTable& n_;
  std::vector<bool> needs_;
};

}  // namespace

const char* optimizer_name(OptimizerSpec::Kind k) {
  switch (k) {
    case OptimizerSpec::Kind::sgd:
      return "sgd";
    case OptimizerSpec::Kind::adam:
      return "adam";
    case OptimizerSpec::Kind::adamw:
      return "adamw";
  }
  return "?";
}

void append_backward(Graph& g) {
  Differentiator(g).run();
}

void append_optimizer(Graph& g, const OptimizerSpec& spec) {
  auto& t = g.tensors;
  const std::size_t count = t.size();
  auto state = [&](TensorId w, const char* suffix) {
    TensorId s = t.add(t.name[w] + suffix, t.shape[w], DType::f32, Role::optimizer_state);
    t.init[s] = {WeightInit::Kind::zeros, 0};
    return s;
  };
  // Every update reads the step's loss statistics and skips itself when the loss is not finite.
  TensorId stats = no_tensor;
  for (TensorId id = 0; id < count; ++id) {
    if (t.role[id] == Role::stats) stats = id;
  }
  for (TensorId w = 0; w < count; ++w) {
    if (t.role[w] != Role::weight || t.grad[w] == no_tensor) continue;
    const TensorId grad = t.grad[w];
    if (spec.kind == OptimizerSpec::Kind::sgd) {
      // Without momentum the velocity is the gradient itself, which dies at this update: use its
      // buffer rather than keeping (and, when streaming, moving) a state tensor.
      TensorId v = spec.sgd.momentum == 0.0f ? grad : state(w, ".momentum");
      const TensorId ins[] = {w, grad, v, stats};
      const TensorId outs[] = {w, v};
      g.nodes.add(OpKind::sgd_update, t.name[w] + ".update", std::span(ins, stats == no_tensor ? 3 : 4), outs);
    } else {
      TensorId m = state(w, ".adam_m");
      TensorId v = state(w, ".adam_v");
      const TensorId ins[] = {w, grad, m, v, stats};
      const TensorId outs[] = {w, m, v};
      g.nodes.add(OpKind::adam_update, t.name[w] + ".update", std::span(ins, stats == no_tensor ? 4 : 5), outs);
    }
  }
}

void append_stats_download(Graph& g) {
  for (TensorId s = 0; s < g.tensors.size(); ++s) {
    if (g.tensors.role[s] == Role::stats) {
      const TensorId ins[] = {s};
      g.nodes.add(OpKind::download, "download." + g.tensors.name[s], ins, {}, {}, Lane::d2h);
    }
  }
}

}  // namespace ferry::graph
