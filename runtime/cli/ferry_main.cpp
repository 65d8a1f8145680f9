// The `ferry` command: list devices, train a model on Fashion-MNIST.
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>

#include "cli.hpp"
#include "ferry/ferry.hpp"
#include "ferry/runtime/lr_schedule.hpp"
#include "ops/gemm_tune.hpp"
#include "runtime/output_file.hpp"
#include "runtime/trainer_internals.hpp"

namespace {

using namespace ferry::cli;
using Clock = std::chrono::steady_clock;

// Standardise pixels with the training set's statistics (Fashion-MNIST: mean 0.286, std 0.353).
void standardise(ferry::Dataset& d, float mean, float stddev) {
  for (auto& v : d.images) v = (v - mean) / stddev;
}

int cmd_devices() {
  auto devices = ferry::cl::list_devices();
  if (devices.empty()) {
    std::cerr << "no OpenCL device found: install a driver (for a CPU: apt-get install pocl-opencl-icd)\n";
    return 1;
  }
  for (const auto& d : devices) {
    // The driver's count of memory in use, where it keeps one (NVML, AMD's query): what others hold.
    std::string in_use;
    const ferry::cl::DriverMemory source = ferry::cl::DriverMemory::for_device(d);
    if (const auto count = source.read()) {
      in_use = fmt::format(", {} in use as the driver counts it", ferry::format_bytes(count->used_bytes));
    }
    std::cerr << unread_driver_memory_warning(source);
    std::cout << fmt::format("[{}] {} / {}  ({}, {} compute units, {} memory{}, largest buffer {}, {}{})\n", d.index,
                             d.platform_name, d.name, d.type_name(), d.compute_units,
                             ferry::format_bytes(d.global_mem_bytes), in_use, ferry::format_bytes(d.max_alloc_bytes),
                             d.version, d.host_unified_memory ? ", unified host memory" : "");
  }
  return 0;
}

// What `ferry train` keeps in a checkpoint's caller section besides the trainer's state: where the
// loop is in which epoch, the data order and its RNG, the schedule, and the sums its output needs.
// (Its layout, version 1, counts epochs done and steps into the next rather than steps done.)
std::vector<std::byte> encode_position(const TrainArgs& a, const ferry::LoopPosition& p, std::size_t steps_per_epoch,
                                       std::size_t samples, std::uint64_t data_checksum,
                                       const ferry::ShuffledBatches& batches, std::size_t total_steps) {
  std::ostringstream rng_state;
  rng_state << batches.engine();
  const auto order = batches.order();
  std::vector<std::uint8_t> order_bytes(order.size() * 4);
  for (std::size_t i = 0; i < order.size(); ++i) {
    const auto v = static_cast<std::uint32_t>(order[i]);
    std::memcpy(order_bytes.data() + 4 * i, &v, 4);
  }
  const nlohmann::json j = {{"kind", "ferry train"},
                            {"version", 1},
                            {"model", a.model},
                            {"seed", a.seed},
                            {"train_samples", samples},
                            {"data_checksum", data_checksum},
                            {"epochs", a.epochs},
                            {"epochs_done", p.done / steps_per_epoch},
                            {"step_in_epoch", p.done % steps_per_epoch},
                            {"loss_sum", p.epoch_loss_sum},
                            {"last_epoch_loss", p.last_epoch_loss},
                            {"schedule", a.schedule},
                            {"lr", a.lr},
                            {"total_steps", total_steps},
                            {"rng", rng_state.str()},
                            {"order", nlohmann::json::binary(std::move(order_bytes))}};
  return caller_section(j);
}

// Reads the caller section `ferry train` wrote back into the loop's position and the batches'
// engine, order and place in it, after checking it belongs to this command line; throws
// std::invalid_argument naming what differs.
ferry::LoopPosition decode_fields(const nlohmann::json& j, const TrainArgs& a, std::size_t samples,
                                  std::uint64_t data_checksum, std::size_t steps_per_epoch,
                                  ferry::ShuffledBatches& batches) {
  const auto fail = [&](const std::string& what) { return resume_error(a, what); };
  if (j.at("version").get<int>() != 1) throw fail("its ferry train section has another version");
  if (j.at("seed").get<std::uint64_t>() != a.seed) {
    throw fail(fmt::format("it was trained with --seed {}, not {}: resume with --seed {}",
                           j.at("seed").get<std::uint64_t>(), a.seed, j.at("seed").get<std::uint64_t>()));
  }
  if (j.at("train_samples").get<std::size_t>() != samples) {
    throw fail(fmt::format("it was trained on {} samples, this run has {}: resume with the same --train-limit and data",
                           j.at("train_samples").get<std::size_t>(), samples));
  }
  check_same_data(j, data_checksum, a, "--data and --train-limit");
  if (j.at("schedule").get<std::string>() != a.schedule || j.at("lr").get<float>() != a.lr) {
    throw fail(fmt::format("it was trained with --schedule {} --lr {}, not --schedule {} --lr {}: resume with those",
                           j.at("schedule").get<std::string>(), j.at("lr").get<float>(), a.schedule, a.lr));
  }
  const auto epochs_done = j.at("epochs_done").get<std::uint32_t>();
  const auto step_in_epoch = j.at("step_in_epoch").get<std::size_t>();
  if (step_in_epoch >= steps_per_epoch) throw fail("its position in the epoch is past the epoch's end");
  if (epochs_done > a.epochs || (epochs_done == a.epochs && step_in_epoch > 0)) {
    throw fail(fmt::format("it is past epoch {} already ({} epochs{} done): give --epochs {} or more", a.epochs,
                           epochs_done,
                           step_in_epoch > 0 ? fmt::format(" and {} steps of the next", step_in_epoch) : std::string(),
                           epochs_done + (step_in_epoch > 0)));
  }
  std::istringstream rng_state(j.at("rng").get<std::string>());
  std::mt19937_64 rng;
  rng_state >> rng;
  if (!rng_state) throw fail("its shuffle RNG state does not parse");
  const auto& bin = j.at("order").get_binary();
  if (bin.size() != samples * 4) throw fail("its data order has another length");
  std::vector<std::size_t> order(samples);
  for (std::size_t i = 0; i < samples; ++i) {
    std::uint32_t v;
    std::memcpy(&v, bin.data() + 4 * i, 4);
    if (v >= samples) throw fail("its data order names a sample out of range");
    order[i] = v;
  }
  try {
    batches.set_order(order);
  } catch (const std::invalid_argument& e) {
    throw fail(fmt::format("its data order is not a permutation ({})", e.what()));
  }
  batches.engine() = rng;
  // Mid-epoch: on in this order; at an epoch's end, a new order first (next() draws it).
  batches.seek(step_in_epoch > 0 ? step_in_epoch : steps_per_epoch);
  if (const auto was = j.at("epochs").get<std::uint32_t>(); a.primary && was != a.epochs && a.schedule != "constant") {
    std::cerr << fmt::format(
        "ferry: note: the checkpoint's run had --epochs {}; its {} schedule now spans {} epochs, so the learning "
        "rates from here differ from that run's\n",
        was, a.schedule, a.epochs);
  }
  ferry::LoopPosition p;
  p.done = std::uint64_t{epochs_done} * steps_per_epoch + step_in_epoch;
  p.epoch_loss_sum = j.at("loss_sum").get<double>();
  p.last_epoch_loss = j.at("last_epoch_loss").get<double>();
  return p;
}

ferry::LoopPosition decode_position(const std::vector<std::byte>& bytes, const TrainArgs& a, std::size_t samples,
                                    std::uint64_t data_checksum, std::size_t steps_per_epoch,
                                    ferry::ShuffledBatches& batches) {
  const nlohmann::json j = read_caller_section(bytes, a, "ferry train");
  try {
    return decode_fields(j, a, samples, data_checksum, steps_per_epoch, batches);
  } catch (const nlohmann::json::exception& e) {
    throw resume_error(a, fmt::format("its ferry train section is incomplete ({})", e.what()));
  }
}

// The banner line of where the state lives: the residency mode, the homes, the planned device
// peak, and what streaming, mapping or staging moves per step.
std::string residency_banner(const ferry::Trainer& trainer) {
  const auto& rr = trainer.residency();
  // The state's homes apart from the steps' host pools (host_state_bytes counts both).
  const std::uint64_t state_bytes = compiled_train_step(trainer).persistent()->host_bytes();
  const std::uint64_t step_bytes = trainer.host_state_bytes() - state_bytes;
  std::string where;
  switch (rr.mode) {
    case ferry::graph::ResidencyMode::stream:
      where = fmt::format(
          "; weights and optimizer state in {} of {} host memory, step tensors in {} more; per step {} fetches ({}) "
          "and {} write-backs ({}), issued {} compute nodes ahead, kept apart from {} compute nodes around them{}",
          ferry::format_bytes(state_bytes), ferry::offload::host_memory_name(trainer.host_memory()),
          ferry::format_bytes(step_bytes), rr.fetches, ferry::format_bytes(rr.fetch_bytes), rr.write_backs,
          ferry::format_bytes(rr.write_back_bytes), rr.lookahead, rr.transfer_slack,
          rr.host_updates ? fmt::format("; {} optimizer updates on the host", rr.host_updates) : std::string());
      break;
    case ferry::graph::ResidencyMode::mapped:
      where = fmt::format(
          "; weights and optimizer state in {} of host memory, the mapped ones used by kernels in place "
          "(zero-copy); {} of step tensors (their gradients, staging) in pinned host memory",
          ferry::format_bytes(state_bytes), ferry::format_bytes(step_bytes));
      break;
    default:
      break;
  }
  if (rr.unpacks + rr.packs > 0) {
    where += fmt::format("; staged homes: {} unpacks and {} packs per step on host workers, {} of pinned staging",
                         rr.unpacks, rr.packs, ferry::format_bytes(compiled_train_step(trainer).host_step_bytes()));
  }
  return fmt::format(
      "ferry: residency {} (weights: {}, optimizer state: {}): device peak {} of a {} budget (planned){}{}\n",
      ferry::graph::residency_mode_name(rr.mode), ferry::offload::home_name(trainer.weights_home()),
      ferry::offload::home_name(trainer.state_home()), ferry::format_bytes(trainer.device_peak_bytes()),
      ferry::format_bytes(trainer.device_budget_bytes()), budget_from_free_memory_note(trainer), where);
}

// Fashion-MNIST's two splits as `a` asks: checked against the model before any step, the training
// split cut to --train-limit, both standardised with the training set's statistics.
struct Splits {
  ferry::Dataset train, test;
};
Splits load_splits(const TrainArgs& a) {
  const auto data_dir = a.data_dir.empty() ? ferry::default_fashion_mnist_dir() : std::filesystem::path(a.data_dir);
  Splits s{ferry::load_fashion_mnist(data_dir, ferry::Split::train),
           ferry::load_fashion_mnist(data_dir, ferry::Split::test)};
  const ferry::ModelSpec model = make_model(a);
  check_split(model, s.train, "train", data_dir);
  check_split(model, s.test, "test", data_dir);
  if (a.train_limit > s.train.count && a.primary && !a.quiet) {
    std::cerr << fmt::format(
        "ferry: note: --train-limit {} is more than the {} training samples in {}: all {} are used\n", a.train_limit,
        s.train.count, data_dir.string(), s.train.count);
  }
  if (a.train_limit && a.train_limit < s.train.count) {
    s.train.count = a.train_limit;
    s.train.images.resize(s.train.count * s.train.sample_elems());
    s.train.labels.resize(s.train.count);
  }
  standardise(s.train, 0.2860f, 0.3530f);
  standardise(s.test, 0.2860f, 0.3530f);
  return s;
}

// The classifier's own fields of the --json line: its results, rates and where its state lived.
void add_classifier_fields(nlohmann::json& j, const TrainArgs& a, const ferry::Trainer& trainer,
                           const ferry::LoopSummary& run, const ferry::EvalResult& final_eval, double eval_seconds,
                           double compile_s) {
  j.update(
      {{"epochs", a.epochs},
       {"test_accuracy", final_eval.accuracy},
       {"test_loss", final_eval.loss},
       {"train_loss", run.position.last_epoch_loss},
       {"samples_per_s", run.units_per_second},
       {"train_seconds", run.run_train_seconds},
       {"eval_seconds", eval_seconds},
       {"checkpoint_seconds", run.checkpoint_seconds},
       {"steps", run.steps_run},
       {"step_ms", run.mean_step_ms},
       {"weights_home", ferry::offload::home_name(trainer.weights_home())},
       {"state_home", ferry::offload::home_name(trainer.state_home())},
       // Every compiled step's host memory (evaluation's too), as host_state_bytes counts it.
       {"host_staging_bytes", trainer.host_state_bytes() - compiled_train_step(trainer).persistent()->host_bytes()},
       {"pinned_staging_bytes", compiled_train_step(trainer).plan().host_staging_bytes},
       {"unpacks_per_step", trainer.residency().unpacks},
       {"packs_per_step", trainer.residency().packs},
       {"fetch_bytes_per_step", trainer.residency().fetch_bytes},
       {"write_back_bytes_per_step", trainer.residency().write_back_bytes},
       {"host_updates_per_step", trainer.residency().host_updates},
       {"compile_s", compile_s}});
}

// A checksum of the training samples: data-parallel ranks compare theirs
// (TrainingLoopOptions::data_fingerprint), and a checkpoint keeps it so that a resume on other
// data of the same size is refused.
std::uint64_t dataset_fingerprint(const ferry::Dataset& d) {
  const std::uint64_t images = ferry::checkpoint_checksum(d.images.data(), d.count * d.sample_elems() * sizeof(float));
  return ferry::checkpoint_checksum(d.labels.data(), d.count * sizeof(std::int32_t), images);
}

// One batch needs that many samples; --accumulate k makes an update of every k batches: a run with
// fewer would train nothing, and a run whose batches k does not divide is told that its last ones
// make no update.
void check_updates_happen(const TrainArgs& a, std::size_t samples, std::uint32_t batch) {
  if (samples < batch) {
    throw std::invalid_argument(fmt::format("batch {} is larger than the {} training samples", batch, samples));
  }
  const std::uint64_t micro_batches = std::uint64_t{samples / batch} * a.epochs;
  if (micro_batches >= a.accumulate) {
    note_micro_batches_left_over(a, micro_batches, "--epochs, --train-limit or --batch");
    return;
  }
  throw std::invalid_argument(fmt::format(
      "--accumulate {} makes one optimizer update of every {} batches, but this run has {} ({} of {} samples in "
      "each of {} epochs): it would train nothing; give more --epochs or samples, a smaller --batch or a smaller "
      "--accumulate",
      a.accumulate, a.accumulate, micro_batches, samples / batch, batch, a.epochs));
}

// --resume of a classifier's run: the trainer's state and the loop's position from the checkpoint.
void resume_classifier_run(const TrainArgs& a, ferry::Trainer& trainer, ferry::TrainingLoop& loop,
                           std::size_t train_count, std::uint64_t data_checksum, ferry::ShuffledBatches& batches) {
  const std::size_t steps_per_epoch = batches.steps_per_epoch();
  const auto load_start = Clock::now();
  const auto caller = load_resume(trainer, a);
  const double load_ms = std::chrono::duration<double, std::milli>(Clock::now() - load_start).count();
  const ferry::LoopPosition start = decode_position(caller, a, train_count, data_checksum, steps_per_epoch, batches);
  loop.resume(start);
  if (!a.quiet) {
    std::cerr << fmt::format(
        "ferry: resumed from {}{} at epoch {}, step {} of {} ({} updates done; loaded in {:.0f} ms){}\n", a.resume_path,
        resume_note(a), start.done / steps_per_epoch + 1, start.done % steps_per_epoch, steps_per_epoch,
        trainer.steps_done(), load_ms,
        start.done == std::uint64_t{a.epochs} * steps_per_epoch
            ? fmt::format("; every epoch --epochs {} asks for is done, so none is trained", a.epochs)
            : std::string());
  }
}

int cmd_train(const TrainArgs& a) {
  Splits splits = load_splits(a);
  const ferry::Dataset& train = splits.train;
  const ferry::Dataset& test = splits.test;

  ferry::Runtime runtime({.device = a.device,
                          .local_rank = a.world ? ferry::local_rank() : 0,
                          .profiling = !a.trace_path.empty() || !a.profile_path.empty(),
                          .tune_progress = !a.quiet});
  ferry::TrainerOptions opt;
  const std::uint32_t batch = a.batch ? a.batch : default_batch(a.model);  // the global batch, over all ranks
  configure_trainer(a, opt);
  const ferry::Shard shard = configure_ranks(a, batch, opt);
  const ferry::LrSchedule::Kind schedule_kind = ferry::parse_schedule(a.schedule);
  check_updates_happen(a, train.count, batch);
  choose_optimizer_place(a, runtime, make_model(a), opt);

  const auto compile_start = Clock::now();
  ferry::Trainer trainer(runtime, make_model(a), opt);
  const double compile_s = std::chrono::duration<double>(Clock::now() - compile_start).count();
  if (!a.quiet) {
    std::cerr << fmt::format("ferry: {} on {} ({}); {} parameters; training state {}; compiled in {:.1f} s\n",
                             trainer.model().name, runtime.device().name, runtime.device().type_name(),
                             trainer.parameter_count(), ferry::format_bytes(trainer.training_state_bytes()), compile_s);
    announce_ranks(a, trainer, batch);
    std::cerr << residency_banner(trainer) << recompute_cost_note(runtime, trainer.model(), opt);
  }

  // This rank's rows of every global batch, in a new shuffled order each epoch.
  ferry::ShuffledBatches batches(train, trainer.model(), batch, a.seed, shard);
  const std::size_t steps_per_epoch = batches.steps_per_epoch();
  const std::size_t total_steps = steps_per_epoch * a.epochs;
  // The schedule counts optimizer updates.
  const ferry::LrSchedule schedule{
      .kind = schedule_kind, .peak = a.lr, .total_steps = ferry::updates_in(total_steps, trainer.options().accumulate)};
  ferry::ChromeTrace trace;
  ferry::MemoryProfiler profiler;
  profiler.add_training_step(trainer);
  // Read only where it is used: by the ranks, and by checkpoints (written and resumed from).
  const bool used = a.control || !a.checkpoint_path.empty() || !a.resume_path.empty();
  const std::uint64_t data_checksum = used ? dataset_fingerprint(train) : 0;

  ferry::TrainingLoop loop(trainer, batches,
                           {.steps = total_steps,
                            .steps_per_epoch = steps_per_epoch,
                            .schedule = schedule,
                            .units_per_step = batch,
                            .progress = !a.quiet,
                            .acknowledge_stop = a.primary,  // mpirun signals every rank: rank 0 says it
                            .checkpoint = a.checkpoint_path,
                            .caller_section =
                                [&](const ferry::LoopPosition& p) {
                                  return encode_position(a, p, steps_per_epoch, train.count, data_checksum, batches,
                                                         total_steps);
                                },
                            .checkpoint_options = {.replace_foreign_file = a.force},
                            // Data parallel: every rank holds the same state and rank 0 writes it, unless each holds
                            // its own share of the optimizer state (ZeRO stage 1: each writes its file).
                            .write_checkpoints = a.primary || a.sharded_checkpoint,
                            .after_checkpoint = [&a] { remove_stale_shards(a); },
                            .control = a.control,
                            .rank_timeout_seconds = a.rank_timeout_minutes * 60,
                            .data_fingerprint = a.control ? data_checksum : 0});
  if (!a.resume_path.empty()) resume_classifier_run(a, trainer, loop, train.count, data_checksum, batches);
  // Every rank, resumed or not (one that was not would otherwise miss the agreement).
  check_ranks_resumed_together(a, !a.resume_path.empty(), trainer.steps_done());
  loop.on_step = [&](std::uint64_t step, std::uint64_t run_index, const ferry::StepResult&) {
    if (run_index >= a.trace_steps) return;  // the first --trace-steps steps of this run
    if (!a.trace_path.empty()) trace.add_step(trainer, step);
    if (!a.profile_path.empty()) profiler.add_last_step(trainer, step);
  };
  // The last boundary's evaluation, which the final report takes where the run ended there: the
  // weights are the same, and evaluating them again cost the quick start's deep model 2.8 s.
  std::optional<std::pair<std::uint64_t, ferry::EvalResult>> boundary_eval;  // (steps done, result)
  loop.on_boundary = [&](const ferry::LoopPosition& p) {
    if (a.quiet) return;
    const auto eval = trainer.evaluate(test);
    boundary_eval.emplace(p.done, eval);
    std::string phase_note;
    if (const auto* pc = trainer.phases()) {
      phase_note =
          fmt::format(" ({:.0f}% of steps predicted so far, {} runs, {} ended, {} restored)",
                      100 * pc->predict_fraction(), pc->counts().runs, pc->counts().ended, pc->counts().restores);
    }
    std::cerr << fmt::format("epoch {}/{}: train loss {:.4f}, test accuracy {:.4f}{}\n", p.done / steps_per_epoch,
                             a.epochs, p.last_epoch_loss, eval.accuracy, phase_note);
  };
  const ferry::LoopSummary run = run_loop(loop, a);
  if (run.end == ferry::LoopSummary::End::stopped) {
    const ferry::LoopPosition& p = run.position;
    report_stop(a, run, trace, trainer, profiler,
                fmt::format("epoch {}/{}, step {}/{} ({} optimizer updates done)", p.done / steps_per_epoch + 1,
                            a.epochs, p.done % steps_per_epoch, steps_per_epoch, trainer.steps_done()));
    return 128 + run.signal;
  }
  const auto final_eval_start = Clock::now();
  const bool ended_at_boundary =
      run.end == ferry::LoopSummary::End::finished && boundary_eval && boundary_eval->first == run.position.done;
  const auto final_eval = !a.primary          ? ferry::EvalResult{}  // rank 0 reports it
                          : ended_at_boundary ? boundary_eval->second
                                              : trainer.evaluate(test);
  const double eval_seconds =
      run.position.boundary_seconds + std::chrono::duration<double>(Clock::now() - final_eval_start).count();
  std::vector<std::string> output_errors;
  write_run_outputs(a, trainer, trace, profiler, run.steps_run, output_errors);
  if (!a.quiet) {
    std::cerr << fmt::format("ferry: test accuracy {:.4f}, {:.0f} samples/s, {:.2f} ms/step, device peak {}\n",
                             final_eval.accuracy, run.units_per_second, run.mean_step_ms,
                             ferry::format_bytes(trainer.device_peak_bytes()));
  }
  if (a.json) {
    nlohmann::json j = common_train_summary(a, runtime, trainer, batch, output_errors);
    add_classifier_fields(j, a, trainer, run, final_eval, eval_seconds, compile_s);
    j["train_samples"] = train.count;  // after --train-limit (whose note --quiet leaves out)
    if (a.eval_int8) j["test_accuracy_int8"] = trainer.evaluate(test, true).accuracy;
    std::cout << j.dump() << std::endl;
  }
  return train_exit_status(output_errors);
}

}  // namespace

