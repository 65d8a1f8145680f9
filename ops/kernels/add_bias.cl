// A bias broadcast over the leading axes, out of place: x viewed as a row-major [rows, cols]
// matrix, b as [cols]. Operands are (buffer, element offset) pairs. The gradient of b is the
// column sum of bias.cl (bias_backward).
#include "store16.clh"

// y[r, c] = x[r, c] + b[c], one work-item per element: neighbouring work-items read neighbouring
// elements of x and of b.
__kernel void add_bias(__global const float* x, ulong x_off, __global const float* b, ulong b_off, __global float* y,
                       ulong y_off, uint n, uint cols) {
  const uint i = get_global_id(0);
  if (i >= n) return;
  y[y_off + i] = x[x_off + i] + b[b_off + i % cols];
}

// The same on CPU devices: a work-item per row and 16 columns, read and written as one float16
// (one work-item per element read x at a third of the memory bandwidth on PoCL); columns past the
// last whole 16 of a row one by one. Global: rows * ceil(cols / 16).
__kernel void add_bias16(__global const float* x, ulong x_off, __global const float* b, ulong b_off, __global float* y,
                         ulong y_off, uint n, uint cols) {
  const uint chunks = (cols + 15) / 16;
  const uint k = get_global_id(0);
  const uint r = k / chunks, c0 = (k - r * chunks) * 16;
  const ulong at = (ulong)r * cols + c0;
  if (at >= n) return;
  if (c0 + 16 <= cols) {
    VSTORE16_GLOBAL(vload16(0, x + x_off + at) + vload16(0, b + b_off + c0), y + y_off + at);
    return;
  }
  for (uint c = c0; c < cols; ++c) y[y_off + (ulong)r * cols + c] = x[x_off + (ulong)r * cols + c] + b[b_off + c];
}
