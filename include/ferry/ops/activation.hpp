// Elementwise activations: ReLU and GELU (the erf form, x Phi(x); the kernel evaluates erf with a
// rational approximation accurate to 1.5e-7, the reference with std::erf).
#pragma once

#include <cmath>
#include <cstddef>
#include <span>

#include "ferry/ops/launch.hpp"
#include "ferry/ops/types.hpp"

namespace ferry::ops {

enum class Activation : std::uint8_t { relu, gelu };

// The storage types the activation kernels accept (all operands share one); arithmetic is fp32,
// results are rounded to nearest even into f16 or bf16.
inline constexpr DTypeSet activation_dtypes{DType::f32, DType::f16, DType::bf16};

// y = act(x) and dx = dy * act'(x), every operand of storage type `dtype`; throws
// std::invalid_argument for a dtype outside activation_dtypes.
LaunchList activation_forward(OpEnv& env, Activation a, DeviceSpan x, DeviceSpan y, std::size_t n,
                              DType dtype = DType::f32);
LaunchList activation_backward(OpEnv& env, Activation a, DeviceSpan x, DeviceSpan dy, DeviceSpan dx, std::size_t n,
                               DType dtype = DType::f32);

namespace ref {

template <class T>
void activation_forward(Activation a, std::span<const T> x, std::span<T> y) {
  for (std::size_t i = 0; i < x.size(); ++i) {
    const T v = x[i];
    y[i] = a == Activation::relu ? (v > T(0) ? v : T(0)) : T(0.5) * v * (T(1) + std::erf(v / std::sqrt(T(2))));
  }
}

template <class T>
void activation_backward(Activation a, std::span<const T> x, std::span<const T> dy, std::span<T> dx) {
  for (std::size_t i = 0; i < x.size(); ++i) {
    const T v = x[i];
    if (a == Activation::relu) {
      dx[i] = v > T(0) ? dy[i] : T(0);
    } else {
      const T cdf = T(0.5) * (T(1) + std::erf(v / std::sqrt(T(2))));
      const T pdf = std::exp(-T(0.5) * v * v) / std::sqrt(T(2) * T(M_PI));
      dx[i] = dy[i] * (cdf + v * pdf);
    }
  }
}

}  // namespace ref
}  // namespace ferry::ops
