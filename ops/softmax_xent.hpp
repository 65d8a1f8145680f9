// Fused softmax + cross-entropy over logits [rows, classes] with int32 class labels.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>

#include "ferry/ops/launch.hpp"

namespace ferry::ops {

// lse[r] = log sum_c exp(logits[r, c]) per row (max-subtracted); stats[0] = mean over rows of
// -log softmax(logits)[label] = lse - logits[label]; stats[1] = number of rows whose argmax is the
// label. Nothing of size [rows, classes] is written: the backward recomputes the probabilities
// from the logits and lse, so a large vocabulary costs no probability tensor. `labels` is an int32
// buffer (offset in int32 elements). A label outside [0, classes) makes the loss NaN, which the
// trainer reports as bad input.
//
// The argmax takes the first index among equal maxima. The loss stays finite where the label's
// probability underflows to 0. Both reductions are deterministic (fixed order, no atomics); stats
// are computed by a single work-group, cheap next to the row pass for classification heads.
LaunchList softmax_xent_forward(OpEnv& env, DeviceSpan logits, DeviceSpan labels, DeviceSpan lse, DeviceSpan stats,
                                std::size_t rows, std::size_t classes);
// dlogits = scale * (exp(logits - lse) - onehot(label)) / rows  (the gradient of the mean loss,
// times scale). A row whose label is outside [0, classes) gets NaN gradients, so bad input cannot
// train silently. dlogits may be logits' memory.
LaunchList softmax_xent_backward(OpEnv& env, DeviceSpan logits, DeviceSpan lse, DeviceSpan labels, DeviceSpan dlogits,
                                 std::size_t rows, std::size_t classes, float scale = 1.0f);

namespace ref {

// stats has two elements: the mean loss and the count of rows whose argmax is the label.
template <class T>
void softmax_xent_forward(std::span<const T> logits, std::span<const std::int32_t> labels, std::span<T> lse,
                          std::span<T> stats, std::size_t rows, std::size_t classes) {
  T loss = T(0), correct = T(0);
  for (std::size_t r = 0; r < rows; ++r) {
    const T* x = logits.data() + r * classes;
    std::size_t best = 0;
    for (std::size_t c = 1; c < classes; ++c)
      if (x[c] > x[best]) best = c;
    const T m = x[best];
    T s = T(0);
    for (std::size_t c = 0; c < classes; ++c) s += std::exp(x[c] - m);
    lse[r] = m + std::log(s);
    const std::int32_t label = labels[r];
    if (label < 0 || static_cast<std::size_t>(label) >= classes) {
      loss += std::numeric_limits<T>::quiet_NaN();
      continue;
    }
    loss += std::log(s) + m - x[label];
    if (static_cast<std::size_t>(label) == best) correct += T(1);
  }
  stats[0] = loss / T(rows);
  stats[1] = correct;
}

// dlogits = scale * (exp(logits - lse) - onehot(label)) / rows; NaN rows for labels outside [0, classes).
template <class T>
void softmax_xent_backward(std::span<const T> logits, std::span<const T> lse, std::span<const std::int32_t> labels,
                           std::span<T> dlogits, std::size_t rows, std::size_t classes, T scale = T(1)) {
  for (std::size_t r = 0; r < rows; ++r) {
    const std::int32_t label = labels[r];
    const bool valid = label >= 0 && static_cast<std::size_t>(label) < classes;
    for (std::size_t c = 0; c < classes; ++c) {
      const T onehot = valid && static_cast<std::size_t>(label) == c ? T(1) : T(0);
      const T p = std::exp(logits[r * classes + c] - lse[r]);
      dlogits[r * classes + c] = valid ? scale * (p - onehot) / T(rows) : std::numeric_limits<T>::quiet_NaN();
    }
  }
}

}  // namespace ref
}  // namespace ferry::ops
