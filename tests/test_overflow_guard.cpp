// Overflow guard: the init and per-gradient check kernels against the CPU reference, with finite
// gradients, gradients with one or many non-finite elements (every writer racing to store the
// same NaN), finite elements at the limit (2^64) and just below it, a non-finite loss, and lengths
// that are not multiples of the work-group size.
#include <cmath>
#include <limits>

#include "ops/overflow_guard.hpp"
#include "ops/quantize_host.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

struct GuardCase {
  std::size_t elems;
  std::size_t bad_every;  // 0: all finite; else every bad_every-th element is inf or NaN
  float loss;
};

class OverflowGuardTest : public ::testing::TestWithParam<GuardCase> {};

TEST_P(OverflowGuardTest, InitAndChecksMatchTheReference) {
  const GuardCase c = GetParam();
  auto& dev = TestDevice::get();
  const std::vector<float> stats{c.loss, 3.0f};
  auto clean = random_vector(c.elems, 1);
  auto dirty = random_vector(c.elems, 2);
  for (std::size_t i = 0; c.bad_every && i < c.elems; i += c.bad_every) {
    dirty[i] = i % 2 ? std::numeric_limits<float>::quiet_NaN() : -std::numeric_limits<float>::infinity();
  }
  DeviceTensor dstats(stats), dclean(clean, 5), ddirty(dirty, 9), dguard(1, 3);
  ops::LaunchList list = ops::overflow_guard_init(dev.env, dstats.span(), dguard.span());
  for (const DeviceTensor* g : {&dclean, &ddirty}) {
    for (auto& l : ops::overflow_guard_check(dev.env, g->span(), c.elems, dguard.span())) list.push_back(std::move(l));
  }
  ops::run_blocking(dev.context.compute(), list);
  const std::span<const float> grads[] = {clean, dirty};
  const float expected = ops::ref::overflow_guard<float>(c.loss, grads);
  const float got = dguard.download()[0];
  if (std::isnan(expected)) {
    EXPECT_TRUE(std::isnan(got)) << got;
  } else {
    EXPECT_EQ(got, expected);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, OverflowGuardTest,
                         ::testing::Values(GuardCase{1, 0, 2.5f}, GuardCase{1000, 0, 0.25f}, GuardCase{1000, 999, 1.0f},
                                           GuardCase{4099, 1, 1.0f}, GuardCase{65, 7, 1.0f},
                                           GuardCase{64, 0, std::numeric_limits<float>::infinity()},
                                           GuardCase{64, 0, std::numeric_limits<float>::quiet_NaN()}));

// One non-finite element alone, wherever it lies: inside a whole chunk of 256 that CPU devices read
// as vectors (first, middle, last element of a chunk) or in the elements after the last chunk.
TEST(OverflowGuard, OneBadElementAnywhereIsFound) {
  auto& dev = TestDevice::get();
  const std::size_t n = 1000;  // three chunks of 256 and 232 elements after them
  for (const std::size_t at : {std::size_t{0}, std::size_t{300}, std::size_t{511}, std::size_t{768}, n - 1}) {
    for (const float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                            ops::gradient_limit, -ops::gradient_limit}) {
      SCOPED_TRACE(testing::Message() << "element " << at << " = " << bad);
      auto g = random_vector(n, 4);
      g[at] = bad;
      DeviceTensor dstats(std::vector<float>{1.5f}), dg(g, 3), dguard(1, 5);
      ops::LaunchList list = ops::overflow_guard_init(dev.env, dstats.span(), dguard.span());
      for (auto& l : ops::overflow_guard_check(dev.env, dg.span(), n, dguard.span())) list.push_back(std::move(l));
      ops::run_blocking(dev.context.compute(), list);
      EXPECT_TRUE(std::isnan(dguard.download()[0]));
      EXPECT_FALSE(ops::all_usable_host(g));
    }
  }
}

// Finite gradients just below the limit pass, wherever they lie (their squares are finite floats:
// Adam's second moment can hold them); the device, the reference and the host check agree.
TEST(OverflowGuard, GradientsJustBelowTheLimitPass) {
  auto& dev = TestDevice::get();
  const std::size_t n = 1000;
  const float below = std::nextafter(ops::gradient_limit, 0.0f);
  ASSERT_TRUE(std::isfinite(below * below));
  auto g = random_vector(n, 8);
  for (const std::size_t at : {std::size_t{0}, std::size_t{300}, std::size_t{511}, n - 1})
    g[at] = at % 2 ? -below : below;
  DeviceTensor dstats(std::vector<float>{1.5f}), dg(g, 3), dguard(1, 5);
  ops::LaunchList list = ops::overflow_guard_init(dev.env, dstats.span(), dguard.span());
  for (auto& l : ops::overflow_guard_check(dev.env, dg.span(), n, dguard.span())) list.push_back(std::move(l));
  ops::run_blocking(dev.context.compute(), list);
  EXPECT_EQ(dguard.download()[0], 1.5f);
  EXPECT_EQ(ops::ref::overflow_guard_check<float>(1.5f, g), 1.5f);
  EXPECT_TRUE(ops::all_usable_host(g));
}

