// Fused causal multi-head attention (ops/kernels/attention.cl, attention_blocked.cl): o = softmax(scale q kᵀ + causal
// mask) v per head, with optional dropout on the probabilities, without a [T, T] score matrix that
// outlives the op (the gemm family holds a bounded chunk of them while it runs). Tiled with an online softmax
// (FlashAttention-2's partitioning): the forward runs over query blocks and saves each row's log-sum-exp; the backward
// recomputes the probabilities from it, over key blocks for dk and dv and over query blocks for dq (two passes instead
// of atomics, so every run gives the same bits).
//
// Layout: q, k, v and o are [B, T, H D] (the output of a linear layer, heads side by side in the
// last axis; no permutes), lse is [B, H, T] in f32. Storage f32, f16 or bf16; arithmetic f32.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "ferry/ops/launch.hpp"
#include "ferry/ops/types.hpp"
#include "ops/sequence.hpp"

namespace ferry::ops {

struct AttentionShape {
  std::size_t batch = 1, context = 0, heads = 1, head_dim = 0;
  std::size_t width() const { return heads * head_dim; }
  std::size_t rows() const { return batch * heads * context; }  // of lse
};

// The largest head dimension the fused kernels hold in registers and private memory.
inline constexpr std::size_t attention_max_head_dim = 128;

// Throws std::invalid_argument saying what is out of range: an empty shape, a head dimension past
// attention_max_head_dim (with what to do instead), sizes past 32-bit indexing.
void check_attention_shape(const AttentionShape& s);

struct AttentionOptions {
  // Optional: a kernel family and its parameters instead of the device's default, for tests and
  // benchmarks. "cpu RB=4 QB=32 KB=64 PASS=1": a work-item per QB query rows, RB (at most 8) of
  // them at a time in registers, keys in 16-key float16 blocks, the forward's online softmax per KB
  // keys (a multiple of 16); PASS=1 runs the backward as one work-item
  // per head, PASS=2 as dk dv per key block then dq per query block, PASS=0 (the default) by the
  // heads: 1 when there are four per compute unit; contexts up to LT (default 4096, 0: never) stage
  // each head in local memory where it fits (grammar: ops/attention_config.hpp).
  // "tiled BQ=64 BK=32": a work-group per BQ queries (or keys),
  // tiles of BK keys (or queries) in local memory, a work-item per query (or key). "blocked TQ=64
  // TK=32" (GPUs): a work-group per TQ queries (or TK keys), every work-item a 4 x 4 block of the
  // scores (ops/kernels/attention_blocked.cl); TQ and TK (4 to 64, powers of two) are fitted per
  // kernel to the device's local memory. "gemm MIB=32" (GPUs): the scores of a chunk of heads made
  // and consumed by ferry's batched GEMM, at most MIB MiB of them in scratch while the op runs
  // (ops/attention_gemm.hpp); given here, a context whose one head does not fit MIB is an error, as
  // the tuner's choice the blocked family runs there. Defaults: cpu on CPU devices; elsewhere the
  // tuner's winner for the device (ops/attention_tune.hpp), or blocked with FERRY_TUNE=off.
  // Empty here, the environment's FERRY_ATTENTION_KERNEL (when set) names the kernel instead.
  std::string kernel{};
};

struct AttentionDropout {
  float p = 0.0f;  // in [0, 1); 0: none
  std::uint32_t seed = 0;
};

// What the op's kernel families share (attention.cpp, attention_gemm.cpp): every attention kernel
// ends with the dropout arguments seed, threshold, inv_keep (these; all zero but inv_keep without
// dropout), then step_lo, step_hi, the step counter, which attention_step_args (given step_lo's
// index) sets per step with the seed (ops::dropout_step_args; nothing without dropout).
struct AttentionKernelDropout {
  cl_uint seed = 0, threshold = 0;
  float inv_keep = 1.0f;
};
AttentionKernelDropout attention_kernel_dropout(const AttentionDropout& d);
void attention_step_args(KernelLaunch& l, cl_uint step_arg, const AttentionKernelDropout& dr);

// Scratch (in floats) of the forward and the backward: staged f32 copies of k and v (transposed
// and row-major, per head) and the backward's row sums delta = rowsum(do o).
std::size_t attention_forward_scratch_elems(OpEnv& env, const AttentionShape& s, const AttentionOptions& o = {});
std::size_t attention_backward_scratch_elems(OpEnv& env, const AttentionShape& s, const AttentionOptions& o = {});

// o and lse are overwritten. scale: the factor of q kᵀ (usually 1 / sqrt(head_dim)).
LaunchList attention_forward(OpEnv& env, const AttentionShape& s, DType dtype, float scale,
                             const AttentionDropout& dropout, DeviceSpan q, DeviceSpan k, DeviceSpan v, DeviceSpan o,
                             DeviceSpan lse, DeviceSpan scratch, const AttentionOptions& options = {});
// dq, dk and dv (overwritten) from the forward's inputs, its o and lse, and do.
LaunchList attention_backward(OpEnv& env, const AttentionShape& s, DType dtype, float scale,
                              const AttentionDropout& dropout, DeviceSpan q, DeviceSpan k, DeviceSpan v, DeviceSpan o,
                              DeviceSpan lse, DeviceSpan dout, DeviceSpan dq, DeviceSpan dk, DeviceSpan dv,
                              DeviceSpan scratch, const AttentionOptions& options = {});

// The kernel family and tile parameters attention_forward picks here, for logs and benchmarks.
std::string attention_kernel_description(OpEnv& env, const AttentionShape& s, const AttentionOptions& o = {});

namespace ref {

namespace detail {
inline std::size_t attention_at(const AttentionShape& s, std::size_t b, std::size_t t, std::size_t h) {
  return (b * s.context + t) * s.width() + h * s.head_dim;
}
// Probability j of row i (b, h): exp(scores - lse), the dropout factor applied by the caller.
template <class T>
T attention_score(const AttentionShape& s, T scale, std::span<const T> q, std::span<const T> k, std::size_t b,
                  std::size_t h, std::size_t i, std::size_t j) {
  const T* qi = q.data() + attention_at(s, b, i, h);
  const T* kj = k.data() + attention_at(s, b, j, h);
  T acc = 0;
  for (std::size_t d = 0; d < s.head_dim; ++d) acc += qi[d] * kj[d];
  return scale * acc;
}
// The dropout factor of probability (b, h, i, j): 0 or 1 / (1 - p), the mask of ops::dropout
// over the flat index of the [B, H, T, T] probabilities (so that the fused op and the unfused
// softmax + dropout draw the same mask).
template <class T>
T attention_keep(const AttentionShape& s, const AttentionDropout& dr, std::uint64_t step, std::size_t b, std::size_t h,
                 std::size_t i, std::size_t j) {
  if (dr.p == 0.0f) return T(1);
  const std::uint64_t index = ((std::uint64_t(b) * s.heads + h) * s.context + i) * s.context + j;
  return dropout_keep(dr.seed, step, index, dropout_threshold(dr.p)) ? T(1) / (T(1) - T(dr.p)) : T(0);
}
}  // namespace detail

template <class T>
void attention_forward(const AttentionShape& s, T scale, const AttentionDropout& dr, std::uint64_t step,
                       std::span<const T> q, std::span<const T> k, std::span<const T> v, std::span<T> o,
                       std::span<T> lse) {
  std::vector<T> p(s.context);
  for (std::size_t b = 0; b < s.batch; ++b) {
    for (std::size_t h = 0; h < s.heads; ++h) {
      for (std::size_t i = 0; i < s.context; ++i) {
        T m = -std::numeric_limits<T>::infinity();
        for (std::size_t j = 0; j <= i; ++j)
          m = std::max(m, p[j] = detail::attention_score(s, scale, q, k, b, h, i, j));
        T l = 0;
        for (std::size_t j = 0; j <= i; ++j) l += std::exp(p[j] - m);
        const T row_lse = m + std::log(l);
        lse[(b * s.heads + h) * s.context + i] = row_lse;
        T* oi = o.data() + detail::attention_at(s, b, i, h);
        for (std::size_t d = 0; d < s.head_dim; ++d) oi[d] = 0;
        for (std::size_t j = 0; j <= i; ++j) {
          const T pj = std::exp(p[j] - row_lse) * detail::attention_keep<T>(s, dr, step, b, h, i, j);
          const T* vj = v.data() + detail::attention_at(s, b, j, h);
          for (std::size_t d = 0; d < s.head_dim; ++d) oi[d] += pj * vj[d];
        }
      }
    }
  }
}

// dq, dk, dv (overwritten) from the forward's o and lse (as the device's backward reads them).
template <class T>
void attention_backward(const AttentionShape& s, T scale, const AttentionDropout& dr, std::uint64_t step,
                        std::span<const T> q, std::span<const T> k, std::span<const T> v, std::span<const T> o,
                        std::span<const T> lse, std::span<const T> dout, std::span<T> dq, std::span<T> dk,
                        std::span<T> dv) {
  for (std::span<T>* g : {&dq, &dk, &dv}) std::fill(g->begin(), g->end(), T(0));
  const std::size_t D = s.head_dim;
  for (std::size_t b = 0; b < s.batch; ++b) {
    for (std::size_t h = 0; h < s.heads; ++h) {
      for (std::size_t i = 0; i < s.context; ++i) {
        const std::size_t ai = detail::attention_at(s, b, i, h);
        T delta = 0;
        for (std::size_t d = 0; d < D; ++d) delta += dout[ai + d] * o[ai + d];
        const T row_lse = lse[(b * s.heads + h) * s.context + i];
        for (std::size_t j = 0; j <= i; ++j) {
          const std::size_t aj = detail::attention_at(s, b, j, h);
          const T p = std::exp(detail::attention_score(s, scale, q, k, b, h, i, j) - row_lse);
          const T keep = detail::attention_keep<T>(s, dr, step, b, h, i, j);
          T dp = 0;
          for (std::size_t d = 0; d < D; ++d) {
            dp += dout[ai + d] * v[aj + d];
            dv[aj + d] += p * keep * dout[ai + d];
          }
          const T ds = p * (dp * keep - delta);
          for (std::size_t d = 0; d < D; ++d) {
            dq[ai + d] += scale * ds * k[aj + d];
            dk[aj + d] += scale * ds * q[ai + d];
          }
        }
      }
    }
  }
}

}  // namespace ref
}  // namespace ferry::ops
