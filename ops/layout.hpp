// Layout and elementwise ops for transformers: permute (a materialised transpose of up to four
// axes), the elementwise product of two tensors and scaling by a constant.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "ferry/ops/launch.hpp"
#include "ferry/ops/types.hpp"

namespace ferry::ops {

// The storage types permute copies (bit for bit). mul and scale are f32.
inline constexpr DTypeSet permute_dtypes{DType::f32, DType::f16, DType::bf16};

// Why `perm` (its first x.rank entries) is not a permutation of the axes of x, or "" when it is
// one. Permute takes rank 2 to 4.
std::string permutation_error(const Shape& x, std::span<const std::int32_t> perm);
// y.shape[k] = x.shape[perm[k]]. Throws std::invalid_argument with permutation_error's message.
Shape permuted_shape(const Shape& x, std::span<const std::int32_t> perm);
// The inverse permutation (inv[perm[k]] = k) in the first `rank` entries, zeros after.
std::array<std::int32_t, 4> inverse_permutation(std::span<const std::int32_t> perm, std::size_t rank);

// y = x with its axes reordered: y[i_0, .., i_{r-1}] = x[j] where j[perm[k]] = i_k. One work-item
// per element of y, in y's order, so the writes are coalesced. Elements of storage type `dtype`
// (permute_dtypes), copied bit for bit. Throws std::invalid_argument for a bad permutation.
LaunchList permute(OpEnv& env, DeviceSpan x, DeviceSpan y, const Shape& x_shape, std::span<const std::int32_t> perm,
                   DType dtype = DType::f32);
// out = a * b elementwise (fp32).
LaunchList mul(OpEnv& env, DeviceSpan a, DeviceSpan b, DeviceSpan out, std::size_t n);
// y = x * factor (fp32).
LaunchList scale(OpEnv& env, DeviceSpan x, DeviceSpan y, float factor, std::size_t n);

namespace ref {

// As ops::permute. The gradient of permute is permute by the inverse permutation.
template <class T>
void permute(std::span<const T> x, std::span<T> y, const Shape& x_shape, std::span<const std::int32_t> perm) {
  const Shape ys = permuted_shape(x_shape, perm);
  const std::size_t r = x_shape.rank;
  std::array<std::size_t, 4> xstride{};
  std::size_t s = 1;
  for (std::size_t k = r; k-- > 0;) {
    xstride[k] = s;
    s *= x_shape[k];
  }
  std::array<std::size_t, 4> idx{};  // y's multi-index, row-major
  for (std::size_t i = 0; i < y.size(); ++i) {
    std::size_t src = 0;
    for (std::size_t k = 0; k < r; ++k) src += idx[k] * xstride[static_cast<std::size_t>(perm[k])];
    y[i] = x[src];
    for (std::size_t k = r; k-- > 0;) {
      if (++idx[k] < ys[k]) break;
      idx[k] = 0;
    }
  }
}

// out = a * b; the gradients are da = dy * b and db = dy * a.
template <class T>
void mul(std::span<const T> a, std::span<const T> b, std::span<T> out) {
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = a[i] * b[i];
}

// y = x * factor; the gradient is dx = dy * factor.
template <class T>
void scale(std::span<const T> x, T factor, std::span<T> y) {
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = x[i] * factor;
}

}  // namespace ref
}  // namespace ferry::ops
