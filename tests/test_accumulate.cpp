// Gradient accumulation: the kernels against their CPU references (the restart of a group, the
// loss guard, the mean), and k micro-batches through the trainer against one k-times-larger batch,
// resident and streamed.
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>

#include "classifier.hpp"
#include "ferry/ferry.hpp"
#include "ops/accumulate.hpp"
#include "test_models.hpp"
#include "test_support.hpp"
#include "train_check.hpp"

namespace ferry::test {
namespace {

TEST(GradAccumulate, KernelsMatchReferences) {
  auto& dev = TestDevice::get();
  for (std::size_t n : {1u, 100u, 4097u}) {
    auto acc0 = random_vector(n, 1), g0 = random_vector(n, 2);
    acc0[0] = std::numeric_limits<float>::quiet_NaN();  // a stale value a restart must not keep
    DeviceTensor acc(acc0), g(g0, 5);
    ops::StepInfo restart;
    restart.accumulate_keep = 0.0f;
    ops::run_blocking(dev.context.compute(), ops::grad_accumulate(dev.env, acc.span(), g.span(), n), restart);
    EXPECT_EQ(acc.download(), g0) << "keep 0: the sum restarts at g";
    ops::run_blocking(dev.context.compute(), ops::grad_accumulate(dev.env, acc.span(), g.span(), n));
    auto want = to_double(g0);
    ops::ref::grad_accumulate<double>(want, to_double(g0), 1.0);
    for (std::size_t i = 0; i < n; ++i) ASSERT_FLOAT_EQ(acc.download()[i], want[i]);
    // A non-finite loss adds nothing.
    DeviceTensor inf(std::vector<float>{std::numeric_limits<float>::infinity()}, 1);
    const auto before = acc.download();
    ops::run_blocking(dev.context.compute(), ops::grad_accumulate(dev.env, acc.span(), g.span(), n, inf.span()));
    EXPECT_EQ(acc.download(), before);
    // The mean over k = 3: g = (acc + g) / 3.
    ops::run_blocking(dev.context.compute(), ops::grad_mean(dev.env, acc.span(), g.span(), n, 1.0f / 3));
    auto mean = to_double(g0);
    ops::ref::grad_mean<double>(to_double(before), mean, 1.0 / 3);
    for (std::size_t i = 0; i < n; ++i) ASSERT_NEAR(g.download()[i], mean[i], 1e-6);
  }
}

TrainerOptions options(std::uint32_t batch, std::uint32_t accumulate, ops::OptimizerConfig::Kind kind) {
  TrainerOptions o;
  o.batch = batch;
  o.accumulate = accumulate;
  o.lr = 0.01f;
  o.optimizer.kind = kind;
  return o;
}

// k micro-batches of b samples make the same update as one batch of k * b: parameters agree to
// float rounding (the sums are taken in another order) after several updates.
TEST(GradAccumulate, EqualsOneLargerBatch) {
  Runtime rt;
  const ModelSpec m = small_mlp();
  const std::size_t sample = sample_elems(m);
  for (auto kind : {ops::OptimizerConfig::Kind::sgd, ops::OptimizerConfig::Kind::adam}) {
    for (std::uint32_t k : {2u, 3u}) {
      SCOPED_TRACE(fmt::format("{} k={}", optimizer_name(kind), k));
      Trainer micro(rt, m, options(4, k, kind));
      Trainer large(rt, m, options(4 * k, 1, kind));
      for (int update = 0; update < 3; ++update) {
        const auto images = random_vector(4 * k * sample, 10 + update);
        const auto labels = labels_for(4 * k, 20 + update);
        double micro_loss = 0;
        for (std::uint32_t i = 0; i < k; ++i) {
          const auto r =
              micro.step(std::span(images).subspan(i * 4 * sample, 4 * sample), std::span(labels).subspan(i * 4, 4));
          EXPECT_EQ(r.updated, i + 1 == k);
          micro_loss += r.loss / k;
        }
        const auto r = large.step(images, labels);
        EXPECT_NEAR(micro_loss, r.loss, 1e-5);
        EXPECT_EQ(micro.steps_done(), large.steps_done());
      }
      for (const auto& name : large.parameter_names()) {
        const auto a = micro.read_parameter(name), b = large.read_parameter(name);
        for (std::size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 2e-6) << name << "[" << i << "]";
      }
    }
  }
}

TEST(GradAccumulate, StreamedIsBitIdenticalToResident) {
  Runtime rt;
  const ModelSpec m = small_cnn();
  const TrainerOptions resident_opt = options(4, 3, ops::OptimizerConfig::Kind::adam);
  TrainerOptions stream_opt = resident_opt;
  stream_opt.residency.mode = graph::ResidencyMode::stream;
  stream_opt.residency.budget_bytes = 2 * stream_budget(rt, m, resident_opt);
  Trainer resident(rt, m, resident_opt), streamed(rt, m, stream_opt);
  ASSERT_EQ(streamed.residency().mode, graph::ResidencyMode::stream);
  const std::size_t sample = sample_elems(m);
  for (int s = 0; s < 7; ++s) {
    const auto images = random_vector(4 * sample, 50 + s);
    const auto labels = labels_for(4, 60 + s);
    ASSERT_EQ(resident.step(images, labels).loss, streamed.step(images, labels).loss) << s;
  }
  for (const auto& name : resident.tensor_names()) {
    const auto a = resident.read_tensor(name), b = streamed.read_tensor(name);
    EXPECT_EQ(a.bytes, b.bytes) << name;
  }
}

TEST(GradAccumulate, BadSettingsAreClearErrors) {
  Runtime rt;
  TrainerOptions o = options(4, 0, ops::OptimizerConfig::Kind::adam);
  try {
    Trainer t(rt, small_mlp(), o);
    ADD_FAILURE() << "accumulation over 0 micro-batches was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("0 micro-batches"), std::string::npos) << e.what();
  }
}

// Options that contradict each other, or apply only with another, are refused rather than one
// silently ignored.
TEST(TrainerOptionsCheck, ContradictionsAreClearErrors) {
  Runtime rt;
  const auto refused = [&](const char* what, const std::function<void(TrainerOptions&)>& set, const char* needle) {
    TrainerOptions o = options(4, 1, ops::OptimizerConfig::Kind::adam);
    set(o);
    try {
      Trainer t(rt, small_mlp(), o);
      ADD_FAILURE() << what << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << what << ": " << e.what();
    }
  };
  refused(
      "recompute_auto with recompute 2", [](TrainerOptions& o) { o.recompute_auto = true, o.recompute = 2; },
      "recompute_auto chooses");
  refused(
      "int8 Predict steps without hybrid phases", [](TrainerOptions& o) { o.phases.predict_int8 = true; },
      "PhaseConfig::predict_int8 applies to the Predict steps");
  refused(
      "residual correction without hybrid phases", [](TrainerOptions& o) { o.phases.predictor.residual = true; },
      "PhaseConfig::predictor.residual applies");
  refused(
      "a global batch on one rank", [](TrainerOptions& o) { o.data_parallel.global_batch = 16; },
      "a global batch of 16 with a batch of 4 on one rank");
  // What may be given together is still taken.
  TrainerOptions o = options(4, 1, ops::OptimizerConfig::Kind::adam);
  o.data_parallel.global_batch = 4;
  o.recompute_auto = true;
  EXPECT_NO_THROW(Trainer(rt, small_mlp(), o));
}

}  // namespace
}  // namespace ferry::test
