// Elementwise activations, forward and backward. Operands are (buffer, element offset) pairs
// because tensors live at planned offsets inside a few large arena buffers. Built per storage type
// (-DT_F32|-DT_F16|-DT_BF16, see dtype.clh): x, y, dy and dx are stored as T, arithmetic is fp32.
#define FERRY_WIDE16 1  // LOAD16, STORE16, ROUND16 (dtype.clh)
#include "dtype.clh"
#include "gelu.clh"

__kernel void relu_forward(__global const T_STORAGE* x, ulong x_off, __global T_STORAGE* y, ulong y_off, uint n) {
  const uint i = get_global_id(0);
  if (i >= n) return;
  STORE_T(fmax(LOAD_T(x, x_off + i), 0.0f), y, y_off + i);
}

__kernel void relu_backward(__global const T_STORAGE* x, ulong x_off, __global const T_STORAGE* dy, ulong dy_off,
                            __global T_STORAGE* dx, ulong dx_off, uint n) {
  const uint i = get_global_id(0);
  if (i >= n) return;
  STORE_T(LOAD_T(x, x_off + i) > 0.0f ? LOAD_T(dy, dy_off + i) : 0.0f, dx, dx_off + i);
}

// GELU, exact form: x * Phi(x) with Phi the standard normal CDF.
__kernel void gelu_forward(__global const T_STORAGE* x, ulong x_off, __global T_STORAGE* y, ulong y_off, uint n) {
  const uint i = get_global_id(0);
  if (i >= n) return;
  const float v = LOAD_T(x, x_off + i);
  STORE_T(v * normal_cdf(v), y, y_off + i);
}

// d/dx [x Phi(x)] = Phi(x) + x phi(x), phi the standard normal density.
__kernel void gelu_backward(__global const T_STORAGE* x, ulong x_off, __global const T_STORAGE* dy, ulong dy_off,
                            __global T_STORAGE* dx, ulong dx_off, uint n) {
  const uint i = get_global_id(0);
  if (i >= n) return;
  STORE_T(LOAD_T(dy, dy_off + i) * gelu_slope(LOAD_T(x, x_off + i)), dx, dx_off + i);
}

// GELU on CPU devices: a work-item takes 16 consecutive elements as one float16 (normal_cdf16 in
// gelu.clh); elements past the last whole chunk go one by one. Any storage type: narrow elements
// are widened as they are read and rounded as they are stored, lane by lane as LOAD_T and STORE_T.
__kernel void gelu_forward16(__global const T_STORAGE* x, ulong x_off, __global T_STORAGE* y, ulong y_off, uint n) {
  const ulong i = (ulong)get_global_id(0) * 16;  // n may be near 2^32: no uint wraps
  if (i + 16 <= n) {
    const float16 v = LOAD16_T(x, x_off + i);
    STORE16_T(v * normal_cdf16(v), y, y_off + i);
    return;
  }
  for (ulong j = i; j < n; ++j) {
    const float v = LOAD_T(x, x_off + j);
    STORE_T(v * normal_cdf(v), y, y_off + j);
  }
}

__kernel void gelu_backward16(__global const T_STORAGE* x, ulong x_off, __global const T_STORAGE* dy, ulong dy_off,
                              __global T_STORAGE* dx, ulong dx_off, uint n) {
  const ulong i = (ulong)get_global_id(0) * 16;
  if (i + 16 <= n) {
    STORE16_T(LOAD16_T(dy, dy_off + i) * gelu_slope16(LOAD16_T(x, x_off + i)), dx, dx_off + i);
    return;
  }
  for (ulong j = i; j < n; ++j) {
    STORE_T(LOAD_T(dy, dy_off + j) * gelu_slope(LOAD_T(x, x_off + j)), dx, dx_off + j);
  }
}
