// Max pooling over NCHW planes, square window and stride, no padding. The geometry is compiled
// in (-D POOL_H, POOL_W, POOL_P, POOL_Q, POOL_WINDOW, POOL_STRIDE) so index divisions become
// multiplies. argmax holds the index of each maximum within its (n, c) plane (-1 for none: with
// -DPOOL_RELU=1, a fused ReLU, windows whose maximum is not positive). x, y, dx and dy are
// stored as T (-DT_F16 / -DT_BF16, f32 without: dtype.clh).
#define FERRY_WIDE16 1  // LOAD16_T, STORE16_T, LOAD8_T, STORE8_T (dtype.clh) for the 2 x 2 rows' vector paths
#include "dtype.clh"

#define POOL_HW (POOL_H * POOL_W)
#define POOL_PQ (POOL_P * POOL_Q)

// Stores one window's maximum and its argmax. With the ReLU fused, a window whose maximum is not
// positive (or is NaN) outputs 0 and routes no gradient (argmax -1 matches no element in backward).
inline void store_pooled(float best_v, uint best, __global T_STORAGE* y, ulong yo, __global int* argmax, ulong ao) {
#if POOL_RELU
  const int positive = best_v > 0.0f;
  STORE_T(positive ? best_v : 0.0f, y, yo);
  argmax[ao] = positive ? (int)best : -1;
#else
  STORE_T(best_v, y, yo);
  argmax[ao] = (int)best;
#endif
}

// One work-item per output element; ties go to the first maximum in row-major window order.
__kernel void maxpool2d_forward(__global const T_STORAGE* x, ulong x_off, __global T_STORAGE* y, ulong y_off,
                                __global int* argmax, ulong argmax_off, uint count) {
  const uint i = get_global_id(0);
  if (i >= count) return;
  const uint nc = i / POOL_PQ;
  const uint pq = i - nc * POOL_PQ;
  const uint p = pq / POOL_Q;
  const uint q = pq - p * POOL_Q;
  const ulong plane = x_off + (ulong)nc * POOL_HW;
  uint best = p * POOL_STRIDE * POOL_W + q * POOL_STRIDE;
  float best_v = LOAD_T(x, plane + best);
  for (uint a = 0; a < POOL_WINDOW; ++a) {
    for (uint b = 0; b < POOL_WINDOW; ++b) {
      const uint idx = (p * POOL_STRIDE + a) * POOL_W + q * POOL_STRIDE + b;
      const float v = LOAD_T(x, plane + idx);
      // Selects, not a branch, so that PoCL vectorises across work-items.
      const int gt = v > best_v;
      best = gt ? idx : best;
      best_v = gt ? v : best_v;
    }
  }
  store_pooled(best_v, best, y, y_off + i, argmax, argmax_off + i);
}

// One work-item per input element: the sum of dy over the windows that contain it and chose it
// as their maximum, in ascending (p, q) order. No atomics; deterministic for overlapping windows.
__kernel void maxpool2d_backward(__global const T_STORAGE* dy, ulong dy_off, __global const int* argmax,
                                 ulong argmax_off, __global T_STORAGE* dx, ulong dx_off, uint count) {
  const uint i = get_global_id(0);
  if (i >= count) return;
  const uint nc = i / POOL_HW;
  const uint hw = i - nc * POOL_HW;
  const int h = (int)(hw / POOL_W);
  const int w = (int)(hw - (uint)h * POOL_W);
#if POOL_WINDOW == POOL_STRIDE
  // Windows that tile the plane: an element lies in at most one, so no loop (branch-free, which
  // lets PoCL vectorise across work-items; the general loop below measured ~4x slower).
  const uint p = (uint)h / POOL_STRIDE, q = (uint)w / POOL_STRIDE;
  const ulong o = (ulong)nc * POOL_PQ + min(p, (uint)POOL_P - 1) * POOL_Q + min(q, (uint)POOL_Q - 1);
  const float g = LOAD_T(dy, dy_off + o);
  const float acc = (p < POOL_P && q < POOL_Q && argmax[argmax_off + o] == (int)hw) ? g : 0.0f;
  STORE_T(acc, dx, dx_off + i);
#else
  // Windows p with p*stride <= h < p*stride + window.
  const int p_lo = max(0, (h - POOL_WINDOW + POOL_STRIDE) / POOL_STRIDE);
  const int p_hi = min(POOL_P - 1, h / POOL_STRIDE);
  const int q_lo = max(0, (w - POOL_WINDOW + POOL_STRIDE) / POOL_STRIDE);
  const int q_hi = min(POOL_Q - 1, w / POOL_STRIDE);
  const ulong plane = (ulong)nc * POOL_PQ;
  float acc = 0.0f;
  for (int p = p_lo; p <= p_hi; ++p) {
    for (int q = q_lo; q <= q_hi; ++q) {
      const ulong o = plane + (uint)(p * POOL_Q + q);
      if (argmax[argmax_off + o] == (int)hw) acc += LOAD_T(dy, dy_off + o);
    }
  }
  STORE_T(acc, dx, dx_off + i);
#endif
}

// ---- 2x2 windows, stride 2: one work-item per output row ---------------------------------------
// The common pool, in row kernels: per chunk of 8 outputs two vload16 per input row split into
// even and odd columns (f32; narrow types and the tail go element by element). The per-element
// kernels above read every window through 4 strided gathers and ran at about a third of the
// copy bandwidth. Same results bit for bit: ties go to the first maximum in row-major order.
#if POOL_WINDOW == 2 && POOL_STRIDE == 2

