// The weight-update predictor of the hybrid phases (include/ferry/ops/predictor.hpp).
//
// Per weight tensor: d, the smoothed recent update (same shape as w), r (with has_r), the smoothed
// residuals, and st = [delta.d, d.d, delta.delta, gain, delta.r, d.r, r.r, rgain]: the last fit's
// dot products of the true update delta = w - w_before with d and r as they were, and the weights
// the predictor applies to d and r. Operands are (buffer, element offset) pairs.
// The dot products are deterministic: a fixed number of work-groups each sum a contiguous share
// in a fixed order and combine it with a fixed tree; one work-group then adds the groups' sums in order.
// With has_guard, nothing changes when guard[0] (the step's loss) is not finite: the optimizer
// skipped its update, so there is nothing to learn from.

#include "reduce.clh"

__kernel void predictor_copy(__global const float* src, ulong src_off, __global float* dst, ulong dst_off, uint n) {
  const size_t i = get_global_id(0);
  if (i < n) dst[dst_off + i] = src[src_off + i];
}

// Stage 1, one pass over the tensor: partial[6 g + k] for work-group g = its share's sums of
// delta.d, d.d, delta.delta, delta.r, d.r and r.r with d and r as they were; then
// d = beta d + (1 - beta) delta and (has_r) r = beta r + (1 - beta) (delta - gain d), with the gain
// st[3] the last prediction used.
__kernel void predictor_fit_pass(__global const float* w, ulong w_off, __global const float* before, ulong before_off,
                                 __global float* d, ulong d_off, uint n, float beta, __global float* partial,
                                 ulong partial_off, __global const float* guard, ulong guard_off, uint has_guard,
                                 __global float* r, ulong r_off, uint has_r, __global const float* st, ulong st_off,
                                 __local float* scratch) {
  const uint group = get_group_id(0), groups = get_num_groups(0);
  const uint lid = get_local_id(0), local_size = get_local_size(0);
  const bool skip = has_guard && !isfinite(guard[guard_off]);
  const float gain = st[st_off + 3];
  float dd_sum = 0.0f, d2 = 0.0f, dl2 = 0.0f, dr = 0.0f, fr = 0.0f, r2 = 0.0f;
  const uint chunk = (n + groups - 1) / groups;  // a contiguous share per work-group
  const uint end = min(n, (group + 1) * chunk);
  for (uint i = group * chunk + lid; i < end; i += local_size) {
    const float delta = w[w_off + i] - before[before_off + i];
    const float di = d[d_off + i];
    dd_sum = fma(delta, di, dd_sum);
    d2 = fma(di, di, d2);
    dl2 = fma(delta, delta, dl2);
    if (has_r) {
      const float ri = r[r_off + i];
      dr = fma(delta, ri, dr);
      fr = fma(di, ri, fr);
      r2 = fma(ri, ri, r2);
      if (!skip) r[r_off + i] = fma(beta, ri, (1.0f - beta) * (delta - gain * di));
    }
    if (!skip) d[d_off + i] = fma(beta, di, (1.0f - beta) * delta);
  }
  const float sums[6] = {dd_sum, d2, dl2, dr, fr, r2};
  for (uint k = 0; k < 6; ++k) {
    const float total = group_sum(sums[k], scratch);
    if (lid == 0) partial[partial_off + 6 * group + k] = total;
  }
}

// Stage 2 (one work-item): st[0..2, 4..6] = the sums; st[3] = the next gain. kind 0 (linear): 1.
// kind 1 (least squares): the gain that best maps d to delta, smoothed by beta and kept in
// [0, max_gain]; 1 before d has a direction. st[7] (has_r): cos(res, r) of the residual res =
// delta - gain d against the smoothed past residuals, clamped to [0, 1], smoothed by beta.
__kernel void predictor_stats(__global const float* partial, ulong partial_off, uint groups, __global float* st,
                              ulong st_off, uint kind, float beta, float max_gain, __global const float* guard,
                              ulong guard_off, uint has_guard, uint has_r) {
  if (get_global_id(0) != 0) return;
  if (has_guard && !isfinite(guard[guard_off])) return;
  float sum[6] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (uint g = 0; g < groups; ++g) {
    for (uint k = 0; k < 6; ++k) sum[k] += partial[partial_off + 6 * g + k];
  }
  const float a = sum[0], b = sum[1], c = sum[2];
  const float old_gain = st[st_off + 3];
  st[st_off + 0] = a;
  st[st_off + 1] = b;
  st[st_off + 2] = c;
  st[st_off + 4] = sum[3];
  st[st_off + 5] = sum[4];
  st[st_off + 6] = sum[5];
  float gain = 1.0f;
  if (kind == 1 && b > 0.0f) {
    const float fitted = clamp(a / b, 0.0f, max_gain);
    gain = beta * old_gain + (1.0f - beta) * fitted;
  }
  st[st_off + 3] = gain;
  if (has_r) {
    const float res_r = sum[3] - old_gain * sum[4];
    const float res_res = c - 2.0f * old_gain * a + old_gain * old_gain * b;
    const float cosine = sum[5] > 0.0f && res_res > 0.0f ? res_r / sqrt(res_res * sum[5]) : 0.0f;
    st[st_off + 7] = beta * st[st_off + 7] + (1.0f - beta) * clamp(cosine, 0.0f, 1.0f);
  }
}

// Predict: w += scale (gain d + rgain r), gain = st[3], rgain = st[7] (has_r), scale set per step;
// skipped when the loss is not finite.
__kernel void predictor_apply(__global float* w, ulong w_off, __global const float* d, ulong d_off,
                              __global const float* st, ulong st_off, uint n, __global const float* guard,
                              ulong guard_off, uint has_guard, float scale, __global const float* r, ulong r_off,
                              uint has_r) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  if (has_guard && !isfinite(guard[guard_off])) return;
  float step = st[st_off + 3] * d[d_off + i];
  if (has_r) step = fma(st[st_off + 7], r[r_off + i], step);
  w[w_off + i] = fma(scale, step, w[w_off + i]);
}
