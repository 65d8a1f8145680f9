// The overflow guard of loss-scaled mixed precision: one scalar that the optimizer updates check
// in place of the loss, non-finite when the loss is or when any weight gradient overflowed.
//
// With fp16 gradients scaled by StepInfo::loss_scale, a scale too large for this step makes some
// of them inf or NaN. Every update of the step must then be skipped together (and the scale
// lowered by the trainer), not only those whose own gradient overflowed: so the guard reads all
// weight gradients, and the updates wait for it.
//
//   guard = loss (stats[0])  if every element of every gradient is finite
//           NaN              otherwise
#pragma once

#include <cmath>
#include <cstddef>
#include <limits>
#include <span>

#include "ferry/ops/launch.hpp"

namespace ferry::ops {

// `stats` holds the loss at element 0; `gradients` are f32 spans of the given element counts.
// Launches: the guard set to the loss, then one pass per gradient that sets it to NaN on a
// non-finite element (an atomic exchange: every writer writes the same NaN).
LaunchList overflow_guard(OpEnv& env, DeviceSpan stats, std::span<const DeviceSpan> gradients,
                          std::span<const std::size_t> elems, DeviceSpan guard);

namespace ref {

template <class T>
T overflow_guard(T loss, std::span<const std::span<const T>> gradients) {
  for (const auto& g : gradients) {
    for (T v : g) {
      if (!std::isfinite(v)) return std::numeric_limits<T>::quiet_NaN();
    }
  }
  return loss;
}

}  // namespace ref
}  // namespace ferry::ops
