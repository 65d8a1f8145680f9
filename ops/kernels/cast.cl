// Conversions between storage types, and int8 quantization with one fp32 scale per channel.
// Operands are (buffer, element offset) pairs. Built with -DS_<from> -DD_<to> (see dtype.clh)
// for `cast`, with a single type for `cast_identity` (-DS_<type>), and with no options for the
// int8 kernels.
#include "dtype.clh"

// out[i] = in[i] converted: exact widening, round-to-nearest-even narrowing (vstore_half_rte for
// f16, float_to_bf16_rte for bf16).
__kernel void cast(__global const S_STORAGE* in, ulong in_off, __global D_STORAGE* out, ulong out_off, uint n) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  STORE_D(LOAD_S(in, in_off + i), out, out_off + i);
}

// A gradient crossing a precision boundary under loss scaling (fp16 mixed precision): out[i] =
// in[i] * scale, converted. scale is the loss scale (into the narrow type) or its inverse (back to
// f32), a power of two, so the product itself is exact unless it overflows.
__kernel void cast_scaled(__global const S_STORAGE* in, ulong in_off, __global D_STORAGE* out, ulong out_off, uint n,
                          float scale) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  STORE_D(LOAD_S(in, in_off + i) * scale, out, out_off + i);
}

// from == to: a bit copy (a NaN keeps its payload, which a round trip through fp32 might not).
__kernel void cast_identity(__global const S_RAW* in, ulong in_off, __global S_RAW* out, ulong out_off, uint n) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  out[out_off + i] = in[in_off + i];
}

// ---- int8, symmetric, per channel ------------------------------------------------------------
// The tensor is viewed as [outer, channels, inner]: element (o, c, i) is at (o*channels + c)*inner
// + i. scale[c] = absmax_c / 127, q = round-half-even(x / scale[c]) clamped to [-127, 127] (0 for
// a channel of zeros and for NaN), x' = q * scale[c].
//
// Every division is correctly rounded in software (div_rn from dtype.clh: integer division of the
// significands), so the result is the same bits as the host's IEEE division on every device, with
// or without -cl-fp32-correctly-rounded-divide-sqrt, and whatever the device's denormal mode. The
// absmax and the tests on the scale are on the bits for the same reason.

// One work-item per channel: scale[c] = (max |x| over the channel) / 127; NaN elements are skipped
// (as fmax does), an infinity gives an infinite scale.
__kernel void quantize_i8_scales(__global const float* x, ulong x_off, __global float* scale, ulong scale_off,
                                 uint outer, uint channels, uint inner) {
  const uint c = get_global_id(0);
  if (c >= channels) return;
  uint amax = 0;  // |x| as bits: for non-NaN values the integer order is the float order
  for (uint o = 0; o < outer; ++o) {
    const ulong base = x_off + ((ulong)o * channels + c) * inner;
    for (uint i = 0; i < inner; ++i) {
      const uint a = as_uint(x[base + i]) & 0x7fffffffu;
      if (a <= 0x7f800000u && a > amax) amax = a;
    }
  }
  scale[scale_off + c] = amax == 0x7f800000u ? INFINITY : div_rn(as_float(amax), 127.0f);
}

__kernel void quantize_i8(__global const float* x, ulong x_off, __global const float* scale, ulong scale_off,
                          __global char* q, ulong q_off, uint channels, uint inner, uint n) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  const float s = scale[scale_off + (i / inner) % channels];
  const float v = x[x_off + i];
  // Tested on the bits, so that a subnormal scale counts as nonzero on devices that flush them.
  const uint su = as_uint(s), vu = as_uint(v) & 0x7fffffffu;
  float t = 0.0f;
  if (su != 0u && su < 0x7f800000u && vu < 0x7f800000u) t = clamp(rint(div_rn(v, s)), -127.0f, 127.0f);
  q[q_off + i] = (char)(int)t;
}

__kernel void dequantize_i8(__global const char* q, ulong q_off, __global const float* scale, ulong scale_off,
                            __global float* x, ulong x_off, uint channels, uint inner, uint n) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  x[x_off + i] = (float)q[q_off + i] * scale[scale_off + (i / inner) % channels];
}
