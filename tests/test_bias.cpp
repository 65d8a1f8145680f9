// Bias: device forward and backward against the CPU reference over shapes that are not
// multiples of the work-group size, determinism of the column sums, and the reference backward
// against double-precision finite differences.
#include <cmath>
#include <cstring>

#include "ops/bias.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

class BiasTest : public ::testing::TestWithParam<std::tuple<std::size_t, std::size_t>> {};

TEST_P(BiasTest, ForwardAndBackwardMatchReference) {
  auto [rows, cols] = GetParam();
  auto& dev = TestDevice::get();
  auto y = random_vector(rows * cols, 1), b = random_vector(cols, 2), dy = random_vector(rows * cols, 3);
  DeviceTensor dyv(y), db(b, 3), ddy(dy, 5), ddb(cols, 11);

  ops::run_blocking(dev.context.compute(), ops::bias_forward(dev.env, dyv.span(), db.span(), rows, cols));
  std::vector<float> y_ref = y;
  ops::ref::bias_forward<float>(y_ref, b, rows, cols);
  expect_near(dyv.download(), y_ref, 0.0f, 0.0f, "forward");

  ops::run_blocking(dev.context.compute(), ops::bias_backward(dev.env, ddy.span(), ddb.span(), rows, cols));
  std::vector<double> db_ref(cols);
  ops::ref::bias_backward<double>(to_double(dy), db_ref, rows, cols);
  // Float sums in a different order than the double reference: error grows like sqrt(rows).
  expect_near(ddb.download(), to_float(db_ref), 1e-5f * float(std::sqrt(double(rows)) + 1), 1e-5f, "backward");
}

TEST_P(BiasTest, BackwardIsDeterministic) {
  auto [rows, cols] = GetParam();
  auto& dev = TestDevice::get();
  DeviceTensor ddy(random_vector(rows * cols, 4, -100.0f, 100.0f)), ddb(cols);
  const ops::LaunchList launches = ops::bias_backward(dev.env, ddy.span(), ddb.span(), rows, cols);
  ops::run_blocking(dev.context.compute(), launches);
  const auto first = ddb.download();
  for (int run = 0; run < 3; ++run) {
    ops::run_blocking(dev.context.compute(), launches);
    const auto again = ddb.download();
    ASSERT_EQ(std::memcmp(first.data(), again.data(), cols * sizeof(float)), 0) << "run " << run;
  }
}

// With a guard, the backward checks the sums as it stores them: an infinite dy element (in a whole
// chunk of 16 columns or past the last one) sets the guard to NaN, a finite dy leaves it; db is
// what the unguarded kernel stores.
TEST_P(BiasTest, GuardOverTheSums) {
  auto [rows, cols] = GetParam();
  if (rows * cols > 20000) GTEST_SKIP() << "the guard's paths are covered by the smaller shapes";
  auto& dev = TestDevice::get();
  for (const bool infinite : {false, true}) {
    auto dy = random_vector(rows * cols, 8);
    if (infinite) dy[(rows - 1) * cols + cols - 1] = -INFINITY;
    DeviceTensor ddy(dy), plain(cols, 3), guarded(cols, 5), guard(std::vector<float>{2.5f}, 1);
    ops::run_blocking(dev.context.compute(), ops::bias_backward(dev.env, ddy.span(), plain.span(), rows, cols));
    ops::run_blocking(dev.context.compute(), ops::bias_backward(dev.env, ddy.span(), guarded.span(), rows, cols,
                                                                ops::DType::f32, guard.span()));
    const auto a = plain.download(), b = guarded.download();
    EXPECT_EQ(std::memcmp(a.data(), b.data(), cols * sizeof(float)), 0) << (infinite ? "infinite" : "finite");
    const float g = guard.download()[0];
    if (infinite) {
      EXPECT_TRUE(std::isnan(g)) << g;
    } else {
      EXPECT_EQ(g, 2.5f);
    }
  }
}

TEST_P(BiasTest, ReferenceBackwardMatchesFiniteDifferences) {
  auto [rows, cols] = GetParam();
  if (rows * cols > 20000) GTEST_SKIP() << "the reference is shape-independent; large shapes add only time";
  auto y = to_double(random_vector(rows * cols, 5)), b = to_double(random_vector(cols, 6));
  auto r = to_double(random_vector(rows * cols, 7));
  auto loss = [&, rows = rows, cols = cols](const std::vector<double>& bias) {
    std::vector<double> out = y;
    ops::ref::bias_forward<double>(out, bias, rows, cols);
    return weighted_sum(out, r);
  };
  std::vector<double> grad(cols);
  ops::ref::bias_backward<double>(r, grad, rows, cols);
  expect_gradient_matches_finite_differences(loss, b, grad, "bias");
}

INSTANTIATE_TEST_SUITE_P(Shapes, BiasTest,
                         ::testing::Combine(::testing::Values(1, 3, 64, 257), ::testing::Values(1, 10, 17, 1000)),
                         [](const auto& info) {
                           return case_name(info.param, {"r", "c"});
                         });

}  // namespace
}  // namespace ferry::test
