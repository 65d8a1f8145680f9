// Binding of the GPU GEMM kernel (ops/kernels/gemm_tiled.cl), strided-batched. Private to ops/.
#pragma once

#include <cstddef>

#include "gemm_tuning.hpp"
#include "ops/gemm.hpp"

namespace ferry::ops {

// Local memory the kernel declares for these parameters: two tiles of each operand.
std::size_t tiled_local_bytes(const GemmKernelConfig& c);

// Launches computing, for z < s.batch, C[z] = alpha op(A[z]) op(B[z]) + beta C[z] (+ bias, when
// bias.buffer is set: f32, one value per column), product z's operands z matrices past their
// offsets, with the epilogue of `options` (its relu or dact; the other fields unused). Throws
// std::runtime_error naming the parameters when the work-group or the local tiles exceed what the
// device (or the built kernel) allows.
LaunchList bind_tiled(OpEnv& env, const GemmShape& s, const GemmKernelConfig& cfg, float alpha, DeviceSpan a,
                      DeviceSpan b, float beta, DeviceSpan c, DeviceSpan bias, const GemmOptions& options = {});

}  // namespace ferry::ops
