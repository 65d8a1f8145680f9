// Quantizing to the dynamic 8-bit codes (include/ferry/ops/quant_map.hpp) by table lookup instead
// of a binary search, for the host optimizer's 8-bit AdamW: the same code as dynamic_quantize for
// every input (every float in [0, 1], both signs, was checked once; the suite checks a sample), in
// two independent loads that a vectorising compiler turns into gathers.
//
// A normalized value's magnitude m in [0, 1] is placed in a bucket by its float bits: the exponent
// and the top seven mantissa bits (buckets of 1/128 of a binade; every magnitude below 2^-26 shares
// bucket 0, below the smallest code but 0). Code values are at least a bucket apart, so inside one
// bucket the nearest code changes at most once (checked when the tables are built): each bucket
// holds the magnitude index nearest to its lower bound and the least magnitude at which the next
// index is nearer. The tables are built at compile time from the search they replace (a bucket's
// largest index a with value(a) <= its lower bound, then dynamic_quantize's own compare of the
// distances to a and a + 1), which needed three loads in a chain.
//
// Both maps are symmetric in a magnitude index: the unsigned map's code is a (0..255); the signed
// map's is 128 + a for a positive value and 128 - a for a negative one (a = 0..127). A tie between
// two codes goes to the lower code, as in dynamic_quantize: the smaller magnitude for a positive
// value, the larger for a negative one (so the signed map has a row of steps per sign).
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

// The search of the first tables (kept to build the step tables below, and as their check): one
// map's magnitudes by index (then +inf, so a + 1 is always readable and never nearer) and each
// bucket's first index.
template <std::uint32_t Magnitudes>
struct SearchTables {
  std::array<float, Magnitudes + 1> value{};
  std::array<std::int32_t, count> first{};
  std::uint32_t most_inside = 0;  // the most code values strictly inside one bucket (<= 1 required)
};

