// 8-bit block-wise AdamW (adamw8bit): the dynamic code maps (ops/quant_map.hpp), the kernel
// against its CPU reference step after step with the state carried on the device, the loss guard,
// block sizes the kernel cannot run, and a small model trained with it through the trainer.
#include <fmt/format.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "ferry/ferry.hpp"
#include "ferry/ops/optimizer.hpp"
#include "ferry/ops/quant_map.hpp"
#include "ops/attrs.hpp"
#include "ops/optimizer_host.hpp"
#include "ops/quant_buckets.hpp"
#include "test_support.hpp"
#include "train_check.hpp"

namespace ferry::test {
namespace {

using ops::dynamic_quantize;
using ops::dynamic_value;

static_assert(dynamic_value(255, false) == 1.0f && dynamic_value(255, true) == 1.0f);
static_assert(dynamic_value(1, true) == -1.0f && dynamic_value(0, false) == 0.0f && dynamic_value(128, true) == 0.0f);

// ---- The code maps ----

TEST(QuantMap, MonotoneWithExactEndsAndZero) {
  for (bool is_signed : {false, true}) {
    SCOPED_TRACE(is_signed ? "signed" : "unsigned");
    // Every code has a distinct value, in code order (signed code 0 repeats code 1's -1).
    for (int c = is_signed ? 2 : 1; c < 256; ++c) {
      EXPECT_LT(dynamic_value(std::uint8_t(c - 1), is_signed), dynamic_value(std::uint8_t(c), is_signed)) << c;
    }
    EXPECT_EQ(dynamic_value(255, is_signed), 1.0f);
    const std::uint8_t zero = is_signed ? 128 : 0;
    EXPECT_EQ(dynamic_value(zero, is_signed), 0.0f);
    EXPECT_EQ(dynamic_quantize(0.0f, is_signed), zero);
    EXPECT_EQ(dynamic_quantize(std::nanf(""), is_signed), zero);
    EXPECT_EQ(dynamic_quantize(1.0f, is_signed), 255);
    EXPECT_EQ(dynamic_quantize(2.0f, is_signed), 255) << "clamped";
  }
  EXPECT_EQ(dynamic_value(1, true), -1.0f);
  EXPECT_EQ(dynamic_value(0, true), -1.0f);
  EXPECT_EQ(dynamic_quantize(-1.0f, true), 1);
  EXPECT_EQ(dynamic_quantize(-2.0f, true), 1) << "clamped";
  EXPECT_EQ(dynamic_quantize(-0.5f, false), 0) << "clamped";
  // The smallest magnitudes: 1e-7 (unsigned) and 1e-6 (signed).
  EXPECT_FLOAT_EQ(dynamic_value(1, false), 1e-7f);
  EXPECT_FLOAT_EQ(dynamic_value(129, true), 1e-6f);
  EXPECT_FLOAT_EQ(dynamic_value(127, true), -1e-6f);
  // A decade boundary: unsigned code 127 is 0.1 (top of the 10^-1 decade), 128 the first of 10^0.
  EXPECT_FLOAT_EQ(dynamic_value(127, false), 0.1f);
  EXPECT_FLOAT_EQ(dynamic_value(128, false), 0.1f + 0.9f / 128);
}

TEST(QuantMap, QuantizeInvertsValue) {
  for (int c = 0; c < 256; ++c) {
    EXPECT_EQ(dynamic_quantize(dynamic_value(std::uint8_t(c), false), false), c) << "unsigned " << c;
    // Signed code 0 is a second -1, which quantizes to code 1.
    EXPECT_EQ(dynamic_quantize(dynamic_value(std::uint8_t(c), true), true), c == 0 ? 1 : c) << "signed " << c;
  }
}

// The host optimizer quantizes by bucket table (ops/quant_buckets.hpp) instead of searching: the
// same code as dynamic_quantize at every code value, at and beside every midpoint between
// neighbouring codes (where ties and rounding decide), beside every bucket boundary, and at
// values spread over all bit patterns in [0, 1], both signs. (Every float in [0, 1] was checked
// once when the tables were written: a minute, too long for the suite.)
TEST(QuantMap, BucketTablesQuantizeAsTheSearch) {
  std::size_t checked = 0;
  const auto check = [&](float x) {
    if (!(x >= 0.0f && x <= 1.0f)) return;
    ASSERT_EQ(ops::quant_buckets::quantize<false>(x), dynamic_quantize(x, false)) << "unsigned " << x;
    ASSERT_EQ(ops::quant_buckets::quantize<true>(x), dynamic_quantize(x, true)) << "signed " << x;
    ASSERT_EQ(ops::quant_buckets::quantize<true>(-x), dynamic_quantize(-x, true)) << "signed " << -x;
    ++checked;
  };
  const auto around = [&](float x) {
    float below = x, above = x;
    check(x);
    for (int i = 0; i < 4; ++i) {
      below = std::nextafter(below, -1.0f);
      above = std::nextafter(above, 2.0f);
      check(below);
      check(above);
    }
  };
  for (const bool is_signed : {false, true}) {
    for (int c = 0; c < 256; ++c) {
      const float v = std::fabs(dynamic_value(std::uint8_t(c), is_signed));
      around(v);
      if (c < 255) around(0.5f * (v + std::fabs(dynamic_value(std::uint8_t(c + 1), is_signed))));
    }
  }
  for (std::uint32_t b = 0; b < ops::quant_buckets::count; ++b) around(ops::quant_buckets::bucket_floor(b));
  for (std::uint32_t bits = 0; bits <= 0x3F800000u; bits += 997) check(std::bit_cast<float>(bits));
  EXPECT_GT(checked, 1'000'000u);
}

// The largest relative error |q(x) - x| / |x| over x in [lo, 1] (both signs for the signed map):
// a log-spaced sweep plus the points just below each midpoint between neighbouring codes, where
// the error of rounding down peaks.
double max_relative_error(bool is_signed, double lo) {
  double worst = 0;
  auto check = [&](float x) {
    if (x < lo || x > 1) return;
    for (float s : {1.0f, -1.0f}) {
      if (!is_signed && s < 0) continue;
      const float q = dynamic_value(dynamic_quantize(s * x, is_signed), is_signed);
      worst = std::max(worst, std::abs(double(q) - double(s * x)) / double(x));
    }
  };
  const int points = 100000;
  for (int i = 0; i <= points; ++i) check(static_cast<float>(lo * std::pow(1 / lo, double(i) / points)));
  for (int c = is_signed ? 129 : 1; c < 255; ++c) {
    const float mid =
        0.5f * (dynamic_value(std::uint8_t(c), is_signed) + dynamic_value(std::uint8_t(c + 1), is_signed));
    check(std::nextafter(mid, 0.0f));
    check(std::nextafter(mid, 1.0f));
  }
  return worst;
}

// The error is largest just below the midpoint between the top code of a decade and the first code
// of the next, whose ratio is r = 1 + 9 / 2^(e+1): (r - 1) / (r + 1). Over [1e-6, 1] that is the
// 1e-6 -> 3.25e-6 gap (unsigned: 0.529) and 1e-6 -> 5.5e-6 (signed: 0.692); over [0.1, 1],
// 0.1 -> 0.10703 (unsigned: 0.034) and 0.1 -> 0.11406 (signed: 0.066). Dynamic codes spend their
// resolution on the large values of a block, which dominate Adam's update.
TEST(QuantMap, RelativeErrorBounded) {
  struct Bound {
    bool is_signed;
    double lo, bound;
  };
  const Bound bounds[] = {{false, 1e-6, 0.5295}, {false, 1e-3, 0.1234}, {false, 1e-2, 0.0658}, {false, 1e-1, 0.0340},
                          {true, 1e-6, 0.6924},  {true, 1e-3, 0.2196},  {true, 1e-2, 0.1234},  {true, 1e-1, 0.0658}};
  for (const Bound& b : bounds) {
    const double err = max_relative_error(b.is_signed, b.lo);
    EXPECT_LE(err, b.bound) << (b.is_signed ? "signed" : "unsigned") << " over [" << b.lo << ", 1]";
    EXPECT_GE(err, b.bound - 0.001) << "the bound is tight";
  }
}

// ---- The kernel against its reference ----

// A u8 buffer on the test device at a byte offset that is not a multiple of 4.
class ByteTensor {
 public:
  explicit ByteTensor(std::size_t n, std::uint64_t offset = 13) : n_(n), offset_(offset) {
    auto& dev = TestDevice::get();
    mem_ = dev.context.create_buffer(n + offset, "test u8 tensor");
    std::vector<std::uint8_t> zeros(n + offset, 0xab);
    dev.context.write(mem_.get(), 0, zeros.data(), zeros.size());
    upload(std::vector<std::uint8_t>(n, 0));
  }
  void upload(const std::vector<std::uint8_t>& v) {
    TestDevice::get().context.write(mem_.get(), offset_, v.data(), v.size());
  }
  std::vector<std::uint8_t> download() const {
    std::vector<std::uint8_t> out(n_);
    TestDevice::get().context.read(mem_.get(), offset_, out.data(), n_);
    return out;
  }
  ops::DeviceSpan span() const { return {mem_.get(), offset_}; }

