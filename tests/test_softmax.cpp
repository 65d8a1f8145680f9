// Softmax over the last axis: device forward and backward against the CPU reference over row
// counts and lengths that are not multiples of the work-group size (a work-item per row and
// forced work-groups), stability for large logits, masked (-inf) entries, in-place use,
// determinism, the reference backward against finite differences, and the op table rows in a
// small model trained on the device against the reference executor.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <tuple>

#include "classifier.hpp"
#include "ferry/ferry.hpp"
#include "ferry/ops/launch.hpp"
#include "ferry/ops/op_table.hpp"
#include "ops/sequence.hpp"
#include "ops/softmax.hpp"
#include "reference_executor.hpp"
#include "test_support.hpp"
#include "train_check.hpp"

namespace ferry::test {
namespace {

struct DeviceRun {
  std::vector<float> y, dx;
};

DeviceRun run_device(const std::vector<float>& x, const std::vector<float>& dy, std::size_t rows, std::size_t cols) {
  auto& dev = TestDevice::get();
  DeviceTensor tx(x, 3), tdy(dy, 5), ty(rows * cols, 2), tdx(rows * cols, 9);
  ops::run_blocking(dev.context.compute(), ops::softmax_forward(dev.env, tx.span(), ty.span(), rows, cols));
  ops::run_blocking(dev.context.compute(),
                    ops::softmax_backward(dev.env, ty.span(), tdy.span(), tdx.span(), rows, cols));
  return {ty.download(), tdx.download()};
}

struct RefRun {
  std::vector<float> y, dx;
};

RefRun run_reference(const std::vector<float>& x, const std::vector<float>& dy, std::size_t rows, std::size_t cols) {
  std::vector<double> y(rows * cols), dx(rows * cols);
  ops::ref::softmax_forward<double>(to_double(x), y, rows, cols);
  // The device's backward reads the device's y: give the reference the same float y.
  const std::vector<double> yf = to_double(to_float(y));
  ops::ref::softmax_backward<double>(yf, to_double(dy), dx, rows, cols);
  return {to_float(y), to_float(dx)};
}

// The causal softmax equals softmax(causal_mask(x)) (the reference of each), over several
// matrices, with the row group size forced small and large, T including sizes past a float16 chunk.
TEST(Softmax, CausalEqualsSoftmaxOfTheMaskedScores) {
  auto& dev = TestDevice::get();
  for (const std::size_t t : {1u, 5u, 17u, 40u}) {
    for (const std::size_t group : {1u, 64u}) {
      const ScopedRowGroupSize forced(group);
      const std::size_t matrices = 3, rows = matrices * t;
      const auto x = random_vector(rows * t, 7 + t, -4.0f, 4.0f);
      DeviceTensor tx(x, 3), ty(rows * t, 2);
      ops::run_blocking(dev.context.compute(), ops::softmax_forward(dev.env, tx.span(), ty.span(), rows, t, true));
      std::vector<double> masked(rows * t), want(rows * t), fused(rows * t);
      ops::ref::causal_mask_forward<double>(to_double(x), masked, t);
      ops::ref::softmax_forward<double>(masked, want, rows, t);
      ops::ref::softmax_forward<double>(to_double(x), fused, rows, t, true);
      for (std::size_t i = 0; i < fused.size(); ++i) ASSERT_NEAR(fused[i], want[i], 1e-12) << "reference, t " << t;
      expect_near(ty.download(), to_float(want), 1e-7f, 1e-5f, "causal y");
    }
  }
}

// (rows, cols, forced row group size)
class SoftmaxTest : public ::testing::TestWithParam<std::tuple<std::size_t, std::size_t, std::size_t>> {};

TEST_P(SoftmaxTest, ForwardAndBackwardMatchReference) {
  const auto [rows, cols, group] = GetParam();
  const ScopedRowGroupSize forced(group);
  const auto x = random_vector(rows * cols, 1, -4.0f, 4.0f), dy = random_vector(rows * cols, 2);
  const DeviceRun got = run_device(x, dy, rows, cols);
  const RefRun want = run_reference(x, dy, rows, cols);
  expect_near(got.y, want.y, 1e-7f, 1e-5f, "y");
  expect_near(got.dx, want.dx, 1e-6f, 1e-4f, "dx");
  for (std::size_t r = 0; r < rows; ++r) {
    double s = 0;
    for (std::size_t c = 0; c < cols; ++c) s += got.y[r * cols + c];
    ASSERT_NEAR(s, 1.0, 1e-5) << "row " << r;
  }
}

TEST_P(SoftmaxTest, IsDeterministic) {
  const auto [rows, cols, group] = GetParam();
  const ScopedRowGroupSize forced(group);
  const auto x = random_vector(rows * cols, 7, -4.0f, 4.0f), dy = random_vector(rows * cols, 8);
  const DeviceRun a = run_device(x, dy, rows, cols), b = run_device(x, dy, rows, cols);
  EXPECT_EQ(std::memcmp(a.y.data(), b.y.data(), a.y.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(a.dx.data(), b.dx.data(), a.dx.size() * sizeof(float)), 0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, SoftmaxTest,
                         ::testing::Combine(::testing::Values(1, 3, 64, 257), ::testing::Values(1, 10, 17, 128, 1000),
                                            ::testing::Values(0, 1, 64, 256)));

TEST(Softmax, LargeLogitsDoNotOverflow) {
  // exp(1000) overflows float; exp(x - max) does not.
  const std::size_t rows = 4, cols = 37;
  auto x = random_vector(rows * cols, 3, -3.0f, 3.0f);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] += (i / cols) % 2 ? 1000.0f : -1000.0f;
  const auto dy = random_vector(rows * cols, 4);
  for (std::size_t group : {0, 16}) {
    const ScopedRowGroupSize forced(group);
    const DeviceRun got = run_device(x, dy, rows, cols);
    const RefRun want = run_reference(x, dy, rows, cols);
    // x itself is only float-accurate to 1000 * 2^-24 ~ 6e-5.
    expect_near(got.y, want.y, 1e-6f, 2e-4f, "y");
    expect_near(got.dx, want.dx, 1e-6f, 1e-3f, "dx");
  }
}

TEST(Softmax, MaskedEntriesGetZeroProbabilityAndZeroGradient) {
  // A causal mask: row r keeps columns 0..r, the rest are -inf.
  const std::size_t rows = 9, cols = 9;
  auto x = random_vector(rows * cols, 5);
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t c = r + 1; c < cols; ++c) x[r * cols + c] = -std::numeric_limits<float>::infinity();
  }
  const auto dy = random_vector(rows * cols, 6);
  for (std::size_t group : {0, 4}) {
    const ScopedRowGroupSize forced(group);
    const DeviceRun got = run_device(x, dy, rows, cols);
    const RefRun want = run_reference(x, dy, rows, cols);
    expect_near(got.y, want.y, 1e-7f, 1e-5f, "y");
    expect_near(got.dx, want.dx, 1e-6f, 1e-4f, "dx");
    EXPECT_EQ(got.y[0], 1.0f);
    for (std::size_t r = 0; r < rows; ++r) {
      for (std::size_t c = r + 1; c < cols; ++c) {
        EXPECT_EQ(got.y[r * cols + c], 0.0f);
        EXPECT_EQ(got.dx[r * cols + c], 0.0f);
      }
    }
  }
}

TEST(Softmax, InPlace) {
  const std::size_t rows = 5, cols = 70;
  const auto x = random_vector(rows * cols, 11), dy = random_vector(rows * cols, 12);
  const RefRun want = run_reference(x, dy, rows, cols);
  auto& dev = TestDevice::get();
  for (std::size_t group : {0, 32}) {
    const ScopedRowGroupSize forced(group);
    DeviceTensor t(x), g(dy);
    ops::run_blocking(dev.context.compute(), ops::softmax_forward(dev.env, t.span(), t.span(), rows, cols));
    ops::run_blocking(dev.context.compute(), ops::softmax_backward(dev.env, t.span(), g.span(), g.span(), rows, cols));
    expect_near(t.download(), want.y, 1e-7f, 1e-5f, "y in place");
    expect_near(g.download(), want.dx, 1e-6f, 1e-4f, "dx in place");
  }
}

TEST(Softmax, EmptyLastAxisIsAnError) {
  auto& dev = TestDevice::get();
  DeviceTensor t(4);
  EXPECT_THROW(ops::softmax_forward(dev.env, t.span(), t.span(), 4, 0), std::invalid_argument);
  EXPECT_TRUE(ops::softmax_forward(dev.env, t.span(), t.span(), 0, 4).empty());
}

TEST(Softmax, ReferenceBackwardMatchesFiniteDifferences) {
  for (auto [rows, cols] : {std::pair<std::size_t, std::size_t>{1, 1}, {3, 7}, {4, 33}}) {
    const auto x = to_double(random_vector(rows * cols, 13, -3.0f, 3.0f));
    const auto r = to_double(random_vector(rows * cols, 14));
    auto loss = [&, rows = rows, cols = cols](const std::vector<double>& xv) {
      std::vector<double> y(xv.size());
      ops::ref::softmax_forward<double>(xv, y, rows, cols);
      return weighted_sum(y, r);
    };
    std::vector<double> y(x.size()), dx(x.size());
    ops::ref::softmax_forward<double>(x, y, rows, cols);
    ops::ref::softmax_backward<double>(y, r, dx, rows, cols);
    expect_gradient_matches_finite_differences(loss, x, dx, "dx");
  }
}

// linear -> softmax -> linear: the softmax rows in a compiled step against the reference executor.
ModelSpec softmax_model() {
  return models::classifier("softmax-mlp", graph::Shape{10}, 3, [](graph::Builder& b, TensorId x) {
    const TensorId h = b.linear(x, 19);
    const TensorId ins[] = {h};
    return b.linear(b.apply(ops::builtin::softmax, ins)[0], 3);
  });
}

TEST(SoftmaxRows, ModelTrainsOnTheDeviceLikeItsReference) {
  Runtime runtime;
  TrainerOptions topt;
  topt.batch = 6;
  topt.lr = 0.1f;
  topt.optimizer.kind = ops::OptimizerConfig::Kind::sgd;
  topt.optimizer.sgd.momentum = 0.9f;
  Trainer trainer(runtime, softmax_model(), topt);
  expect_training_matches_reference(trainer, 4, 60, 1, -2.0f, 2.0f);
}

TEST(SoftmaxRows, ShapeRuleKeepsTheShapeAndRejectsAnEmptyAxis) {
  graph::Graph g;
  ClassifierBuilder b(g, 2, graph::Shape{3, 4}, 2);
  const TensorId x[] = {b.input()};
  const TensorId y = b.apply(ops::builtin::softmax, x)[0];
  EXPECT_EQ(g.tensors.shape[y], (graph::Shape{2, 3, 4}));
  const TensorId empty = g.tensors.add("empty", graph::Shape{2, 0}, graph::DType::f32, graph::Role::activation);
  const TensorId e[] = {empty};
  EXPECT_THROW(b.apply(ops::builtin::softmax, e), graph::BuildError);
}

// Attention's softmax: 32 sequences x 4 heads x 128 queries, rows of 128 keys. Disabled by
// default: --gtest_also_run_disabled_tests --gtest_filter='*Bench*'.
// FERRY_ROW_GROUP_SIZE is checked as the other FERRY_* numbers are: anything but a whole number
// from 1 to 1024 is an error naming it (strtoull made "abc" 0, "-1" a huge size, "4x" 4).
TEST(RowGroupSize, BadValuesAreRefusedNamingTheVariable) {
  for (const char* bad : {"abc", "-1", "0", "4x", " 8", "+8", "1025", "99999999999999999999"}) {
    ScopedEnv set("FERRY_ROW_GROUP_SIZE", bad);
    try {
      ops::row_group_forced();
      ADD_FAILURE() << "FERRY_ROW_GROUP_SIZE='" << bad << "' was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("FERRY_ROW_GROUP_SIZE='") + bad +
                                           "': expected a whole number from 1 to 1024"),
                std::string::npos)
          << e.what();
    }
  }
  {
    ScopedEnv set("FERRY_ROW_GROUP_SIZE", "64");
    EXPECT_TRUE(ops::row_group_forced());
  }
  ScopedEnv empty("FERRY_ROW_GROUP_SIZE", "");
  EXPECT_FALSE(ops::row_group_forced());
}

