// LayerNorm: device forward (y, mean, rstd) and backward (dx, dgamma, dbeta) against the CPU
// reference over shapes that are not multiples of the work-group size, determinism, stability
// for rows with a large common offset, and the reference backward against double-precision
// finite differences for x, gamma and beta.
#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>

#include "ferry/ops/cast.hpp"
#include "ops/layernorm.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

struct Inputs {
  std::vector<float> x, gamma, beta, dy;
};

Inputs make_inputs(std::size_t rows, std::size_t cols, std::uint32_t seed, float offset = 0.0f) {
  Inputs in{random_vector(rows * cols, seed, -2.0f, 2.0f), random_vector(cols, seed + 1, 0.5f, 1.5f),
            random_vector(cols, seed + 2), random_vector(rows * cols, seed + 3)};
  for (auto& v : in.x) v += offset;
  return in;
}

struct DeviceRun {
  std::vector<float> y, mean, rstd, dx, dgamma, dbeta;
};

DeviceRun run_device(const Inputs& in, std::size_t rows, std::size_t cols, float eps) {
  auto& dev = TestDevice::get();
  DeviceTensor dx_in(in.x, 3), dgamma_in(in.gamma, 5), dbeta_in(in.beta, 1), dy_in(in.dy, 2);
  DeviceTensor y(rows * cols, 4), mean(rows, 6), rstd(rows, 8), dx(rows * cols, 10), dgamma(cols, 12), dbeta(cols, 14);
  ops::run_blocking(dev.context.compute(),
                    ops::layernorm_forward(dev.env, dx_in.span(), dgamma_in.span(), dbeta_in.span(), y.span(),
                                           mean.span(), rstd.span(), rows, cols, eps));
  ops::run_blocking(dev.context.compute(),
                    ops::layernorm_backward(dev.env, dx_in.span(), dgamma_in.span(), mean.span(), rstd.span(),
                                            dy_in.span(), dx.span(), dgamma.span(), dbeta.span(), rows, cols));
  return {y.download(), mean.download(), rstd.download(), dx.download(), dgamma.download(), dbeta.download()};
}

// The residual form (add_layernorm): x = a + b written and normalised in one pass, and the
// backward's dres added into dx, bit for bit what the plain kernels give on the float sum and
// the float add of the gradients.
TEST(LayerNorm, ResidualSumAndGradientMatchThePlainKernelsBitForBit) {
  auto& dev = TestDevice::get();
  for (const auto& [rows, cols] : {std::pair<std::size_t, std::size_t>{5, 40}, {3, 7}, {64, 128}}) {
    SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols));
    const Inputs in = make_inputs(rows, cols, 21);
    const auto b = random_vector(rows * cols, 99, -1.0f, 1.0f), dres = random_vector(rows * cols, 98);
    std::vector<float> sum(rows * cols), want_dx(rows * cols);
    for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = in.x[i] + b[i];
    const DeviceRun plain = run_device(Inputs{sum, in.gamma, in.beta, in.dy}, rows, cols, 1e-5f);
    for (std::size_t i = 0; i < sum.size(); ++i) want_dx[i] = plain.dx[i] + dres[i];

    DeviceTensor ta(in.x, 3), tb(b, 5), tg(in.gamma, 1), tbeta(in.beta, 2), tdy(in.dy, 4), tres(dres, 6);
    DeviceTensor x(rows * cols, 8), y(rows * cols, 9), mean(rows, 10), rstd(rows, 11), dx(rows * cols, 12),
        dg(cols, 13), db(cols, 14);
    ops::run_blocking(dev.context.compute(),
                      ops::layernorm_forward(dev.env, x.span(), tg.span(), tbeta.span(), y.span(), mean.span(),
                                             rstd.span(), rows, cols, 1e-5f, ta.span(), tb.span()));
    ops::run_blocking(dev.context.compute(),
                      ops::layernorm_backward(dev.env, x.span(), tg.span(), mean.span(), rstd.span(), tdy.span(),
                                              dx.span(), dg.span(), db.span(), rows, cols, tres.span()));
    EXPECT_EQ(x.download(), sum);
    EXPECT_EQ(y.download(), plain.y);
    EXPECT_EQ(mean.download(), plain.mean);
    EXPECT_EQ(rstd.download(), plain.rstd);
    EXPECT_EQ(dx.download(), want_dx);
    EXPECT_EQ(dg.download(), plain.dgamma);
    EXPECT_EQ(db.download(), plain.dbeta);
  }
  DeviceTensor one(8);
  EXPECT_THROW(ops::layernorm_forward(dev.env, one.span(), one.span(), one.span(), one.span(), one.span(), one.span(),
                                      1, 8, 1e-5f, one.span(), {}),
               std::invalid_argument);
}

