// What a Trainer compiled, for the CLI, the benchmarks and the tests: its compiled steps (their
// graphs, timelines and memory plans). Not installed: a trainer's users see
// ferry/runtime/trainer.hpp, whose figures (device_peak_bytes, residency, ...) come from these.
#pragma once

#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "ferry/runtime/plan.hpp"
#include "ferry/runtime/trainer.hpp"
#include "graph/compiled_step.hpp"
#include "graph/memory_plan.hpp"
#include "graph/pipeline.hpp"
#include "trainer_variants.hpp"

namespace ferry {

struct Trainer::Compiled {
  std::unique_ptr<graph::CompiledStep> train;
  // The variants compiled besides the training step so far (evaluation at each batch size it
  // met, the Predict step, ...), by what differs between them.
  std::map<graph::VariantKey, std::unique_ptr<graph::CompiledStep>> variants;
  graph::VariantKey train_key;
  // Resolved once: where each weight's predictor statistics and each weight live.
  std::vector<graph::PersistentArena::Entry> fit_stats, weights;
  // The step the newest settled training step ran: the training step, or with accumulation the
  // micro-batch step, with hybrid phases the Predict step or the one without a fit (what traces
  // and memory profiles of that step read).
  const graph::CompiledStep* last_run = nullptr;
};

struct TrainerInternals {
  static graph::CompiledStep& train_step(Trainer& t) noexcept { return *t.compiled_->train; }
  static const graph::CompiledStep& last_run_step(const Trainer& t) noexcept {
    return t.compiled_->last_run ? *t.compiled_->last_run : *t.compiled_->train;
  }
  static const graph::CompiledStep& train_step(const Trainer& t) noexcept { return *t.compiled_->train; }
  static const std::map<graph::VariantKey, std::unique_ptr<graph::CompiledStep>>& variants(const Trainer& t) noexcept {
    return t.compiled_->variants;
  }
  // Trainer::save_checkpoint for a caller that holds the path's OutputLock (output_file.hpp).
  static void save_checkpoint_locked_by_caller(const Trainer& t, const std::filesystem::path& path,
                                               std::span<const std::byte> caller, WriteOptions options) {
    t.write_checkpoint_file(path, caller, options, false);
  }
};

// The trainer's training step.
inline graph::CompiledStep& compiled_train_step(Trainer& t) noexcept {
  return TrainerInternals::train_step(t);
}
inline const graph::CompiledStep& compiled_train_step(const Trainer& t) noexcept {
  return TrainerInternals::train_step(t);
}
// The step the newest settled training step ran (the training step before any ran).
inline const graph::CompiledStep& compiled_last_run_step(const Trainer& t) noexcept {
  return TrainerInternals::last_run_step(t);
}
// The variants compiled besides the training step so far.
inline const std::map<graph::VariantKey, std::unique_ptr<graph::CompiledStep>>& compiled_variants(
    const Trainer& t) noexcept {
  return TrainerInternals::variants(t);
}
// The compiled Predict step with hybrid phases, else nullptr.
const graph::CompiledStep* compiled_predict_step(const Trainer& t);
inline graph::CompiledStep* compiled_predict_step(Trainer& t) {
  return const_cast<graph::CompiledStep*>(compiled_predict_step(std::as_const(t)));
}

// The bytes at the peak of a step planned as `step` with memory plan `plan`; the persistent
// tensors are those of `training` (the model's training variant, which holds them all: a variant
// that does not use a device-resident tensor, Predict and the optimizer state, still finds it on
// the device), whose device home holds `persistent_device_bytes`.
DeviceBreakdown device_breakdown(const graph::Graph& step, const graph::MemoryPlan& plan, const graph::Graph& training,
                                 std::uint64_t persistent_device_bytes);
// The same for compiled steps.
DeviceBreakdown device_breakdown(const graph::CompiledStep& step, const graph::CompiledStep& training);

}  // namespace ferry
