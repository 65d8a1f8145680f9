// Fused causal attention through the GEMM, the "gemm" family (ops/attention_gemm.cpp): q, k, v, do
// staged per head as f32 rows [BH, Tp, DP], the scores of a chunk of heads [heads, Tp, Tp] made and
// consumed by ferry's batched GEMM, and these kernels between them: the masked row softmax of the
// forward, the probabilities and ds of the backward (recomputed from the scores and the forward's
// log-sum-exp, as every family does), and the staging in and out. Formulas, masking and the dropout
// draw are the other families'; every sum has a fixed order (no atomics).
//
// Built with -DHEAD_DIM=D -DDP=(D rounded up to 16) and T_NAME (attention.clh).

#include "attention.clh"
#include "reduce.clh"

// rows[bh, t, d] = x[b, t, h d] for t < T and d < D, else 0. Work-item (d, t, bh) over (DP, Tp, BH):
// neighbouring work-items read neighbouring elements of a row.
__kernel void attention_gemm_stage(__global const T_STORAGE* x, ulong x_off, __global float* rows, ulong rows_off,
                                   uint T, uint Tp, uint H) {
  const uint d = get_global_id(0), t = get_global_id(1), bh = get_global_id(2);
  const uint b = bh / H, h = bh - b * H;
  float v = 0.0f;
  if (t < T && d < D) v = LOAD_T(x, x_off + attention_at(b, t, h, T, H) + d);
  rows[rows_off + ((ulong)bh * Tp + t) * DP + d] = v;
}

// x[b, t, h d] = rows[bh, t, d] for t < T, d < D: the staging's inverse, rounded to the storage type.
// Work-item (d, t, bh) over (D, T, BH).
__kernel void attention_gemm_unstage(__global const float* rows, ulong rows_off, __global T_STORAGE* x, ulong x_off,
                                     uint T, uint Tp, uint H) {
  const uint d = get_global_id(0), t = get_global_id(1), bh = get_global_id(2);
  const uint b = bh / H, h = bh - b * H;
  STORE_T(rows[rows_off + ((ulong)bh * Tp + t) * DP + d], x, x_off + attention_at(b, t, h, T, H) + d);
}

// Whether query i sees key j: the causal mask, and both inside the sequence.
inline bool attention_gemm_visible(uint i, uint j, uint T) {
  return j <= i && i < T;
}

// Forward: row r of the chunk's scores s [heads, Tp, Tp] (scaled by the GEMM), query i = r % Tp of head
// bh = first_head + r / Tp, becomes its probabilities (times the dropout factor: what multiplies v),
// zero where masked and on padded rows; lse[bh, i] = the row's log-sum-exp. A work-group per row
// (a power-of-two size): the maximum, then the sum of exponentials, each a fixed tree.
__kernel void attention_gemm_softmax(__global float* s, ulong s_off, __global float* lse, ulong lse_off, uint T, uint Tp,
                                     uint first_head, uint seed, uint threshold, float inv_keep, uint step_lo,
                                     uint step_hi, __local float* scratch) {
  const uint r = get_group_id(0), lid = get_local_id(0), ls = get_local_size(0);
  const uint i = r % Tp, bh = first_head + r / Tp;
  __global float* row = s + s_off + (ulong)r * Tp;
  float m = -INFINITY;
  for (uint j = lid; j < Tp; j += ls)
    if (attention_gemm_visible(i, j, T)) m = fmax(m, row[j]);
  m = group_max(m, scratch);
  float l = 0.0f;
  for (uint j = lid; j < Tp; j += ls)
    if (attention_gemm_visible(i, j, T)) l += exp(row[j] - m);
  l = group_sum(l, scratch);
  const float inv = i < T ? 1.0f / l : 0.0f;
  for (uint j = lid; j < Tp; j += ls) {
    float p = 0.0f;
    if (attention_gemm_visible(i, j, T)) {
      p = exp(row[j] - m) * inv;
      if (threshold) p *= attention_keep(((ulong)bh * T + i) * T + j, seed, threshold, inv_keep, step_lo, step_hi);
    }
    row[j] = p;
  }
  if (lid == 0 && i < T) lse[lse_off + (ulong)bh * T + i] = m + log(l);
}

// Backward, element (r, j) of the chunk: with s the scores (scaled) and dp = do vᵀ, the probability
// p = exp(s - lse) (zero where masked), s becomes p keep (what dv = (p keep)ᵀ do reads) and dp
// becomes ds = p (dp keep - delta). Work-item (j, r) over (Tp, heads Tp).
__kernel void attention_gemm_ds(__global float* s, ulong s_off, __global float* dp, ulong dp_off,
                                __global const float* lse, ulong lse_off, __global const float* delta, ulong delta_off,
                                uint T, uint Tp, uint first_head, uint seed, uint threshold, float inv_keep,
                                uint step_lo, uint step_hi) {
  const uint j = get_global_id(0), r = get_global_id(1);
  const uint i = r % Tp, bh = first_head + r / Tp;
  const ulong at = (ulong)r * Tp + j;
  float pk = 0.0f, ds = 0.0f;
  if (attention_gemm_visible(i, j, T)) {
    const ulong row = (ulong)bh * T + i;
    const float p = exp(s[s_off + at] - lse[lse_off + row]);
    const float keep =
        threshold ? attention_keep(row * T + j, seed, threshold, inv_keep, step_lo, step_hi) : 1.0f;
    pk = p * keep;
    ds = p * (dp[dp_off + at] * keep - delta[delta_off + row]);
  }
  s[s_off + at] = pk;
  dp[dp_off + at] = ds;
}