 private:
  std::size_t n_;
  std::uint64_t offset_;
  cl::Mem mem_;
};

// The 8-bit state of one weight on the device (zero-initialised) and its update, bound once.
struct Device8bit {
  std::size_t n;
  std::uint32_t block;
  DeviceTensor w, g, scales;
  ByteTensor m, v;
  Device8bit(const std::vector<float>& w0, std::uint32_t block_)
      : n(w0.size()),
        block(block_),
        w(w0, 3),
        g(w0.size(), 5),
        scales(std::vector<float>(2 * ops::adam8bit_blocks(w0.size(), block_), 0.0f), 9),
        m(w0.size()),
        v(w0.size()) {}
  ops::LaunchList bind(const ops::AdamConfig& c, ops::DeviceSpan guard = {}, std::uint32_t group = 0) {
    return ops::adam8bit_update(TestDevice::get().env, c, block, w.span(), g.span(), m.span(), v.span(), scales.span(),
                                n, guard, group);
  }
};

std::vector<double> codes_as_double(const std::vector<std::uint8_t>& c) {
  return {c.begin(), c.end()};
}

// Dequantized moment i: its code's value times its block's scale.
double dequantized(double code, bool is_signed, const std::vector<double>& scales, std::size_t block_index,
                   std::size_t blocks) {
  return dynamic_value(static_cast<std::uint8_t>(code), is_signed) * scales[(is_signed ? 0 : blocks) + block_index];
}

// The distance from code c's value to its farther neighbour: one quantization step there.
double code_step(std::uint8_t c, bool is_signed) {
  const double here = dynamic_value(c, is_signed);
  const double below = c > (is_signed ? 1 : 0) ? dynamic_value(std::uint8_t(c - 1), is_signed) : here;
  const double above = c < 255 ? dynamic_value(std::uint8_t(c + 1), is_signed) : here;
  return std::max(here - below, above - here);
}

// Gradients uniform in [-1, 1] times a magnitude spread over three decades, so that blocks and
// elements within a block use many decades of the code maps.
std::vector<float> spread_gradient(std::size_t n, std::uint32_t seed) {
  auto g = random_vector(n, seed);
  const auto e = random_vector(n, seed + 1000, -3.0f, 0.0f);
  for (std::size_t i = 0; i < n; ++i) g[i] *= std::pow(10.0f, e[i]);
  return g;
}

// One step's result against the reference's from the same state: the weights agree to float
// rounding of the update, the scales to float rounding, and the dequantized moments to one
// quantization step (float and double may round a value at a code midpoint to different
// neighbours). Returns how many codes differ.
std::size_t expect_near_reference(std::uint32_t block, const std::vector<float>& w, const std::vector<std::uint8_t>& m,
                                  const std::vector<std::uint8_t>& v, const std::vector<double>& scales,
                                  const std::vector<double>& w_before, const std::vector<double>& w_ref,
                                  const std::vector<double>& m_ref, const std::vector<double>& v_ref,
                                  const std::vector<double>& scales_ref) {
  const std::size_t n = w.size(), blocks = ops::adam8bit_blocks(n, block);
  std::size_t flips = 0;
  for (std::size_t i = 0; i < scales.size(); ++i) {
    EXPECT_NEAR(scales[i], scales_ref[i], 1e-6 * scales_ref[i]) << "scale " << i;
    EXPECT_GT(scales[i], 0.0) << "scale " << i;
  }
  int reported = 0;
  for (std::size_t i = 0; i < n && reported < 5; ++i) {
    const double dw_ref = w_ref[i] - w_before[i];
    const double w_tol = 1e-6 + 1e-5 * std::abs(dw_ref) + 1e-6 * std::abs(w_ref[i]);
    if (!(std::abs(w[i] - w_ref[i]) <= w_tol)) {
      ADD_FAILURE() << "w[" << i << "]: got " << w[i] << ", expected " << w_ref[i];
      ++reported;
    }
    for (bool is_signed : {true, false}) {
      const double code = is_signed ? m[i] : v[i], code_ref = is_signed ? m_ref[i] : v_ref[i];
      if (code == code_ref) continue;
      ++flips;
      const double got = dequantized(code, is_signed, scales, i / block, blocks);
      const double want = dequantized(code_ref, is_signed, scales_ref, i / block, blocks);
      const double tol = (code_step(static_cast<std::uint8_t>(code_ref), is_signed) + 1e-6) *
                         scales_ref[(is_signed ? 0 : blocks) + i / block];
      if (std::abs(code - code_ref) > 1 || !(std::abs(got - want) <= tol)) {
        ADD_FAILURE() << (is_signed ? "m[" : "v[") << i << "]: code " << code << " (" << got << "), expected "
                      << code_ref << " (" << want << ")";
        ++reported;
      }
    }
  }
  return flips;
}

// (n, block, work-group size: 0 for the device's, 256 for what GPUs run).
class Adam8bitTest : public ::testing::TestWithParam<std::tuple<std::size_t, std::uint32_t, std::uint32_t>> {};

// Each step, the reference (double) starts from the state the device carried over (weights, codes,
// scales) and takes the same step: the weights agree to float rounding of the update, the scales
// to float rounding, and the dequantized moments to one quantization step (float and double may
// round a value at a code midpoint to different neighbours; such flips must be rare and of one code).
TEST_P(Adam8bitTest, StepsMatchReference) {
  const auto [n, block, group] = GetParam();
  auto& dev = TestDevice::get();
  const ops::AdamConfig c{0.9f, 0.999f, 1e-8f, 0.01f, true};
  Device8bit d(random_vector(n, 2), block);
  const ops::LaunchList update = d.bind(c, {}, group);
  const float lrs[] = {0.01f, 0.02f, 0.005f, 0.01f};
  std::size_t flips = 0;
  for (std::uint64_t s = 0; s < std::size(lrs); ++s) {
    SCOPED_TRACE(fmt::format("step {}", s + 1));
    auto w_ref = to_double(d.w.download());
    const auto w_before = w_ref;
    auto m_ref = codes_as_double(d.m.download()), v_ref = codes_as_double(d.v.download());
    auto scales_ref = to_double(d.scales.download());
    const auto g = spread_gradient(n, 300 + static_cast<std::uint32_t>(s));
    d.g.upload(g);
    const ops::StepInfo info{s + 1, lrs[s]};
    ops::run_blocking(dev.context.compute(), update, info);
    ops::ref::adam8bit_update<double>(c, block, info, w_ref, to_double(g), m_ref, v_ref, scales_ref);

    const auto w = d.w.download();
    flips += expect_near_reference(block, w, d.m.download(), d.v.download(), to_double(d.scales.download()), w_before,
                                   w_ref, m_ref, v_ref, scales_ref);
    EXPECT_NE(w[0], static_cast<float>(w_before[0])) << "the update must move w";
  }
  EXPECT_LE(flips, std::max<std::size_t>(2, n * std::size(lrs) / 1000)) << "codes differing from the reference";
}

INSTANTIATE_TEST_SUITE_P(Sizes, Adam8bitTest,
                         ::testing::Combine(::testing::Values(1, 1000, 2048, 5000, 3 * 2048 + 17),
                                            ::testing::Values(256u, 2048u), ::testing::Values(0u, 256u)));
// The largest block: each work-item holds the most elements.
INSTANTIATE_TEST_SUITE_P(LargestBlock, Adam8bitTest,
                         ::testing::Values(std::make_tuple(std::size_t{2 * 16384 + 5}, ops::adam8bit_max_block, 0u)));

// The host optimizer's version (ops/optimizer_host.hpp) against the same reference, step after
// step, in place on host state; AdamW and Adam with L2.
class HostAdam8bitTest : public ::testing::TestWithParam<std::tuple<std::size_t, std::uint32_t, bool>> {};

TEST_P(HostAdam8bitTest, StepsMatchReference) {
  const auto [n, block, decoupled] = GetParam();
  const ops::AdamConfig c{0.9f, 0.999f, 1e-8f, 0.01f, decoupled};
  std::vector<float> w = random_vector(n, 2), scales(2 * ops::adam8bit_blocks(n, block), 0.0f);
  std::vector<std::uint8_t> m(n, 128), v(n, 0);  // zero moments (zero scales make any code 0)
  const float lrs[] = {0.01f, 0.02f, 0.005f, 0.01f};
  std::size_t flips = 0;
  for (std::uint64_t s = 0; s < std::size(lrs); ++s) {
    SCOPED_TRACE(fmt::format("step {}", s + 1));
    auto w_ref = to_double(w);
    const auto w_before = w_ref;
    auto m_ref = codes_as_double(m), v_ref = codes_as_double(v);
    auto scales_ref = to_double(scales);
    const auto g = spread_gradient(n, 300 + static_cast<std::uint32_t>(s));
    const ops::StepInfo info{s + 1, lrs[s]};
    EXPECT_TRUE(ops::host_adam8bit_update(
        c, block, info, g.data(),
        {w.data(), m.data(), v.data(), scales.data(), w.data(), m.data(), v.data(), scales.data()}, n));
    ops::ref::adam8bit_update<double>(c, block, info, w_ref, to_double(g), m_ref, v_ref, scales_ref);
    flips += expect_near_reference(block, w, m, v, to_double(scales), w_before, w_ref, m_ref, v_ref, scales_ref);
    EXPECT_NE(w[0], static_cast<float>(w_before[0])) << "the update must move w";
  }
  EXPECT_LE(flips, std::max<std::size_t>(2, n * std::size(lrs) / 1000)) << "codes differing from the reference";
}

INSTANTIATE_TEST_SUITE_P(Sizes, HostAdam8bitTest,
                         ::testing::Combine(::testing::Values(1, 1000, 5000, 3 * 2048 + 17, 2 * 16384 + 5),
                                            ::testing::Values(256u, 2048u, ops::adam8bit_max_block),
                                            ::testing::Bool()));

TEST(Adam8bit, HostUpdateRefusesBadBlocksAndReportsNonFiniteWeights) {
  std::vector<float> w(600, 0.5f), g(600, 0.1f), scales(6, 0.0f);
  std::vector<std::uint8_t> m(600, 128), v(600, 0);
  const ops::Adam8bitSlots slots{w.data(), m.data(), v.data(), scales.data(),
                                 w.data(), m.data(), v.data(), scales.data()};
  EXPECT_THROW(ops::host_adam8bit_update({}, 0, {1, 0.01f}, g.data(), slots, 600), std::invalid_argument);
  EXPECT_THROW(ops::host_adam8bit_update({}, ops::adam8bit_max_block + 1, {1, 0.01f}, g.data(), slots, 600),
               std::invalid_argument);
  EXPECT_THROW(ops::host_adam8bit_update({}, 256, {0, 0.01f}, g.data(), slots, 600), std::invalid_argument);
  g[599] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(ops::host_adam8bit_update({}, 256, {1, 0.01f}, g.data(), slots, 600));
}

// Without a loss guard the 8-bit state tracks fp32 Adam: after a few steps from zero state the
// weights differ from fp32 Adam's by a small fraction of the distance they moved.
TEST(Adam8bit, TracksFp32Adam) {
  auto& dev = TestDevice::get();
  const std::size_t n = 4096;
  const ops::AdamConfig c{0.9f, 0.999f, 1e-8f, 0.0f, true};
  const auto w0 = random_vector(n, 4);
  Device8bit d(w0, 2048);
  const auto update = d.bind(c);
  auto w32 = to_double(w0), m32 = std::vector<double>(n, 0.0), v32 = std::vector<double>(n, 0.0);
  for (std::uint64_t s = 1; s <= 5; ++s) {
    const auto g = random_vector(n, 40 + static_cast<std::uint32_t>(s));
    d.g.upload(g);
    ops::run_blocking(dev.context.compute(), update, {s, 0.01f});
    ops::ref::adam_update<double>(c, {s, 0.01f}, w32, to_double(g), m32, v32);
  }
  const auto w = d.w.download();
  double moved = 0, diff = 0;
  for (std::size_t i = 0; i < n; ++i) {
    moved += std::abs(w32[i] - w0[i]);
    diff += std::abs(w[i] - w32[i]);
  }
  EXPECT_LT(diff, 0.05 * moved) << "mean |w8 - w32| " << diff / n << ", mean movement " << moved / n;
}

// A step whose loss is not finite changes nothing (weights, codes, scales); a finite one updates.
TEST(Adam8bit, GuardSkipsNonFiniteLoss) {
  auto& dev = TestDevice::get();
  const std::size_t n = 3000;
  const ops::AdamConfig c{};
  Device8bit d(random_vector(n, 6), 2048);
  DeviceTensor loss(std::vector<float>{0.5f}, 1);
  const auto update = d.bind(c, loss.span());
  d.g.upload(random_vector(n, 7));
  ops::run_blocking(dev.context.compute(), update, {1, 0.01f});  // a non-trivial state first
  const auto w1 = d.w.download(), s1 = d.scales.download();
  const auto m1 = d.m.download(), v1 = d.v.download();
  d.g.upload(random_vector(n, 8));
  for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity()}) {
    loss.upload({bad});
    ops::run_blocking(dev.context.compute(), update, {2, 0.01f});
    EXPECT_EQ(d.w.download(), w1);
    EXPECT_EQ(d.scales.download(), s1);
    EXPECT_EQ(d.m.download(), m1);
    EXPECT_EQ(d.v.download(), v1);
  }
  loss.upload({0.25f});
  ops::run_blocking(dev.context.compute(), update, {2, 0.01f});
  EXPECT_NE(d.w.download(), w1);
  EXPECT_NE(d.m.download(), m1);
}

