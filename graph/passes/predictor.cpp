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
  NodeTable out;
  for (NodeId n = 0; n < old.size(); ++n) {
    const bool update = ops::op_info(old.op[n]).op_class == ops::OpClass::update;
    const TensorId w = update ? old.outputs(n)[0] : no_tensor;
    if (!update || t.role[w] != Role::weight) {
      out.add_copy(old, n);
      continue;
    }
    check_f32(t, w);
    const PredictorState s = predictor_state(t, w, c.residual);
    const TensorId before = t.add(t.name[w] + ".before", t.shape[w], DType::f32, Role::activation);
    out.add(snapshot, t.name[w] + ".snapshot", std::span(&w, 1), std::span(&before, 1));
    out.add_copy(old, n);
    const auto ins = with_optional({w, before, s.d, s.stats}, s.r, g.update_guard());
    const auto outs = with_optional({s.d, s.stats}, s.r, no_tensor);
    out.add(fit, t.name[w] + ".fit", ins, outs, attrs);
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
