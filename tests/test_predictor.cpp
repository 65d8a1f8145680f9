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
  FitCase c{random_vector(n, seed),
            random_vector(n, seed + 1),
            random_vector(n, seed + 2, -0.5f, 0.5f),
            {0, 0, 0, 0.75f, 0, 0, 0, 0}};
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
  c.st = {0, 0, 0, 0, 0, 0, 0, 0};
  {
    DeviceFit dev(c);
    dev.run(cfg);
    EXPECT_EQ(dev.st.download()[ops::predictor_stat_gain], 1.0f);
  }
  // An update 10x d: the fitted gain 10 is clamped to 2, then smoothed with the previous 1.
  c = random_case(300, 8);
  c.st = {0, 0, 0, 1.0f, 0, 0, 0, 0};
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
    const std::vector<float> st0{0, 0, 0, 0.5f, 0, 0, 0, 0};
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

// Residual correction: the fit also smooths the residuals delta - gain d into r and weighs them by
// their similarity to the new residual; the apply adds rgain r. Device against reference, with a
// residual that keeps its direction (so rgain grows) over sizes that do not divide the groups.
TEST(PredictorResidual, FitAndApplyMatchReference) {
  auto& dev = TestDevice::get();
  for (std::size_t n : {std::size_t{7}, std::size_t{1000}, std::size_t{100003}}) {
    ops::PredictorConfig cfg;
    cfg.kind = ops::PredictorConfig::Kind::least_squares;
    cfg.beta = 0.8f;
    cfg.residual = true;
    FitCase c = random_case(n, 70 + static_cast<std::uint32_t>(n));
    c.st[ops::predictor_stat_rgain] = 0.25f;
    auto r0 = random_vector(n, 90, -0.2f, 0.2f);
    // The update's part beyond gain d points along r: the new residual resembles the old ones.
    for (std::size_t i = 0; i < n; ++i) c.w[i] += 0.5f * r0[i];
    DeviceTensor r(r0, 13);
    DeviceFit fit(c);
    ops::run_blocking(dev.context.compute(),
                      ops::predictor_fit(dev.env, cfg, fit.w.span(), fit.before.span(), fit.d.span(), fit.st.span(),
                                         fit.scratch.span(), n, {}, r.span()));
    auto w = to_double(c.w), before = to_double(c.before), d = to_double(c.d), st = to_double(c.st), rr = to_double(r0);
    ops::ref::predictor_fit<double>(cfg, w, before, d, st, rr);
    expect_near_all(fit.st.download(), st, 1e-4, "st");
    expect_near_all(fit.d.download(), d, 1e-6, "d");
    expect_near_all(r.download(), rr, 1e-6, "r");
    EXPECT_GT(st[ops::predictor_stat_rgain], 0.25) << "a residual along r raises its weight (n " << n << ")";
    // Apply: w += scale (gain d + rgain r).
    const auto st_dev = fit.st.download();
    DeviceTensor wa(c.before, 2);
    ops::run_blocking(dev.context.compute(),
                      ops::predictor_apply(dev.env, wa.span(), fit.d.span(), fit.st.span(), n, {}, r.span()),
                      ops::StepInfo{1, 0.0f, 0.5f});
    auto want = to_double(c.before);
    ops::ref::predictor_apply<double>(want, to_double(fit.d.download()), to_double(st_dev), 0.5,
                                      to_double(r.download()));
    expect_near_all(wa.download(), want, 1e-6, "w after apply");
  }
}

// A residual that turns against r gives no correction: rgain decays towards 0 (the similarity is
// clamped at 0), and without residual state the r stats stay 0.
TEST(PredictorResidual, OpposedResidualsAreNotTrusted) {
  const std::size_t n = 4096;
  ops::PredictorConfig cfg;
  cfg.beta = 0.5f;
  cfg.residual = true;
  FitCase c = random_case(n, 5);
  c.st[ops::predictor_stat_rgain] = 0.5f;
  auto r0 = random_vector(n, 6, -0.2f, 0.2f);
  for (std::size_t i = 0; i < n; ++i) c.w[i] = c.before[i] + c.d[i] - 2.0f * r0[i];  // residual = -2 r
  auto w = to_double(c.w), before = to_double(c.before), d = to_double(c.d), st = to_double(c.st), rr = to_double(r0);
  ops::ref::predictor_fit<double>(cfg, w, before, d, st, rr);
  EXPECT_DOUBLE_EQ(st[ops::predictor_stat_rgain], 0.25);  // 0.5 * 0.5 + 0.5 * 0
  cfg.residual = false;
  st = to_double(c.st);
  d = to_double(c.d);
  ops::ref::predictor_fit<double>(cfg, w, before, d, st);
  EXPECT_EQ(st[ops::predictor_stat_r_r], 0.0);
  EXPECT_EQ(st[ops::predictor_stat_rgain], 0.5) << "untouched without residual correction";
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