// y stored in f16 or bf16 (a cast folded in: graph::fuse_narrowing_casts) holds the bits the cast
// kernel makes of the f32 y, in the plain and the residual form, over rows of whole 16-column
// chunks, of a partial one past them, and shorter than one; so does a residual whose b is narrow.
TEST(LayerNorm, NarrowOutputIsTheCastOfTheF32Output) {
  auto& dev = TestDevice::get();
  for (const ops::DType to : {ops::DType::f16, ops::DType::bf16}) {
    for (const auto& shape : {std::pair<std::size_t, std::size_t>{5, 40}, {3, 7}, {64, 128}, {9, 35}}) {
      const std::size_t rows = shape.first, cols = shape.second;  // (lambdas below capture them)
      for (const bool residual : {false, true}) {
        SCOPED_TRACE(fmt::format("{} {} x {}{}", ops::dtype_name(to), rows, cols, residual ? " residual" : ""));
        const Inputs in = make_inputs(rows, cols, 31);
        const auto other = random_vector(rows * cols, 77, -1.0f, 1.0f);
        const std::size_t n = rows * cols;
        // x: the input, or with a residual the sum this run writes from a and b.
        const auto run = [&](ops::DType y_dtype, DeviceTensor& y) {
          DeviceTensor x(in.x, 3), a(in.x, 4), b(other, 5), g(in.gamma, 1), beta(in.beta, 2), mean(rows, 6),
              rstd(rows, 8);
          ops::run_blocking(
              dev.context.compute(),
              ops::layernorm_forward(dev.env, x.span(), g.span(), beta.span(), y.span(), mean.span(), rstd.span(), rows,
                                     cols, 1e-5f, residual ? a.span() : ops::DeviceSpan{},
                                     residual ? b.span() : ops::DeviceSpan{}, y_dtype));
          return std::pair(mean.download(), rstd.download());
        };
        DeviceTensor wide(n, 9), cast(n, 10), narrow(n, 11);
        const auto stats_wide = run(ops::DType::f32, wide);
        ops::run_blocking(dev.context.compute(), ops::cast(dev.env, ops::DType::f32, to, wide.span(), cast.span(), n));
        const auto stats_narrow = run(to, narrow);
        const std::vector<float> want = cast.download(), got = narrow.download();
        EXPECT_EQ(std::memcmp(want.data(), got.data(), n * 2), 0) << "the narrow y differs from the cast";
        EXPECT_EQ(stats_wide, stats_narrow);
        if (!residual) continue;
        // b narrow, read by the sum (a residual branch's narrow output): the sum, y and the
        // statistics of b widened by a cast first, bit for bit.
        DeviceTensor b32(other, 5), b_narrow(n, 12), b_wide(n, 13);
        ops::run_blocking(dev.context.compute(),
                          ops::cast(dev.env, ops::DType::f32, to, b32.span(), b_narrow.span(), n));
        ops::run_blocking(dev.context.compute(),
                          ops::cast(dev.env, to, ops::DType::f32, b_narrow.span(), b_wide.span(), n));
        const auto sum_run = [&](ops::DeviceSpan b, ops::DType b_dtype) {
          DeviceTensor x(n, 3), a(in.x, 4), g(in.gamma, 1), beta(in.beta, 2), y(n, 9), mean(rows, 6), rstd(rows, 8);
          ops::run_blocking(dev.context.compute(),
                            ops::layernorm_forward(dev.env, x.span(), g.span(), beta.span(), y.span(), mean.span(),
                                                   rstd.span(), rows, cols, 1e-5f, a.span(), b, to, b_dtype));
          // y: n elements of 2 bytes, compared as bytes (the rest of the buffer is not written).
          const std::vector<float> y_all = y.download();
          std::vector<float> y_bytes(n);
          for (std::size_t i = 0; i < n; ++i) {
            std::uint16_t e;
            std::memcpy(&e, reinterpret_cast<const std::byte*>(y_all.data()) + 2 * i, 2);
            y_bytes[i] = static_cast<float>(e);
          }
          return std::vector<std::vector<float>>{x.download(), y_bytes, mean.download(), rstd.download()};
        };
        EXPECT_EQ(sum_run(b_narrow.span(), to), sum_run(b_wide.span(), ops::DType::f32));
      }
    }
  }
  DeviceTensor one(8);
  EXPECT_THROW(ops::layernorm_forward(dev.env, one.span(), one.span(), one.span(), one.span(), one.span(), one.span(),
                                      1, 8, 1e-5f, {}, {}, ops::DType::i32),
               std::invalid_argument);
  EXPECT_THROW(ops::layernorm_forward(dev.env, one.span(), one.span(), one.span(), one.span(), one.span(), one.span(),
                                      1, 8, 1e-5f, one.span(), one.span(), ops::DType::f32, ops::DType::i8),
               std::invalid_argument);
}

