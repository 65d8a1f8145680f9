// Optimizer updates, one pass over (weight, gradient, state) per kernel. The learning rate and
// the step count come from StepInfo at enqueue time, so schedules need no re-binding.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

#include "ferry/ops/launch.hpp"

namespace ferry::ops {

struct SgdConfig {
  float momentum = 0.9f;
  float weight_decay = 0.0f;  // L2, added to the gradient
  bool nesterov = false;
};

struct AdamConfig {
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  float weight_decay = 0.0f;
  bool decoupled_weight_decay = false;  // true: AdamW (w -= lr * wd * w), false: L2 into the gradient
};

// Which optimizer a step's update nodes run, with its settings (read by the update rows).
struct OptimizerConfig {
  enum class Kind : std::uint8_t { sgd, adam, adamw } kind = Kind::adam;
  SgdConfig sgd;
  AdamConfig adam;
  // `adam` with decoupled weight decay set for AdamW.
  AdamConfig adam_config() const {
    AdamConfig c = adam;
    c.decoupled_weight_decay = kind == Kind::adamw;
    return c;
  }
};
const char* optimizer_name(OptimizerConfig::Kind k);

// velocity = momentum * velocity + (g + wd * w); w -= lr * (nesterov ? g' + momentum * velocity : velocity)
// `guard` (optional): a float on the device, the step's loss; when it is not finite the update
// does nothing, so a diverged step leaves weights and state as they were.
LaunchList sgd_update(OpEnv& env, const SgdConfig& c, DeviceSpan w, DeviceSpan g, DeviceSpan velocity, std::size_t n,
                      DeviceSpan guard = {});
// Adam / AdamW with bias correction by StepInfo::step.
// g' = g + wd w (L2 only); m = beta1 m + (1 - beta1) g'; v = beta2 v + (1 - beta2) g'^2;
// w -= lr (m / (1 - beta1^t) / (sqrt(v / (1 - beta2^t)) + eps) + wd w (AdamW only)), t = step.
// Enqueueing with StepInfo::step == 0 throws std::invalid_argument (the correction is undefined).
LaunchList adam_update(OpEnv& env, const AdamConfig& c, DeviceSpan w, DeviceSpan g, DeviceSpan m, DeviceSpan v,
                       std::size_t n, DeviceSpan guard = {});

namespace ref {

template <class T>
void sgd_update(const SgdConfig& c, const StepInfo& s, std::span<T> w, std::span<const T> g, std::span<T> velocity) {
  const T lr = T(s.lr), momentum = T(c.momentum), wd = T(c.weight_decay);
  for (std::size_t i = 0; i < w.size(); ++i) {
    const T gi = g[i] + wd * w[i];
    velocity[i] = momentum * velocity[i] + gi;
    w[i] -= lr * (c.nesterov ? gi + momentum * velocity[i] : velocity[i]);
  }
}

template <class T>
void adam_update(const AdamConfig& c, const StepInfo& s, std::span<T> w, std::span<const T> g, std::span<T> m,
                 std::span<T> v) {
  const T lr = T(s.lr), b1 = T(c.beta1), b2 = T(c.beta2), eps = T(c.eps), wd = T(c.weight_decay);
  const T bc1 = T(1) - std::pow(b1, T(s.step)), bc2 = T(1) - std::pow(b2, T(s.step));
  for (std::size_t i = 0; i < w.size(); ++i) {
    const T gi = c.decoupled_weight_decay ? g[i] : g[i] + wd * w[i];
    m[i] = b1 * m[i] + (T(1) - b1) * gi;
    v[i] = b2 * v[i] + (T(1) - b2) * gi * gi;
    const T update = (m[i] / bc1) / (std::sqrt(v[i] / bc2) + eps);
    w[i] -= lr * (update + (c.decoupled_weight_decay ? wd * w[i] : T(0)));
  }
}

}  // namespace ref
}  // namespace ferry::ops