void add_residency_options(CLI::App* app, TrainArgs& t);
void add_phase_options(CLI::App* app, TrainArgs& t);

// Options `train` and `plan` share: the model, the optimizer, where state lives, phases,
// accumulation, the device and its budget, JSON output.
void add_model_options(CLI::App* app, TrainArgs& t) {
  app->add_option("--model", t.model,
                  "mlp (784-1024-1024-10), cnn (two conv layers), deep (residual MLP): Fashion-MNIST; gpt: a "
                  "character-level GPT on the fortune files")
      ->check(CLI::IsMember({"mlp", "cnn", "deep", "gpt"}))
      ->capture_default_str();
  app->add_option("--batch", t.batch, "Samples per step (default: mlp 256, cnn 128, deep 64, gpt 32)")
      ->check(positive_number());
  app->add_option("--optimizer", t.optimizer,
                  "adam, adamw, adamw8bit (AdamW with 8-bit block-wise quantized moments) or sgd")
      ->capture_default_str();
  app->add_option("--optimizer-block", t.optimizer_block,
                  "adamw8bit: elements sharing one scale per moment (a multiple of 256)")
      ->capture_default_str();
  app->add_option("--weight-decay", t.weight_decay, "L2 (adam, sgd) or decoupled (adamw, adamw8bit)")
      ->capture_default_str();
  app->add_option("--weight-decay-on", t.weight_decay_on,
                  "all (every weight) or matrices (weights of rank 2 or more: linear and convolution weights, "
                  "embedding tables; not biases, LayerNorm gains and shifts, as transformers are usually trained)")
      ->check(CLI::IsMember({"all", "matrices"}))
      ->capture_default_str();
  app->add_option("--momentum", t.momentum, "SGD momentum")->capture_default_str();
  app->add_option("--width", t.width, "deep, gpt: width (default: deep 1024, gpt 192)")->check(positive_number());
  app->add_option("--depth", t.depth, "deep: residual blocks (default 16); gpt: decoder blocks (default 4)")
      ->check(CLI::Range(1u, 65536u));
  app->add_option("--heads", t.heads, "gpt: attention heads")->check(positive_number())->capture_default_str();
  app->add_option("--attention", t.attention,
                  "gpt: fused (one op per block, no context x context tensors; head dimension up to 128) or "
                  "unfused (batched matmuls, a causal softmax and a dropout op: the reference path; both take "
                  "--dropout, with the same masks)")
      ->check(CLI::IsMember({"fused", "unfused"}))
      ->capture_default_str();
  app->add_option("--context", t.context, "gpt: characters per window")
      ->check(positive_number())
      ->capture_default_str();
  app->add_option("--device", t.device, "Device index or name substring (default: $FERRY_DEVICE, else first GPU)")
      ->check(not_empty());
  app->add_option("--device-budget", t.device_budget,
                  "Device bytes a step may use, e.g. 64MiB (default: device memory less headroom)");
  app->add_option("--host-budget", t.host_budget,
                  "Pinned host bytes the weights, optimizer state and step buffers (evaluation's too) may take, e.g. "
                  "16GiB, checked before anything is allocated (default: the machine's physical memory)");
  add_residency_options(app, t);
  add_phase_options(app, t);
  app->add_flag("--json", t.json, "End with one JSON line of results on stdout");
}

