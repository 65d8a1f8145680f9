// Trainer::save_checkpoint / load_checkpoint (ferry/runtime/checkpoint.hpp, docs/checkpoints.md):
// what a trainer keeps in a checkpoint and how it is put back. The file format itself, its atomic
// writer and its verifying reader are in runtime/checkpoint_format.cpp.
#include "ferry/runtime/checkpoint.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "checkpoint_format.hpp"
#include "checkpoint_shards.hpp"
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

// The first setting both lists hold with another value, for `mismatch` to throw. A setting on one
// side only belongs to an option already compared (an optimizer kind, hybrid phases).
// With `accept_other` only the settings the stored bytes depend on (TrainingSetting::stored).
template <class Mismatch>
void compare_settings(const std::vector<TrainingSetting>& file, const std::vector<TrainingSetting>& here,
                      bool accept_other, const Mismatch& mismatch) {
  for (const TrainingSetting& h : here) {
    if (accept_other && !h.stored) continue;
    const auto f = std::find_if(file.begin(), file.end(), [&](const TrainingSetting& s) { return s.name == h.name; });
    if (f == file.end() || f->value == h.value) continue;
    // A flag that was off reads "without --flag", and is left out rather than given.
    const auto off = [&](const std::string& v) { return v == "false" && !h.flag.empty(); };
    throw mismatch(fmt::format("it was trained {}{}, this trainer {}{}", off(f->value) ? "" : "with ",
                               setting_text(h, f->value), off(h.value) ? "runs " : "has ", setting_text(h, h.value)),
                   fmt::format("{}{}", off(f->value) ? "leave out " + h.flag : "use " + setting_text(h, f->value),
                               // A stored setting shapes the file's bytes: no option loads it otherwise.
                               h.stored ? ""
                                        : " (a program may load it with LoadOptions::accept_other_settings to train "
                                          "on with its own)"));
  }
}

// Whether `file` holds less optimizer state than `here` of the same weights: every other tensor
// alike, and a state tensor smaller than this trainer's, or fewer of them, as one rank's file of a
// ZeRO stage 1 or 2 checkpoint does (the other ranks hold the rest). A file of other weights
// (another width of a model whose name does not say it) is not a share. `states`: this trainer's
// optimizer-state names.
bool zero_share(const Fingerprint& file, const Fingerprint& here, const std::set<std::string, std::less<>>& states) {
  std::map<std::string_view, std::uint64_t> mine;
  std::map<std::string_view, const Fingerprint::Tensor*> others;
  for (const auto& t : here.tensors) {
    if (states.contains(t.name)) {
      mine[t.name] = t.bytes;
    } else {
      others[t.name] = &t;
    }
  }
  for (const auto& t : file.tensors) {
    const auto it = others.find(t.name);
    if (it == others.end()) continue;
    if (t.dtype != it->second->dtype || !(t.shape == it->second->shape) || t.bytes != it->second->bytes) return false;
  }
  std::size_t there = 0;
  for (const auto& t : file.tensors) {
    const auto it = mine.find(t.name);
    if (it == mine.end()) continue;
    ++there;
    if (t.bytes < it->second) return true;
  }
  return there > 0 && there < mine.size();
}

// What to do where the model differs: a GPT of another vocabulary ("gpt-v114-..." against
// "gpt-v93-...", the same sizes) was trained on another text, which the model's name alone hid.
std::string model_remedy(const std::string& file, const std::string& here) {
  const auto vocabulary = [](const std::string& name) -> std::pair<std::string, std::string> {
    if (!name.starts_with("gpt-v")) return {};
    const std::size_t dash = name.find('-', 5);
    if (dash == std::string::npos) return {};
    return {name.substr(5, dash - 5), name.substr(dash)};
  };
  const auto [file_vocab, file_sizes] = vocabulary(file);
  const auto [here_vocab, here_sizes] = vocabulary(here);
  if (!file_vocab.empty() && !here_vocab.empty() && file_sizes == here_sizes) {
    return fmt::format(
        "its text had {} distinct characters and this one has {}: train on the text it was trained "
        "on (ferry train --text DIR)",
        file_vocab, here_vocab);
  }
  return "load it into the model that wrote it (ferry train: the same --model and sizes; ModelSpec)";
}

