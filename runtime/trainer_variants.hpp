// What a Trainer compiles, as functions of its options, so that the planner
// (ferry::plan_training, runtime/plan.cpp) plans exactly the variants a Trainer would compile.
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "ferry/runtime/plan.hpp"
#include "ferry/runtime/trainer.hpp"
#include "graph/pipeline.hpp"
#include "runtime/plan_search.hpp"

namespace ferry {

// The forward graph of one variant of `model`: its batch tensors, layers, and either the loss
// (training, evaluation) or the prediction as the output "prediction" (key.predict). Throws
// graph::BuildError for a model that cannot be built.
graph::Graph forward_graph(const ModelSpec& model, const graph::VariantKey& key);

}  // namespace ferry

namespace ferry::detail {

// Checks the options as the Trainer does (std::invalid_argument saying what to change) and sets
// what follows from them: with hybrid phases, the optimizer's predictor.
void validate_trainer_options(const ModelSpec& model, TrainerOptions& options);
// What keeps host updates from being overlapped with the next step's forward in these options (a
// second training variant: hybrid phases' fitting steps, accumulation's micro-batches; or
// collectives), named as a user would change it, or nullptr where nothing does.
const char* overlapped_updates_conflict(const TrainerOptions& options);
// The training step's key; a training variant's (micro-batch, predictor fit); the Predict step's.
graph::VariantKey training_key(const TrainerOptions& options);
graph::VariantKey training_variant_key(const TrainerOptions& options, bool micro, bool fit);
graph::VariantKey predict_key(const TrainerOptions& options);
// An evaluation (Trainer::evaluate) or inference (Trainer::predict: `predict`) variant of `count`
// samples: the batch, or a smaller power of two for a data set's tail.
graph::VariantKey evaluation_key(const TrainerOptions& options, std::uint32_t count, bool predict = false,
                                 bool int8_weights = false);
// The device budget a Trainer plans in: the options', or the device's memory less headroom
// (10%, at least 256 MiB, at most half).
std::uint64_t resolve_device_budget(std::uint64_t budget_bytes, const cl::DeviceInfo& device);
inline std::uint64_t resolve_device_budget(const TrainerOptions& options, const cl::DeviceInfo& device) {
  return resolve_device_budget(options.residency.budget_bytes, device);
}
// The budget a Trainer takes where the driver counts device memory in use (`count`: the runtime's
// source, read now; the budget returned unchanged without a count): a budget above what the driver
// counts free throws std::invalid_argument naming both; with no budget (0), where the device's
// memory less headroom is more than is free (other processes, or this one's other trainers, hold
// some), the free memory less the same headroom, or on a rank of a data-parallel run (whose ranks
// must plan alike) an error asking for a budget; otherwise the budget as given.
std::uint64_t budget_within_free_memory(std::uint64_t budget_bytes, const cl::DriverMemory& count,
                                        const cl::DeviceInfo& device, bool data_parallel);
// The residency options a Trainer compiles with: the options', the budget resolved and updates grouped
// when the graph fuses (TrainerOptions::fuse).
graph::ResidencyOptions residency_options(const TrainerOptions& options, std::uint64_t device_budget);

// The variants a Trainer compiles up front after its training step, with the phase each serves.
struct UpfrontVariant {
  std::string phase;
  graph::VariantKey key;
};
std::vector<UpfrontVariant> upfront_variants(const TrainerOptions& options);

// plan(options) with host memory `automatic` made concrete for `device` (resolve_host_transfers).
// Where that chose staged memory, whose pinned buffers count in the device budget there, pageable
// memory (automatic's other choice, no chunk) is planned too when the staged plan does not fit
// (graph::BudgetError; pageable's error is then the one thrown) or fits only by recomputing what
// pageable does not: the plan taken is pageable's in those cases.
template <class Plan>
TrainingPlan plan_with_host_transfers(TrainerOptions options, const cl::DeviceInfo& device, Plan&& plan) {
  const graph::ResidencyOptions resolved = resolve_host_transfers(options.residency, device);
  const bool chose_staged = options.residency.homes.host_memory == offload::HostMemory::automatic &&
                            resolved.homes.host_memory == offload::HostMemory::staged;
  options.residency = resolved;
  if (!chose_staged) return plan(options);
  TrainerOptions pageable = options;
  pageable.residency.homes.host_memory = offload::HostMemory::pageable;
  pageable.residency.staging_chunk_bytes = 0;
  TrainingPlan staged;
  try {
    staged = plan(options);
  } catch (const graph::BudgetError&) {
    return plan(pageable);
  }
  if (!options.recompute_auto || staged.recompute == 0) return staged;
  try {
    TrainingPlan without_staging = plan(pageable);
    if (without_staging.recompute == 0) return without_staging;
  } catch (const graph::BudgetError&) {
    // Pageable memory does not fit either: staged with recomputation it is.
  }
  return staged;
}

// plan(options) with TrainerOptions::host_optimizer_auto made concrete for `device`. On a device with memory of its
// own, a step that streams is planned with the updates on the device and on the host, and the host's plan is taken
// where the device's does not fit the budget, or where the host's moves fewer bytes over the link (its fetches and
// write-backs), recomputes no more and is within the host's memory (host_limit_by: the host budget, physical memory or
// both) wherever the device's is. Measured on an H200 (bench/RESULTS.md, "Fourth GPU run"), a 1.0B GPT under an 8 GiB
// budget: 689 ms a step with the host's updates against 3,323 ms with the device's (staged memory), 571 against 800 ms
// (registered), 2,062 against 3,526 ms (pageable); the device's moved 32.9 GB a step, the host's 9.1. Where the
// device's memory is the host's, nothing crosses a link: the updates stay on the device.
template <class Plan>
TrainingPlan plan_with_host_optimizer(TrainerOptions options, const cl::DeviceInfo& device, HostLimit host_limit_by,
                                      Plan&& plan) {
  if (!options.host_optimizer_auto) return plan(options);
  options.host_optimizer_auto = false;
  TrainerOptions on_host = options;
  on_host.residency.host_optimizer = true;
  // Overlapped host updates are the host optimizer's: asked for, they are the answer.
  if (options.residency.overlap_host_updates) return plan(on_host);
  if (device.host_unified_memory) return plan(options);
  std::optional<TrainingPlan> device_plan;
  std::exception_ptr device_error;
  try {
    device_plan = plan(options);
    if (device_plan->mode != graph::ResidencyMode::stream) return *device_plan;  // nothing streams
  } catch (const graph::BudgetError&) {
    device_error = std::current_exception();
  }
  TrainingPlan host_plan;
  try {
    host_plan = plan(on_host);
  } catch (const std::invalid_argument&) {  // a setting the host optimizer does not take (say, compressed state)
    if (device_error) std::rethrow_exception(device_error);
    return *device_plan;
  } catch (const graph::BudgetError& e) {
    if (!device_error) return *device_plan;
    // Neither fits: the error of the place that needs the smaller budget, which auto would take there.
    try {
      std::rethrow_exception(device_error);
    } catch (const graph::BudgetError& on_device) {
      if (on_device.min_budget() <= e.min_budget()) throw;
    }
    throw;
  }
  host_plan.host_optimizer_chosen = true;
  if (!device_plan) return host_plan;
  // The host's updates keep their gradients in host memory: where that is over the host's limit and the
  // device's plan is not, the device's it is.
  const std::uint64_t host_limit = host_limit_bytes(options.residency.host_budget_bytes, host_limit_by);
  const auto fits_host = [&](const TrainingPlan& p) { return host_limit == 0 || host_bytes_needed(p) <= host_limit; };
  const bool host_over = !fits_host(host_plan) && fits_host(*device_plan);
  if (!host_over && host_plan.recompute <= device_plan->recompute &&
      link_bytes_per_step(host_plan) < link_bytes_per_step(*device_plan)) {
    host_plan.other_place_moved_bytes = link_bytes_per_step(*device_plan);
    return host_plan;
  }
  device_plan->host_optimizer_chosen = true;
  device_plan->other_place_moved_bytes = link_bytes_per_step(host_plan);
  return *device_plan;
}

}  // namespace ferry::detail