// Where the training state lives and how it streams.
void add_residency_options(CLI::App* app, TrainArgs& t) {
  app->add_option("--host-memory", t.host_memory,
                  "Memory of the streamed homes and the step's host buffers: pinned (DMA copies), pageable (no "
                  "device memory; the driver stages copies), staged (pageable, copies through a small pinned "
                  "staging area filled on all cores), registered (ferry's pages handed to the driver, "
                  "CL_MEM_USE_HOST_PTR, which may pin them in place; otherwise as pinned), or auto: on NVIDIA, "
                  "whose pinned buffers take device memory too, staged in chunks under a budget of 2 GiB or more "
                  "and pageable below it; pinned elsewhere")
      ->check(CLI::IsMember(ferry::offload::host_memory_names()))
      ->capture_default_str();
  app->add_option("--staging-chunk", t.staging_chunk,
                  fmt::format("With --host-memory staged: each fetch copies itself through a ring of four pinned "
                              "chunks of this size (host copy and link in a pipeline) instead of through an unpack "
                              "node on the host lanes ({}; write-backs stay staged)",
                              staging_chunk_range()));
  app->add_option("--residency", t.residency,
                  "Where weights and optimizer state live: auto, resident, stream (copy in and out), mapped "
                  "(zero-copy, unified-memory devices)")
      ->check(CLI::IsMember({"auto", "resident", "stream", "mapped"}))
      ->capture_default_str();
  auto* host_optimizer = app->add_flag(
      "--host-optimizer", t.host_optimizer,
      "Streaming: run optimizer updates on the host; only weights go to the device and only gradients come back. "
      "Without this or --no-host-optimizer: on the host where the device has memory of its own, the step streams "
      "and the host's updates move fewer bytes over the link");
  app->add_flag("--no-host-optimizer", t.no_host_optimizer,
                "Run optimizer updates on the device, streamed state and all (their weights and moments fetched and "
                "written back after the backward)")
      ->excludes(host_optimizer);
  app->add_flag("--overlap-host-updates", t.overlap_host_updates,
                "Run the optimizer on the host (as --host-optimizer, which it implies) and apply each step's host "
                "updates during the next step's forward, each weight's just before its fetch, instead of after the "
                "backward with the device idle (the same results)");
  // The library's names of the homes are taken as well, as its messages use them.
  const auto homes = CLI::IsMember(
      {"device", "host", "mapped", "compressed", "dropped", "host_pinned", "host_mapped", "host_compressed"});
  app->add_option("--weights-home", t.weights_home,
                  "Home of the weights, replacing the residency mode's: device, host (pinned, streamed; also "
                  "host_pinned), mapped (zero-copy; host_mapped), compressed (zstd chunks in host memory, streamed; "
                  "host_compressed)")
      ->check(homes);
  app->add_option("--state-home", t.state_home,
                  "Home of the optimizer state, replacing the residency mode's: as --weights-home, and dropped "
                  "(not kept: re-initialised to zeros before every update)")
      ->check(homes);
  app->add_option("--compress-chunk", t.compress_chunk,
                  "Compressed home: uncompressed bytes per chunk (e.g. 256KiB, 1MiB; at least 4KiB)")
      ->capture_default_str();
  app->add_option("--compress-level", t.compress_level, "Compressed home: zstd level")->capture_default_str();
  app->add_option("--compress-workers", t.compress_workers,
                  "Compressed home: TBB workers (de)compressing one tensor's chunks (0: all; more than the machine's "
                  "hardware threads run as that many)")
      ->capture_default_str();
  app->add_option("--lookahead", t.lookahead, "Streaming: compute nodes a fetch is issued ahead of its use")
      ->capture_default_str();
  app->add_option("--transfer-slack", t.transfer_slack,
                  "Streaming: compute nodes around each fetch and write-back whose device bytes the copy's are kept "
                  "apart from, so that neither waits for the other, and staged copies after each staged one whose "
                  "pinned staging is kept apart from its own (given up under a tight budget before the lookahead)")
      ->capture_default_str();
}