// With a guard, the backward checks dgamma and dbeta as it stores them: a dy element made infinite
// (in the last row, in a whole chunk of 16 columns and in the columns past the last whole chunk)
// sets the guard to NaN, a finite dy leaves it; the gradients are those of the unguarded kernels.
TEST(LayerNorm, GuardOverTheGainAndShiftGradients) {
  auto& dev = TestDevice::get();
  for (const auto& [rows, cols, col] :
       {std::tuple<std::size_t, std::size_t, std::size_t>{5, 40, 3}, {5, 40, 37}, {3, 7, 6}, {64, 128, 127}}) {
    for (const bool infinite : {false, true}) {
      SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols) + (infinite ? " infinite" : " finite"));
      Inputs in = make_inputs(rows, cols, 31);
      if (infinite) in.dy[(rows - 1) * cols + col] = INFINITY;
      const DeviceRun plain = run_device(in, rows, cols, 1e-5f);
      DeviceTensor tx(in.x, 3), tg(in.gamma, 1), tdy(in.dy, 4), mean(plain.mean, 5), rstd(plain.rstd, 6),
          dx(rows * cols, 8), dg(cols, 9), db(cols, 10), guard(std::vector<float>{2.5f}, 2);
      ops::run_blocking(dev.context.compute(),
                        ops::layernorm_backward(dev.env, tx.span(), tg.span(), mean.span(), rstd.span(), tdy.span(),
                                                dx.span(), dg.span(), db.span(), rows, cols, {}, guard.span()));
      const auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
        return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
      };
      EXPECT_TRUE(same_bits(dg.download(), plain.dgamma));
      EXPECT_TRUE(same_bits(db.download(), plain.dbeta));
      const float g = guard.download()[0];
      if (infinite) {
        EXPECT_TRUE(std::isnan(g)) << g;
      } else {
        EXPECT_EQ(g, 2.5f);
      }
    }
  }
}

// (rows, cols, forced row group size)
class LayerNormTest : public ::testing::TestWithParam<std::tuple<std::size_t, std::size_t, std::size_t>> {};
class LayerNormTestReference : public ::testing::TestWithParam<std::tuple<std::size_t, std::size_t>> {};

TEST_P(LayerNormTest, ForwardAndBackwardMatchReference) {
  auto [rows, cols, group] = GetParam();
  const ScopedRowGroupSize forced(group);
  const float eps = 1e-5f;
  const Inputs in = make_inputs(rows, cols, 1);
  const DeviceRun got = run_device(in, rows, cols, eps);

  std::vector<double> y(rows * cols), mean(rows), rstd(rows), dx(rows * cols), dgamma(cols), dbeta(cols);
  ops::ref::layernorm_forward<double>(to_double(in.x), to_double(in.gamma), to_double(in.beta), y, mean, rstd, rows,
                                      cols, eps);
  ops::ref::layernorm_backward<double>(to_double(in.x), to_double(in.gamma), mean, rstd, to_double(in.dy), dx, dgamma,
                                       dbeta, rows, cols);
  // cols == 1 normalises to 0 with rstd = 1/sqrt(eps): outputs are beta, dx is 0.
  const float rs_tol = cols == 1 ? 1e-3f : 1e-5f;
  expect_near(got.mean, to_float(mean), 1e-6f, 1e-5f, "mean");
  expect_near(got.rstd, to_float(rstd), 1e-5f, rs_tol, "rstd");
  expect_near(got.y, to_float(y), 2e-5f, 1e-4f, "y");
  expect_near(got.dx, to_float(dx), 1e-4f, 1e-3f, "dx");
  const float sum_tol = 1e-5f * float(std::sqrt(double(rows)) + 1);
  expect_near(got.dgamma, to_float(dgamma), sum_tol, 1e-4f, "dgamma");
  expect_near(got.dbeta, to_float(dbeta), sum_tol, 1e-4f, "dbeta");
}

