// Elementwise activations, forward and backward. Operands are (buffer, element offset) pairs
// because tensors live at planned offsets inside a few large arena buffers.

__kernel void relu_forward(__global const float* x, ulong x_off, __global float* y, ulong y_off, uint n) {
  const uint i = get_global_id(0);
  if (i >= n) return;
  y[y_off + i] = fmax(x[x_off + i], 0.0f);
}

__kernel void relu_backward(__global const float* x, ulong x_off, __global const float* dy, ulong dy_off,
                            __global float* dx, ulong dx_off, uint n) {
  const uint i = get_global_id(0);
  if (i >= n) return;
  dx[dx_off + i] = x[x_off + i] > 0.0f ? dy[dy_off + i] : 0.0f;
}

// GELU, exact form: x * Phi(x) with Phi the standard normal CDF.
__kernel void gelu_forward(__global const float* x, ulong x_off, __global float* y, ulong y_off, uint n) {
  const uint i = get_global_id(0);
  if (i >= n) return;
  const float v = x[x_off + i];
  y[y_off + i] = 0.5f * v * (1.0f + erf(v * M_SQRT1_2_F));
}

// d/dx [x Phi(x)] = Phi(x) + x phi(x), phi the standard normal density.
__kernel void gelu_backward(__global const float* x, ulong x_off, __global const float* dy, ulong dy_off,
                            __global float* dx, ulong dx_off, uint n) {
  const uint i = get_global_id(0);
  if (i >= n) return;
  const float v = x[x_off + i];
  const float cdf = 0.5f * (1.0f + erf(v * M_SQRT1_2_F));
  const float pdf = 0.3989422804014327f * exp(-0.5f * v * v);
  dx[dx_off + i] = dy[dy_off + i] * (cdf + v * pdf);
}
