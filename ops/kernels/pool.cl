// Max pooling over NCHW planes, square window and stride, no padding. The geometry is compiled
// in (-D POOL_H, POOL_W, POOL_P, POOL_Q, POOL_WINDOW, POOL_STRIDE) so index divisions become
// multiplies. argmax holds the index of each maximum within its (n, c) plane (-1 for none: with
// -DPOOL_RELU=1, a fused ReLU, windows whose maximum is not positive). x, y, dx and dy are
// stored as T (-DT_F16 / -DT_BF16, f32 without: dtype.clh).
#include "dtype.clh"

#define POOL_HW (POOL_H * POOL_W)
#define POOL_PQ (POOL_P * POOL_Q)

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
#if POOL_RELU
  // ReLU fused: a window whose maximum is not positive (or is NaN) outputs 0 and routes no
  // gradient (argmax -1 matches no element in backward).
  const int positive = best_v > 0.0f;
  STORE_T(positive ? best_v : 0.0f, y, y_off + i);
  argmax[argmax_off + i] = positive ? (int)best : -1;
#else
  STORE_T(best_v, y, y_off + i);
  argmax[argmax_off + i] = (int)best;
#endif
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
