// Elementwise activations, forward and backward. Operands are (buffer, element offset) pairs
// because tensors live at planned offsets inside a few large arena buffers. Built per storage type
// (-DT_F32|-DT_F16|-DT_BF16, see dtype.clh): x, y, dy and dx are stored as T, arithmetic is fp32.
#include "dtype.clh"

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

// The standard normal CDF, Phi(x) = (1 + erf(x / sqrt 2)) / 2, with erf from Abramowitz & Stegun
// 7.1.26 (absolute error below 1.5e-7, under float rounding of the result): one exp and a
// division, which vectorise, where the library erf made GELU ten times the cost of ReLU on PoCL.
inline float normal_cdf(float x) {
  const float z = fabs(x) * M_SQRT1_2_F;
  const float t = 1.0f / fma(0.3275911f, z, 1.0f);
  const float poly =
      t * fma(t, fma(t, fma(t, fma(t, 1.061405429f, -1.453152027f), 1.421413741f), -0.284496736f), 0.254829592f);
  const float erf_abs = 1.0f - poly * exp(-z * z);
  return 0.5f * (1.0f + copysign(erf_abs, x));
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
  const float v = LOAD_T(x, x_off + i);
  const float cdf = normal_cdf(v);
  const float pdf = 0.3989422804014327f * exp(-0.5f * v * v);
  STORE_T(LOAD_T(dy, dy_off + i) * (cdf + v * pdf), dx, dx_off + i);
}

#if defined(T_F32)
// GELU on CPU devices: a work-item takes 16 consecutive elements as one float16, since PoCL runs a
// vector exp and division about ten times faster than 16 scalar ones (see softmax.cl). The same
// arithmetic as normal_cdf, lane by lane; elements past the last whole chunk go one by one.
inline float16 normal_cdf16(float16 x) {
  const float16 z = fabs(x) * M_SQRT1_2_F;
  const float16 t = 1.0f / fma(0.3275911f, z, 1.0f);
  const float16 poly =
      t * fma(t, fma(t, fma(t, fma(t, 1.061405429f, -1.453152027f), 1.421413741f), -0.284496736f), 0.254829592f);
  const float16 erf_abs = 1.0f - poly * exp(-z * z);
  return 0.5f * (1.0f + copysign(erf_abs, x));
}

__kernel void gelu_forward16(__global const float* x, ulong x_off, __global float* y, ulong y_off, uint n) {
  const uint i = get_global_id(0) * 16;
  if (i + 16 <= n) {
    const float16 v = vload16(0, x + x_off + i);
    vstore16(v * normal_cdf16(v), 0, y + y_off + i);
    return;
  }
  for (uint j = i; j < n; ++j) {
    const float v = x[x_off + j];
    y[y_off + j] = v * normal_cdf(v);
  }
}

__kernel void gelu_backward16(__global const float* x, ulong x_off, __global const float* dy, ulong dy_off,
                              __global float* dx, ulong dx_off, uint n) {
  const uint i = get_global_id(0) * 16;
  if (i + 16 <= n) {
    const float16 v = vload16(0, x + x_off + i);
    const float16 pdf = 0.3989422804014327f * exp(-0.5f * v * v);
    vstore16(vload16(0, dy + dy_off + i) * (normal_cdf16(v) + v * pdf), 0, dx + dx_off + i);
    return;
  }
  for (uint j = i; j < n; ++j) {
    const float v = x[x_off + j];
    const float pdf = 0.3989422804014327f * exp(-0.5f * v * v);
    dx[dx_off + j] = dy[dy_off + j] * (normal_cdf(v) + v * pdf);
  }
}
#endif
