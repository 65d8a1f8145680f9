// Fused softmax + cross-entropy: device forward (log-sum-exp per row, mean loss, correct count) and backward
// against the CPU reference, determinism, stability for large logits, argmax ties, out-of-range
// labels, and the reference gradient of the loss against double-precision finite differences.
#include <cstdlib>
#include <cstring>
#include <string>

#include "ops/softmax_xent.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

// An int32 label buffer at a nonzero element offset.
class DeviceLabels {
 public:
  explicit DeviceLabels(const std::vector<std::int32_t>& labels, std::uint64_t offset = 5) : offset_(offset) {
    auto& dev = TestDevice::get();
    mem_ = dev.context.create_buffer((labels.size() + offset) * sizeof(std::int32_t), "test labels");
    std::vector<std::int32_t> padded(offset, -7);
    padded.insert(padded.end(), labels.begin(), labels.end());
    dev.context.write(mem_.get(), 0, padded.data(), padded.size() * sizeof(std::int32_t));
  }
  ops::DeviceSpan span() const { return {mem_.get(), offset_ * sizeof(float)}; }

 private:
  std::uint64_t offset_;
  cl::Mem mem_;
};

std::vector<std::int32_t> random_labels(std::size_t rows, std::size_t classes, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::int32_t> dist(0, static_cast<std::int32_t>(classes) - 1);
  std::vector<std::int32_t> labels(rows);
  for (auto& l : labels) l = dist(rng);
  return labels;
}

// Logits where roughly half the rows predict their label, so the correct count is informative.
std::vector<float> logits_for(const std::vector<std::int32_t>& labels, std::size_t classes, std::uint32_t seed) {
  auto logits = random_vector(labels.size() * classes, seed, -4.0f, 4.0f);
  for (std::size_t r = 0; r < labels.size(); r += 2) logits[r * classes + labels[r]] += 6.0f;
  return logits;
}

struct Result {
  std::vector<float> lse, stats;
};

Result run_forward(const std::vector<float>& logits, const std::vector<std::int32_t>& labels, std::size_t classes) {
  auto& dev = TestDevice::get();
  const std::size_t rows = labels.size();
  DeviceTensor dlogits(logits, 3), dlse(rows, 9), dstats(2, 1);
  DeviceLabels dlabels(labels);
  ops::run_blocking(dev.context.compute(), ops::softmax_xent_forward(dev.env, dlogits.span(), dlabels.span(),
                                                                     dlse.span(), dstats.span(), rows, classes));
  return {dlse.download(), dstats.download()};
}

// (rows, cols, forced row group size)
class SoftmaxXentTest : public ::testing::TestWithParam<std::tuple<std::size_t, std::size_t, std::size_t>> {};
class SoftmaxXentTestReference : public ::testing::TestWithParam<std::tuple<std::size_t, std::size_t>> {};

TEST_P(SoftmaxXentTest, ForwardAndBackwardMatchReference) {
  auto [rows, classes, group] = GetParam();
  const ScopedRowGroupSize forced(group);
  auto& dev = TestDevice::get();
  const auto labels = random_labels(rows, classes, 1);
  const auto logits = logits_for(labels, classes, 2);

  const Result got = run_forward(logits, labels, classes);
  std::vector<double> lse_ref(rows), stats_ref(2);
  ops::ref::softmax_xent_forward<double>(to_double(logits), labels, lse_ref, stats_ref, rows, classes);
  expect_near(got.lse, to_float(lse_ref), 1e-6f, 1e-6f, "lse");
  expect_near({got.stats[0]}, {float(stats_ref[0])}, 1e-6f, 1e-5f, "mean loss");
  EXPECT_EQ(got.stats[1], float(stats_ref[1])) << "correct count";
  if (classes > 1) {
    EXPECT_GT(stats_ref[0], 0.0);
  }

  const float scale = 2.5f;
  // The backward reads the logits and the device's lse (as a training step does); in place too.
  DeviceTensor dx(logits, 4), dlse(got.lse, 2), ddl(rows * classes, 6);
  DeviceLabels dlabels(labels, 3);
  ops::run_blocking(dev.context.compute(), ops::softmax_xent_backward(dev.env, dx.span(), dlse.span(), dlabels.span(),
                                                                      ddl.span(), rows, classes, scale));
  std::vector<double> dl_ref(rows * classes);
  ops::ref::softmax_xent_backward<double>(to_double(logits), to_double(got.lse), labels, dl_ref, rows, classes, scale);
  expect_near(ddl.download(), to_float(dl_ref), 1e-7f, 1e-5f, "dlogits");
  ops::run_blocking(dev.context.compute(), ops::softmax_xent_backward(dev.env, dx.span(), dlse.span(), dlabels.span(),
                                                                      dx.span(), rows, classes, scale));
  expect_near(dx.download(), to_float(dl_ref), 1e-7f, 1e-5f, "dlogits in place");
}

TEST_P(SoftmaxXentTest, ForwardIsDeterministic) {
  auto [rows, classes, group] = GetParam();
  const ScopedRowGroupSize forced(group);
  const auto labels = random_labels(rows, classes, 3);
  const auto logits = logits_for(labels, classes, 4);
  const Result first = run_forward(logits, labels, classes);
  for (int run = 0; run < 2; ++run) {
    const Result again = run_forward(logits, labels, classes);
    ASSERT_EQ(std::memcmp(first.stats.data(), again.stats.data(), 2 * sizeof(float)), 0) << "run " << run;
    ASSERT_EQ(std::memcmp(first.lse.data(), again.lse.data(), first.lse.size() * sizeof(float)), 0);
  }
}