// Throws std::invalid_argument naming the first difference between the checkpoint's fingerprint
// and this trainer's; settings only where `check_settings`. `states`: this trainer's optimizer-state
// names (zero_share).
void compare(const Fingerprint& file, const Fingerprint& here, const std::filesystem::path& path, bool check_settings,
             const std::set<std::string, std::less<>>& states = {}) {
  const auto mismatch = [&](const std::string& what, const std::string& todo) {
    return std::invalid_argument(
        fmt::format("checkpoint '{}' was written for another training setup: {}; the trainer was not changed: {}",
                    path.string(), what, todo));
  };
  if (file.model != here.model) {
    throw mismatch(fmt::format("its model is '{}', this trainer's is '{}'", file.model, here.model),
                   model_remedy(file.model, here.model));
  }
  if (file.optimizer != here.optimizer) {
    throw mismatch(fmt::format("its optimizer is {}, this trainer's is {}", file.optimizer, here.optimizer),
                   fmt::format("use optimizer {} (ferry train --optimizer {}; OptimizerConfig::kind)", file.optimizer,
                               file.optimizer));
  }
  if (file.batch != here.batch) {
    throw mismatch(
        fmt::format("its batch is {}, this trainer's is {}", file.batch, here.batch),
        fmt::format("use a batch of {} (ferry train --batch {}; TrainerOptions::batch)", file.batch, file.batch));
  }
  if (file.accumulate != here.accumulate) {
    throw mismatch(
        fmt::format("it accumulates {} micro-batch{} per update, this trainer {}", file.accumulate,
                    file.accumulate == 1 ? "" : "es", here.accumulate),
        fmt::format("use {} micro-batch{} per update (ferry train --accumulate {}; TrainerOptions::accumulate)",
                    file.accumulate, file.accumulate == 1 ? "" : "es", file.accumulate));
  }
  if (file.precision != here.precision || file.scaled != here.scaled) {
    // In --precision's own words (fp32, not the dtype's f32).
    const auto precision = [](const Fingerprint& f) { return precision_name(static_cast<ops::DType>(f.precision)); };
    const auto name = [&](const Fingerprint& f) {
      // (Said either way where the precision could scale: "fp16" alone would read as the same.)
      const bool could_scale = static_cast<ops::DType>(f.precision) != ops::DType::f32;
      return fmt::format("{}{}", precision(f),
                         f.scaled      ? " with loss scaling"
                         : could_scale ? " without loss scaling"
                                       : "");
    };
    throw mismatch(
        fmt::format("its precision is {}, this trainer's is {}", name(file), name(here)),
        fmt::format("use precision {} with loss scaling {} (ferry train --precision {} --loss-scaling {}; "
                    "TrainerOptions::precision)",
                    precision(file), file.scaled ? "on" : "off", precision(file), file.scaled ? "on" : "off"));
  }
  if (file.hybrid != here.hybrid) {
    throw mismatch(
        fmt::format("its phases are {}, this trainer's are {}", phases_name(file.hybrid), phases_name(here.hybrid)),
        fmt::format("use {} phases (ferry train --phases {}; PhaseConfig::hybrid)", phases_name(file.hybrid),
                    phases_name(file.hybrid)));
  }
  if (file.settings && here.settings) compare_settings(*file.settings, *here.settings, !check_settings, mismatch);
  // SGD keeps a velocity tensor only with momentum (without, the gradient buffer holds it): a
  // velocity on one side only says which option differs, wherever in the list it shows.
  const auto velocity = [](const Fingerprint::Tensor* t) { return t && t->name.ends_with(".momentum"); };
  for (std::size_t i = 0; i < std::max(file.tensors.size(), here.tensors.size()); ++i) {
    const Fingerprint::Tensor* a = i < file.tensors.size() ? &file.tensors[i] : nullptr;
    const Fingerprint::Tensor* b = i < here.tensors.size() ? &here.tensors[i] : nullptr;
    if (a && b && a->name == b->name && a->dtype == b->dtype && a->shape == b->shape && a->bytes == b->bytes) continue;
    const std::string what = !a   ? fmt::format("it has no tensor {}", tensor_text(*b))
                             : !b ? fmt::format("this trainer has no tensor {}", tensor_text(*a))
                                  : fmt::format("its tensor {} is {} here", tensor_text(*a), tensor_text(*b));
    if (velocity(a) != velocity(b)) {
      throw mismatch(fmt::format("{} (it was written by SGD {} momentum)", what, velocity(a) ? "with" : "without"),
                     "use the SGD momentum it was written with (--momentum; OptimizerConfig::sgd)");
    }
    // The 8-bit state's scales, one pair per block: the same weights, another block size.
    if (a && b && a->name == b->name && a->name.ends_with(".adam8_scales") && a->shape.rank == 2 &&
        b->shape.rank == 2 && a->shape[1] != b->shape[1]) {
      throw mismatch(fmt::format("{}: its 8-bit optimizer state has {} blocks of that weight, this trainer's {} "
                                 "(another block size)",
                                 what, a->shape[1], b->shape[1]),
                     "use the block size it was written with (--optimizer-block; OptimizerConfig::block8bit)");
    }
    if (zero_share(file, here, states)) {
      throw mismatch(fmt::format("{}: it holds a share of the optimizer state, as one rank's file of a checkpoint "
                                 "written by several ranks at ZeRO stage 1 or 2 does",
                                 what),
                     "load every rank's file of it together (ferry train --resume FILE reads FILE.rank1, "
                     "FILE.rank2, ... beside it: restore any that is missing; Trainer::load_resharded_checkpoint)");
    }
    throw mismatch(what, "load it into the model that wrote it (the same sizes and options)");
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
  fp.settings.emplace();
  for (TrainingSetting& s : training_settings(model, options)) {
    if (s.resume) fp.settings->push_back(std::move(s));
  }
  return fp;
}

// Files to cut anew (Trainer::load_resharded_checkpoint): each fits this trainer but for its
// tensors' shapes, which differ with the cut; they are of one step (and micro-batch).
void check_shards(std::span<const std::filesystem::path> paths, std::span<const ckpt::Contents> contents,
                  const Fingerprint& here, bool check_settings) {
  const std::filesystem::path& path = paths[0];
  const ckpt::Contents& file = contents[0];
  Fingerprint setup = here;
  setup.tensors.clear();
  for (std::size_t f = 0; f < paths.size(); ++f) {
    Fingerprint theirs = contents[f].fingerprint;
    theirs.tensors.clear();
    compare(theirs, setup, paths[f], check_settings);
    const ckpt::TrainerRecord& a = contents[f].trainer;
    if (a.steps != file.trainer.steps || a.micro != file.trainer.micro) {
      throw std::invalid_argument(fmt::format(
          "the files of checkpoint '{}' are of different steps: '{}' after {} updates, '{}' after {}: a run stopped "
          "while its ranks were writing, or a file left from another run; the trainer was not changed: resume from "
          "files its ranks wrote together",
          path.string(), path.string(), file.trainer.steps, paths[f].string(), a.steps));
    }
  }
}

// Refuses a value that is not a finite number where training cannot have put one
// (ckpt::load_refuses). Files are compared first, so a name found is this trainer's tensor of that
// role; names it lacks are not loaded.
void refuse_non_finite(const std::filesystem::path& path, const ckpt::Contents& file, const graph::TensorTable& t,
                       const std::vector<TensorId>& ids) {
  for (const ckpt::Contents::NonFinite& bad : file.non_finite) {
    const std::string& name = file.fingerprint.tensors[bad.tensor].name;
    const auto id = std::find_if(ids.begin(), ids.end(), [&](TensorId i) { return t.name[i] == name; });
    if (id == ids.end() || !ckpt::load_refuses(t.role[*id], bad)) continue;
    throw std::invalid_argument(fmt::format(
        "checkpoint '{}' holds a value that is not a finite number: element {} of {} '{}' is {}; the trainer was not "
        "changed: the run that wrote it had diverged before it saved; resume from an earlier checkpoint, and train on "
        "with a lower learning rate",
        path.string(), bad.element, ckpt::role_text(t.role[*id], bad), name, bad.value_text()));
  }
}

}  // namespace

