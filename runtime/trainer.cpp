// Trainer: graph construction per variant, parameter initialisation, step and evaluation.
#include "ferry/runtime/trainer.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "distributed/data_parallel.hpp"
#include "ferry/runtime/plan.hpp"
#include "ferry/runtime/units.hpp"
#include "graph/pipeline.hpp"
#include "initial_values.hpp"
#include "plan_search.hpp"
#include "trainer_internals.hpp"
#include "trainer_variants.hpp"

namespace ferry {
namespace {

// What the overflow guard refuses in a gradient (ops/overflow_guard.hpp), as the errors name it.
constexpr const char* unusable_gradient_text =
    "inf or NaN, or 2^64 or more in magnitude, whose square would make Adam's second moment inf";

// The loss's stats carry an argmax-hit count after the loss (softmax cross-entropy's [loss, hits]).
bool counts_hits(const graph::CompiledStep& step) {
  return step.graph().tensors.shape[step.graph().loss].elems() > 1;
}

// Host updates deferred into the next step belong to the one training variant that updates:
// configurations with a second one (hybrid phases' fitting steps, accumulation's micro-batches)
// or with collectives are refused rather than run without the overlap.
void validate_overlapped_updates(const TrainerOptions& options) {
  // (Without the host optimizer, or with two copies of the state, the residency pass refuses it.)
  if (!options.residency.overlap_host_updates) return;
  const char* other = detail::overlapped_updates_conflict(options);
  if (other == nullptr) return;
  throw std::invalid_argument(
      fmt::format("host updates overlapped with the next step's forward (--overlap-host-updates; "
                  "ResidencyOptions::overlap_host_updates) do not combine with {} yet: leave one of the two out",
                  other));
}

}  // namespace

namespace detail {

const char* overlapped_updates_conflict(const TrainerOptions& options) {
  return options.phases.hybrid            ? "hybrid phases (--phases hybrid)"
         : options.accumulate > 1         ? "gradient accumulation (--accumulate above 1)"
         : detail::data_parallel(options) ? "data-parallel training (more than one rank)"
                                          : nullptr;
}

void validate_trainer_options(const ModelSpec& model, TrainerOptions& options) {
  if (!model.forward) throw std::invalid_argument("model has no forward function");
  if (!(options.lr > 0) || !std::isfinite(options.lr)) {
    throw std::invalid_argument(fmt::format(
        "learning rate must be a finite number > 0 (TrainerOptions::lr; set_lr takes 0 later, as a schedule's end), "
        "got {}",
        options.lr));
  }
  if (options.batch == 0) {
    throw std::invalid_argument("TrainerOptions::batch is 0: a step trains on at least 1 sample (ferry train --batch)");
  }
  ops::validate(options.optimizer);
  validate(options.phases);
  if (options.accumulate == 0) {
    throw std::invalid_argument(
        "gradient accumulation over 0 micro-batches (TrainerOptions::accumulate): use 1 (no accumulation) or more");
  }
  validate(options.precision);
  if (options.recompute_auto && options.recompute > 0) {
    throw std::invalid_argument(fmt::format(
        "recompute_auto chooses the layers per recomputed segment, and TrainerOptions::recompute gives {}: set one "
        "(recompute_auto with recompute 0, or recompute_auto false)",
        options.recompute));
  }
  if (options.host_optimizer_auto && options.residency.host_optimizer) {
    throw std::invalid_argument(
        "host_optimizer_auto chooses where the optimizer runs, and ResidencyOptions::host_optimizer asks for the "
        "host: set one (host_optimizer_auto with host_optimizer false, or host_optimizer_auto false)");
  }
  if (options.phases.hybrid) options.optimizer.predictor = options.phases.predictor;
  validate_data_parallel(options);
  validate_overlapped_updates(options);
}

graph::VariantKey training_key(const TrainerOptions& options) {
  graph::VariantKey key{options.batch, true};
  key.precision = options.precision.compute;
  key.loss_scaling = options.precision.scaled();
  key.accumulate = options.accumulate;
  key.recompute = options.recompute;
  key.fuse = options.fuse;
  key.fit_predictor = options.phases.hybrid;
  if (data_parallel(options)) {
    key.ranks = static_cast<std::uint32_t>(options.data_parallel.communicator->size());
    key.rank_share = static_cast<float>(static_cast<double>(options.batch) / options.data_parallel.global_batch);
    key.bucket_bytes = options.data_parallel.bucket_bytes;
    key.rank = static_cast<std::uint32_t>(options.data_parallel.communicator->rank());
    key.zero_stage = static_cast<std::uint8_t>(options.data_parallel.zero_stage);
  }
  return key;
}

graph::VariantKey training_variant_key(const TrainerOptions& options, bool micro, bool fit) {
  graph::VariantKey key = training_key(options);
  key.micro = micro;
  key.fit_predictor = options.phases.hybrid && fit && !micro;
  return key;
}

graph::VariantKey predict_key(const TrainerOptions& options) {
  graph::VariantKey key{options.batch, false};
  key.precision = options.precision.compute;
  key.fuse = options.fuse;
  key.apply_predictor = true;
  key.int8_weights = options.phases.predict_int8;
  return key;
}

graph::VariantKey evaluation_key(const TrainerOptions& options, std::uint32_t count, bool predict, bool int8_weights) {
  graph::VariantKey key{count, false, predict};
  key.precision = options.precision.compute;
  key.fuse = options.fuse;
  key.int8_weights = int8_weights;
  return key;
}

namespace {
// `mem` less headroom for the driver and others: 10%, at least 256 MiB, at most half.
std::uint64_t less_headroom(std::uint64_t mem) {
  return mem - std::min(mem / 2, std::max<std::uint64_t>(mem / 10, 256ull << 20));
}
}  // namespace

std::uint64_t resolve_device_budget(std::uint64_t budget_bytes, const cl::DeviceInfo& device) {
  return budget_bytes != 0 ? budget_bytes : less_headroom(device.global_mem_bytes);
}

std::uint64_t budget_within_free_memory(std::uint64_t budget_bytes, const cl::DriverMemory& count,
                                        const cl::DeviceInfo& device, bool data_parallel) {
  const auto now = count.read();
  if (!now) return budget_bytes;
  // The driver's own free figure: total - used leaves in what it reserves for itself (NVML).
  const std::uint64_t free = now->free_bytes;
  const std::uint64_t reserved = now->total_bytes - std::min(now->total_bytes, now->used_bytes + free);
  const std::string counted = fmt::format(
      "the driver ({}) counts {} free on '{}' ({} of its {} in use, by this process and others{})", count.source(),
      format_bytes(free), device.name, format_bytes(now->used_bytes), format_bytes(now->total_bytes),
      reserved ? fmt::format("; {} reserved by the driver", format_bytes(reserved)) : std::string());
  if (budget_bytes > free) {
    throw std::invalid_argument(
        fmt::format("device budget {} is more than {}: give at most {}, or no budget to use "
                    "what is free",
                    format_bytes(budget_bytes), counted, format_bytes(free)));
  }
  if (budget_bytes != 0 || resolve_device_budget(0, device) <= free) return budget_bytes;
  // No budget, and the device's memory less headroom is more than is free.
  if (data_parallel) {
    throw std::invalid_argument(
        fmt::format("no device budget given, and {}: give every rank a device budget of at "
                    "most {} (the ranks plan alike, so none may take its own)",
                    counted, format_bytes(free)));
  }
  return less_headroom(free);
}

graph::ResidencyOptions residency_options(const TrainerOptions& options, std::uint64_t device_budget) {
  graph::ResidencyOptions r = options.residency;
  r.budget_bytes = device_budget;
  // Streamed state is one host copy, updated after the commit point (by the device, or by the
  // host optimizer). A Predict step (hybrid phases) moves the weights before its loss is known:
  // the run's restore point puts them back when it diverges or fails (predict_step).
  r.group_updates = options.fuse;  // like the graph's fusions: bit-identical, off to compare
  return r;
}

std::vector<UpfrontVariant> upfront_variants(const TrainerOptions& options) {
  // So that a budget they do not fit in fails at construction, not mid-run.
  std::vector<UpfrontVariant> out;
  if (options.accumulate > 1) out.push_back({"micro-batch", training_variant_key(options, true, true)});
  if (options.phases.hybrid) {
    out.push_back({"predict", predict_key(options)});
    if (options.phases.fit_every > 1) out.push_back({"full (no fit)", training_variant_key(options, false, false)});
  }
  return out;
}

}  // namespace detail

TrainerBudget trainer_budget_now(Runtime& runtime, const TrainerOptions& options) {
  const std::uint64_t given = options.residency.budget_bytes;
  const std::uint64_t budget = detail::budget_within_free_memory(given, runtime.driver_memory().source(),
                                                                 runtime.device(), detail::data_parallel(options));
  return {budget, given == 0 && budget != 0};
}

Trainer::Trainer(Runtime& runtime, ModelSpec model, TrainerOptions options)
    : runtime_(runtime.shared()),
      model_(std::move(model)),
      options_(options),
      lr_(options.lr),
      compiled_(std::make_unique<Compiled>()),
      scaler_(options.precision) {
  detail::validate_trainer_options(model_, options_);
  if (detail::data_parallel(options_)) {
    ranks_ = options_.data_parallel.communicator;
    control_ = ranks_->split();
    detail::check_ranks_agree(*control_, build_graph(detail::training_key(options_)), model_, options_);
  }
  // The budget as the driver's count of free device memory allows now, before anything is planned.
  const TrainerBudget budget = trainer_budget_now(runtime, options_);
  options_.residency.budget_bytes = budget.budget_bytes;
  budget_from_free_memory_ = budget.from_free_memory;
  // Every step variant compiled below, planned first without allocating anything (choosing the
  // recomputation with recompute_auto): the pinned host bytes they need are checked against the
  // host budget and the machine's memory here, before any of them is allocated.
  const TrainingPlan plan = [&] {
    try {
      return plan_training(runtime, model_, options_, {});
    } catch (const graph::BudgetError& e) {
      throw detail::with_recompute_hint(e, runtime, model_, options_);
    }
  }();
  options_.recompute = plan.recompute;
  options_.recompute_auto = false;  // chosen: options() says what this trainer runs
  // Host memory `automatic` as the plan made it concrete (resolve_host_transfers), chunk and all.
  options_.residency.homes.host_memory = plan.host_memory;
  options_.residency.staging_chunk_bytes = plan.staging_chunk_bytes;
  // The optimizer's place as host_optimizer_auto chose it (plan_training), the same on every rank: the host's
  // arithmetic is not the device kernels' to the bit, and the ranks' replicas must stay equal. On every rank of
  // a data-parallel run, whether or not it chose (host_optimizer_auto is not among the settings the ranks'
  // agreement compares): a collective some ranks skip would hang the others.
  if (control_) detail::check_ranks_place_optimizer_alike(*control_, plan.host_optimizer);
  options_.residency.host_optimizer = plan.host_optimizer;
  options_.host_optimizer_auto = false;
  check_host_budget(plan, options_.residency.host_budget_bytes);
  compiled_->train_key = detail::training_key(options_);
  if (options_.phases.hybrid) phases_ = std::make_unique<PhaseController>(options_.phases);
  // Training needs the budget to exist (planning does not: `ferry plan` plans for other devices).
  if (const std::uint64_t mem = runtime_->context->device().global_mem_bytes; options_.residency.budget_bytes > mem) {
    throw std::invalid_argument(fmt::format(
        "device budget {} is more than the device '{}' has ({}): give at most that, or no budget to use "
        "what the device can spare",
        format_bytes(options_.residency.budget_bytes), runtime_->context->device().name, format_bytes(mem)));
  }
  budget_ = detail::resolve_device_budget(options_, runtime_->context->device());
  compiled_->train = std::make_unique<graph::CompiledStep>(
      build_graph(compiled_->train_key), options_.optimizer, runtime_->env, *runtime_->context, nullptr,
      graph::StepOptions{residency_options(), options_.serial_schedule});
  initialise_parameters();
  for (const auto& v : detail::upfront_variants(options_)) variant(v.key);
  // Where each weight lives, resolved once (the weight check and the restore point read them).
  const auto& arena = *compiled_->train->persistent();
  weight_names_ = parameter_names();
  for (const auto& name : weight_names_) compiled_->weights.push_back(*arena.find(name));
  if (phases_) {
    for (const auto& name : weight_names_) {
      const auto stats = arena.find(name + ".pred_stats");
      if (!stats) throw std::logic_error(fmt::format("no predictor state for '{}'", name));
      compiled_->fit_stats.push_back(*stats);
    }
    gains_.assign(2 * compiled_->fit_stats.size(), 0.0f);  // per weight: the gain of d, the weight of r
  }
}

graph::CompiledStep& Trainer::training_variant(bool micro, bool fit) {
  if (!micro && (fit || !phases_)) return *compiled_->train;
  return variant(detail::training_variant_key(options_, micro, fit));
}

graph::CompiledStep& Trainer::predict_variant_mutable() {
  return variant(detail::predict_key(options_));
}

namespace {

// A failure after the step had begun changing state in place: the trainer is inconsistent until
// a checkpoint restores it.
// With host updates deferred into the next step (`deferred`), the state changes in place while
// that step applies the update of the step before.
[[noreturn]] void throw_inconsistent(const graph::PartialUpdateError& e, std::uint64_t step, bool deferred,
                                     std::string& inconsistent) {
  inconsistent = fmt::format("step {} failed {}: {}. The training state is therefore inconsistent", step,
                             deferred ? "while applying the update of the step before it, deferred into it"
                                      : "in its update phase, after its forward and backward had succeeded",
                             e.what());
  throw graph::PartialUpdateError(
      fmt::format("{}: restore it from a checkpoint (Trainer::load_checkpoint; ferry train --resume) before "
                  "training on; until then the trainer refuses to step or to save a checkpoint",
                  inconsistent),
      e.tensors(), e.cause());
}

}  // namespace

void Trainer::wait_step(graph::CompiledStep& step) {
  try {
    step.wait();
  } catch (const graph::PartialUpdateError& e) {
    throw_inconsistent(e, steps_ + 1, options_.residency.overlap_host_updates, inconsistent_);
  }
}

StepResult Trainer::after_wait(graph::CompiledStep& step, std::chrono::steady_clock::time_point t0) {
  const auto t1 = std::chrono::steady_clock::now();
  StepResult r;
  const float* stats = step.stats_host();
  r.loss = stats[0];
  if (counts_hits(step)) r.correct = static_cast<std::uint32_t>(stats[1]);
  r.step_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
  r.device_peak_bytes = step.device_bytes();
  return r;
}

StepResult Trainer::run_step(graph::CompiledStep& step, const ops::StepInfo& info) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    step.submit(info);
  } catch (const graph::PartialUpdateError& e) {
    throw_inconsistent(e, steps_ + 1, options_.residency.overlap_host_updates, inconsistent_);
  }
  wait_step(step);
  return after_wait(step, t0);
}