TEST_P(SoftmaxXentTestReference, ReferenceGradientMatchesFiniteDifferences) {
  auto [rows, classes] = GetParam();
  if (rows * classes > 20000) GTEST_SKIP() << "covered by the smaller shapes; the check costs rows*classes per probe";
  const auto labels = random_labels(rows, classes, 5);
  const auto x = to_double(logits_for(labels, classes, 6));
  auto loss = [&, rows = rows, classes = classes](const std::vector<double>& in) {
    std::vector<double> lse(rows), stats(2);
    ops::ref::softmax_xent_forward<double>(in, labels, lse, stats, rows, classes);
    return stats[0];
  };
  std::vector<double> lse(rows), stats(2), grad(x.size());
  ops::ref::softmax_xent_forward<double>(x, labels, lse, stats, rows, classes);
  ops::ref::softmax_xent_backward<double>(x, lse, labels, grad, rows, classes);
  expect_gradient_matches_finite_differences(loss, x, grad, "softmax_xent", 1e-6, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Shapes, SoftmaxXentTest,
                         ::testing::Combine(::testing::Values(1, 3, 64, 257), ::testing::Values(1, 10, 1000),
                                            ::testing::Values(0, 64)),
                         [](const auto& info) {
                           return case_name(info.param, {"r", "k", "g"});
                         });
INSTANTIATE_TEST_SUITE_P(Shapes, SoftmaxXentTestReference,
                         ::testing::Combine(::testing::Values(1, 3, 64, 257), ::testing::Values(1, 10, 1000)),
                         [](const auto& info) {
                           return case_name(info.param, {"r", "k"});
                         });

TEST(SoftmaxXent, LargeLogitsStayFinite) {
  // exp(1000) overflows float and probs[label] underflows to 0 without the max subtraction and
  // the log-sum-exp form of the loss.
  const std::size_t classes = 3;
  const std::vector<float> logits = {1000.0f, 0.0f, -1000.0f, -500.0f, 500.0f, 400.0f};
  const std::vector<std::int32_t> labels = {1, 2};
  const Result got = run_forward(logits, labels, classes);
  std::vector<double> lse_ref(2), stats_ref(2);
  ops::ref::softmax_xent_forward<double>(to_double(logits), labels, lse_ref, stats_ref, 2, classes);
  expect_near(got.lse, to_float(lse_ref), 1e-7f, 1e-6f, "lse");
  EXPECT_NEAR(got.stats[0], (1000.0 + 100.0) / 2, 1e-3);  // -log p = max - x[label] here
  EXPECT_NEAR(stats_ref[0], (1000.0 + 100.0) / 2, 1e-9);
  EXPECT_EQ(got.stats[1], 0.0f);
}

TEST(SoftmaxXent, ArgmaxTiesTakeTheFirstIndex) {
  const std::size_t classes = 4;
  // Rows 0 and 1 tie classes 1 and 2; row 2 ties all four.
  const std::vector<float> logits = {0, 3, 3, 1, 0, 3, 3, 1, 2, 2, 2, 2};
  const std::vector<std::int32_t> labels = {1, 2, 0};
  const Result got = run_forward(logits, labels, classes);
  std::vector<double> lse_ref(3), stats_ref(2);
  ops::ref::softmax_xent_forward<double>(to_double(logits), labels, lse_ref, stats_ref, 3, classes);
  EXPECT_EQ(got.stats[1], 2.0f);  // rows 0 and 2
  EXPECT_EQ(stats_ref[1], 2.0);
  EXPECT_NEAR(got.stats[0], stats_ref[0], 1e-6);
}

TEST(SoftmaxXent, OutOfRangeLabelMakesLossNaN) {
  auto& dev = TestDevice::get();
  const std::size_t rows = 4, classes = 5;
  for (std::int32_t bad : {-1, 5, 1 << 30}) {
    const std::vector<std::int32_t> labels = {0, bad, 4, 2};
    const auto logits = random_vector(rows * classes, 7);
    const Result got = run_forward(logits, labels, classes);
    EXPECT_TRUE(std::isnan(got.stats[0])) << "label " << bad;
    std::vector<double> lse_ref(rows), stats_ref(2);
    ops::ref::softmax_xent_forward<double>(to_double(logits), labels, lse_ref, stats_ref, rows, classes);
    EXPECT_TRUE(std::isnan(stats_ref[0]));
    EXPECT_EQ(got.stats[1], float(stats_ref[1]));
    expect_near(got.lse, to_float(lse_ref), 1e-7f, 1e-6f, "lse stays valid");

    // Backward: the bad row is NaN, the others are the usual gradient.
    DeviceTensor dx(logits), dlse(got.lse), ddl(rows * classes);
    DeviceLabels dlabels(labels);
    ops::run_blocking(dev.context.compute(), ops::softmax_xent_backward(dev.env, dx.span(), dlse.span(), dlabels.span(),
                                                                        ddl.span(), rows, classes));
    const auto dl = ddl.download();
    std::vector<double> dl_ref(rows * classes);
    ops::ref::softmax_xent_backward<double>(to_double(logits), to_double(got.lse), labels, dl_ref, rows, classes);
    for (std::size_t i = 0; i < dl.size(); ++i) {
      if (i / classes == 1) {
        EXPECT_TRUE(std::isnan(dl[i]) && std::isnan(dl_ref[i])) << i;
      } else {
        EXPECT_NEAR(dl[i], dl_ref[i], 1e-7) << i;
      }
    }
  }
}

}  // namespace
}  // namespace ferry::test
