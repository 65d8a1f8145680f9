// Rows of the weight-update predictor (ops/predictor.hpp), class `state_update`: the residency pass
// moves them early with the optimizer updates, in their order, and never to the host lane.
//
//   predictor_snapshot  in: w                      out: before (w as it was before the update)
//   predictor_fit       in: w before d st [r] [loss]   out: d st [r] (in place)
//                       attrs: f0 beta, f1 max gain, i0 kind, i1 residual correction (r present)
//   predictor_apply     in: w d st [r] [loss]      out: w (in place)   attrs: i1 residual correction;
//                       also on the host lane, where
//                       streamed weights are advanced in host memory (no guard: a step whose loss
//                       is not finite does not commit what it wrote)
#include "ferry/ops/predictor.hpp"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <cmath>

#include "ops/attrs.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

PredictorConfig config_of(const NodeAttrs& a) {
  return PredictorAttrs::of(a).config;
}

// Where the optional operands are: r right after the fixed ones when present, then the guard.
struct Optional {
  std::size_t r, guard;  // input indices; r == fixed when absent (and unused)
};
Optional optional_inputs(const NodeAttrs& a, std::size_t fixed) {
  return {fixed, fixed + (config_of(a).residual ? 1 : 0)};
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
    const PredictorConfig cfg = config_of(c.attrs());
    const Optional o = optional_inputs(c.attrs(), 4);
    return predictor_fit(c.env(), cfg, c.in(0), c.in(1), c.in(2), c.in(3), c.scratch(), in_elems(c, 0),
                         c.input_count() > o.guard ? c.in(o.guard) : DeviceSpan{},
                         cfg.residual ? c.in(o.r) : DeviceSpan{});
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    const PredictorConfig cfg = config_of(c.attrs());
    const Optional o = optional_inputs(c.attrs(), 4);
    // Skipped like the update it follows when the loss is not finite.
    if (in.size() > o.guard && !std::isfinite(c.real(in[o.guard])[0])) return;
    ref::predictor_fit<double>(cfg, c.real(in[0]), c.real(in[1]), c.real(in[2]), c.real(in[3]),
                               cfg.residual ? c.real(in[o.r]) : std::span<double>{});
  };
  return r;
}

OpInfo apply_row() {
  OpInfo r;
  r.name = "predictor_apply";
  r.op_class = OpClass::state_update;
  r.bind = [](const BindContext& c) {
    const Optional o = optional_inputs(c.attrs(), 3);
    return predictor_apply(c.env(), c.in(0), c.in(1), c.in(2), in_elems(c, 0),
                           c.input_count() > o.guard ? c.in(o.guard) : DeviceSpan{},
                           config_of(c.attrs()).residual ? c.in(o.r) : DeviceSpan{});
  };
  r.host = [](const HostContext& c) {
    const auto* w = reinterpret_cast<const float*>(c.in(0));
    const auto* d = reinterpret_cast<const float*>(c.in(1));
    const auto* st = reinterpret_cast<const float*>(c.in(2));
    const bool residual = config_of(c.attrs()).residual;
    const auto* rs = residual ? reinterpret_cast<const float*>(c.in(3)) : nullptr;
    auto* out = reinterpret_cast<float*>(c.out(0));
    // As the kernel rounds: the step (a product, then a fused multiply-add for the residual), then
    // a fused multiply-add per element.
    // Element by element, so in parallel over blocks (a weight of millions on one core was a
    // Predict step's largest host cost).
    const float scale = c.step().predict_scale, gain = st[predictor_stat_gain], rgain = st[predictor_stat_rgain];
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, in_elems(c, 0), std::size_t{1} << 16), [&](const auto& r) {
      for (std::size_t i = r.begin(); i < r.end(); ++i) {
        float step = gain * d[i];
        if (residual) step = std::fma(rgain, rs[i], step);
        out[i] = std::fma(scale, step, w[i]);
      }
    });
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    const Optional o = optional_inputs(c.attrs(), 3);
    if (in.size() > o.guard && !std::isfinite(c.real(in[o.guard])[0])) return;
    ref::predictor_apply<double>(
        c.real(in[0]), c.real(in[1]), c.real(in[2]), c.step().predict_scale,
        config_of(c.attrs()).residual ? std::span<const double>(c.real(in[o.r])) : std::span<const double>{});
  };
  return r;
}

}  // namespace

void register_predictor_rows(const AddRow& add) {
  add(snapshot_row(), builtin::predictor_snapshot);
  add(fit_row(), builtin::predictor_fit);
  add(apply_row(), builtin::predictor_apply);
}

}  // namespace ferry::ops::table