// Output (p, q) of plane nc from the element kernel's rule, for tails and narrow types.
inline void pool2_one(__global const T_STORAGE* x, ulong plane, uint p, uint q, __global T_STORAGE* y, ulong yo,
                      __global int* argmax, ulong ao) {
  const uint i00 = 2 * p * POOL_W + 2 * q;
  uint best = i00;
  float best_v = LOAD_T(x, plane + i00);
  const uint idx[3] = {i00 + 1, i00 + POOL_W, i00 + POOL_W + 1};
  for (uint j = 0; j < 3; ++j) {
    const float v = LOAD_T(x, plane + idx[j]);
    if (v > best_v) {
      best = idx[j];
      best_v = v;
    }
  }
  store_pooled(best_v, best, y, yo, argmax, ao);
}

__kernel void maxpool2x2_forward_rows(__global const T_STORAGE* x, ulong x_off, __global T_STORAGE* y, ulong y_off,
                                      __global int* argmax, ulong argmax_off, uint rows) {
  const uint row = get_global_id(0);  // nc * P + p
  if (row >= rows) return;
  const uint nc = row / POOL_P;
  const uint p = row - nc * POOL_P;
  const ulong plane = x_off + (ulong)nc * POOL_HW;
  const ulong yo = y_off + (ulong)row * POOL_Q, ao = argmax_off + (ulong)row * POOL_Q;
  uint q = 0;
  // Eight windows at a time, every storage type (a narrow one widened 16 wide); the maxima are
  // stored values, so storing them back narrow is exact.
  const int8 lanes = (int8)(0, 2, 4, 6, 8, 10, 12, 14);
  for (; q + 8 <= POOL_Q; q += 8) {
    const uint i00 = 2 * p * POOL_W + 2 * q;
    const float16 r0 = LOAD16_T(x, plane + i00), r1 = LOAD16_T(x, plane + i00 + POOL_W);
    const int8 base = (int8)(i00) + lanes;
    float8 best = r0.even;
    int8 idx = base;
    int8 gt = isgreater(r0.odd, best);
    best = select(best, r0.odd, gt);
    idx = select(idx, base + 1, gt);
    gt = isgreater(r1.even, best);
    best = select(best, r1.even, gt);
    idx = select(idx, base + POOL_W, gt);
    gt = isgreater(r1.odd, best);
    best = select(best, r1.odd, gt);
    idx = select(idx, base + POOL_W + 1, gt);
#if POOL_RELU
    const int8 positive = isgreater(best, (float8)(0.0f));
    best = select((float8)(0.0f), best, positive);
    idx = select((int8)(-1), idx, positive);
#endif
    STORE8_T(best, y, yo + q);
    vstore8(idx, 0, argmax + ao + q);
  }
  for (; q < POOL_Q; ++q) pool2_one(x, plane, p, q, y, yo + q, argmax, ao + q);
}

// dx rows 2p and 2p+1 of plane nc from output row p: dy where the argmax points, 0 elsewhere;
// the row with p = P-1 also zeroes the input rows no window covers (odd H), and every row the
// column no window covers (odd W).
__kernel void maxpool2x2_backward_rows(__global const T_STORAGE* dy, ulong dy_off, __global const int* argmax,
                                       ulong argmax_off, __global T_STORAGE* dx, ulong dx_off, uint rows) {
  const uint row = get_global_id(0);
  if (row >= rows) return;
  const uint nc = row / POOL_P;
  const uint p = row - nc * POOL_P;
  const ulong plane = dx_off + (ulong)nc * POOL_HW;
  const ulong go = dy_off + (ulong)row * POOL_Q, ao = argmax_off + (ulong)row * POOL_Q;
  const uint h0 = 2 * p;
  uint q = 0;
  // Eight windows at a time, every storage type (the gradients routed unchanged: exact narrow).
  const int8 lanes = (int8)(0, 2, 4, 6, 8, 10, 12, 14);
  for (; q + 8 <= POOL_Q; q += 8) {
    const float8 g = LOAD8_T(dy, go + q);
    const int8 a = vload8(0, argmax + ao + q);
    const int8 base = (int8)(h0 * POOL_W + 2 * q) + lanes;
    const float8 zero = (float8)(0.0f);
    const float8 v00 = select(zero, g, a == base), v01 = select(zero, g, a == base + 1);
    const float8 v10 = select(zero, g, a == base + POOL_W), v11 = select(zero, g, a == base + POOL_W + 1);
    const uint16 interleave = (uint16)(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    STORE16_T(shuffle2(v00, v01, interleave), dx, plane + h0 * POOL_W + 2 * q);
    STORE16_T(shuffle2(v10, v11, interleave), dx, plane + (h0 + 1) * POOL_W + 2 * q);
  }
  for (; q < POOL_Q; ++q) {
    const float g = LOAD_T(dy, go + q);
    const int a = argmax[ao + q];
    for (uint i = 0; i < 2; ++i) {
      for (uint j = 0; j < 2; ++j) {
        const uint at = (h0 + i) * POOL_W + 2 * q + j;
        STORE_T(a == (int)at ? g : 0.0f, dx, plane + at);
      }
    }
  }
  for (uint i = 0; i < 2 && 2 * POOL_Q < POOL_W; ++i) STORE_T(0.0f, dx, plane + (h0 + i) * POOL_W + POOL_W - 1);
  if (p == POOL_P - 1) {
    for (uint h = 2 * POOL_P; h < POOL_H; ++h) {
      for (uint w = 0; w < POOL_W; ++w) STORE_T(0.0f, dx, plane + h * POOL_W + w);
    }
  }
}

#endif  // POOL_WINDOW == 2 && POOL_STRIDE == 2
