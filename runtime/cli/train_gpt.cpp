// `ferry train --model gpt`: a character-level GPT on the fortune files, with a held-out tail,
// validation loss in nats per character, and text sampled from the trained model.
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <deque>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "cli.hpp"
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
  c.context = a.context;
  c.dropout = a.dropout;
  if (corpus.train_end < c.context + 1u) {
    throw std::invalid_argument(fmt::format("the training text has {} characters, fewer than one window of {} + 1",
                                            corpus.train_end, c.context));
  }

  Runtime runtime({.device = a.device, .profiling = !a.trace_path.empty()});
  TrainerOptions opt;
  opt.batch = a.batch ? a.batch : 32;
  configure_trainer(a, opt);
  const std::uint32_t steps = a.steps ? a.steps : 2000;
  LrSchedule schedule;
  schedule.kind = parse_schedule(a.schedule);
  schedule.peak = a.lr;
  schedule.total_steps = steps;
  schedule.warmup_steps = std::min<std::uint64_t>(100, steps / 10);
  schedule.min_lr = a.lr / 10;
  schedule.validate();

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
    std::cerr << fmt::format("ferry: residency {}: device peak {} of a {} budget (planned)\n",
                             graph::residency_mode_name(trainer.residency().mode),
                             format_bytes(trainer.device_peak_bytes()), format_bytes(trainer.device_budget_bytes()));
  }

  const std::uint32_t batch = opt.batch, t = c.context;
  RandomWindows windows(corpus, t, batch, a.seed);
  const std::uint32_t eval_every = a.eval_every ? a.eval_every : 250;
  nlohmann::json curve = nlohmann::json::array();
  std::deque<float> recent;  // the last 20 steps' losses
  double train_seconds = 0, eval_seconds = 0;
  std::uint32_t done = 0;
  const auto run_start = Clock::now();
  auto validate = [&] {
    const auto e0 = Clock::now();
    const EvalResult r = trainer.evaluate(val);
    eval_seconds += seconds_since(e0);
    curve.push_back({{"step", done}, {"seconds", seconds_since(run_start)}, {"val_loss", r.loss}});
    return r.loss;
  };
  Progress progress(!a.quiet);
  ChromeTrace trace;
  double val_loss = 0;
  for (; done < steps;) {
    const Batch batch_views = windows.next();
    trainer.set_lr(schedule.at(done));
    const auto s0 = Clock::now();
    const StepResult r = trainer.step(batch_views);
    train_seconds += seconds_since(s0);
    ++done;
    if (!a.trace_path.empty() && done <= a.trace_steps) trace.add_step(trainer.train_step().timeline(), done - 1);
    recent.push_back(r.loss);
    if (recent.size() > 20) recent.pop_front();
    const double mean = std::accumulate(recent.begin(), recent.end(), 0.0) / recent.size();
    const double rate = done * double(batch) * t / train_seconds;
    progress.update(fmt::format("step {}/{}", done, steps), done, steps, static_cast<float>(mean), rate, "tokens",
                    train_seconds / done * (steps - done));
    const bool out_of_time = a.max_minutes > 0 && seconds_since(run_start) > a.max_minutes * 60;
    if (done % eval_every == 0 || done == steps || out_of_time) {
      val_loss = validate();
      if (!a.quiet) {
        std::cerr << fmt::format("step {}/{}: train loss {:.4f}, val loss {:.4f} nats/char, {:.0f} tokens/s, {}\n",
                                 done, steps, mean, val_loss, rate, clock_string(seconds_since(run_start)));
      }
    }
    if (out_of_time) {
      if (!a.quiet) std::cerr << fmt::format("ferry: stopped after {} minutes (--max-minutes)\n", a.max_minutes);
      break;
    }
  }
  if (!a.trace_path.empty()) {
    trace.write(a.trace_path);
    if (!a.quiet) std::cerr << fmt::format("ferry: wrote a trace of {} steps to {}\n", trace.steps(), a.trace_path);
  }
  const double train_loss =
      std::accumulate(recent.begin(), recent.end(), 0.0) / std::max<std::size_t>(recent.size(), 1);
  const double tokens_per_s = done * double(batch) * t / train_seconds;
  std::string sample;
  if (a.sample) {
    sample = sample_text(trainer, corpus, t, a.prompt, a.sample, a.temperature, a.seed);
    if (!a.quiet) std::cerr << "ferry: sample:\n" << a.prompt << sample << "\n";
  }
  if (!a.quiet) {
    std::cerr << fmt::format("ferry: val loss {:.4f} nats/char after {} steps, {:.0f} tokens/s, {:.1f} ms/step\n",
                             val_loss, done, tokens_per_s, 1e3 * train_seconds / done);
  }
  if (a.json) {
    nlohmann::json j = {{"schema", train_json_schema},
                        {"model", trainer.model().name},
                        {"device", runtime.device().name},
                        {"parameters", trainer.parameter_count()},
                        {"vocab", c.vocab},
                        {"width", c.width},
                        {"depth", c.depth},
                        {"heads", c.heads},
                        {"context", c.context},
                        {"batch", batch},
                        {"steps", done},
                        {"optimizer", a.optimizer},
                        {"lr", shortest(a.lr)},
                        {"seed", a.seed},
                        {"train_loss", train_loss},
                        {"val_loss", val_loss},
                        {"tokens_per_s", tokens_per_s},
                        {"step_ms", 1e3 * train_seconds / done},
                        {"train_seconds", train_seconds},
                        {"eval_seconds", eval_seconds},
                        {"compile_s", compile_s},
                        {"device_peak_bytes", trainer.device_peak_bytes()},
                        {"training_state_bytes", trainer.training_state_bytes()},
                        {"optimizer_state_bytes", trainer.optimizer_state_bytes()},
                        {"residency", graph::residency_mode_name(trainer.residency().mode)},
                        {"device_budget_bytes", trainer.device_budget_bytes()},
                        {"host_state_bytes", trainer.host_state_bytes()},
                        {"curve", curve}};
    if (a.sample) j["sample"] = sample;
    add_phase_fields(j, trainer);
    // Sampled text may hold bytes that are not UTF-8 (the corpus is bytes): replaced in the JSON.
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
  }
  return 0;
}

}  // namespace ferry::cli