Trainer::~Trainer() = default;

std::uint64_t Trainer::device_peak_bytes() const {
  return compiled_->train->device_bytes();
}

std::uint64_t Trainer::host_state_bytes() const {
  // Every compiled variant keeps its own host pool (the device arena is shared, host pools are
  // not): the micro-batch and Predict steps', and each evaluation step's once one has run.
  std::uint64_t bytes = compiled_->train->persistent()->host_bytes() + compiled_->train->host_bytes();
  for (const auto& [key, step] : compiled_->variants) bytes += step->host_bytes();
  return bytes;
}

const graph::ResidencyReport& Trainer::residency() const {
  return compiled_->train->residency();
}

void Trainer::require_settled(const char* what) const {
  if (std::none_of(pending_.begin(), pending_.end(), [](const Pending& p) { return p.step != nullptr; })) return;
  throw std::logic_error(
      fmt::format("the trainer cannot {} while submitted steps are still running: read their result() first", what));
}

void Trainer::refuse_if_inconsistent(const char* what) const {
  if (inconsistent_.empty()) return;
  throw std::runtime_error(fmt::format(
      "the trainer refuses to {}: {}; restore the training state from a checkpoint first (Trainer::load_checkpoint)",
      what, inconsistent_));
}

graph::ResidencyOptions Trainer::residency_options() const {
  return detail::residency_options(options_, budget_);
}

