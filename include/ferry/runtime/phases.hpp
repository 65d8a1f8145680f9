// The training-phase cycle of hybrid training: Warmup -> Full -> Predict -> Correct -> Full ...
//
// Warmup and Full run the training step (forward, backward, optimizer) and fit the weight-update
// predictor (ops/predictor.hpp) after every update. Predict runs forward and loss only and
// advances the weights by the predictor instead: no gradients, no optimizer. Correct is the first
// full step after a Predict run: its fit measures how well the frozen prediction matched the true
// update, and feeds the true update back into the predictor.
//
// The controller is host logic only (no device): the Trainer asks it for the next phase and tells
// it what each step measured. The rules, in full, are in docs/phases.md:
//   - quality of a prediction = the cosine between the predicted and the true update over all
//     weights (from the fit's dot products);
//   - Full -> Predict after at least min_full_steps Full steps when the mean quality of the last
//     min_full_steps fits is at least `confidence`;
//   - a Predict run lasts `predict_length` steps; after its Correct step, the length doubles (up
//     to max_predict_steps) when the Correct quality reached `confidence` and the run was not cut
//     short, and halves (down to 1) otherwise;
//   - step k of a Predict run applies predict_decay^k times the predicted update;
//   - divergence in Predict: a loss above mean + sigma_limit * sd of the recent Full losses, a
//     loss that oscillates with growing amplitude, or a non-finite loss ends the run at once
//     (the next step is Correct); a loss more than max_loss_gap above that mean, or non-finite,
//     also restores the weights from before the run (the next step is Full).
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "ferry/ops/predictor.hpp"

namespace ferry {

enum class Phase : std::uint8_t { warmup, full, predict, correct };
const char* phase_name(Phase p);
inline constexpr std::size_t phase_count = 4;

struct PhaseConfig {
  bool hybrid = false;  // false: every step is a Full step, nothing is predicted
  ops::PredictorConfig predictor;
  std::uint32_t warmup_steps = 20;
  std::uint32_t min_full_steps = 2;
  std::uint32_t max_predict_steps = 4;
  float confidence = 0.3f;         // the prediction quality (a cosine) needed to predict, in (0, 1]
  float max_loss_gap = 0.25f;      // Predict loss above the recent Full mean by more than this: restore
  float sigma_limit = 4.0f;        // Predict loss above mean + sigma_limit * sd: end the run
  std::uint32_t loss_window = 32;  // recent Full losses the mean and sd are taken over
  // Step k of a Predict run (from 0) applies predict_decay^k times the prediction: the way an
  // update carried by momentum alone fades. In (0, 1].
  float predict_decay = 1.0f;
  // Predict's forward reads every Linear and Conv2d weight but the head's as int8 (per output
  // channel); streamed weights then cross the link as int8. With hybrid phases only (refused
  // without them, as the predictor's residual correction is).
  bool predict_int8 = false;
  // Fit the predictor on every fit_every-th training step only (and always on Correct): the fit
  // costs a snapshot and a pass over every weight. d then smooths over fit_every / (1 - beta)
  // steps. At least 1.
  std::uint32_t fit_every = 1;
};
const char* phases_name(bool hybrid);  // "hybrid" or "full"
// "full" or "hybrid"; throws std::invalid_argument naming the choices.
bool parse_phases(const std::string& s);
// Throws std::invalid_argument naming the setting and the range it must be in.
void validate(const PhaseConfig& c);

// What one fit measured, summed over every weight tensor: delta.(gain d), (gain d).(gain d),
// delta.delta (ops/predictor.hpp's st, with each tensor's gain).
struct FitStats {
  double delta_pred = 0, pred_pred = 0, delta_delta = 0;
  double quality() const;  // the cosine of the predicted and true update; 0 without a prediction
};

class PhaseController {
 public:
  explicit PhaseController(PhaseConfig config);

  // The phase of the next step.
  Phase next() const noexcept { return next_; }
  // The factor of the next Predict step's update (predict_decay^k at step k of the run).
  float predict_scale() const;

  // Whether the next step (a training step) fits the predictor.
  bool fits_next() const noexcept;
  // After a Warmup, Full or Correct step, with what its fit measured (nullptr: it did not fit).
  void record_full(float loss, const FitStats* fit);
  void record_full(float loss, const FitStats& fit) { record_full(loss, &fit); }

  enum class Verdict : std::uint8_t {
    go_on,    // keep predicting (or the run reached its length: next is Correct)
    end,      // diverging: next is Correct
    restore,  // diverged: put back the weights from before the run; next is Full
  };
  // After a Predict step. A restore also makes the next Predict run 1 step long.
  Verdict record_predict(float loss);

  struct Counts {
    std::uint64_t steps[phase_count] = {};
    std::uint64_t runs = 0;      // Predict runs that ran (counted at their first step)
    std::uint64_t ended = 0;     // runs cut short by the divergence monitor
    std::uint64_t restores = 0;  // runs whose weights were put back
  };
  const Counts& counts() const noexcept { return counts_; }
  double predict_fraction() const;
  std::uint32_t predict_length() const noexcept { return length_; }
  double last_quality() const noexcept { return last_quality_; }
  // Mean and standard deviation of the recent Full losses.
  double loss_mean() const;
  double loss_sd() const;
  const PhaseConfig& config() const noexcept { return config_; }
  // New settings from the next step on (validated first; hybrid cannot be switched).
  void set_config(const PhaseConfig& config);

  // Everything the controller has learnt, for checkpoints (ferry/runtime/checkpoint.hpp): with
  // the same config, a controller given another's state() makes the same decisions from then on.
  struct State {
    Phase next = Phase::full;
    Counts counts;
    std::uint32_t length = 1, in_phase = 0, since_fit = 0;
    bool cut_short = false;
    double last_quality = 0;
    std::vector<double> losses, qualities, predict_losses;
  };
  State state() const;
  // Throws std::invalid_argument, changing nothing, for a state this config cannot have reached
  // (a Predict phase without hybrid phases, a run length above max_predict_steps, more losses
  // than the window holds).
  void restore(const State& s);

 private:
  void start_full();
  PhaseConfig config_;
  Phase next_;
  Counts counts_;
  std::uint32_t length_;         // the next Predict run's length
  std::uint32_t in_phase_ = 0;   // steps done in the current Full stretch or Predict run
  std::uint32_t since_fit_ = 0;  // training steps since the last fit
  bool cut_short_ = false;       // the Predict run just ended by the monitor
  double last_quality_ = 0;
  std::deque<double> losses_;     // recent Full losses
  std::deque<double> qualities_;  // recent Full fit qualities
  std::deque<double> predict_losses_;
};

}  // namespace ferry
