// Quantizing to the dynamic 8-bit codes (include/ferry/ops/quant_map.hpp) by table lookup instead
// of a binary search, for the host optimizer's 8-bit AdamW: the same code as dynamic_quantize for
// every input, in a handful of loads that a vectorising compiler turns into gathers.
//
// A normalized value's magnitude m in [0, 1] is placed in a bucket by its float bits: the exponent
// and the top seven mantissa bits (buckets of 1/128 of a binade; every magnitude below 2^-26 shares
// bucket 0, below the smallest code but 0). Each bucket holds the largest magnitude index a whose
// value is <= the bucket's lower bound. No bucket has more than one code value strictly inside it
// (checked when the tables are built), so one compare finds the largest a with value(a) <= m, and
// a second the nearer of a and a + 1.
//
// Both maps are symmetric in a magnitude index: the unsigned map's code is a (0..255); the signed
// map's is 128 + a for a positive value and 128 - a for a negative one (a = 0..127). A tie between
// two codes goes to the lower code, as in dynamic_quantize: the smaller magnitude for a positive
// value, the larger for a negative one.
#pragma once

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "ferry/ops/quant_map.hpp"

namespace ferry::ops::quant_buckets {

inline constexpr std::uint32_t mantissa_bits = 7;
// The biased exponent of bucket 1's binade: 2^-26, below the smallest non-zero code (1e-7).
inline constexpr std::uint32_t first_exponent = 127 - 26;
// Bucket 0, 2^7 per binade from 2^-26 up to 1.0, and 1.0's.
inline constexpr std::uint32_t count = ((127 - first_exponent) << mantissa_bits) + 2;

// The bucket of a magnitude m in [0, 1] (not NaN).
inline std::int32_t bucket_of(float m) {
  const std::int32_t b = static_cast<std::int32_t>(std::bit_cast<std::uint32_t>(m) >> (23 - mantissa_bits)) -
                         static_cast<std::int32_t>(first_exponent << mantissa_bits) + 1;
  return b > 0 ? b : 0;
}

// The least magnitude of bucket b (0 for bucket 0).
constexpr float bucket_floor(std::uint32_t b) {
  if (b == 0) return 0.0f;
  return std::bit_cast<float>(((b - 1) + (first_exponent << mantissa_bits)) << (23 - mantissa_bits));
}

// One map's tables: the magnitudes by index (then +inf, so a + 1 is always readable and never
// nearer) and each bucket's first index.
template <std::uint32_t Magnitudes>
struct Tables {
  std::array<float, Magnitudes + 1> value{};
  std::array<std::int32_t, count> first{};
  std::uint32_t most_inside = 0;  // the most code values strictly inside one bucket (<= 1 required)
};

template <std::uint32_t Magnitudes>
constexpr Tables<Magnitudes> make_tables() {
  constexpr bool is_signed = Magnitudes == 128;
  Tables<Magnitudes> t;
  for (std::uint32_t a = 0; a < Magnitudes; ++a) {
    t.value[a] = dynamic_value(static_cast<std::uint8_t>(is_signed ? 128 + a : a), is_signed);
  }
  t.value[Magnitudes] = std::numeric_limits<float>::infinity();
  std::uint32_t a = 0;  // the values rise with a, so one sweep serves every bucket
  for (std::uint32_t b = 0; b < count; ++b) {
    const float floor = bucket_floor(b);
    while (a + 1 < Magnitudes && t.value[a + 1] <= floor) ++a;
    t.first[b] = static_cast<std::int32_t>(a);
    const float ceiling = b + 1 < count ? bucket_floor(b + 1) : std::numeric_limits<float>::infinity();
    std::uint32_t inside = 0;
    for (std::uint32_t c = a + 1; c < Magnitudes && t.value[c] < ceiling; ++c) inside += t.value[c] > floor;
    t.most_inside = inside > t.most_inside ? inside : t.most_inside;
  }
  return t;
}

inline constexpr Tables<128> signed_tables = make_tables<128>();
inline constexpr Tables<256> unsigned_tables = make_tables<256>();
static_assert(signed_tables.most_inside <= 1 && unsigned_tables.most_inside <= 1,
              "a bucket holds two codes: one compare cannot place a value; add mantissa bits");

// dynamic_quantize(r, Signed) for r normalized, clamped to [-1, 1] ([0, 1] unsigned) and not NaN.
template <bool Signed>
inline std::uint32_t quantize(float r) {
  const float m = std::fabs(r);  // -0.0 too
  const float* value = Signed ? signed_tables.value.data() : unsigned_tables.value.data();
  const std::int32_t* first = Signed ? signed_tables.first.data() : unsigned_tables.first.data();
  std::int32_t a = first[bucket_of(m)];
  a += static_cast<std::int32_t>(value[a + 1] <= m);
  const float below = m - value[a], above = value[a + 1] - m;
  // The lower code on a tie: the smaller magnitude unless the value is negative. (Arithmetic on
  // the comparisons rather than branches: the loops calling this vectorise only without them.)
  const std::int32_t negative = Signed ? static_cast<std::int32_t>(r < 0.0f) : 0;
  a += static_cast<std::int32_t>(above < below) | (negative & static_cast<std::int32_t>(above == below));
  if constexpr (Signed) return static_cast<std::uint32_t>(128 + a - 2 * negative * a);
  // A positive value never becomes 0 (second moments: Adam divides by their square root).
  return static_cast<std::uint32_t>(a | (static_cast<std::int32_t>(a == 0) & static_cast<std::int32_t>(m > 0.0f)));
}

}  // namespace ferry::ops::quant_buckets
