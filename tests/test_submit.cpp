// Steps enqueued ahead (Trainer::submit / result, CompiledStep::submit / wait): the same results
// bit for bit as step(), one host wait per step, and failures that stay with the step they
// belong to.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ferry/ferry.hpp"
#include "runtime/trainer_internals.hpp"
#include "test_models.hpp"
#include "test_support.hpp"
#include "trainer_state.hpp"

namespace ferry::test {
namespace {

TrainerOptions options(graph::ResidencyMode mode) {
  TrainerOptions o;
  o.batch = 8;
  o.lr = 0.01f;
  o.residency.mode = mode;
  return o;
}

struct Batches {
  std::vector<std::vector<float>> images;
  std::vector<std::vector<std::int32_t>> labels;
  Batches(const ModelSpec& m, int n) {
    const std::size_t sample = m.inputs[0].sample.elems();
    for (int i = 0; i < n; ++i) {
      images.push_back(random_vector(8 * sample, 100 + i));
      labels.push_back(labels_for(8, 200 + i));
    }
  }
  Batch at(int i) const { return Batch{{"input", HostView(images[i])}, {"labels", HostView(labels[i])}}; }
};

class SubmitAhead : public ::testing::TestWithParam<graph::ResidencyMode> {};

// Submitting step k+1 before reading step k gives the losses, hits and state that step() gives.
TEST_P(SubmitAhead, GivesWhatStepGivesBitForBit) {
  Runtime rt;
  const ModelSpec m = small_residual();
  Trainer sync(rt, m, options(GetParam())), ahead(rt, m, options(GetParam()));
  const int steps = 6;
  const Batches b(m, steps);
  std::vector<StepResult> expected;
  for (int i = 0; i < steps; ++i) expected.push_back(sync.step(b.at(i)));

  std::vector<StepResult> got;
  std::optional<StepHandle> previous;
  for (int i = 0; i < steps; ++i) {
    const StepHandle h = ahead.submit(b.at(i));
    if (previous) got.push_back(ahead.result(*previous));
    previous = h;
    EXPECT_EQ(ahead.pending(), 1u);
  }
  got.push_back(ahead.result(*previous));
  EXPECT_EQ(ahead.pending(), 0u);
  ASSERT_EQ(got.size(), expected.size());
  for (int i = 0; i < steps; ++i) {
    EXPECT_EQ(got[i].loss, expected[i].loss) << "step " << i;
    EXPECT_EQ(got[i].correct, expected[i].correct) << "step " << i;
  }
  EXPECT_EQ(ahead.steps_done(), sync.steps_done());
  EXPECT_TRUE(tensors_of(ahead) == tensors_of(sync)) << "the training state differs";
}

INSTANTIATE_TEST_SUITE_P(Homes, SubmitAhead,
                         ::testing::Values(graph::ResidencyMode::resident, graph::ResidencyMode::stream),
                         [](const auto& info) {
                           return info.param == graph::ResidencyMode::resident ? std::string("resident")
                                                                               : std::string("stream");
                         });

// Resident state, and streamed state kept as one host copy, change in place after the commit
// point on the device: the step runs ahead and the host waits once per step. With the host
// optimizer the step has host-lane nodes (the flow-graph form, which runs a step to its end):
// submit() completes the step before it first, and says so through runs_ahead().
TEST(SubmitAhead, RunsAheadWhereTheStateChangesInPlace) {
  Runtime rt;
  const ModelSpec m = small_residual();
  const Batches b(m, 4);
  TrainerOptions o = options(graph::ResidencyMode::stream);
  o.residency.budget_bytes = 1;
  o.residency.budget_bytes = min_stream_budget(rt, m, o).value_or(0);
  for (const bool streamed : {false, true}) {
    SCOPED_TRACE(streamed ? "streamed" : "resident");
    Trainer t(rt, m, streamed ? o : options(graph::ResidencyMode::resident));
    EXPECT_TRUE(compiled_train_step(t).can_run_ahead());
    EXPECT_TRUE(t.runs_ahead());
    const std::uint64_t w0 = compiled_train_step(t).host_waits();
    const StepHandle h0 = t.submit(b.at(0));
    const StepHandle h1 = t.submit(b.at(1));
    EXPECT_EQ(compiled_train_step(t).in_flight(), 2u) << "both steps should be on the device at once";
    t.result(h0);
    t.result(h1);
    EXPECT_EQ(compiled_train_step(t).host_waits() - w0, 2u) << "one host wait per step";
  }

  o.residency.host_optimizer = true;
  Trainer host(rt, m, o);
  EXPECT_FALSE(compiled_train_step(host).can_run_ahead());
  EXPECT_FALSE(host.runs_ahead());
  const StepHandle s0 = host.submit(b.at(0));
  const StepHandle s1 = host.submit(b.at(1));
  EXPECT_LE(compiled_train_step(host).in_flight(), 1u);
  EXPECT_TRUE(std::isfinite(host.result(s1).loss));  // out of order: the earlier one is kept
  EXPECT_TRUE(std::isfinite(host.result(s0).loss));
}

// The timeline of a step read after a later one was submitted is its own. A step that does not run
// ahead (a compressed state home: the flow-graph form, which runs the whole step in submit) ran the
// next one in the same submission before its caller read it, so a trace or profile recorded the
// step after it in its place: `ferry train --state-home compressed --trace` repeated a step's
// predecessor's timeline before every evaluation and at the end.
TEST(SubmitAhead, AStepsTimelineIsItsOwnAfterTheNextIsSubmitted) {
  Runtime rt({.profiling = true});
  const ModelSpec m = small_residual();
  const Batches b(m, 2);
  TrainerOptions compressed = options(graph::ResidencyMode::resident);
  compressed.residency.state_home = graph::Home::host_compressed;
  for (const TrainerOptions& o : {options(graph::ResidencyMode::resident), compressed}) {
    Trainer t(rt, m, o);
    SCOPED_TRACE(t.runs_ahead() ? "runs ahead" : "does not run ahead");
    const auto compute_span = [&] {
      std::uint64_t first = UINT64_MAX, last = 0;
      for (const graph::TimelineEntry& e : compiled_last_run_step(t).timeline()) {
        if (e.lane != graph::Lane::compute) continue;
        first = std::min(first, e.start_ns);
        last = std::max(last, e.end_ns);
      }
      return std::pair{first, last};
    };
    const StepHandle h0 = t.submit(b.at(0));
    const StepHandle h1 = t.submit(b.at(1));
    t.result(h0);
    const auto [first0, last0] = compute_span();
    t.result(h1);
    const auto [first1, last1] = compute_span();
    ASSERT_LT(first0, last0) << "step 0 has a timeline";
    ASSERT_LT(first1, last1) << "step 1 has a timeline";
    // One compute queue, in order: step 0's kernels all end before step 1's begin.
    EXPECT_LE(last0, first1) << "step 0's timeline, read after step 1 was submitted, is not its own";
  }
}

// The host mirrors of the second batch slot (a step staged while the one before runs) were
// numbered by the batch tensors' names and allocated by their ids: where the orders differ (an
// input "x" made before a target "a") a mirror got another's buffer, and staging a larger tensor
// into a smaller one wrote past it (a heap overflow that crashed later, far from it).
TEST(SubmitAhead, BatchTensorsNamedOutOfTheirOrderKeepTheirOwnMirrors) {
  Runtime rt;
  const auto regression = [](const std::string& target) {
    ModelSpec m;
    m.name = "regression-" + target;
    m.inputs = {TensorSpec{"x", graph::Shape{3, 4}}};
    m.targets = {TensorSpec{target, graph::Shape{3, 1}}};
    m.forward = [](graph::Builder& b, std::span<const TensorId> in) { return b.linear(in[0], 1); };
    m.loss = [](graph::Builder& b, TensorId p, std::span<const TensorId> t) { return b.mse(p, t[0]); };
    return m;
  };
  const int steps = 6;
  std::vector<std::vector<float>> x, y;
  for (int i = 0; i < steps; ++i) {
    x.push_back(random_vector(8 * 12, 300 + i));
    y.push_back(random_vector(8 * 3, 400 + i));
  }
  std::map<std::string, std::vector<float>> losses;
  for (const std::string target : {"y", "a"}) {
    SCOPED_TRACE("target " + target);
    Trainer t(rt, regression(target), options(graph::ResidencyMode::resident));
    ASSERT_TRUE(t.runs_ahead());
    std::optional<StepHandle> previous;
    for (int i = 0; i < steps; ++i) {
      const StepHandle h = t.submit(Batch{{"x", HostView(x[i])}, {target, HostView(y[i])}});
      if (previous) losses[target].push_back(t.result(*previous).loss);
      previous = h;
    }
    losses[target].push_back(t.result(*previous).loss);
  }
  EXPECT_EQ(losses["a"], losses["y"]);
}

TEST(SubmitAhead, MisuseIsAClearError) {
  Runtime rt;
  const ModelSpec m = small_residual();
  Trainer t(rt, m, options(graph::ResidencyMode::resident));
  const Batches b(m, 3);
  const StepHandle h = t.submit(b.at(0));
  // Reading the state while a step runs is refused, naming what to do.
  try {
    t.read_parameter(t.parameter_names().front());
    ADD_FAILURE() << "reading a parameter with a step in flight should throw";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("result()"), std::string::npos) << e.what();
  }
  t.result(h);
  EXPECT_THROW(t.result(h), std::invalid_argument);  // read once
  EXPECT_THROW(t.result(StepHandle{12345}), std::invalid_argument);

