// The predictor pass: snapshot and fit around every optimizer update (training variants of the
// hybrid phases), or one apply node per weight (Predict).
#include <fmt/format.h>

#include <initializer_list>
#include <stdexcept>
#include <vector>

#include "ferry/ops/op_table.hpp"
#include "graph/autodiff.hpp"
#include "ops/attrs.hpp"

namespace ferry::graph {
namespace {

struct PredictorState {
  TensorId d, stats, r = no_tensor;
};

PredictorState predictor_state(TensorTable& t, TensorId w, bool residual) {
  const TensorId d = t.add(t.name[w] + ".pred_d", t.shape[w], DType::f32, Role::predictor_state);
  const TensorId stats = t.add(t.name[w] + ".pred_stats", Shape{static_cast<std::uint32_t>(ops::predictor_stat_count)},
                               DType::f32, Role::predictor_state);
  t.init[d] = t.init[stats] = {WeightInit::Kind::zeros, 0};
  PredictorState s{d, stats};
  if (residual) {
    s.r = t.add(t.name[w] + ".pred_r", t.shape[w], DType::f32, Role::predictor_state);
    t.init[s.r] = {WeightInit::Kind::zeros, 0};
  }
  return s;
}

// in: fixed..., [r], [guard]
std::vector<TensorId> with_optional(std::initializer_list<TensorId> fixed, TensorId r, TensorId guard) {
  std::vector<TensorId> v(fixed);
  if (r != no_tensor) v.push_back(r);
  if (guard != no_tensor) v.push_back(guard);
  return v;
}

void check_f32(const TensorTable& t, TensorId w) {
  if (t.dtype[w] != DType::f32) {
    throw std::invalid_argument(
        fmt::format("the weight-update predictor needs f32 weights; '{}' is {}: train it with --phases full", t.name[w],
                    dtype_name(t.dtype[w])));
  }
}

}  // namespace

void append_predictor_fit(Graph& g, const ops::PredictorConfig& c) {
  ops::check_predictor(c);
  auto& t = g.tensors;
  const ops::OpId snapshot = ops::builtin::predictor_snapshot;
  const ops::OpId fit = ops::builtin::predictor_fit;
  const NodeAttrs attrs = ops::PredictorAttrs{c}.pack();
  const NodeTable old = g.nodes;
  // Each weight the step changes is snapshot before the first node that writes it and fitted after
  // the last one: its update, and with ZeRO sharding the copy of the other ranks' shares after the
  // all-gather, so every rank fits the whole step's change of every weight, the weights it owns no
  // share of included (their only writer there is that copy), and the ranks' predictors agree.
  std::vector<std::vector<TensorId>> snapshot_before(old.size()), fit_after(old.size());
  std::vector<NodeId> first(t.size(), old.size()), last(t.size(), old.size());
  for (NodeId n = 0; n < old.size(); ++n) {
    for (TensorId w : old.outputs(n)) {
      if (t.role[w] != Role::weight) continue;
      if (first[w] == old.size()) first[w] = n;
      last[w] = n;
    }
  }
  for (TensorId w = 0; w < t.size(); ++w) {
    if (first[w] == old.size()) continue;
    check_f32(t, w);
    snapshot_before[first[w]].push_back(w);
    fit_after[last[w]].push_back(w);
  }
  std::vector<TensorId> before(t.size(), no_tensor);
  NodeTable out;
  for (NodeId n = 0; n < old.size(); ++n) {
    for (TensorId w : snapshot_before[n]) {
      before[w] = t.add(t.name[w] + ".before", t.shape[w], DType::f32, Role::activation);
      out.add(snapshot, t.name[w] + ".snapshot", std::span(&w, 1), std::span(&before[w], 1));
    }
    out.add_copy(old, n);
    for (TensorId w : fit_after[n]) {
      const PredictorState s = predictor_state(t, w, c.residual);
      const auto ins = with_optional({w, before[w], s.d, s.stats}, s.r, g.update_guard());
      const auto outs = with_optional({s.d, s.stats}, s.r, no_tensor);
      out.add(fit, t.name[w] + ".fit", ins, outs, attrs);
    }
  }
  g.nodes = std::move(out);
}

void append_predictor_apply(Graph& g, const ops::PredictorConfig& c) {
  auto& t = g.tensors;
  const ops::OpId apply = ops::builtin::predictor_apply;
  const NodeAttrs attrs = ops::PredictorAttrs{c}.pack();
  const std::size_t count = t.size();
  for (TensorId w = 0; w < count; ++w) {
    if (t.role[w] != Role::weight || t.alias_of[w] != no_tensor) continue;
    check_f32(t, w);
    const PredictorState s = predictor_state(t, w, c.residual);
    const auto ins = with_optional({w, s.d, s.stats}, s.r, g.update_guard());
    g.nodes.add(apply, t.name[w] + ".predict", ins, std::span(&w, 1), attrs);
  }
}

}  // namespace ferry::graph
