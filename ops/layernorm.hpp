// LayerNorm over the last dimension of [rows, cols]: y = (x - mean) * rstd * gamma + beta.
#pragma once

#include <cmath>
#include <cstddef>
#include <span>

#include "ferry/ops/launch.hpp"
#include "ferry/ops/types.hpp"

namespace ferry::ops {

// Writes y and the per-row mean and rstd = 1/sqrt(var + eps) that backward reuses. The variance
// is the biased one (divided by cols), computed in two passes (mean, then centred squares).
// With a residual (a and b given, both or neither): x is an output, x = a + b, normalised in the
// same pass (add_layernorm: a residual stream's add and the LayerNorm that reads it). y is stored
// as `y_dtype` and b read as `b_dtype` (f32, f16 or bf16; the rest f32): y the f32 result rounded
// to nearest even, the bits the cast kernel makes of an f32 y; b widened exactly.
LaunchList layernorm_forward(OpEnv& env, DeviceSpan x, DeviceSpan gamma, DeviceSpan beta, DeviceSpan y, DeviceSpan mean,
                             DeviceSpan rstd, std::size_t rows, std::size_t cols, float eps = 1e-5f, DeviceSpan a = {},
                             DeviceSpan b = {}, DType y_dtype = DType::f32, DType b_dtype = DType::f32);
// Writes dx, dgamma, dbeta (all overwritten). All reductions are deterministic (fixed order).
// dres, when given: added to dx (the gradient a residual sum gets from its other readers). guard,
// when given (ops/overflow_guard.hpp): set to NaN when a dgamma or dbeta element is not finite.
LaunchList layernorm_backward(OpEnv& env, DeviceSpan x, DeviceSpan gamma, DeviceSpan mean, DeviceSpan rstd,
                              DeviceSpan dy, DeviceSpan dx, DeviceSpan dgamma, DeviceSpan dbeta, std::size_t rows,
                              std::size_t cols, DeviceSpan dres = {}, DeviceSpan guard = {});

namespace ref {

template <class T>
void layernorm_forward(std::span<const T> x, std::span<const T> gamma, std::span<const T> beta, std::span<T> y,
                       std::span<T> mean, std::span<T> rstd, std::size_t rows, std::size_t cols, T eps = T(1e-5)) {
  for (std::size_t r = 0; r < rows; ++r) {
    const T* xr = x.data() + r * cols;
    T s = T(0);
    for (std::size_t c = 0; c < cols; ++c) s += xr[c];
    const T mu = s / T(cols);
    T q = T(0);
    for (std::size_t c = 0; c < cols; ++c) q += (xr[c] - mu) * (xr[c] - mu);
    const T rs = T(1) / std::sqrt(q / T(cols) + eps);
    for (std::size_t c = 0; c < cols; ++c) y[r * cols + c] = (xr[c] - mu) * rs * gamma[c] + beta[c];
    mean[r] = mu;
    rstd[r] = rs;
  }
}

// With xhat = (x - mean) rstd and g = dy gamma: dx = rstd (g - mean(g) - xhat mean(g xhat)),
// dgamma = sum over rows of dy xhat, dbeta = sum over rows of dy.
template <class T>
void layernorm_backward(std::span<const T> x, std::span<const T> gamma, std::span<const T> mean,
                        std::span<const T> rstd, std::span<const T> dy, std::span<T> dx, std::span<T> dgamma,
                        std::span<T> dbeta, std::size_t rows, std::size_t cols) {
  for (std::size_t c = 0; c < cols; ++c) dgamma[c] = dbeta[c] = T(0);
  for (std::size_t r = 0; r < rows; ++r) {
    const std::size_t o = r * cols;
    T sg = T(0), sgx = T(0);
    for (std::size_t c = 0; c < cols; ++c) {
      const T xhat = (x[o + c] - mean[r]) * rstd[r];
      const T g = dy[o + c] * gamma[c];
      sg += g;
      sgx += g * xhat;
      dgamma[c] += dy[o + c] * xhat;
      dbeta[c] += dy[o + c];
    }
    const T mean_g = sg / T(cols), mean_gx = sgx / T(cols);
    for (std::size_t c = 0; c < cols; ++c) {
      const T xhat = (x[o + c] - mean[r]) * rstd[r];
      dx[o + c] = rstd[r] * (dy[o + c] * gamma[c] - mean_g - xhat * mean_gx);
    }
  }
}

}  // namespace ref
}  // namespace ferry::ops