graph::Graph Trainer::build_graph(const graph::VariantKey& key) const {
  return graph::prepare_step_graph(forward_graph(model_, key), key, options_.optimizer);
}

void Trainer::initialise_parameters() {
  const auto& t = compiled_->train->graph().tensors;
  std::vector<TensorId> tensors;
  for (TensorId id = 0; id < t.size(); ++id) {
    if (graph::is_persistent(t.role[id]) && t.alias_of[id] == graph::no_tensor) tensors.push_back(id);
  }
  write_initial_values(*compiled_->train->persistent(), t, tensors, options_.seed);
}

void Trainer::validate_staged(const graph::CompiledStep& step, std::span<const TensorSpec> specs,
                              std::size_t first) const {
  for (const TensorSpec& spec : specs) {
    const auto bytes = step.host_input(spec.name);
    const std::size_t per_sample = spec.sample.elems();
    if (spec.dtype == graph::DType::i32 && spec.id_limit > 0) {
      const auto* v = reinterpret_cast<const std::int32_t*>(bytes.data());
      for (std::size_t i = 0; i < bytes.size() / 4; ++i) {
        if (v[i] < 0 || static_cast<std::uint32_t>(v[i]) >= spec.id_limit) {
          throw std::invalid_argument(fmt::format(
              "'{}' value {} (element {} of sample {}) is outside [0, {}): {} must be ids below {} (check the data or "
              "the vocabulary size the model was built with)",
              spec.name, v[i], i % per_sample, first + i / per_sample, spec.id_limit, spec.name, spec.id_limit));
        }
      }
    } else if (spec.dtype == graph::DType::f32) {
      const auto* v = reinterpret_cast<const float*>(bytes.data());
      for (std::size_t i = 0; i < bytes.size() / 4; ++i) {
        if (!std::isfinite(v[i])) {
          throw std::invalid_argument(fmt::format("'{}' value {} of sample {} is not finite ({}): fix the data",
                                                  spec.name, i % per_sample, first + i / per_sample, v[i]));
        }
      }
    }
  }
}

