// `ferry train --model gpt`: a character-level GPT on the fortune files, with a held-out tail,
// validation loss in nats per character, and text sampled from the trained model.
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <deque>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>

#include "cli.hpp"
#include "ferry/runtime/text_corpus.hpp"
#include "ops/attention.hpp"
#include "ops/gemm_tune.hpp"

namespace ferry::cli {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint32_t default_eval_every = 250;  // --eval-every not given

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The window of one prompt for prediction: the last `context` tokens at the start, zeros after
// (causal attention: the logits at position len - 1 do not see what follows).
class PromptWindow final : public DataSource {
 public:
  explicit PromptWindow(std::uint32_t context) : tokens_(context, 0) {}
  std::size_t set(std::span<const std::int32_t> text) {
    const std::size_t n = std::min(text.size(), tokens_.size());
    std::fill(tokens_.begin(), tokens_.end(), 0);
    std::copy(text.end() - static_cast<std::ptrdiff_t>(n), text.end(), tokens_.begin());
    return n;
  }
  std::size_t size() const override { return 1; }
  void read(std::string_view name, std::size_t, std::size_t, std::span<std::byte> out) const override {
    if (name != "tokens") throw std::invalid_argument(fmt::format("a prompt provides 'tokens', not '{}'", name));
    std::memcpy(out.data(), tokens_.data(), out.size());
  }

