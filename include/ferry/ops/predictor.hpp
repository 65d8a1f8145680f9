// The weight-update predictor of the hybrid training phases (runtime/phases/).
//
// Per weight tensor w the predictor keeps, on the device:
//   d   the smoothed recent update, shaped like w: d = beta d + (1 - beta) delta after every fit,
//       delta = w after the step's optimizer update - w before it;
//   st  eight floats [delta.d, d.d, delta.delta, gain, delta.r, d.r, r.r, rgain]: the last
//       fit's dot products (with d and r as they were before the fit, i.e. the parts of the update
//       the predictor would have made), the gain the next prediction applies to d, and the
//       residual correction's weight rgain;
//   r   (with residual correction) the smoothed residuals, shaped like w: the part of each true
//       update the main prediction missed, res = delta - gain d, as r = beta r + (1 - beta) res.
// A Predict step applies w += gain d + rgain r in place of the optimizer. Predictors:
//   linear         gain 1: the update continues as the smoothed recent updates (momentum-like);
//   least_squares  gain fitted per tensor: the scale of d that best explains the true update
//                  (delta.d / d.d), smoothed by beta and clamped to [0, max_gain].
// Residual correction (PredictorConfig::residual): rgain is the similarity of each new residual
// to the smoothed past ones, cos(res, r) clamped to [0, 1] and smoothed by beta, so the
// correction grows only while the residuals keep pointing the same way (0 without it).
// The host reads st after Full and Correct steps to judge the prediction (runtime/phases/).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "ferry/ops/launch.hpp"

namespace ferry::ops {

struct PredictorConfig {
  enum class Kind : std::uint8_t { linear, least_squares } kind = Kind::linear;
  float beta = 0.97f;     // smoothing of d (and of the least-squares gain), in [0, 1)
  float max_gain = 4.0f;  // least squares: the largest gain
  bool residual = false;  // residual correction weighted by similarity to past residuals
};
const char* predictor_name(PredictorConfig::Kind k);
// "linear" or "lsq"; throws std::invalid_argument naming the choices.
PredictorConfig::Kind parse_predictor(const std::string& s);
// Throws std::invalid_argument for a beta outside [0, 1) or a max_gain not positive and finite.
void check_predictor(const PredictorConfig& c);

// Indices into st.
inline constexpr std::size_t predictor_stat_delta_d = 0, predictor_stat_d_d = 1, predictor_stat_delta_delta = 2,
                             predictor_stat_gain = 3, predictor_stat_delta_r = 4, predictor_stat_d_r = 5,
                             predictor_stat_r_r = 6, predictor_stat_rgain = 7, predictor_stat_count = 8;

// Work-groups of the fit's first reduction stage; the scratch it needs is 6 floats per group.
inline constexpr std::uint32_t predictor_fit_groups = 64;
inline constexpr std::size_t predictor_fit_scratch_bytes = 6 * predictor_fit_groups * sizeof(float);

// dst = src (n floats): the weight before the optimizer updates it.
LaunchList predictor_snapshot(OpEnv& env, DeviceSpan src, DeviceSpan dst, std::size_t n);
// The fit after the optimizer update: st from (w, before, d, r), then d and r smoothed. `r` is
// the residual state (empty span without residual correction). `scratch` holds
// predictor_fit_scratch_bytes. With `guard` (the step's loss) not finite, nothing changes.
LaunchList predictor_fit(OpEnv& env, const PredictorConfig& c, DeviceSpan w, DeviceSpan before, DeviceSpan d,
                         DeviceSpan st, DeviceSpan scratch, std::size_t n, DeviceSpan guard = {}, DeviceSpan r = {});
// Predict: w += StepInfo::predict_scale * (st[gain] d + st[rgain] r); nothing when `guard` is not
// finite. `r` empty: no residual term.
LaunchList predictor_apply(OpEnv& env, DeviceSpan w, DeviceSpan d, DeviceSpan st, std::size_t n, DeviceSpan guard = {},
                           DeviceSpan r = {});

namespace ref {

// The fit (r empty: no residual correction; its stats stay 0).
template <class T>
void predictor_fit(const PredictorConfig& c, std::span<const T> w, std::span<const T> before, std::span<T> d,
                   std::span<T> st, std::span<T> r = {}) {
  T a = 0, b = 0, e = 0, dr = 0, fr = 0, rr = 0;
  for (std::size_t i = 0; i < w.size(); ++i) {
    const T delta = w[i] - before[i];
    const T ri = r.empty() ? T(0) : r[i];
    a += delta * d[i];
    b += d[i] * d[i];
    e += delta * delta;
    dr += delta * ri;
    fr += d[i] * ri;
    rr += ri * ri;
  }
  const T old_gain = st[predictor_stat_gain];
  st[predictor_stat_delta_d] = a;
  st[predictor_stat_d_d] = b;
  st[predictor_stat_delta_delta] = e;
  st[predictor_stat_delta_r] = dr;
  st[predictor_stat_d_r] = fr;
  st[predictor_stat_r_r] = rr;
  T gain = 1;
  if (c.kind == PredictorConfig::Kind::least_squares && b > 0) {
    const T fitted = std::clamp(a / b, T(0), T(c.max_gain));
    gain = T(c.beta) * old_gain + (1 - T(c.beta)) * fitted;
  }
  st[predictor_stat_gain] = gain;
  if (!r.empty()) {
    // cos(res, r) with res = delta - old_gain d, from the sums.
    const T res_r = dr - old_gain * fr;
    const T res_res = e - 2 * old_gain * a + old_gain * old_gain * b;
    const T cos = rr > 0 && res_res > 0 ? res_r / std::sqrt(res_res * rr) : T(0);
    st[predictor_stat_rgain] = T(c.beta) * st[predictor_stat_rgain] + (1 - T(c.beta)) * std::clamp(cos, T(0), T(1));
  }
  for (std::size_t i = 0; i < w.size(); ++i) {
    const T delta = w[i] - before[i];
    if (!r.empty()) r[i] = T(c.beta) * r[i] + (1 - T(c.beta)) * (delta - old_gain * d[i]);
    d[i] = T(c.beta) * d[i] + (1 - T(c.beta)) * delta;
  }
}

template <class T>
void predictor_apply(std::span<T> w, std::span<const T> d, std::span<const T> st, T scale = 1,
                     std::span<const T> r = {}) {
  for (std::size_t i = 0; i < w.size(); ++i) {
    w[i] += scale * (st[predictor_stat_gain] * d[i] + (r.empty() ? T(0) : st[predictor_stat_rgain] * r[i]));
  }
}

}  // namespace ref
}  // namespace ferry::ops
