// Direct convolution for few input channels (the first layer of an image model: C = 1 or 3),
// stride 1, forward only. There the GEMM's K = C*R*S is a few dozen, so an implicit GEMM spends its
// time in the epilogue's scattered NCHW stores, not in multiply-adds; here each work-item owns
// DIRECT_KB output channels x 32 consecutive outputs of one output row, held in 2 * DIRECT_KB
// float16 accumulators: per tap, two vector loads of the padded input row and DIRECT_KB scalar
// weights broadcast into fma(), and the results are stored as contiguous runs of the NCHW row.
//
// Geometry from conv2d.cl's defines (-D CONV_C ... CONV_PAD, T storage type for y and the weight:
// under mixed precision both are narrow, else both f32); xp is the padded f32 input written by
// conv2d_pad, with at least 32 floats of slack after it (the second
// vector load of the last row reaches past it; those lanes are never stored).
// Global: (N*P, ceil(K / DIRECT_KB), ceil(Q / 32)); any local size.
#define FERRY_WIDE16 1  // LOAD16_T, STORE16_T (dtype.clh): whole runs of 16 in any storage type
#include "dtype.clh"

#define CONV_HP (CONV_H + 2 * CONV_PAD)
#define CONV_WP (CONV_W + 2 * CONV_PAD)
#define CONV_RS (CONV_R * CONV_S)
#define DIRECT_KB 8

#define FOR_KB(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define ACC_DECL(j) float16 lo##j = 0.0f, hi##j = 0.0f;
// Channels past K read channel K-1's weights (valid memory) and are never stored.
#define W_ROW(j) \
  __global const T_STORAGE* w##j = w + w_off + (ulong)min(k0 + j, (uint)CONV_K - 1) * CONV_C * CONV_RS;
