// Bias over the rows of a [rows, cols] matrix: forward adds b[cols] to every row in place;
// backward sums the rows of dy into db.
#pragma once

#include "ferry/ops/launch.hpp"

namespace ferry::ops {

LaunchList bias_forward(OpEnv& env, DeviceSpan y, DeviceSpan b, std::size_t rows, std::size_t cols);
// db = sum over rows of dy (overwrites db).
LaunchList bias_backward(OpEnv& env, DeviceSpan dy, DeviceSpan db, std::size_t rows, std::size_t cols);

}  // namespace ferry::ops
