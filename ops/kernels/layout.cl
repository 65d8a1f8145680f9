// Layout and elementwise kernels for transformers: permute (a transpose copy of up to four axes),
// elementwise product and scaling. Operands are (buffer, element offset) pairs. permute is built
// per storage type (-DT_F32|-DT_F16|-DT_BF16, see dtype.clh) and copies bits; mul and scale are
// fp32 (they come from the f32 build).
#include "dtype.clh"

// y = x with its axes reordered, both padded to four axes with leading extents of 1. Work-item i
// writes element i of y (consecutive work-items write consecutive elements: coalesced writes),
// whose multi-index (c0, c1, c2, c3) over y's extents (_, d1, d2, d3) reads x at
// c0*s0 + c1*s1 + c2*s2 + c3*s3, where s_k is the stride in x of the axis y's axis k comes from.
__kernel void permute(__global const T_RAW* x, ulong x_off, __global T_RAW* y, ulong y_off, uint n, uint d1, uint d2,
                      uint d3, ulong s0, ulong s1, ulong s2, ulong s3) {
  const uint i = get_global_id(0);
  if (i >= n) return;
  uint t = i;
  const uint c3 = t % d3;
  t /= d3;
  const uint c2 = t % d2;
  t /= d2;
  const uint c1 = t % d1;
  const uint c0 = t / d1;
  y[y_off + i] = x[x_off + c0 * s0 + c1 * s1 + c2 * s2 + c3 * s3];
}

// permute when the last axis stays last (st3 = 1): work-item r copies row r of y, d3 contiguous
// elements, from one contiguous row of x. One index computation per row instead of per element,
// and a plain copy loop the compiler vectorises: splitting attention heads moves rows of D.
__kernel void permute_rows(__global const T_RAW* x, ulong x_off, __global T_RAW* y, ulong y_off, uint rows, uint d1,
                           uint d2, uint d3, ulong s0, ulong s1, ulong s2) {
  const uint r = get_global_id(0);
  if (r >= rows) return;
  const uint c2 = r % d2;
  const uint c1 = (r / d2) % d1;
  const uint c0 = r / d2 / d1;
  __global const T_RAW* src = x + x_off + c0 * s0 + c1 * s1 + c2 * s2;
  __global T_RAW* dst = y + y_off + (ulong)r * d3;
  for (uint i = 0; i < d3; ++i) dst[i] = src[i];
}

#ifdef T_F32
#include "transpose16.clh"
// A rows x cols matrix of floats transposed, both multiples of 16, on CPU devices: work-item
// (i, j) moves the 16 x 16 block at rows 16 i, columns 16 j of x to rows 16 j, columns 16 i of y,
// sixteen vector loads, the transpose in registers and sixteen vector stores, where `permute`
// computed an index per element (192 x 768 took 1 ms in PoCL's per-work-item loop).
#define BLOCK_ROW_LOAD(n) float16 r##n = vload16(0, src + (ulong)(n) * cols);
#define BLOCK_ROW_STORE(n) vstore16(r##n, 0, dst + (ulong)(n) * rows);
__kernel void transpose16(__global const float* x, ulong x_off, __global float* y, ulong y_off, uint rows, uint cols) {
  const uint i = get_global_id(0), j = get_global_id(1);
  __global const float* src = x + x_off + (ulong)(16 * i) * cols + 16 * j;
  __global float* dst = y + y_off + (ulong)(16 * j) * rows + 16 * i;
  FOR_16(BLOCK_ROW_LOAD)
  TRANSPOSE16
  FOR_16(BLOCK_ROW_STORE)
}
#endif

__kernel void mul(__global const float* a, ulong a_off, __global const float* b, ulong b_off, __global float* out,
                  ulong out_off, uint n) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  out[out_off + i] = a[a_off + i] * b[b_off + i];
}

__kernel void scale(__global const float* x, ulong x_off, __global float* y, ulong y_off, float factor, uint n) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  y[y_off + i] = x[x_off + i] * factor;
}
