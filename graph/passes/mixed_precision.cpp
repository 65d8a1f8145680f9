// The precision pass, mixed-precision part (before autodiff), and the overflow guard every
// training variant's state updates check (after autodiff, before accumulation and the optimizer).
//
// Mixed precision: the layers that gain from narrow storage (Linear, Conv2d, activations,
// max-pooling, fused attention) compute from and store f16 or bf16; the rest (LayerNorm, the losses, softmax,
// sequence ops, the head) stay f32. A narrow node reads narrow copies of its float inputs: a
// weight is cast once per step from its f32 master (biases and other rank-1 weights stay f32, as
// the kernels want), an activation once per dtype it is wanted in. Autodiff then gives every
// tensor a gradient of its own dtype and every cast a cast back; the casts of gradients into a
// narrow type apply the loss scale and those back to f32 remove it (ops::CastScale), so the
// optimizer sees true f32 gradients of f32 master weights.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <stdexcept>
#include <vector>

#include "ferry/ops/op_table.hpp"
#include "graph/autodiff.hpp"
#include "ops/attrs.hpp"

namespace ferry::graph {
NodeId head_layer(const Graph& g) {
  const auto& t = g.tensors;
  NodeId head = static_cast<NodeId>(g.nodes.size());
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    bool loss = false;
    for (TensorId x : g.nodes.outputs(n)) loss = loss || x == g.loss;
    if (loss) break;
    for (TensorId x : g.nodes.inputs(n)) {
      if (t.role[t.storage(x)] == Role::weight) head = n;
    }
  }
  return head;
}

void apply_mixed_precision(Graph& g, DType narrow) {
  if (narrow != DType::f16 && narrow != DType::bf16) {
    throw std::invalid_argument(
        fmt::format("mixed precision in {}: the compute dtype must be f16 or bf16", dtype_name(narrow)));
  }
  auto& t = g.tensors;
  const NodeTable old = g.nodes;
  const NodeId head = head_layer(g);
  NodeTable out;
  std::map<std::pair<TensorId, DType>, TensorId> copies;  // (tensor, dtype) -> its cast
  auto as = [&](TensorId x, DType to) {
    if (t.dtype[x] == to) return x;
    auto [it, fresh] = copies.try_emplace({x, to}, no_tensor);
    if (fresh) {
      it->second = t.add(fmt::format("{}.{}", t.name[x], dtype_name(to)), t.shape[x], to, Role::activation);
      out.add(builtin::cast, fmt::format("{}.to_{}", t.name[x], dtype_name(to)), std::span(&x, 1),
              std::span(&it->second, 1), ops::CastAttrs{.to = to}.pack());
    }
    return it->second;
  };
  // Views share their base's storage, so they take its dtype when it changes.
  std::vector<std::vector<TensorId>> views(t.size());
  for (TensorId v = 0; v < t.size(); ++v) {
    if (t.alias_of[v] != no_tensor) views[t.storage(v)].push_back(v);
  }
  std::vector<TensorId> ins;
  for (NodeId n = 0; n < old.size(); ++n) {
    const ops::OpInfo& row = ops::op_info(old.op[n]);
    if (row.op_class != ops::OpClass::forward && row.op_class != ops::OpClass::loss) {
      out.add_copy(old, n);
      continue;
    }
    const bool low = n != head && row.computes_narrow && row.float_dtypes.contains(narrow);
    ins.assign(old.inputs(n).begin(), old.inputs(n).end());
    for (TensorId& x : ins) {
      if (!ops::dtype_is_float(t.dtype[x])) continue;
      const bool stays_f32 = t.role[t.storage(x)] == Role::weight && t.shape[x].rank < 2;  // biases, gains
      x = as(x, low && !stays_f32 ? narrow : DType::f32);
    }
    const std::vector<TensorId> outs(old.outputs(n).begin(), old.outputs(n).end());
    out.add_copy(old, n, ins, outs, old.lane[n]);
    if (!low) continue;
    for (std::size_t o = 0; o < outs.size() && o < row.narrow_outputs; ++o) {
      const TensorId y = outs[o];
      if (!ops::dtype_is_float(t.dtype[y])) continue;
      t.dtype[y] = narrow;
      for (TensorId v : views[y]) t.dtype[v] = narrow;
    }
  }
  g.nodes = std::move(out);
}

