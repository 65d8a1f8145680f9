// A bias broadcast over the leading axes, out of place: x viewed as a row-major [rows, cols]
// matrix, b as [cols]. Operands are (buffer, element offset) pairs. The gradient of b is the
// column sum of bias.cl (bias_backward).

// y[r, c] = x[r, c] + b[c], one work-item per element: neighbouring work-items read neighbouring
// elements of x and of b.
__kernel void add_bias(__global const float* x, ulong x_off, __global const float* b, ulong b_off, __global float* y,
                       ulong y_off, uint n, uint cols) {
  const uint i = get_global_id(0);
  if (i >= n) return;
  y[y_off + i] = x[x_off + i] + b[b_off + i % cols];
}