std::uint32_t Trainer::global_batch() const noexcept {
  return world_size() > 1 ? options_.data_parallel.global_batch : options_.batch;
}

double Trainer::batch_share() const noexcept {
  return static_cast<double>(options_.batch) / global_batch();
}

std::map<TensorId, std::vector<std::byte>> Trainer::group_sums_over_ranks(bool keep) const {
  std::map<TensorId, std::vector<std::byte>> out;
  if (world_size() == 1 || compiled_->train_key.zero_stage != 0 || micro_ == 0) return out;
  const auto& t = compiled_->train->graph().tensors;
  const auto& arena = *compiled_->train->persistent();
  std::vector<float> values;  // f32 sums (the accumulation pass's)
  std::vector<double> weighted;
  for (const TensorId id : checkpoint_tensors()) {
    if (t.role[id] != graph::Role::gradient_sum) continue;
    values.resize(t.bytes(id) / sizeof(float));
    arena.read(t.home[id], t.placement[id], values.data(), t.bytes(id));
    weighted.assign(values.begin(), values.end());
    for (double& v : weighted) v *= batch_share();
    control_->allreduce_sum(weighted);
    if (!keep) continue;
    std::vector<std::byte>& bytes = out[id];
    bytes.resize(t.bytes(id));
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(weighted[i]);
    std::memcpy(bytes.data(), values.data(), bytes.size());
  }
  return out;
}