 private:
  std::vector<std::int32_t> tokens_;
};

// `count` characters continuing `prompt`, each drawn from softmax(logits / temperature).
// Stops between characters on SIGINT / SIGTERM / SIGHUP (a second one ends the process): `stopped_by` is
// then the signal, and the text is what was sampled so far.
std::string sample_text(Trainer& trainer, const TextCorpus& corpus, std::uint32_t context, const std::string& prompt,
                        std::uint32_t count, float temperature, std::uint64_t seed, int& stopped_by) {
  const StopSignals signals;
  stopped_by = 0;
  std::vector<std::int32_t> text = corpus.encode(prompt);
  const std::size_t prompt_len = text.size();
  const std::uint32_t vocab = corpus.vocab_size();
  std::mt19937_64 rng(seed);
  PromptWindow window(context);
  std::vector<double> p(vocab);
  for (std::uint32_t i = 0; i < count; ++i) {
    if ((stopped_by = StopSignals::received()) != 0) break;
    const std::size_t n = window.set(text);
    const Trainer::HostTensor logits = trainer.predict(window);
    const auto* row = reinterpret_cast<const float*>(logits.bytes.data()) + (n - 1) * vocab;
    const float t = std::max(temperature, 1e-3f);
    const float top = *std::max_element(row, row + vocab);
    for (std::uint32_t v = 0; v < vocab; ++v) p[v] = std::exp((row[v] - top) / t);
    std::discrete_distribution<std::int32_t> pick(p.begin(), p.end());
    text.push_back(pick(rng));
  }
  return corpus.decode(std::span(text).subspan(prompt_len));
}

// --sample after training: the text, printed also with --quiet (which silences progress, not
// results). A signal stops it early: said here, `stopped_by` set, the results still follow.
std::string print_sample(const TrainArgs& a, Trainer& trainer, const TextCorpus& corpus, std::uint32_t context,
                         int& stopped_by) {
  if (!a.quiet) std::cerr << fmt::format("ferry: sampling {} characters (SIGINT stops it)\n", a.sample);
  const std::string sample =
      sample_text(trainer, corpus, context, a.prompt, a.sample, a.temperature, a.seed, stopped_by);
  std::cerr << "ferry: sample:\n" << a.prompt << sample << "\n";
  if (stopped_by != 0) {  // training is done (and checkpointed)
    std::cerr << fmt::format("ferry: sampling stopped by {} after {} of {} characters; training had finished{}\n",
                             StopSignals::name(stopped_by), sample.size(), a.sample,
                             a.checkpoint_path.empty() ? "" : fmt::format(" (checkpoint {})", a.checkpoint_path));
  }
  return sample;
}

// What `ferry train --model gpt` keeps in a checkpoint's caller section besides the trainer's
// state and the loop's position: where the draw of windows stands, and the validation reports.
struct Validation {
  nlohmann::json curve = nlohmann::json::array();  // {step, seconds, val_loss} per report
  double val_loss = 0;                             // the newest report's
};

// A checksum of the text (its character ids, training and held-out part): data-parallel ranks
// compare theirs, and a checkpoint keeps it so that a resume on another text is refused.
std::uint64_t corpus_checksum(const TextCorpus& corpus) {
  return ferry::checkpoint_checksum(corpus.ids.data(), corpus.ids.size() * sizeof(corpus.ids[0]));
}

std::vector<std::byte> encode_position(const TrainArgs& a, const TextCorpus& corpus, std::uint64_t text_checksum,
                                       const RandomWindows& windows, std::uint32_t steps, const LoopPosition& p,
                                       const Validation& v) {
  const nlohmann::json j = {{"kind", "ferry train --model gpt"},
                            {"version", 1},
                            {"seed", a.seed},
                            {"train_characters", corpus.train_end},
                            {"vocab", corpus.vocab_size()},
                            {"data_checksum", text_checksum},
                            {"schedule", a.schedule},
                            {"lr", a.lr},
                            {"steps", steps},
                            {"done", p.done},
                            {"windows", windows.state()},
                            {"recent", p.recent},
                            {"curve", v.curve},
                            {"train_seconds", p.train_seconds},
                            {"eval_seconds", p.boundary_seconds},
                            {"val_loss", v.val_loss}};
  return caller_section(j);
}

// Reads back what encode_position wrote into `windows`, the loop's position and `v`, after checking
// it belongs to this command line; throws std::invalid_argument naming what differs.
LoopPosition decode_position(const std::vector<std::byte>& bytes, const TrainArgs& a, const TextCorpus& corpus,
                             std::uint64_t text_checksum, std::uint32_t steps, RandomWindows& windows, Validation& v) {
  const auto fail = [&](const std::string& what) { return resume_error(a, what); };
  const nlohmann::json j = read_caller_section(bytes, a, "ferry train --model gpt");
  LoopPosition p;
  try {
    if (j.at("version").get<int>() != 1) throw fail("its ferry train --model gpt section has another version");
    if (j.at("seed").get<std::uint64_t>() != a.seed) {
      throw fail(fmt::format("it was trained with --seed {}, not {}: resume with --seed {}",
                             j.at("seed").get<std::uint64_t>(), a.seed, j.at("seed").get<std::uint64_t>()));
    }
    if (j.at("train_characters").get<std::size_t>() != corpus.train_end ||
        j.at("vocab").get<std::uint32_t>() != corpus.vocab_size()) {
      throw fail(fmt::format(
          "it was trained on a text of {} characters ({} distinct), this one has {} ({}): resume with the same --text",
          j.at("train_characters").get<std::size_t>(), j.at("vocab").get<std::uint32_t>(), corpus.train_end,
          corpus.vocab_size()));
    }
    check_same_data(j, text_checksum, a, "--text");
    if (j.at("schedule").get<std::string>() != a.schedule || j.at("lr").get<float>() != a.lr) {
      throw fail(fmt::format("it was trained with --schedule {} --lr {}, not --schedule {} --lr {}: resume with those",
                             j.at("schedule").get<std::string>(), j.at("lr").get<float>(), a.schedule, a.lr));
    }
    p.done = j.at("done").get<std::uint32_t>();
    if (p.done > steps) {
      throw fail(
          fmt::format("it is past step {} already (at step {}): give --steps {} or more", steps, p.done, p.done));
    }
    windows.restore(j.at("windows").get<std::string>());
    p.recent = j.at("recent").get<std::vector<float>>();
    if (p.recent.size() > LoopPosition::recent_losses) throw fail("its recent losses are too many");
    v.curve = j.at("curve");
    // A run that ended off the --eval-every grid reported once more at its end; the run resumed
    // past that step would not have, so its point goes (the curve then is the straight run's).
    const std::uint32_t every = a.eval_every ? a.eval_every : default_eval_every;
    if (p.done < steps && p.done % every != 0 && !v.curve.empty() &&
        v.curve.back().at("step").get<std::uint64_t>() == p.done) {
      v.curve.erase(v.curve.end() - 1);
    }
    p.train_seconds = j.at("train_seconds").get<double>();
    p.boundary_seconds = j.at("eval_seconds").get<double>();
    v.val_loss = j.at("val_loss").get<double>();
    if (const auto was = j.at("steps").get<std::uint32_t>(); a.primary && was != steps && a.schedule != "constant") {
      std::cerr << fmt::format(
          "ferry: note: the checkpoint's run had --steps {}; its {} schedule now spans {} steps, so the learning "
          "rates from here differ from that run's\n",
          was, a.schedule, steps);
    }
  } catch (const nlohmann::json::exception& e) {
    throw fail(fmt::format("its ferry train --model gpt section is incomplete ({})", e.what()));
  }
  return p;
}

// The model `a` asks for over the corpus's characters. Both parts of the text must hold one window
// of context + 1 characters: an error says so before any work.
models::GptConfig gpt_config(const TrainArgs& a, const TextCorpus& corpus) {
  models::GptConfig c;
  c.vocab = corpus.vocab_size();
  c.width = a.width ? a.width : 192;
  c.depth = a.depth ? a.depth : 4;
  c.heads = a.heads;
  c.fused_attention = a.attention != "unfused";
  c.context = a.context;
  c.dropout = a.dropout;
  const std::size_t held_out = corpus.ids.size() - corpus.train_end;
  const std::size_t shorter_part = std::min<std::size_t>(corpus.train_end, held_out);
  if (shorter_part < std::uint64_t{c.context} + 1) {
    throw std::invalid_argument(fmt::format(
        "the text has {} characters ({} to train on, {} held out for validation), too few for one window of "
        "--context {} + 1 in each part: {}",
        corpus.ids.size(), corpus.train_end, held_out, c.context,
        shorter_part >= 2
            ? fmt::format("use --context {} or less, or give --text a folder with more text", shorter_part - 1)
            : std::string("give --text a folder with more text")));
  }
  return c;
}

// The set-up lines: the model, its device, the text and where the state lives.
void announce_gpt(const Runtime& runtime, const Trainer& trainer, double compile_s, const TextCorpus& corpus,
                  const TextWindows& val, std::uint32_t context, std::uint32_t val_windows_asked) {
  // Fewer windows than --val-windows asked for: said here and in --json's `val_windows`.
  const std::string fewer =
      val.size() < val_windows_asked
          ? fmt::format("; fewer than --val-windows {}: the held-out text holds no more", val_windows_asked)
          : std::string();
  std::cerr << fmt::format(
      "ferry: {} on {} ({}); {} parameters; training state {}; compiled in {:.1f} s\n"
      "ferry: text: {} files, {} characters ({} distinct), {} held out ({} validation windows of {}{})\n",
      trainer.model().name, runtime.device().name, runtime.device().type_name(), trainer.parameter_count(),
      format_bytes(trainer.training_state_bytes()), compile_s, corpus.files, corpus.ids.size(), corpus.vocab_size(),
      corpus.ids.size() - corpus.train_end, val.size(), context, fewer);
}

// Where the state lives, and what an explicit --recompute costs where it buys nothing.
void announce_residency(Runtime& runtime, const Trainer& trainer, const TrainerOptions& opt) {
  const bool on_host = trainer.residency().mode != graph::ResidencyMode::resident;
  std::cerr << fmt::format("ferry: residency {}: device peak {} of a {} budget (planned){}{}\n",
                           graph::residency_mode_name(trainer.residency().mode),
                           format_bytes(trainer.device_peak_bytes()), format_bytes(trainer.device_budget_bytes()),
                           budget_from_free_memory_note(trainer),
                           on_host ? fmt::format("; {} in {} host memory", format_bytes(trainer.host_state_bytes()),
                                                 offload::host_memory_name(trainer.host_memory()))
                                   : std::string());
  std::cerr << recompute_cost_note(runtime, trainer.model(), opt);
}

// The GPT's own fields of the --json line: its shape, losses, rates and validation curve.
void add_gpt_fields(nlohmann::json& j, const TrainArgs& a, const models::GptConfig& c, const LoopSummary& run,
                    const Validation& validation, std::size_t val_windows, double tokens_per_s, double compile_s) {
  const std::uint64_t done = run.position.done;
  const double train_seconds = run.position.train_seconds;
  j.update({{"vocab", c.vocab},
            {"width", c.width},
            {"depth", c.depth},
            {"heads", c.heads},
            {"context", c.context},
            {"attention", a.attention},
            {"steps", done},
            {"train_loss", run.position.recent_loss()},
            {"val_loss", validation.val_loss},
            {"val_windows", val_windows},  // what val_loss ran over: at most --val-windows
            {"tokens_per_s", tokens_per_s},
            {"step_ms", 1e3 * train_seconds / static_cast<double>(done)},
            {"train_seconds", train_seconds},
            {"eval_seconds", run.position.boundary_seconds},
            {"checkpoint_seconds", run.checkpoint_seconds},
            {"compile_s", compile_s},
            {"curve", validation.curve}});
}

// The GPT's learning rates: cosine, a warm-up of a tenth of the updates (at most 100), then down
// to a tenth of --lr; constant, --lr at every update (no warm-up, whose length would depend on
// --steps: a resume to more steps would then train other numbers than the straight run). The
// schedule counts optimizer updates: `steps` micro-batches over `accumulate`.
LrSchedule gpt_schedule(const TrainArgs& a, std::uint32_t steps, std::uint32_t accumulate) {
  LrSchedule schedule;
  schedule.kind = parse_schedule(a.schedule);
  schedule.peak = a.lr;
  schedule.total_steps = updates_in(steps, accumulate);
  if (schedule.kind == LrSchedule::Kind::cosine)
    schedule.warmup_steps = std::min<std::uint64_t>(100, schedule.total_steps / 10);
  schedule.min_lr = a.lr / 10;
  schedule.validate();
  return schedule;
}

// The fused attention's kernel family and tiles on this device (tuned on GPUs), as the GEMM's row.
void add_attention_kernel(nlohmann::json& j, Runtime& runtime, const models::GptConfig& c, std::uint32_t batch) {
  j["attention_kernel"] = c.fused_attention ? ops::attention_kernel_description(
                                                  runtime.env(), {batch, c.context, c.heads, c.width / c.heads})
                                            : std::string("unfused");
}

}  // namespace

