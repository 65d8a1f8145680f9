// The overflow guard: one scalar that a training step's state updates (optimizer, gradient
// accumulation, predictor fits) check in place of the loss, non-finite when the loss is or when
// any weight gradient has an element the updates cannot take: not finite, or finite but of
// gradient_limit (2^64) or more in magnitude, whose square (Adam's second moment) would be inf.
//
// With fp16 gradients scaled by StepInfo::loss_scale, a scale too large for this step makes some
// of them inf or NaN; in any precision a gradient can overflow. Every update of the step must then
// be skipped together, not only those whose own gradient is not finite: so the guard reads all
// weight gradients, and the updates wait for it. It is two kinds of node, so that no step needs
// every gradient alive at once: one init after the loss, then one check per gradient, each right
// after its gradient is made, or made by the node that makes the gradient (a Linear's weight
// gradient product checks it in its epilogue: GemmOptions::guard, graph::fuse_guard_checks).
//
//   init:   guard = loss (stats[0])
//   check:  guard = NaN  if an element of the gradient is not usable_gradient, else unchanged
#pragma once

#include <cmath>
#include <cstddef>
#include <limits>
#include <span>

#include "ferry/ops/cast.hpp"
#include "ferry/ops/launch.hpp"

namespace ferry::ops {

// The gradient magnitude the updates take, exclusive (GUARD_LIMIT in ops/kernels/guard.clh): a
// finite gradient of 2^64 or more squares past the largest float, so Adam's second moment would
// turn inf and its weight never move again. The guard stops such a step's updates as it stops an
// overflowed one, and the state stays as it was.
inline constexpr float gradient_limit = 0x1p64f;

// Whether the updates take gradient value `v` (NaN compares false).
template <class T>
bool usable_gradient(T v) {
  return std::fabs(v) < static_cast<T>(gradient_limit);
}

// `stats` holds the loss at element 0.
LaunchList overflow_guard_init(OpEnv& env, DeviceSpan stats, DeviceSpan guard);
// `gradient` is an f32 span of `elems` elements. Sets the guard to NaN on an element that is not
// usable_gradient (an atomic exchange: every writer writes the same NaN).
LaunchList overflow_guard_check(OpEnv& env, DeviceSpan gradient, std::size_t elems, DeviceSpan guard);

// `gradient` is an f16 or bf16 span (`dtype`) of `elems` elements, checked as the f32 values the
// cast that widens it makes: each element times cast_factor(scale, step), the step's factor set at
// enqueue. Throws std::invalid_argument for another dtype.
LaunchList overflow_guard_check_scaled(OpEnv& env, DType dtype, DeviceSpan gradient, std::size_t elems, CastScale scale,
                                       DeviceSpan guard);

// On the host (a sum a data-parallel reduction left in pinned host memory, checked there): whether
// every element is usable_gradient, on all cores.
bool all_usable_host(std::span<const float> values);

namespace ref {

template <class T>
T overflow_guard_check(T guard, std::span<const T> gradient) {
  for (T v : gradient) {
    if (!usable_gradient(v)) return std::numeric_limits<T>::quiet_NaN();
  }
  return guard;
}

// A narrow gradient's check: its values (as the reference holds them, rounded to their dtype) times
// the widening cast's factor, in float as the kernels compute them.
template <class T>
T overflow_guard_check_scaled(T guard, std::span<const T> gradient, float factor) {
  for (T v : gradient) {
    if (!usable_gradient(static_cast<float>(v) * factor)) return std::numeric_limits<T>::quiet_NaN();
  }
  return guard;
}

// The guard after the init and a check of each gradient.
template <class T>
T overflow_guard(T loss, std::span<const std::span<const T>> gradients) {
  for (const auto& g : gradients) loss = overflow_guard_check<T>(loss, g);
  return loss;
}

}  // namespace ref
}  // namespace ferry::ops