ckpt::TrainerRecord Trainer::checkpoint_record() const {
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
  return tr;
}

std::uint64_t Trainer::checkpoint_bytes() const {
  const auto ids = checkpoint_tensors();
  std::optional<PhaseController::State> phases;
  if (phases_) phases = phases_->state();
  // A Predict run's checkpoint holds the weights before it too: they are the first tensors.
  const std::size_t restored = phases_ ? compiled_->weights.size() : 0;
  return ckpt::checkpoint_file_bytes(
      fingerprint_of(model_, options_, phases_ != nullptr, compiled_->train->graph().tensors, ids), checkpoint_record(),
      phases, 0, restored);
}

void Trainer::contribute_to_checkpoint() const {
  const OneThreadAtATime::Call call(one_thread_, "Trainer::contribute_to_checkpoint");
  require_settled("contribute to a checkpoint");
  refuse_if_inconsistent("contribute to a checkpoint");
  group_sums_over_ranks(false);
}

void Trainer::save_checkpoint(const std::filesystem::path& path, std::span<const std::byte> caller,
                              WriteOptions options) const {
  write_checkpoint_file(path, caller, options, true);
}

void Trainer::write_checkpoint_file(const std::filesystem::path& path, std::span<const std::byte> caller,
                                    WriteOptions options, bool lock) const {
  const OneThreadAtATime::Call call(one_thread_, "Trainer::save_checkpoint");
  require_settled("save a checkpoint");
  refuse_if_inconsistent("save a checkpoint");
  const auto& t = compiled_->train->graph().tensors;
  const auto ids = checkpoint_tensors();
  const auto& arena = *compiled_->train->persistent();
  // Every collective first: a write that fails part-way leaves no rank waiting in one.
  const std::map<TensorId, std::vector<std::byte>> group_sums = group_sums_over_ranks(true);

  std::optional<PhaseController::State> phases;
  if (phases_) phases = phases_->state();
  // At ZeRO stages 1 and 2 a checkpoint is one file per rank: none replaces its rank's earlier file
  // before every rank has written its own, so a failed write (or a stop while one rank still
  // evaluates) never leaves files of two steps behind.
  std::function<bool(bool)> agree;
  if (world_size() > 1 && compiled_->train_key.zero_stage != 0) {
    agree = [this](bool written) {
      const std::vector<std::uint64_t> all = control_->allgather(std::uint64_t{written});
      return std::all_of(all.begin(), all.end(), [](std::uint64_t w) { return w != 0; });
    };
  }

  ckpt::write_checkpoint(
      path, fingerprint_of(model_, options_, phases_ != nullptr, t, ids), checkpoint_record(), phases, caller,
      [&](std::size_t i, std::vector<std::byte>& buf) {
        if (const auto sum = group_sums.find(ids[i]); sum != group_sums.end()) {
          std::memcpy(buf.data(), sum->second.data(), buf.size());
        } else {
          arena.read(t.home[ids[i]], t.placement[ids[i]], buf.data(), buf.size());
        }
      },
      in_predict_run_ ? std::span<const std::vector<std::byte>>(restore_point_)
                      : std::span<const std::vector<std::byte>>(),
      options.replace_foreign_file, agree, lock);
}

