// Conversions between storage dtypes (f32, f16, bf16) and symmetric int8 quantization with one
// fp32 scale per output channel. The kernels are in ops/kernels/cast.cl; the storage helpers they
// use are in ops/kernels/dtype.clh.
//
// Narrowing (f32 -> f16, f32 -> bf16, f16 <-> bf16 through f32) rounds to nearest, ties to even:
// values past the largest finite value become inf, subnormals are rounded like any other value,
// NaN stays NaN. Widening is exact. Identity casts copy the bits.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>

#include "ferry/ops/launch.hpp"
#include "ferry/ops/types.hpp"

namespace ferry::ops {

// Whether cast() converts `from` to `to`: every pair among f32, f16 and bf16, identity included.
bool cast_supported(DType from, DType to);

// Loss scaling at a precision boundary (mixed precision with fp16): a gradient cast into a narrow
// type is multiplied by StepInfo::loss_scale, one cast back to f32 by its inverse, read when the
// launch is enqueued. With a scale of 1 both are plain casts.
enum class CastScale : std::uint8_t { none, loss_scale, inverse_loss_scale };

// out[i] = in[i] converted from `from` to `to` (times the loss scale or its inverse, `scale`), n
// elements; in and out are in elements of their own dtype (DeviceSpan offsets in bytes, aligned to
// the element size). Throws std::invalid_argument naming the pair when !cast_supported(from, to).
// in and out must not overlap unless they are the same span of an identity cast.
LaunchList cast(OpEnv& env, DType from, DType to, DeviceSpan in, DeviceSpan out, std::size_t n,
                CastScale scale = CastScale::none);
// The factor `scale` stands for in this step.
float cast_factor(CastScale scale, const StepInfo& step);

// How a tensor splits into channels for per-channel quantization: it is viewed as
// [outer, channels, inner], so element (o, c, i) is at flat index (o * channels + c) * inner + i
// and channel c has outer * inner elements.
struct QuantLayout {
  std::size_t outer = 1, channels = 1, inner = 1;
  std::size_t elems() const { return outer * channels * inner; }
  // A Linear weight [in, out] (y = x w): one scale per output column.
  static QuantLayout linear_weight(std::size_t in, std::size_t out) { return {in, out, 1}; }
  // A conv weight [K, C, R, S]: one scale per output channel k.
  static QuantLayout conv_weight(std::size_t k, std::size_t c, std::size_t r, std::size_t s) {
    return {1, k, c * r * s};
  }
  bool operator==(const QuantLayout&) const = default;
};

// Symmetric absmax quantization per channel: scales[c] = max |x| over channel c / 127 (NaN
// elements skipped; a channel of zeros gets scale 0), q = round-half-even(x / scales[c]) clamped
// to [-127, 127], and q = 0 where the scale is 0 or infinite or x is not finite. x is f32
// (layout.elems() elements), q is i8 (same count), scales is f32 (layout.channels). The device
// result is bit-identical to ref::quantize_i8 on every device (each quotient is the IEEE one:
// ops/kernels/cast.cl). Two launches: the scales, then the elements.
LaunchList quantize_i8(OpEnv& env, DeviceSpan x, DeviceSpan q, DeviceSpan scales, QuantLayout layout);
// x = q * scales[c] in f32.
LaunchList dequantize_i8(OpEnv& env, DeviceSpan q, DeviceSpan scales, DeviceSpan x, QuantLayout layout);

namespace ref {

// IEEE binary16 <-> binary32, on the bits. half_to_float is exact (a NaN keeps its sign and
// payload and becomes quiet); float_to_half rounds to nearest even as vstore_half_rte does (a NaN
// becomes a quiet NaN with the sign and top payload bits; devices may choose another NaN).
// Without branches, so that loops of them vectorise (the host lane's casts, ops::cast_host). Half
// to float: the half's exponent and mantissa placed as a float's and scaled by 2^112 (exact,
// subnormals included: a product by a power of two), inf and NaN by a select.
inline float half_to_float(std::uint16_t h) {
  const std::uint32_t em = h & 0x7fffu;
  const std::uint32_t scaled = std::bit_cast<std::uint32_t>(std::bit_cast<float>(em << 13) * 0x1p112f);
  const std::uint32_t special = 0x7f800000u | (em << 13) | (em > 0x7c00u ? 0x400000u : 0u);
  return std::bit_cast<float>((em >= 0x7c00u ? special : scaled) | (static_cast<std::uint32_t>(h & 0x8000u) << 16));
}

// A normal half rebiases the exponent and rounds off 13 bits; a subnormal one (and zero) is what
// the float addition x + 0.5 rounds to in units of 2^-24 (its ulp there), which is RNE(x / 2^-24)
// by the FPU's own rounding; the same bits as the branching form for all 2^32 inputs (checked).
inline std::uint16_t float_to_half(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  const std::uint32_t r = a - (112u << 23);
  const std::uint32_t normal = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;
  const std::uint32_t subnormal = std::bit_cast<std::uint32_t>(std::bit_cast<float>(a) + 0.5f) - 0x3f000000u;
  const std::uint32_t nan = 0x7e00u | ((a >> 13) & 0x3ffu);
  const std::uint32_t h = a > 0x7f800000u    ? nan
                          : a >= 0x477ff000u ? 0x7c00u  // >= 65520: inf
                          : a >= 0x38800000u ? normal
                                             : subnormal;
  return static_cast<std::uint16_t>(sign | h);
}

// bfloat16 (the top 16 bits of a binary32) <-> binary32, as dtype.clh does it on the device.
inline float bf16_to_float(std::uint16_t b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

inline std::uint16_t float_to_bf16(float f) {  // a NaN stays a (quiet) NaN; no branch
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet_nan = (u >> 16) | 0x0040u;
  return static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// One element of storage type `t` (f32, f16, bf16) at p[i], as a float, and back (rounded).
float load_float(DType t, const void* p, std::size_t i);
void store_float(DType t, float v, void* p, std::size_t i);

// cast() on host memory: n elements of `from` at `in` to `to` at `out`, each times `factor`.
// Throws like cast().
void cast(DType from, DType to, const void* in, void* out, std::size_t n, float factor = 1.0f);

// quantize_i8() / dequantize_i8() on host memory. Throws std::invalid_argument when a span's size
// does not match the layout.
void quantize_i8(std::span<const float> x, QuantLayout layout, std::span<std::int8_t> q, std::span<float> scales);
void dequantize_i8(std::span<const std::int8_t> q, std::span<const float> scales, QuantLayout layout,
                   std::span<float> x);

}  // namespace ref
}  // namespace ferry::ops
