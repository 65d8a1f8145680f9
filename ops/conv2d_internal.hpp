// What ops/conv2d.cpp and ops/conv2d_winograd.cpp share. Private to ops/conv2d*.cpp.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include "ops/conv2d.hpp"

namespace ferry::ops {

// The layer geometry as kernel build options (-D CONV_C ... CONV_RELU and the storage type T):
// the activations' type unless `t` names another (the weight's, for kernels that read it).
std::string conv2d_defines(const Conv2dShape& s, std::optional<DType> t = std::nullopt);

// Winograd F(m x m, r x r) forward and weight gradient (ops/conv2d_winograd.cpp,
// ops/kernels/conv2d_winograd.cl).
namespace winograd {

// Whether the conv2d passes run `s` this way: CPU devices (where the GEMM is ferry's packed
// kernel, which reads NCHW planes, and its tuning row gives the register block), stride 1, a
// square 3x3 or 5x5 kernel, at least 16 input and output channels. FERRY_CONV_WINOGRAD=0 turns it off (for
// comparisons); any value but 0, 1 or auto is an error.
bool applies(OpEnv& env, const Conv2dShape& s);
// "winograd F(2x2,5x5)" for a shape it applies to; its weight gradient "winograd F(5x5,2x2)" (the
// taps as outputs of a correlation of the inputs with 2x2 blocks of dy).
std::string name(const Conv2dShape& s);
std::string weights_name(const Conv2dShape& s);
// Scratch in floats of forward() (the channels-last padded input and the filter transform) and of
// backward_weights() (the padded input and dy, and the partial sums).
std::size_t forward_scratch_elems(OpEnv& env, const Conv2dShape& s);
std::size_t weights_scratch_elems(OpEnv& env, const Conv2dShape& s);
// y = conv(x, w) + bias (ReLU'd with s.relu): pad, filter transform, products.
LaunchList forward(OpEnv& env, const Conv2dShape& s, DeviceSpan x, DeviceSpan w, DeviceSpan bias, DeviceSpan y,
                   DeviceSpan scratch);
// dw = d(sum dy * y) / dw (overwritten; the bias gradient is the caller's): x and dy padded
// channels-last, partial sums per chunk of tiles, then their sum through A^T (.) A.
LaunchList backward_weights(OpEnv& env, const Conv2dShape& s, DeviceSpan x, DeviceSpan dy, DeviceSpan dw,
                            DeviceSpan scratch);

}  // namespace winograd
}  // namespace ferry::ops