std::vector<std::byte> Trainer::load_checkpoint(const std::filesystem::path& path, LoadOptions options) {
  const OneThreadAtATime::Call call(one_thread_, "Trainer::load_checkpoint");
  return load_checkpoint_files(std::span(&path, 1), false, options);
}

std::vector<std::byte> Trainer::load_resharded_checkpoint(std::span<const std::filesystem::path> files,
                                                          LoadOptions options) {
  if (files.empty()) throw std::invalid_argument("load_resharded_checkpoint: no checkpoint files given");
  // File r is rank r's share: one file twice would load one rank's share as another's.
  for (std::size_t i = 0; i < files.size(); ++i) {
    for (std::size_t j = 0; j < i; ++j) {
      std::error_code ec;
      if (files[i] == files[j] || std::filesystem::equivalent(files[i], files[j], ec)) {
        throw std::invalid_argument(fmt::format(
            "load_resharded_checkpoint: files {} and {} ('{}', '{}') are one file; the trainer was not changed: give "
            "each rank's file once, rank 0's first",
            j, i, files[j].string(), files[i].string()));
      }
    }
  }
  return load_checkpoint_files(files, true, options);
}

namespace {

// The trainer's record of a checkpoint against this trainer: counts in range, a usable rate, and
// the predictor's gains and phase section exactly where hybrid phases are on.
void check_trainer_record(const ckpt::Reader& r, const ckpt::Contents& file, std::uint32_t accumulate, bool phases,
                          std::size_t weights) {
  const ckpt::TrainerRecord& tr = file.trainer;
  if (tr.micro >= accumulate) throw r.corrupt(fmt::format("{} micro-batches done of {}", tr.micro, accumulate));
  if (!std::isfinite(tr.lr) || tr.lr < 0) throw r.corrupt(fmt::format("the learning rate is {}", tr.lr));
  if (phases ? tr.gains.size() != 2 * weights : !tr.gains.empty()) {
    throw r.corrupt(fmt::format("{} predictor gains for {} weights (two each)", tr.gains.size(), weights));
  }
  if (file.phases.has_value() != phases) throw r.corrupt("the phase section disagrees with the fingerprint");
}

}  // namespace

