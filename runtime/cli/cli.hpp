// Pieces the `ferry` subcommands share: the train arguments, trainer options from them, and a
// progress line.
#pragma once

#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ferry/ferry.hpp"
#include "validators.hpp"

namespace ferry::cli {

// The versions of the JSON lines' layouts (docs/outputs.md): each line carries its own as
// "schema"; a field removed or changed in meaning raises it, a field added does not.
inline constexpr int train_json_schema = 1;  // ferry train (every model)
inline constexpr int plan_json_schema = 1;   // ferry plan

// A float as the double of its shortest decimal, so JSON shows what was given (0.001, not
// 0.0010000000474974513).
inline double shortest(float f) {
  return std::strtod(fmt::format("{}", f).c_str(), nullptr);
}

// The CLI's names of homes: device, host (pinned, streamed), mapped, compressed, int8, dropped.
ferry::graph::Home cli_home(const std::string& s);

struct TrainArgs {
  std::string model = "mlp";
  std::uint32_t epochs = 10, batch = 0;    // batch 0: the model's default
  std::uint32_t width = 0, depth = 0;      // 0: the model's default (deep: 1024 x 16; gpt: 192 x 4)
  std::uint32_t heads = 4, context = 128;  // gpt
  std::uint32_t steps = 0;                 // gpt: training steps, a batch each (0: the default)
  double max_minutes = 0;                  // gpt: stop training after this long (0: no limit)
  std::uint32_t eval_every = 0;            // gpt: steps between validation reports (0: the default)
  std::uint32_t val_windows = 256;         // gpt: held-out windows each validation report runs over
  std::uint32_t sample = 0;                // gpt: characters to generate after training
  std::string prompt = "\n";               // gpt: text the sample continues
  float temperature = 0.8f, dropout = 0.0f;
  std::string attention = "fused";  // gpt: fused or unfused
  std::string text_dir;             // gpt: folder of text files (default: the fortunes)
  float lr = 1e-3f, weight_decay = 0.0f, momentum = 0.9f;
  bool lr_given = false;           // --lr on the command line (gpt's default peak is 2e-3)
  bool bucket_size_given = false;  // --bucket-size on the command line (one rank: warned, unused)
  std::string optimizer = "adam", schedule = "cosine";
  std::string weight_decay_on = "all";   // all or matrices (OptimizerConfig::decay_on)
  std::uint32_t optimizer_block = 2048;  // adamw8bit: elements per quantization block
  std::string device, data_dir, trace_path, profile_path;
  std::string device_budget, host_budget, residency = "auto", host_memory = "auto";
  std::string staging_chunk;             // --staging-chunk (empty: fetches through unpack nodes)
  ferry::PlanRates plan_rates;           // plan: the rates of the step-time prediction given (0: measure it)
  std::string weights_home, state_home;  // empty: the residency mode's preset
  std::string compress_chunk = "1MiB";   // the compressed home's codec
  int compress_level = 1;
  unsigned compress_workers = 0;
  std::uint32_t lookahead = 2;
  std::uint32_t transfer_slack = 4;
  // --host-optimizer (on the host) and --no-host-optimizer (on the device); neither: chosen by the plan
  // (TrainerOptions::host_optimizer_auto).
  bool host_optimizer = false, no_host_optimizer = false;
  bool overlap_host_updates = false;  // ResidencyOptions::overlap_host_updates
  std::uint64_t seed = 1;
  std::size_t train_limit = 0;
  std::uint32_t trace_steps = 4;
  std::uint32_t check_weights_every = 0;  // TrainerOptions::check_weights_every
  bool json = false, quiet = false;
  // Hybrid phases (ferry/runtime/phases.hpp): the defaults are PhaseConfig's.
  std::string phases = "full", predictor = "linear";
  std::uint32_t accumulate = 1;    // micro-batches per optimizer update
  std::string recompute = "auto";  // layers per recomputed segment (0: none; auto: what the budget needs)
  bool no_fuse = false;            // TrainerOptions::fuse off
  std::string precision = "fp32";  // fp32, fp16 or bf16 (mixed precision)
  std::string loss_scaling = "auto";
  float initial_loss_scale = 65536.0f;
  std::uint32_t loss_scale_interval = 2000;
  bool eval_int8 = false;  // also evaluate the final model with int8 weights
  std::string profile_phases_path;
  ferry::PhaseConfig phase_config;
  // Checkpoints (docs/checkpoints.md): written after every epoch and on SIGINT/SIGTERM/SIGHUP; resumed from.
  std::string checkpoint_path, resume_path;
  std::vector<std::string> argv;  // the command line, for the resume command printed on a signal
  bool force = false;             // outputs may replace files ferry did not write
  // Data parallel (`mpirun -np N ferry train ...`; docs/distributed.md, runtime/cli/ranks.cpp).
  int zero = 0;                       // ZeRO stage
  int plan_ranks = 1;                 // ferry plan --ranks: rank 0 of this many
  std::string bucket_size = "25MiB";  // gradient bytes reduced together
  double rank_timeout_minutes = 30;   // data parallel: no progress this long ends every rank (0: never)
  std::shared_ptr<ferry::ops::Communicator> world, control;  // null: one rank
  bool primary = true;                                       // rank 0: progress, JSON, checkpoints, traces, profiles
  bool sharded_checkpoint = false;  // ZeRO stage 1 over several ranks: each rank writes its own file
  // --resume of a checkpoint cut for other ranks or another ZeRO stage: all its files, which every
  // rank reads (Trainer::load_resharded_checkpoint); empty: each rank loads resume_path as it is.
  std::vector<std::string> resume_files;
};

// Before any work (data, compile; runtime/cli/outputs.cpp): every output (--checkpoint, --trace,
// --profile, --profile-phases) is a new file in a folder that takes one, or an existing regular,
// writable file ferry wrote of that kind (any file with --force); never a device node, folder or
// symbolic link, never one of the run's inputs (--resume unless it is the checkpoint, the data
// set's files, the text folder), never another output's path; --trace-steps is at least 1. Throws
// std::invalid_argument naming the flag, the path and why; writes nothing (a probe file is removed).
void check_outputs(const TrainArgs& a);
// The first `n` bytes of a file (fewer if it is shorter; none if it cannot be read).
std::string head_of(const std::filesystem::path& p, std::size_t n);
// Before any work: a split's images have the size `model` takes and its labels lie in its
// classes. Throws std::invalid_argument naming the split, the folder and both sizes.
void check_split(const ferry::ModelSpec& model, const ferry::Dataset& data, const char* split,
                 const std::filesystem::path& folder);

// The optimizer, learning rate, seed and residency options of `a` into `opt` (batch aside).
// Throws std::invalid_argument for an unknown optimizer or home.
void configure_trainer(const TrainArgs& a, ferry::TrainerOptions& opt);
// A size option's value (ferry::parse_bytes), an error naming `flag` when it is not one.
std::uint64_t size_option(const char* flag, const std::string& text);
// The sizes --staging-chunk takes, "4.0 KiB to 256.0 MiB" (ResidencyOptions' limits), for its help and its error.
std::string staging_chunk_range();

// Before a large model is allocated: what the plan says it will take (device peak, pinned host
// bytes, recomputation), on stderr unless --quiet, so a long set-up says what it is doing. Plans
// only (milliseconds), also when quiet; errors are left to the Trainer, which plans the same way. The
// recomputation it chose (--recompute auto) goes into `opt` on every rank, so the Trainer does not
// search for it again and every rank of a data-parallel run states it to the ranks' agreement
// check; the optimizer's place (TrainerOptions::host_optimizer_auto) as choose_optimizer_place says.
void announce_setup(const TrainArgs& a, ferry::Runtime& runtime, const ferry::ModelSpec& model,
                    ferry::TrainerOptions& opt);
// TrainerOptions::host_optimizer_auto's choice, with the line saying where the optimizer runs and why
// unless quiet, made concrete in `opt` (but for data-parallel runs, whose Trainer chooses on every
// rank and checks that the ranks chose alike); nothing when the plan fails (the Trainer reports it).
void choose_optimizer_place(const TrainArgs& a, ferry::Runtime& runtime, const ferry::ModelSpec& model,
                            ferry::TrainerOptions& opt);
// A --recompute N given (not auto) runs each segment's forward again in the backward; where the
// step's device peak without it is no higher, that costs compute and buys nothing. Then a note
// saying so, with both peaks and the flops it adds ("" otherwise, or when either plan fails).
std::string recompute_cost_note(ferry::Runtime& runtime, const ferry::ModelSpec& model,
                                const ferry::TrainerOptions& opt);

// "fp32" / "fp16" / "bf16" (also "f32", "f16") and back; throws std::invalid_argument naming the
// choices.
ferry::ops::DType parse_precision(const std::string& s);
// --loss-scaling on, off or auto (CLI11 checks the word).
ferry::PrecisionConfig::Scaling parse_loss_scaling(const std::string& s);

// Batches that train well and fit the models' usual budgets (deep: 64 MiB): mlp 256, cnn 128,
// gpt 32, deep 64.
std::uint32_t default_batch(const std::string& model);
// The Fashion-MNIST models (mlp, cnn, deep) as `a` sizes them; throws std::invalid_argument for
// another name.
ferry::ModelSpec make_model(const TrainArgs& a);

// The JSON fields of phases, accumulation, recomputation and precision (docs/phases.md) into `j`.
void add_phase_fields(nlohmann::json& j, const ferry::Trainer& trainer);

// At the end of a run of `steps_run` steps: a warning (even with --quiet) where most of them
// overflowed under loss scaling and updated nothing (such a run ends with exit 0 and a model that
// barely trained), then write_trace and write_memory_profiles (declared below).
void write_run_outputs(const TrainArgs& a, const ferry::Trainer& trainer, const ferry::ChromeTrace& trace,
                       ferry::MemoryProfiler& profiler, std::uint64_t steps_run, std::vector<std::string>& errors);

// Writes the steps traced so far to --trace (when given): a failure is said (unless --quiet) and
// added to `errors`, and training's results stand.
void write_trace(const TrainArgs& a, const ferry::ChromeTrace& trace, std::vector<std::string>& errors);

// Adds every compiled variant to `profiler`, writes --profile and --profile-phases (when given)
// and shows the summary (unless --quiet): a failed write is said and added to `errors`.
void write_memory_profiles(const TrainArgs& a, const ferry::Trainer& trainer, ferry::MemoryProfiler& profiler,
                           std::vector<std::string>& errors);

// The fields of the `--json` line every `ferry train` prints (docs/outputs.md): the run's setting,
// its device, the sizes of its state and memory, data parallelism, and the phase fields. Each
// command adds its results (losses, rates, timings) and its model's own fields.
nlohmann::json common_train_summary(const TrainArgs& a, ferry::Runtime& runtime, const ferry::Trainer& trainer,
                                    std::uint32_t batch, const std::vector<std::string>& output_errors);

// The device memory the driver counted in use (ferry::Runtime::driver_memory) beside the plan's
// peak. The fields of the `--json` line: driver_memory_source, driver_memory_unavailable,
// driver_device_used_before_bytes, driver_device_used_after_context_bytes,
// driver_device_used_peak_bytes, driver_device_bytes_beyond_plan (docs/outputs.md).
void add_driver_memory_fields(nlohmann::json& j, const ferry::Trainer& trainer);
// After a run (write_memory_profiles calls it): a line saying the driver's count (unless quiet,
// and only where there is one), and a warning (even when quiet) where the driver counted more
// than the plan's peak and the context together explain.
void report_driver_memory(const TrainArgs& a, const ferry::Trainer& trainer);
// For the residency line: where the trainer took its budget from what the driver counts free
// (Trainer::budget_from_free_memory), "; ..." saying so; else "".
std::string budget_from_free_memory_note(const ferry::Trainer& trainer);
// Where FERRY_NVML_LIBRARY or FERRY_NVML_GPU is set and `source` reads nothing: a warning line
// naming them and the reason; else "".
std::string unread_driver_memory_warning(const ferry::cl::DriverMemory& source);

// `ferry train`'s exit status when training finished and its results were printed, but a side
// output it was asked for (trace, profile) could not be written: scripts see the loss, a person
// reads the warning.
inline constexpr int exit_side_output_failed = 3;

// The exit status of a finished `ferry train` run: 0, or exit_side_output_failed.
inline int train_exit_status(const std::vector<std::string>& output_errors) {
  return output_errors.empty() ? 0 : exit_side_output_failed;
}

// Writes a side output (trace, profile) with `write`; a failure is a warning naming the file and
// the OS's reason, added to `errors` (the JSON line's output_errors), never the end of the run:
// the results are printed after it all the same. Returns whether it was written.
template <class Write>
bool write_side_output(const std::string& path, const char* what, bool quiet, std::vector<std::string>& errors,
                       Write&& write) {
  try {
    write();
    if (!quiet) std::cerr << fmt::format("ferry: wrote {} to {}\n", what, path);
    return true;
  } catch (const std::exception& e) {
    std::cerr << fmt::format("ferry: warning: {} (the results below are unaffected)\n", e.what());
    errors.push_back(e.what());
    return false;
  }
}

// `ferry plan` (runtime/cli/plan.cpp).
int cmd_plan(const TrainArgs& a);
// `ferry plan`'s flags for the rates of its step-time prediction (--link-gbps, ...).
void add_rate_options(CLI::App* plan, TrainArgs& t);

struct TuneArgs {
  std::string device, mode = "quick", family = "all";
  double budget_seconds = 60;
  bool json = false, quiet = false;
  bool force = false;  // save over cached results of searches that measured more candidates
};
// `ferry tune` (runtime/cli/tune.cpp).
int cmd_tune(const TuneArgs& a);

int cmd_train_gpt(const TrainArgs& a);

struct CheckpointArgs {
  std::string path;
  bool json = false;
};
// `ferry checkpoint FILE` (runtime/cli/checkpoint_info.cpp).
int cmd_checkpoint(const CheckpointArgs& a);

// Data-parallel runs (runtime/cli/ranks.cpp). Under mpirun: joins MPI's world (an error in a
// ferry built without MPI) and, on ranks other than 0, turns off every output (progress, JSON,
// trace, profiles; checkpoints are rank 0's). Alone: nothing.
// A checkpoint of a ZeRO stage 1 or 2 run over N ranks is N files (rank r > 0 writes and reads
// "<path>.rank<r>"): --resume of one on another number of ranks or stage, or of a whole-state
// checkpoint at stage 1 or 2 over several ranks, cuts the optimizer state anew (resume_files).
void join_ranks(TrainArgs& a);
// Under mpirun, join_ranks also starts a watch over set-up (MPI's start, the data, compiling the
// step, a resume): not over within --rank-timeout-minutes, it ends every rank with status 124,
// where a rank stopped or hung there had left the others waiting in a collective for ever. It ends
// here, where the training loop, which watches the steps itself, begins.
void end_setup_watch();
// Rank r > 0's file of a checkpoint at `path` written at ZeRO stage 1 or 2.
std::string shard_file(const std::string& path, int rank);
// The path as the user gave it, where `path` is this rank's own file of a ZeRO stage 1 or 2
// checkpoint (shard_file of it on a rank other than 0): what every rank's messages name.
std::string given_file(const TrainArgs& a, const std::string& path);
// --resume: the checkpoint loaded as join_ranks planned; its caller's bytes.
std::vector<std::byte> load_resume(ferry::Trainer& trainer, const TrainArgs& a);
// " (written by N ranks ..., cut anew for ...)" when the resume was resharded, else empty.
std::string resume_note(const TrainArgs& a);
// On rank 0, after each checkpoint written: removes "<checkpoint>.rank<k>" files (ferry
// checkpoints only) beyond this run's ranks, shards of an earlier checkpoint at the same path
// that a resume would otherwise take for part of this one.
void remove_stale_shards(const TrainArgs& a);
// This rank's share of each global batch of `global_batch` samples, with `opt` set to train on
// it (opt.batch its samples, opt.data_parallel the world, --zero and --bucket-size). Alone:
// the whole batch.
ferry::Shard configure_ranks(const TrainArgs& a, std::uint32_t global_batch, ferry::TrainerOptions& opt);
// The banner line of a data-parallel run (nothing alone): ranks, transport, shares, buckets.
void announce_ranks(const TrainArgs& a, const ferry::Trainer& trainer, std::uint32_t global_batch);
// After resuming: every rank's checkpoint (file or share) is at the same step, else an error.
void check_ranks_resumed_together(const TrainArgs& a, bool resumed, std::uint64_t steps_done);
// An error on one rank of a data-parallel run: says which rank and ends every rank (MPI_Abort),
// since the others would wait for it in their next reduction. Alone: returns.
void end_all_ranks_on_error(const TrainArgs& a, const std::exception& e);

// After a training loop stopped by a signal: the steps traced so far and the memory profiles
// written (a failure only said), and on rank 0 where it stopped (`where`), the checkpoint written and the command that
// resumes from it, or that none was written.
void report_stop(const TrainArgs& a, const ferry::LoopSummary& run, const ferry::ChromeTrace& trace,
                 const ferry::Trainer& trainer, ferry::MemoryProfiler& profiler, const std::string& where);

// A command's own section of a checkpoint (the caller section) as CBOR, and back. The reader
// returns the JSON object whose "kind" is `kind`; anything else throws resume_error's
// "it was not written by <kind>".
std::vector<std::byte> caller_section(const nlohmann::json& j);
nlohmann::json read_caller_section(const std::vector<std::byte>& bytes, const TrainArgs& a, const std::string& kind);
// With --accumulate k over a run of `micro_batches` not a multiple of k: a note (rank 0, without
// --quiet) that the last micro-batches make no update, and what to give (`give`) so that k divides.
void note_micro_batches_left_over(const TrainArgs& a, std::uint64_t micro_batches, const std::string& give);
// "cannot resume from '<--resume path>': <what>"
std::invalid_argument resume_error(const TrainArgs& a, const std::string& what);
// Refuses a caller section whose "data_checksum" (the checksum of the training data the run read)
// is not `here`: resumed on other data of the same size, a run would go on silently as another
// run. `give` says what to pass again (e.g. "--data and --train-limit"). Sections written before
// the field existed are taken as they are.
void check_same_data(const nlohmann::json& j, std::uint64_t here, const TrainArgs& a, const std::string& give);

// The command line that continues this run from `checkpoint`: the same arguments, any --resume
// replaced.
std::string resume_command(const TrainArgs& a, const std::string& checkpoint);

// loop.run(). A checkpoint that cannot be written (a full disk) ends the run with an error that
// also says what the file at --checkpoint still holds and the command that goes on from it (or
// from --resume's checkpoint, when this run had written none yet).
ferry::LoopSummary run_loop(ferry::TrainingLoop& loop, const TrainArgs& a);

}  // namespace ferry::cli
