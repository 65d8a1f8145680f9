// What decides a training run's result beyond its model's tensors and its data, in one list that
// every check of "is this the same training" reads: the ranks of a data-parallel run agree on all
// of it, a checkpoint records the settings a resume must keep and Trainer::load_checkpoint refuses
// another value (naming the setting and the `ferry train` flag that sets it).
#pragma once

#include <string>
#include <vector>

namespace ferry {

struct ModelSpec;
struct TrainerOptions;

struct TrainingSetting {
  std::string name;  // where the library sets it: "optimizer.sgd.momentum", "gpt.dropout"
  std::string flag;  // the `ferry train` flag that sets it ("--momentum"); empty where none does
  // As text, so settings of any type compare alike: numbers in their shortest exact form (a float
  // as the float it is), choices by name, flags as "true" / "false".
  std::string value;
  // A resumed run must keep it. Not so for the learning rate and the initial loss scale (the
  // checkpoint carries the current ones), the seed of the first weights, the host optimizer, or
  // how data-parallel ranks cut and reduce their work.
  bool resume = true;
  // The checkpoint's bytes are laid out by it (the 8-bit state's block): compared even when a load
  // accepts other settings (LoadOptions::accept_other_settings).
  bool stored = false;
};

// Every setting of a trainer of `model` with `options` that decides what it computes: the
// model's own (ModelSpec::settings), then the optimizer's, accumulation, precision and loss
// scaling, hybrid phases and data parallelism. A setting an option makes irrelevant is left out
// (SGD's momentum under Adam, the phases' settings without hybrid phases, what the weight decay
// applies to without weight decay); so is anything exact either way (residency but for dropped
// optimizer state and the host optimizer, recompute, fusion). The order is fixed, so two lists of
// one configuration compare element by element.
std::vector<TrainingSetting> training_settings(const ModelSpec& model, const TrainerOptions& options);

// "--momentum 0.9" where a flag sets it, else "optimizer.adam.eps = 1e-08".
std::string setting_text(const TrainingSetting& s, const std::string& value);

}  // namespace ferry