void unscale_f32_weight_gradients(Graph& g) {
  auto& t = g.tensors;
  const auto narrow = [&](TensorId x) { return t.dtype[x] == DType::f16 || t.dtype[x] == DType::bf16; };
  // Per weight: read as it is by a node that computes narrow (its gradient comes scaled), by one
  // that does not (unscaled).
  std::vector<char> scaled(t.size(), 0), unscaled(t.size(), 0);
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    if (ops::op_info(g.nodes.op[n]).op_class != ops::OpClass::forward) continue;
    const auto outs = g.nodes.outputs(n);
    const bool low = std::any_of(outs.begin(), outs.end(), narrow);
    for (TensorId x : g.nodes.inputs(n)) {
      const TensorId w = t.storage(x);
      if (t.role[w] != Role::weight || t.grad[w] == no_tensor || t.dtype[x] != DType::f32) continue;
      (low ? scaled : unscaled)[w] = 1;
    }
  }
  std::vector<NodeId> last_writer(t.size(), static_cast<NodeId>(g.nodes.size()));
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    for (TensorId x : g.nodes.outputs(n)) last_writer[t.storage(x)] = n;
  }
  std::vector<std::vector<TensorId>> after(g.nodes.size());  // weights whose gradient is unscaled after node n
  for (TensorId w = 0; w < t.size(); ++w) {
    if (!scaled[w]) continue;
    if (unscaled[w]) {
      throw std::logic_error(fmt::format(
          "mixed precision: weight '{}' is read as f32 by narrow and by f32 nodes, so its gradient sums scaled "
          "and unscaled parts",
          t.name[w]));
    }
    const NodeId writer = last_writer[t.storage(t.grad[w])];
    if (writer == g.nodes.size()) throw std::logic_error(fmt::format("no node makes the gradient of '{}'", t.name[w]));
    after[writer].push_back(w);
  }
  const NodeTable old = std::move(g.nodes);
  g.nodes = {};
  const NodeAttrs attrs = ops::CastAttrs{.to = DType::f32, .scale = ops::CastScale::inverse_loss_scale}.pack();
  for (NodeId n = 0; n < old.size(); ++n) {
    g.nodes.add_copy(old, n);
    for (TensorId w : after[n]) {
      const TensorId grad = t.grad[w];
      const TensorId true_grad = t.add(t.name[grad] + ".unscaled", t.shape[grad], DType::f32, t.role[grad]);
      g.nodes.add(builtin::cast, t.name[grad] + ".unscale", std::span(&grad, 1), std::span(&true_grad, 1), attrs);
      t.grad[w] = true_grad;
    }
  }
}

TensorId widened_narrow_tensor(const TensorTable& t, const NodeTable& nodes, NodeId n, TensorId out) {
  if (nodes.op[n] != builtin::cast || is_host_lane(nodes.lane[n]) || nodes.outputs(n).size() != 1) return no_tensor;
  const TensorId in = nodes.inputs(n)[0];
  const bool narrow = t.dtype[in] == DType::f16 || t.dtype[in] == DType::bf16;
  const bool whole = nodes.outputs(n)[0] == out && t.storage(out) == out && t.storage(in) == in &&
                     t.shape[in].elems() == t.shape[out].elems();
  return narrow && whole && t.dtype[out] == DType::f32 && t.home[in] == Home::device ? in : no_tensor;
}

std::vector<TensorId> weights_in_gradient_order(const Graph& g) {
  const auto& t = g.tensors;
  std::vector<NodeId> last_write(t.size(), 0);
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    for (TensorId x : g.nodes.outputs(n)) last_write[t.storage(x)] = n;
  }
  std::vector<std::pair<NodeId, TensorId>> grads;
  for (TensorId w = 0; w < t.size(); ++w) {
    if (t.role[w] == Role::weight && t.grad[w] != no_tensor) grads.emplace_back(last_write[t.storage(t.grad[w])], w);
  }
  std::stable_sort(grads.begin(), grads.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<TensorId> out;
  for (const auto& [writer, w] : grads) out.push_back(w);
  return out;
}

void append_overflow_guard(Graph& g) {
  auto& t = g.tensors;
  if (g.loss == no_tensor) throw std::logic_error("overflow guard: the graph has no loss");
  // The checks follow the order the gradients are made in, so that each can run right after its
  // gradient when updates move early (graph::place_updates_early keeps the checks of one guard in
  // order).
  const std::vector<TensorId> weights = weights_in_gradient_order(g);
  g.guard = t.add(std::string(overflow_guard_name), Shape{1}, DType::f32, Role::stats);
  g.nodes.add(ops::builtin::overflow_guard_init, std::string(overflow_guard_name), std::span(&g.loss, 1),
              std::span(&g.guard, 1));
  const ops::OpId check = ops::builtin::overflow_guard_check;
  for (TensorId w : weights) {
    const TensorId ins[] = {g.guard, t.grad[w]};
    g.nodes.add(check, fmt::format("{}.{}", overflow_guard_name, t.name[w]), ins, std::span(&g.guard, 1));
  }
}

}  // namespace ferry::graph