// Steps, accumulation, recomputation, precision and the hybrid phases.
void add_phase_options(CLI::App* app, TrainArgs& t) {
  app->add_option("--seed", t.seed, "Seed of initialisation and shuffling")
      ->check(whole_number())
      ->capture_default_str();
  app->add_option("--accumulate", t.accumulate,
                  "Micro-batches of --batch samples whose mean gradient makes one optimizer update")
      ->capture_default_str();
  app->add_option("--recompute", t.recompute,
                  "Recompute activations in backward for segments of N layers instead of keeping them (0: off; "
                  "auto: none if the step fits the device budget, else the longest segments that fit)")
      ->capture_default_str();
  app->add_flag("--no-fuse", t.no_fuse,
                "Keep every layer its own kernel (no ReLU fused into a max-pool or a convolution's or Linear's "
                "epilogue, no residual add into a LayerNorm, no activation's backward into a GEMM, no gradient's "
                "overflow check in the kernel that makes it, no Adam updates grouped into one launch); results are "
                "bit-identical, only slower: for measuring what fusion buys");
  app->add_option("--precision", t.precision,
                  "Mixed precision: fp32 (none), bf16 or fp16 layers over fp32 master weights (docs/phases.md)")
      ->check(CLI::IsMember({"fp32", "fp16", "bf16"}))
      ->capture_default_str();
  app->add_option("--loss-scaling", t.loss_scaling, "Dynamic loss scaling: auto (on with fp16), on, off")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  app->add_option("--initial-loss-scale", t.initial_loss_scale,
                  "Loss scaling: the first scale, a power of two from 1 to 2^24")
      ->capture_default_str();
  app->add_option("--loss-scale-interval", t.loss_scale_interval,
                  "Loss scaling: steps without overflow before the scale doubles")
      ->capture_default_str();
  auto& pc = t.phase_config;
  app->add_option("--phases", t.phases,
                  "full (every step trains) or hybrid (Warmup/Full/Predict/Correct: some steps run forward only and "
                  "advance the weights by a predicted update; see docs/phases.md)")
      ->capture_default_str();
  app->add_option("--predictor", t.predictor,
                  "hybrid: linear (smoothed recent updates) or lsq (with a least-squares gain per tensor)")
      ->capture_default_str();
  app->add_option("--predictor-beta", pc.predictor.beta, "hybrid: smoothing of the recent updates, in [0, 1)")
      ->capture_default_str();
  app->add_option("--warmup-steps", pc.warmup_steps, "hybrid: Full steps before anything is predicted")
      ->capture_default_str();
  app->add_option("--min-full-steps", pc.min_full_steps, "hybrid: Full steps between Predict runs")
      ->capture_default_str();
  app->add_option("--max-predict", pc.max_predict_steps, "hybrid: the longest Predict run")->capture_default_str();
  app->add_option("--confidence", pc.confidence,
                  "hybrid: prediction quality (cosine of predicted and true update) needed to predict, in (0, 1]")
      ->capture_default_str();
  app->add_flag("--predictor-residual", pc.predictor.residual,
                "hybrid: add residual correction, the smoothed past prediction errors weighted by how similar each "
                "new one is to them");
  app->add_flag("--predict-int8", pc.predict_int8,
                "hybrid: Predict's forward reads every layer's weight but the head's as int8 (per output channel); "
                "streamed weights cross the link as int8");
  app->add_option("--fit-every", pc.fit_every,
                  "hybrid: fit the predictor on every K-th training step only (and on Correct steps)")
      ->capture_default_str();
  app->add_option("--predict-decay", pc.predict_decay, "hybrid: step k of a Predict run applies decay^k of the update")
      ->capture_default_str();
  app->add_option("--max-loss-gap", pc.max_loss_gap,
                  "hybrid: a Predict loss this far above the recent Full mean restores the last Full weights")
      ->capture_default_str();
}

