// Elementwise utilities: sum, fill, copy. Operands are (buffer, element offset) pairs; `out` of
// add may alias an input, so no pointer is restrict. `add` is built per storage type
// (-DT_F32|-DT_F16|-DT_BF16, see dtype.clh) and sums in fp32; fill and copy are fp32.
#include "dtype.clh"

__kernel void add(__global const T_STORAGE* a, ulong a_off, __global const T_STORAGE* b, ulong b_off,
                  __global T_STORAGE* out, ulong out_off, uint n) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  STORE_T(LOAD_T(a, a_off + i) + LOAD_T(b, b_off + i), out, out_off + i);
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
