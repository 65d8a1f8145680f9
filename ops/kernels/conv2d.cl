// Conv2d helpers around the GEMM: im2col, col2im (a gather, so deterministic without atomics),
// the permutes between NCHW and the GEMM's [K, G*P*Q] layout, and the bias gradient.
//
// The layer geometry is compiled in (-D CONV_C, CONV_H, CONV_W, CONV_K, CONV_R, CONV_S, CONV_P,
// CONV_Q, CONV_STRIDE, CONV_PAD) so that the index divisions become multiplies and PoCL can
// vectorise across work-items. The number of images G in a group varies and is an argument;
// `ncols` = G * P * Q is the width of the column matrix. Every kernel handles one group of G
// consecutive images: the host offsets x, y, dx, dy to the group's first image.
//
// x, y and their gradients are stored as T (-DT_F16 / -DT_BF16, f32 without: dtype.clh); the
// column matrix, the GEMM results and the bias are f32.
#include "dtype.clh"

#ifndef CONV_RELU
#define CONV_RELU 0  // 1: a ReLU fused into the forward epilogue (Conv2dShape::relu)
#endif

#define CONV_PQ (CONV_P * CONV_Q)
#define CONV_RS (CONV_R * CONV_S)
#define CONV_HW (CONV_H * CONV_W)

// cols[(c*R + r)*S + s, g*PQ + p*Q + q] = x[g, c, p*stride + r - pad, q*stride + s - pad] (0 if
// outside). Global (ncols rounded up, C*R*S): one work-item per column-matrix element, with
// consecutive work-items on consecutive columns (output pixels), so writes are contiguous and
// reads are contiguous for stride 1.
__kernel void conv2d_im2col(__global const T_STORAGE* x, ulong x_off, __global float* cols, ulong cols_off, uint ncols) {
  const uint j = get_global_id(0);
  const uint row = get_global_id(1);
  if (j >= ncols) return;
  const uint g = j / CONV_PQ;
  const uint pq = j - g * CONV_PQ;
  const uint p = pq / CONV_Q;
  const uint q = pq - p * CONV_Q;
  const uint c = row / CONV_RS;
  const uint rs = row - c * CONV_RS;
  const uint r = rs / CONV_S;
  const uint s = rs - r * CONV_S;
  const int h = (int)(p * CONV_STRIDE + r) - CONV_PAD;
  const int w = (int)(q * CONV_STRIDE + s) - CONV_PAD;
  const ulong xg = x_off + (ulong)c * CONV_HW;
  __global float* out = cols + cols_off + (ulong)row * ncols;
  float v = 0.0f;
  if (h >= 0 && h < CONV_H && w >= 0 && w < CONV_W) {
    v = LOAD_T(x, xg + g * (CONV_C * CONV_HW) + (uint)h * CONV_W + (uint)w);
  }
  out[j] = v;
}

// dx[g, c, h, w] = sum over (r, s) of dcols[(c*R + r)*S + s, g*PQ + p*Q + q] for every output
// pixel (p, q) whose window covers (h, w). One work-item per input element, fixed summation
// order. Global: G*C*H*W rounded up. (A branch-free variant that clamps and masks all R*S taps
// let PoCL vectorise across work-items but measured no faster: it gathers every tap.)
__kernel void conv2d_col2im(__global const float* dcols, ulong dcols_off, __global T_STORAGE* dx, ulong dx_off, uint ncols,
                            uint count) {
  const uint i = get_global_id(0);
  if (i >= count) return;
  const uint gc = i / CONV_HW;
  const uint hw = i - gc * CONV_HW;
  const uint g = gc / CONV_C;
  const uint c = gc - g * CONV_C;
  const int h = (int)(hw / CONV_W);
  const int w = (int)(hw - (uint)h * CONV_W);
  __global const float* base = dcols + dcols_off + (ulong)c * CONV_RS * ncols;
  const uint gbase = g * CONV_PQ;
  float acc = 0.0f;
  for (int r = 0; r < CONV_R; ++r) {
    const int hp = h + CONV_PAD - r;
    if (hp < 0) break;
    if (hp % CONV_STRIDE != 0) continue;
    const int p = hp / CONV_STRIDE;
    if (p >= CONV_P) continue;
    for (int s = 0; s < CONV_S; ++s) {
      const int wq = w + CONV_PAD - s;
      if (wq < 0) break;
      if (wq % CONV_STRIDE != 0) continue;
      const int q = wq / CONV_STRIDE;
      if (q >= CONV_Q) continue;
      acc += base[(uint)(r * CONV_S + s) * ncols + gbase + (uint)(p * CONV_Q + q)];
    }
  }
  STORE_T(acc, dx, dx_off + i);
}

