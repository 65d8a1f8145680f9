// 2-D max pooling over NCHW, square window and stride, no padding.
#pragma once

#include "ferry/ops/launch.hpp"

namespace ferry::ops {

struct Pool2dShape {
  std::size_t N = 0, C = 0, H = 0, W = 0;
  std::size_t window = 2, stride = 2;
  std::size_t P() const { return (H - window) / stride + 1; }
  std::size_t Q() const { return (W - window) / stride + 1; }
};

// y[N,C,P,Q] = max over each window; argmax (int32, same shape as y) records the flat input
// index (within the N,C plane) of each maximum for backward.
LaunchList maxpool2d_forward(OpEnv& env, const Pool2dShape& s, DeviceSpan x, DeviceSpan y, DeviceSpan argmax);
// dx[N,C,H,W] (overwritten) from dy and argmax; correct for overlapping windows too.
LaunchList maxpool2d_backward(OpEnv& env, const Pool2dShape& s, DeviceSpan dy, DeviceSpan argmax, DeviceSpan dx);

}  // namespace ferry::ops