// On CPU devices a work-item per block (optimizer8bit_rows.cl, the bucket tables' codes) runs
// where the work-group kernel would: the same weights, codes and scales, bit for bit, step after
// step, with blocks whose tails are not whole vectors; and a weight made not finite is reported.
TEST(Adam8bit, RowsKernelMatchesTheWorkGroupKernel) {
  auto& dev = TestDevice::get();
  if (!dev.context.device().is_cpu()) GTEST_SKIP() << "the rows kernel runs on CPU devices";
  const ops::AdamConfig c{0.9f, 0.999f, 1e-8f, 0.01f, true};
  for (const auto& [n, block] : {std::pair<std::size_t, std::uint32_t>{1000, 256}, {5000, 2048}, {37, 256}}) {
    SCOPED_TRACE(fmt::format("n {} block {}", n, block));
    Device8bit rows(random_vector(n, 2), block), groups(random_vector(n, 2), block);
    const ops::LaunchList rows_update = rows.bind(c), group_update = groups.bind(c, {}, 32);
    for (std::uint64_t s = 1; s <= 3; ++s) {
      const auto g = spread_gradient(n, 40 + static_cast<std::uint32_t>(s));
      rows.g.upload(g);
      groups.g.upload(g);
      ops::run_blocking(dev.context.compute(), rows_update, {s, 0.01f});
      ops::run_blocking(dev.context.compute(), group_update, {s, 0.01f});
      ASSERT_EQ(rows.w.download(), groups.w.download()) << "step " << s;
      ASSERT_EQ(rows.scales.download(), groups.scales.download()) << "step " << s;
      ASSERT_EQ(rows.m.download(), groups.m.download()) << "step " << s;
      ASSERT_EQ(rows.v.download(), groups.v.download()) << "step " << s;
    }
  }
  // A weight made infinite sets the status word.
  Device8bit d(random_vector(100, 3), 256);
  DeviceTensor status(std::vector<float>{0.0f}, 1);
  const ops::LaunchList update = ops::adam8bit_update(dev.env, c, 256, d.w.span(), d.g.span(), d.m.span(), d.v.span(),
                                                      d.scales.span(), 100, {}, 0, status.span());
  std::vector<float> g(100, 0.0f);
  g[77] = std::numeric_limits<float>::infinity();
  d.g.upload(g);
  ops::run_blocking(dev.context.compute(), update, {1, 0.01f});
  EXPECT_NE(status.download()[0], 0.0f) << "the infinite weight should be reported";
}