// `ferry tune` and its options.
CLI::App* add_tune_command(CLI::App& app, TuneArgs& a) {
  auto* tune = app.add_subcommand(
      "tune",
      "Tune the GEMM kernel (and, on GPUs, the fused attention's) for a device ahead of first use (bounded "
      "searches; the winners are cached beside the program cache; a row of ops/tuning/gemm.tsv naming the device "
      "wins over the GEMM's)");
  tune->add_option("--device", a.device, "Device index or name substring (default: $FERRY_DEVICE, else first GPU)")
      ->check(not_empty());
  tune->add_option("--mode", a.mode, "quick: the likeliest candidates; full: all of them")
      ->check(CLI::IsMember({"quick", "full"}))
      ->capture_default_str();
  tune->add_option("--budget-seconds", a.budget_seconds,
                   "The search's time limit: a candidate starts only if one as long as the last still ends within it")
      ->check(positive_number())
      ->capture_default_str();
  tune->add_option("--family", a.family,
                   "What to tune: gemm, attention (devices that are not CPUs) or all (the GEMM, then the attention "
                   "where it is tuned)")
      ->check(CLI::IsMember({"gemm", "attention", "all"}))
      ->capture_default_str();
  tune->add_flag("--json", a.json, "End with one JSON line of results per family tuned on stdout");
  tune->add_flag("--quiet", a.quiet, "No progress output");
  tune->add_flag("--force", a.force,
                 "Save the winners even over cached ones from searches that measured more candidates");
  return tune;
}

