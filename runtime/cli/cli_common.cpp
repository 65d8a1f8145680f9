// Shared pieces of the `ferry` subcommands.
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <stdexcept>

#include "cli.hpp"
#include "ferry/runtime/plan.hpp"
#include "ops/gemm_tune.hpp"
#include "runtime/distributed/data_parallel.hpp"
#include "runtime/trainer_internals.hpp"

namespace ferry::cli {

ferry::graph::Home cli_home(const std::string& s) {
  using ferry::graph::Home;
  // The library's names (host_pinned, ...) are taken too: its messages use them.
  if (s == "device") return Home::device;
  if (s == "host" || s == "host_pinned") return Home::host_pinned;
  if (s == "mapped" || s == "host_mapped") return Home::host_mapped;
  if (s == "compressed" || s == "host_compressed") return Home::host_compressed;
  if (s == "dropped") return Home::dropped;
  throw std::invalid_argument(fmt::format("unknown home '{}': use device, host, mapped, compressed or dropped", s));
}

ferry::PrecisionConfig::Scaling parse_loss_scaling(const std::string& s) {
  using Scaling = ferry::PrecisionConfig::Scaling;
  return s == "on" ? Scaling::on : s == "off" ? Scaling::off : Scaling::automatic;
}

ferry::ops::DType parse_precision(const std::string& s) {
  if (s == "fp32" || s == "f32") return ferry::ops::DType::f32;
  if (s == "fp16" || s == "f16") return ferry::ops::DType::f16;
  if (s == "bf16") return ferry::ops::DType::bf16;
  throw std::invalid_argument(fmt::format("unknown precision '{}': use fp32, fp16 or bf16", s));
}

void check_split(const ferry::ModelSpec& model, const ferry::Dataset& data, const char* split,
                 const std::filesystem::path& folder) {
  if (model.inputs.empty()) return;
  const ferry::TensorSpec& in = model.inputs.front();
  if (data.sample_elems() != in.sample.elems()) {
    throw std::invalid_argument(fmt::format(
        "the {} split in '{}' has {}x{} images ({} values per sample), but model '{}' takes {} values per sample "
        "('{}' of shape {}): give --data a folder whose train and test splits both hold images of that size",
        split, folder.string(), data.rows, data.cols, data.sample_elems(), model.name, in.sample.elems(), in.name,
        in.sample.str()));
  }
  for (const ferry::TensorSpec& target : model.targets) {
    if (target.dtype != ferry::graph::DType::i32 || target.id_limit == 0) continue;
    for (std::size_t i = 0; i < data.count && i < data.labels.size(); ++i) {
      if (data.labels[i] < 0 || static_cast<std::uint32_t>(data.labels[i]) >= target.id_limit) {
        throw std::invalid_argument(fmt::format(
            "the {} split in '{}': label {} of sample {} is outside [0, {}), the classes model '{}' has: fix the data",
            split, folder.string(), data.labels[i], i, target.id_limit, model.name));
      }
    }
  }
}

std::string staging_chunk_range() {
  using ResidencyOptions = ferry::graph::ResidencyOptions;
  return fmt::format("{} to {}", ferry::format_bytes(ResidencyOptions::min_staging_chunk_bytes),
                     ferry::format_bytes(ResidencyOptions::max_staging_chunk_bytes));
}

std::uint64_t size_option(const char* flag, const std::string& text) {
  try {
    return ferry::parse_bytes(text);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(fmt::format("{}: {}", flag, e.what()));
  }
}

void configure_trainer(const TrainArgs& a, ferry::TrainerOptions& opt) {
  opt.lr = a.lr;
  opt.seed = a.seed;
  opt.check_weights_every = a.check_weights_every;
  if (a.optimizer == "adam" || a.optimizer == "adamw") {
    opt.optimizer.kind =
        a.optimizer == "adam" ? ferry::ops::OptimizerConfig::Kind::adam : ferry::ops::OptimizerConfig::Kind::adamw;
    opt.optimizer.adam.weight_decay = a.weight_decay;
  } else if (a.optimizer == "adamw8bit") {
    ferry::ops::check_adam8bit_block(a.optimizer_block);
    opt.optimizer.kind = ferry::ops::OptimizerConfig::Kind::adamw8bit;
    opt.optimizer.adam.weight_decay = a.weight_decay;
    opt.optimizer.block8bit = a.optimizer_block;
  } else if (a.optimizer == "sgd") {
    opt.optimizer.kind = ferry::ops::OptimizerConfig::Kind::sgd;
    opt.optimizer.sgd.momentum = a.momentum;
    opt.optimizer.sgd.weight_decay = a.weight_decay;
  } else {
    throw std::invalid_argument(fmt::format("unknown optimizer '{}': use adam, adamw, adamw8bit or sgd", a.optimizer));
  }
  opt.optimizer.decay_on = a.weight_decay_on == "matrices" ? ferry::ops::OptimizerConfig::DecayOn::matrices
                                                           : ferry::ops::OptimizerConfig::DecayOn::all;
  opt.residency.mode = ferry::graph::parse_residency_mode(a.residency);
  opt.residency.lookahead = a.lookahead;
  opt.residency.transfer_slack = a.transfer_slack;
  opt.residency.host_optimizer = a.host_optimizer;
  opt.host_optimizer_auto = !a.host_optimizer && !a.no_host_optimizer;
  opt.residency.overlap_host_updates = a.overlap_host_updates;
  if (!a.weights_home.empty()) opt.residency.weights_home = cli_home(a.weights_home);
  if (!a.state_home.empty()) opt.residency.state_home = cli_home(a.state_home);
  const auto budget = [](const char* flag, const std::string& text, const char* left_out) {
    return ferry::cli::budget_option(flag, text, ' ', fmt::format("leave {} out to {}", flag, left_out));
  };
  if (!a.device_budget.empty()) {
    opt.residency.budget_bytes = budget("--device-budget", a.device_budget, "use what the device can spare");
  }
  if (!a.host_budget.empty()) {
    opt.residency.host_budget_bytes = budget("--host-budget", a.host_budget, "plan for this machine's memory");
  }
  opt.residency.homes.host_memory = ferry::offload::parse_host_memory(a.host_memory);
  if (!a.staging_chunk.empty()) {
    if (opt.residency.homes.host_memory != ferry::offload::HostMemory::staged) {
      throw std::invalid_argument(
          fmt::format("--staging-chunk {}: chunked fetches are a way of staged host memory; add --host-memory staged",
                      a.staging_chunk));
    }
    opt.residency.staging_chunk_bytes = size_option("--staging-chunk", a.staging_chunk);
    using ResidencyOptions = ferry::graph::ResidencyOptions;
    if (opt.residency.staging_chunk_bytes < ResidencyOptions::min_staging_chunk_bytes ||
        opt.residency.staging_chunk_bytes > ResidencyOptions::max_staging_chunk_bytes) {
      throw std::invalid_argument(fmt::format("--staging-chunk {}: use {} (the ring holds four chunks)",
                                              a.staging_chunk, staging_chunk_range()));
    }
  }
  opt.residency.homes.codec.chunk_bytes = size_option("--compress-chunk", a.compress_chunk);
  if (opt.residency.homes.codec.chunk_bytes < ferry::offload::min_useful_chunk_bytes) {
    throw std::invalid_argument(fmt::format(
        "--compress-chunk {}: chunks below {} hold more than they save (a zstd frame and an allocation each); use {} "
        "or more (default 1MiB)",
        a.compress_chunk, ferry::format_bytes(ferry::offload::min_useful_chunk_bytes),
        ferry::format_bytes(ferry::offload::min_useful_chunk_bytes)));
  }
  opt.residency.homes.codec.level = a.compress_level;
  opt.residency.homes.codec.workers = a.compress_workers;
  ferry::offload::validate(opt.residency.homes.codec);
  opt.accumulate = a.accumulate;
  if (a.recompute == "auto") {
    opt.recompute_auto = true;
  } else {
    std::size_t used = 0;
    unsigned long every = 0;
    try {
      every = std::stoul(a.recompute, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != a.recompute.size() || a.recompute[0] == '-' || every > 1u << 20) {
      throw std::invalid_argument(fmt::format(
          "--recompute '{}': give auto (recompute only what the device budget needs), 0 (off) or the layers per "
          "recomputed segment",
          a.recompute));
    }
    opt.recompute = static_cast<std::uint32_t>(every);
  }
  opt.fuse = !a.no_fuse;
  opt.precision.compute = parse_precision(a.precision);
  opt.precision.scaling = parse_loss_scaling(a.loss_scaling);
  opt.precision.initial_scale = a.initial_loss_scale;
  opt.precision.growth_interval = a.loss_scale_interval;
  ferry::validate(opt.precision);
  opt.phases = a.phase_config;
  opt.phases.hybrid = ferry::parse_phases(a.phases);
  opt.phases.predictor.kind = ferry::ops::parse_predictor(a.predictor);
  ferry::validate(opt.phases);
}

namespace {

// The plan ferry train's Trainer will make, planned here to pin its choices (none when it fails:
// the Trainer reports that, with the same words).
std::optional<ferry::TrainingPlan> plan_ahead(ferry::Runtime& runtime, const ferry::ModelSpec& model,
                                              const ferry::TrainerOptions& opt) {
  try {
    return ferry::plan_training(runtime, model, opt);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// The optimizer's place the plan chose, said unless quiet, and pinned in `opt` so that the Trainer does not plan
// both places again. Not on the ranks of a data-parallel run: there the Trainer chooses on every rank and checks
// that the ranks chose alike (detail::check_ranks_place_optimizer_alike), which names the ranks where the places
// differ (devices of different kinds); pinned, they would differ at the ranks' agreement check as settings given.
void pin_optimizer_place(const TrainArgs& a, const ferry::TrainingPlan& plan, ferry::TrainerOptions& opt) {
  if (!a.quiet && plan.host_optimizer_chosen) std::cerr << "ferry: " << ferry::optimizer_place_reason(plan) << "\n";
  if (ferry::detail::data_parallel(opt)) return;
  opt.residency.host_optimizer = plan.host_optimizer;
  opt.host_optimizer_auto = false;
}

}  // namespace

void announce_setup(const TrainArgs& a, ferry::Runtime& runtime, const ferry::ModelSpec& model,
                    ferry::TrainerOptions& opt) {
  // Quiet runs (every rank but the first) plan too: each rank pins the same recomputation, which the ranks'
  // agreement check then compares.
  const std::optional<ferry::TrainingPlan> plan = plan_ahead(runtime, model, opt);
  if (!plan) return;
  opt.recompute = plan->recompute;
  opt.recompute_auto = false;
  if (!a.quiet) {
    std::cerr << fmt::format(
        "ferry: setting up {}: residency {}, device peak {} (planned), host {} of {} memory ({} weights and state, "
        "{} step buffers){}\n",
        model.name, ferry::graph::residency_mode_name(plan->mode), ferry::format_bytes(plan->device_peak_bytes),
        ferry::format_bytes(plan->host_bytes), ferry::offload::host_memory_name(plan->host_memory),
        ferry::format_bytes(plan->host_store_bytes), ferry::format_bytes(plan->host_step_bytes),
        plan->recompute ? fmt::format(", recomputing segments of {} layers", plan->recompute) : std::string());
  }
  pin_optimizer_place(a, *plan, opt);
}

void choose_optimizer_place(const TrainArgs& a, ferry::Runtime& runtime, const ferry::ModelSpec& model,
                            ferry::TrainerOptions& opt) {
  if (!opt.host_optimizer_auto) return;
  if (const std::optional<ferry::TrainingPlan> plan = plan_ahead(runtime, model, opt))
    pin_optimizer_place(a, *plan, opt);
}

std::string recompute_cost_note(ferry::Runtime& runtime, const ferry::ModelSpec& model,
                                const ferry::TrainerOptions& opt) {
  if (opt.recompute_auto || opt.recompute == 0) return "";
  ferry::TrainerOptions without = opt;
  without.recompute = 0;
  ferry::TrainingPlan with_plan, without_plan;
  try {
    with_plan = ferry::plan_training(runtime, model, opt);
    without_plan = ferry::plan_training(runtime, model, without);
  } catch (const std::exception&) {
    return "";  // the step needs recomputing to fit (or does not fit at all: the Trainer says so)
  }
  if (without_plan.device_peak_bytes > with_plan.device_peak_bytes) return "";
  const double flops = static_cast<double>(with_plan.phases.front().flops);
  const double flops_without = static_cast<double>(without_plan.phases.front().flops);
  return fmt::format(
      "ferry: note: --recompute {} does not lower this step's device peak ({} with it, {} without) and adds {:.3g} "
      "GFLOP a step ({:+.0f}%); --recompute 0 keeps the activations, and auto recomputes only what a "
      "--device-budget needs\n",
      opt.recompute, ferry::format_bytes(with_plan.device_peak_bytes),
      ferry::format_bytes(without_plan.device_peak_bytes), (flops - flops_without) * 1e-9,
      flops_without > 0 ? 100.0 * (flops - flops_without) / flops_without : 0.0);
}

void add_phase_fields(nlohmann::json& j, const ferry::Trainer& trainer) {
  const auto& opt = trainer.options();
  j["phases"] = ferry::phases_name(opt.phases.hybrid);
  j["accumulate"] = opt.accumulate;
  j["recompute"] = opt.recompute;
  j["optimizer_updates"] = trainer.steps_done();
  j["precision"] = precision_name(opt.precision.compute);
  j["loss_scaling"] = opt.precision.scaled();
  j["loss_scale"] = trainer.loss_scale();
  j["overflow_steps"] = trainer.overflow_steps();
  const auto* pc = trainer.phases();
  if (!pc) return;
  const auto& c = pc->counts();
  j["predictor"] = ferry::ops::predictor_name(opt.phases.predictor.kind);
  j["predict_fraction"] = pc->predict_fraction();
  nlohmann::json steps;
  for (std::size_t p = 0; p < ferry::phase_count; ++p) steps[ferry::phase_name(ferry::Phase(p))] = c.steps[p];
  j["phase_steps"] = steps;
  j["predict_runs"] = c.runs;
  j["predict_ended"] = c.ended;
  j["predict_restores"] = c.restores;
  j["full_step_ms"] = trainer.phase_step_ms(ferry::Phase::full);
  j["predict_step_ms"] = trainer.phase_step_ms(ferry::Phase::predict);
  j["predictor_state_bytes"] = trainer.predictor_state_bytes();
  j["predict_int8"] = opt.phases.predict_int8;
  j["predictor_residual"] = opt.phases.predictor.residual;
  j["fit_every"] = opt.phases.fit_every;
  j["predict_fetch_bytes_per_step"] = compiled_predict_step(trainer)->residency().fetch_bytes;
  j["predict_write_back_bytes_per_step"] = compiled_predict_step(trainer)->residency().write_back_bytes;
}

void write_run_outputs(const TrainArgs& a, const ferry::Trainer& trainer, const ferry::ChromeTrace& trace,
                       ferry::MemoryProfiler& profiler, std::uint64_t steps_run, std::vector<std::string>& errors) {
  // (A resumed trainer's count includes the steps before the resume: at most this run's are its.)
  const std::uint64_t overflowed = std::min<std::uint64_t>(trainer.overflow_steps(), steps_run);
  if (trainer.options().precision.scaled() && steps_run >= 4 && 2 * overflowed > steps_run) {
    std::cerr << fmt::format(
        "ferry: warning: {} of this run's {} steps overflowed under {} loss scaling and updated nothing (the loss "
        "scale is now {}): the gradients overflow even scaled down, so the model barely trained; lower the learning "
        "rate (--lr), or train in bf16 (--precision bf16), whose range is fp32's\n",
        overflowed, steps_run, precision_name(trainer.options().precision.compute), trainer.loss_scale());
  }
  write_trace(a, trace, errors);
  write_memory_profiles(a, trainer, profiler, errors);
}

void write_trace(const TrainArgs& a, const ferry::ChromeTrace& trace, std::vector<std::string>& errors) {
  if (a.trace_path.empty()) return;
  write_side_output(a.trace_path, fmt::format("a trace of {} steps", trace.steps()).c_str(), a.quiet, errors,
                    [&] { trace.write(a.trace_path, {.replace_foreign_file = a.force}); });
}

void write_memory_profiles(const TrainArgs& a, const ferry::Trainer& trainer, ferry::MemoryProfiler& profiler,
                           std::vector<std::string>& output_errors) {
  profiler.add_variants(trainer);
  if (!a.profile_phases_path.empty()) {
    write_side_output(a.profile_phases_path, "the per-phase memory profile", a.quiet, output_errors,
                      [&] { profiler.write_phase_csv(a.profile_phases_path, {.replace_foreign_file = a.force}); });
  }
  if (!a.profile_path.empty()) {
    write_side_output(a.profile_path, "the memory profile", a.quiet, output_errors,
                      [&] { profiler.write_csv(a.profile_path, {.replace_foreign_file = a.force}); });
  }
  if (!a.quiet) std::cerr << "ferry: memory profile (device bytes from the plan)\n" << profiler.summary();
  report_driver_memory(a, trainer);  // and what the driver counted beside it
}

nlohmann::json common_train_summary(const TrainArgs& a, ferry::Runtime& runtime, const ferry::Trainer& trainer,
                                    std::uint32_t batch, const std::vector<std::string>& output_errors) {
  nlohmann::json j = {{"schema", train_json_schema},
                      {"model", trainer.model().name},
                      {"device", runtime.device().name},
                      {"gemm_tuning", ferry::ops::gemm_tuning_choice(runtime.env())},
                      {"output_errors", output_errors},
                      {"batch", batch},
                      {"optimizer", a.optimizer},
                      {"lr", shortest(a.lr)},
                      {"seed", a.seed},
                      {"parameters", trainer.parameter_count()},
                      {"device_peak_bytes", trainer.device_peak_bytes()},
                      {"training_state_bytes", trainer.training_state_bytes()},
                      {"optimizer_state_bytes", trainer.optimizer_state_bytes()},
                      {"gradient_bytes", trainer.gradient_bytes()},
                      {"world_size", trainer.world_size()},
                      {"zero_stage", a.zero},
                      {"allreduce_bytes_per_step", trainer.allreduce_bytes_per_step()},
                      {"residency", ferry::graph::residency_mode_name(trainer.residency().mode)},
                      {"device_budget_bytes", trainer.device_budget_bytes()},
                      {"host_state_bytes", trainer.host_state_bytes()},
                      {"host_memory", ferry::offload::host_memory_name(trainer.host_memory())},
                      {"staging_chunk_bytes", trainer.options().residency.staging_chunk_bytes},
                      {"host_optimizer", trainer.options().residency.host_optimizer}};
  add_phase_fields(j, trainer);
  add_driver_memory_fields(j, trainer);
  return j;
}

std::uint32_t default_batch(const std::string& model) {
  return model == "mlp" ? 256 : model == "cnn" ? 128 : model == "gpt" ? 32 : 64;
}

ferry::ModelSpec make_model(const TrainArgs& a) {
  if (a.model == "mlp") return ferry::models::mlp();
  if (a.model == "cnn") return ferry::models::cnn();
  if (a.model == "deep") return ferry::models::deep(a.width ? a.width : 1024, a.depth ? a.depth : 16);
  throw std::invalid_argument(fmt::format("unknown model '{}': use mlp, cnn or deep", a.model));
}

void report_stop(const TrainArgs& a, const ferry::LoopSummary& run, const ferry::ChromeTrace& trace,
                 const ferry::Trainer& trainer, ferry::MemoryProfiler& profiler, const std::string& where) {
  std::vector<std::string> ignored;                       // each failure is a warning already
  if (trace.steps() > 0) write_trace(a, trace, ignored);  // the steps traced so far are kept too
  // And the memory profiles of the steps profiled so far (and of every variant compiled).
  if (!a.profile_path.empty() || !a.profile_phases_path.empty()) write_memory_profiles(a, trainer, profiler, ignored);
  if (!a.primary) return;  // rank 0 says it (and writes the checkpoint, unless each rank writes its own)
  const std::string name = ferry::StopSignals::name(run.signal);
  if (run.every_step_done) {
    std::cerr << fmt::format(
        "ferry: stopped by {} after the last step: every step was trained{}; the final report was left out\n", name,
        run.checkpoint_written ? fmt::format(" and checkpoint {} holds them", a.checkpoint_path) : std::string());
  } else if (run.checkpoint_written) {
    std::cerr << fmt::format("ferry: stopped by {} at {}; wrote checkpoint {}\nferry: resume with: {}\n", name, where,
                             a.checkpoint_path, resume_command(a, a.checkpoint_path));
  } else {
    std::cerr << fmt::format(
        "ferry: stopped by {} at {}; no checkpoint written (run with --checkpoint FILE to be able to resume)\n", name,
        where);
  }
}

namespace {
// `s` quoted for a POSIX shell where it needs quoting.
std::string shell_quote(const std::string& s) {
  const bool plain = !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || std::string_view("_-./=:,+@%").find(c) != std::string::npos;
  });
  if (plain) return s;
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}
}  // namespace

ferry::LoopSummary run_loop(ferry::TrainingLoop& loop, const TrainArgs& a) {
  end_setup_watch();  // the loop watches the ranks' steps itself
  try {
    return loop.run();
  } catch (const ferry::CheckpointWriteError& e) {
    std::string way_back;
    std::error_code ec;
    if (e.intact_done && std::filesystem::is_regular_file(a.checkpoint_path, ec)) {
      way_back = fmt::format(
          "\nferry: {} still holds this run's state after {} steps; once it can be written, go on from there "
          "with: {}",
          a.checkpoint_path, *e.intact_done, resume_command(a, a.checkpoint_path));
    } else {
      // The checkpoint that held the run's state may have gone with its folder: not offered then.
      if (e.intact_done) {
        way_back =
            fmt::format("\nferry: {} held this run's state after {} steps, but it is gone (removed during the run)",
                        a.checkpoint_path, *e.intact_done);
      } else if (!a.resume_path.empty()) {
        way_back = "\nferry: this run saved nothing";
      }
      if (!a.resume_path.empty() && std::filesystem::is_regular_file(a.resume_path, ec)) {
        way_back += fmt::format("; go on from where it started with: {}", resume_command(a, a.resume_path));
      }
    }
    throw std::runtime_error(e.what() + way_back);
  }
}

// The command line that continues this run from `checkpoint`: the same arguments, any --resume
// replaced.
std::string resume_command(const TrainArgs& a, const std::string& checkpoint) {
  std::string cmd;
  for (std::size_t i = 0; i < a.argv.size(); ++i) {
    const std::string& arg = a.argv[i];
    if (arg == "--resume") {
      ++i;
      continue;
    }
    if (arg.rfind("--resume=", 0) == 0) continue;
    cmd += (cmd.empty() ? "" : " ") + shell_quote(arg);
  }
  // Data parallel: the same ranks again (its own argv is one rank's; mpirun's options are not known),
  // and rank 0's file, the path given, on every rank (the others find theirs beside it).
  const std::string ranks = a.world ? fmt::format("mpirun -np {} ", a.world->size()) : std::string();
  return ranks + cmd + " --resume " + shell_quote(given_file(a, checkpoint));
}

std::vector<std::byte> caller_section(const nlohmann::json& j) {
  const auto cbor = nlohmann::json::to_cbor(j);
  std::vector<std::byte> out(cbor.size());
  std::memcpy(out.data(), cbor.data(), cbor.size());
  return out;
}

std::invalid_argument resume_error(const TrainArgs& a, const std::string& what) {
  return std::invalid_argument(fmt::format("cannot resume from '{}': {}", a.resume_path, what));
}

void note_micro_batches_left_over(const TrainArgs& a, std::uint64_t micro_batches, const std::string& give) {
  const std::uint64_t left = micro_batches % a.accumulate;
  if (left == 0 || !a.primary || a.quiet) return;
  std::cerr << fmt::format(
      "ferry: note: --accumulate {} makes {} updates of this run's {} micro-batches; the last {} make none (their "
      "gradients are summed, and dropped at the end unless a --checkpoint keeps them for a resume to go on from): "
      "give {} so that {} divides the micro-batches\n",
      a.accumulate, micro_batches / a.accumulate, micro_batches, left, give, a.accumulate);
}

void check_same_data(const nlohmann::json& j, std::uint64_t here, const TrainArgs& a, const std::string& give) {
  const auto it = j.find("data_checksum");
  if (it == j.end()) return;
  const auto was = it->get<std::uint64_t>();
  if (was == here) return;
  throw resume_error(a, fmt::format("it was trained on other data of the same size (checksum {:016x} of the training "
                                    "data, this run's {:016x}): resume with the same {}",
                                    was, here, give));
}

nlohmann::json read_caller_section(const std::vector<std::byte>& bytes, const TrainArgs& a, const std::string& kind) {
  nlohmann::json j;
  try {
    j = nlohmann::json::from_cbor(reinterpret_cast<const std::uint8_t*>(bytes.data()),
                                  reinterpret_cast<const std::uint8_t*>(bytes.data()) + bytes.size());
  } catch (const std::exception&) {
    j = nullptr;
  }
  if (!j.is_object() || j.value("kind", "") != kind) {
    throw resume_error(a, fmt::format("it was not written by {} (its caller section is not that command's)", kind));
  }
  return j;
}

}  // namespace ferry::cli