void Trainer::stage_batch(graph::CompiledStep& step, const Batch& batch) const {
  const std::uint32_t samples = options_.batch;
  for (const auto& entry : batch) {
    const std::string& name = entry.first;  // (clang 14 cannot capture a structured binding)
    const auto known = [&](const TensorSpec& s) { return s.name == name; };
    if (std::none_of(model_.inputs.begin(), model_.inputs.end(), known) &&
        std::none_of(model_.targets.begin(), model_.targets.end(), known)) {
      throw std::invalid_argument(fmt::format("batch has a tensor '{}' that model '{}' does not take (it takes: {})",
                                              name, model_.name, fmt::join(step.host_input_names(), ", ")));
    }
  }
  for (const auto* specs : {&model_.inputs, &model_.targets}) {
    for (const TensorSpec& spec : *specs) {
      const auto it = batch.find(spec.name);
      if (it == batch.end()) {
        throw std::invalid_argument(fmt::format("batch has no '{}' ({} {} per sample), which model '{}' needs",
                                                spec.name, graph::dtype_name(spec.dtype), spec.sample.str(),
                                                model_.name));
      }
      const HostView& v = it->second;
      if (v.dtype != spec.dtype) {
        throw std::invalid_argument(fmt::format(
            "batch tensor '{}' is {}, but model '{}' takes {} there ({} per sample): convert the data to {} "
            "before staging it",
            spec.name, graph::dtype_name(v.dtype), model_.name, graph::dtype_name(spec.dtype), spec.sample.str(),
            graph::dtype_name(spec.dtype)));
      }
      if (v.bytes.size() != samples * spec.sample_bytes()) {
        throw std::invalid_argument(fmt::format(
            "batch tensor '{}' has {} bytes; this step was compiled for {} samples of {} {} ({} bytes): pass "
            "full batches (drop or pad the last one)",
            spec.name, v.bytes.size(), samples, graph::dtype_name(spec.dtype), spec.sample.str(),
            samples * spec.sample_bytes()));
      }
      std::memcpy(step.host_input(spec.name).data(), v.bytes.data(), v.bytes.size());
    }
  }
  validate_staged(step, model_.inputs, 0);
  validate_staged(step, model_.targets, 0);
}

offload::HostMemory Trainer::host_memory() const {
  return offload::resolve_host_memory(options_.residency.homes.host_memory, runtime_->context->device());
}

StepResult Trainer::step(const Batch& batch) {
  const OneThreadAtATime::Call call(one_thread_, "Trainer::step");
  return result(submit(batch));
}

bool Trainer::runs_ahead() const {
  return compiled_->train->can_run_ahead() && !phases_ && options_.accumulate <= 1 && !options_.precision.scaled() &&
         options_.check_weights_every == 0;
}

StepHandle Trainer::submit(const Batch& batch) {
  const OneThreadAtATime::Call call(one_thread_, "Trainer::submit");
  refuse_if_inconsistent("step");
  const auto unsettled = [this] {
    return static_cast<std::size_t>(
        std::count_if(pending_.begin(), pending_.end(), [](const Pending& p) { return p.step != nullptr; }));
  };
  // Settle what this step depends on: everything unless it may run ahead, else enough that no
  // more than max_in_flight steps are on the device.
  for (Pending& p : pending_) {
    if (!p.step) continue;
    if (runs_ahead() && unsettled() < graph::CompiledStep::max_in_flight) break;
    settle(p);
  }
  refuse_if_inconsistent("step");
  Pending p;
  p.id = ++handles_;
  if (phases_ && phases_->next() == Phase::predict) {
    // The controller moves on at updates only, so a Predict step never falls inside a group of
    // micro-batches.
    if (micro_ != 0) throw std::logic_error("a Predict step inside an accumulation group");
    try {
      p.result = predict_step(batch);
    } catch (const std::invalid_argument&) {
      throw;  // a bad batch: nothing ran
    } catch (...) {
      p.error = std::current_exception();
    }
    pending_.push_back(std::move(p));
    return {pending_.back().id};
  }
  p.phase = phases_ ? phases_->next() : Phase::full;
  p.micro = micro_ + 1 < options_.accumulate;
  p.fit = phases_ && phases_->fits_next();
  graph::CompiledStep& step = training_variant(p.micro, p.fit);
  stage_batch(step, batch);
  // Steps still in flight are updates this one comes after (only the plain configuration runs
  // ahead: each of them is one optimizer step).
  ops::StepInfo info{steps_ + 1 + unsettled(), lr_};
  info.accumulate_keep = micro_ == 0 ? 0.0f : 1.0f;
  // Where this micro-batch's samples sit among the update's (dropout draws other masks for each).
  info.first_row = std::uint64_t{micro_} * global_batch() +
                   (ranks_ ? shard_of(global_batch(), ranks_->rank(), ranks_->size()).first : 0u);
  // Each rank's loss is the mean over its share of the global batch, so its gradients are 1/share
  // times the global batch's (the all-reduce scales them back): scaled by the share too, the narrow
  // gradients have the magnitudes of one rank's run, which then overflows where this one does.
  info.loss_scale = scaler_.scale() * compiled_->train_key.rank_share;
  info.communicator = ranks_.get();
  p.loss_scale = scaler_.scale();
  p.submitted = std::chrono::steady_clock::now();
  try {
    step.submit(info);
  } catch (const graph::PartialUpdateError& e) {
    throw_inconsistent(e, steps_ + 1, options_.residency.overlap_host_updates, inconsistent_);
  }
  p.step = &step;
  pending_.push_back(std::move(p));
  return {pending_.back().id};
}

StepResult Trainer::result(StepHandle handle) {
  const OneThreadAtATime::Call call(one_thread_, "Trainer::result");
  const auto it = std::find_if(pending_.begin(), pending_.end(), [&](const Pending& p) { return p.id == handle.id; });
  if (it == pending_.end()) {
    throw std::invalid_argument(
        fmt::format("no submitted step has handle {}: each step's result is read once, by the handle submit() returned",
                    handle.id));
  }
  for (Pending& p : pending_) {
    if (p.step) settle(p);
    if (&p == &*it) break;
  }
  Pending done = std::move(*it);
  pending_.erase(it);
  if (done.error) std::rethrow_exception(done.error);
  return done.result;
}

void Trainer::settle(Pending& p) {
  graph::CompiledStep* step = p.step;
  try {
    p.result = finish_training_step(p);
  } catch (...) {
    p.error = std::current_exception();
    // A step that failed on the device cancelled the one submitted after it (graph::CompiledStep::wait).
    if (step->in_flight() == 0) {
      for (Pending& q : pending_) {
        if (!q.step || q.step != step || &q == &p) continue;
        q.step = nullptr;
        q.error = std::make_exception_ptr(
            std::runtime_error("this step was cancelled: the step submitted before it failed, and it was enqueued to "
                               "run after that one; nothing of it is in the training state"));
      }
    }
  }
  p.step = nullptr;
}

void Trainer::settle_all() {
  for (Pending& p : pending_) {
    if (p.step) settle(p);
  }
}

