// Direct convolution for few input channels (the first layer of an image model: C = 1 or 3),
// stride 1, forward only. There the GEMM's K = C*R*S is a few dozen, so an implicit GEMM spends its
// time in the epilogue's scattered NCHW stores, not in multiply-adds; here each work-item owns
// DIRECT_KB output channels x 32 consecutive outputs of one output row, held in 2 * DIRECT_KB
// float16 accumulators: per tap, two vector loads of the padded input row and DIRECT_KB scalar
// weights broadcast into fma(), and the results are stored as contiguous runs of the NCHW row.
//
// Geometry from conv2d.cl's defines (-D CONV_C ... CONV_PAD, T storage type for y); xp is the
// padded f32 input written by conv2d_pad, with at least 32 floats of slack after it (the second
// vector load of the last row reaches past it; those lanes are never stored).
// Global: (N*P, ceil(K / DIRECT_KB), ceil(Q / 32)); any local size.
#include "dtype.clh"

#define CONV_HP (CONV_H + 2 * CONV_PAD)
#define CONV_WP (CONV_W + 2 * CONV_PAD)
#define CONV_RS (CONV_R * CONV_S)
#define DIRECT_KB 8

#define FOR_KB(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define ACC_DECL(j) float16 lo##j = 0.0f, hi##j = 0.0f;
// Channels past K read channel K-1's weights (valid memory) and are never stored.
#define W_ROW(j) __global const float* w##j = w + w_off + (ulong)min(k0 + j, (uint)CONV_K - 1) * CONV_C * CONV_RS;
#define ACC_STEP(j)                 \
  {                                 \
    const float16 b = (float16)(w##j[tap]); \
    lo##j = fma(b, x_lo, lo##j);    \
    hi##j = fma(b, x_hi, hi##j);    \
  }

// Stores `count` (<= 16) lanes of v + bias (ReLU'd with -DCONV_RELU=1) at y[at...].
inline void store_run(float16 v, float bias, __global T_STORAGE* y, ulong at, uint count) {
  v += bias;
#if CONV_RELU
  v = select((float16)(0.0f), v, isgreater(v, (float16)(0.0f)));  // NaN -> 0, as the ReLU
#endif
#if T_IS_F32
  if (count == 16) {
    vstore16(v, 0, y + at);
    return;
  }
#endif
  float tmp[16];
  vstore16(v, 0, tmp);
  for (uint i = 0; i < count; ++i) STORE_T(tmp[i], y, at + i);
}

#define ACC_STORE(j)                                                                   \
  if (k0 + j < CONV_K) {                                                               \
    const ulong row = y_off + ((ulong)(n * CONV_K + k0 + j) * CONV_P + p) * CONV_Q + q0; \
    const float bj = has_bias ? bias[bias_off + k0 + j] : 0.0f;                        \
    store_run(lo##j, bj, y, row, min(16u, (uint)CONV_Q - q0));                         \
    if (q0 + 16 < CONV_Q) store_run(hi##j, bj, y, row + 16, min(16u, (uint)CONV_Q - q0 - 16)); \
  }

__kernel void conv2d_direct_forward(__global const float* xp, ulong xp_off, __global const float* w, ulong w_off,
                                    __global const float* bias, ulong bias_off, uint has_bias,
                                    __global T_STORAGE* y, ulong y_off, uint rows) {
  const uint np = get_global_id(0);
  if (np >= rows) return;
  const uint n = np / CONV_P;
  const uint p = np - n * CONV_P;
  const uint k0 = get_global_id(1) * DIRECT_KB;
  const uint q0 = get_global_id(2) * 32;
  FOR_KB(W_ROW)
  FOR_KB(ACC_DECL)
  for (uint c = 0; c < CONV_C; ++c) {
    __global const float* in = xp + xp_off + ((ulong)(n * CONV_C + c) * CONV_HP + p) * CONV_WP + q0;
    for (uint r = 0; r < CONV_R; ++r, in += CONV_WP) {
      for (uint s = 0; s < CONV_S; ++s) {
        const float16 x_lo = vload16(0, in + s), x_hi = vload16(1, in + s);
        const uint tap = (c * CONV_R + r) * CONV_S + s;
        FOR_KB(ACC_STEP)
      }
    }
  }
  FOR_KB(ACC_STORE)
}