// A finite gradient whose square overflows makes the second moment's block scale inf with the
// weight finite: the update reports it as it reports a weight made not finite (the trainer's
// overflow guard keeps such gradients from the updates; this is the update's own check).
TEST(Adam8bit, ASecondMomentMadeInfiniteIsReported) {
  auto& dev = TestDevice::get();
  const ops::AdamConfig c{0.9f, 0.999f, 1e-8f, 0.01f, true};
  Device8bit d(random_vector(100, 4), 256);
  DeviceTensor status(std::vector<float>{0.0f}, 1);
  const ops::LaunchList update = ops::adam8bit_update(dev.env, c, 256, d.w.span(), d.g.span(), d.m.span(), d.v.span(),
                                                      d.scales.span(), 100, {}, 0, status.span());
  std::vector<float> g = random_vector(100, 5);
  g[41] = 1e25f;
  d.g.upload(g);
  ops::run_blocking(dev.context.compute(), update, {1, 0.01f});
  EXPECT_NE(status.download()[0], 0.0f) << "the infinite second moment should be reported";
}

TEST(Adam8bit, StepZeroThrows) {
  auto& dev = TestDevice::get();
  Device8bit d(random_vector(300, 1), 256);
  EXPECT_THROW(ops::run_blocking(dev.context.compute(), d.bind({}), {0, 0.1f}), std::invalid_argument);
}