// Flags given for another model or phase mode are refused, not ignored.
void check_flags_apply(const CLI::App& command, const TrainArgs& t) {
  // `ferry train` and `ferry plan` (which has the model's options only) share the checks.
  const auto given = [&](const char* flag) {
    const CLI::Option* o = command.get_option_no_throw(flag);
    return o != nullptr && o->count() > 0;
  };
  const bool gpt = t.model == "gpt";
  for (const char* flag : {"--steps", "--max-minutes", "--eval-every", "--val-windows", "--sample", "--prompt",
                           "--temperature", "--text", "--dropout"}) {
    if (!gpt && given(flag)) {
      // Of the GPT's length settings, say what bounds this model's run instead; of the others, only
      // which model they serve.
      const std::string f = flag;
      const bool length = f == "--steps" || f == "--max-minutes" || f == "--eval-every";
      throw std::invalid_argument(fmt::format(
          "{} applies to --model gpt only{}", flag,
          length
              ? fmt::format("; --model {} trains for --epochs{}", t.model, f == "--steps" ? " (and --train-limit)" : "")
              : fmt::format(" (the character-level GPT); --model {} has no such setting", t.model)));
    }
  }
  for (const char* flag : {"--epochs", "--train-limit", "--data", "--eval-int8"}) {
    if (gpt && given(flag)) {
      throw std::invalid_argument(fmt::format(
          "{} applies to the Fashion-MNIST models (mlp, cnn, deep); --model gpt trains for --steps on --text", flag));
    }
  }
  if (t.phase_config.predict_int8 && t.phases != "hybrid") {
    throw std::invalid_argument("--predict-int8 applies to Predict steps, which only --phases hybrid runs");
  }
  // Each flag below changes nothing unless its condition holds: given without it, it is a mistake
  // the run would hide.
  const auto is_compressed = [](const std::string& home) {
    return !home.empty() && cli_home(home) == ferry::graph::Home::host_compressed;
  };
  const bool compressed = is_compressed(t.weights_home) || is_compressed(t.state_home);
  const auto fetched = [](const std::string& home) {  // kept in host memory and fetched to the device
    if (home.empty()) return false;
    const ferry::graph::Home h = cli_home(home);
    return h == ferry::graph::Home::host_pinned || h == ferry::graph::Home::host_compressed;
  };
  ferry::PrecisionConfig precision;
  precision.compute = parse_precision(t.precision);
  precision.scaling = parse_loss_scaling(t.loss_scaling);
  const bool scaled = precision.scaled();
  const struct {
    std::vector<const char*> flags;
    bool applies;
    const char* when;
  } conditional[] = {
      {{"--width", "--depth"}, t.model == "deep" || gpt, "to --model deep and gpt (mlp and cnn have fixed sizes)"},
      {{"--heads", "--context", "--attention"}, gpt, "to --model gpt only"},
      {{"--momentum"}, t.optimizer == "sgd", "to --optimizer sgd only"},
      {{"--optimizer-block"}, t.optimizer == "adamw8bit", "to --optimizer adamw8bit only"},
      {{"--compress-chunk", "--compress-level", "--compress-workers"},
       compressed,
       "to a compressed home only (--state-home compressed or --weights-home compressed)"},
      {{"--predictor", "--predictor-beta", "--warmup-steps", "--min-full-steps", "--max-predict", "--confidence",
        "--predictor-residual", "--fit-every", "--predict-decay", "--max-loss-gap"},
       t.phases == "hybrid",
       "to --phases hybrid only"},
      {{"--trace-steps"},
       !t.trace_path.empty() || !t.profile_path.empty(),
       "to --trace and --profile only (the steps they record)"},
      {{"--prompt", "--temperature"}, t.sample > 0, "with --sample only (the text generated after training)"},
      {{"--weight-decay-on"}, t.weight_decay > 0, "with a --weight-decay above 0 only"},
      {{"--initial-loss-scale", "--loss-scale-interval"},
       scaled,
       "with loss scaling only (--precision fp16, or bf16 with --loss-scaling on)"},
      // (ferry train's rank count is known only under mpirun, where one rank warns of --bucket-size.)
      {{"--bucket-size", "--network-gbps"},
       command.get_name() != "plan" || t.plan_ranks >= 2,
       "to a plan of several ranks only (--ranks N, N >= 2): one rank sums and sends nothing"},
      {{"--host-memory", "--staging-chunk", "--lookahead", "--transfer-slack"},
       t.residency != "resident" || fetched(t.weights_home) || fetched(t.state_home),
       "to tensors fetched from host memory, which --residency resident has none of unless --weights-home or "
       "--state-home host or compressed puts them there"},
  };
  for (const auto& c : conditional) {
    for (const char* flag : c.flags) {
      if (!c.applies && given(flag)) {
        throw std::invalid_argument(
            fmt::format("{} applies {}: leave it out, or give what it applies to", flag, c.when));
      }
    }
  }
}

