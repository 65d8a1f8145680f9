// 2-D max pooling over NCHW, square window and stride, no padding.
//
// Forward is one work-item per output and records the argmax; backward is one work-item per
// input element that gathers dy over every window containing it whose argmax is that element, so
// overlapping windows (window > stride) are handled without atomics and deterministically.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "ferry/ops/launch.hpp"
#include "ferry/ops/types.hpp"

namespace ferry::ops {

struct Pool2dShape {
  std::size_t N = 0, C = 0, H = 0, W = 0;
  std::size_t window = 2, stride = 2;
  DType dtype = DType::f32;  // of x, y and their gradients (f32, f16, bf16)
  // ReLU fused in (a graph pass rewrites relu -> maxpool into this): y = max(0, max over the
  // window), equal to the max of the ReLU'd window. A window whose maximum is not positive gets
  // argmax -1, so backward routes it nothing: the ReLU's mask and the pool's backward in one pass.
  bool relu = false;
  std::size_t P() const { return (H - window) / stride + 1; }
  std::size_t Q() const { return (W - window) / stride + 1; }
};

// y[N,C,P,Q] = max over each window; argmax (int32, same shape as y) records the flat input
// index (within the N,C plane) of each maximum for backward (-1: none, with relu).
LaunchList maxpool2d_forward(OpEnv& env, const Pool2dShape& s, DeviceSpan x, DeviceSpan y, DeviceSpan argmax);
// dx[N,C,H,W] (overwritten) from dy and argmax; correct for overlapping windows too.
LaunchList maxpool2d_backward(OpEnv& env, const Pool2dShape& s, DeviceSpan dy, DeviceSpan argmax, DeviceSpan dx);

// CPU references, for tests; T is float or double. Ties go to the first maximum in row-major
// window order, as on the device.
namespace ref {

template <class T>
void maxpool2d_forward(const Pool2dShape& s, std::span<const T> x, std::span<T> y, std::span<std::int32_t> argmax) {
  const std::size_t P = s.P(), Q = s.Q();
  for (std::size_t nc = 0; nc < s.N * s.C; ++nc) {
    const T* plane = x.data() + nc * s.H * s.W;
    for (std::size_t p = 0; p < P; ++p) {
      for (std::size_t q = 0; q < Q; ++q) {
        std::size_t best = p * s.stride * s.W + q * s.stride;
        for (std::size_t i = 0; i < s.window; ++i) {
          for (std::size_t j = 0; j < s.window; ++j) {
            const std::size_t idx = (p * s.stride + i) * s.W + q * s.stride + j;
            if (plane[idx] > plane[best]) best = idx;
          }
        }
        const bool positive = plane[best] > T(0);  // false for NaN, as the ReLU's x > 0
        y[(nc * P + p) * Q + q] = s.relu && !positive ? T(0) : plane[best];
        argmax[(nc * P + p) * Q + q] = s.relu && !positive ? -1 : static_cast<std::int32_t>(best);
      }
    }
  }
}

template <class T>
void maxpool2d_backward(const Pool2dShape& s, std::span<const T> dy, std::span<const std::int32_t> argmax,
                        std::span<T> dx) {
  const std::size_t P = s.P(), Q = s.Q();
  for (auto& v : dx) v = T(0);
  for (std::size_t nc = 0; nc < s.N * s.C; ++nc) {
    for (std::size_t pq = 0; pq < P * Q; ++pq) {
      const std::int32_t at = argmax[nc * P * Q + pq];
      if (at >= 0) dx[nc * s.H * s.W + static_cast<std::size_t>(at)] += dy[nc * P * Q + pq];
    }
  }
}

}  // namespace ref
}  // namespace ferry::ops