#define ACC_STEP(j)                 \
  {                                 \
    const float16 b = (float16)(LOAD_T(w##j, tap)); \
    lo##j = fma(b, x_lo, lo##j);    \
    hi##j = fma(b, x_hi, hi##j);    \
  }

// Stores `count` (<= 16) lanes of v + bias (ReLU'd with -DCONV_RELU=1) at y[at...].
inline void store_run(float16 v, float bias, __global T_STORAGE* y, ulong at, uint count) {
  v += bias;
#if CONV_RELU
  v = select((float16)(0.0f), v, isgreater(v, (float16)(0.0f)));  // NaN -> 0, as the ReLU
#endif
  if (count == 16) {
    STORE16_T(v, y, at);
    return;
  }
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

__kernel void conv2d_direct_forward(__global const float* xp, ulong xp_off, __global const T_STORAGE* w, ulong w_off,
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

// ---- Weight gradient -------------------------------------------------------------------------
// dw[k, c, r, s] = sum over n, p, q of dy[n, k, p, q] xp[n, c, p + r, q + s], for the same layers
// (few input channels, stride 1; dy and dw in T, f32 or the narrow type of mixed precision): the implicit GEMM's K is the batch's pixels and its packed
// output gradient cost more than the product. Each work-item owns 4 output channels x one kernel
// row (c, r) x all S taps of it, for one chunk of images, in 4*S float16 accumulators over 16
// outputs of a row: per 16 outputs, 4 loads of dy, S of the padded input and 4*S fma(). It writes
// its chunk's partial sums (and, for (c, r) = (0, 0), the bias gradient's); conv2d_direct_weights_sum
// adds the chunks in order (deterministic). S <= 7. Lanes past a row's end read the next row or the
// slack after xp (conv2d_pad zeroes it) and meet zeros of dy.
// Global: (ceil(K / 4), C * R, chunks); part[chunk] holds K*C*R*S weight sums, then K bias sums.
#define DW_KB 4
#define FOR_DW_K(X) X(0) X(1) X(2) X(3)
#define FOR_DW_S(X, j) X(j, 0) X(j, 1) X(j, 2) X(j, 3) X(j, 4) X(j, 5) X(j, 6)
#define DW_ACC_DECL_S(j, s) float16 a##j##_##s = 0.0f;
#define DW_ACC_DECL(j) FOR_DW_S(DW_ACC_DECL_S, j) float16 b##j = 0.0f;
#define DW_STEP_S(j, s) \
  if (s < CONV_S) a##j##_##s = fma(g##j, x##s, a##j##_##s);
#define DW_STEP(j) FOR_DW_S(DW_STEP_S, j) b##j += g##j;
#define DW_X(s) const float16 x##s = s < CONV_S ? vload16(0, in + s) : 0.0f;
#define DW_X_ALL(j, s) DW_X(s)

inline float sum16(float16 v) {
  const float8 h = v.lo + v.hi;
  const float4 f = h.lo + h.hi;
  return (f.x + f.y) + (f.z + f.w);
}

// dy[at .. at + 16) widened to f32, with the lanes from `valid` on zero (the tail of a row: no
// reads past it).
inline float16 load_dy(__global const T_STORAGE* dy, ulong at, uint valid) {
  if (valid >= 16) return LOAD16_T(dy, at);
  float tmp[16];
  for (uint i = 0; i < 16; ++i) tmp[i] = i < valid ? LOAD_T(dy, at + i) : 0.0f;
  return vload16(0, tmp);
}

#define DW_G(j) \
  const float16 g##j = load_dy(dy, dy_off + ((ulong)(n * CONV_K + min(k0 + j, (uint)CONV_K - 1)) * CONV_P + p) * CONV_Q + q0, valid);

#define DW_STORE_S(j, s)                                                                      \
  if (s < CONV_S && k0 + j < CONV_K)                                                          \
    part[part_base + ((ulong)(k0 + j) * CONV_C + c) * CONV_RS + r * CONV_S + s] = sum16(a##j##_##s);
#define DW_STORE(j)                                                    \
  FOR_DW_S(DW_STORE_S, j)                                              \
  if (cr == 0 && k0 + j < CONV_K) part[part_base + (ulong)CONV_K * CONV_C * CONV_RS + k0 + j] = sum16(b##j);

__kernel void conv2d_direct_weights(__global const float* xp, ulong xp_off, __global const T_STORAGE* dy, ulong dy_off,
                                    __global float* part, ulong part_off, uint batch, uint images_per_chunk) {
  const uint k0 = get_global_id(0) * DW_KB;
  const uint cr = get_global_id(1);  // c * R + r
  const uint c = cr / CONV_R, r = cr - (cr / CONV_R) * CONV_R;
  const uint chunk = get_global_id(2);
  const uint n_begin = chunk * images_per_chunk, n_end = min(n_begin + images_per_chunk, batch);
  const ulong part_base = part_off + (ulong)chunk * (CONV_K * CONV_C * CONV_RS + CONV_K);
  FOR_DW_K(DW_ACC_DECL)
  for (uint n = n_begin; n < n_end; ++n) {
    for (uint p = 0; p < CONV_P; ++p) {
      __global const float* row = xp + xp_off + ((ulong)(n * CONV_C + c) * CONV_HP + p + r) * CONV_WP;
      for (uint q0 = 0; q0 < CONV_Q; q0 += 16) {
        const uint valid = CONV_Q - q0;
        FOR_DW_K(DW_G)
        __global const float* in = row + q0;
        FOR_DW_S(DW_X_ALL, 0)
        FOR_DW_K(DW_STEP)
      }
    }
  }
  FOR_DW_K(DW_STORE)
}

// dw (and dbias) = the chunks' partial sums added in chunk order, dw stored in T (rounded to nearest
// even from the f32 sum, as a cast after an f32 product would) and dbias in f32. One work-item per
// element of dw then of dbias. Global: K*C*R*S + K rounded up.
__kernel void conv2d_direct_weights_sum(__global const float* part, ulong part_off, uint chunks,
                                        __global T_STORAGE* dw, ulong dw_off, __global float* dbias, ulong dbias_off,
                                        uint has_bias) {
  const uint i = get_global_id(0);
  const uint weights = CONV_K * CONV_C * CONV_RS;
  if (i >= weights + CONV_K || (i >= weights && !has_bias)) return;
  float acc = 0.0f;
  for (uint ch = 0; ch < chunks; ++ch) acc += part[part_off + (ulong)ch * (weights + CONV_K) + i];
  if (i < weights) {
    STORE_T(acc, dw, dw_off + i);
  } else {
    dbias[dbias_off + i - weights] = acc;
  }
}
