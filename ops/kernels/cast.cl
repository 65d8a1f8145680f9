// Conversions between storage types, and int8 quantization with one fp32 scale per channel.
// Operands are (buffer, element offset) pairs. Built with -DS_<from> -DD_<to> (see dtype.clh)
// for `cast`, with a single type for `cast_identity` (-DS_<type>), and with no options for the
// int8 kernels.
#include "dtype.clh"

// out[i] = in[i] converted: exact widening, round-to-nearest-even narrowing (float_to_f16_rte for
// f16, float_to_bf16_rte for bf16: dtype.clh).
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
// The results are the bits the host's IEEE division gives, on every device, with or without
// -cl-fp32-correctly-rounded-divide-sqrt and whatever the device's denormal mode: the scales are
// divided in software (div_rn from dtype.clh: integer division of the significands), the elements
// by the device where its rounding cannot change the integer and in software where it could
// (quantize_one). The absmax and the tests on the scale are on the bits for the same reason.

// |x| as bits, 0 for NaN: for the other values the integer order is the float order, so the absmax
// is an integer max (no branch: CPU devices vectorise it).
inline uint quant_abs_bits(float v) {
  const uint a = as_uint(v) & 0x7fffffffu;
  return a <= 0x7f800000u ? a : 0u;
}

// scale = absmax / 127; an infinite absmax gives an infinite scale.
inline float quant_scale_of(uint amax) {
  return amax == 0x7f800000u ? INFINITY : div_rn(as_float(amax), 127.0f);
}

// CPU devices: one work-item per channel, scale[c] = (max |x| over the channel) / 127; NaN
// elements are skipped (as fmax does). PoCL vectorises it across neighbouring channels.
__kernel void quantize_i8_scales(__global const float* x, ulong x_off, __global float* scale, ulong scale_off,
                                 uint outer, uint channels, uint inner) {
  const uint c = get_global_id(0);
  if (c >= channels) return;
  uint amax = 0;
  for (uint o = 0; o < outer; ++o) {
    const ulong base = x_off + ((ulong)o * channels + c) * inner;
    for (uint i = 0; i < inner; ++i) amax = max(amax, quant_abs_bits(x[base + i]));
  }
  scale[scale_off + c] = quant_scale_of(amax);
}

