// ferry-bench gpt: how fast does ferry train the character-level GPT next to PyTorch (eager and
// torch.compile) on the same machine, in one run?
//
// ferry: Trainer with models::gpt on the fortune files (the model `ferry train --model gpt`
// trains), batches of random windows, Adam, fp32. PyTorch: bench/peers/torch_gpt.py, the same
// model, data, batch and optimizer, run through the shell for each mode. ferry is measured before
// and after the peers and its figure is the median over both sets of blocks, so the ratio is
// taken under the same machine load. Both sides run --repeat blocks of --steps steps and report
// the median of the block means (the peer waits for its device once per block, at its end);
// tokens per second are of that step time; ratios are ferry / peer (> 1: ferry is faster).
#include <fmt/format.h>

#include "bench.hpp"
#include "ferry/ferry.hpp"
#include "ferry/runtime/text_corpus.hpp"
#include "peer.hpp"
#include "runtime/cli/validators.hpp"
#include "runtime/trainer_internals.hpp"

namespace ferry::bench {
namespace {

struct GptBenchOptions {
  std::uint32_t width = 192, depth = 4, heads = 4, context = 128, batch = 32;
  std::string attention = "fused";  // ferry's attention: fused or unfused (models::GptConfig::fused_attention)
  float lr = 1e-3f;
  int warmup = 3;
  int steps = 10;  // steps per timed block
  std::string python = "python3";
  std::string peer_script;
  std::vector<std::string> modes{"eager", "compile"};
  std::string peer_device = "cpu";  // where the peer runs: cpu, cuda, cuda:N
  bool ferry = true;
};

class GptSession {
 public:
  GptSession(const BenchCommon& common, const GptBenchOptions& o)
      : common_(common),
        o_(o),
        corpus_(load_text_corpus(fortune_files(), 0.1)),
        runtime_({.device = common.device}),
        trainer_(runtime_, models::gpt(config(o, corpus_)), options(o)),
        windows_(corpus_, o.context, o.batch, 1) {
    for (int w = 0; w < o.warmup; ++w) one();
  }

  // --repeat blocks of --steps steps: the block means (ms per step).
  std::vector<double> measure() {
    std::vector<double> blocks;
    for (int rep = 0; rep < common_.repeat; ++rep) {
      // Each step is submitted before the previous one's result is read (Trainer::submit), as
      // ferry train does: the host draws and stages the next windows while the device runs.
      const double ms = time_ms([&] {
        std::optional<StepHandle> previous;
        for (int s = 0; s < o_.steps; ++s) {
          const StepHandle h = trainer_.submit(windows_.next());
          if (previous) loss_ = trainer_.result(*previous).loss;
          previous = h;
        }
        loss_ = trainer_.result(*previous).loss;
      });
      blocks.push_back(ms / o_.steps);
    }
    return blocks;
  }
  const Trainer& trainer() const { return trainer_; }
  const Runtime& runtime() const { return runtime_; }
  float loss() const { return loss_; }

 private:
  static models::GptConfig config(const GptBenchOptions& o, const TextCorpus& c) {
    models::GptConfig g;
    g.vocab = c.vocab_size();
    g.width = o.width;
    g.depth = o.depth;
    g.heads = o.heads;
    g.context = o.context;
    g.fused_attention = o.attention != "unfused";
    return g;
  }
  static TrainerOptions options(const GptBenchOptions& o) {
    TrainerOptions t;
    t.batch = o.batch;
    t.lr = o.lr;
    return t;
  }
  // One step on fresh random windows; its time (batch staging and validation included).
  double one() {
    const Batch batch = windows_.next();
    return time_ms([&] { loss_ = trainer_.step(batch).loss; });
  }

