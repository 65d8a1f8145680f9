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
#include "ferry/ops/gemm_tune.hpp"
#include "ferry/runtime/text_corpus.hpp"

namespace ferry::cli {
namespace {

using Clock = std::chrono::steady_clock;

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
std::string sample_text(Trainer& trainer, const TextCorpus& corpus, std::uint32_t context, const std::string& prompt,
                        std::uint32_t count, float temperature, std::uint64_t seed) {
  std::vector<std::int32_t> text = corpus.encode(prompt.empty() ? std::string("\n") : prompt);
  const std::size_t prompt_len = text.size();
  const std::uint32_t vocab = corpus.vocab_size();
  std::mt19937_64 rng(seed);
  PromptWindow window(context);
  std::vector<double> p(vocab);
  for (std::uint32_t i = 0; i < count; ++i) {
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

// What `ferry train --model gpt` keeps in a checkpoint's caller section besides the trainer's
// state: the steps done, where the draw of windows stands, and what its output sums up.
struct GptPosition {
  std::uint32_t done = 0;
  std::deque<float> recent;  // the last 20 steps' losses
  nlohmann::json curve = nlohmann::json::array();
  double train_seconds = 0, eval_seconds = 0, val_loss = 0;
};

std::vector<std::byte> encode_position(const TrainArgs& a, const TextCorpus& corpus, const RandomWindows& windows,
                                       std::uint32_t steps, const GptPosition& p) {
  const nlohmann::json j = {{"kind", "ferry train --model gpt"},
                            {"version", 1},
                            {"seed", a.seed},
                            {"train_characters", corpus.train_end},
                            {"vocab", corpus.vocab_size()},
                            {"schedule", a.schedule},
                            {"lr", a.lr},
                            {"steps", steps},
                            {"done", p.done},
                            {"windows", windows.state()},
                            {"recent", std::vector<float>(p.recent.begin(), p.recent.end())},
                            {"curve", p.curve},
                            {"train_seconds", p.train_seconds},
                            {"eval_seconds", p.eval_seconds},
                            {"val_loss", p.val_loss}};
  return caller_section(j);
}

// Reads back what encode_position wrote into `windows` and `p`, after checking it belongs to this
// command line; throws std::invalid_argument naming what differs.
void decode_position(const std::vector<std::byte>& bytes, const TrainArgs& a, const TextCorpus& corpus,
                     std::uint32_t steps, RandomWindows& windows, GptPosition& p) {
  const auto fail = [&](const std::string& what) { return resume_error(a, what); };
  const nlohmann::json j = read_caller_section(bytes, a, "ferry train --model gpt");
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
    for (float l : j.at("recent").get<std::vector<float>>()) p.recent.push_back(l);
    p.curve = j.at("curve");
    p.train_seconds = j.at("train_seconds").get<double>();
    p.eval_seconds = j.at("eval_seconds").get<double>();
    p.val_loss = j.at("val_loss").get<double>();
    if (const auto was = j.at("steps").get<std::uint32_t>(); a.primary && was != steps && a.schedule != "constant") {
      std::cerr << fmt::format(
          "ferry: note: the checkpoint's run had --steps {}; its {} schedule now spans {} steps, so the learning "
          "rates from here differ from that run's\n",
          was, a.schedule, steps);
    }
  } catch (const nlohmann::json::exception& e) {
    throw fail(fmt::format("its ferry train --model gpt section is incomplete ({})", e.what()));
  }
}

}  // namespace

int cmd_train_gpt(const TrainArgs& args) {
  TrainArgs a = args;
  if (!a.lr_given) a.lr = 2e-3f;  // the small decoder trains faster at 2e-3 than at the classifiers' 1e-3
  const auto files = fortune_files(a.text_dir);
  const TextCorpus corpus = load_text_corpus(files, 0.1);
  models::GptConfig c;
  c.vocab = corpus.vocab_size();
  c.width = a.width ? a.width : 192;
  c.depth = a.depth ? a.depth : 4;
  c.heads = a.heads;
  c.fused_attention = a.attention != "unfused";
  c.context = a.context;
  c.dropout = a.dropout;
  // Both parts must hold one window of context + 1 characters; say so before any work.
  const std::size_t held_out = corpus.ids.size() - corpus.train_end;
  const std::size_t shorter_part = std::min<std::size_t>(corpus.train_end, held_out);
  if (shorter_part < c.context + 1u) {
    throw std::invalid_argument(fmt::format(
        "the text has {} characters ({} to train on, {} held out for validation), too few for one window of "
        "--context {} + 1 in each part: {}",
        corpus.ids.size(), corpus.train_end, held_out, c.context,
        shorter_part >= 2
            ? fmt::format("use --context {} or less, or give --text a folder with more text", shorter_part - 1)
            : std::string("give --text a folder with more text")));
  }

  Runtime runtime(
      {.device = a.device, .local_rank = a.world ? ferry::local_rank() : 0, .profiling = !a.trace_path.empty()});
  TrainerOptions opt;
  const std::uint32_t batch = a.batch ? a.batch : 32;  // the global batch, over all ranks
  configure_trainer(a, opt);
  const Shard shard = configure_ranks(a, batch, opt);
  const std::uint32_t steps = a.steps ? a.steps : 2000;
  LrSchedule schedule;
  schedule.kind = parse_schedule(a.schedule);
  schedule.peak = a.lr;
  schedule.total_steps = steps;
  schedule.warmup_steps = std::min<std::uint64_t>(100, steps / 10);
  schedule.min_lr = a.lr / 10;
  schedule.validate();

  announce_setup(a, runtime, models::gpt(c), opt);
  const auto compile_start = Clock::now();
  Trainer trainer(runtime, models::gpt(c), opt);
  const double compile_s = seconds_since(compile_start);
  const TextWindows val = TextWindows::held_out(corpus, c.context, 256);
  if (!a.quiet) {
    std::cerr << fmt::format(
        "ferry: {} on {} ({}); {} parameters; training state {}; compiled in {:.1f} s\n"
        "ferry: text: {} files, {} characters ({} distinct), {} held out ({} validation windows of {})\n",
        trainer.model().name, runtime.device().name, runtime.device().type_name(), trainer.parameter_count(),
        format_bytes(trainer.training_state_bytes()), compile_s, corpus.files, corpus.ids.size(), c.vocab,
        corpus.ids.size() - corpus.train_end, val.size(), c.context);
    announce_ranks(a, trainer, batch);
    const bool on_host = trainer.residency().mode != graph::ResidencyMode::resident;
    std::cerr << fmt::format("ferry: residency {}: device peak {} of a {} budget (planned){}\n",
                             graph::residency_mode_name(trainer.residency().mode),
                             format_bytes(trainer.device_peak_bytes()), format_bytes(trainer.device_budget_bytes()),
                             on_host ? fmt::format("; {} in {} host memory", format_bytes(trainer.host_state_bytes()),
                                                   offload::host_memory_name(trainer.host_memory()))
                                     : std::string());
  }

  const std::uint32_t t = c.context;
  RandomWindows windows(corpus, t, batch, a.seed, shard);
  const std::uint32_t eval_every = a.eval_every ? a.eval_every : 250;
  GptPosition pos;
  if (!a.resume_path.empty()) {
    const auto load_start = Clock::now();
    const auto caller = trainer.load_checkpoint(a.resume_path);
    decode_position(caller, a, corpus, steps, windows, pos);
    check_ranks_resumed_together(a, trainer.steps_done());
    if (!a.quiet) {
      std::cerr << fmt::format("ferry: resumed from {} at step {} of {} (loaded in {:.0f} ms)\n", a.resume_path,
                               pos.done, steps, 1e3 * seconds_since(load_start));
    }
  }
  std::uint32_t& done = pos.done;
  double& train_seconds = pos.train_seconds;
  double checkpoint_seconds = 0;
  const auto run_start = Clock::now();
  auto validate = [&] {
    const auto e0 = Clock::now();
    const EvalResult r = trainer.evaluate(val);
    pos.eval_seconds += seconds_since(e0);
    pos.curve.push_back({{"step", done}, {"seconds", seconds_since(run_start)}, {"val_loss", r.loss}});
    return r.loss;
  };
  const auto save = [&] {
    // Data parallel: every rank holds the same state and rank 0 writes it, unless each holds its own
    // share of the optimizer state (ZeRO stage 1: each writes its file).
    if (!a.primary && !a.sharded_checkpoint) return;
    const auto t0 = Clock::now();
    trainer.save_checkpoint(a.checkpoint_path, encode_position(a, corpus, windows, steps, pos),
                            {.replace_foreign_file = a.force});
    const double seconds = seconds_since(t0);
    checkpoint_seconds += seconds;
    if (!a.quiet) {
      std::cerr << fmt::format("ferry: checkpoint {} ({}, {:.0f} ms)\n", a.checkpoint_path,
                               format_bytes(std::filesystem::file_size(a.checkpoint_path)), 1e3 * seconds);
    }
  };
  Progress progress(!a.quiet);
  ChromeTrace trace;
  std::deque<float>& recent = pos.recent;
  const StopSignals signals;
  // One step in flight (Trainer::submit): the host draws and stages the next windows while the
  // device runs the step before. Never across a validation or checkpoint, which see the state of
  // exactly `done` steps (and the window stream's position after them).
  std::optional<StepHandle> in_flight;
  std::uint32_t submitted = done, steps_run = 0;
  bool out_of_time = false;
  auto mark = Clock::now();  // training time is wall time between results, less validation and checkpoints
  // Data parallel: every rank stops when any rank's clock says so, so that all stop together.
  const auto time_up = [&] {
    if (a.max_minutes <= 0) return false;
    double up = seconds_since(run_start) > a.max_minutes * 60 ? 1.0 : 0.0;
    if (a.control) a.control->allreduce_sum(std::span<double>(&up, 1));
    return up > 0;
  };
  // Reads the oldest step's result; with no other step in flight, validates and checkpoints where due.
  const auto read_result = [&](bool another_in_flight) {
    const StepResult r = trainer.result(*in_flight);
    in_flight.reset();
    train_seconds += seconds_since(mark);
    mark = Clock::now();
    ++done;
    if (!a.trace_path.empty() && steps_run < a.trace_steps) {
      trace.add_step(trainer.train_step().timeline(), steps_run, trainer.train_step().host_activity());
    }
    ++steps_run;
    recent.push_back(r.loss);
    if (recent.size() > 20) recent.pop_front();
    const double mean = std::accumulate(recent.begin(), recent.end(), 0.0) / recent.size();
    const double rate = done * double(batch) * t / train_seconds;
    progress.update(fmt::format("step {}/{}", done, steps), done, steps, static_cast<float>(mean), rate, "tokens",
                    train_seconds / done * (steps - done));
    out_of_time = !another_in_flight && time_up();
    if (done % eval_every == 0 || done == steps || out_of_time) {
      if (a.primary) pos.val_loss = validate();  // (the same weights on every rank)
      if (!a.quiet) {
        std::cerr << fmt::format("step {}/{}: train loss {:.4f}, val loss {:.4f} nats/char, {:.0f} tokens/s, {}\n",
                                 done, steps, mean, pos.val_loss, rate, clock_string(seconds_since(run_start)));
      }
      if (!a.checkpoint_path.empty()) save();
      mark = Clock::now();
    }
  };
  const auto boundary = [&](std::uint32_t n) { return n % eval_every == 0 || n == steps || time_up(); };
  while (done < steps && !out_of_time) {
    if (stop_requested(a)) {
      if (in_flight) read_result(false);
      // Between steps, the one in flight read: a checkpoint if asked for, and how to go on.
      const int sig = stop_signal ? static_cast<int>(stop_signal) : SIGTERM;  // data parallel: another rank's
      const char* name = sig == SIGINT ? "SIGINT" : "SIGTERM";
      const int status = 128 + sig;
      if (trace.steps() > 0) {  // the steps traced so far are kept too
        std::vector<std::string> ignored;
        write_trace(a, trace, ignored);
      }
      if (!a.primary) {
        if (a.sharded_checkpoint && !a.checkpoint_path.empty()) save();  // this rank's share
        return status;                                                   // rank 0 writes the checkpoint and says so
      } else if (!a.checkpoint_path.empty()) {
        save();
        std::cerr << fmt::format("ferry: stopped by {} at step {}/{}; wrote checkpoint {}\nferry: resume with: {}\n",
                                 name, done, steps, a.checkpoint_path, resume_command(a, a.checkpoint_path));
      } else {
        std::cerr << fmt::format(
            "ferry: stopped by {} at step {}/{}; no checkpoint written (run with --checkpoint FILE to be able to "
            "resume)\n",
            name, done, steps);
      }
      return status;
    }
    if (in_flight && boundary(submitted)) {
      read_result(false);
      continue;
    }
    const Batch batch_views = windows.next();
    trainer.set_lr(schedule.at(submitted));
    const StepHandle h = trainer.submit(batch_views);
    ++submitted;
    if (in_flight) read_result(true);
    in_flight = h;
  }
  if (out_of_time && !a.quiet) {
    std::cerr << fmt::format("ferry: stopped after {} minutes (--max-minutes)\n", a.max_minutes);
  }
  const double val_loss = pos.val_loss;
  const double eval_seconds = pos.eval_seconds;
  const nlohmann::json& curve = pos.curve;
  std::vector<std::string> output_errors;
  write_trace(a, trace, output_errors);
  const double train_loss =
      std::accumulate(recent.begin(), recent.end(), 0.0) / std::max<std::size_t>(recent.size(), 1);
  const double tokens_per_s = done * double(batch) * t / train_seconds;
  std::string sample;
  if (a.sample) {
    sample = sample_text(trainer, corpus, t, a.prompt, a.sample, a.temperature, a.seed);
    // Asked for, so printed also with --quiet (which silences progress, not results).
    std::cerr << "ferry: sample:\n" << a.prompt << sample << "\n";
  }
  if (!a.quiet) {
    std::cerr << fmt::format("ferry: val loss {:.4f} nats/char after {} steps, {:.0f} tokens/s, {:.1f} ms/step\n",
                             val_loss, done, tokens_per_s, 1e3 * train_seconds / done);
  }
  if (a.json) {
    nlohmann::json j = common_train_summary(a, runtime, trainer, batch, output_errors);
    j.update({{"vocab", c.vocab},
              {"width", c.width},
              {"depth", c.depth},
              {"heads", c.heads},
              {"context", c.context},
              {"attention", a.attention},
              {"steps", done},
              {"train_loss", train_loss},
              {"val_loss", val_loss},
              {"tokens_per_s", tokens_per_s},
              {"step_ms", 1e3 * train_seconds / done},
              {"train_seconds", train_seconds},
              {"eval_seconds", eval_seconds},
              {"checkpoint_seconds", checkpoint_seconds},
              {"compile_s", compile_s},
              {"curve", curve}});
    if (a.sample) j["sample"] = sample;
    // Sampled text may hold bytes that are not UTF-8 (the corpus is bytes): replaced in the JSON.
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
  }
  return train_exit_status(output_errors);
}

}  // namespace ferry::cli
