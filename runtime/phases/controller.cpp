// The phase controller's rules (include/ferry/runtime/phases.hpp, docs/phases.md).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "ferry/runtime/phases.hpp"

namespace ferry {

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::warmup:
      return "warmup";
    case Phase::full:
      return "full";
    case Phase::predict:
      return "predict";
    case Phase::correct:
      return "correct";
  }
  return "?";
}

const char* phases_name(bool hybrid) {
  return hybrid ? "hybrid" : "full";
}

bool parse_phases(const std::string& s) {
  if (s == "full") return false;
  if (s == "hybrid") return true;
  throw std::invalid_argument(
      fmt::format("unknown phases '{}': use full (every step trains) or hybrid (Warmup/Full/Predict/Correct)", s));
}

void validate(const PhaseConfig& c) {
  ops::check_predictor(c.predictor);
  if (!c.hybrid) {
    // Settings of Predict steps, which only hybrid phases run: set without them, a mistake.
    if (c.predict_int8 || c.predictor.residual) {
      throw std::invalid_argument(fmt::format(
          "PhaseConfig::{} applies to the Predict steps of hybrid phases, and PhaseConfig::hybrid is false: set "
          "hybrid, or leave it out",
          c.predict_int8 ? "predict_int8" : "predictor.residual"));
    }
    return;
  }
  if (c.max_predict_steps == 0) {
    throw std::invalid_argument(
        "hybrid phases with a maximum predict length of 0 never predict: use a length of at least 1, or phases full");
  }
  if (c.min_full_steps == 0) {
    throw std::invalid_argument("hybrid phases need at least 1 Full step between Predict runs (min full steps 0)");
  }
  if (!(c.confidence > 0.0f && c.confidence <= 1.0f)) {
    throw std::invalid_argument(fmt::format("phase confidence must be in (0, 1], got {}", c.confidence));
  }
  if (!(c.max_loss_gap > 0.0f) || !std::isfinite(c.max_loss_gap)) {
    throw std::invalid_argument(fmt::format("maximum loss gap must be positive and finite, got {}", c.max_loss_gap));
  }
  if (!(c.sigma_limit > 0.0f) || !std::isfinite(c.sigma_limit)) {
    throw std::invalid_argument(
        fmt::format("divergence sigma limit must be positive and finite, got {}", c.sigma_limit));
  }
  if (c.fit_every == 0) throw std::invalid_argument("fit every 0 steps: use 1 (every training step) or more");
  if (!(c.predict_decay > 0.0f && c.predict_decay <= 1.0f)) {
    throw std::invalid_argument(fmt::format("predict decay must be in (0, 1], got {}", c.predict_decay));
  }
  if (c.loss_window < 2) {
    throw std::invalid_argument(fmt::format("the loss window must hold at least 2 losses, got {}", c.loss_window));
  }
}

double FitStats::quality() const {
  if (!(pred_pred > 0) || !(delta_delta > 0)) return 0;
  const double q = delta_pred / std::sqrt(pred_pred * delta_delta);
  return std::isfinite(q) ? q : 0;
}

PhaseController::PhaseController(PhaseConfig config)
    : config_(config), next_(Phase::full), length_(std::max<std::uint32_t>(1, config.max_predict_steps / 4)) {
  validate(config_);
  next_ = config_.hybrid && config_.warmup_steps > 0 ? Phase::warmup : Phase::full;
}

void PhaseController::set_config(const PhaseConfig& config) {
  validate(config);
  if (config.hybrid != config_.hybrid) {
    throw std::invalid_argument("the phases (full or hybrid) are fixed when the trainer is built");
  }
  config_ = config;
  length_ = std::min(length_, config_.max_predict_steps);
}

PhaseController::State PhaseController::state() const {
  State s;
  s.next = next_;
  s.counts = counts_;
  s.length = length_;
  s.in_phase = in_phase_;
  s.since_fit = since_fit_;
  s.cut_short = cut_short_;
  s.last_quality = last_quality_;
  s.losses.assign(losses_.begin(), losses_.end());
  s.qualities.assign(qualities_.begin(), qualities_.end());
  s.predict_losses.assign(predict_losses_.begin(), predict_losses_.end());
  return s;
}

void PhaseController::restore(const State& s) {
  if (static_cast<std::size_t>(s.next) >= phase_count || (!config_.hybrid && s.next != Phase::full)) {
    throw std::invalid_argument(fmt::format("phase state: next phase {} is not possible with phases {}",
                                            static_cast<int>(s.next), phases_name(config_.hybrid)));
  }
  if (config_.hybrid && (s.length == 0 || s.length > config_.max_predict_steps)) {
    throw std::invalid_argument(
        fmt::format("phase state: a Predict run length of {} is outside [1, {}]", s.length, config_.max_predict_steps));
  }
  if (s.losses.size() > config_.loss_window || s.qualities.size() > config_.min_full_steps) {
    throw std::invalid_argument(
        fmt::format("phase state: {} recent losses and {} qualities, more than the window of {} and {}",
                    s.losses.size(), s.qualities.size(), config_.loss_window, config_.min_full_steps));
  }
  next_ = s.next;
  counts_ = s.counts;
  length_ = s.length;
  in_phase_ = s.in_phase;
  since_fit_ = s.since_fit;
  cut_short_ = s.cut_short;
  last_quality_ = s.last_quality;
  losses_.assign(s.losses.begin(), s.losses.end());
  qualities_.assign(s.qualities.begin(), s.qualities.end());
  predict_losses_.assign(s.predict_losses.begin(), s.predict_losses.end());
}

