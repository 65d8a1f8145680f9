// Binding of the GPU GEMM kernel (ops/kernels/gemm_tiled.cl), shared by gemm() and the batched
// matmul: one strided-batched routine. Private to ops/.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ferry/ops/gemm.hpp"
#include "gemm_tuning.hpp"

namespace ferry::ops {

// Elements between consecutive products of a batch, per operand (0: every product reads the same).
struct GemmBatchStrides {
  std::uint64_t a = 0, b = 0, c = 0;
};

// Local memory the kernel declares for these parameters: two tiles of each operand.
std::size_t tiled_local_bytes(const GemmKernelConfig& c);

// Launches computing, for z < batch, C[z] = alpha op(A[z]) op(B[z]) + beta C[z] (+ bias, when
// bias.buffer is set: f32, one value per column). Throws std::runtime_error naming the parameters
// when the work-group or the local tiles exceed what the device (or the built kernel) allows.
LaunchList bind_tiled_batched(OpEnv& env, const GemmShape& s, std::size_t batch, GemmBatchStrides strides,
                              const GemmKernelConfig& cfg, float alpha, DeviceSpan a, DeviceSpan b, float beta,
                              DeviceSpan c, DeviceSpan bias);

}  // namespace ferry::ops
