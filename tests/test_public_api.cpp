// What a trainer's own program reaches from ferry/ferry.hpp alone, with no internal header: the
// memory profiler and the Chrome trace take a Trainer (its training step, the step it ran last,
// the variants it compiled), and the trainer reports its plan's figures and its state's homes.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "ferry/ferry.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

bool has_variant(const std::vector<MemoryPhaseSummary>& phases, const std::string& variant) {
  return std::any_of(phases.begin(), phases.end(), [&](const MemoryPhaseSummary& p) {
    return p.variant == variant && p.section == "all" && p.peak_bytes > 0;
  });
}

TEST(PublicApi, ProfilesAndTracesATrainerFromTheUmbrellaHeader) {
  Runtime rt({.profiling = true});
  TrainerOptions o;
  o.batch = 8;
  Trainer t(rt, models::mlp({16}), o);
  EXPECT_GT(t.device_peak_bytes(), 0u);
  EXPECT_GT(t.host_state_bytes(), 0u);
  EXPECT_EQ(t.residency().mode, graph::ResidencyMode::resident);
  EXPECT_EQ(t.weights_home(), offload::Home::device);
  EXPECT_EQ(t.state_home(), offload::Home::device);

  MemoryProfiler profiler;
  profiler.add_training_step(t);
  const std::vector<float> images = random_vector(8 * 784, 3, 0.0f, 1.0f);
  const std::vector<std::int32_t> labels = labels_for(8, 5);
  t.step(images, labels);
  profiler.add_last_step(t, 1);
  ChromeTrace trace;
  EXPECT_EQ(trace.size(), 0u);
  trace.add_step(t, 1);
  EXPECT_EQ(trace.steps(), 1u);
  EXPECT_GT(trace.size(), 2u) << "a marker and the step's nodes";

  // Evaluating 12 samples in batches of 8 compiles the variants eval8 and eval4.
  Dataset d;
  d.rows = d.cols = 28;
  d.count = 12;
  d.images = random_vector(d.count * 784, 7, 0.0f, 1.0f);
  d.labels = labels_for(d.count, 9);
  t.evaluate(d);
  profiler.add_variants(t);
  const auto phases = profiler.phases();
  EXPECT_TRUE(has_variant(phases, "train"));
  EXPECT_TRUE(has_variant(phases, "eval8"));
  EXPECT_TRUE(has_variant(phases, "eval4"));
  EXPECT_NE(profiler.summary().find("train"), std::string::npos);
}

}  // namespace
}  // namespace ferry::test
