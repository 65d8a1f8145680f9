// Hybrid phases: the controller's rules on made-up measurements (transitions, run lengths, the
// divergence monitor, bad settings), and the trainer's hybrid steps on a small model: a Full
// step's fit measures the true update, a Predict step moves the weights by exactly the predicted
// update and leaves the optimizer state alone, a restore puts back the weights bit for bit, and
// streamed hybrid training is bit-identical to resident.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <random>

#include "classifier.hpp"
#include "ferry/ferry.hpp"
#include "runtime/trainer_internals.hpp"
#include "test_models.hpp"
#include "test_support.hpp"
#include "train_check.hpp"

namespace ferry::test {
namespace {

using Verdict = PhaseController::Verdict;

PhaseConfig hybrid(std::uint32_t warmup = 3, std::uint32_t min_full = 2, std::uint32_t max_predict = 8) {
  PhaseConfig c;
  c.hybrid = true;
  c.warmup_steps = warmup;
  c.min_full_steps = min_full;
  c.max_predict_steps = max_predict;
  c.confidence = 0.5f;
  c.max_loss_gap = 0.5f;
  c.sigma_limit = 3.0f;
  c.predict_decay = 0.9f;
  return c;
}

// A fit whose quality (cosine) is q: |delta| = |pred| = 1.
FitStats fit_of(double q) {
  return {q, 1.0, 1.0};
}

// Losses around 1.0 with a spread of about 0.1 (alternating), so the monitor has a mean and sd.
float full_loss(int i) {
  return i % 2 ? 1.1f : 0.9f;
}

TEST(PhaseController, FullOnlyNeverPredicts) {
  PhaseController c(PhaseConfig{});
  for (int i = 0; i < 50; ++i) {
    ASSERT_EQ(c.next(), Phase::full);
    c.record_full(1.0f, fit_of(1.0));
  }
  EXPECT_EQ(c.predict_fraction(), 0.0);
}

TEST(PhaseController, WarmupFullPredictCorrectCycleWithAdaptiveLength) {
  PhaseController c(hybrid());
  int i = 0;
  for (; i < 3; ++i) {
    ASSERT_EQ(c.next(), Phase::warmup);
    c.record_full(full_loss(i), fit_of(0.9));
  }
  // Full steps until min_full_steps fits reach the confidence.
  ASSERT_EQ(c.next(), Phase::full);
  c.record_full(full_loss(i++), fit_of(0.9));
  ASSERT_EQ(c.next(), Phase::full);
  c.record_full(full_loss(i++), fit_of(0.9));
  // The first run: max_predict / 4 = 2 steps, scaled 1, then decay.
  ASSERT_EQ(c.next(), Phase::predict);
  EXPECT_EQ(c.predict_length(), 2u);
  EXPECT_FLOAT_EQ(c.predict_scale(), 1.0f);
  EXPECT_EQ(c.record_predict(1.0f), Verdict::go_on);
  ASSERT_EQ(c.next(), Phase::predict);
  EXPECT_FLOAT_EQ(c.predict_scale(), 0.9f);
  EXPECT_EQ(c.record_predict(1.0f), Verdict::go_on);
  ASSERT_EQ(c.next(), Phase::correct);
  // A good Correct doubles the length (2 -> 4), a poor one halves it.
  c.record_full(full_loss(i++), fit_of(0.8));
  EXPECT_EQ(c.predict_length(), 4u);
  ASSERT_EQ(c.next(), Phase::full);
  c.record_full(full_loss(i++), fit_of(0.9));
  c.record_full(full_loss(i++), fit_of(0.9));
  ASSERT_EQ(c.next(), Phase::predict);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(c.record_predict(1.0f), Verdict::go_on);
  ASSERT_EQ(c.next(), Phase::correct);
  c.record_full(full_loss(i++), fit_of(0.1));
  EXPECT_EQ(c.predict_length(), 2u);
  // Poor fits keep it in Full.
  for (int k = 0; k < 10; ++k) {
    c.record_full(full_loss(i++), fit_of(0.2));
    ASSERT_EQ(c.next(), Phase::full);
  }
  EXPECT_EQ(c.counts().runs, 2u);
  EXPECT_EQ(c.counts().steps[static_cast<int>(Phase::predict)], 6u);
  // A run decided on and never stepped (the training ended there) is not counted.
  int good = 0;
  for (; good < 4 && c.next() == Phase::full; ++good) c.record_full(full_loss(i++), fit_of(0.9));
  ASSERT_EQ(c.next(), Phase::predict);
  EXPECT_EQ(c.counts().runs, 2u);
  EXPECT_EQ(c.record_predict(1.0f), Verdict::go_on);
  EXPECT_EQ(c.counts().runs, 3u);
  EXPECT_EQ(c.counts().steps[static_cast<int>(Phase::correct)], 2u);
  EXPECT_NEAR(c.predict_fraction(), 7.0 / (3 + 2 + 2 + 10 + good + 7 + 2), 1e-12);
}

// Drives a controller into its first Predict step.
PhaseController predicting(PhaseConfig cfg = hybrid()) {
  PhaseController c(cfg);
  for (int i = 0; c.next() != Phase::predict; ++i) {
    if (i > 100) throw std::logic_error("never predicts");
    c.record_full(full_loss(i), fit_of(0.9));
  }
  return c;
}

TEST(PhaseController, LossBeyondSigmaEndsTheRunAndNoLongerGrowsIt) {
  PhaseController c = predicting(hybrid(3, 2, 16));
  const double limit = c.loss_mean() + 3.0 * c.loss_sd();
  EXPECT_EQ(c.record_predict(static_cast<float>(limit + 0.01)), Verdict::end);  // within the gap of 0.5
  EXPECT_EQ(c.next(), Phase::correct);
  EXPECT_EQ(c.counts().ended, 1u);
  const auto before = c.predict_length();
  c.record_full(1.0f, fit_of(0.9));  // a good Correct after a run cut short: halved, not doubled
  EXPECT_EQ(c.predict_length(), std::max(1u, before / 2));
}

TEST(PhaseController, LossGapOrNonFiniteLossRestores) {
  for (float loss : {2.0f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    PhaseController c = predicting();
    EXPECT_EQ(c.record_predict(loss), Verdict::restore) << loss;
    EXPECT_EQ(c.next(), Phase::full);
    EXPECT_EQ(c.predict_length(), 1u);
    EXPECT_EQ(c.counts().restores, 1u);
  }
}

TEST(PhaseController, GrowingOscillationEndsTheRun) {
  PhaseConfig cfg = hybrid(3, 2, 32);
  cfg.sigma_limit = 100.0f;
  PhaseController c = predicting(cfg);
  for (int k = 0; k < 8; ++k) c.record_full(1.0f, fit_of(0.9));  // nothing: c is predicting
  PhaseController d = predicting(cfg);
  // 1.0, 0.95, 1.05, 0.88: alternating, each swing larger.
  EXPECT_EQ(d.record_predict(1.0f), Verdict::go_on);
  EXPECT_EQ(d.record_predict(0.95f), Verdict::go_on);
  EXPECT_EQ(d.record_predict(1.05f), Verdict::go_on);
  EXPECT_EQ(d.record_predict(0.88f), Verdict::end);
}

// With fit_every 3, only every third training step fits (Correct steps always), Predict starts
// only after a fit, and steps without a fit leave the quality as it was.
TEST(PhaseController, FitEveryKFitsOnlyThoseSteps) {
  PhaseConfig cfg = hybrid(3, 2, 8);
  cfg.fit_every = 3;
  PhaseController c(cfg);
  std::vector<bool> fitted;
  int i = 0;
  while (c.next() != Phase::predict && i < 40) {
    const bool fit = c.fits_next();
    fitted.push_back(fit);
    const FitStats f = fit_of(0.9);
    c.record_full(full_loss(i++), fit ? &f : nullptr);
  }
  ASSERT_EQ(c.next(), Phase::predict);
  // Steps 3, 6, 9, ... (1-based) fit; the switch comes right after a fit.
  for (std::size_t k = 0; k < fitted.size(); ++k) EXPECT_EQ(fitted[k], (k + 1) % 3 == 0) << k;
  EXPECT_TRUE(fitted.back());
  EXPECT_FALSE(c.fits_next()) << "Predict steps do not fit";
  while (c.next() == Phase::predict) c.record_predict(1.0f);
  ASSERT_EQ(c.next(), Phase::correct);
  EXPECT_TRUE(c.fits_next()) << "Correct always fits";
}

TEST(PhaseController, BadSettingsAreClearErrors) {
  const auto rejects = [](auto change, const char* what) {
    PhaseConfig c = hybrid();
    change(c);
    try {
      validate(c);
      ADD_FAILURE() << "accepted " << what;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  rejects([](PhaseConfig& c) { c.max_predict_steps = 0; }, "maximum predict length of 0");
  rejects([](PhaseConfig& c) { c.confidence = 0.0f; }, "confidence must be in (0, 1]");
  rejects([](PhaseConfig& c) { c.confidence = 1.5f; }, "confidence must be in (0, 1]");
  rejects([](PhaseConfig& c) { c.confidence = std::nanf(""); }, "confidence must be in (0, 1]");
  rejects([](PhaseConfig& c) { c.min_full_steps = 0; }, "min full steps 0");
  rejects([](PhaseConfig& c) { c.max_loss_gap = -1.0f; }, "loss gap");
  rejects([](PhaseConfig& c) { c.predict_decay = 0.0f; }, "predict decay");
  rejects([](PhaseConfig& c) { c.fit_every = 0; }, "fit every 0");
  rejects([](PhaseConfig& c) { c.predictor.beta = 1.0f; }, "smoothing");
  EXPECT_THROW(parse_phases("sometimes"), std::invalid_argument);
  // Full-only training ignores the hybrid settings.
  PhaseConfig off;
  off.max_predict_steps = 0;
  EXPECT_NO_THROW(validate(off));
}

// ---- The trainer's hybrid steps ----

TrainerOptions hybrid_options(graph::ResidencyMode mode = graph::ResidencyMode::resident, std::uint64_t budget = 0) {
  TrainerOptions o;
  o.batch = 8;
  o.lr = 0.01f;
  o.residency.mode = mode;
  o.residency.budget_bytes = budget;
  o.phases = hybrid(2, 1, 4);
  o.phases.confidence = 0.01f;  // predict as soon as allowed
  o.phases.max_loss_gap = 1e6f;
  o.phases.sigma_limit = 1e6f;
  return o;
}

std::vector<float> values(const Trainer& t, const std::string& name) {
  const auto v = t.read_tensor(name);
  std::vector<float> out(v.bytes.size() / 4);
  std::memcpy(out.data(), v.bytes.data(), v.bytes.size());
  return out;
}

struct Batches {
  std::size_t sample;
  StepResult step(Trainer& t, int s) const {
    return t.step(random_vector(8 * sample, 300 + s), labels_for(8, 400 + s));
  }
};

TEST(HybridTrainer, FitMeasuresTheTrueUpdateAndPredictAppliesExactlyThePrediction) {
  Runtime rt;
  const ModelSpec m = small_mlp();
  Trainer t(rt, m, hybrid_options());
  const Batches b{sample_elems(m)};
  const auto names = t.parameter_names();
  int s = 0;
  // Warmup: each fit's delta.delta is |w after - w before|^2 of this very step.
  for (; t.phases()->next() == Phase::warmup; ++s) {
    std::map<std::string, std::vector<float>> before;
    for (const auto& n : names) before[n] = values(t, n);
    EXPECT_EQ(b.step(t, s).phase, Phase::warmup);
    for (const auto& n : names) {
      const auto after = values(t, n);
      double dd = 0;
      for (std::size_t i = 0; i < after.size(); ++i) dd += double(after[i] - before[n][i]) * (after[i] - before[n][i]);
      ASSERT_GT(dd, 0) << n;
      EXPECT_NEAR(values(t, n + ".pred_stats")[ops::predictor_stat_delta_delta], dd, 1e-4 * dd + 1e-12) << n;
    }
  }
  while (t.phases()->next() != Phase::predict) b.step(t, s++);
  // A Predict step: w += scale * gain * d, optimizer state and the predictor untouched.
  std::map<std::string, std::vector<float>> before;
  for (const auto& n : t.tensor_names()) before[n] = values(t, n);
  const float scale = t.phases()->predict_scale();
  const auto updates = t.steps_done();
  EXPECT_EQ(b.step(t, s++).phase, Phase::predict);
  EXPECT_EQ(t.steps_done(), updates);
  for (const auto& n : t.tensor_names()) {
    const auto now = values(t, n);
    if (std::find(names.begin(), names.end(), n) == names.end()) {
      EXPECT_EQ(now, before[n]) << n << " changed in a Predict step";
      continue;
    }
    const auto& d = before[n + ".pred_d"];
    const float gain = before[n + ".pred_stats"][ops::predictor_stat_gain];
    EXPECT_EQ(gain, 1.0f) << "linear";
    for (std::size_t i = 0; i < now.size(); ++i) {
      ASSERT_FLOAT_EQ(now[i], std::fma(scale * gain, d[i], before[n][i])) << n << "[" << i << "]";
    }
  }
}

// Residual correction: a Predict step adds rgain r to gain d, where r holds the smoothed
// residuals the fits measured; resident and streamed (apply on the host) alike.
TEST(HybridTrainer, ResidualCorrectionEntersThePrediction) {
  for (bool streamed : {false, true}) {
    Runtime rt;
    const ModelSpec m = small_mlp();
    TrainerOptions o = streamed ? hybrid_options(graph::ResidencyMode::stream, 64ull << 20) : hybrid_options();
    o.phases.predictor.residual = true;
    Trainer t(rt, m, o);
    const Batches b{sample_elems(m)};
    int s = 0;
    while (t.phases()->next() != Phase::predict) b.step(t, s++);
    std::map<std::string, std::vector<float>> before;
    for (const auto& n : t.tensor_names()) before[n] = values(t, n);
    const float scale = t.phases()->predict_scale();
    EXPECT_EQ(b.step(t, s++).phase, Phase::predict);
    double rgains = 0;
    for (const auto& n : t.parameter_names()) {
      const auto now = values(t, n);
      const auto& d = before[n + ".pred_d"];
      const auto& r = before.at(n + ".pred_r");
      const auto& st = before[n + ".pred_stats"];
      const float gain = st[ops::predictor_stat_gain], rgain = st[ops::predictor_stat_rgain];
      rgains += rgain;
      EXPECT_GT(std::inner_product(r.begin(), r.end(), r.begin(), 0.0), 0.0) << n << ": the fits left no residual";
      for (std::size_t i = 0; i < now.size(); ++i) {
        const float step = std::fma(rgain, r[i], gain * d[i]);
        ASSERT_FLOAT_EQ(now[i], std::fma(scale, step, before[n][i])) << n << "[" << i << "] streamed " << streamed;
      }
    }
    EXPECT_GT(rgains, 0.0) << "some residuals should have resembled the ones before";
  }
}

// With the optimizer on the host, the update writes the weight's next host copy directly; the fit,
// on the device after it, must fetch that value (not the step's starting one) to see the update.
TEST(HybridTrainer, FitSeesHostOptimizerUpdates) {
  Runtime rt;
  const ModelSpec m = small_mlp();
  TrainerOptions o = hybrid_options(graph::ResidencyMode::stream, 64ull << 20);
  o.residency.host_optimizer = true;
  Trainer t(rt, m, o);
  ASSERT_GT(t.residency().host_updates, 0u);
  const Batches b{sample_elems(m)};
  for (int s = 0; s < 3; ++s) {
    std::map<std::string, std::vector<float>> before;
    for (const auto& n : t.parameter_names()) before[n] = values(t, n);
    b.step(t, s);
    for (const auto& n : t.parameter_names()) {
      const auto after = values(t, n);
      double dd = 0;
      for (std::size_t i = 0; i < after.size(); ++i) dd += double(after[i] - before[n][i]) * (after[i] - before[n][i]);
      ASSERT_GT(dd, 0) << n;
      EXPECT_NEAR(values(t, n + ".pred_stats")[ops::predictor_stat_delta_delta], dd, 1e-4 * dd + 1e-12) << n;
    }
  }
}

// A hybrid trainer of small_mlp (Predict runs of 2 steps), resident or streamed, trained up to its
// first Predict step; `full` holds the weights of its last Full step.
struct AtFirstPredict {
  static TrainerOptions options(bool streamed) {
    TrainerOptions o = streamed ? hybrid_options(graph::ResidencyMode::stream, 64ull << 20) : hybrid_options();
    o.phases.max_predict_steps = 8;
    return o;
  }
  explicit AtFirstPredict(bool streamed) : t(rt, small_mlp(), options(streamed)) {
    while (t.phases()->next() != Phase::predict) b.step(t, s++);
    for (const auto& n : t.parameter_names()) full[n] = values(t, n);
  }
  Runtime rt;
  Trainer t;
  const Batches b{sample_elems(small_mlp())};
  int s = 0;
  std::map<std::string, std::vector<float>> full;
};

TEST(HybridTrainer, RestoreBringsBackTheLastFullWeightsBitForBit) {
  for (const bool streamed : {false, true}) {
    SCOPED_TRACE(streamed ? "streamed (one host copy)" : "resident");
    AtFirstPredict at(streamed);
    Trainer& t = at.t;
    EXPECT_EQ(at.b.step(t, at.s++).verdict, Verdict::go_on);
    // The next Predict step sees inputs 100x larger: its loss is far above the Full losses, beyond
    // a gap of 1, and the run is undone.
    PhaseConfig tight = t.phases()->config();
    tight.max_loss_gap = 1.0f;
    t.phases()->set_config(tight);
    auto wild = random_vector(8 * at.b.sample, 999, -100.0f, 100.0f);
    const auto r = t.step(wild, labels_for(8, 998));
    EXPECT_GT(r.loss, t.phases()->loss_mean() + 1.0);
    EXPECT_EQ(r.phase, Phase::predict);
    EXPECT_EQ(r.verdict, Verdict::restore);
    for (const auto& n : t.parameter_names()) EXPECT_EQ(values(t, n), at.full[n]) << n;
    EXPECT_EQ(t.phases()->next(), Phase::full);
  }
}

// A Predict step moves the weights before its loss is known (streamed: in the one host copy, once
// the step's fetches have read them). When it fails after that, the weights go back to those from
// before its run, the last Full step's, and the trainer trains on.
TEST(HybridTrainer, AFailedPredictStepPutsBackTheWeightsFromBeforeItsRun) {
  for (const bool streamed : {false, true}) {
    SCOPED_TRACE(streamed ? "streamed" : "resident");
    AtFirstPredict at(streamed);
    Trainer& t = at.t;
    ASSERT_EQ(at.b.step(t, at.s++).phase, Phase::predict);
    ASSERT_EQ(t.phases()->next(), Phase::predict);
    // The last weight's move fails before its work: the others, earlier on the same lane (the
    // device's compute queue, or streamed the host lane), have moved theirs.
    graph::CompiledStep& predict = *compiled_predict_step(t);
    const auto& nodes = predict.graph().nodes;
    graph::NodeId victim = 0;
    std::size_t moves = 0;
    for (graph::NodeId id = 0; id < nodes.size(); ++id) {
      if (ops::op_info(nodes.op[id]).name != "predictor_apply") continue;
      victim = id;
      ++moves;
    }
    ASSERT_EQ(moves, t.parameter_names().size());
    ASSERT_EQ(nodes.lane[victim], streamed ? graph::Lane::host : graph::Lane::compute);
    predict.inject_failure(victim, graph::Fault::exception);
    try {
      at.b.step(t, at.s++);
      FAIL() << "the Predict step should fail";
    } catch (const graph::PartialUpdateError& e) {
      FAIL() << "the trainer should have put the weights back: " << e.what();
    } catch (const std::runtime_error& e) {
      const std::string what = e.what();
      std::printf("%s: %s\n", streamed ? "streamed" : "resident", what.c_str());
      EXPECT_NE(what.find(nodes.name[victim]), std::string::npos) << what;
      EXPECT_NE(what.find("were put back to those from before its Predict run"), std::string::npos) << what;
    }
    EXPECT_EQ(t.inconsistent_state(), "");
    for (const auto& n : t.parameter_names()) EXPECT_EQ(values(t, n), at.full[n]) << n;
    // It trains on: the rest of the run, its Correct step and more.
    for (int k = 0; k < 4; ++k) EXPECT_TRUE(std::isfinite(at.b.step(t, at.s++).loss)) << k;
  }
}

TEST(HybridTrainer, StepsWithoutAFitLeaveThePredictorAlone) {
  Runtime rt;
  const ModelSpec m = small_mlp();
  TrainerOptions o = hybrid_options();
  o.phases.fit_every = 2;
  Trainer t(rt, m, o);
  const Batches b{sample_elems(m)};
  const std::string stats = t.parameter_names()[0] + ".pred_stats";
  std::uint64_t predicted = 0;
  for (int s = 0; s < 24; ++s) {
    const bool fit = t.phases()->fits_next();
    const auto before = values(t, stats);
    const auto r = b.step(t, s);
    predicted += r.phase == Phase::predict;
    if (r.phase != Phase::predict) {
      EXPECT_EQ(values(t, stats) != before, fit) << "step " << s;
    }
  }
  EXPECT_GT(predicted, 0u);
}

// `steps` steps of both trainers on the same batches: the same phases and losses, some steps
// predicted, and every tensor the same bits at the end.
void expect_streamed_like_resident(Trainer& resident, Trainer& streamed, const Batches& b, int steps) {
  ASSERT_EQ(streamed.residency().mode, graph::ResidencyMode::stream);
  std::uint64_t predicted = 0;
  for (int s = 0; s < steps; ++s) {
    const auto a = b.step(resident, s), c = b.step(streamed, s);
    ASSERT_EQ(a.phase, c.phase) << s;
    ASSERT_EQ(a.loss, c.loss) << s;
    predicted += a.phase == Phase::predict;
  }
  EXPECT_GT(predicted, 0u);
  for (const auto& n : resident.tensor_names()) EXPECT_EQ(values(resident, n), values(streamed, n)) << n;
}

TEST(HybridTrainer, StreamedIsBitIdenticalToResident) {
  Runtime rt;
  for (const bool int8 : {false, true})
    for (const ModelSpec& m : {small_mlp(), small_cnn()}) {
      SCOPED_TRACE(m.name + (int8 ? " int8" : ""));
      TrainerOptions ro = hybrid_options();
      TrainerOptions so = hybrid_options(graph::ResidencyMode::stream, stream_budget(rt, m, hybrid_options()));
      ro.phases.predict_int8 = so.phases.predict_int8 = int8;
      Trainer resident(rt, m, ro);
      Trainer streamed(rt, m, so);
      expect_streamed_like_resident(resident, streamed, Batches{sample_elems(m)}, 16);
    }
}

// With accumulation the controller moves on at updates: a training phase's step is a group of
// micro-batches, each reporting the group's phase, whose last fits the predictor with the group's
// whole update; Predict steps fall only between groups and apply exactly the prediction, touching
// neither the optimizer state nor the gradient sums.
TEST(HybridTrainer, AccumulatedUpdatesArePredictedBetweenGroups) {
  constexpr std::uint32_t k = 3;
  Runtime rt;
  const ModelSpec m = small_mlp();
  TrainerOptions o = hybrid_options();
  o.accumulate = k;
  Trainer t(rt, m, o);
  const Batches b{sample_elems(m)};
  const auto names = t.parameter_names();
  const auto is_weight = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) != names.end(); };
  std::uint32_t in_group = 0;  // micro-batches of the open group
  std::uint64_t predicted = 0, fits = 0;
  std::map<std::string, std::vector<float>> before;  // every tensor before the group or Predict step
  for (int s = 0; s < 60; ++s) {
    if (in_group == 0) {
      for (const auto& n : t.tensor_names()) before[n] = values(t, n);
    }
    const Phase next = t.phases()->next();
    const bool fit = t.phases()->fits_next();
    const float scale = t.phases()->predict_scale();
    const StepResult r = b.step(t, s);
    ASSERT_EQ(r.phase, next) << "step " << s;
    if (r.phase == Phase::predict) {
      EXPECT_EQ(in_group, 0u) << "a Predict step inside a group at step " << s;
      ++predicted;
      for (const auto& n : t.tensor_names()) {
        const auto now = values(t, n);
        if (!is_weight(n)) {
          EXPECT_EQ(now, before[n]) << n << " changed in Predict step " << s;
          continue;
        }
        const auto& d = before[n + ".pred_d"];
        const float gain = before[n + ".pred_stats"][ops::predictor_stat_gain];
        for (std::size_t i = 0; i < now.size(); ++i) {
          ASSERT_FLOAT_EQ(now[i], std::fma(scale * gain, d[i], before[n][i])) << n << "[" << i << "] step " << s;
        }
      }
      continue;
    }
    if (!r.updated) {
      ASSERT_LT(++in_group, k) << "step " << s;
      for (const auto& n : names) EXPECT_EQ(values(t, n), before[n]) << n << " changed by a micro-batch";
      continue;
    }
    EXPECT_EQ(in_group, k - 1) << "an update after " << in_group << " micro-batches, step " << s;
    in_group = 0;
    if (!fit) continue;
    ++fits;
    for (const auto& n : names) {
      const auto after = values(t, n);
      double dd = 0;
      for (std::size_t i = 0; i < after.size(); ++i) dd += double(after[i] - before[n][i]) * (after[i] - before[n][i]);
      ASSERT_GT(dd, 0) << n;
      EXPECT_NEAR(values(t, n + ".pred_stats")[ops::predictor_stat_delta_delta], dd, 1e-4 * dd + 1e-12)
          << n << ", the group's update at step " << s;
    }
  }
  EXPECT_GT(predicted, 0u);
  EXPECT_GT(fits, 0u);
  EXPECT_EQ(t.steps_done() * k + predicted, 60u - in_group);
}

// fp16 with loss scaling: a step whose scaled gradients overflow changes nothing, neither the
// training state (weights, moments, the predictor's state) nor what the controller knows; the scale
// doubles after every clean update here, so overflows recur between the Predict runs.
TEST(HybridTrainer, LossScaledOverflowsLeaveTheStateAndTheControllerAlone) {
  Runtime rt;
  const ModelSpec m = small_mlp();
  TrainerOptions o = hybrid_options();
  o.precision.compute = ops::DType::f16;
  o.precision.initial_scale = 16777216.0f;  // 2^24
  o.precision.growth_interval = 1;
  Trainer t(rt, m, o);
  const std::size_t sample = sample_elems(m);
  std::uint64_t overflows = 0, predicted = 0;
  for (int s = 0; s < 48; ++s) {
    std::map<std::string, std::vector<float>> before;
    for (const auto& n : t.tensor_names()) before[n] = values(t, n);
    const PhaseController::State controller = t.phases()->state();
    const StepResult r = t.step(random_vector(8 * sample, 300 + s, -4.0f, 4.0f), labels_for(8, 400 + s));
    ASSERT_EQ(r.phase, controller.next) << "step " << s;
    predicted += r.phase == Phase::predict;
    if (!r.overflow) continue;
    ++overflows;
    EXPECT_FALSE(r.updated);
    for (const auto& n : t.tensor_names()) EXPECT_EQ(values(t, n), before[n]) << n << ", step " << s;
    const PhaseController::State after = t.phases()->state();
    EXPECT_EQ(after.next, controller.next) << "step " << s;
    EXPECT_EQ(after.losses, controller.losses) << "step " << s;
    EXPECT_EQ(after.in_phase, controller.in_phase) << "step " << s;
    for (std::size_t p = 0; p < phase_count; ++p) EXPECT_EQ(after.counts.steps[p], controller.counts.steps[p]);
  }
  EXPECT_GT(overflows, 1u);
  EXPECT_GT(predicted, 0u);
  EXPECT_EQ(t.overflow_steps(), overflows);
}

TEST(HybridTrainer, AccumulatedStreamedIsBitIdenticalToResident) {
  Runtime rt;
  const ModelSpec m = small_mlp();
  TrainerOptions ro = hybrid_options();
  ro.accumulate = 2;
  TrainerOptions so = hybrid_options(graph::ResidencyMode::stream, 0);
  so.accumulate = 2;
  so.residency.budget_bytes = stream_budget(rt, m, so);
  Trainer resident(rt, m, ro), streamed(rt, m, so);
  expect_streamed_like_resident(resident, streamed, Batches{sample_elems(m)}, 30);
}

// A Predict step with int8 weights computes the loss an int8 evaluation of its batch gives, before
// the step moves the weights.
TEST(HybridTrainer, Int8PredictForwardIsTheInt8Evaluation) {
  Runtime rt;
  const ModelSpec m = small_mlp();
  TrainerOptions o = hybrid_options();
  o.phases.predict_int8 = true;
  Trainer t(rt, m, o);
  const Batches b{sample_elems(m)};
  int s = 0;
  while (t.phases()->next() != Phase::predict) b.step(t, s++);
  Dataset batch;
  batch.images = random_vector(8 * b.sample, 300 + s);
  batch.labels = labels_for(8, 400 + s);
  batch.count = 8;
  batch.rows = 1;
  batch.cols = b.sample;
  const auto int8 = t.evaluate(batch, true), fp32 = t.evaluate(batch, false);
  const auto r = b.step(t, s);
  EXPECT_EQ(r.phase, Phase::predict);
  EXPECT_EQ(r.loss, static_cast<float>(int8.loss));
  EXPECT_NE(int8.loss, fp32.loss) << "the int8 forward should differ from fp32 in its last bits at least";
}

// Streamed, a Predict step with int8 weights fetches each quantized layer's int8 values and
// scales (and the fp32 head and biases) and writes nothing back.
TEST(HybridTrainer, StreamedInt8PredictMovesAQuarterOfTheWeights) {
  Runtime rt;
  const ModelSpec m = models::mlp({256});
  TrainerOptions o = hybrid_options(graph::ResidencyMode::stream, 16ull << 20);
  o.phases.predict_int8 = true;
  Trainer t(rt, m, o);
  const auto& full = t.residency();
  const auto& predict = compiled_predict_step(t)->residency();
  EXPECT_EQ(predict.write_back_bytes, 0u);
  EXPECT_LT(predict.fetch_bytes, t.weight_bytes() * 3 / 10) << predict.fetch_bytes << " of " << t.weight_bytes();
  EXPECT_LT(double(predict.fetch_bytes), 0.05 * double(full.fetch_bytes + full.write_back_bytes));
}

}  // namespace
}  // namespace ferry::test