// Before any work: the run makes at least one update, and the prompt its sample continues is
// made of the text's characters (not found out after the training it follows).
void check_run_makes_sense(const TrainArgs& a, const TextCorpus& corpus, std::uint32_t steps) {
  if (steps < a.accumulate) {
    throw std::invalid_argument(fmt::format(
        "--accumulate {} makes one optimizer update of every {} steps, but this run has {} (--steps): it would "
        "train nothing; give --steps {} or more, or a smaller --accumulate",
        a.accumulate, a.accumulate, steps, a.accumulate));
  }
  note_micro_batches_left_over(a, steps, "--steps");
  if (a.sample == 0) return;
  try {
    (void)corpus.encode(a.prompt);
  } catch (const std::invalid_argument& e) {
    if (a.prompt == "\n") {  // the default, or given as it
      throw std::invalid_argument(fmt::format(
          "--prompt is a newline (its default) and this text has none ({}): give --prompt with characters of the "
          "text (checked before training)",
          e.what()));
    }
    throw std::invalid_argument(
        fmt::format("--prompt: {}: give a prompt made of the text's characters (checked before training)", e.what()));
  }
}

// The runtime a run trains on: its rank's device, profiling where a trace or profile is written, and
// first-use tuning without progress output under --quiet.
RuntimeOptions runtime_options(const TrainArgs& a) {
  return {.device = a.device,
          .local_rank = a.world ? ferry::local_rank() : 0,
          .profiling = !a.trace_path.empty() || !a.profile_path.empty(),
          .tune_progress = !a.quiet};
}

