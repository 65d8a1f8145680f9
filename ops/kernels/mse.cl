// Mean squared error between a prediction p and a target t of n elements. Operands are
// (buffer, element offset) pairs.
//
// The reduction is deterministic: each work-item accumulates a fixed strided subset in order, then
// the work-group combines the partial sums (reduce.clh).

#include "reduce.clh"

// stats[0] = sum over i of (p[i] - t[i])^2 / n; one work-group. A non-finite p or t gives a
// non-finite loss.
__kernel void mse_forward(__global const float* p, ulong p_off, __global const float* t, ulong t_off,
                          __global float* stats, ulong stats_off, uint n, __local float* scratch) {
  const uint lid = get_local_id(0), ls = get_local_size(0);
  float s = 0.0f;
  for (ulong i = lid; i < n; i += ls) {  // ulong: i + ls cannot wrap near n = 2^32 - 1
    const float d = p[p_off + i] - t[t_off + i];
    s += d * d;
  }
  s = group_sum(s, scratch);
  if (lid == 0) stats[stats_off] = s / (float)n;
}

// dp = coef * (p - t) with coef = 2 / n.
__kernel void mse_backward(__global const float* p, ulong p_off, __global const float* t, ulong t_off,
                           __global float* dp, ulong dp_off, uint n, float coef) {
  const uint i = get_global_id(0);
  if (i >= n) return;
  dp[dp_off + i] = coef * (p[p_off + i] - t[t_off + i]);
}
