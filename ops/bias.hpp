// Bias over the rows of a [rows, cols] matrix: forward adds b[cols] to every row in place;
// backward sums the rows of dy into db.
#pragma once

#include <cstddef>
#include <span>

#include "ferry/ops/launch.hpp"
#include "ferry/ops/types.hpp"

namespace ferry::ops {

LaunchList bias_forward(OpEnv& env, DeviceSpan y, DeviceSpan b, std::size_t rows, std::size_t cols);
// db = sum over rows of dy (overwrites db); dy stored as dy_type (f32, f16, bf16), db f32, sums in
// fp32. Deterministic: the same inputs give the same bits on
// every run (a fixed summation order, no atomics). With a guard (ops/overflow_guard.hpp), a sum
// that is not finite sets it to NaN, as overflow_guard_check over db would.
LaunchList bias_backward(OpEnv& env, DeviceSpan dy, DeviceSpan db, std::size_t rows, std::size_t cols,
                         DType dy_type = DType::f32, DeviceSpan guard = {});

namespace ref {

// y[r, c] += b[c] for y of [rows, cols], row-major.
template <class T>
void bias_forward(std::span<T> y, std::span<const T> b, std::size_t rows, std::size_t cols) {
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) y[r * cols + c] += b[c];
}

// db[c] = sum over r of dy[r, c].
template <class T>
void bias_backward(std::span<const T> dy, std::span<T> db, std::size_t rows, std::size_t cols) {
  for (std::size_t c = 0; c < cols; ++c) db[c] = T(0);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) db[c] += dy[r * cols + c];
}

}  // namespace ref
}  // namespace ferry::ops
