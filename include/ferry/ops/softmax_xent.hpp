// Fused softmax + cross-entropy over logits [rows, classes] with int32 class labels.
#pragma once

#include "ferry/ops/launch.hpp"

namespace ferry::ops {

// probs = softmax(logits) per row (numerically stable, max-subtracted);
// stats[0] = mean over rows of -log(probs[label]); stats[1] = number of rows whose argmax is the label.
// `labels` is an int32 buffer (offset in int32 elements). A label outside [0, classes) makes the
// loss NaN, which the trainer reports as bad input.
LaunchList softmax_xent_forward(OpEnv& env, DeviceSpan logits, DeviceSpan labels, DeviceSpan probs, DeviceSpan stats,
                                std::size_t rows, std::size_t classes);
// dlogits = scale * (probs - onehot(label)) / rows  (the gradient of the mean loss, times scale).
LaunchList softmax_xent_backward(OpEnv& env, DeviceSpan probs, DeviceSpan labels, DeviceSpan dlogits,
                                 std::size_t rows, std::size_t classes, float scale = 1.0f);

}  // namespace ferry::ops
