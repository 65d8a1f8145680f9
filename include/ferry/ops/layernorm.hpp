// LayerNorm over the last dimension of [rows, cols]: y = (x - mean) * rstd * gamma + beta.
#pragma once

#include "ferry/ops/launch.hpp"

namespace ferry::ops {

// Writes y and the per-row mean and rstd = 1/sqrt(var + eps) that backward reuses.
LaunchList layernorm_forward(OpEnv& env, DeviceSpan x, DeviceSpan gamma, DeviceSpan beta, DeviceSpan y,
                             DeviceSpan mean, DeviceSpan rstd, std::size_t rows, std::size_t cols, float eps = 1e-5f);
// Writes dx, dgamma, dbeta (all overwritten).
LaunchList layernorm_backward(OpEnv& env, DeviceSpan x, DeviceSpan gamma, DeviceSpan mean, DeviceSpan rstd,
                              DeviceSpan dy, DeviceSpan dx, DeviceSpan dgamma, DeviceSpan dbeta, std::size_t rows,
                              std::size_t cols);

}  // namespace ferry::ops