StepResult Trainer::finish_training_step(Pending& p) {
  graph::CompiledStep& step = *p.step;
  p.step = nullptr;
  compiled_->last_run = &step;
  const bool micro = p.micro, fit = p.fit;
  const Phase phase = p.phase;
  wait_step(step);
  // Wall time of the step: from its submission, or from the end of the step before it when that
  // ended later (the device ran them back to back), so a run's steps add up to its wall time.
  const auto t0 = std::max(p.submitted, last_done_);
  StepResult r = after_wait(step, t0);
  if (ranks_) reduce_over_ranks(r);
  last_done_ = std::chrono::steady_clock::now();
  r.loss_scale = p.loss_scale;
  // The phase the controller chose; with accumulation every micro-batch belongs to the update it
  // makes.
  r.phase = phase;
  float guard = 0;
  std::memcpy(&guard, step.host_output(graph::overflow_guard_name).data(), sizeof guard);
  if (micro) {
    if (options_.precision.scaled() && std::isfinite(r.loss) && !std::isfinite(guard)) {
      // Its scaled gradients overflowed: the micro-batch added nothing to the sums (their
      // updates check the guard), so the group waits for another one, at half the scale. The
      // sums hold unscaled gradients: micro-batches at different scales add up.
      r.overflow = true;
      scaler_.record(true);
      r.updated = false;
      return r;
    }
    if (!std::isfinite(r.loss) || !std::isfinite(guard)) {
      throw std::runtime_error(
          fmt::format("training diverged at micro-batch {} of {} (update {}): {}; its gradient was not added, so the "
                      "accumulated sum is as it was: lower the learning rate or check the data",
                      micro_ + 1, options_.accumulate, steps_ + 1,
                      std::isfinite(r.loss) ? fmt::format("the loss ({}) is finite, but a weight gradient is not ({})",
                                                          r.loss, unusable_gradient_text)
                                            : fmt::format("the loss is {}", r.loss)));
    }
    ++micro_;
    r.updated = false;
    // Timed with its update (phase_step_ms: a Full update's micro-batches against a Predict step).
    phase_ms_[static_cast<int>(phase)] += r.step_ms;
    return r;
  }
  if (!std::isfinite(r.loss)) {
    // The optimizer updates check the loss on the device and did nothing: the state is as it was.
    // That state is only worth keeping if its weights are finite: a loss turns non-finite also
    // because an earlier update (with a finite loss) broke the weights, unseen between checks.
    if (const std::string bad = non_finite_weight(); !bad.empty()) {
      // Steps and saves are refused until a checkpoint is loaded: a save would replace the last
      // good one with these weights.
      inconsistent_ =
          fmt::format("weight {} is not finite (training diverged before optimizer update {})", bad, steps_ + 1);
      throw std::runtime_error(fmt::format(
          "training diverged before optimizer update {}: the loss is {} because weight {} was already not finite "
          "before this step ({}; learning rate {}): the update was skipped, but the weights are not usable: go back "
          "to a checkpoint from before the divergence and lower the learning rate",
          steps_ + 1, r.loss, bad,
          weights_checked_at_ > 0 ? fmt::format("they were last checked finite after update {}", weights_checked_at_)
                                  : std::string("they were not checked finite after any update"),
          lr_));
    }
    throw std::runtime_error(fmt::format(
        "training diverged at optimizer update {}: the loss is {} (learning rate {}); the update was skipped, so the "
        "weights and optimizer state are those from before this step: lower the learning rate or check the data (a "
        "loss that stays non-finite on every batch means an earlier update left the weights finite but huge: go back "
        "to a checkpoint from before it)",
        steps_ + 1, r.loss, lr_));
  }
  if (options_.precision.scaled()) {
    // A non-finite guard with a finite loss: the scaled gradients overflowed, nothing was updated.
    // With accumulation the group's last micro-batch is dropped and the group waits for another;
    // with hybrid phases the controller has not moved on.
    r.overflow = !std::isfinite(guard);
    scaler_.record(r.overflow);
    if (r.overflow) {
      r.updated = false;
      return r;
    }
  } else if (!std::isfinite(guard)) {
    throw std::runtime_error(
        fmt::format("training diverged at optimizer update {}: the loss ({}) is finite, but a weight gradient is not "
                    "({}; learning rate {}); the update was skipped, so the weights and optimizer state are those "
                    "from before this step: lower the learning rate or check the data",
                    steps_ + 1, r.loss, unusable_gradient_text, lr_));
  }
  ++steps_;
  micro_ = 0;  // (after a diverged last micro-batch the group waits for another one)
  phase_ms_[static_cast<int>(phase)] += r.step_ms;
  ++phase_steps_[static_cast<int>(phase)];
  if (phases_) {
    if (fit) {
      const FitStats f = read_fit();
      phases_->record_full(r.loss, &f);
    } else {
      phases_->record_full(r.loss, nullptr);
    }
  }
  // Every update reports a weight it made not finite through the step's status word: the weights
  // are read back (to name the first such element) only when one did.
  const bool updates_broke_weights = step.wrote_non_finite_weight();
  if (updates_broke_weights || (options_.check_weights_every > 0 && steps_ % options_.check_weights_every == 0)) {
    std::string bad = non_finite_weight();
    if (bad.empty() && updates_broke_weights) throw_non_finite_state(r.loss);
    if (!bad.empty()) {
      inconsistent_ = fmt::format("weight {} is not finite (training diverged at optimizer update {})", bad, steps_);
      throw std::runtime_error(
          fmt::format("training diverged at optimizer update {}: the loss ({}) was finite, but this step's update "
                      "made weight {} not finite (learning rate {}): the weights are NOT those from before this step "
                      "and are not usable: go back to a checkpoint from before this step and lower the learning rate",
                      steps_, r.loss, bad, lr_));
    }
  }
  weights_checked_at_ = steps_;  // every update checked what it wrote
  return r;
}

