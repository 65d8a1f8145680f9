// Storage dtypes on the device: the kernel prelude (ops/kernels/dtype.clh and the include
// mechanism of cl::KernelLibrary), the cast op (f32/f16/bf16, bit-exact against the CPU reference,
// exhaustively where the input has 16 bits), int8 quantization per channel (bit-exact), and add
// and the activations built for f16 and bf16. The references themselves are checked against
// independent definitions (nearest representable value by search, ldexp).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "ferry/cl/error.hpp"
#include "ferry/ops/activation.hpp"
#include "ferry/ops/cast.hpp"
#include "ops/elementwise.hpp"
#include "ops/quantize_host.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

using ops::DType;

void run(const ops::LaunchList& l) {
  ops::run_blocking(TestDevice::get().context.compute(), l);
}

std::uint32_t bits(float f) {
  return std::bit_cast<std::uint32_t>(f);
}
float from_bits(std::uint32_t u) {
  return std::bit_cast<float>(u);
}
bool half_is_nan(std::uint16_t h) {
  return (h & 0x7fffu) > 0x7c00u;
}
bool bf16_is_nan(std::uint16_t h) {
  return (h & 0x7fffu) > 0x7f80u;
}
std::string hex(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

// Compares storage words. `any_nan` (may be null) says which expected values are NaN whose
// payload is the device's choice: there only NaN-ness is checked.
template <class W>
void expect_words(const std::vector<W>& got, const std::vector<W>& want, const std::vector<std::uint32_t>& input,
                  bool (*any_nan)(W), const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  std::size_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const bool ok = (any_nan != nullptr && any_nan(want[i])) ? any_nan(got[i]) : got[i] == want[i];
    if (ok) continue;
    ++bad;
    if (reported++ < 8) {
      ADD_FAILURE() << what << "[" << i << "]: input " << hex(input[i]) << " -> got " << hex(got[i]) << ", expected "
                    << hex(want[i]);
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": mismatches";
}

bool half_nan_word(std::uint16_t h) {
  return half_is_nan(h);
}
bool f32_nan_word(std::uint32_t u) {
  return (u & 0x7fffffffu) > 0x7f800000u;
}

// ---- Independent definitions of the references ----------------------------------------------

// The exact value of a binary16 word, by the definition (ldexp in double).
double half_value(std::uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -mag : mag;
}

// Round to nearest even by search over the monotone table of positive finite codes:
// decode(code) for code in [0, max_finite], and next_value for max_finite + 1 (the first value
// that is no longer finite, which is where rounding overflows to the inf code max_finite + 1).
template <class Decode>
std::uint16_t nearest_even(float f, Decode decode, std::uint16_t max_finite, double next_value) {
  const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(f));
  if (std::isinf(f)) return static_cast<std::uint16_t>(sign | (max_finite + 1));
  auto value = [&](std::uint32_t c) { return c > max_finite ? next_value : decode(static_cast<std::uint16_t>(c)); };
  std::uint32_t lo = 0, hi = max_finite + 1u;  // value(lo) <= a < value(hi) unless a >= value(hi)
  if (a >= next_value) return static_cast<std::uint16_t>(sign | (max_finite + 1));
  while (hi - lo > 1) {
    const std::uint32_t mid = (lo + hi) / 2;
    if (value(mid) <= a) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  // 2a against the sum of the neighbours: both sides exact in double.
  const double twice = 2 * a, sum = value(lo) + value(hi);
  std::uint32_t code = twice < sum ? lo : twice > sum ? hi : ((lo & 1u) == 0 ? lo : hi);
  return static_cast<std::uint16_t>(sign | code);
}

std::uint16_t oracle_half(float f) {
  return nearest_even(
      f, [](std::uint16_t c) { return half_value(c); }, 0x7bff, 65536.0);
}
std::uint16_t oracle_bf16(float f) {
  return nearest_even(
      f, [](std::uint16_t c) { return static_cast<double>(from_bits(static_cast<std::uint32_t>(c) << 16)); }, 0x7f7f,
      std::ldexp(1.0, 128));
}

// ---- Test values ----------------------------------------------------------------------------

std::vector<float> special_floats() {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> v = {0.0f,
                          -0.0f,
                          inf,
                          -inf,
                          std::numeric_limits<float>::max(),
                          -std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::min(),
                          std::numeric_limits<float>::denorm_min(),
                          -std::numeric_limits<float>::denorm_min(),
                          65504.0f,
                          65519.0f,
                          65519.996f,
                          65520.0f,
                          -65520.0f,
                          65536.0f,
                          1e10f,
                          std::ldexp(1.0f, -24),
                          std::ldexp(1.0f, -25),
                          std::ldexp(1.5f, -25),
                          std::ldexp(1.0f, -26),
                          std::ldexp(1.0f, -14),
                          std::ldexp(1023.5f, -24)};
  for (std::uint32_t nan : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fbfffffu, 0x7f802000u, 0x7fffffffu,
                            0x7f810000u, 0xff8fe001u}) {
    v.push_back(from_bits(nan));
  }
  // Neighbours of the f16 limits, one f32 ulp either side.
  for (float f : {65520.0f, std::ldexp(1.0f, -25), std::ldexp(1.0f, -14), std::ldexp(1.0f, -24)}) {
    v.push_back(std::nextafter(f, 0.0f));
    v.push_back(std::nextafter(f, inf));
  }
  return v;
}

void push_with_neighbours(std::vector<float>& v, float f) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float s : {1.0f, -1.0f}) {
    v.push_back(s * f);
    v.push_back(s * std::nextafter(f, 0.0f));
    v.push_back(s * std::nextafter(f, inf));
  }
}

std::vector<float> random_bit_floats(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> v(n);
  for (auto& f : v) f = from_bits(rng());
  return v;
}

// Every f16 value, the midpoint of every pair of neighbours (ties) and the floats next to those,
// both signs; the specials; a million random bit patterns (every f32 class).
std::vector<float> f32_cases_for_half() {
  std::vector<float> v = special_floats();
  for (std::uint32_t h = 0; h < 0x7c00; ++h) {
    const auto a = static_cast<float>(half_value(static_cast<std::uint16_t>(h)));
    const float b = h + 1 < 0x7c00 ? static_cast<float>(half_value(static_cast<std::uint16_t>(h + 1))) : 65536.0f;
    push_with_neighbours(v, a);
    push_with_neighbours(v, static_cast<float>((static_cast<double>(a) + b) / 2));  // exact: 12 bits
  }
  auto r = random_bit_floats(1u << 20, 11);
  v.insert(v.end(), r.begin(), r.end());
  return v;
}