// ---- Block sizes ----

std::string bind_error(std::uint32_t block) {
  Device8bit d(random_vector(100, 1), 2048);
  try {
    ops::adam8bit_update(TestDevice::get().env, {}, block, d.w.span(), d.g.span(), d.m.span(), d.v.span(),
                         d.scales.span(), 100);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Adam8bit, BadBlockSizesAreRejectedSayingWhatToUse) {
  // The kernel runs with work-groups of at most 256, a power of two: a multiple of 256 suits all.
  const std::string not_multiple = bind_error(1000);
  EXPECT_NE(not_multiple.find("block size 1000 is not a multiple of the work-group size"), std::string::npos)
      << not_multiple;
  EXPECT_NE(not_multiple.find("use a multiple of"), std::string::npos) << not_multiple;
  EXPECT_NE(not_multiple.find("e.g. 2048"), std::string::npos) << not_multiple;
  const std::string zero = bind_error(0);
  EXPECT_NE(zero.find("block size 0"), std::string::npos) << zero;
  const std::string huge = bind_error(1u << 20);
  EXPECT_NE(huge.find("block size 1048576 is larger than 16384"), std::string::npos) << huge;

  Device8bit d(random_vector(100, 1), 2048);
  EXPECT_THROW(d.bind({}, {}, 100), std::invalid_argument) << "a work-group size that is not a power of two";
  EXPECT_THROW(d.bind({}, {}, 512), std::invalid_argument) << "a work-group size above 256";

  // The check config parsing uses (the largest work-group the kernel takes).
  EXPECT_NO_THROW(ops::check_adam8bit_block(2048));
  EXPECT_NO_THROW(ops::check_adam8bit_block(256));
  try {
    ops::check_adam8bit_block(1000);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("block size 1000 is not a multiple of the work-group size 256 of this device: "
                                         "use a multiple of 256, e.g. 2048"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(ops::check_adam8bit_block(0), std::invalid_argument);
  EXPECT_THROW(ops::check_adam8bit_block(128), std::invalid_argument);

  // The optimizer pass refuses it before any tensor is made.
  ops::OptimizerConfig spec;
  spec.kind = ops::OptimizerConfig::Kind::adamw8bit;
  spec.block8bit = 1000;
  EXPECT_THROW(training_graph(models::mlp({8}), 4, spec), std::invalid_argument);
}

// ---- Through the trainer ----

TEST(Adam8bit, OptimizerPassMakesU8StateAndScales) {
  ops::OptimizerConfig spec;
  spec.kind = ops::OptimizerConfig::Kind::adamw8bit;
  spec.block8bit = 512;
  const graph::Graph g = training_graph(models::mlp({16}), 4, spec);
  const auto& t = g.tensors;
  std::size_t updates = 0;
  for (graph::NodeId nd = 0; nd < g.nodes.size(); ++nd) {
    if (ops::op_info(g.nodes.op[nd]).name != "adam8bit_update") continue;
    ++updates;
    const auto in = g.nodes.inputs(nd);
    ASSERT_EQ(in.size(), 6u);
    const TensorId w = in[0];
    EXPECT_EQ(t.name[in[2]], t.name[w] + ".adam8_m");
    EXPECT_EQ(t.name[in[3]], t.name[w] + ".adam8_v");
    EXPECT_EQ(t.name[in[4]], t.name[w] + ".adam8_scales");
    EXPECT_EQ(t.dtype[in[2]], graph::DType::u8);
    EXPECT_EQ(t.dtype[in[3]], graph::DType::u8);
    EXPECT_EQ(t.shape[in[2]], t.shape[w]);
    EXPECT_EQ(t.dtype[in[4]], graph::DType::f32);
    EXPECT_EQ(t.shape[in[4]],
              (graph::Shape{2, static_cast<std::uint32_t>(ops::adam8bit_blocks(t.shape[w].elems(), 512))}));
    for (std::size_t k = 2; k < 5; ++k) EXPECT_EQ(t.role[in[k]], graph::Role::optimizer_state);
    EXPECT_EQ(g.nodes.outputs(nd).size(), 4u);
    EXPECT_EQ(ops::UpdateAttrs::of(g.nodes.attrs[nd]).block8bit, 512);
  }
  EXPECT_EQ(updates, 4u) << "two Linear layers, weight and bias each";
}

// A tiny model: the trainer's steps agree with the reference executor running the row's CPU
// reference (few elements, so no code lands near a rounding midpoint), with the updates on the
// device and on the host (--host-optimizer: the 8-bit state streams in host memory and the host
// version of the row updates it in place).
TEST(Adam8bit, TrainerMatchesReferenceExecutor) {
  Runtime runtime;
  const ModelSpec model = models::classifier(
      "tiny", graph::Shape{12}, 4, [](graph::Builder& b, TensorId x) { return b.linear(b.relu(b.linear(x, 16)), 4); });
  for (const bool host : {false, true}) {
    SCOPED_TRACE(host ? "host optimizer" : "device");
    TrainerOptions topt;
    topt.batch = 8;
    topt.lr = 0.01f;
    topt.optimizer.kind = ops::OptimizerConfig::Kind::adamw8bit;
    topt.optimizer.adam.weight_decay = 0.01f;
    topt.optimizer.block8bit = 256;
    if (host) {
      topt.residency.mode = graph::ResidencyMode::stream;
      topt.residency.host_optimizer = true;
    }
    Trainer trainer(runtime, model, topt);
    EXPECT_EQ(trainer.residency().host_updates > 0, host);
    expect_training_matches_reference(trainer, 4, 70);
  }
}

// A small MLP learns a fixed set of samples with adamw8bit, and its optimizer state is about a
// quarter of fp32 Adam's (one byte per moment, plus a scale per block).
TEST(Adam8bit, TrainsAndKeepsAQuarterOfAdamsState) {
  Runtime runtime;
  const ModelSpec model = models::mlp({64});
  TrainerOptions topt;
  topt.batch = 32;
  topt.lr = 2e-3f;
  topt.optimizer.kind = ops::OptimizerConfig::Kind::adamw8bit;
  topt.optimizer.adam.weight_decay = 0.01f;
  Trainer trainer(runtime, model, topt);
  TrainerOptions adam_opt = topt;
  adam_opt.optimizer.kind = ops::OptimizerConfig::Kind::adam;
  const Trainer adam(runtime, model, adam_opt);
  const double ratio = double(trainer.optimizer_state_bytes()) / double(adam.optimizer_state_bytes());
  EXPECT_LE(ratio, 0.27) << trainer.optimizer_state_bytes() << " vs " << adam.optimizer_state_bytes();
  EXPECT_GE(ratio, 0.25);

  // 4 batches of inputs whose label is a fixed function of the input (the sign pattern of two
  // random projections), so the model can fit them.
  const std::size_t sample = sample_elems(model);
  std::vector<std::vector<float>> images;
  std::vector<std::vector<std::int32_t>> labels;
  const auto p1 = random_vector(sample, 91), p2 = random_vector(sample, 92);
  for (std::uint32_t b = 0; b < 4; ++b) {
    images.push_back(random_vector(topt.batch * sample, 100 + b, 0.0f, 1.0f));
    std::vector<std::int32_t> l(topt.batch);
    for (std::size_t i = 0; i < l.size(); ++i) {
      double a = 0, c = 0;
      for (std::size_t k = 0; k < sample; ++k) {
        a += p1[k] * images[b][i * sample + k];
        c += p2[k] * images[b][i * sample + k];
      }
      l[i] = (a > 0 ? 1 : 0) + (c > 0 ? 2 : 0);
    }
    labels.push_back(l);
  }
  double first = 0, last = 0;
  const int epochs = 15;
  for (int e = 0; e < epochs; ++e) {
    double sum = 0;
    for (std::size_t b = 0; b < images.size(); ++b) {
      const StepResult r = trainer.step(images[b], labels[b]);
      ASSERT_TRUE(std::isfinite(r.loss));
      sum += r.loss;
    }
    if (e == 0) first = sum / images.size();
    last = sum / images.size();
  }
  EXPECT_LT(last, 0.5 * first) << "the model did not learn: mean loss " << first << " -> " << last;
}

}  // namespace
}  // namespace ferry::test
