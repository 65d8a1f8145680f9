// Dynamic (non-linear) 8-bit codes for block-wise quantized optimizer state (adamw8bit). A code
// stands for a value in [-1, 1] (signed map, the first moment) or [0, 1] (unsigned map, the
// second moment), to be multiplied by its block's scale (the block's absmax). The codes are our
// own monotone format: code order is value order, so quantizing is a binary search over codes and
// nothing needs a stored table. ops/kernels/optimizer8bit.cl mirrors these functions; the host
// optimizer gets the same codes from a table of buckets instead (ops/quant_buckets.hpp), faster.
//
// Unsigned map: code 0 is 0; code c >= 1 has e = floor(log2 c) (0..7), j = c - 2^e and value
//   10^-(7-e) * (0.1 + 0.9 (j + 1) / 2^e),
// so decade 10^-7 has 1 code, decade 10^-6 2 codes, ..., decade 10^0 128 codes; code 255 is 1.
// Signed map: s = c - 128; s = 0 is 0; otherwise sign(s) * mag7(min(|s|, 127)) with
//   mag7(a) = 10^-(6-e) * (0.1 + 0.9 (j + 1) / 2^e), e = floor(log2 a) (0..6), j = a - 2^e;
// code 255 is +1, codes 1 and 0 are -1 (quantizing never gives code 0).
//
// Each value is computed as one division of two integers that floats hold exactly:
// (2^e + 9 (j + 1)) / (10^(top+1-e) 2^e), so the host and a kernel get the same bits wherever the
// device's division is correctly rounded.
#pragma once

#include <bit>
#include <cstdint>

namespace ferry::ops {

namespace quant_map_detail {

inline constexpr std::uint32_t pow10[9] = {1, 10, 100, 1000, 10000, 100000, 1000000, 10000000, 100000000};

// The magnitude of code `a` >= 1 of a map whose top exponent is `top` (7 unsigned, 6 signed).
constexpr float magnitude(std::uint32_t a, std::uint32_t top) {
  const std::uint32_t e = static_cast<std::uint32_t>(std::bit_width(a)) - 1;
  const std::uint32_t numerator = (1u << e) + 9u * (a - (1u << e) + 1u);
  const std::uint32_t denominator = pow10[top + 1 - e] << e;
  return static_cast<float>(numerator) / static_cast<float>(denominator);
}

}  // namespace quant_map_detail

// The value of code `c` in [-1, 1] (signed map) or [0, 1] (unsigned map).
constexpr float dynamic_value(std::uint8_t c, bool is_signed) {
  if (!is_signed) return c == 0 ? 0.0f : quant_map_detail::magnitude(c, 7);
  const int s = static_cast<int>(c) - 128;
  if (s == 0) return 0.0f;
  const std::uint32_t a = s < 0 ? static_cast<std::uint32_t>(s == -128 ? 127 : -s) : static_cast<std::uint32_t>(s);
  const float m = quant_map_detail::magnitude(a, 6);
  return s < 0 ? -m : m;
}

// The code whose value is nearest to x, a value normalized by its block's absmax (clamped to
// [-1, 1] or [0, 1]; NaN gives the code of 0). A binary search for the largest code whose value
// is <= x, then the nearer of it and the next code; a tie goes to the lower code. In the unsigned
// map a positive x gives at least code 1.
constexpr std::uint8_t dynamic_quantize(float x, bool is_signed) {
  const float lowest = is_signed ? -1.0f : 0.0f;
  if (!(x == x)) x = 0.0f;  // NaN
  x = x < lowest ? lowest : (x > 1.0f ? 1.0f : x);
  std::uint32_t lo = is_signed ? 1 : 0, hi = 255;  // invariant: value(lo) <= x
  while (lo < hi) {
    const std::uint32_t mid = (lo + hi + 1) / 2;
    if (dynamic_value(static_cast<std::uint8_t>(mid), is_signed) <= x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  if (lo < 255) {
    const float below = x - dynamic_value(static_cast<std::uint8_t>(lo), is_signed);
    const float above = dynamic_value(static_cast<std::uint8_t>(lo + 1), is_signed) - x;
    if (above < below) ++lo;
  }
  // A positive value never becomes 0 in the unsigned map (second moments): Adam divides by
  // sqrt(v), and a v rounded to 0 under a non-zero m would give an update of m / eps.
  if (!is_signed && lo == 0 && x > 0.0f) lo = 1;
  return static_cast<std::uint8_t>(lo);
}

}  // namespace ferry::ops