// `ferry plan`: the model's options and the rates of the step-time prediction.
CLI::App* add_plan_command(CLI::App& app, TrainArgs& t) {
  auto* plan = app.add_subcommand(
      "plan",
      "Print the device bytes of each phase of a model's step (weights, gradients, optimizer state, activations), "
      "the smallest budget it runs in, and the configuration to use for --device-budget");
  add_model_options(plan, t);
  add_rate_options(plan, t);
  plan->add_option("--ranks", t.plan_ranks,
                   "Plan rank 0 of a data-parallel run over N ranks (mpirun -np N ferry train ...): its share of "
                   "--batch (the global batch), and with --zero its shares of the state")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  plan->add_option("--zero", t.zero, "With --ranks: the ZeRO stage (0, 1 or 2), as ferry train's")
      ->check(CLI::Range(0, 2))
      ->capture_default_str();
  plan->add_option("--bucket-size", t.bucket_size, "With --ranks: gradient bytes summed together, as ferry train's")
      ->capture_default_str();
  return plan;
}

namespace {

// `ferry train` and its options.
CLI::App* add_train_command(CLI::App& app, TrainArgs& t) {
  auto* train = app.add_subcommand("train",
                                   "Train a model: an MLP, CNN or deep MLP on Fashion-MNIST (test accuracy at the "
                                   "end), or a GPT on English text (validation loss)");
  add_model_options(train, t);
  train->add_option("--epochs", t.epochs, "Passes over the training set (Fashion-MNIST models)")
      ->check(positive_number())
      ->capture_default_str();
  train->add_option("--lr", t.lr, "Peak learning rate (gpt: 0.002)")->check(positive_number())->capture_default_str();
  train->add_option("--schedule", t.schedule, "Learning rate schedule: cosine or constant")->capture_default_str();
  train->add_option("--dropout", t.dropout, "gpt: dropout probability")->check(CLI::Range(0.0, 0.95));
  train
      ->add_option("--steps", t.steps,
                   "gpt: training steps, each a batch of --batch windows (default 2000; with --accumulate k, every k "
                   "of them make one optimizer update)")
      ->check(positive_number());
  train->add_option("--max-minutes", t.max_minutes, "gpt: stop training after this many minutes")
      ->check(positive_number());
  train->add_option("--eval-every", t.eval_every, "gpt: steps between validation losses (default 250)")
      ->check(positive_number());
  train
      ->add_option("--val-windows", t.val_windows,
                   "gpt: held-out windows each validation loss averages over (fewer: faster reports, e.g. for a "
                   "large streamed model)")
      ->check(positive_number())
      ->capture_default_str();
  train->add_option("--sample", t.sample, "gpt: characters of text to generate after training");
  train
      ->add_option("--prompt", t.prompt,
                   "gpt: text the sample continues (default: a newline); of a prompt longer than --context, the "
                   "model sees the last --context characters")
      ->check(not_empty());
  train
      ->add_option("--temperature", t.temperature,
                   "gpt: sampling temperature (below 0.001 it samples as 0.001: all but always the likeliest "
                   "character)")
      ->check(positive_number())
      ->capture_default_str();
  train->add_option("--text", t.text_dir, "gpt: folder of text files (default: $FERRY_TEXT_DIR or Debian's fortunes)")
      ->check(not_empty());
  train
      ->add_option("--data", t.data_dir,
                   "Folder with the Fashion-MNIST .gz files (default: $FERRY_DATA_DIR or Debian's)")
      ->check(not_empty());
  train->add_option("--train-limit", t.train_limit, "Use only the first N training samples (quick runs)")
      ->check(positive_number());
  train->add_option("--trace", t.trace_path, "Write a Chrome trace of the first steps' device timeline")
      ->check(not_empty());
  train->add_option("--trace-steps", t.trace_steps, "Steps to trace (and to profile), from the first (1 or more)")
      ->capture_default_str();
  train
      ->add_option("--check-weights-every", t.check_weights_every,
                   "Also read every weight back after every N optimizer updates and check it is finite (0: never; "
                   "each update already checks the weights it writes on the device, and a non-finite loss always "
                   "reads them)")
      ->capture_default_str();
  train
      ->add_option("--profile", t.profile_path,
                   "Write a CSV memory profile: device bytes per node, transfers and their device times")
      ->check(not_empty());
  train->add_flag("--quiet", t.quiet, "No progress output");
  train
      ->add_option("--profile-phases", t.profile_phases_path,
                   "Write a CSV of device bytes per phase's step and section: peak (and where), mean, min, spikes")
      ->check(not_empty());
  train
      ->add_option("--checkpoint", t.checkpoint_path,
                   "Write the whole training state to this file after every epoch (gpt: after every validation), "
                   "at the end, and when stopped by SIGINT, SIGTERM or SIGHUP (atomically; docs/checkpoints.md)")
      ->check(not_empty());
  train
      ->add_option("--resume", t.resume_path,
                   "Continue the run a --checkpoint file holds, up to --epochs (gpt: --steps), exactly as if it had "
                   "not stopped (give the same options)")
      ->check(not_empty());
  train->add_flag("--force", t.force,
                  "Let --checkpoint, --trace and --profile* replace an existing file that ferry did not write, and "
                  "--checkpoint another run's checkpoint (starting over instead of resuming it); never a device "
                  "node, folder, link or one of the run's inputs, and --trace or --profile* never a checkpoint");
  train
      ->add_option("--zero", t.zero,
                   "Data parallel (mpirun -np N ferry train ...): the ZeRO stage; 0 keeps all optimizer state on every "
                   "rank, 1 gives each rank the state of its share of the weights, 2 also the reduced gradients of "
                   "its share alone (reduce-scattered)")
      ->check(CLI::Range(0, 2))
      ->capture_default_str();
  train
      ->add_option("--bucket-size", t.bucket_size,
                   "Data parallel: gradient bytes summed over the ranks together, each bucket as soon as backward "
                   "has finished it (e.g. 25MiB)")
      ->capture_default_str();
  train
      ->add_option("--rank-timeout-minutes", t.rank_timeout_minutes,
                   "Data parallel: end every rank (exit status 124) when set-up, or a step, evaluation or "
                   "checkpoint, has not finished for this long: another rank stopped, hung or was lost (0: wait "
                   "forever)")
      ->check(non_negative_number())
      ->capture_default_str();
  train->add_flag("--eval-int8", t.eval_int8,
                  "Also evaluate the final model with every layer's weight but the head's read as int8 "
                  "(JSON: test_accuracy_int8)");
  return train;
}

int run_ferry(int argc, char** argv) {
  CLI::App app{"ferry: train neural networks on any OpenCL device"};
  app.failure_message(failure_message);
  app.require_subcommand(1);
  app.set_version_flag(
      "--version", [] { return ferry::version_text("ferry"); },
      "Print the version, git commit and the OpenCL devices seen, and exit");
  auto* devices = app.add_subcommand("devices", "List OpenCL devices (index, platform, name)");
  TrainArgs t;
  CLI::App* train = add_train_command(app, t);
  CLI::App* plan = add_plan_command(app, t);
  TuneArgs tune_args;
  CLI::App* tune = add_tune_command(app, tune_args);
  CheckpointArgs checkpoint_args;
  auto* checkpoint = app.add_subcommand(
      "checkpoint",
      "Describe a checkpoint: model, optimizer, batch, precision, phases, updates done, the training settings a "
      "resume must keep and its tensors, after verifying every byte (no device needed)");
  checkpoint->add_option("file", checkpoint_args.path, "The checkpoint (ferry train --checkpoint)")->required();
  checkpoint->add_flag("--json", checkpoint_args.json, "One JSON line (docs/outputs.md)");
  CLI11_PARSE(app, argc, argv);
  t.lr_given = train->count("--lr") > 0;
  t.bucket_size_given = train->count("--bucket-size") > 0;
  t.argv.assign(argv, argv + argc);
  try {
    if (devices->parsed()) return cmd_devices();
    if (train->parsed()) check_flags_apply(*train, t);
    if (plan->parsed()) check_flags_apply(*plan, t);
    if (train->parsed()) join_ranks(t);  // under mpirun: MPI's world
    // Before any data is loaded or step run: rank 0's outputs, and under ZeRO stage 1 each rank's
    // own checkpoint file ("<path>.rank<r>").
    if (train->parsed() && (t.primary || t.sharded_checkpoint)) check_outputs(t);
    if (train->parsed()) return t.model == "gpt" ? cmd_train_gpt(t) : cmd_train(t);
    if (plan->parsed()) return cmd_plan(t);
    if (tune->parsed()) return cmd_tune(tune_args);
    if (checkpoint->parsed()) return cmd_checkpoint(checkpoint_args);
  } catch (const ferry::ops::TuneStopped& e) {  // a signal during first-use tuning: as a stopped run
    std::cerr << "ferry: " << e.what() << "\n";
    return 128 + e.signal;
  } catch (const std::exception& e) {
    end_all_ranks_on_error(t, e);  // data parallel: does not return
    std::cerr << "ferry: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ferry::reserve_standard_streams();
  const int status = run_ferry(argc, argv);
  if (const auto lost = ferry::standard_output_failure()) {
    std::cerr << "ferry: error: " << *lost << "\n";
    // Lost results outrank a missing trace or profile (3 says the results are there); a signal's
    // status stays, the run having stopped before it finished.
    return status == 0 || status == ferry::cli::exit_side_output_failed ? 1 : status;
  }
  return status;
}