std::vector<float> f32_cases_for_bf16() {
  std::vector<float> v = special_floats();
  for (std::uint32_t h = 0; h < 0x7f80; ++h) {
    push_with_neighbours(v, from_bits(h << 16));
    push_with_neighbours(v, from_bits((h << 16) | 0x8000u));  // the midpoint to the next bf16
  }
  auto r = random_bit_floats(1u << 20, 12);
  v.insert(v.end(), r.begin(), r.end());
  return v;
}

std::vector<std::uint16_t> all_words() {
  std::vector<std::uint16_t> w(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) w[i] = static_cast<std::uint16_t>(i);
  return w;
}

std::vector<std::uint32_t> as_input_bits(const std::vector<float>& v) {
  std::vector<std::uint32_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = bits(v[i]);
  return out;
}
std::vector<std::uint32_t> widen(const std::vector<std::uint16_t>& v) {
  return {v.begin(), v.end()};
}

// Runs cast(from, to) on the device over `in` (raw words of `from`).
template <class To, class From>
std::vector<To> device_cast(DType from, DType to, const std::vector<From>& in) {
  auto& dev = TestDevice::get();
  auto din = DeviceBytes::from(in, 5);
  DeviceBytes dout(in.size(), sizeof(To), 3);
  run(ops::cast(dev.env, from, to, din.span(), dout.span(), in.size()));
  for (unsigned char b : dout.tail()) EXPECT_EQ(b, 0xA5) << "cast wrote past its range";
  return dout.download<To>();
}

template <class To, class From>
std::vector<To> host_cast(DType from, DType to, const std::vector<From>& in) {
  std::vector<To> out(in.size());
  ops::ref::cast(from, to, in.data(), out.data(), in.size());
  return out;
}

// ---- The references against their definitions ------------------------------------------------

TEST(DTypeReference, HalfToFloatIsTheExactValue) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float f = ops::ref::half_to_float(static_cast<std::uint16_t>(h));
    if (half_is_nan(static_cast<std::uint16_t>(h))) {
      ASSERT_TRUE(std::isnan(f)) << hex(h);
      ASSERT_EQ(std::signbit(f), (h & 0x8000u) != 0) << hex(h);
    } else if ((h & 0x7fffu) == 0x7c00u) {
      ASSERT_TRUE(std::isinf(f) && std::signbit(f) == ((h & 0x8000u) != 0)) << hex(h);
    } else {
      ASSERT_EQ(static_cast<double>(f), half_value(static_cast<std::uint16_t>(h))) << hex(h);
      ASSERT_EQ(std::signbit(f), (h & 0x8000u) != 0) << hex(h);
    }
  }
}