// A narrow gradient checked as its widening cast would make it (overflow_guard_check_scaled): the
// element times the cast's factor for the step, so a bf16 value that the factor takes past the
// largest float is caught, and a non-finite element anywhere (in a CPU work-item's chunk of 256 or
// after the last one) too; the reference agrees in each case. GPUs run one element per work-item.
TEST(OverflowGuard, NarrowGradientsAreCheckedAsTheirWidenedValues) {
  auto& dev = TestDevice::get();
  const std::size_t n = 1000;
  struct Case {
    ops::DType dtype;
    std::size_t at;
    float value;  // element `at`, before the factor
    float loss_scale;
    ops::CastScale scale;
    bool finite;
  };
  const float big = 3.0e38f, inf = std::numeric_limits<float>::infinity(),
              nan = std::numeric_limits<float>::quiet_NaN();
  const Case cases[] = {
      {ops::DType::bf16, 300, 2.5f, 1024.0f, ops::CastScale::inverse_loss_scale, true},
      {ops::DType::bf16, 511, big, 0.5f, ops::CastScale::inverse_loss_scale, false},    // the factor 2 overflows it
      {ops::DType::bf16, 511, 3e19f, 0.5f, ops::CastScale::inverse_loss_scale, false},  // past 2^64 by the factor 2
      {ops::DType::bf16, 511, 3e19f, 2.0f, ops::CastScale::inverse_loss_scale, true},   // below it by the factor 0.5
      {ops::DType::bf16, 999, nan, 1.0f, ops::CastScale::none, false},
      {ops::DType::f16, 0, inf, 65536.0f, ops::CastScale::inverse_loss_scale, false},
      {ops::DType::f16, 768, 60000.0f, 65536.0f, ops::CastScale::inverse_loss_scale, true},
      {ops::DType::f16, 999, -inf, 1.0f, ops::CastScale::none, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << ops::dtype_name(c.dtype) << " element " << c.at << " = " << c.value
                                    << ", loss scale " << c.loss_scale);
    auto values = random_vector(n, 6);
    values[c.at] = c.value;
    std::vector<std::uint16_t> narrow(n);
    ops::cast_host(ops::DType::f32, c.dtype, values.data(), narrow.data(), n);
    const auto dg = DeviceBytes::from(narrow, 3);
    DeviceTensor dstats(std::vector<float>{1.5f}), dguard(1, 5);
    ops::LaunchList list = ops::overflow_guard_init(dev.env, dstats.span(), dguard.span());
    for (auto& l : ops::overflow_guard_check_scaled(dev.env, c.dtype, dg.span(), n, c.scale, dguard.span())) {
      list.push_back(std::move(l));
    }
    ops::StepInfo step{1, 0.0f};
    step.loss_scale = c.loss_scale;
    ops::run_blocking(dev.context.compute(), list, step);
    const float got = dguard.download()[0];
    EXPECT_EQ(std::isnan(got), !c.finite) << got;
    std::vector<float> rounded(n);
    ops::cast_host(c.dtype, ops::DType::f32, narrow.data(), rounded.data(), n);
    const float want = ops::ref::overflow_guard_check_scaled<float>(1.5f, rounded, ops::cast_factor(c.scale, step));
    EXPECT_EQ(std::isnan(want), !c.finite) << "the reference: " << want;
  }
  DeviceTensor guard(1);
  EXPECT_THROW(
      ops::overflow_guard_check_scaled(dev.env, ops::DType::f32, guard.span(), 1, ops::CastScale::none, guard.span()),
      std::invalid_argument);
}

// An empty gradient needs no check: no launch.
TEST(OverflowGuard, EmptyGradientIsNoLaunch) {
  auto& dev = TestDevice::get();
  DeviceTensor g(1), guard(1);
  EXPECT_TRUE(ops::overflow_guard_check(dev.env, g.span(), 0, guard.span()).empty());
}

}  // namespace
}  // namespace ferry::test
