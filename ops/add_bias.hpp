// A bias broadcast over the leading axes: y = x + b where b's shape is the trailing dims of x's,
// e.g. a learned positional embedding [T, W] added to [B, T, W] activations, or a bias over the
// last axis. Viewed as x [rows, cols] with cols = b's elements, every row gets b added (fp32).
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "ferry/ops/launch.hpp"
#include "ferry/ops/types.hpp"
#include "ops/bias.hpp"

namespace ferry::ops {

// Why b cannot be added to x (b's rank is 0 or above x's, or its dims are not x's last b.rank
// dims), or "" when it can. The message names both shapes.
std::string add_bias_error(const Shape& x, const Shape& b);

// y[r, c] = x[r, c] + b[c] for x and y of [rows, cols] and b of [cols], one work-item per element
// of y. y may be x (in place).
LaunchList add_bias_forward(OpEnv& env, DeviceSpan x, DeviceSpan b, DeviceSpan y, std::size_t rows, std::size_t cols);
// db = sum over rows of dy (overwrites db): ops::bias_backward, deterministic. The gradient of x
// is dy itself, which needs no launch.
LaunchList add_bias_backward(OpEnv& env, DeviceSpan dy, DeviceSpan db, std::size_t rows, std::size_t cols);

namespace ref {

template <class T>
void add_bias_forward(std::span<const T> x, std::span<const T> b, std::span<T> y, std::size_t rows, std::size_t cols) {
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) y[r * cols + c] = x[r * cols + c] + b[c];
}

// db[c] = sum over r of dy[r, c], in row order.
template <class T>
void add_bias_backward(std::span<const T> dy, std::span<T> db, std::size_t rows, std::size_t cols) {
  bias_backward<T>(dy, db, rows, cols);
}

}  // namespace ref
}  // namespace ferry::ops
