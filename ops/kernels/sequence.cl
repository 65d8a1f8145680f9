// Embedding lookup and its gradient, the causal mask and dropout. Operands are
// (buffer, element offset) pairs. No atomics: every output element is written by one work-item.

#include "philox.clh"
#include "store16.clh"

// y[n, d] = table[ids[n], d]; zeros for an id outside [0, vocab) (the host validates ids).
__kernel void embedding_forward(__global const int* ids, ulong ids_off, __global const float* table, ulong table_off,
                                __global float* y, ulong y_off, uint positions, uint vocab, uint dim) {
  const uint k = get_global_id(0);
  if (k >= positions * dim) return;
  const uint n = k / dim, d = k - n * dim;
  const int id = ids[ids_off + n];
  y[y_off + k] = (id >= 0 && (uint)id < vocab) ? table[table_off + (ulong)id * dim + d] : 0.0f;
}

// The same on CPU devices: a work-item per position and 16 columns, copied as one float16; columns
// past the last whole 16 one by one. Global: positions * ceil(dim / 16).
__kernel void embedding_forward16(__global const int* ids, ulong ids_off, __global const float* table,
                                  ulong table_off, __global float* y, ulong y_off, uint positions, uint vocab,
                                  uint dim) {
  const uint chunks = (dim + 15) / 16;
  const uint k = get_global_id(0);
  const uint n = k / chunks, d0 = (k - n * chunks) * 16;
  if (n >= positions) return;
  const int id = ids[ids_off + n];
  const bool inside = id >= 0 && (uint)id < vocab;
  __global const float* src = table + table_off + (ulong)(inside ? id : 0) * dim;
  __global float* dst = y + y_off + (ulong)n * dim;
  if (d0 + 16 <= dim) {
    VSTORE16_GLOBAL(inside ? vload16(0, src + d0) : (float16)(0.0f), dst + d0);
    return;
  }
  for (uint d = d0; d < dim; ++d) dst[d] = inside ? src[d] : 0.0f;
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

// The same sums on CPU devices: a work-item per 16 columns (one float16) zeroes that column block
// of every row, then adds dy's rows to the rows their ids name, in position order, so each sum adds
// in embedding_backward's order (the same bits) and dy is read once. (A work-item per row and 16
// columns scanned every position's id: 4.3 ms a step of the default GPT.) Ids outside [0, vocab)
// add nothing. Columns past the last whole 16 go one by one. Global: ceil(dim / 16).
__kernel void embedding_backward16(__global const int* ids, ulong ids_off, __global const float* dy, ulong dy_off,
                                   __global float* dtable, ulong dtable_off, uint positions, uint vocab, uint dim) {
  const uint d0 = get_global_id(0) * 16;
  if (d0 >= dim) return;
  __global const int* id = ids + ids_off;
  __global const float* g = dy + dy_off + d0;
  __global float* out = dtable + dtable_off + d0;
  const uint width = min(16u, dim - d0);
  if (width == 16) {
    for (uint v = 0; v < vocab; ++v) VSTORE16_GLOBAL((float16)(0.0f), out + (ulong)v * dim);
    for (uint n = 0; n < positions; ++n) {
      const int v = id[n];
      if (v < 0 || (uint)v >= vocab) continue;
      __global float* row = out + (ulong)v * dim;
      VSTORE16_GLOBAL(vload16(0, row) + vload16(0, g + (ulong)n * dim), row);
    }
    return;
  }
  for (uint v = 0; v < vocab; ++v)
    for (uint d = 0; d < width; ++d) out[(ulong)v * dim + d] = 0.0f;
  for (uint n = 0; n < positions; ++n) {
    const int v = id[n];
    if (v < 0 || (uint)v >= vocab) continue;
    for (uint d = 0; d < width; ++d) out[(ulong)v * dim + d] += g[(ulong)n * dim + d];
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

// The same on CPU devices, 16 elements a work-item (k0 = 16 get_global_id(0)), the draws as one
// vector: the same draws, so the same mask.
__kernel void dropout16(__global const float* x, ulong x_off, __global float* y, ulong y_off, uint n, uint seed,
                        uint threshold, float scale, uint step_lo, uint step_hi) {
  const uint k0 = get_global_id(0) * 16;
  if (k0 >= n) return;
  const uint16 r = philox_draws16(k0, step_lo, step_hi, seed);
  if (k0 + 16 <= n) {
    const float16 v = vload16(0, x + x_off + k0) * scale;
    vstore16(select((float16)0.0f, v, r >= (uint16)threshold), 0, y + y_off + k0);
    return;
  }
  uint rs[16];
  vstore16(r, 0, rs);
  for (uint i = 0; k0 + i < n; ++i) y[y_off + k0 + i] = rs[i] >= threshold ? x[x_off + k0 + i] * scale : 0.0f;
}