TEST(DTypeReference, FloatToHalfAndBf16AreNearestEven) {
  for (float f : f32_cases_for_half()) {
    if (std::isnan(f)) {
      ASSERT_TRUE(half_is_nan(ops::ref::float_to_half(f))) << hex(bits(f));
      continue;
    }
    ASSERT_EQ(ops::ref::float_to_half(f), oracle_half(f)) << hex(bits(f)) << " = " << f;
  }
  for (float f : f32_cases_for_bf16()) {
    if (std::isnan(f)) {
      ASSERT_TRUE(bf16_is_nan(ops::ref::float_to_bf16(f))) << hex(bits(f));
      continue;
    }
    ASSERT_EQ(ops::ref::float_to_bf16(f), oracle_bf16(f)) << hex(bits(f)) << " = " << f;
  }
  // Spot checks of the rules by hand: ties to even, overflow, the subnormal boundary.
  EXPECT_EQ(ops::ref::float_to_half(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // tie, 1.0 is even
  EXPECT_EQ(ops::ref::float_to_half(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie, up to even
  EXPECT_EQ(ops::ref::float_to_half(65519.0f), 0x7bff);
  EXPECT_EQ(ops::ref::float_to_half(65520.0f), 0x7c00);
  EXPECT_EQ(ops::ref::float_to_half(std::ldexp(1.0f, -25)), 0x0000);  // tie between 0 and 2^-24
  EXPECT_EQ(ops::ref::float_to_half(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(ops::ref::float_to_half(-0.0f), 0x8000);
  EXPECT_EQ(ops::ref::float_to_bf16(from_bits(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(ops::ref::float_to_bf16(from_bits(0x3f818000u)), 0x3f82);  // tie, up to even
  EXPECT_EQ(ops::ref::float_to_bf16(from_bits(0x7f7f8000u)), 0x7f80);  // past the largest: inf
  EXPECT_EQ(ops::ref::float_to_bf16(from_bits(0x7f800001u)), 0x7fc0);  // signalling NaN: quiet, not inf
}

// ---- Casts on the device ---------------------------------------------------------------------

TEST(Cast, EveryHalfAndBf16PatternWidensExactly) {
  const auto words = all_words();
  const auto from_half = device_cast<std::uint32_t>(DType::f16, DType::f32, words);
  const auto want_half = host_cast<std::uint32_t>(DType::f16, DType::f32, words);
  // A NaN's payload after vload_half is the device's: only NaN-ness is checked there.
  expect_words<std::uint32_t>(from_half, want_half, widen(words), f32_nan_word, "f16 -> f32");
  const auto from_bf16 = device_cast<std::uint32_t>(DType::bf16, DType::f32, words);
  const auto want_bf16 = host_cast<std::uint32_t>(DType::bf16, DType::f32, words);
  expect_words<std::uint32_t>(from_bf16, want_bf16, widen(words), nullptr, "bf16 -> f32 (NaNs too)");
}

TEST(Cast, FloatToHalfRoundsToNearestEven) {
  const auto in = f32_cases_for_half();
  const auto got = device_cast<std::uint16_t>(DType::f32, DType::f16, in);
  const auto want = host_cast<std::uint16_t>(DType::f32, DType::f16, in);
  expect_words<std::uint16_t>(got, want, as_input_bits(in), half_nan_word, "f32 -> f16");
}

TEST(Cast, FloatToBf16RoundsToNearestEven) {
  const auto in = f32_cases_for_bf16();
  const auto got = device_cast<std::uint16_t>(DType::f32, DType::bf16, in);
  const auto want = host_cast<std::uint16_t>(DType::f32, DType::bf16, in);
  expect_words<std::uint16_t>(got, want, as_input_bits(in), nullptr, "f32 -> bf16 (NaNs too)");
}

TEST(Cast, RoundTripsThroughF32AreBitIdentical) {
  const auto words = all_words();
  for (DType t : {DType::f16, DType::bf16}) {
    const auto wide = device_cast<float>(t, DType::f32, words);
    const auto back = device_cast<std::uint16_t>(DType::f32, t, wide);
    std::size_t checked = 0;
    for (std::size_t i = 0; i < words.size(); ++i) {
      const bool nan = t == DType::f16 ? half_is_nan(words[i]) : bf16_is_nan(words[i]);
      if (nan) {
        EXPECT_TRUE(t == DType::f16 ? half_is_nan(back[i]) : bf16_is_nan(back[i])) << hex(words[i]);
        continue;
      }
      ASSERT_EQ(back[i], words[i]) << ops::dtype_name(t) << " " << hex(words[i]) << " -> " << hex(back[i]);
      ++checked;
    }
    EXPECT_EQ(checked, t == DType::f16 ? 65536u - 2 * 1023u : 65536u - 2 * 127u);
  }
}

TEST(Cast, HalfAndBf16ConvertIntoEachOtherThroughF32) {
  const auto words = all_words();
  const auto h2b = device_cast<std::uint16_t>(DType::f16, DType::bf16, words);
  expect_words<std::uint16_t>(
      h2b, host_cast<std::uint16_t>(DType::f16, DType::bf16, words), widen(words),
      [](std::uint16_t w) { return bf16_is_nan(w); }, "f16 -> bf16");
  const auto b2h = device_cast<std::uint16_t>(DType::bf16, DType::f16, words);
  expect_words<std::uint16_t>(b2h, host_cast<std::uint16_t>(DType::bf16, DType::f16, words), widen(words),
                              half_nan_word, "bf16 -> f16");
}

TEST(Cast, IdentityCopiesTheBits) {
  const auto words = all_words();
  for (DType t : {DType::f16, DType::bf16}) {
    expect_words<std::uint16_t>(device_cast<std::uint16_t>(t, t, words), words, widen(words), nullptr,
                                ops::dtype_name(t));
  }
  auto in = random_bit_floats(4099, 3);
  in.push_back(from_bits(0x7f800001u));  // a signalling NaN keeps its payload
  const auto got = device_cast<std::uint32_t>(DType::f32, DType::f32, in);
  expect_words<std::uint32_t>(got, as_input_bits(in), as_input_bits(in), nullptr, "f32 -> f32");
}

TEST(Cast, OddSizesAndOffsets) {
  for (std::size_t n : {1u, 3u, 63u, 65u, 1000u}) {
    auto in = random_vector(n, static_cast<std::uint32_t>(n), -70000.0f, 70000.0f);
    const auto got = device_cast<std::uint16_t>(DType::f32, DType::f16, in);
    EXPECT_EQ(got, (host_cast<std::uint16_t>(DType::f32, DType::f16, in))) << n;
  }
}

TEST(Cast, UnsupportedPairsThrow) {
  auto& dev = TestDevice::get();
  DeviceBytes buf(16, 4);
  for (auto [from, to] : {std::pair{DType::i8, DType::f32}, std::pair{DType::f32, DType::i32},
                          std::pair{DType::u8, DType::u8}, std::pair{DType::f16, DType::i8}}) {
    EXPECT_FALSE(ops::cast_supported(from, to));
    try {
      (void)ops::cast(dev.env, from, to, buf.span(), buf.span(), 4);
      ADD_FAILURE() << "no exception for " << ops::dtype_name(from) << " -> " << ops::dtype_name(to);
    } catch (const std::invalid_argument& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(std::string(ops::dtype_name(from)) + " -> " + ops::dtype_name(to)), std::string::npos) << msg;
      EXPECT_NE(msg.find("f32, f16, bf16"), std::string::npos) << msg;
    }
    std::vector<std::uint32_t> host(4);
    EXPECT_THROW(ops::ref::cast(from, to, host.data(), host.data(), 4), std::invalid_argument);
  }
  for (DType a : {DType::f32, DType::f16, DType::bf16}) {
    for (DType b : {DType::f32, DType::f16, DType::bf16}) EXPECT_TRUE(ops::cast_supported(a, b));
  }
}

// The host lane's cast (ops/quantize_host.hpp): the reference's bits over many blocks and a tail,
// for every pair and scale a narrowing or widening on the host uses; a refused pair throws before
// any block runs.
TEST(Cast, OnTheHostInBlocksMatchesTheReference) {
  const std::size_t n = (std::size_t{1} << 18) + 77;
  const std::vector<float> bits = random_bit_floats(n, 23);
  for (const auto& [from, to, factor] :
       {std::tuple{DType::f32, DType::bf16, 1.0f}, std::tuple{DType::f32, DType::f16, 1024.0f},
        std::tuple{DType::bf16, DType::f32, 1.0f}, std::tuple{DType::f16, DType::f32, 1.0f / 1024},
        std::tuple{DType::f16, DType::f32, 1.0f}, std::tuple{DType::bf16, DType::f32, 0.5f},
        std::tuple{DType::bf16, DType::f16, 1.0f}, std::tuple{DType::f32, DType::f32, 0.5f}}) {
    SCOPED_TRACE(std::string(ops::dtype_name(from)) + " -> " + ops::dtype_name(to));
    std::vector<std::byte> want(n * ops::dtype_bytes(to)), got(want.size());
    ops::ref::cast(from, to, bits.data(), want.data(), n, factor);
    ops::cast_host(from, to, bits.data(), got.data(), n, factor);
    EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size()), 0);
  }
  std::vector<std::uint32_t> host(n);
  EXPECT_THROW(ops::cast_host(DType::f32, DType::i32, host.data(), host.data(), n), std::invalid_argument);
}

// ---- Correctly rounded division (dtype.clh div_rn) ---------------------------------------------

TEST(KernelPrelude, DivRnIsIeeeDivisionBitForBit) {
  auto& dev = TestDevice::get();
  const char* source = R"(#include "dtype.clh"
__kernel void divide(__global const float* a, __global const float* b, __global float* q, uint n) {
  const size_t i = get_global_id(0);
  if (i < n) q[i] = div_rn(a[i], b[i]);
})";
  cl_program program = dev.kernels.program_from_source("test_div_rn", source);
  cl_int status = CL_SUCCESS;
  cl::Kernel k(clCreateKernel(program, "divide", &status));
  ASSERT_EQ(status, CL_SUCCESS);

  std::vector<float> a, b;
  std::mt19937 rng(7);
  const float tiny = std::numeric_limits<float>::denorm_min();
  auto add = [&](float x, float y) {
    a.push_back(x);
    b.push_back(y);
  };
  for (int i = 0; i < (1 << 20); ++i) {
    const std::uint32_t x = rng() % 0xff000000u, y = rng() % 0x7f800000u;  // finite a; finite b >= 0
    add(from_bits(x >= 0x7f800000u ? x + 0x00800000u : x), from_bits(y == 0 ? 1 : y));
  }
  for (int i = 0; i < (1 << 18); ++i) {                            // quotients near 1..127 as quantization makes them
    const float s = from_bits(0x00800000u + rng() % 0x7a000000u);  // below 2^118: s * 127 is finite
    add(s * static_cast<float>(rng() % 255) / 2.0f, s);
  }
  // Overflow, underflow to subnormals and zero, ties at the bottom of the range, exact quotients.
  add(std::numeric_limits<float>::max(), 0.5f);
  add(-std::numeric_limits<float>::max(), 0.99999994f);
  add(3 * tiny, 2.0f);
  add(tiny, 2.0f);
  add(-tiny, 2.0f);
  add(5 * tiny, 2.0f);
  add(std::numeric_limits<float>::min(), 3.0f);
  add(1.0f, 3.0f);
  add(127.0f * 0.125f, 127.0f);
  add(0.0f, 5.0f);
  add(-0.0f, tiny);
  add(1.0f, tiny);
  add(tiny, std::numeric_limits<float>::max());
  add(std::numeric_limits<float>::max(), tiny);

  const std::size_t n = a.size();
  DeviceBytes da = DeviceBytes::from(a, 0), db = DeviceBytes::from(b, 0);
  DeviceBytes dq(n, 4, 0);
  const cl_mem ma = da.span().buffer, mb = db.span().buffer, mq = dq.span().buffer;
  cl::set_args(k.get(), ma, mb, mq, static_cast<cl_uint>(n));
  ops::LaunchList l;
  l.push_back(ops::elementwise_launch(std::move(k), n));
  run(l);
  const auto got = dq.download<std::uint32_t>();
  std::vector<std::uint32_t> want(n), in(n);
  for (std::size_t i = 0; i < n; ++i) {
    want[i] = bits(a[i] / b[i]);
    in[i] = bits(a[i]);
  }
  expect_words<std::uint32_t>(got, want, in, nullptr, "div_rn(a, b) vs a / b");
}

// ---- The include mechanism -------------------------------------------------------------------

TEST(KernelPrelude, HeadersAreEmbeddedAndInlinedOnce) {
  const std::string_view header = cl::kernel_header("dtype.clh");
  EXPECT_NE(header.find("float_to_bf16_rte"), std::string_view::npos);
  EXPECT_THROW((void)cl::kernel_header("dtype"), std::invalid_argument);
  EXPECT_THROW((void)cl::kernel_source("dtype.clh"), std::invalid_argument);

  const std::string src = "// user\n#include \"dtype.clh\"\n  #  include \"dtype.clh\"\nkernel void k() {}\n";
  const std::string out = cl::expand_kernel_includes("user.cl", src);
  // The header's text up to its own #include of store16.clh, which is inlined in its place.
  const std::string_view head = header.substr(0, header.find("#include \"store16.clh\""));
  ASSERT_LT(head.size(), header.size()) << "dtype.clh includes store16.clh";
  EXPECT_NE(out.find(std::string(head)), std::string::npos) << "the header's text is inlined";
  EXPECT_NE(out.find("#line 1 \"store16.clh\""), std::string::npos) << "the header's own header is inlined";
  const auto first = out.find("inline ushort float_to_bf16_rte");
  ASSERT_NE(first, std::string::npos);
  EXPECT_EQ(out.find("inline ushort float_to_bf16_rte", first + 1), std::string::npos) << "inlined twice";
  EXPECT_NE(out.find("#line 1 \"dtype.clh\""), std::string::npos);
  EXPECT_NE(out.find("#line 3 \"user.cl\""), std::string::npos);
  EXPECT_EQ(out.find("\n#include \"dtype.clh\""), std::string::npos);
  EXPECT_EQ(out.find("#  include"), std::string::npos);

  // No include: the same bytes (so such kernels keep their program cache keys).
  const std::string plain = "kernel void k() {}\n#include <not_ours.h>";
  EXPECT_EQ(cl::expand_kernel_includes("plain.cl", plain), plain);
  // The library's own kernel files that use the prelude build with it inlined.
  EXPECT_NE(cl::expand_kernel_includes("cast.cl", cl::kernel_source("cast")).find("inline float div_rn"),
            std::string::npos);
}

TEST(KernelPrelude, UnknownIncludeNamesTheFileAndTheHeader) {
  try {
    (void)cl::expand_kernel_includes("mine.cl", "#include \"nope.clh\"\n");
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("mine.cl"), std::string::npos) << msg;
    EXPECT_NE(msg.find("nope.clh"), std::string::npos) << msg;
    EXPECT_NE(msg.find("dtype.clh"), std::string::npos) << msg << " (lists the headers there are)";
  }
  auto& dev = TestDevice::get();
  try {
    (void)dev.kernels.program_from_source("user_program", "#include \"elementwise.cl\"\nkernel void k() {}\n");
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("user_program"), std::string::npos) << msg;
    EXPECT_NE(msg.find("elementwise.cl"), std::string::npos) << msg;
  }
}

TEST(KernelPrelude, TwoStorageTypesAreABuildError) {
  auto& dev = TestDevice::get();
  const char* source = "#include \"dtype.clh\"\n__kernel void k(__global T_RAW* p) { p[0] = 0; }\n";
  try {
    (void)dev.kernels.program_from_source("two_types", source, "-DT_F16 -DT_BF16");
    ADD_FAILURE() << "no exception";
  } catch (const cl::Error& e) {
    EXPECT_NE(std::string(e.what()).find("more than one of -DT_F32, -DT_F16, -DT_BF16"), std::string::npos) << e.what();
  }
  // One type builds, with and without the option (f32 by default).
  EXPECT_NO_THROW((void)dev.kernels.program_from_source("one_type", source, "-DT_BF16"));
  EXPECT_NO_THROW((void)dev.kernels.program_from_source("one_type", source));
}

// ---- int8 quantization -----------------------------------------------------------------------

struct Quantized {
  std::vector<std::int8_t> q;
  std::vector<float> scales, x;  // x: dequantized
};

Quantized quantize_on_device(const std::vector<float>& x, ops::QuantLayout layout) {
  auto& dev = TestDevice::get();
  auto dx = DeviceBytes::from(x, 3);
  DeviceBytes dq(x.size(), 1, 256 + 5), ds(layout.channels, 4, 9), dback(x.size(), 4, 11);
  run(ops::quantize_i8(dev.env, dx.span(), dq.span(), ds.span(), layout));
  run(ops::dequantize_i8(dev.env, dq.span(), ds.span(), dback.span(), layout));
  for (unsigned char b : dq.tail()) EXPECT_EQ(b, 0xA5) << "quantize wrote past its range";
  for (unsigned char b : ds.tail()) EXPECT_EQ(b, 0xA5) << "quantize wrote past the scales";
  return {dq.download<std::int8_t>(), ds.download<float>(), dback.download<float>()};
}

// The same with the scales from the work-group kernel GPUs run (quantize_i8_scales_lanes), here 8
// lanes a channel where channels are runs (fewer than some runs hold, more than others).
Quantized quantize_on_device_in_lanes(const std::vector<float>& x, ops::QuantLayout layout) {
  const ScopedRowGroupSize lanes(8);
  return quantize_on_device(x, layout);
}

Quantized quantize_on_host(const std::vector<float>& x, ops::QuantLayout layout) {
  Quantized r{std::vector<std::int8_t>(x.size()), std::vector<float>(layout.channels), std::vector<float>(x.size())};
  ops::ref::quantize_i8(x, layout, r.q, r.scales);
  ops::ref::dequantize_i8(r.q, r.scales, layout, r.x);
  return r;
}

// The host lane's parallel quantization (ops/quantize_host.hpp), dequantized by the reference.
Quantized quantize_in_parallel_on_host(const std::vector<float>& x, ops::QuantLayout layout) {
  Quantized r{std::vector<std::int8_t>(x.size()), std::vector<float>(layout.channels), std::vector<float>(x.size())};
  ops::quantize_i8_host(x, layout, r.q, r.scales);
  ops::ref::dequantize_i8(r.q, r.scales, layout, r.x);
  return r;
}

// The element kernel built with `options` (cast.cl; without QUANT_FP64: the float path; a device
// whose division is off by QUANT_DIV_ERROR_ULPS, QUANT_MARGIN), run on `scales`: its q.
std::vector<std::int8_t> quantize_elements_built_with(const char* options, const std::vector<float>& x,
                                                      ops::QuantLayout l, const std::vector<float>& scales) {
  auto& dev = TestDevice::get();
  auto dx = DeviceBytes::from(x, 3), ds = DeviceBytes::from(scales, 9);
  DeviceBytes dq(x.size(), 1, 5);
  const std::size_t cols = l.inner == 1 ? l.channels : l.inner;
  cl::Kernel k = dev.env.kernels.kernel("cast", "quantize_i8", options);
  cl::set_args(k.get(), dx.span().buffer, dx.span().elem_offset(4), ds.span().buffer, ds.span().elem_offset(4),
               dq.span().buffer, dq.span().elem_offset(1), static_cast<cl_uint>(cols), static_cast<cl_uint>(l.channels),
               static_cast<cl_uint>(l.inner));
  ops::KernelLaunch launch;
  launch.kernel = std::move(k);
  launch.dims = 2;
  launch.global = {(cols + 63) / 64 * 64, l.elems() / cols, 1};
  launch.local = {64, 1, 1};
  run({launch});
  return dq.download<std::int8_t>();
}

std::size_t count_differing(const std::vector<std::int8_t>& a, const std::vector<std::int8_t>& b) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

std::size_t index_of(ops::QuantLayout l, std::size_t o, std::size_t c, std::size_t i) {
  return (o * l.channels + c) * l.inner + i;
}

// Channel c gets magnitudes around 10^(c % 13 - 6), one channel is all zeros, one is tiny enough
// for a subnormal scale, one holds exact ties (scale 1/8, values (k + 1/2) / 8).
std::vector<float> channel_data(ops::QuantLayout l, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(l.elems());
  for (std::size_t c = 0; c < l.channels; ++c) {
    const float mag = std::pow(10.0f, static_cast<float>(static_cast<int>(c % 13) - 6));
    std::size_t k = 0;
    for (std::size_t o = 0; o < l.outer; ++o) {
      for (std::size_t i = 0; i < l.inner; ++i, ++k) {
        float v = normal(rng) * mag;
        if (c == 1) v = 0.0f;
        if (c == 2) v = normal(rng) * 1e-39f;
        if (c == 3) v = k == 0 ? 127.0f / 8 : (static_cast<float>(static_cast<int>(rng() % 254) - 127) + 0.5f) / 8;
        x[index_of(l, o, c, i)] = v;
      }
    }
  }
  return x;
}

void expect_quantized_equal(const Quantized& got, const Quantized& want, const char* what) {
  ASSERT_EQ(got.scales.size(), want.scales.size());
  for (std::size_t c = 0; c < got.scales.size(); ++c) {
    ASSERT_EQ(bits(got.scales[c]), bits(want.scales[c]))
        << what << " scale " << c << ": " << got.scales[c] << " vs " << want.scales[c];
  }
  std::size_t bad = 0;
  for (std::size_t i = 0; i < got.q.size(); ++i) {
    // 0 * inf (a channel with an infinite scale) is a NaN whose bits are the device's choice.
    const bool same_x = bits(got.x[i]) == bits(want.x[i]) || (std::isnan(got.x[i]) && std::isnan(want.x[i]));
    if (got.q[i] != want.q[i] || !same_x) {
      if (bad++ < 8) {
        ADD_FAILURE() << what << " [" << i << "]: q " << int(got.q[i]) << " vs " << int(want.q[i]) << ", x " << got.x[i]
                      << " vs " << want.x[i];
      }
    }
  }
  EXPECT_EQ(bad, 0u) << what;
}

TEST(QuantizeI8, LinearAndConvLayoutsMatchTheReferenceBitForBit) {
  const ops::QuantLayout layouts[] = {
      ops::QuantLayout::linear_weight(300, 77),     // [in, out]: channels are columns
      ops::QuantLayout::conv_weight(13, 3, 3, 3),   // [K, C, R, S]: channels are rows of 27
      ops::QuantLayout{5, 6, 7},                    // both outer and inner
      ops::QuantLayout::linear_weight(1, 4),        // one element per channel
      ops::QuantLayout::conv_weight(70, 5, 1, 1)};  // 350 elements: not a multiple of 64
  std::uint32_t seed = 1;
  for (const auto& l : layouts) {
    const auto x = channel_data(l, seed++);
    const Quantized dev = quantize_on_device(x, l), host = quantize_on_host(x, l);
    const std::string what =
        "layout [" + std::to_string(l.outer) + ", " + std::to_string(l.channels) + ", " + std::to_string(l.inner) + "]";
    expect_quantized_equal(dev, host, what.c_str());
    expect_quantized_equal(quantize_on_device_in_lanes(x, l), host, (what + " (lanes)").c_str());
    expect_quantized_equal(quantize_in_parallel_on_host(x, l), host, (what + " (host lane)").c_str());

    // The reference does what it says: the zero channel quantizes to zeros with scale 0, every
    // channel's largest magnitude maps to +-127, and the error is at most half a step.
    ASSERT_EQ(host.scales[1], 0.0f);
    for (std::size_t c = 0; c < l.channels; ++c) {
      float amax = 0.0f;
      int qmax = 0;
      for (std::size_t o = 0; o < l.outer; ++o) {
        for (std::size_t i = 0; i < l.inner; ++i) {
          const std::size_t k = index_of(l, o, c, i);
          amax = std::max(amax, std::abs(x[k]));
          qmax = std::max(qmax, std::abs(int(host.q[k])));
          if (c == 1) {
            ASSERT_EQ(host.q[k], 0);
          }
          if (c != 1 && c != 2) {
            ASSERT_LE(std::abs(x[k] - host.x[k]), 0.5001f * host.scales[c]) << what << " element " << k;
          }
        }
      }
      ASSERT_EQ(host.scales[c], amax / 127.0f) << what << " channel " << c;
      if (c != 1 && c != 2) {
        ASSERT_EQ(qmax, 127) << what << " channel " << c;
      }
    }
  }
}

TEST(QuantizeI8, TiesRoundToEvenAndSpecialValues) {
  // One channel with scale exactly 1/8: x = 2.5/8 -> 2, 3.5/8 -> 4, -2.5/8 -> -2, -0.5/8 -> 0.
  // A second channel holds NaN (skipped by the absmax, quantized to 0) and tiny values.
  const ops::QuantLayout l{1, 2, 8};
  const float s = 0.125f;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> x = {127 * s, 2.5f * s, 3.5f * s, -2.5f * s, -0.5f * s, 0.5f * s, -127 * s, 126.5f * s,
                          nan,     1.0f,     -2.0f,    1e-30f,    -1e-38f,   0.0f,     -0.0f,    1.5f};
  const Quantized dev = quantize_on_device(x, l), host = quantize_on_host(x, l);
  expect_quantized_equal(dev, host, "ties and specials");
  expect_quantized_equal(quantize_in_parallel_on_host(x, l), host, "ties and specials (host lane)");
  EXPECT_EQ(count_differing(quantize_elements_built_with("", x, l, host.scales), host.q), 0u) << "the float path";
  EXPECT_EQ(host.scales[0], s);
  const std::vector<int> want0 = {127, 2, 4, -2, 0, 0, -127, 126};
  for (std::size_t i = 0; i < 8; ++i) EXPECT_EQ(int(dev.q[i]), want0[i]) << i;
  EXPECT_EQ(dev.scales[1], 2.0f / 127.0f);
  EXPECT_EQ(dev.q[8], 0) << "NaN quantizes to 0";
  EXPECT_EQ(int(dev.q[10]), -127);
}

TEST(QuantizeI8, ManyRandomPatternsMatchTheReference) {
  // Random bit patterns (every magnitude, subnormals, NaN and inf) in channels of 1000: a broad
  // check of the kernel's division against the host's.
  const ops::QuantLayout l{1000, 37, 3};
  auto x = random_bit_floats(l.elems(), 5);
  for (std::size_t c = 0; c < l.channels; ++c) {
    // Keep every third channel finite and moderate so most channels have a finite scale.
    for (std::size_t o = 0; o < l.outer; ++o) {
      for (std::size_t i = 0; i < l.inner; ++i) {
        float& v = x[index_of(l, o, c, i)];
        if (c % 3 != 0 && !std::isfinite(v)) v = 1.0f;
        int e = 0;
        if (c % 3 == 1) v = std::ldexp(std::frexp(v, &e), static_cast<int>(c % 40) - 20);
      }
    }
  }
  const Quantized host = quantize_on_host(x, l);
  expect_quantized_equal(quantize_on_device(x, l), host, "random bits");
  expect_quantized_equal(quantize_on_device_in_lanes(x, l), host, "random bits (lanes)");
  const ops::QuantLayout columns = ops::QuantLayout::linear_weight(1000, 111);  // inner == 1: 16 x 16 lanes
  expect_quantized_equal(quantize_on_device_in_lanes(x, columns), quantize_on_host(x, columns), "random bits, columns");
  expect_quantized_equal(quantize_in_parallel_on_host(x, l), host, "random bits (host lane)");
  EXPECT_EQ(count_differing(quantize_elements_built_with("", x, l, host.scales), host.q), 0u) << "the float path";
}

// The kernel divides on the device except within 2^-12 of a half-integer quotient, where it
// divides in software: quotients on both sides of that margin, at it and next to exact ties all
// round as the host's IEEE quotient does. (The largest magnitude of a channel sets its scale, so
// quotients stay within [-127, 127].)
TEST(QuantizeI8, QuotientsNearHalfIntegersRoundAsTheHost) {
  const float offsets[] = {0.0f,     0x1p-24f,  -0x1p-24f, 0x1p-20f,  -0x1p-20f, 0x1p-13f, -0x1p-13f,
                           0x1p-12f, -0x1p-12f, 0x1p-11f,  -0x1p-11f, 0x1p-8f,   -0x1p-8f};
  const float units[] = {0.125f, 0.1f, 3.0e-3f, 7.77e7f, 1.0e-30f};  // scales: exact, inexact, wide range
  std::vector<float> x;
  const std::size_t per_channel = 1 + 254 * 2 * std::size(offsets) + 2;
  for (const float u : units) {
    x.push_back(127.0f * u);  // the channel's absmax: its scale is u, or u rounded
    for (int k = -127; k < 127; ++k) {
      for (const float d : offsets) {
        x.push_back((static_cast<float>(k) + 0.5f + d) * u);
        x.push_back(std::nextafter((static_cast<float>(k) + 0.5f + d) * u, 0.0f));
      }
    }
    x.push_back(126.99999f * u);
    x.push_back(-127.0f * u);
  }
  const ops::QuantLayout l{1, std::size(units), per_channel};
  ASSERT_EQ(x.size(), l.elems());
  const Quantized host = quantize_on_host(x, l);
  expect_quantized_equal(quantize_on_device(x, l), host, "near half-integers");
  expect_quantized_equal(quantize_in_parallel_on_host(x, l), host, "near half-integers (host lane)");

  // The float path (devices without doubles or float denormals); and, since this device divides
  // exactly, one whose division is 3 ulp off (OpenCL allows 2.5) stood in for by the kernel built
  // so: it still gives the host's integers, and would not without the margin, so these values
  // reach it.
  const auto built = [&](const char* options) {
    return count_differing(quantize_elements_built_with(options, x, l, host.scales), host.q);
  };
  EXPECT_EQ(built(""), 0u);
  EXPECT_EQ(built("-DQUANT_DIV_ERROR_ULPS=3"), 0u);
  EXPECT_GT(built("-DQUANT_DIV_ERROR_ULPS=3 -DQUANT_MARGIN=0.0f"), 0u);
}

TEST(QuantizeI8, ReferenceRejectsMismatchedSpans) {
  std::vector<float> x(12), scales(3), back(12);
  std::vector<std::int8_t> q(12);
  EXPECT_THROW(ops::ref::quantize_i8(x, ops::QuantLayout{2, 2, 3}, q, scales), std::invalid_argument);
  EXPECT_NO_THROW(ops::ref::quantize_i8(x, ops::QuantLayout{2, 3, 2}, q, scales));
  EXPECT_THROW(ops::ref::dequantize_i8(q, scales, ops::QuantLayout{1, 3, 3}, back), std::invalid_argument);
}

// ---- add and the activations in f16 and bf16 ----------------------------------------------------

std::uint16_t encode(DType t, float v) {
  return t == DType::f16 ? ops::ref::float_to_half(v) : ops::ref::float_to_bf16(v);
}
float decode(DType t, std::uint16_t w) {
  return t == DType::f16 ? ops::ref::half_to_float(w) : ops::ref::bf16_to_float(w);
}

// n values of type t: random in [lo, hi], with zeros, signed zeros, tiny and large values mixed in.
std::vector<std::uint16_t> typed_values(DType t, std::size_t n, std::uint32_t seed, float lo, float hi) {
  auto f = random_vector(n, seed, lo, hi);
  std::vector<std::uint16_t> w(n);
  const float extras[] = {0.0f, -0.0f, 1.0f, -3.0f, 6.1e-5f, 60000.0f, -60000.0f, 7.0e-4f};
  for (std::size_t i = 0; i < n; ++i) {
    float v = i % 17 == 5 ? extras[(i / 17) % 8] : f[i];
    w[i] = encode(t, v);
    if (t == DType::bf16 && std::fpclassify(decode(t, w[i])) == FP_SUBNORMAL) w[i] = 0;  // not a device ask
  }
  return w;
}

template <class F>
std::vector<std::uint16_t> map_reference(DType t, std::size_t n, F f) {
  std::vector<std::uint16_t> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = encode(t, f(i));
  return out;
}

class TypedOpTest : public ::testing::TestWithParam<std::tuple<DType, std::size_t>> {};

TEST_P(TypedOpTest, AddSumsInF32AndRoundsOnce) {
  auto [t, n] = GetParam();
  auto& dev = TestDevice::get();
  const auto a = typed_values(t, n, 1, -4.0f, 4.0f), b = typed_values(t, n, 2, -4.0f, 4.0f);
  auto da = DeviceBytes::from(a, 3), db = DeviceBytes::from(b, 8);
  DeviceBytes dout(n, 2, 5);
  run(ops::add(dev.env, da.span(), db.span(), dout.span(), n, t));
  const auto want = map_reference(t, n, [&, t = t](std::size_t i) { return decode(t, a[i]) + decode(t, b[i]); });
  expect_words<std::uint16_t>(dout.download<std::uint16_t>(), want, widen(a), t == DType::f16 ? half_nan_word : nullptr,
                              "typed add");
  for (unsigned char byte : dout.tail()) EXPECT_EQ(byte, 0xA5) << "add wrote past its range";

  // In place (out aliases a), as the graph's gradient sums do.
  run(ops::add(dev.env, da.span(), db.span(), da.span(), n, t));
  EXPECT_EQ(da.download<std::uint16_t>(), want);
}

TEST_P(TypedOpTest, ActivationsMatchTheF32KernelRoundedAndTheReference) {
  auto [t, n] = GetParam();
  auto& dev = TestDevice::get();
  const auto x = typed_values(t, n, 3, -4.0f, 4.0f), dy = typed_values(t, n, 4, -2.0f, 2.0f);
  std::vector<float> xf(n), dyf(n);
  for (std::size_t i = 0; i < n; ++i) {
    xf[i] = decode(t, x[i]);
    dyf[i] = decode(t, dy[i]);
  }
  auto dx_in = DeviceBytes::from(x, 3), ddy = DeviceBytes::from(dy, 6);
  for (ops::Activation act : {ops::Activation::relu, ops::Activation::gelu}) {
    const bool relu = act == ops::Activation::relu;
    DeviceBytes dyo(n, 2, 1), ddx(n, 2, 2);
    run(ops::activation_forward(dev.env, act, dx_in.span(), dyo.span(), n, t));
    run(ops::activation_backward(dev.env, act, dx_in.span(), ddy.span(), ddx.span(), n, t));
    const auto y = dyo.download<std::uint16_t>(), dx = ddx.download<std::uint16_t>();

    // The f32 kernels on the decoded inputs, rounded on the host: the typed kernels do the same
    // fp32 arithmetic, so the words must match exactly.
    DeviceTensor fx(xf), fdy(dyf), fy(n), fdx(n);
    run(ops::activation_forward(dev.env, act, fx.span(), fy.span(), n));
    run(ops::activation_backward(dev.env, act, fx.span(), fdy.span(), fdx.span(), n));
    const auto fyv = fy.download(), fdxv = fdx.download();
    const auto want_y = map_reference(t, n, [&](std::size_t i) { return fyv[i]; });
    const auto want_dx = map_reference(t, n, [&](std::size_t i) { return fdxv[i]; });
    expect_words<std::uint16_t>(y, want_y, widen(x), nullptr, relu ? "relu forward" : "gelu forward");
    expect_words<std::uint16_t>(dx, want_dx, widen(x), nullptr, relu ? "relu backward" : "gelu backward");

    // The CPU reference in f32, rounded: ReLU is exact, so bit for bit; GELU's kernel erf is an
    // approximation, so within one unit in the last place of the storage type.
    std::vector<float> ry(n), rdx(n);
    ops::ref::activation_forward<float>(act, xf, ry);
    ops::ref::activation_backward<float>(act, xf, dyf, rdx);
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint16_t ey = encode(t, ry[i]), edx = encode(t, rdx[i]);
      if (relu) {  // compared as values: fmax(-0, 0) may be either zero
        ASSERT_EQ(decode(t, y[i]), decode(t, ey)) << "relu forward " << i << " x=" << xf[i];
        ASSERT_EQ(decode(t, dx[i]), decode(t, edx)) << "relu backward " << i << " x=" << xf[i];
      } else {
        ASSERT_LE(std::abs(decode(t, y[i]) - decode(t, ey)),
                  std::abs(decode(t, static_cast<std::uint16_t>(ey + 1)) - decode(t, ey)) + 1e-30f)
            << "gelu forward " << i << " x=" << xf[i];
        ASSERT_LE(std::abs(decode(t, dx[i]) - decode(t, edx)),
                  std::abs(decode(t, static_cast<std::uint16_t>(edx + 1)) - decode(t, edx)) + 1e-30f)
            << "gelu backward " << i << " x=" << xf[i];
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(F16AndBf16, TypedOpTest,
                         ::testing::Combine(::testing::Values(DType::f16, DType::bf16),
                                            ::testing::Values(1, 63, 1000, 4097)),
                         [](const auto& info) {
                           return std::string(ops::dtype_name(std::get<0>(info.param))) + "_" +
                                  std::to_string(std::get<1>(info.param));
                         });

// Every f16 and bf16 pattern as a, added to a shuffled pattern b: on CPU devices `add` runs 16 lanes
// a work-item (add16), so this reads every pattern through the 16-wide widening (subnormals, inf and
// NaN included) and rounds sums of every magnitude (ties, overflow, subnormal results) through the
// 16-wide narrowing, against the host's scalar reference.
TEST(TypedOps, EveryPatternAddsThroughTheWideConversions) {
  auto& dev = TestDevice::get();
  const std::size_t n = 1u << 16;
  for (DType t : {DType::f16, DType::bf16}) {
    std::vector<std::uint16_t> a(n), b(n);
    for (std::size_t i = 0; i < n; ++i) {
      a[i] = static_cast<std::uint16_t>(i);
      b[i] = static_cast<std::uint16_t>((i * 40503u + 12345u) & 0xffffu);
      // A bf16 subnormal is an f32 one, which a device may flush (not a device ask; f16 ones widen
      // to normal floats): such operands become zeros, and a sum that would be one gets b = 0.
      if (t == DType::bf16) {
        if (std::fpclassify(decode(t, a[i])) == FP_SUBNORMAL) a[i] = 0;
        if (std::fpclassify(decode(t, b[i])) == FP_SUBNORMAL) b[i] = 0;
        if (std::fpclassify(decode(t, a[i]) + decode(t, b[i])) == FP_SUBNORMAL) b[i] = 0;
      }
    }
    auto da = DeviceBytes::from(a), db = DeviceBytes::from(b);
    DeviceBytes dout(n, 2);
    run(ops::add(dev.env, da.span(), db.span(), dout.span(), n, t));
    const auto want = map_reference(t, n, [&](std::size_t i) { return decode(t, a[i]) + decode(t, b[i]); });
    expect_words<std::uint16_t>(dout.download<std::uint16_t>(), want, widen(a),
                                t == DType::f16 ? half_nan_word : bf16_is_nan, "every pattern's sum");
  }
}

TEST(TypedOps, F16OverflowAndNaN) {
  auto& dev = TestDevice::get();
  const std::vector<std::uint16_t> a = {encode(DType::f16, 60000.0f), encode(DType::f16, -60000.0f), 0x7e00,
                                        encode(DType::f16, 6e-8f), 0x7c00};
  const std::vector<std::uint16_t> b = {encode(DType::f16, 60000.0f), encode(DType::f16, -60000.0f),
                                        encode(DType::f16, 1.0f), encode(DType::f16, 6e-8f), 0xfc00};
  auto da = DeviceBytes::from(a), db = DeviceBytes::from(b);
  DeviceBytes dout(a.size(), 2);
  run(ops::add(dev.env, da.span(), db.span(), dout.span(), a.size(), DType::f16));
  const auto got = dout.download<std::uint16_t>();
  EXPECT_EQ(got[0], 0x7c00) << "overflow to +inf";
  EXPECT_EQ(got[1], 0xfc00) << "overflow to -inf";
  EXPECT_TRUE(half_is_nan(got[2]));
  EXPECT_EQ(got[3], 0x0002) << "subnormal sum";
  EXPECT_TRUE(half_is_nan(got[4])) << "inf + -inf";
}

}  // namespace
}  // namespace ferry::test
