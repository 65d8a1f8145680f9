// The one list of what decides a training run (ferry/runtime/training_setting.hpp): read by the
// data-parallel ranks' agreement check, the checkpoint's settings section and its comparison.
#include <fmt/format.h>

#include "ferry/runtime/trainer.hpp"

namespace ferry {

namespace {

class Settings {
 public:
  explicit Settings(std::vector<TrainingSetting>& out) : out_(out) {}
  // Floats print in their shortest exact form, so a value compares equal exactly when it is.
  template <class T>
  void add(std::string name, std::string flag, const T& value, bool resume = true, bool stored = false) {
    std::string text;
    if constexpr (std::is_same_v<T, bool>) {
      text = value ? "true" : "false";
    } else {
      text = fmt::format("{}", value);
    }
    out_.push_back({std::move(name), std::move(flag), std::move(text), resume, stored});
  }

 private:
  std::vector<TrainingSetting>& out_;
};

void add_optimizer(Settings& s, const ops::OptimizerConfig& o) {
  using Kind = ops::OptimizerConfig::Kind;
  s.add("optimizer.kind", "--optimizer", ops::optimizer_name(o.kind));
  float decay = 0;
  if (o.kind == Kind::sgd) {
    decay = o.sgd.weight_decay;
    s.add("optimizer.sgd.momentum", "--momentum", o.sgd.momentum);
    s.add("optimizer.sgd.nesterov", "", o.sgd.nesterov);
    s.add("optimizer.sgd.weight_decay", "--weight-decay", decay);
  } else {
    decay = o.adam.weight_decay;
    s.add("optimizer.adam.beta1", "", o.adam.beta1);
    s.add("optimizer.adam.beta2", "", o.adam.beta2);
    s.add("optimizer.adam.eps", "", o.adam.eps);
    s.add("optimizer.adam.weight_decay", "--weight-decay", decay);
  }
  if (decay > 0) s.add("optimizer.decay_on", "--weight-decay-on", ops::decay_on_name(o.decay_on));
  if (o.kind == Kind::adamw8bit) s.add("optimizer.block8bit", "--optimizer-block", o.block8bit, true, /*stored=*/true);
}

void add_precision(Settings& s, const PrecisionConfig& p) {
  s.add("precision.compute", "--precision", precision_name(p.compute));
  s.add("precision.scaled", "--loss-scaling", p.scaled() ? "on" : "off");
  if (!p.scaled()) return;
  s.add("precision.growth_interval", "--loss-scale-interval", p.growth_interval);
  s.add("precision.initial_scale", "--initial-loss-scale", p.initial_scale, /*resume=*/false);  // the checkpoint's
}

void add_phases(Settings& s, const PhaseConfig& p) {
  s.add("phases.hybrid", "--phases", phases_name(p.hybrid));
  if (!p.hybrid) return;
  s.add("phases.predictor.kind", "--predictor", ops::predictor_name(p.predictor.kind));
  s.add("phases.predictor.beta", "--predictor-beta", p.predictor.beta);
  s.add("phases.predictor.max_gain", "", p.predictor.max_gain);
  s.add("phases.predictor.residual", "--predictor-residual", p.predictor.residual);
  s.add("phases.warmup_steps", "--warmup-steps", p.warmup_steps);
  s.add("phases.min_full_steps", "--min-full-steps", p.min_full_steps);
  s.add("phases.max_predict_steps", "--max-predict", p.max_predict_steps);
  s.add("phases.confidence", "--confidence", p.confidence);
  s.add("phases.max_loss_gap", "--max-loss-gap", p.max_loss_gap);
  s.add("phases.sigma_limit", "", p.sigma_limit);
  s.add("phases.loss_window", "", p.loss_window);
  s.add("phases.predict_decay", "--predict-decay", p.predict_decay);
  s.add("phases.predict_int8", "--predict-int8", p.predict_int8);
  s.add("phases.fit_every", "--fit-every", p.fit_every);
}

}  // namespace

std::vector<TrainingSetting> training_settings(const ModelSpec& model, const TrainerOptions& o) {
  std::vector<TrainingSetting> out = model.settings;
  Settings s(out);
  add_optimizer(s, o.optimizer);
  s.add("accumulate", "--accumulate", o.accumulate);
  add_precision(s, o.precision);
  add_phases(s, o.phases);
  // Where state lives is exact either way, but for these two: state that is dropped is zeros at
  // every update, and the host optimizer's arithmetic is not the device kernels' to the bit
  // (ops/optimizer_host.hpp), which ranks must agree on; a resume may switch it.
  // Recorded either way, so that a resume that drops kept state (or keeps dropped state) is seen.
  // (Checkpoints written before it recorded "residency.state_home" only when dropped.)
  s.add("residency.state_dropped", "--state-home dropped", o.residency.state_home == graph::Home::dropped);
  s.add("residency.host_optimizer", "--host-optimizer", o.residency.host_optimizer, /*resume=*/false);
  s.add("lr", "--lr", o.lr, /*resume=*/false);        // a checkpoint carries the current rate
  s.add("seed", "--seed", o.seed, /*resume=*/false);  // the first weights only
  const DataParallelOptions& dp = o.data_parallel;
  s.add("data_parallel.global_batch", "", dp.global_batch, /*resume=*/false);
  s.add("data_parallel.bucket_bytes", "--bucket-size", dp.bucket_bytes, /*resume=*/false);
  s.add("data_parallel.zero_stage", "--zero", dp.zero_stage, /*resume=*/false);
  return out;
}

std::string setting_text(const TrainingSetting& s, const std::string& value) {
  if (s.flag.empty()) return fmt::format("{} = {}", s.name, value);
  if (value == "true") return s.flag;
  if (value == "false") return "without " + s.flag;
  return fmt::format("{} {}", s.flag, value);
}

}  // namespace ferry
