// What a trainer's own program reaches from ferry/ferry.hpp alone, with no internal header: the
// memory profiler and the Chrome trace take a Trainer (its training step, the step it ran last,
// the variants it compiled), and the trainer reports its plan's figures and its state's homes.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
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

// With accumulation a micro-batch runs its own step (no update): the trace and the memory profile of
// that step record the nodes it ran, under "micro", not the training step's.
TEST(PublicApi, TracesAndProfilesRecordTheStepThatRan) {
  Runtime rt({.profiling = true});
  TrainerOptions o;
  o.batch = 8;
  o.accumulate = 2;
  Trainer t(rt, models::mlp({16}), o);
  const std::vector<float> images = random_vector(8 * 784, 3, 0.0f, 1.0f);
  const std::vector<std::int32_t> labels = labels_for(8, 5);
  MemoryProfiler profiler;
  ChromeTrace trace;
  std::vector<std::size_t> sizes;
  for (std::uint64_t step = 0; step < 2; ++step) {
    t.step(images, labels);
    profiler.add_last_step(t, step);
    const std::size_t before = trace.size();
    trace.add_step(t, step);
    sizes.push_back(trace.size() - before);
  }
  EXPECT_GT(sizes[0], 0u) << "step 0 (a micro-batch) traced";
  EXPECT_LT(sizes[0], sizes[1]) << "the micro-batch's step has no update nodes";
  const auto csv = std::filesystem::temp_directory_path() / "ferry-test-ran-step.csv";
  profiler.write_csv(csv);
  std::ifstream in(csv);
  std::size_t micro = 0, train = 0;
  for (std::string line; std::getline(in, line);) {
    micro += line.starts_with("micro,0,");
    train += line.starts_with("train,1,");
  }
  std::filesystem::remove(csv);
  EXPECT_GT(micro, 0u) << "step 0 ran the micro-batch step";
  EXPECT_GT(train, 0u) << "step 1 ran the training step";
}

// A trainer outlives the runtime it was made on: it steps, compiles evaluation variants and is
// destroyed on the device context it keeps (ASan's CI stage sees any use after free).
TEST(PublicApi, ATrainerOutlivesItsRuntime) {
  auto rt = std::make_unique<Runtime>();
  TrainerOptions o;
  o.batch = 8;
  auto t = std::make_unique<Trainer>(*rt, models::mlp({16}), o);
  const std::vector<float> images = random_vector(8 * 784, 3, 0.0f, 1.0f);
  const std::vector<std::int32_t> labels = labels_for(8, 5);
  const double first = t->step(images, labels).loss;
  rt.reset();
  const double second = t->step(images, labels).loss;
  EXPECT_TRUE(std::isfinite(second));
  EXPECT_LT(second, first) << "the same batch again, after an update";
  Dataset d;
  d.rows = d.cols = 28;
  d.count = 12;
  d.images = random_vector(d.count * 784, 7, 0.0f, 1.0f);
  d.labels = labels_for(d.count, 9);
  EXPECT_EQ(t->evaluate(d).samples, 12u);  // variants compiled after the runtime is gone
  t.reset();
}

// A model that reads no inputs is refused when the trainer builds it (its forward would index an
// empty list), and predicting nothing is refused rather than answered with a shapeless tensor.
TEST(PublicApi, AModelWithoutInputsAndAnEmptyPredictionAreRefused) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 8;
  ModelSpec none = models::mlp({16});
  none.inputs.clear();
  try {
    Trainer t(rt, none, o);
    ADD_FAILURE() << "a model without inputs was built";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("has no inputs (ModelSpec::inputs is empty)"), std::string::npos) << e.what();
  }
  Trainer t(rt, models::mlp({16}), o);
  Dataset empty;
  empty.rows = empty.cols = 28;
  try {
    t.predict(empty);
    ADD_FAILURE() << "predicted for no samples";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("hold no samples"), std::string::npos) << e.what();
  }
}

// A call from a second thread while the first is in a call is refused, naming both; calls nested
// on the holding thread pass, and once released another thread may take the object.
TEST(PublicApi, OneThreadAtATimeRefusesASecondThreadAndAllowsNesting) {
  OneThreadAtATime use;
  std::string refused;
  {
    const OneThreadAtATime::Call outer(use, "Trainer::step");
    const OneThreadAtATime::Call nested(use, "Trainer::result");
    std::thread other([&] {
      try {
        const OneThreadAtATime::Call call(use, "Trainer::evaluate");
      } catch (const std::logic_error& e) {
        refused = e.what();
      }
    });
    other.join();
  }
  EXPECT_NE(refused.find("Trainer::evaluate was called while another thread is in Trainer::step: a Trainer serves "
                         "one thread at a time"),
            std::string::npos)
      << refused;
  bool taken = false;
  std::thread later([&] {
    const OneThreadAtATime::Call call(use, "Trainer::evaluate");
    taken = true;
  });
  later.join();
  EXPECT_TRUE(taken) << "released once the holder's outermost call returned";
}

// One Trainer stepped from two threads at once crashed inside the OpenCL driver; a colliding call
// is now refused with std::logic_error and every step that ran is whole.
TEST(PublicApi, ATrainerSteppedFromTwoThreadsRefusesTheColliderAndStaysUsable) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 8;
  Trainer t(rt, models::mlp({16}), o);
  const std::vector<float> images = random_vector(8 * 784, 3, 0.0f, 1.0f);
  const std::vector<std::int32_t> labels = labels_for(8, 5);
  std::atomic<int> done{0}, refused{0};
  std::atomic<bool> other_error{false};
  auto work = [&] {
    for (int i = 0; i < 40; ++i) {
      try {
        t.step(images, labels);
        ++done;
      } catch (const std::logic_error& e) {
        if (std::string(e.what()).find("serves one thread at a time") == std::string::npos) other_error = true;
        ++refused;
      } catch (...) {
        other_error = true;
      }
    }
  };
  std::thread a(work), b(work);
  a.join();
  b.join();
  EXPECT_FALSE(other_error);
  EXPECT_EQ(done + refused, 80);
  EXPECT_GT(done, 0);
  EXPECT_TRUE(std::isfinite(t.step(images, labels).loss)) << "usable after the collisions";
}

// Options a program sets wrong are named as the program names them.
TEST(PublicApi, AZeroBatchAndANegativeLocalRankAreRefusedByName) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 0;
  try {
    Trainer t(rt, models::mlp({16}), o);
    ADD_FAILURE() << "a batch of 0 was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("TrainerOptions::batch is 0"), std::string::npos) << e.what();
  }
  try {
    Runtime negative({.local_rank = -5});
    ADD_FAILURE() << "local rank -5 was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("RuntimeOptions::local_rank is -5"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace ferry::test