// y[g, k, pq] = t[k, g*PQ + pq] + bias[k] (then ReLU with -DCONV_RELU=1): the GEMM result [K, ncols] to NCHW. One work-item per
// element of y (contiguous writes; reads contiguous within each pq run). Global: G*K*PQ.
__kernel void conv2d_to_nchw(__global const float* t, ulong t_off, __global const float* bias, ulong bias_off,
                             uint has_bias, __global T_STORAGE* y, ulong y_off, uint ncols, uint count) {
  const uint i = get_global_id(0);
  if (i >= count) return;
  const uint gk = i / CONV_PQ;
  const uint pq = i - gk * CONV_PQ;
  const uint g = gk / CONV_K;
  const uint k = gk - g * CONV_K;
  float v = t[t_off + (ulong)k * ncols + g * CONV_PQ + pq];
  if (has_bias) v += bias[bias_off + k];
#if CONV_RELU
  v = v > 0.0f ? v : 0.0f;  // the ReLU fused in (NaN -> 0, as ops::Activation::relu)
#endif
  STORE_T(v, y, y_off + i);
}

// t[k, g*PQ + pq] = dy[g, k, pq]: NCHW gradients to the GEMM layout [K, ncols]. One work-item per
// element of t. Global: K*ncols.
__kernel void conv2d_from_nchw(__global const T_STORAGE* dy, ulong dy_off, __global float* t, ulong t_off, uint ncols,
                               uint count) {
  const uint i = get_global_id(0);
  if (i >= count) return;
  const uint k = i / ncols;
  const uint j = i - k * ncols;
  const uint g = j / CONV_PQ;
  const uint pq = j - g * CONV_PQ;
  t[t_off + i] = LOAD_T(dy, dy_off + (ulong)(g * CONV_K + k) * CONV_PQ + pq);
}

// dbias[k] = sum over n, pq of dy[n, k, pq], in two fixed-order passes (deterministic):
// conv2d_bias_partial sums each image's planes, part[n, k] = sum over pq of dy[n, k, pq], one
// work-item per image reading its K planes front to back (contiguous, vector loads for f32);
// conv2d_bias_sum adds the images in order, one work-item per channel. (One work-group per
// channel striding over the batch ran at 2 GB/s: PoCL's work-group loops gathered across planes.)
__kernel void conv2d_bias_partial(__global const T_STORAGE* dy, ulong dy_off, __global float* part, ulong part_off,
                                  uint batch) {
  const uint n = get_global_id(0);
  if (n >= batch) return;
  for (uint k = 0; k < CONV_K; ++k) {
    const ulong plane = dy_off + (ulong)(n * CONV_K + k) * CONV_PQ;
    float acc = 0.0f;
    uint pq = 0;
#if T_IS_F32
    float16 v = 0.0f;
    for (; pq + 16 <= CONV_PQ; pq += 16) v += vload16(0, dy + plane + pq);
    acc = ((v.s0 + v.s1) + (v.s2 + v.s3)) + ((v.s4 + v.s5) + (v.s6 + v.s7)) + ((v.s8 + v.s9) + (v.sa + v.sb)) +
          ((v.sc + v.sd) + (v.se + v.sf));
#endif
    for (; pq < CONV_PQ; ++pq) acc += LOAD_T(dy, plane + pq);
    part[part_off + (ulong)n * CONV_K + k] = acc;
  }
}

__kernel void conv2d_bias_sum(__global const float* part, ulong part_off, __global float* dbias, ulong dbias_off,
                              uint batch) {
  const uint k = get_global_id(0);
  if (k >= CONV_K) return;
  float acc = 0.0f;
  for (uint n = 0; n < batch; ++n) acc += part[part_off + (ulong)n * CONV_K + k];
  dbias[dbias_off + k] = acc;
}

#define CONV_HP (CONV_H + 2 * CONV_PAD)
#define CONV_WP (CONV_W + 2 * CONV_PAD)

