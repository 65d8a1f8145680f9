// Trainer::save_checkpoint / load_checkpoint (ferry/runtime/checkpoint.hpp, docs/checkpoints.md):
// what a trainer keeps in a checkpoint and how it is put back. The file format itself, its atomic
// writer and its verifying reader are in runtime/checkpoint_format.cpp.
#include "ferry/runtime/checkpoint.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint_format.hpp"
#include "ferry/runtime/trainer.hpp"
#include "trainer_internals.hpp"

namespace ferry {

using ckpt::Fingerprint;

std::vector<TensorId> Trainer::checkpoint_tensors() const {
  const auto& t = compiled_->train->graph().tensors;
  std::vector<TensorId> ids;
  for (const graph::Role role :
       {graph::Role::weight, graph::Role::optimizer_state, graph::Role::predictor_state, graph::Role::gradient_sum}) {
    for (TensorId id = 0; id < t.size(); ++id) {
      if (t.role[id] == role && t.alias_of[id] == graph::no_tensor) ids.push_back(id);
    }
  }
  return ids;
}

namespace {

std::string tensor_text(const Fingerprint::Tensor& t) {
  return fmt::format("'{}' ({} {})", t.name, graph::dtype_name(static_cast<graph::DType>(t.dtype)), t.shape.str());
}

// Throws std::invalid_argument naming the first difference between the checkpoint's fingerprint
// and this trainer's.
void compare(const Fingerprint& file, const Fingerprint& here, const std::filesystem::path& path) {
  const auto mismatch = [&](const std::string& what, const std::string& todo) {
    return std::invalid_argument(
        fmt::format("checkpoint '{}' was written for another training setup: {}; the trainer was not changed: {}",
                    path.string(), what, todo));
  };
  if (file.model != here.model) {
    throw mismatch(fmt::format("its model is '{}', this trainer's is '{}'", file.model, here.model),
                   "load it into the model that wrote it (the same --model and sizes)");
  }
  if (file.optimizer != here.optimizer) {
    throw mismatch(fmt::format("its optimizer is {}, this trainer's is {}", file.optimizer, here.optimizer),
                   fmt::format("use --optimizer {}", file.optimizer));
  }
  if (file.batch != here.batch) {
    throw mismatch(fmt::format("its batch is {}, this trainer's is {}", file.batch, here.batch),
                   fmt::format("use --batch {}", file.batch));
  }
  if (file.accumulate != here.accumulate) {
    throw mismatch(
        fmt::format("it accumulates {} micro-batches per update, this trainer {}", file.accumulate, here.accumulate),
        fmt::format("use --accumulate {}", file.accumulate));
  }
  if (file.precision != here.precision || file.scaled != here.scaled) {
    const auto name = [](const Fingerprint& f) {
      return fmt::format("{}{}", graph::dtype_name(static_cast<graph::DType>(f.precision)),
                         f.scaled ? " with loss scaling" : "");
    };
    throw mismatch(fmt::format("its precision is {}, this trainer's is {}", name(file), name(here)),
                   "use the --precision and --loss-scaling it was written with");
  }
  if (file.hybrid != here.hybrid) {
    throw mismatch(
        fmt::format("its phases are {}, this trainer's are {}", phases_name(file.hybrid), phases_name(here.hybrid)),
        fmt::format("use --phases {}", phases_name(file.hybrid)));
  }
  for (std::size_t i = 0; i < std::max(file.tensors.size(), here.tensors.size()); ++i) {
    if (i >= file.tensors.size()) {
      throw mismatch(fmt::format("it has no tensor {}", tensor_text(here.tensors[i])),
                     "load it into the model that wrote it (the same sizes and options)");
    }
    if (i >= here.tensors.size()) {
      throw mismatch(fmt::format("this trainer has no tensor {}", tensor_text(file.tensors[i])),
                     "load it into the model that wrote it (the same sizes and options)");
    }
    const auto &a = file.tensors[i], &b = here.tensors[i];
    if (a.name != b.name || a.dtype != b.dtype || !(a.shape == b.shape) || a.bytes != b.bytes) {
      throw mismatch(fmt::format("its tensor {} is {} here", tensor_text(a), tensor_text(b)),
                     "load it into the model that wrote it (the same sizes and options)");
    }
  }
}

// The fingerprint of a trainer of `model` with `options` whose checkpointed tensors are `ids`.
Fingerprint fingerprint_of(const ModelSpec& model, const TrainerOptions& options, bool hybrid,
                           const graph::TensorTable& t, const std::vector<TensorId>& ids) {
  Fingerprint fp;
  fp.model = model.name;
  fp.optimizer = optimizer_name(options.optimizer.kind);
  // Data parallel: the global batch, which does not depend on the number of ranks, so that a
  // checkpoint of N ranks resumes on M (ZeRO stage 0) or alone.
  const auto& dp = options.data_parallel;
  fp.batch = dp.communicator && dp.communicator->size() > 1 ? dp.global_batch : options.batch;
  fp.accumulate = options.accumulate;
  fp.precision = static_cast<std::uint8_t>(options.precision.compute);
  fp.scaled = options.precision.scaled();
  fp.hybrid = hybrid;
  for (const TensorId id : ids) {
    fp.tensors.push_back({t.name[id], static_cast<std::uint8_t>(t.dtype[id]), t.shape[id], t.bytes(id)});
  }
  return fp;
}

}  // namespace

void Trainer::save_checkpoint(const std::filesystem::path& path, std::span<const std::byte> caller,
                              WriteOptions options) const {
  require_settled("save a checkpoint");
  refuse_if_inconsistent("save a checkpoint");
  const auto& t = compiled_->train->graph().tensors;
  const auto ids = checkpoint_tensors();
  const auto& arena = *compiled_->train->persistent();

  ckpt::TrainerRecord tr;
  tr.steps = steps_;
  tr.micro = micro_;
  tr.lr = lr_;
  for (std::size_t i = 0; i < phase_count; ++i) {
    tr.phase_ms[i] = phase_ms_[i];
    tr.phase_steps[i] = phase_steps_[i];
  }
  tr.loss_scale = scaler_.scale();
  tr.clean_steps = scaler_.clean_steps();
  tr.overflows = scaler_.overflows();
  tr.in_predict_run = in_predict_run_;
  tr.gains = gains_;
  std::optional<PhaseController::State> phases;
  if (phases_) phases = phases_->state();

  ckpt::write_checkpoint(
      path, fingerprint_of(model_, options_, phases_ != nullptr, t, ids), tr, phases, caller,
      [&](std::size_t i, std::vector<std::byte>& buf) {
        arena.read(t.home[ids[i]], t.placement[ids[i]], buf.data(), buf.size());
      },
      in_predict_run_ ? std::span<const std::vector<std::byte>>(restore_point_)
                      : std::span<const std::vector<std::byte>>(),
      options.replace_foreign_file);
}

std::vector<std::byte> Trainer::load_checkpoint(const std::filesystem::path& path) {
  settle_all();
  // Pass 1: every section read and verified, everything but the tensors decoded. A damaged
  // file is reported as damaged before it is compared: not as another model's.
  const ckpt::Reader r(path);
  ckpt::Contents file = ckpt::read_contents(r);
  const auto& t = compiled_->train->graph().tensors;
  const auto ids = checkpoint_tensors();

  // The file is whole: now does it fit this trainer?
  compare(file.fingerprint, fingerprint_of(model_, options_, phases_ != nullptr, t, ids), path);
  const ckpt::TrainerRecord& tr = file.trainer;
  if (tr.micro >= options_.accumulate)
    throw r.corrupt(fmt::format("{} micro-batches done of {}", tr.micro, options_.accumulate));
  if (!std::isfinite(tr.lr) || tr.lr < 0) throw r.corrupt(fmt::format("the learning rate is {}", tr.lr));
  if (phases_ ? tr.gains.size() != 2 * compiled_->weights.size() : !tr.gains.empty()) {
    throw r.corrupt(
        fmt::format("{} predictor gains for {} weights (two each)", tr.gains.size(), compiled_->weights.size()));
  }
  if (file.phases.has_value() != (phases_ != nullptr))
    throw r.corrupt("the phase section disagrees with the fingerprint");
  LossScaler scaler = scaler_;
  std::optional<PhaseController> controller;
  try {
    scaler.restore(tr.loss_scale, tr.clean_steps, tr.overflows);
    if (phases_) {
      controller.emplace(*phases_);
      controller->restore(*file.phases);
    }
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(
        fmt::format("checkpoint '{}' does not fit this trainer's settings: {}; the trainer was not changed: use the "
                    "--loss-scale-interval and phase settings it was written with",
                    path.string(), e.what()));
  }

  // Pass 2: the tensors, one at a time, each checked again against pass 1's checksum (the file
  // stays open, so a checkpoint renamed over it meanwhile is not mixed in).
  std::vector<std::byte> buf;
  const auto read_payload = [&](const ckpt::Section& sec, const Fingerprint::Tensor& ft) {
    const auto v = ckpt::read_tensor(r, sec, ft.name.size(), buf);
    if (!v) {
      inconsistent_ =
          fmt::format("the load of checkpoint '{}' stopped part-way (tensor '{}' changed while it was read)",
                      path.string(), ft.name);
      throw std::runtime_error(fmt::format(
          "checkpoint '{}' changed while it was loaded (tensor '{}' no longer matches its checksum): the trainer's "
          "tensors are now partly loaded; load a checkpoint again before training",
          path.string(), ft.name));
    }
    return *v;
  };
  std::vector<std::vector<std::byte>> restore_point(file.restores.size());
  for (std::size_t i = 0; i < file.restores.size(); ++i) {
    const auto v = read_payload(file.restores[i], file.fingerprint.tensors[i]);
    restore_point[i].assign(v.begin(), v.end());
  }
  auto& arena = *compiled_->train->persistent();
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const auto v = read_payload(file.tensors[i], file.fingerprint.tensors[i]);
    arena.write(t.home[ids[i]], t.placement[ids[i]], v.data(), v.size());
  }
  steps_ = tr.steps;
  micro_ = tr.micro;
  lr_ = tr.lr;
  for (std::size_t i = 0; i < phase_count; ++i) {
    phase_ms_[i] = tr.phase_ms[i];
    phase_steps_[i] = tr.phase_steps[i];
  }
  scaler_ = scaler;
  if (controller) *phases_ = std::move(*controller);
  gains_ = tr.gains;
  in_predict_run_ = tr.in_predict_run;
  restore_point_ = std::move(restore_point);
  inconsistent_.clear();  // every tensor now holds the checkpoint's value
  return std::move(file.caller);
}

}  // namespace ferry
