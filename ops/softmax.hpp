// Softmax over the last axis, viewed as [rows, cols]: y = exp(x - max) / sum exp(x - max) per row.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>

#include "ferry/ops/launch.hpp"

namespace ferry::ops {

// Writes y (f32, like x). Numerically stable: the row maximum is subtracted before exp, so large
// logits do not overflow; -inf entries (masked positions) give 0. A row whose entries are all
// -inf gives NaN, as in PyTorch. y may be x's memory.
// causal: the rows are those of square [cols, cols] matrices of attention scores and row i of each
// keeps columns 0..i, the rest 0: softmax(causal_mask(x)) in one pass (rows a multiple of cols).
LaunchList softmax_forward(OpEnv& env, DeviceSpan x, DeviceSpan y, std::size_t rows, std::size_t cols,
                           bool causal = false);
// dx = y (dy - sum(dy y, last axis)), from the forward's output y. dx may be dy's memory.
LaunchList softmax_backward(OpEnv& env, DeviceSpan y, DeviceSpan dy, DeviceSpan dx, std::size_t rows, std::size_t cols);

namespace ref {

template <class T>
void softmax_forward(std::span<const T> x, std::span<T> y, std::size_t rows, std::size_t cols, bool causal = false) {
  for (std::size_t r = 0; r < rows; ++r) {
    const T* xr = x.data() + r * cols;
    T* yr = y.data() + r * cols;
    const std::size_t valid = causal ? std::min(cols, r % cols + 1) : cols;
    T m = -std::numeric_limits<T>::infinity();
    for (std::size_t c = 0; c < valid; ++c) m = std::max(m, xr[c]);
    T s = T(0);
    for (std::size_t c = 0; c < valid; ++c) s += (yr[c] = std::exp(xr[c] - m));
    for (std::size_t c = 0; c < valid; ++c) yr[c] /= s;
    for (std::size_t c = valid; c < cols; ++c) yr[c] = T(0);
  }
}

template <class T>
void softmax_backward(std::span<const T> y, std::span<const T> dy, std::span<T> dx, std::size_t rows,
                      std::size_t cols) {
  for (std::size_t r = 0; r < rows; ++r) {
    const std::size_t o = r * cols;
    T s = T(0);
    for (std::size_t c = 0; c < cols; ++c) s += dy[o + c] * y[o + c];
    for (std::size_t c = 0; c < cols; ++c) dx[o + c] = y[o + c] * (dy[o + c] - s);
  }
}

}  // namespace ref
}  // namespace ferry::ops