  // The compiled step: at most max_in_flight, and wait() with nothing in flight.
  graph::CompiledStep& step = compiled_train_step(t);
  EXPECT_THROW(step.wait(), std::logic_error);
  step.submit(ops::StepInfo{t.steps_done() + 1, t.lr()});
  step.submit(ops::StepInfo{t.steps_done() + 2, t.lr()});
  EXPECT_THROW(step.submit(ops::StepInfo{t.steps_done() + 3, t.lr()}), std::logic_error);
  step.wait();
  step.wait();
}

// A step whose enqueue fails throws from submit(); the step in flight before it is unharmed, and
// training goes on as if the failed one had never been submitted.
TEST(SubmitAhead, AnEnqueueFailureStaysWithItsStep) {
  Runtime rt;
  const ModelSpec m = small_residual();
  Trainer t(rt, m, options(graph::ResidencyMode::resident)), reference(rt, m, options(graph::ResidencyMode::resident));
  const Batches b(m, 3);
  const float r0 = reference.step(b.at(0)).loss;
  const float r1 = reference.step(b.at(2)).loss;

  const StepHandle h0 = t.submit(b.at(0));
  // A kernel of the backward pass (before the commit point) is refused by the driver.
  const auto& n = compiled_train_step(t).graph().nodes;
  graph::NodeId victim = 0;
  for (graph::NodeId id = 0; id < n.size(); ++id) {
    if (n.lane[id] == graph::Lane::compute && id < *compiled_train_step(t).commit_node()) victim = id;
  }
  compiled_train_step(t).inject_failure(victim, graph::Fault::enqueue_error);
  try {
    t.submit(b.at(1));
    ADD_FAILURE() << "the submit should fail";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(n.name[victim]), std::string::npos) << e.what();
  }
  EXPECT_EQ(t.result(h0).loss, r0);
  EXPECT_EQ(t.step(b.at(2)).loss, r1);
  EXPECT_TRUE(tensors_of(t) == tensors_of(reference)) << "the failed step left something in the state";
}

}  // namespace
}  // namespace ferry::test
