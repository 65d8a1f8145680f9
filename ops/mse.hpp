// Mean squared error between a prediction p and a target t of the same shape (fp32), a loss.
#pragma once

#include <cstddef>
#include <span>

#include "ferry/ops/launch.hpp"

namespace ferry::ops {

// stats[0] = mean over the n elements of (p - t)^2. A non-finite p or t makes it non-finite (the
// trainer's divergence check sees it). Deterministic: one work-group, each work-item sums a fixed
// strided subset in order, then a fixed tree combines them (reduce.clh); like softmax_xent's
// statistics, one work-group is cheap next to the model that produced p. Throws
// std::invalid_argument for n = 0 or n >= 2^32.
LaunchList mse_forward(OpEnv& env, DeviceSpan p, DeviceSpan t, DeviceSpan stats, std::size_t n);
// dp = scale 2 (p - t) / n: the gradient of the mean, times the loss's weight in the step's loss.
// MSE does not differentiate its target (which would be -dp).
LaunchList mse_backward(OpEnv& env, DeviceSpan p, DeviceSpan t, DeviceSpan dp, std::size_t n, float scale = 1.0f);

namespace ref {

// stats has one element.
template <class T>
void mse_forward(std::span<const T> p, std::span<const T> t, std::span<T> stats) {
  T s = T(0);
  for (std::size_t i = 0; i < p.size(); ++i) {
    const T d = p[i] - t[i];
    s += d * d;
  }
  stats[0] = s / T(p.size());
}

template <class T>
void mse_backward(std::span<const T> p, std::span<const T> t, std::span<T> dp, T scale = T(1)) {
  const T coef = T(2) * scale / T(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) dp[i] = coef * (p[i] - t[i]);
}

}  // namespace ref
}  // namespace ferry::ops
