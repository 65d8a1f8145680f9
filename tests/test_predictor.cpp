// The weight-update predictor's kernels (ops/predictor.hpp) against their CPU references: the
// fit's dot products, gain and smoothed update for both predictors and sizes that do not divide
// the work-groups, the loss guard, determinism, and the apply step.
#include <cmath>
#include <limits>
#include <vector>

#include "ferry/ops/predictor.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

struct FitCase {
  std::vector<float> w, before, d, st;
};

FitCase random_case(std::size_t n, std::uint32_t seed) {
  FitCase c{
      random_vector(n, seed), random_vector(n, seed + 1), random_vector(n, seed + 2, -0.5f, 0.5f), {0, 0, 0, 0.75f}};
  // Make the update correlated with d, as real training makes it, so the gain is not clamped.
  for (std::size_t i = 0; i < n; ++i) c.w[i] = c.before[i] + 0.6f * c.d[i] + 0.1f * c.w[i];
  return c;
}

struct DeviceFit {
  DeviceTensor w, before, d, st, scratch;
  explicit DeviceFit(const FitCase& c)
      : w(c.w), before(c.before, 3), d(c.d, 11), st(c.st, 5), scratch(ops::predictor_fit_scratch_bytes / 4, 1) {}
  void run(const ops::PredictorConfig& cfg, ops::DeviceSpan guard = {}) {
    auto& dev = TestDevice::get();
    ops::run_blocking(dev.context.compute(), ops::predictor_fit(dev.env, cfg, w.span(), before.span(), d.span(),
                                                                st.span(), scratch.span(), w.size(), guard));
  }
};

void expect_near_all(const std::vector<float>& got, const std::vector<double>& want, double rel, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], rel * (1.0 + std::abs(want[i]))) << what << "[" << i << "]";
  }
}

class PredictorFit : public ::testing::TestWithParam<std::tuple<ops::PredictorConfig::Kind, std::size_t>> {};

TEST_P(PredictorFit, MatchesReference) {
  const auto [kind, n] = GetParam();
  ops::PredictorConfig cfg;
  cfg.kind = kind;
  cfg.beta = 0.8f;
  const FitCase c = random_case(n, 40 + static_cast<std::uint32_t>(n));
  DeviceFit dev(c);
  dev.run(cfg);
  auto w = to_double(c.w), before = to_double(c.before), d = to_double(c.d), st = to_double(c.st);
  ops::ref::predictor_fit<double>(cfg, w, before, d, st);
  // Dot products over n terms in float: relative error grows like sqrt(n) epsilon.
  expect_near_all(dev.st.download(), st, 1e-4, "st");
  expect_near_all(dev.d.download(), d, 1e-6, "d");
  if (kind == ops::PredictorConfig::Kind::linear) {
    EXPECT_EQ(dev.st.download()[ops::predictor_stat_gain], 1.0f);
  } else {
    // 0.8 * 0.75 + 0.2 * (fitted ~0.6 + noise): moved from 0.75 towards the fit.
    EXPECT_NE(dev.st.download()[ops::predictor_stat_gain], 0.75f);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, PredictorFit,
    ::testing::Combine(::testing::Values(ops::PredictorConfig::Kind::linear, ops::PredictorConfig::Kind::least_squares),
                       ::testing::Values(std::size_t{1}, std::size_t{7}, std::size_t{1000}, std::size_t{100003})));

TEST(PredictorFit, LeastSquaresGainStartsAtOneAndIsClamped) {
  ops::PredictorConfig cfg;
  cfg.kind = ops::PredictorConfig::Kind::least_squares;
  cfg.beta = 0.5f;
  cfg.max_gain = 2.0f;
  FitCase c = random_case(300, 7);
  std::fill(c.d.begin(), c.d.end(), 0.0f);  // no direction yet: gain 1
  c.st = {0, 0, 0, 0};
  {
    DeviceFit dev(c);
    dev.run(cfg);
    EXPECT_EQ(dev.st.download()[ops::predictor_stat_gain], 1.0f);
  }
  // An update 10x d: the fitted gain 10 is clamped to 2, then smoothed with the previous 1.
  c = random_case(300, 8);
  c.st = {0, 0, 0, 1.0f};
  for (std::size_t i = 0; i < c.w.size(); ++i) c.w[i] = c.before[i] + 10.0f * c.d[i];
  DeviceFit dev(c);
  dev.run(cfg);
  EXPECT_FLOAT_EQ(dev.st.download()[ops::predictor_stat_gain], 1.5f);
}

TEST(PredictorFit, NonFiniteLossChangesNothing) {
  ops::PredictorConfig cfg;
  cfg.kind = ops::PredictorConfig::Kind::least_squares;
  const FitCase c = random_case(500, 3);
  DeviceFit dev(c);
  DeviceTensor guard(std::vector<float>{std::numeric_limits<float>::infinity()}, 2);
  dev.run(cfg, guard.span());
  EXPECT_EQ(dev.d.download(), c.d);
  EXPECT_EQ(dev.st.download(), c.st);
  DeviceTensor finite(std::vector<float>{1.5f}, 2);
  dev.run(cfg, finite.span());
  EXPECT_NE(dev.d.download(), c.d);
}

TEST(PredictorFit, DeterministicBits) {
  ops::PredictorConfig cfg;
  const FitCase c = random_case(54321, 12);
  DeviceFit a(c), b(c);
  a.run(cfg);
  b.run(cfg);
  EXPECT_EQ(a.st.download(), b.st.download());
  EXPECT_EQ(a.d.download(), b.d.download());
}

TEST(PredictorApply, MatchesReferenceAndHonoursTheGuard) {
  for (std::size_t n : {1u, 65u, 4099u}) {
    const auto w0 = random_vector(n, 21), d0 = random_vector(n, 22);
    const std::vector<float> st0{0, 0, 0, 0.5f};
    DeviceTensor w(w0), d(d0, 9), st(st0, 4);
    auto& dev = TestDevice::get();
    DeviceTensor inf(std::vector<float>{std::nanf("")}, 1);
    ops::run_blocking(dev.context.compute(),
                      ops::predictor_apply(dev.env, w.span(), d.span(), st.span(), n, inf.span()));
    EXPECT_EQ(w.download(), w0) << "a NaN loss skips the prediction";
    ops::run_blocking(dev.context.compute(), ops::predictor_apply(dev.env, w.span(), d.span(), st.span(), n),
                      ops::StepInfo{1, 0.0f, 0.25f});
    auto want = to_double(w0);
    ops::ref::predictor_apply<double>(want, to_double(d0), to_double(st0), 0.25);
    expect_near_all(w.download(), want, 1e-6, "w");
  }
}

TEST(PredictorConfig, BadSettingsAreClearErrors) {
  ops::PredictorConfig c;
  c.beta = 1.0f;
  EXPECT_THROW(ops::check_predictor(c), std::invalid_argument);
  c.beta = -0.1f;
  EXPECT_THROW(ops::check_predictor(c), std::invalid_argument);
  c.beta = 0.5f;
  c.max_gain = std::nanf("");
  EXPECT_THROW(ops::check_predictor(c), std::invalid_argument);
  EXPECT_THROW(ops::parse_predictor("cubic"), std::invalid_argument);
  EXPECT_EQ(ops::parse_predictor("lsq"), ops::PredictorConfig::Kind::least_squares);
}

}  // namespace
}  // namespace ferry::test