// An update reported a value it wrote not finite and every weight is: an Adam second moment made
// infinite by a gradient whose square overflows f32 (above about 1.8e19), with which its weight
// would never move again. The state is changed in place, so the trainer is inconsistent.
void Trainer::throw_non_finite_state(double loss) {
  const auto& t = compiled_->train->graph().tensors;
  std::string bad;
  std::vector<float> values;
  for (TensorId id = 0; id < t.size() && bad.empty(); ++id) {
    if (t.role[id] != graph::Role::optimizer_state || t.alias_of[id] != graph::no_tensor ||
        t.dtype[id] != graph::DType::f32) {
      continue;
    }
    values.resize(t.shape[id].elems());
    compiled_->train->persistent()->read(t.home[id], t.placement[id], values.data(), t.bytes(id));
    const auto it = std::find_if(values.begin(), values.end(), [](float v) { return !std::isfinite(v); });
    if (it != values.end()) bad = fmt::format("'{}' (element {} is {})", t.name[id], it - values.begin(), *it);
  }
  if (bad.empty()) {  // (an update said so, yet what it wrote reads back finite: not explained as above)
    inconsistent_ = fmt::format("update {} reported a value it wrote not finite", steps_);
    throw std::runtime_error(
        fmt::format("training diverged at optimizer update {}: the loss ({}) was finite, but an update reported a "
                    "weight or optimizer state it wrote not finite, and reading them back found none: the training "
                    "state is not trusted: go back to a checkpoint from before this step",
                    steps_, loss));
  }
  inconsistent_ =
      fmt::format("optimizer state {} is not finite (training diverged at optimizer update {})", bad, steps_);
  throw std::runtime_error(fmt::format(
      "training diverged at optimizer update {}: the loss ({}) and the weights are finite, but this step's update "
      "made optimizer state {} not finite: the gradient the update squares (the weight gradient the overflow guard "
      "took, plus the L2 weight decay times the weight) overflowed, after which its weight would never change again; "
      "the state is not usable: go back to a checkpoint from before this step and check the weights' magnitudes and "
      "the weight decay, or lower the learning rate",
      steps_, loss, bad));
}

std::string Trainer::non_finite_weight() const {
  // Weights are f32 masters (mixed precision casts copies of them), read where they live.
  const auto& arena = *compiled_->train->persistent();
  std::vector<float> values;
  for (std::size_t w = 0; w < compiled_->weights.size(); ++w) {
    values.resize(compiled_->weights[w].bytes / sizeof(float));
    arena.read(compiled_->weights[w].home, compiled_->weights[w].place, values.data(), compiled_->weights[w].bytes);
    for (std::size_t i = 0; i < values.size(); ++i) {
      if (!std::isfinite(values[i])) return fmt::format("'{}' (element {} is {})", weight_names_[w], i, values[i]);
    }
  }
  return {};
}

FitStats Trainer::read_fit() {
  FitStats f;
  const auto& arena = *compiled_->train->persistent();
  for (std::size_t i = 0; i < compiled_->fit_stats.size(); ++i) {
    float st[ops::predictor_stat_count];
    arena.read(compiled_->fit_stats[i].home, compiled_->fit_stats[i].place, st, sizeof st);
    // The prediction this fit judged was g d + rg r, with the gains it was made with.
    const double g = gains_[2 * i], rg = gains_[2 * i + 1];
    f.delta_pred += g * st[ops::predictor_stat_delta_d] + rg * st[ops::predictor_stat_delta_r];
    f.pred_pred += g * g * st[ops::predictor_stat_d_d] + 2 * g * rg * st[ops::predictor_stat_d_r] +
                   rg * rg * st[ops::predictor_stat_r_r];
    f.delta_delta += st[ops::predictor_stat_delta_delta];
    gains_[2 * i] = st[ops::predictor_stat_gain];
    gains_[2 * i + 1] = st[ops::predictor_stat_rgain];
  }
  return f;
}

namespace {

// Puts `values` (one per weight, as a restore point holds them) where the weights live.
void write_weights(graph::PersistentArena& arena, const std::vector<graph::PersistentArena::Entry>& weights,
                   const std::vector<std::vector<std::byte>>& values) {
  for (std::size_t i = 0; i < weights.size(); ++i) {
    arena.write(weights[i].home, weights[i].place, values[i].data(), values[i].size());
  }
}

}  // namespace

StepResult Trainer::predict_step(const Batch& batch) {
  graph::CompiledStep& step = predict_variant_mutable();
  stage_batch(step, batch);
  auto& arena = *compiled_->train->persistent();
  if (!in_predict_run_) {
    // The weights of the last Full step, put back if the run diverges.
    restore_point_.resize(compiled_->weights.size());
    for (std::size_t i = 0; i < compiled_->weights.size(); ++i) {
      restore_point_[i].resize(compiled_->weights[i].bytes);
      arena.read(compiled_->weights[i].home, compiled_->weights[i].place, restore_point_[i].data(),
                 compiled_->weights[i].bytes);
    }
    in_predict_run_ = true;
  }
  StepResult r;
  try {
    compiled_->last_run = &step;
    r = run_step(step, ops::StepInfo{steps_ + 1, lr_, phases_->predict_scale()});
  } catch (const graph::PartialUpdateError& e) {
    put_back_weights_after_failed_predict(e);
  }
  // Every rank's controller judges the global batch's loss, so all of them choose alike.
  if (ranks_) reduce_over_ranks(r);
  r.phase = Phase::predict;
  r.updated = false;
  phase_ms_[static_cast<int>(Phase::predict)] += r.step_ms;
  ++phase_steps_[static_cast<int>(Phase::predict)];
  r.verdict = phases_->record_predict(r.loss);
  if (r.verdict == PhaseController::Verdict::restore) write_weights(arena, compiled_->weights, restore_point_);
  if (phases_->next() != Phase::predict) in_predict_run_ = false;
  return r;
}

// A Predict step moves the weights in place ahead of its loss (on the device, or streamed in the
// one host copy once its fetches have read them): failing after that, it puts back the run's
// restore point, a state the trainer was in (the last training step's), rather than leaving the
// trainer inconsistent.
void Trainer::put_back_weights_after_failed_predict(const graph::PartialUpdateError& e) {
  for (const std::string& name : e.tensors()) {
    if (std::find(weight_names_.begin(), weight_names_.end(), name) == weight_names_.end()) throw e;
  }
  try {
    write_weights(*compiled_->train->persistent(), compiled_->weights, restore_point_);
  } catch (const std::exception& w) {
    throw graph::PartialUpdateError(
        fmt::format("{}; putting back the weights from before the Predict run failed too: {}", e.what(), w.what()),
        e.tensors(), e.cause());
  }
  inconsistent_.clear();
  std::string cause = "an unknown failure";
  try {
    if (e.cause()) std::rethrow_exception(e.cause());
  } catch (const std::exception& c) {
    cause = c.what();
  } catch (...) {
  }
  throw std::runtime_error(fmt::format(
      "a Predict step (after update {}) failed once it had begun moving the weights: {}; the weights were put back "
      "to those from before its Predict run (update {}'s), so training can go on",
      steps_, cause, steps_));
}

const graph::CompiledStep* compiled_predict_step(const Trainer& t) {
  for (const auto& [key, step] : compiled_variants(t)) {
    if (key.apply_predictor) return step.get();
  }
  return nullptr;
}

