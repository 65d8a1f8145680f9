// Elementwise utilities the graph needs: sums (residual connections, gradient accumulation),
// fills (zeroing accumulators) and copies.
#pragma once

#include "ferry/ops/launch.hpp"

namespace ferry::ops {

// out = a + b (out may alias a or b).
LaunchList add(OpEnv& env, DeviceSpan a, DeviceSpan b, DeviceSpan out, std::size_t n);
// out = value.
LaunchList fill(OpEnv& env, DeviceSpan out, float value, std::size_t n);
// out = in.
LaunchList copy(OpEnv& env, DeviceSpan in, DeviceSpan out, std::size_t n);

}  // namespace ferry::ops
