// Rows of the weight-update predictor (ops/predictor.hpp), class `state_update`: the residency pass
// moves them early with the optimizer updates, in their order, and never to the host lane.
//
//   predictor_snapshot  in: w                      out: before (w as it was before the update)
//   predictor_fit       in: w before d st [loss]   out: d st (in place)   attrs: f0 beta, f1 max gain, i0 kind
//   predictor_apply     in: w d st [loss]          out: w (in place); also on the host lane, where
//                       streamed weights are advanced in host memory (no guard: a step whose loss
//                       is not finite does not commit what it wrote)
#include "ferry/ops/predictor.hpp"

#include <cmath>

#include "rows.hpp"

namespace ferry::ops::table {
namespace {

PredictorConfig config_of(const NodeAttrs& a) {
  PredictorConfig c;
  c.kind = static_cast<PredictorConfig::Kind>(a.i[0]);
  c.beta = a.f[0];
  c.max_gain = a.f[1];
  return c;
}

OpInfo snapshot_row() {
  OpInfo r;
  r.name = "predictor_snapshot";
  r.op_class = OpClass::state_update;
  r.bind = [](const BindContext& c) { return predictor_snapshot(c.env(), c.in(0), c.out(0), in_elems(c, 0)); };
  r.reference = [](RefContext& c) {
    const auto src = c.real(c.inputs()[0]);
    const auto dst = c.real(c.outputs()[0]);
    std::copy(src.begin(), src.end(), dst.begin());
  };
  return r;
}

OpInfo fit_row() {
  OpInfo r;
  r.name = "predictor_fit";
  r.op_class = OpClass::state_update;
  r.scratch_bytes = [](const ShapeView&, OpEnv&) { return predictor_fit_scratch_bytes; };
  r.bind = [](const BindContext& c) {
    return predictor_fit(c.env(), config_of(c.attrs()), c.in(0), c.in(1), c.in(2), c.in(3), c.scratch(), in_elems(c, 0),
                         c.input_count() > 4 ? c.in(4) : DeviceSpan{});
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    // Skipped like the update it follows when the loss is not finite.
    if (in.size() > 4 && !std::isfinite(c.real(in[4])[0])) return;
    ref::predictor_fit<double>(config_of(c.attrs()), c.real(in[0]), c.real(in[1]), c.real(in[2]), c.real(in[3]));
  };
  return r;
}

OpInfo apply_row() {
  OpInfo r;
  r.name = "predictor_apply";
  r.op_class = OpClass::state_update;
  r.bind = [](const BindContext& c) {
    return predictor_apply(c.env(), c.in(0), c.in(1), c.in(2), in_elems(c, 0),
                           c.input_count() > 3 ? c.in(3) : DeviceSpan{});
  };
  r.host = [](const HostContext& c) {
    const auto* w = reinterpret_cast<const float*>(c.in(0));
    const auto* d = reinterpret_cast<const float*>(c.in(1));
    const auto* st = reinterpret_cast<const float*>(c.in(2));
    auto* out = reinterpret_cast<float*>(c.out(0));
    // As the kernel rounds: one product, then a fused multiply-add per element.
    const float s = c.step().predict_scale * st[predictor_stat_gain];
    for (std::size_t i = 0, n = in_elems(c, 0); i < n; ++i) out[i] = std::fma(s, d[i], w[i]);
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    if (in.size() > 3 && !std::isfinite(c.real(in[3])[0])) return;
    ref::predictor_apply<double>(c.real(in[0]), c.real(in[1]), c.real(in[2]), c.step().predict_scale);
  };
  return r;
}

}  // namespace

void register_predictor_rows(const AddNamedRow& add) {
  add(snapshot_row());
  add(fit_row());
  add(apply_row());
}

}  // namespace ferry::ops::table
