// Optimizer updates, one pass over (weight, gradient, state) per kernel. The learning rate and
// the step count come from StepInfo at enqueue time, so schedules need no re-binding.
#pragma once

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

// velocity = momentum * velocity + (g + wd * w); w -= lr * (nesterov ? g' + momentum * velocity : velocity)
LaunchList sgd_update(OpEnv& env, const SgdConfig& c, DeviceSpan w, DeviceSpan g, DeviceSpan velocity, std::size_t n);
// Adam / AdamW with bias correction by StepInfo::step.
LaunchList adam_update(OpEnv& env, const AdamConfig& c, DeviceSpan w, DeviceSpan g, DeviceSpan m, DeviceSpan v,
                       std::size_t n);

}  // namespace ferry::ops
