// Elementwise utilities: sum, fill, copy. Operands are (buffer, element offset) pairs; `out` of
// add may alias an input, so no pointer is restrict.

__kernel void add(__global const float* a, ulong a_off, __global const float* b, ulong b_off, __global float* out,
                  ulong out_off, uint n) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  out[out_off + i] = a[a_off + i] + b[b_off + i];
}

__kernel void fill(__global float* out, ulong out_off, float value, uint n) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  out[out_off + i] = value;
}

__kernel void copy(__global const float* in, ulong in_off, __global float* out, ulong out_off, uint n) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  out[out_off + i] = in[in_off + i];
}