int cmd_train_gpt(const TrainArgs& args) {
  TrainArgs a = args;
  if (!a.lr_given) a.lr = 2e-3f;  // the small decoder trains faster at 2e-3 than at the classifiers' 1e-3
  const TextCorpus corpus = load_text_corpus(fortune_files(a.text_dir), 0.1);
  const models::GptConfig c = gpt_config(a, corpus);

  Runtime runtime(runtime_options(a));
  TrainerOptions opt;
  const std::uint32_t batch = a.batch ? a.batch : 32;  // the global batch, over all ranks
  configure_trainer(a, opt);
  const Shard shard = configure_ranks(a, batch, opt);
  const std::uint32_t steps = a.steps ? a.steps : 2000;
  check_run_makes_sense(a, corpus, steps);
  const LrSchedule schedule = gpt_schedule(a, steps, opt.accumulate);

  announce_setup(a, runtime, models::gpt(c), opt);
  const auto compile_start = Clock::now();
  Trainer trainer(runtime, models::gpt(c), opt);
  const double compile_s = seconds_since(compile_start);
  const TextWindows val = TextWindows::held_out(corpus, c.context, a.val_windows);
  if (!a.quiet) {
    announce_gpt(runtime, trainer, compile_s, corpus, val, c.context, a.val_windows);
    announce_ranks(a, trainer, batch);
    announce_residency(runtime, trainer, opt);
  }

  const std::uint32_t t = c.context;
  RandomWindows windows(corpus, t, batch, a.seed, shard);
  ChromeTrace trace;
  MemoryProfiler profiler;
  profiler.add_training_step(trainer);
  Validation validation;
  const std::uint64_t text_checksum = corpus_checksum(corpus);  // read once: checkpoints and ranks compare it
  TrainingLoop loop(trainer, windows,
                    {.steps = steps,
                     .boundary_every = a.eval_every ? a.eval_every : default_eval_every,
                     .max_seconds = a.max_minutes * 60,
                     .schedule = schedule,
                     .units_per_step = std::uint64_t{batch} * t,
                     .unit = "tokens",
                     .progress = !a.quiet,
                     .acknowledge_stop = a.primary,  // mpirun signals every rank: rank 0 says it
                     .checkpoint = a.checkpoint_path,
                     .caller_section =
                         [&](const LoopPosition& p) {
                           return encode_position(a, corpus, text_checksum, windows, steps, p, validation);
                         },
                     .checkpoint_options = {.replace_foreign_file = a.force},
                     // Data parallel: rank 0 writes the state all ranks hold, unless each holds its
                     // own share of the optimizer state (ZeRO stage 1: each writes its file).
                     .write_checkpoints = a.primary || a.sharded_checkpoint,
                     .after_checkpoint = [&a] { remove_stale_shards(a); },
                     .control = a.control,
                     .rank_timeout_seconds = a.rank_timeout_minutes * 60,
                     // Data parallel: every rank must read the same text (the ranks compare it).
                     .data_fingerprint = a.control ? text_checksum : 0});
  if (!a.resume_path.empty()) {
    const auto load_start = Clock::now();
    const auto caller = load_resume(trainer, a);
    const LoopPosition start = decode_position(caller, a, corpus, text_checksum, steps, windows, validation);
    loop.resume(start);
    if (!a.quiet) {
      std::cerr << fmt::format("ferry: resumed from {}{} at step {} of {} (loaded in {:.0f} ms)\n", a.resume_path,
                               resume_note(a), start.done, steps, 1e3 * seconds_since(load_start));
    }
  }
  // Every rank, resumed or not (one that was not would otherwise miss the agreement).
  check_ranks_resumed_together(a, !a.resume_path.empty(), trainer.steps_done());
  const auto run_start = Clock::now();
  loop.on_step = [&](std::uint64_t step, std::uint64_t run_index, const StepResult&) {
    if (run_index >= a.trace_steps) return;  // the first --trace-steps steps of this run
    if (!a.trace_path.empty()) trace.add_step(trainer, run_index);
    if (!a.profile_path.empty()) profiler.add_last_step(trainer, step);
  };
  loop.on_boundary = [&](const LoopPosition& p) {
    if (a.primary) {  // (the same weights on every rank)
      validation.val_loss = trainer.evaluate(val).loss;
      validation.curve.push_back(
          {{"step", p.done}, {"seconds", seconds_since(run_start)}, {"val_loss", validation.val_loss}});
    }
    if (!a.quiet) {
      std::cerr << fmt::format("step {}/{}: train loss {:.4f}, val loss {:.4f} nats/char, {:.0f} tokens/s, {}\n",
                               p.done, steps, p.recent_loss(), validation.val_loss,
                               static_cast<double>(p.done) * batch * t / p.train_seconds,
                               format_duration(seconds_since(run_start)));
    }
  };
  const LoopSummary run = run_loop(loop, a);
  if (run.end == LoopSummary::End::stopped) {
    report_stop(a, run, trace, trainer, profiler, fmt::format("step {}/{}", run.position.done, steps));
    return 128 + run.signal;
  }
  if (run.end == LoopSummary::End::out_of_time && !a.quiet) {
    std::cerr << fmt::format("ferry: stopped after {} minutes (--max-minutes)\n", a.max_minutes);
  }
  const std::uint64_t done = run.position.done;
  const double train_seconds = run.position.train_seconds;
  std::vector<std::string> output_errors;
  write_run_outputs(a, trainer, trace, profiler, run.steps_run, output_errors);
  const double tokens_per_s = static_cast<double>(done) * batch * t / train_seconds;
  int sample_stopped_by = 0;
  const std::string sample = a.sample ? print_sample(a, trainer, corpus, t, sample_stopped_by) : std::string();
  if (!a.quiet) {
    std::cerr << fmt::format("ferry: val loss {:.4f} nats/char after {} steps, {:.0f} tokens/s, {:.1f} ms/step\n",
                             validation.val_loss, done, tokens_per_s, 1e3 * train_seconds / done);
  }
  if (a.json) {
    nlohmann::json j = common_train_summary(a, runtime, trainer, batch, output_errors);
    add_gpt_fields(j, a, c, run, validation, val.size(), tokens_per_s, compile_s);
    add_attention_kernel(j, runtime, c, batch);
    if (a.sample) j["sample"] = sample;
    if (sample_stopped_by != 0) j["sample_stopped"] = true;
    // Sampled text may hold bytes that are not UTF-8 (the corpus is bytes): replaced in the JSON.
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
  }
  if (sample_stopped_by != 0) return 128 + sample_stopped_by;
  return train_exit_status(output_errors);
}

}  // namespace ferry::cli