std::vector<std::byte> Trainer::load_checkpoint_files(std::span<const std::filesystem::path> paths, bool reshard,
                                                      LoadOptions options) {
  settle_all();
  // Pass 1: every section of every file read and verified, everything but the tensors decoded. A
  // damaged file is reported as damaged before it is compared: not as another model's.
  std::vector<std::unique_ptr<ckpt::Reader>> readers;
  std::vector<ckpt::Contents> contents;
  for (const auto& p : paths) {
    readers.push_back(std::make_unique<ckpt::Reader>(p));
    contents.push_back(ckpt::read_contents(*readers.back()));
  }
  const std::filesystem::path& path = paths[0];
  const ckpt::Reader& r = *readers[0];
  ckpt::Contents& file = contents[0];
  const auto& t = compiled_->train->graph().tensors;
  const auto ids = checkpoint_tensors();

  // The files are whole: now do they fit this trainer?
  const Fingerprint here = fingerprint_of(model_, options_, phases_ != nullptr, t, ids);
  std::optional<detail::ReshardedState> resharded;
  if (reshard) {
    check_shards(paths, contents, here, !options.accept_other_settings);
    resharded.emplace(compiled_->train->graph(), compiled_->train_key, options_.optimizer, global_batch(), paths,
                      contents);
  } else {
    std::set<std::string, std::less<>> states;
    for (const TensorId id : ids) {
      if (t.role[id] == graph::Role::optimizer_state) states.insert(t.name[id]);
    }
    compare(file.fingerprint, here, path, !options.accept_other_settings, states);
  }
  for (std::size_t f = 0; f < paths.size(); ++f) refuse_non_finite(paths[f], contents[f], t, ids);
  const ckpt::TrainerRecord& tr = file.trainer;
  check_trainer_record(r, file, options_.accumulate, phases_ != nullptr, compiled_->weights.size());
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
  // Tensor `ft` of file `f` from its section `sec`.
  const auto read_payload = [&](std::size_t f, const ckpt::Section& sec, const Fingerprint::Tensor& ft) {
    const auto v = ckpt::read_tensor(*readers[f], sec, ft.name.size(), buf);
    if (!v) {
      const std::string which =
          f == 0 ? fmt::format("tensor '{}'", ft.name) : fmt::format("tensor '{}' of '{}'", ft.name, paths[f].string());
      inconsistent_ = fmt::format("the load of checkpoint '{}' stopped part-way ({} changed while it was read)",
                                  path.string(), which);
      throw std::runtime_error(fmt::format(
          "checkpoint '{}' changed while it was loaded ({} no longer matches its checksum): the trainer's tensors are "
          "now partly loaded; load a checkpoint again before training",
          path.string(), which));
    }
    return *v;
  };
  std::vector<std::vector<std::byte>> restore_point(file.restores.size());
  for (std::size_t i = 0; i < file.restores.size(); ++i) {
    const auto v = read_payload(0, file.restores[i], file.fingerprint.tensors[i]);
    restore_point[i].assign(v.begin(), v.end());
  }
  auto& arena = *compiled_->train->persistent();
  // Every tensor is written below: an update still pending (host updates deferred into the next
  // step) no longer applies, and one that failed part-way is overwritten.
  compiled_->train->discard_deferred_updates();
  // Gradient sums come as the group's (detail::group_sums_for_rank), but from this rank's own file
  // of a ZeRO checkpoint cut as this trainer cuts, which holds its own sums.
  const bool group_sums = resharded || compiled_->train_key.zero_stage == 0 || world_size() == 1;
  std::vector<std::byte> sums;
  for (std::size_t k = 0; k < ids.size(); ++k) {
    std::vector<std::byte> v;
    std::span<const std::byte> value;
    if (resharded) {
      // Put together from the files' shares, one tensor at a time as a plain load.
      v = resharded->value(ids[k], [&](std::size_t f, std::size_t i) {
        return read_payload(f, contents[f].tensors[i], contents[f].fingerprint.tensors[i]);
      });
      value = v;
    } else {
      value = read_payload(0, file.tensors[k], file.fingerprint.tensors[k]);
    }
    if (group_sums && t.role[ids[k]] == graph::Role::gradient_sum) {
      sums.assign(value.begin(), value.end());
      detail::group_sums_for_rank(sums, rank(), batch_share());
      value = sums;
    }
    arena.write(t.home[ids[k]], t.placement[ids[k]], value.data(), value.size());
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
