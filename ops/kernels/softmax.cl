// Softmax over the last axis of a row-major [rows, cols] tensor, and its gradient. Operands are
// (buffer, element offset) pairs. One work-group per row (the local size a power of two: 1 on CPU
// devices, up to 256 on GPUs, see ops::row_group_size).
//
// VW (-D, 16 or 1): with VW=16 (a work-item per row, on CPU devices) a work-item takes the row in
// float16 chunks, then the columns past the last whole chunk one by one; a vector exp is ~10x
// faster than scalar ones on PoCL. With VW=1 neighbouring work-items take neighbouring columns.
//
// Reductions are deterministic: each work-item accumulates a fixed strided subset of the row in
// order, then the work-group combines the partial results with a fixed tree in local memory. No
// atomics, so every run gives the same bits.

#include "reduce.clh"
#include "store16.clh"

#if VW == 16
#define VCOLS(cols) ((cols) / 16 * 16)  // columns taken in float16 chunks
#else
#define VCOLS(cols) 0u
#endif

// y[r, :] = exp(x[r, :] - max) / sum exp(x[r, :] - max). The exponentials are stashed in y and
// rescaled; each work-item rereads only what it wrote, so x and y may be the same memory.
// causal_period > 0: causal attention scores, rows of [.., T, T] matrices (T = causal_period): row
// r keeps columns 0..(r mod T) and its later columns get 0, as if they were -inf (a causal mask
// fused in; the backward is the same, since masked entries of y are 0).
__kernel void softmax_forward(__global const float* x, ulong x_off, __global float* y, ulong y_off, uint all_cols,
                              uint causal_period, __local float* scratch) {
  const ulong row = get_group_id(0);
  const uint lid = get_local_id(0), ls = get_local_size(0);
  __global const float* xr = x + x_off + row * all_cols;
  __global float* yr = y + y_off + row * all_cols;
  const uint cols = causal_period ? min(all_cols, (uint)(row % causal_period) + 1u) : all_cols;
  const uint vcols = VCOLS(cols);

  float16 mv = -INFINITY;
  for (uint c = lid * 16; c < vcols; c += ls * 16) mv = fmax(mv, vload16(0, xr + c));
  float m = fold_max16(mv);
  for (uint c = vcols + lid; c < cols; c += ls) m = fmax(m, xr[c]);
  m = group_max(m, scratch);

  float16 sv = 0.0f;
  for (uint c = lid * 16; c < vcols; c += ls * 16) {
    const float16 e = exp(vload16(0, xr + c) - m);
    VSTORE16_GLOBAL(e, yr + c);
    sv += e;
  }
  float s = fold_sum16(sv);
  for (uint c = vcols + lid; c < cols; c += ls) {
    const float e = exp(xr[c] - m);
    yr[c] = e;
    s += e;
  }
  s = group_sum(s, scratch);

  const float inv = 1.0f / s;
  for (uint c = lid * 16; c < vcols; c += ls * 16) VSTORE16_GLOBAL(vload16(0, yr + c) * inv, yr + c);
  for (uint c = vcols + lid; c < cols; c += ls) yr[c] *= inv;
  for (uint c = cols + lid; c < all_cols; c += ls) yr[c] = 0.0f;
}

// dx[r, :] = y[r, :] (dy[r, :] - sum_c dy[r, c] y[r, c]). dx may be dy's or y's memory: every
// element is read by the work-item that writes it, and the writes follow the reduction.
__kernel void softmax_backward(__global const float* y, ulong y_off, __global const float* dy, ulong dy_off,
                               __global float* dx, ulong dx_off, uint cols, __local float* scratch) {
  const ulong row = get_group_id(0);
  const uint lid = get_local_id(0), ls = get_local_size(0);
  __global const float* yr = y + y_off + row * cols;
  __global const float* dyr = dy + dy_off + row * cols;
  __global float* dxr = dx + dx_off + row * cols;
  const uint vcols = VCOLS(cols);

  float16 sv = 0.0f;
  for (uint c = lid * 16; c < vcols; c += ls * 16) sv = fma(vload16(0, dyr + c), vload16(0, yr + c), sv);
  float s = fold_sum16(sv);
  for (uint c = vcols + lid; c < cols; c += ls) s = fma(dyr[c], yr[c], s);
  s = group_sum(s, scratch);

  for (uint c = lid * 16; c < vcols; c += ls * 16) {
    const float16 yv = vload16(0, yr + c);
    VSTORE16_GLOBAL(yv * (vload16(0, dyr + c) - s), dxr + c);
  }
  for (uint c = vcols + lid; c < cols; c += ls) dxr[c] = yr[c] * (dyr[c] - s);
}
