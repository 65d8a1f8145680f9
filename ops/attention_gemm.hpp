// The fused attention's "gemm" family (ops/kernels/attention_gemm.cl): each head's scores made and
// consumed by ferry's batched GEMM, a chunk of heads at a time in scratch. Private to ops/.
//
// Why a family of products: on a GPU the tuned GEMM runs at two to three times the rate of the
// register-blocked attention kernels, and from the measured unfused path (the same products with
// the scores kept) it was 1.8-2.3x faster than the blocked family up to context 1024 on an H200
// and level at 4096 (bench/RESULTS.md, "Third GPU run"). Unlike the unfused path nothing of size
// context² outlives the op: the scores of at most `mib` MiB of heads live in its scratch while it
// runs, and the backward recomputes them from the log-sum-exp as the other families do. Where one
// head's scores do not fit that bound the op runs the blocked family (attention.cpp).
#pragma once

#include <cstddef>

#include "ferry/ops/launch.hpp"
#include "ferry/ops/types.hpp"
#include "ops/attention.hpp"

namespace ferry::ops {

// MiB of scores the family holds by default (the forward one score matrix per head of a chunk, the
// backward two): 32 MiB hold one head's two at context 2048, 64 heads at 256.
inline constexpr std::size_t attention_gemm_default_mib = 32;

// Heads per chunk when each head takes `buffers` score matrices of Tp² floats within `mib` MiB; 0
// when not even one head fits.
std::size_t attention_gemm_chunk_heads(const AttentionShape& s, std::size_t mib, std::size_t buffers);

// Scratch in floats: the forward's staged q, k, v, o rows, its scores and its GEMMs' scratch; the
// backward's (past the delta rows attention.cpp puts first) staged q, k, v, do, dq, dk, dv rows,
// two score matrices per head and its GEMMs' scratch.
std::size_t attention_gemm_forward_scratch(OpEnv& env, const AttentionShape& s, std::size_t mib);
std::size_t attention_gemm_backward_scratch(OpEnv& env, const AttentionShape& s, std::size_t mib);

// Appends the forward (o, lse) and the backward (dq, dk, dv from delta = rowsum(do o), computed
// by the caller into `delta`) to `list`. The caller checks that a head fits (chunk_heads > 0).
void attention_gemm_forward(LaunchList& list, OpEnv& env, const AttentionShape& s, DType dtype, std::size_t mib,
                            float scale, const AttentionKernelDropout& dr, DeviceSpan q, DeviceSpan k, DeviceSpan v,
                            DeviceSpan o, DeviceSpan lse, DeviceSpan scratch);
void attention_gemm_backward(LaunchList& list, OpEnv& env, const AttentionShape& s, DType dtype, std::size_t mib,
                             float scale, const AttentionKernelDropout& dr, DeviceSpan q, DeviceSpan k, DeviceSpan v,
                             DeviceSpan dout, DeviceSpan lse, DeviceSpan delta, DeviceSpan dq, DeviceSpan dk,
                             DeviceSpan dv, DeviceSpan scratch);

}  // namespace ferry::ops
