// The weight-update predictor of the hybrid phases (include/ferry/ops/predictor.hpp).
//
// Per weight tensor: d, the smoothed recent update (same shape as w), and st = [delta.d, d.d,
// delta.delta, gain]: the last fit's dot products of the true update delta = w - w_before with d
// as it was, and the gain the predictor applies. Operands are (buffer, element offset) pairs.
// The dot products are deterministic: a fixed number of work-groups each sum a contiguous share
// in a fixed order and combine it with a fixed tree; one work-group then adds the groups' sums in order.
// With has_guard, nothing changes when guard[0] (the step's loss) is not finite: the optimizer
// skipped its update, so there is nothing to learn from.

#include "reduce.clh"

__kernel void predictor_copy(__global const float* src, ulong src_off, __global float* dst, ulong dst_off, uint n) {
  const size_t i = get_global_id(0);
  if (i < n) dst[dst_off + i] = src[src_off + i];
}

// Stage 1, one pass over the tensor: partial[3 g + k] for work-group g = its share's sums of
// delta.d, d.d and delta.delta with d as it was, and d = beta d + (1 - beta) delta written back.
__kernel void predictor_fit_pass(__global const float* w, ulong w_off, __global const float* before, ulong before_off,
                                 __global float* d, ulong d_off, uint n, float beta, __global float* partial,
                                 ulong partial_off, __global const float* guard, ulong guard_off, uint has_guard,
                                 __local float* scratch) {
  const uint group = get_group_id(0), groups = get_num_groups(0);
  const uint lid = get_local_id(0), local_size = get_local_size(0);
  const bool skip = has_guard && !isfinite(guard[guard_off]);
  float dd_sum = 0.0f, d2 = 0.0f, dl2 = 0.0f;
  const uint chunk = (n + groups - 1) / groups;  // a contiguous share per work-group
  const uint end = min(n, (group + 1) * chunk);
  for (uint i = group * chunk + lid; i < end; i += local_size) {
    const float delta = w[w_off + i] - before[before_off + i];
    const float di = d[d_off + i];
    dd_sum = fma(delta, di, dd_sum);
    d2 = fma(di, di, d2);
    dl2 = fma(delta, delta, dl2);
    if (!skip) d[d_off + i] = fma(beta, di, (1.0f - beta) * delta);
  }
  const float a = group_sum(dd_sum, scratch);
  const float b = group_sum(d2, scratch);
  const float c = group_sum(dl2, scratch);
  if (lid == 0) {
    partial[partial_off + 3 * group + 0] = a;
    partial[partial_off + 3 * group + 1] = b;
    partial[partial_off + 3 * group + 2] = c;
  }
}

// Stage 2 (one work-item): st[0..2] = the sums; st[3] = the next gain. kind 0 (linear): 1.
// kind 1 (least squares): the gain that best maps d to delta, smoothed by beta and kept in
// [0, max_gain]; 1 before d has a direction.
__kernel void predictor_stats(__global const float* partial, ulong partial_off, uint groups, __global float* st,
                              ulong st_off, uint kind, float beta, float max_gain, __global const float* guard,
                              ulong guard_off, uint has_guard) {
  if (get_global_id(0) != 0) return;
  if (has_guard && !isfinite(guard[guard_off])) return;
  float a = 0.0f, b = 0.0f, c = 0.0f;
  for (uint g = 0; g < groups; ++g) {
    a += partial[partial_off + 3 * g + 0];
    b += partial[partial_off + 3 * g + 1];
    c += partial[partial_off + 3 * g + 2];
  }
  st[st_off + 0] = a;
  st[st_off + 1] = b;
  st[st_off + 2] = c;
  float gain = 1.0f;
  if (kind == 1 && b > 0.0f) {
    const float fitted = clamp(a / b, 0.0f, max_gain);
    gain = beta * st[st_off + 3] + (1.0f - beta) * fitted;
  }
  st[st_off + 3] = gain;
}

// Predict: w += scale gain d, gain = st[3], scale set per step; skipped when the loss is not finite.
__kernel void predictor_apply(__global float* w, ulong w_off, __global const float* d, ulong d_off,
                              __global const float* st, ulong st_off, uint n, __global const float* guard,
                              ulong guard_off, uint has_guard, float scale) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  if (has_guard && !isfinite(guard[guard_off])) return;
  w[w_off + i] = fma(scale * st[st_off + 3], d[d_off + i], w[w_off + i]);
}