template <std::uint32_t Magnitudes>
constexpr SearchTables<Magnitudes> make_search_tables() {
  constexpr bool is_signed = Magnitudes == 128;
  SearchTables<Magnitudes> t;
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

// The magnitude index nearest to m (in [0, 1], in bucket b): the largest a with value(a) <= m, in
// one compare since no bucket has two code values inside it, then the nearer of a and a + 1 as
// dynamic_quantize decides it (the same float subtractions). A tie goes to the lower code: the
// smaller magnitude for a positive value, the larger for a negative one.
template <std::uint32_t Magnitudes>
constexpr std::int32_t nearest_index(const SearchTables<Magnitudes>& t, std::uint32_t b, float m, bool negative) {
  std::int32_t a = t.first[b];
  a += static_cast<std::int32_t>(t.value[a + 1] <= m);
  const float below = m - t.value[a], above = t.value[a + 1] - m;
  return a + static_cast<std::int32_t>(above < below || (negative && above == below));
}

// The step tables: inside one bucket the nearest index rises at most once (checked when they are
// built), so a value's index is its bucket's index at the floor plus one where it reaches the
// bucket's step. A bucket b >= 1 is the 2^16 float bit patterns that share their top 16 bits, so
// its step is one of its low 16-bit halves; one 32-bit entry holds both, the index in its top
// bits and the step (or 2^16: none) in its low 17. One load a value, where the search needs three
// in a chain, from tables that fit a core's first-level cache (40 KiB; the search's 27). The signed
// map has a row per sign (negative values' after the positive ones'), since a tie goes the other
// way for them. Bucket 0 (magnitudes below 2^-26, a range of exponents) has no step: its values
// are all nearest to 0.
inline constexpr std::uint32_t step_bits = 17, no_step = 1u << 16, low_half = 0xffffu;

template <std::uint32_t Magnitudes>
struct StepTables {
  static constexpr std::uint32_t sides = Magnitudes == 128 ? 2 : 1;
  std::array<std::uint32_t, sides * count> entry{};  // index << step_bits | step's low half (or no_step)
  std::uint32_t most_steps = 0;                      // the most rises inside one bucket (<= 1 required)
};

template <std::uint32_t Magnitudes>
constexpr StepTables<Magnitudes> make_step_tables() {
  const SearchTables<Magnitudes> search = make_search_tables<Magnitudes>();
  StepTables<Magnitudes> t;
  for (std::uint32_t side = 0; side < t.sides; ++side) {
    const bool negative = side == 1;
    const auto index = [&](std::uint32_t b, std::uint32_t bits) {
      return nearest_index(search, b, std::bit_cast<float>(bits), negative);
    };
    for (std::uint32_t b = 0; b < count; ++b) {
      // The bucket's float bit patterns [lo, hi]; bucket 0 runs from 0 to just below bucket 1.
      const std::uint32_t lo = std::bit_cast<std::uint32_t>(bucket_floor(b));
      const std::uint32_t hi =
          b + 1 < count ? std::bit_cast<std::uint32_t>(bucket_floor(b + 1)) - 1 : std::bit_cast<std::uint32_t>(1.0f);
      const std::int32_t base = index(b, lo), top = index(b, hi);
      std::uint32_t step = no_step;
      if (top != base) {
        // The first pattern with the higher index (the index never falls as m rises).
        std::uint32_t first = lo + 1, last = hi;
        while (first < last) {
          const std::uint32_t mid = first + (last - first) / 2;
          if (index(b, mid) > base) {
            last = mid;
          } else {
            first = mid + 1;
          }
        }
        step = first & low_half;
        // Bucket 0 spans exponents, so a low half cannot place a value there.
        const std::uint32_t rises = b == 0 ? 2 : static_cast<std::uint32_t>(top - base);
        t.most_steps = rises > t.most_steps ? rises : t.most_steps;
      }
      t.entry[side * count + b] = static_cast<std::uint32_t>(base) << step_bits | step;
    }
  }
  return t;
}

inline constexpr StepTables<128> signed_tables = make_step_tables<128>();
inline constexpr StepTables<256> unsigned_tables = make_step_tables<256>();
static_assert(make_search_tables<128>().most_inside <= 1 && make_search_tables<256>().most_inside <= 1,
              "a bucket holds two codes: one compare cannot place a value; add mantissa bits");
static_assert(signed_tables.most_steps <= 1 && unsigned_tables.most_steps <= 1,
              "the nearest code rises twice inside a bucket (or in bucket 0): one step cannot place a value");
static_assert(23 - mantissa_bits == 16, "a bucket must be the float bit patterns that share their top 16 bits");

// dynamic_quantize(r, Signed) for r normalized, clamped to [-1, 1] ([0, 1] unsigned) and not NaN.
// (Arithmetic on the comparisons rather than branches: the loops calling this vectorise only
// without them.)
template <bool Signed>
inline std::uint32_t quantize(float r) {
  const float m = std::fabs(r);  // -0.0 too
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(m);
  const std::int32_t negative = Signed ? static_cast<std::int32_t>(r < 0.0f) : 0;
  const std::int32_t j = bucket_of(m) + negative * static_cast<std::int32_t>(count);
  const std::uint32_t e = (Signed ? signed_tables.entry.data() : unsigned_tables.entry.data())[j];
  const std::int32_t a = static_cast<std::int32_t>(
      (e >> step_bits) + static_cast<std::uint32_t>((bits & low_half) >= (e & (2 * no_step - 1))));
  if constexpr (Signed) return static_cast<std::uint32_t>(128 + a - 2 * negative * a);
  // A positive value never becomes 0 (second moments: Adam divides by their square root).
  return static_cast<std::uint32_t>(a | (static_cast<std::int32_t>(a == 0) & static_cast<std::int32_t>(m > 0.0f)));
}

}  // namespace ferry::ops::quant_buckets