  const BenchCommon& common_;
  const GptBenchOptions& o_;
  TextCorpus corpus_;
  Runtime runtime_;
  Trainer trainer_;
  RandomWindows windows_;
  float loss_ = 0;
};

int run_gpt(const BenchCommon& common, const GptBenchOptions& o) {
  const nlohmann::json base{{"bench", "gpt"},       {"width", o.width}, {"depth", o.depth}, {"heads", o.heads},
                            {"context", o.context}, {"batch", o.batch}, {"steps", o.steps}, {"repeat", common.repeat}};
  std::unique_ptr<GptSession> ferry;
  std::vector<double> before, after;
  if (o.ferry) {
    ferry = std::make_unique<GptSession>(common, o);
    before = ferry->measure();
  }
  std::vector<nlohmann::json> peers;
  const std::string python = find_on_path(o.python);
  for (const std::string& mode : o.modes) {
    if (mode.empty()) continue;  // --modes '' (CLI11 gives one empty mode): no peers
    nlohmann::json j = base;
    j["impl"] = "torch-" + mode;
    j["python"] = o.python;
    if (python.empty()) {
      j["error"] = interpreter_not_found(o.python);
      peers.push_back(j);
      continue;
    }
    const std::string cmd = fmt::format(
        "{} {} --mode {} --width {} --depth {} --heads {} --context {} --batch {} --lr {} --warmup {} --steps {} "
        "--block-steps {} --device {}",
        shell_quote(python), shell_quote(o.peer_script), shell_quote(mode), o.width, o.depth, o.heads, o.context,
        o.batch, o.lr, o.warmup, o.steps * common.repeat, o.steps, shell_quote(o.peer_device));
    const nlohmann::json r = run_json_command(cmd).back();
    for (const char* key : {"error", "torch_version", "threads", "parameters", "seconds", "train_loss", "compile_s",
                            "device_name", "tf32", "block_ms"}) {
      if (r.contains(key)) j[key] = r[key];
    }
    j["peer_device"] = r.value("device", o.peer_device);
    if (r.contains("warmup_steps")) j["warmup"] = r["warmup_steps"];  // compile mode runs at least 3
    // The peer's --repeat blocks of --steps steps, reduced as ferry's are: the median block mean.
    if (r.value("step_ms", 0.0) > 0) {
      j["step_ms"] = r["step_ms"];
      j["tokens_per_s"] = 1e3 * o.batch * o.context / r["step_ms"].get<double>();
    }
    peers.push_back(j);
  }
  double ferry_tokens_per_s = 0;
  const double gflop = ferry ? step_gflop(ferry->trainer()) : 0.0;
  if (ferry) {
    after = ferry->measure();
    std::vector<double> all = before;
    all.insert(all.end(), after.begin(), after.end());
    const double ms = median(all);
    ferry_tokens_per_s = 1e3 * o.batch * o.context / ms;
    nlohmann::json j = base;
    j["impl"] = "ferry";
    j["attention"] = o.attention;
    j["warmup"] = o.warmup;
    j["step_ms"] = ms;
    j["tokens_per_s"] = ferry_tokens_per_s;
    add_step_rate(j, gflop);
    j["step_ms_before_peers"] = median(before);
    j["step_ms_after_peers"] = median(after);
    j["block_ms"] = all;
    j["device"] = ferry->runtime().device().name;
    j["model"] = ferry->trainer().model().name;
    j["parameters"] = ferry->trainer().parameter_count();
    j["nodes"] = compiled_train_step(ferry->trainer()).node_count();
    j["device_peak_bytes"] = ferry->trainer().device_peak_bytes();
    j["train_loss"] = ferry->loss();
    emit_json(j);
  }
  for (nlohmann::json& j : peers) {
    const double peer = j.value("tokens_per_s", 0.0);
    if (ferry && peer > 0) {
      j["ratio_ferry_over_peer"] = ferry_tokens_per_s / peer;
      add_step_rate(j, gflop);
    }
    emit_json(j);
  }
  return 0;
}

BenchRun setup(CLI::App& sub, const BenchCommon& common) {
  auto o = std::make_shared<GptBenchOptions>();
  o->peer_script = peer_script_path("torch_gpt.py");
  sub.add_option("--width", o->width, "model width")->capture_default_str()->check(ferry::cli::positive_number());
  sub.add_option("--depth", o->depth, "decoder blocks")->capture_default_str()->check(ferry::cli::positive_number());
  sub.add_option("--heads", o->heads, "attention heads")->capture_default_str()->check(ferry::cli::positive_number());
  sub.add_option("--context", o->context, "characters per window")
      ->capture_default_str()
      ->check(ferry::cli::positive_number());
  sub.add_option("--attention", o->attention, "ferry's attention: fused or unfused")
      ->check(CLI::IsMember({"fused", "unfused"}))
      ->capture_default_str();
  sub.add_option("--batch", o->batch, "windows per step")->capture_default_str()->check(ferry::cli::positive_number());
  sub.add_option("--lr", o->lr, "Adam learning rate (e.g. 0.001 or 1e-3)")
      ->capture_default_str()
      ->check(ferry::cli::positive_number());  // as ferry train's --lr: "" and "abc" refused, not read as 0
  sub.add_option("--warmup", o->warmup, "untimed steps first (each side)")
      ->capture_default_str()
      ->check(ferry::cli::non_negative_number());
  sub.add_option("--steps", o->steps, "steps per timed block (--repeat blocks)")
      ->capture_default_str()
      ->check(ferry::cli::positive_number());
  sub.add_option("--python", o->python, "Python interpreter with torch for the peers")->capture_default_str();
  sub.add_option("--peer-script", o->peer_script, "the PyTorch peer script")->capture_default_str();
  sub.add_option("--modes", o->modes, "peer modes: eager, compile (none: --modes '')")
      ->delimiter(',')
      ->check([](const std::string& m) {  // refused here, not after ferry's run by the peer's own parser
        return m.empty() || m == "eager" || m == "compile" ? std::string()
                                                           : "must be eager or compile (none: --modes ''), got " + m;
      });
  add_peer_device_option(sub, o->peer_device);
  sub.add_flag("!--no-ferry", o->ferry, "run only the peers");
  return [o, &common] { return run_gpt(common, *o); };
}

FERRY_BENCH("gpt", "training step of the character-level GPT (tokens/s): ferry vs PyTorch eager and compile", setup);

}  // namespace
}  // namespace ferry::bench
