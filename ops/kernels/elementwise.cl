// Elementwise utilities: sum, fill, copy. Operands are (buffer, element offset) pairs; `out` of
// add may alias an input, so no pointer is restrict. `add` and `add16` are built per storage type
// (-DT_F32|-DT_F16|-DT_BF16, see dtype.clh) and sum in fp32; fill and copy are fp32.
#define FERRY_WIDE16 1  // LOAD16, STORE16 (dtype.clh)
#include "dtype.clh"

__kernel void add(__global const T_STORAGE* a, ulong a_off, __global const T_STORAGE* b, ulong b_off,
                  __global T_STORAGE* out, ulong out_off, uint n) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  STORE_T(LOAD_T(a, a_off + i) + LOAD_T(b, b_off + i), out, out_off + i);
}

// add on CPU devices: 16 consecutive elements per work-item as one float16, the elements past the
// last whole 16 one by one (per element, PoCL read f32 operands at about half the bandwidth, and
// f16 ones, widened and rounded lane by lane, took 8x bf16's time).
__kernel void add16(__global const T_STORAGE* a, ulong a_off, __global const T_STORAGE* b, ulong b_off,
                    __global T_STORAGE* out, ulong out_off, uint n) {
  const size_t i = get_global_id(0) * 16;
  if (i + 16 <= n) {
    STORE16_T(LOAD16_T(a, a_off + i) + LOAD16_T(b, b_off + i), out, out_off + i);
    return;
  }
  for (size_t j = i; j < n; ++j) STORE_T(LOAD_T(a, a_off + j) + LOAD_T(b, b_off + j), out, out_off + j);
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