TEST_P(LayerNormTest, IsDeterministic) {
  auto [rows, cols, group] = GetParam();
  const ScopedRowGroupSize forced(group);
  const Inputs in = make_inputs(rows, cols, 7);
  const DeviceRun a = run_device(in, rows, cols, 1e-5f), b = run_device(in, rows, cols, 1e-5f);
  auto same = [](const std::vector<float>& u, const std::vector<float>& v) {
    return u.size() == v.size() && std::memcmp(u.data(), v.data(), u.size() * sizeof(float)) == 0;
  };
  EXPECT_TRUE(same(a.y, b.y));
  EXPECT_TRUE(same(a.dx, b.dx));
  EXPECT_TRUE(same(a.dgamma, b.dgamma));
  EXPECT_TRUE(same(a.dbeta, b.dbeta));
}

TEST_P(LayerNormTestReference, ReferenceBackwardMatchesFiniteDifferences) {
  auto [rows, cols] = GetParam();
  if (rows * cols > 20000) GTEST_SKIP() << "covered by the smaller shapes; the check costs rows*cols per probe";
  const Inputs in = make_inputs(rows, cols, 11);
  auto x = to_double(in.x), gamma = to_double(in.gamma), beta = to_double(in.beta), r = to_double(in.dy);
  const double eps = 1e-5;
  auto loss = [&, rows = rows, cols = cols](const std::vector<double>& xv, const std::vector<double>& gv,
                                            const std::vector<double>& bv) {
    std::vector<double> y(rows * cols), mean(rows), rstd(rows);
    ops::ref::layernorm_forward<double>(xv, gv, bv, y, mean, rstd, rows, cols, eps);
    return weighted_sum(y, r);
  };
  std::vector<double> y(rows * cols), mean(rows), rstd(rows), dx(rows * cols), dgamma(cols), dbeta(cols);
  ops::ref::layernorm_forward<double>(x, gamma, beta, y, mean, rstd, rows, cols, eps);
  ops::ref::layernorm_backward<double>(x, gamma, mean, rstd, r, dx, dgamma, dbeta, rows, cols);
  expect_gradient_matches_finite_differences([&](const std::vector<double>& v) { return loss(v, gamma, beta); }, x, dx,
                                             "dx");
  expect_gradient_matches_finite_differences([&](const std::vector<double>& v) { return loss(x, v, beta); }, gamma,
                                             dgamma, "dgamma");
  expect_gradient_matches_finite_differences([&](const std::vector<double>& v) { return loss(x, gamma, v); }, beta,
                                             dbeta, "dbeta");
}

INSTANTIATE_TEST_SUITE_P(Shapes, LayerNormTest,
                         ::testing::Combine(::testing::Values(1, 3, 64, 257), ::testing::Values(1, 10, 17, 1000),
                                            ::testing::Values(0, 64)),
                         [](const auto& info) {
                           return case_name(info.param, {"r", "c", "g"});
                         });
INSTANTIATE_TEST_SUITE_P(Shapes, LayerNormTestReference,
                         ::testing::Combine(::testing::Values(1, 3, 64, 257), ::testing::Values(1, 10, 17, 1000)),
                         [](const auto& info) {
                           return case_name(info.param, {"r", "c"});
                         });

TEST(LayerNorm, LargeOffsetDoesNotCancel) {
  // Rows centred at 1000 with unit spread: E[x^2] - E[x]^2 would lose most digits in float.
  const std::size_t rows = 5, cols = 300;
  const Inputs in = make_inputs(rows, cols, 21, 1000.0f);
  const DeviceRun got = run_device(in, rows, cols, 1e-5f);
  std::vector<double> y(rows * cols), mean(rows), rstd(rows);
  ops::ref::layernorm_forward<double>(to_double(in.x), to_double(in.gamma), to_double(in.beta), y, mean, rstd, rows,
                                      cols, 1e-5);
  expect_near(got.rstd, to_float(rstd), 0.0f, 1e-4f, "rstd");
  // x itself is only float-accurate to 1000 * 2^-24 ~ 6e-5, which rstd ~ 1.7 and gamma amplify.
  expect_near(got.y, to_float(y), 5e-4f, 1e-4f, "y");
}

}  // namespace
}  // namespace ferry::test