TEST(SoftmaxBench, DISABLED_AttentionRows) {
  auto& dev = TestDevice::get();
  const std::size_t rows = 128 * 128, cols = 128;
  DeviceTensor x(random_vector(rows * cols, 1, -4.0f, 4.0f), 0), y(rows * cols, 0),
      dy(random_vector(rows * cols, 2), 0), dx(rows * cols, 0);
  const auto time = [&](const ops::LaunchList& list) {
    ops::run_blocking(dev.context.compute(), list);
    double best = 1e30;
    for (int round = 0; round < 5; ++round) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 20; ++i) ops::enqueue(dev.context.compute(), list, {});
      clFinish(dev.context.compute());
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 20);
    }
    return best;
  };
  const double f = time(ops::softmax_forward(dev.env, x.span(), y.span(), rows, cols));
  const double b = time(ops::softmax_backward(dev.env, y.span(), dy.span(), dx.span(), rows, cols));
  const double mb = double(rows * cols) * 4 / 1e6;
  std::printf(
      "softmax [%zu, %zu] on %s: forward %.3f ms (%.1f GB/s of x + y), backward %.3f ms (%.1f GB/s of y, dy, dx)\n",
      rows, cols, dev.context.device().name.c_str(), f * 1e3, 2 * mb / f / 1e3, b * 1e3, 3 * mb / b / 1e3);
}

}  // namespace
}  // namespace ferry::test