// GPUs: the same scales from work-groups of (TC, TR) work-items, which fill a GPU where a work-item
// per channel would not (a Linear weight of 4096 outputs is 4096 work-items, each waiting on 4096
// loads in turn). With inner == 1 (a Linear weight [in, out]) a work-group owns TC neighbouring
// channels and row lane j takes rows j, j + TR, ... (neighbouring work-items read neighbouring
// floats); otherwise (TC = 1) it owns one channel and its lanes take every TR-th element of each of
// the channel's runs of `inner`. The lanes' maxima meet in local memory by a tree (TR a power of
// two). A max is exact in any order, so the scales are those of the kernel above, bit for bit.
__kernel void quantize_i8_scales_lanes(__global const float* x, ulong x_off, __global float* scale, ulong scale_off,
                                       uint outer, uint channels, uint inner, __local uint* partial) {
  const uint lc = get_local_id(0), lr = get_local_id(1);
  const uint tc = get_local_size(0), tr = get_local_size(1);
  const uint c = get_global_id(0);
  uint amax = 0;
  if (c < channels) {
    if (inner == 1) {
      // Four loads in flight before their maxima: a lane's walk waits on latency, not bandwidth.
      const ulong step = (ulong)tr * channels;
      ulong at = x_off + (ulong)lr * channels + c;
      uint o = lr;
      for (; o + 3 * tr < outer; o += 4 * tr, at += 4 * step) {
        const float v0 = x[at], v1 = x[at + step], v2 = x[at + 2 * step], v3 = x[at + 3 * step];
        amax = max(max(amax, quant_abs_bits(v0)), quant_abs_bits(v1));
        amax = max(max(amax, quant_abs_bits(v2)), quant_abs_bits(v3));
      }
      for (; o < outer; o += tr, at += step) amax = max(amax, quant_abs_bits(x[at]));
    } else {
      for (uint o = 0; o < outer; ++o) {
        const ulong base = x_off + ((ulong)o * channels + c) * inner;
        for (uint i = lr; i < inner; i += tr) amax = max(amax, quant_abs_bits(x[base + i]));
      }
    }
  }
  partial[lr * tc + lc] = amax;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (uint span = tr / 2; span > 0; span /= 2) {
    if (lr < span) partial[lr * tc + lc] = max(partial[lr * tc + lc], partial[(lr + span) * tc + lc]);
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (lr == 0 && c < channels) scale[scale_off + c] = quant_scale_of(partial[lc]);
}

// The element kernels see the tensor as [rows, cols], one work-item an element (dim 0 along cols,
// dim 1 along rows): with inner == 1 (a Linear weight [in, out], whose channels are its columns)
// rows are the outer index and cols the channels; otherwise a row is an (outer, channel) pair and
// cols the inner extent. Either way a work-item finds its channel without a division per element.
inline uint quant_channel(uint row, uint j, uint channels, uint inner) {
  return inner == 1 ? j : row % channels;
}

// round-half-even(v / s) clamped to [-127, 127]; 0 for a zero, negative, infinite or NaN scale and
// a value that is not finite.
// QUANT_FP64 (the host sets it for devices with doubles and float denormals): the quotient taken in
// double and rounded once to float is the IEEE float quotient (53 >= 2 * 24 + 2 bits, so rounding
// twice cannot differ for a division), subnormal operands included; no branch per element, so CPU
// devices vectorise it.
// Otherwise the device's float division is within a few ulp of the IEEE quotient (2.5 in OpenCL's
// full profile), far less than 2^-12 below 128, so away from the half-integers, where the two could
// round to different integers, its rounded value is the IEEE quotient's, and a quotient of 128 or
// more clamps either way. The rest (a subnormal operand, which a device may flush, or a quotient
// within 2^-12 of a half-integer) takes div_rn. Tests stand in for a device whose division is
// QUANT_DIV_ERROR_ULPS ulp off (up or down by the value's last bit), and set QUANT_MARGIN to 0 to
// see such a device fail without the margin.
#ifdef QUANT_FP64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
inline char quantize_one(float v, float s) {
  const uint su = as_uint(s), vu = as_uint(v) & 0x7fffffffu;
  const float t = clamp(rint((float)((double)v / (double)s)), -127.0f, 127.0f);
  return su != 0u && su < 0x7f800000u && vu < 0x7f800000u ? (char)(int)t : (char)0;
}
#else
#ifndef QUANT_MARGIN
#define QUANT_MARGIN 0x1p-12f
#endif
inline char quantize_one(float v, float s) {
  const uint su = as_uint(s), vu = as_uint(v) & 0x7fffffffu;
  if (su == 0u || su >= 0x7f800000u || vu >= 0x7f800000u) return 0;
  if (su >= 0x00800000u && (vu >= 0x00800000u || vu == 0u)) {
    float a = v / s;
#ifdef QUANT_DIV_ERROR_ULPS
    if (a != 0.0f) a = as_float(as_uint(a) + ((vu & 1u) ? (uint)QUANT_DIV_ERROR_ULPS : (uint)-QUANT_DIV_ERROR_ULPS));
#endif
    if (fabs(a) >= 128.0f) return a > 0.0f ? (char)127 : (char)-127;
    if (fabs(a - floor(a) - 0.5f) > QUANT_MARGIN) return (char)(int)clamp(rint(a), -127.0f, 127.0f);
  }
  return (char)(int)clamp(rint(div_rn(v, s)), -127.0f, 127.0f);
}
#endif

__kernel void quantize_i8(__global const float* x, ulong x_off, __global const float* scale, ulong scale_off,
                          __global char* q, ulong q_off, uint cols, uint channels, uint inner) {
  const uint j = get_global_id(0), row = get_global_id(1);
  if (j >= cols) return;
  const ulong i = (ulong)row * cols + j;
  q[q_off + i] = quantize_one(x[x_off + i], scale[scale_off + quant_channel(row, j, channels, inner)]);
}

__kernel void dequantize_i8(__global const char* q, ulong q_off, __global const float* scale, ulong scale_off,
                            __global float* x, ulong x_off, uint cols, uint channels, uint inner) {
  const uint j = get_global_id(0), row = get_global_id(1);
  if (j >= cols) return;
  const ulong i = (ulong)row * cols + j;
  x[x_off + i] = (float)q[q_off + i] * scale[scale_off + quant_channel(row, j, channels, inner)];
}
