// Binding of the GPU GEMM kernel (ops/kernels/gemm_tiled.cl), strided-batched. Private to ops/.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "gemm_tuning.hpp"
#include "ops/gemm.hpp"

namespace ferry::ops {

// Local memory the kernel declares for these parameters: two tiles of each operand.
std::size_t tiled_local_bytes(const GemmKernelConfig& c);

// K splits of a product with these parameters on a device of `compute_units` (1: unsplit). With
// SK=1 in the row, a product whose work-groups leave the last wave short (fewer than four groups per
// compute unit) has its K split into s chunks of at least 8 TSK rows (s <= 16) where that shortens
// the waves, ceil(groups s / compute units) / s, by at least 10%: the fewest splits within 5% of the
// shortest. 144 tiles on 132 compute units run two waves unsplit, 7 splits 1008 groups in 8 waves
// of a seventh of the work (1.14); 96 tiles, 4 splits in 3 waves of a quarter. SK=0: unsplit.
std::size_t tiled_splits(const GemmShape& s, const GemmKernelConfig& c, std::uint32_t compute_units);

// The -D options naming the operands' storage types (A_NAME, A_IS_F32, ... C_IS_F32: dtype.clh) and
// the epilogue of `o` (C_PLANES = c_planes, C_RELU, C_DACT, C_GUARD: gemm_epilogue.clh), for the
// kernels that store C: gemm_packed, gemm_tiled, gemm_sum_splits.
std::string gemm_storage_defines(DType a, DType b, DType c);
std::string gemm_epilogue_defines(const GemmOptions& o, std::size_t c_planes);
// Throws std::invalid_argument "gemm MxNxK <what>: needs <need> floats of scratch, got none" where a
// product needs scratch (need > 0) and `scratch` has no buffer; the bindings' one check of it.
void require_scratch(DeviceSpan scratch, const GemmShape& s, std::string_view what, std::size_t need);
// Those kernels' guard argument: o.guard's buffer, or C's (never written without C_GUARD).
inline cl_mem guard_buffer(const GemmOptions& o, DeviceSpan c) {
  return o.guard.buffer ? o.guard.buffer : c.buffer;
}

// The launch adding the splits' partial products (f32 blocks [batch splits, M, N] in `parts`) into
// C with alpha, beta, the bias and the epilogue of `options` (gemm_sum.cl), C stored as NCHW planes
// of c_planes rows when > 0: the second half of a split-K product, for either kernel.
KernelLaunch sum_splits_launch(OpEnv& env, const GemmShape& s, std::size_t splits, DeviceSpan parts, float alpha,
                               float beta, DeviceSpan c, const GemmOptions& options, std::size_t c_planes);

// Scratch (floats) of a product: the splits' partial products, 0 unsplit.
std::size_t tiled_scratch_elems(const GemmShape& s, const GemmKernelConfig& c, std::uint32_t compute_units);

// Launches computing, for z < s.batch, C[z] = alpha op(A[z]) op(B[z]) + beta C[z] (+ bias, when
// bias.buffer is set: f32, one value per column), product z's operands z matrices past their
// offsets, with the epilogue of `options` (its relu, dact or guard; the other fields unused). Throws
// std::runtime_error naming the parameters when the work-group or the local tiles exceed what the
// device (or the built kernel) allows. A split product (tiled_splits) writes its partial products
// into `scratch` (tiled_scratch_elems floats) and adds them into C in a second launch.
LaunchList bind_tiled(OpEnv& env, const GemmShape& s, const GemmKernelConfig& cfg, float alpha, DeviceSpan a,
                      DeviceSpan b, float beta, DeviceSpan c, DeviceSpan scratch, const GemmOptions& options = {});

}  // namespace ferry::ops