double PhaseController::loss_mean() const {
  if (losses_.empty()) return 0;
  return std::accumulate(losses_.begin(), losses_.end(), 0.0) / static_cast<double>(losses_.size());
}

double PhaseController::loss_sd() const {
  if (losses_.size() < 2) return 0;
  const double mean = loss_mean();
  double ss = 0;
  for (double l : losses_) ss += (l - mean) * (l - mean);
  return std::sqrt(ss / static_cast<double>(losses_.size() - 1));
}

float PhaseController::predict_scale() const {
  return next_ == Phase::predict ? static_cast<float>(std::pow(config_.predict_decay, in_phase_)) : 1.0f;
}

double PhaseController::predict_fraction() const {
  std::uint64_t total = 0;
  for (auto s : counts_.steps) total += s;
  return total ? static_cast<double>(counts_.steps[static_cast<int>(Phase::predict)]) / static_cast<double>(total) : 0;
}

void PhaseController::start_full() {
  next_ = Phase::full;
  in_phase_ = 0;
  qualities_.clear();  // the fits before a Predict run say nothing about the next one
}

bool PhaseController::fits_next() const noexcept {
  if (!config_.hybrid || next_ == Phase::predict) return false;
  return next_ == Phase::correct || since_fit_ + 1 >= config_.fit_every;
}

void PhaseController::record_full(float loss, const FitStats* fit) {
  const Phase was = next_;
  ++counts_.steps[static_cast<int>(was)];
  if (std::isfinite(loss)) {
    losses_.push_back(loss);
    if (losses_.size() > config_.loss_window) losses_.pop_front();
  }
  if (!config_.hybrid) return;
  if (!fit) {
    // No fit this step: nothing to judge; the stretch goes on.
    ++since_fit_;
    if (was == Phase::warmup) {
      if (++in_phase_ >= config_.warmup_steps) start_full();
    } else {
      ++in_phase_;
    }
    return;
  }
  since_fit_ = 0;
  last_quality_ = fit->quality();
  switch (was) {
    case Phase::warmup:
      if (++in_phase_ >= config_.warmup_steps) start_full();
      return;
    case Phase::correct: {
      // How well the frozen prediction matched: the run's length follows.
      const bool good = last_quality_ >= config_.confidence && !cut_short_;
      length_ = good ? std::min(config_.max_predict_steps, length_ * 2) : std::max<std::uint32_t>(1, length_ / 2);
      start_full();
      return;
    }
    default:
      break;
  }
  qualities_.push_back(last_quality_);
  if (qualities_.size() > config_.min_full_steps) qualities_.pop_front();
  ++in_phase_;
  const double mean_quality =
      std::accumulate(qualities_.begin(), qualities_.end(), 0.0) / static_cast<double>(qualities_.size());
  if (in_phase_ >= config_.min_full_steps && mean_quality >= config_.confidence) {
    next_ = Phase::predict;
    in_phase_ = 0;
    cut_short_ = false;
    predict_losses_.clear();
  }
}

PhaseController::Verdict PhaseController::record_predict(float loss) {
  ++counts_.steps[static_cast<int>(Phase::predict)];
  // A run counts at its first step: one decided on at a run's last update never ran.
  if (in_phase_ == 0) ++counts_.runs;
  ++in_phase_;
  const double mean = loss_mean(), sd = loss_sd();
  if (!std::isfinite(loss) || loss - mean > config_.max_loss_gap) {
    ++counts_.restores;
    ++counts_.ended;
    length_ = 1;
    start_full();
    return Verdict::restore;
  }
  predict_losses_.push_back(loss);
  // Oscillation: the last four losses alternate up and down with each swing larger.
  bool oscillating = false;
  if (predict_losses_.size() >= 4) {
    const auto n = predict_losses_.size();
    const double d1 = predict_losses_[n - 3] - predict_losses_[n - 4];
    const double d2 = predict_losses_[n - 2] - predict_losses_[n - 3];
    const double d3 = predict_losses_[n - 1] - predict_losses_[n - 2];
    oscillating = d1 * d2 < 0 && d2 * d3 < 0 && std::abs(d3) > std::abs(d2) && std::abs(d2) > std::abs(d1);
  }
  if (loss > mean + config_.sigma_limit * sd || oscillating) {
    ++counts_.ended;
    cut_short_ = true;
    next_ = Phase::correct;
    return Verdict::end;
  }
  if (in_phase_ >= length_) next_ = Phase::correct;
  return Verdict::go_on;
}

}  // namespace ferry
