// 2-D convolution, NCHW activations and KCRS weights, square stride and zero padding.
#pragma once

#include "ferry/ops/launch.hpp"

namespace ferry::ops {

struct Conv2dShape {
  std::size_t N = 0, C = 0, H = 0, W = 0;  // input
  std::size_t K = 0, R = 0, S = 0;         // output channels, kernel height and width
  std::size_t stride = 1, pad = 0;
  std::size_t P() const { return (H + 2 * pad - R) / stride + 1; }  // output height
  std::size_t Q() const { return (W + 2 * pad - S) / stride + 1; }  // output width
};

// Scratch in floats needed by the forward and both backward launches (the max of the three).
std::size_t conv2d_scratch_elems(OpEnv& env, const Conv2dShape& s);

// y[N,K,P,Q] = conv(x, w) + bias[K] (bias optional: buffer null).
LaunchList conv2d_forward(OpEnv& env, const Conv2dShape& s, DeviceSpan x, DeviceSpan w, DeviceSpan bias, DeviceSpan y,
                          DeviceSpan scratch);
// dx[N,C,H,W] from dy and w (overwrites dx).
LaunchList conv2d_backward_data(OpEnv& env, const Conv2dShape& s, DeviceSpan dy, DeviceSpan w, DeviceSpan dx,
                                DeviceSpan scratch);
// dw[K,C,R,S] and dbias[K] (optional) from x and dy (overwrite).
LaunchList conv2d_backward_weights(OpEnv& env, const Conv2dShape& s, DeviceSpan x, DeviceSpan dy, DeviceSpan dw,
                                   DeviceSpan dbias, DeviceSpan scratch);

}  // namespace ferry::ops