double Trainer::phase_step_ms(Phase p) const {
  const auto i = static_cast<int>(p);
  if (i < 0 || static_cast<std::size_t>(i) >= std::size(phase_steps_)) {
    throw std::invalid_argument(fmt::format("phase_step_ms: {} is not a phase", i));
  }
  return phase_steps_[i] ? phase_ms_[i] / static_cast<double>(phase_steps_[i]) : 0.0;
}

std::uint64_t Trainer::predictor_state_bytes() const {
  return bytes_of(graph::Role::predictor_state);
}

StepResult Trainer::step(std::span<const float> images, std::span<const std::int32_t> labels) {
  const OneThreadAtATime::Call call(one_thread_, "Trainer::step");
  return step(Batch{{"input", HostView(images)}, {"labels", HostView(labels)}});
}

graph::CompiledStep& Trainer::variant(const graph::VariantKey& key) {
  auto it = compiled_->variants.find(key);
  if (it == compiled_->variants.end()) {
    auto step =
        std::make_unique<graph::CompiledStep>(build_graph(key), options_.optimizer, runtime_->env, *runtime_->context,
                                              compiled_->train->persistent(), graph::StepOptions{residency_options()});
    it = compiled_->variants.emplace(key, std::move(step)).first;
  }
  return *it->second;
}

template <class After>
void Trainer::for_each_chunk(const DataSource& data, bool predict, bool int8_weights, After after) {
  const std::size_t n = data.size();
  for (std::size_t first = 0; first < n;) {
    // A full batch, or the largest power of two that fits in what is left.
    std::uint32_t count = options_.batch;
    while (count > n - first) count /= 2;
    graph::CompiledStep& step = variant(detail::evaluation_key(options_, count, predict, int8_weights));
    for (const auto* specs : {&model_.inputs, &model_.targets}) {
      if (predict && specs == &model_.targets) break;
      for (const TensorSpec& spec : *specs) data.read(spec.name, first, count, step.host_input(spec.name));
      validate_staged(step, *specs, first);
    }
    step.run(ops::StepInfo{steps_ + 1, lr_});
    after(step, first, count);
    first += count;
  }
}

EvalResult Trainer::evaluate(const DataSource& data, bool int8_weights) {
  const OneThreadAtATime::Call call(one_thread_, "Trainer::evaluate");
  if (data.size() == 0) {
    // A loss of 0 over nothing would read as a perfect model.
    throw std::invalid_argument(
        "Trainer::evaluate: the data hold no samples, so there is nothing to evaluate: give "
        "at least one");
  }
  refuse_if_inconsistent("evaluate");
  settle_all();  // evaluation variants share the training step's device buffers
  EvalResult r;
  double loss_sum = 0, correct = 0;
  std::size_t labels_per_sample = 0;
  for_each_chunk(data, false, int8_weights, [&](const graph::CompiledStep& step, std::size_t, std::uint32_t count) {
    const float* stats = step.stats_host();
    loss_sum += static_cast<double>(stats[0]) * count;
    if (counts_hits(step)) {
      correct += stats[1];
      labels_per_sample = model_.targets.empty() ? 1 : model_.targets[0].sample.elems();
    }
  });
  r.samples = data.size();
  if (r.samples) {
    r.loss = loss_sum / static_cast<double>(r.samples);
    if (labels_per_sample) r.accuracy = correct / static_cast<double>(r.samples * labels_per_sample);
  }
  return r;
}

Trainer::HostTensor Trainer::predict(const DataSource& inputs) {
  const OneThreadAtATime::Call call(one_thread_, "Trainer::predict");
  if (inputs.size() == 0) {
    throw std::invalid_argument(
        "Trainer::predict: the inputs hold no samples, so there is nothing to predict: give "
        "at least one");
  }
  refuse_if_inconsistent("predict");
  settle_all();  // prediction variants share the training step's device buffers
  HostTensor out;
  for_each_chunk(inputs, true, false, [&](const graph::CompiledStep& step, std::size_t, std::uint32_t count) {
    const auto bytes = step.host_output("prediction");
    if (out.bytes.empty()) {
      const auto& t = step.graph().tensors;
      for (TensorId id = 0; id < t.size(); ++id) {
        if (t.name[id] == "prediction@host") {
          out.dtype = t.dtype[id];
          out.shape = t.shape[id];
        }
      }
      out.shape.dims[0] = static_cast<std::uint32_t>(inputs.size());
      out.bytes.reserve(bytes.size() / count * inputs.size());
    }
    out.bytes.insert(out.bytes.end(), bytes.begin(), bytes.end());
  });
  return out;
}

std::uint64_t Trainer::bytes_of(graph::Role role) const {
  std::uint64_t bytes = 0;
  const auto& t = compiled_->train->graph().tensors;
  for (TensorId id = 0; id < t.size(); ++id) {
    if (t.role[id] == role) bytes += t.bytes(id);
  }
  return bytes;
}

std::uint64_t Trainer::weight_bytes() const {
  return bytes_of(graph::Role::weight);
}

std::uint64_t Trainer::parameter_count() const {
  std::uint64_t count = 0;
  const auto& t = compiled_->train->graph().tensors;
  for (TensorId id = 0; id < t.size(); ++id) {
    if (t.role[id] == graph::Role::weight) count += t.shape[id].elems();
  }
  return count;
}

void Trainer::reduce_over_ranks(StepResult& r) {
  const double share = static_cast<double>(options_.batch) / options_.data_parallel.global_batch;
  double sums[2] = {static_cast<double>(r.loss) * share, static_cast<double>(r.correct)};
  control_->allreduce_sum(sums);
  r.loss = static_cast<float>(sums[0]);
  r.correct = static_cast<std::uint32_t>(sums[1]);
}

std::uint64_t Trainer::gradient_bytes() const {
  const graph::Graph& g = compiled_->train->graph();
  std::uint64_t bytes = 0;
  if (compiled_->train_key.zero_stage == 2 && compiled_->train_key.ranks > 1) {
    // The reduced shares (f32) the updates read; the whole gradients are transient.
    for (const graph::ZeroShare& s :
         graph::zero_shares(g, graph::zero_sharding(compiled_->train_key, options_.optimizer))) {
      bytes += s.range.count * sizeof(float);
    }
    return bytes;
  }
  const auto& t = g.tensors;
  for (TensorId w = 0; w < t.size(); ++w) {
    if (t.role[w] == graph::Role::weight && t.grad[w] != graph::no_tensor) bytes += t.bytes(t.grad[w]);
  }
  return bytes;
}

