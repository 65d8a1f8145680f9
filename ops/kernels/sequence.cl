// Embedding lookup and its gradient, the causal mask and dropout. Operands are
// (buffer, element offset) pairs. No atomics: every output element is written by one work-item.

#include "philox.clh"

// y[n, d] = table[ids[n], d]; zeros for an id outside [0, vocab) (the host validates ids).
__kernel void embedding_forward(__global const int* ids, ulong ids_off, __global const float* table, ulong table_off,
                                __global float* y, ulong y_off, uint positions, uint vocab, uint dim) {
  const uint k = get_global_id(0);
  if (k >= positions * dim) return;
  const uint n = k / dim, d = k - n * dim;
  const int id = ids[ids_off + n];
  y[y_off + k] = (id >= 0 && (uint)id < vocab) ? table[table_off + (ulong)id * dim + d] : 0.0f;
}

// One work-item per (v, d): dtable[v, d] = sum of dy[n, d] over the positions n with ids[n] == v,
// in position order. Neighbouring work-items share v and read neighbouring columns of dy.
__kernel void embedding_backward(__global const int* ids, ulong ids_off, __global const float* dy, ulong dy_off,
                                 __global float* dtable, ulong dtable_off, uint positions, uint vocab, uint dim) {
  const uint k = get_global_id(0);
  if (k >= vocab * dim) return;
  const uint v = k / dim, d = k - v * dim;
  __global const int* id = ids + ids_off;
  __global const float* g = dy + dy_off + d;
  float acc = 0.0f;
  for (uint n = 0; n < positions; ++n) {
    if (id[n] == (int)v) acc += g[(ulong)n * dim];
  }
  dtable[dtable_off + k] = acc;
}

// The same sums on CPU devices, 16 columns of a row per work-item as one float16 (the positions
// scanned once per 16 columns instead of once per column; additions in the same order, so the
// same bits). Columns past the last whole chunk of 16 are summed one by one.
__kernel void embedding_backward16(__global const int* ids, ulong ids_off, __global const float* dy, ulong dy_off,
                                   __global float* dtable, ulong dtable_off, uint positions, uint vocab, uint dim) {
  const uint chunks = (dim + 15) / 16;
  const uint k = get_global_id(0);
  if (k >= vocab * chunks) return;
  const uint v = k / chunks, d0 = (k - v * chunks) * 16;
  __global const int* id = ids + ids_off;
  __global const float* g = dy + dy_off + d0;
  __global float* out = dtable + dtable_off + (ulong)v * dim + d0;
  if (d0 + 16 <= dim) {
    float16 acc = 0.0f;
    for (uint n = 0; n < positions; ++n) {
      if (id[n] == (int)v) acc += vload16(0, g + (ulong)n * dim);
    }
    vstore16(acc, 0, out);
    return;
  }
  for (uint d = 0; d0 + d < dim; ++d) {
    float acc = 0.0f;
    for (uint n = 0; n < positions; ++n) {
      if (id[n] == (int)v) acc += g[(ulong)n * dim + d];
    }
    out[d] = acc;
  }
}

// Over whole [t, t] matrices: y[i, j] = j > i ? fill : x[i, j] (fill -inf forward, 0 backward).
__kernel void causal_mask(__global const float* x, ulong x_off, __global float* y, ulong y_off, uint n, uint t,
                          float fill) {
  const uint k = get_global_id(0);
  if (k >= n) return;
  const uint j = k % t, i = (k / t) % t;
  y[y_off + k] = j > i ? fill : x[x_off + k];
}

// y = x * m * scale with m = (draw >= threshold) for the draw of (index, step) under seed.
// step_lo/step_hi are set per step (KernelLaunch::per_step).
__kernel void dropout(__global const float* x, ulong x_off, __global float* y, ulong y_off, uint n, uint seed,
                      uint threshold, float scale, uint step_lo, uint step_hi) {
  const uint k = get_global_id(0);
  if (k >= n) return;
  const uint r = philox_first((uint4)(k, 0u, step_lo, step_hi), (uint2)(seed, 0u));
  y[y_off + k] = r >= threshold ? x[x_off + k] * scale : 0.0f;
}
