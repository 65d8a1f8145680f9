// The weight-update predictor of the hybrid training phases (runtime/phases/).
//
// Per weight tensor w the predictor keeps, on the device:
//   d   the smoothed recent update, shaped like w: d = beta d + (1 - beta) delta after every fit,
//       delta = w after the step's optimizer update - w before it;
//   st  four floats [delta.d, d.d, delta.delta, gain]: the last fit's dot products (with d as it
//       was before the fit, i.e. the update the predictor would have made, divided by the gain)
//       and the gain the next prediction applies.
// A Predict step applies w += gain d in place of the optimizer. Predictors:
//   linear         gain 1: the update continues as the smoothed recent updates (momentum-like);
//   least_squares  gain fitted per tensor: the scale of d that best explains the true update
//                  (delta.d / d.d), smoothed by beta and clamped to [0, max_gain].
// The host reads st after Full and Correct steps to judge the prediction (runtime/phases/).
#pragma once

#include <algorithm>
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
};
const char* predictor_name(PredictorConfig::Kind k);
// "linear" or "lsq"; throws std::invalid_argument naming the choices.
PredictorConfig::Kind parse_predictor(const std::string& s);
// Throws std::invalid_argument for a beta outside [0, 1) or a max_gain not positive and finite.
void check_predictor(const PredictorConfig& c);

// Indices into st.
inline constexpr std::size_t predictor_stat_delta_d = 0, predictor_stat_d_d = 1, predictor_stat_delta_delta = 2,
                             predictor_stat_gain = 3, predictor_stat_count = 4;

// Work-groups of the fit's first reduction stage; the scratch it needs is 3 floats per group.
inline constexpr std::uint32_t predictor_fit_groups = 64;
inline constexpr std::size_t predictor_fit_scratch_bytes = 3 * predictor_fit_groups * sizeof(float);

// dst = src (n floats): the weight before the optimizer updates it.
LaunchList predictor_snapshot(OpEnv& env, DeviceSpan src, DeviceSpan dst, std::size_t n);
// The fit after the optimizer update: st from (w, before, d), then d smoothed. `scratch` holds
// predictor_fit_scratch_bytes. With `guard` (the step's loss) not finite, nothing changes.
LaunchList predictor_fit(OpEnv& env, const PredictorConfig& c, DeviceSpan w, DeviceSpan before, DeviceSpan d,
                         DeviceSpan st, DeviceSpan scratch, std::size_t n, DeviceSpan guard = {});
// Predict: w += StepInfo::predict_scale * st[gain] d; nothing when `guard` is not finite.
LaunchList predictor_apply(OpEnv& env, DeviceSpan w, DeviceSpan d, DeviceSpan st, std::size_t n, DeviceSpan guard = {});

namespace ref {

template <class T>
void predictor_fit(const PredictorConfig& c, std::span<const T> w, std::span<const T> before, std::span<T> d,
                   std::span<T> st) {
  T a = 0, b = 0, e = 0;
  for (std::size_t i = 0; i < w.size(); ++i) {
    const T delta = w[i] - before[i];
    a += delta * d[i];
    b += d[i] * d[i];
    e += delta * delta;
  }
  st[predictor_stat_delta_d] = a;
  st[predictor_stat_d_d] = b;
  st[predictor_stat_delta_delta] = e;
  T gain = 1;
  if (c.kind == PredictorConfig::Kind::least_squares && b > 0) {
    const T fitted = std::clamp(a / b, T(0), T(c.max_gain));
    gain = T(c.beta) * st[predictor_stat_gain] + (1 - T(c.beta)) * fitted;
  }
  st[predictor_stat_gain] = gain;
  for (std::size_t i = 0; i < w.size(); ++i) d[i] = T(c.beta) * d[i] + (1 - T(c.beta)) * (w[i] - before[i]);
}

template <class T>
void predictor_apply(std::span<T> w, std::span<const T> d, std::span<const T> st, T scale = 1) {
  for (std::size_t i = 0; i < w.size(); ++i) w[i] += scale * st[predictor_stat_gain] * d[i];
}

}  // namespace ref
}  // namespace ferry::ops
