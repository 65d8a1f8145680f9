// ferry-bench phases: hybrid phases (Warmup/Full/Predict/Correct) against Full-only training of
// the same model, seed and data order, in one run: test accuracy after every epoch, training time
// (evaluation excluded), the fraction of steps predicted, the time each needs to come within one
// point of Full-only's final accuracy, and, streamed under a device budget, the bytes a Predict
// step moves over the link against a Full step's.
#include <fmt/format.h>

#include <iostream>
#include <numeric>
#include <optional>
#include <random>

#include "bench.hpp"
#include "ferry/ferry.hpp"
#include "ferry/runtime/lr_schedule.hpp"
#include "runtime/cli/validators.hpp"
#include "runtime/trainer_internals.hpp"

namespace ferry::bench {
namespace {

struct PhasesOptions {
  std::string model = "mlp";
  std::uint32_t epochs = 10, batch = 0;
  std::string predictor = "linear";
  std::uint64_t seed = 1;
  std::size_t train_limit = 0;
  std::string budget;               // the streamed part's device budget (empty: 1.25x the smallest streamed budget)
  std::uint32_t stream_steps = 60;  // streamed steps timed
  bool predict_int8 = false;
  std::uint32_t fit_every = 1;
};

ModelSpec make_model(const std::string& name) {
  if (name == "mlp") return models::mlp();
  if (name == "cnn") return models::cnn();
  if (name == "deep") return models::deep(1024, 16);
  throw std::invalid_argument(fmt::format("--model: unknown '{}': use mlp, cnn or deep", name));
}

std::uint32_t default_batch(const std::string& model) {
  return model == "mlp" ? 256 : model == "cnn" ? 128 : 64;
}

void standardise(Dataset& d) {
  for (auto& v : d.images) v = (v - 0.2860f) / 0.3530f;
}

TrainerOptions trainer_options(const PhasesOptions& po, bool hybrid) {
  TrainerOptions o;
  o.batch = po.batch ? po.batch : default_batch(po.model);
  o.lr = 1e-3f;
  o.seed = po.seed;
  o.phases.hybrid = hybrid;
  o.phases.predictor.kind = ops::parse_predictor(po.predictor);
  o.phases.predict_int8 = po.predict_int8;
  o.phases.fit_every = po.fit_every;
  return o;
}

struct Curve {
  std::vector<double> accuracy, seconds;  // after each epoch; seconds of training steps only
  double int8_accuracy = 0;               // the final weights, every layer but the head read as int8
  double predict_fraction = 0, full_step_ms = 0, predict_step_ms = 0;
  std::uint64_t updates = 0;
};

// Trains like `ferry train` (shuffled epochs, cosine schedule) and evaluates after every epoch.
Curve train(Runtime& rt, const Dataset& data, const Dataset& test, const PhasesOptions& po, bool hybrid) {
  Trainer t(rt, make_model(po.model), trainer_options(po, hybrid));
  ShuffledBatches batches(data, t.model(), t.options().batch, po.seed);
  const std::size_t per_epoch = batches.steps_per_epoch();
  LrSchedule schedule;
  schedule.peak = t.options().lr;
  schedule.total_steps = per_epoch * po.epochs;
  schedule.validate();
  Curve c;
  double seconds = 0;
  for (std::uint32_t e = 0; e < po.epochs; ++e) {
    const auto start = std::chrono::steady_clock::now();
    for (std::size_t s = 0; s < per_epoch; ++s) {
      t.set_lr(schedule.at(e * per_epoch + s));
      t.step(batches.next());
    }
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    c.seconds.push_back(seconds);
    c.accuracy.push_back(t.evaluate(test).accuracy);
    std::cerr << fmt::format("ferry-bench phases: {} epoch {}/{}: test accuracy {:.4f} after {:.1f} s{}\n",
                             hybrid ? "hybrid" : "full", e + 1, po.epochs, c.accuracy.back(), seconds,
                             hybrid ? fmt::format(" ({:.0f}% predicted)", 100 * t.phases()->predict_fraction()) : "");
  }
  c.int8_accuracy = t.evaluate(test, true).accuracy;
  if (t.phases()) c.predict_fraction = t.phases()->predict_fraction();
  c.full_step_ms = t.phase_step_ms(Phase::full);
  c.predict_step_ms = t.phase_step_ms(Phase::predict);
  c.updates = t.steps_done();
  return c;
}

// The first epoch-end time at which accuracy reached `target`, if any.
std::optional<double> time_to(const Curve& c, double target) {
  for (std::size_t e = 0; e < c.accuracy.size(); ++e) {
    if (c.accuracy[e] >= target) return c.seconds[e];
  }
  return std::nullopt;
}

nlohmann::json or_null(std::optional<double> v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

// A step time with no step behind it is null, not 0, with a warning saying what to raise.
nlohmann::json step_ms_or_null(std::optional<double> ms, const std::string& field, const std::string& why) {
  if (ms) return *ms;
  std::cerr << fmt::format("ferry-bench phases: warning: {} is null: {}\n", field, why);
  return nullptr;
}

// Trainer::phase_step_ms is 0 where no step of the phase ran.
std::optional<double> ran(double phase_ms) {
  return phase_ms > 0 ? std::optional<double>(phase_ms) : std::nullopt;
}

// --device-budget as given, and what leaving it out does, for budget_bytes' errors.
constexpr const char* phases_budget_left_out = "leave --device-budget out for 1.25x the smallest streamed budget";

// The link bytes of a streamed Full and Predict step, and their median times.
nlohmann::json streamed(Runtime& rt, const Dataset& data, const PhasesOptions& po) {
  TrainerOptions o = trainer_options(po, true);
  o.residency.mode = graph::ResidencyMode::stream;
  if (po.budget.empty()) {
    const auto smallest = min_stream_budget(rt, make_model(po.model), o);
    if (!smallest) throw std::runtime_error("nothing of this model streams: there is no streamed step to measure");
    o.residency.budget_bytes = *smallest + *smallest / 4;
  } else {
    o.residency.budget_bytes = cli::budget_option("--device-budget", po.budget, ' ', phases_budget_left_out);
  }
  Trainer t(rt, make_model(po.model), o);
  const graph::ResidencyReport& full = t.residency();
  const graph::ResidencyReport& predict = compiled_predict_step(t)->residency();
  const auto link = [](const graph::ResidencyReport& r) { return r.fetch_bytes + r.write_back_bytes; };
  const std::size_t sample = data.sample_elems();
  std::vector<float> images(o.batch * sample);
  std::vector<std::int32_t> labels(o.batch);
  std::mt19937_64 rng(po.seed);
  std::vector<double> full_ms, predict_ms;
  for (std::uint32_t s = 0; s < po.stream_steps; ++s) {
    for (std::uint32_t i = 0; i < o.batch; ++i) {
      const std::size_t k = rng() % data.count;
      std::copy_n(data.images.begin() + k * sample, sample, images.begin() + i * sample);
      labels[i] = data.labels[k];
    }
    const StepResult r = t.step(images, labels);
    if (s < 5) continue;  // one-off costs
    (r.phase == Phase::predict ? predict_ms : full_ms).push_back(r.step_ms);
  }
  const auto timed = [&](const std::vector<double>& v) {
    return v.empty() ? std::nullopt : std::optional<double>(median(v));
  };
  const std::string why = fmt::format(
      "no such step among the streamed part's {} timed steps (--stream-steps {}, of which the first 5 are "
      "untimed): raise --stream-steps",
      full_ms.size() + predict_ms.size(), po.stream_steps);
  const auto full_step = timed(full_ms), predict_step = timed(predict_ms);
  return {{"device_budget_bytes", o.residency.budget_bytes},
          {"full_link_bytes", link(full)},
          {"predict_link_bytes", link(predict)},
          {"predict_over_full_link_bytes", double(link(predict)) / double(link(full))},
          {"full_step_ms", step_ms_or_null(full_step, "streamed.full_step_ms", why)},
          {"predict_step_ms", step_ms_or_null(predict_step, "streamed.predict_step_ms", why)},
          {"predict_over_full_step_time",
           full_step && predict_step ? nlohmann::json(*predict_step / *full_step) : nlohmann::json(nullptr)}};
}

int run_phases(const BenchCommon& common, const PhasesOptions& po) {
  // Checked now, not after the two training runs that come before the streamed part.
  if (!po.budget.empty()) cli::budget_option("--device-budget", po.budget, ' ', phases_budget_left_out);
  Runtime rt({.device = common.device});
  Dataset data = load_fashion_mnist(default_fashion_mnist_dir(), Split::train);
  Dataset test = load_fashion_mnist(default_fashion_mnist_dir(), Split::test);
  if (po.train_limit && po.train_limit < data.count) {
    data.count = po.train_limit;
    data.images.resize(data.count * data.sample_elems());
    data.labels.resize(data.count);
  }
  standardise(data);
  standardise(test);
  const Curve full = train(rt, data, test, po, false);
  const Curve hybrid = train(rt, data, test, po, true);
  const double target = full.accuracy.back() - 0.01;
  const auto full_time = time_to(full, target), hybrid_time = time_to(hybrid, target);
  nlohmann::json result = {
      {"name", "phases"},
      {"device", rt.device().name},
      {"model", po.model},
      {"epochs", po.epochs},
      {"batch", po.batch ? po.batch : default_batch(po.model)},
      {"predictor", po.predictor},
      {"full_accuracy", full.accuracy},
      {"hybrid_accuracy", hybrid.accuracy},
      {"full_train_s", full.seconds},
      {"hybrid_train_s", hybrid.seconds},
      {"full_final_accuracy", full.accuracy.back()},
      {"hybrid_final_accuracy", hybrid.accuracy.back()},
      {"accuracy_gap_points", 100 * (full.accuracy.back() - hybrid.accuracy.back())},
      {"predict_int8", po.predict_int8},
      {"fit_every", po.fit_every},
      {"full_int8_forward_accuracy", full.int8_accuracy},
      {"int8_forward_gap_points", 100 * (full.accuracy.back() - full.int8_accuracy)},
      {"predict_fraction", hybrid.predict_fraction},
      {"full_updates", full.updates},
      {"hybrid_updates", hybrid.updates},
      {"full_only_step_ms", full.full_step_ms},
      {"hybrid_full_step_ms", step_ms_or_null(ran(hybrid.full_step_ms), "hybrid_full_step_ms",
                                              "the hybrid run had no Full-phase step: raise --epochs")},
      {"hybrid_predict_step_ms", step_ms_or_null(ran(hybrid.predict_step_ms), "hybrid_predict_step_ms",
                                                 "the hybrid run predicted no step: raise --epochs")},
      {"target_accuracy", target},
      {"full_time_to_target_s", or_null(full_time)},
      {"hybrid_time_to_target_s", or_null(hybrid_time)},
      {"hybrid_over_full_time_to_target",
       full_time && hybrid_time ? nlohmann::json(*hybrid_time / *full_time) : nlohmann::json(nullptr)},
      {"hybrid_over_full_train_time", hybrid.seconds.back() / full.seconds.back()}};
  std::cerr << "ferry-bench phases: streamed steps...\n";
  try {
    result["streamed"] = streamed(rt, data, po);
  } catch (const std::exception& e) {
    // The training results above stand on their own: report them with the error.
    result["streamed"] = {{"error", e.what()}};
    std::cerr << "ferry-bench phases: the streamed part failed: " << e.what() << "\n";
  }
  emit_json(result);
  return 0;
}

BenchRun setup_phases(CLI::App& sub, const BenchCommon& common) {
  auto po = std::make_shared<PhasesOptions>();
  sub.add_option("--model", po->model, "mlp, cnn or deep")->capture_default_str();
  sub.add_option("--epochs", po->epochs, "epochs of each training run")
      ->capture_default_str()
      ->check(ferry::cli::positive_number());
  sub.add_option("--batch", po->batch, "samples per step (default: the model's, as ferry train)")
      ->check(ferry::cli::positive_number());  // 0 is refused, not read as "the model's"
  sub.add_option("--predictor", po->predictor, "linear or lsq")->capture_default_str();
  sub.add_option("--seed", po->seed, "initialisation and data order")
      ->capture_default_str()
      ->check(ferry::cli::whole_number());  // "-1" would wrap around
  sub.add_option("--train-limit", po->train_limit, "use only the first N training samples")
      ->check(ferry::cli::positive_number());  // as ferry train's: 0 is refused, not read as "all"
  sub.add_option("--device-budget", po->budget,
                 "device budget of the streamed part (default: 1.25x the smallest streamed budget)");
  sub.add_option("--stream-steps", po->stream_steps, "steps of the streamed part (the first 5 untimed)")
      ->capture_default_str();
  sub.add_option("--fit-every", po->fit_every, "fit the predictor on every K-th training step")
      ->capture_default_str()
      ->check(ferry::cli::whole_number())
      ->check(CLI::Range(1u, 4294967295u));  // checked here, not after the Full-only run
  sub.add_flag("--predict-int8", po->predict_int8, "Predict's forward reads int8 weights (all layers but the head)");
  return [&common, po] { return run_phases(common, *po); };
}

FERRY_BENCH("phases",
            "hybrid phases against Full-only training: accuracy per epoch, time to accuracy, predicted fraction, "
            "streamed Predict link bytes",
            setup_phases);

}  // namespace
}  // namespace ferry::bench