std::uint64_t Trainer::allreduce_bytes_per_step() const {
  if (!ranks_) return 0;
  if (compiled_->train_key.zero_stage != 2) return gradient_bytes();
  // Every weight's whole f32 gradient goes into the reduce-scatter (its t.grad is the shard now).
  std::uint64_t bytes = 0;
  for (const graph::ZeroShare& s : graph::zero_shares(compiled_->train->graph(), {})) {
    bytes += compiled_->train->graph().tensors.shape[s.weight].elems() * sizeof(float);
  }
  return bytes;
}

std::uint64_t Trainer::optimizer_state_bytes() const {
  return bytes_of(graph::Role::optimizer_state);
}

std::uint64_t Trainer::training_state_bytes() const {
  // Weights, one gradient per weight, optimizer state.
  return 2 * weight_bytes() + optimizer_state_bytes();
}

std::vector<std::string> Trainer::parameter_names() const {
  std::vector<std::string> names;
  const auto& t = compiled_->train->graph().tensors;
  for (TensorId id = 0; id < t.size(); ++id) {
    if (t.role[id] == graph::Role::weight) names.push_back(t.name[id]);
  }
  return names;
}

void Trainer::set_lr(float lr) {
  const OneThreadAtATime::Call call(one_thread_, "Trainer::set_lr");
  if (!std::isfinite(lr) || lr < 0.0f) {
    throw std::invalid_argument(fmt::format(
        "learning rate must be a finite number >= 0, got {}: the trainer keeps {} (step {})", lr, lr_, steps_ + 1));
  }
  lr_ = lr;
}

namespace {

// The home of the tensors of a persistent role (the first one's: all of a role share a home).
graph::Home home_of(const graph::Graph& g, graph::Role role) {
  const auto& t = g.tensors;
  for (TensorId id = 0; id < t.size(); ++id) {
    if (t.role[id] == role && t.alias_of[id] == graph::no_tensor) return t.home[id];
  }
  return graph::Home::device;
}

}  // namespace

offload::Home Trainer::weights_home() const {
  return home_of(compiled_->train->graph(), graph::Role::weight);
}

offload::Home Trainer::state_home() const {
  return home_of(compiled_->train->graph(), graph::Role::optimizer_state);
}

TensorId Trainer::persistent_tensor(const std::string& name) const {
  const auto& t = compiled_->train->graph().tensors;
  for (TensorId id = 0; id < t.size(); ++id) {
    if (graph::is_persistent(t.role[id]) && t.alias_of[id] == graph::no_tensor && t.name[id] == name) return id;
  }
  throw std::invalid_argument(fmt::format("model '{}' has no weight or optimizer state named '{}'", model_.name, name));
}

Trainer::HostTensor Trainer::read_tensor(const std::string& name) const {
  const OneThreadAtATime::Call call(one_thread_, "Trainer::read_tensor");
  require_settled("read a tensor");
  const auto& t = compiled_->train->graph().tensors;
  const TensorId id = persistent_tensor(name);
  HostTensor out{t.dtype[id], t.shape[id], std::vector<std::byte>(t.bytes(id))};
  compiled_->train->persistent()->read(t.home[id], t.placement[id], out.bytes.data(), out.bytes.size());
  return out;
}

std::vector<std::string> Trainer::tensor_names() const {
  std::vector<std::string> names = parameter_names();
  const auto& t = compiled_->train->graph().tensors;
  for (TensorId id = 0; id < t.size(); ++id) {
    if (t.role[id] == graph::Role::optimizer_state && t.alias_of[id] == graph::no_tensor) names.push_back(t.name[id]);
  }
  for (TensorId id = 0; id < t.size(); ++id) {
    if (t.role[id] == graph::Role::predictor_state && t.alias_of[id] == graph::no_tensor) names.push_back(t.name[id]);
  }
  return names;
}

void Trainer::write_tensor(const std::string& name, const HostTensor& value) {
  const OneThreadAtATime::Call call(one_thread_, "Trainer::write_tensor");
  settle_all();
  const auto& t = compiled_->train->graph().tensors;
  const TensorId id = persistent_tensor(name);
  if (value.dtype != t.dtype[id] || !(value.shape == t.shape[id])) {
    throw std::invalid_argument(fmt::format("cannot write '{}': it is {} {}, the value is {} {}; nothing was written",
                                            name, graph::dtype_name(t.dtype[id]), t.shape[id].str(),
                                            graph::dtype_name(value.dtype), value.shape.str()));
  }
  if (value.bytes.size() != t.bytes(id)) {
    throw std::invalid_argument(fmt::format(
        "cannot write '{}': the value says {} {} but holds {} bytes, not the {} that takes; nothing was written", name,
        graph::dtype_name(value.dtype), value.shape.str(), value.bytes.size(), t.bytes(id)));
  }
  if (value.dtype == graph::DType::f32) {
    const auto* f = reinterpret_cast<const float*>(value.bytes.data());
    for (std::size_t i = 0; i < t.shape[id].elems(); ++i) {
      if (!std::isfinite(f[i])) {
        throw std::invalid_argument(
            fmt::format("cannot write '{}': element {} is not finite ({}); nothing was written", name, i, f[i]));
      }
    }
  }
  compiled_->train->persistent()->write(t.home[id], t.placement[id], value.bytes.data(), value.bytes.size());
}

std::vector<float> Trainer::read_parameter(const std::string& name) const {
  const OneThreadAtATime::Call call(one_thread_, "Trainer::read_parameter");
  require_settled("read a parameter");
  const HostTensor v = read_tensor(name);
  if (v.dtype != graph::DType::f32) {
    throw std::invalid_argument(fmt::format("parameter '{}' is stored as {}, not f32: read it with read_tensor", name,
                                            graph::dtype_name(v.dtype)));
  }
  std::vector<float> out(v.shape.elems());
  std::memcpy(out.data(), v.bytes.data(), v.bytes.size());
  return out;
}

std::optional<std::uint64_t> min_stream_budget(Runtime& runtime, const ModelSpec& model, TrainerOptions options) {
  options.residency.mode = graph::ResidencyMode::stream;
  options.residency.budget_bytes = 1;
  try {
    plan_training(runtime, model, options, {});  // planned only: nothing is allocated
  } catch (const graph::BudgetError& e) {
    return e.min_budget();
  }
  return std::nullopt;
}

}  // namespace ferry