// xp[n, c, hp, wp] = x[n, c, hp - pad, wp - pad], 0 in the border, widened to f32: the input the
// implicit column matrix of the packed GEMM reads (A(m, k) = xp[rows[m] + cols[k]], no im2col).
// One work-item per padded row (n, c, hp): zeros, then the row of x (vector copies for f32), then
// zeros. The last row's work-item also zeroes the `slack` floats after xp (kDirectSlack, reserved
// by the host): the direct kernels' last vector loads reach there (conv2d_direct.cl), and lanes a
// product multiplies by 0 must not hold a NaN pattern. (One work-item per element, each clamping
// and selecting, took about 10 times as long on PoCL.) Global: N*C*HP rounded up.
//
// The border test is one unsigned compare on purpose. Written as `h < 0 || h >= CONV_H`, LLVM
// folds the two compares into `switch (trunc row to iB)` when HP is 2^B (HP = 8, 16, 32 at pad 1),
// and Oclgrind (21.10) evaluates a trunc to a width that is not whole bytes without clearing the
// bits above B, so there the border rows of every plane after the first (row >= HP) missed the
// switch's cases and got a row of x instead of zeros. Correct on PoCL either way.
__kernel void conv2d_pad(__global const T_STORAGE* x, ulong x_off, __global float* xp, ulong xp_off, uint rows,
                         uint slack) {
  const uint row = get_global_id(0);
  if (row >= rows) return;
  const uint nc = row / CONV_HP;
  const uint hp = row - nc * CONV_HP;
  __global float* out = xp + xp_off + (ulong)row * CONV_WP;
  if (row == rows - 1) {
    for (uint w = 0; w < slack; ++w) out[CONV_WP + w] = 0.0f;
  }
  const uint h = hp - CONV_PAD;  // hp < pad wraps to a huge value: one compare tests both borders
  if (h >= (uint)CONV_H) {
    for (uint w = 0; w < CONV_WP; ++w) out[w] = 0.0f;
    return;
  }
  for (uint w = 0; w < CONV_PAD; ++w) out[w] = 0.0f;
  const ulong in = x_off + (ulong)nc * CONV_HW + (ulong)h * CONV_W;
  uint w = 0;
#if T_IS_F32
  for (; w + 4 <= CONV_W; w += 4) vstore4(vload4(0, x + in + w), 0, out + CONV_PAD + w);
#endif
  for (; w < CONV_W; ++w) out[CONV_PAD + w] = LOAD_T(x, in + w);
  for (uint w2 = CONV_PAD + CONV_W; w2 < CONV_WP; ++w2) out[w2] = 0.0f;
}

// The offset tables of the implicit column matrix over xp: pixels[m] for output pixel
// m = g*PQ + p*Q + q is where its window starts (g*C*HP*WP + p*stride*WP + q*stride), taps[k] for
// k = (c*R + r)*S + s the tap's offset within a window (c*HP*WP + r*WP + s). Global: max(npix, CRS).
__kernel void conv2d_tables(__global int* pixels, ulong pixels_off, uint npix, __global int* taps, ulong taps_off) {
  const uint i = get_global_id(0);
  if (i < npix) {
    const uint g = i / CONV_PQ;
    const uint pq = i - g * CONV_PQ;
    const uint p = pq / CONV_Q;
    const uint q = pq - p * CONV_Q;
    pixels[pixels_off + i] = (int)(g * (CONV_C * CONV_HP * CONV_WP) + p * CONV_STRIDE * CONV_WP + q * CONV_STRIDE);
  }
  if (i < CONV_C * CONV_RS) {
    const uint c = i / CONV_RS;
    const uint rs = i - c * CONV_RS;
    const uint r = rs / CONV_S;
    const uint s = rs - r * CONV_S;
    taps[taps_off + i] = (int)(c * (CONV_HP * CONV_WP) + r * CONV_WP + s);
  }
}

// wt[c, k, r, s] = w[k, c, R-1-r, S-1-s] widened to f32 (T is the weight's storage type here):
// the weight of the stride-1 data gradient computed as a convolution of dy (see conv2d.cpp).
// One work-item per element. Global: K*C*R*S rounded up.
__kernel void conv2d_flip_weights(__global const T_STORAGE* w, ulong w_off, __global float* wt, ulong wt_off,
                                  uint count) {
  const uint i = get_global_id(0);
  if (i >= count) return;
  const uint ck = i / CONV_RS;
  const uint rs = i - ck * CONV_RS;
  const uint c = ck / CONV_K;
  const uint k = ck - c * CONV_K;
  const uint r = rs / CONV_S;
  const uint s = rs - r * CONV_S;
  wt[wt_off + i] = LOAD_T(w, w_off + ((k * CONV_C + c) * CONV_R + (CONV_R - 1 - r)) * CONV_S + (CONV_S - 1 - s));
}
