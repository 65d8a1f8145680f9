// Elementwise utilities the graph needs: sums (residual connections, gradient accumulation),
// fills (zeroing accumulators) and copies.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>

#include "ferry/ops/launch.hpp"
#include "ferry/ops/types.hpp"

namespace ferry::ops {

// The storage types add accepts (all three operands share one): the sum is fp32, rounded to
// nearest even into f16 or bf16.
inline constexpr DTypeSet add_dtypes{DType::f32, DType::f16, DType::bf16};

// out = a + b (out may alias a or b), every operand of storage type `dtype`; throws
// std::invalid_argument for a dtype outside add_dtypes.
LaunchList add(OpEnv& env, DeviceSpan a, DeviceSpan b, DeviceSpan out, std::size_t n, DType dtype = DType::f32);
// out = value.
LaunchList fill(OpEnv& env, DeviceSpan out, float value, std::size_t n);
// out = in.
LaunchList copy(OpEnv& env, DeviceSpan in, DeviceSpan out, std::size_t n);

namespace ref {

// The gradient of add with respect to either input is dy, so add needs no backward rule.
template <class T>
void add(std::span<const T> a, std::span<const T> b, std::span<T> out) {
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = a[i] + b[i];
}

template <class T>
void fill(std::span<T> out, T value) {
  std::fill(out.begin(), out.end(), value);
}

template <class T>
void copy(std::span<const T> in, std::span<T> out) {
  std::copy(in.begin(), in.end(), out.begin());
}

}  // namespace ref
}  // namespace ferry::ops
