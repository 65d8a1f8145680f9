// ferry-bench step: how fast does ferry train the reference MLP or CNN next to PyTorch on the same
// CPU?
//
// ferry: Trainer with models::mlp() (784-1024-1024-10, batch 256) or models::cnn() (--model cnn,
// batch 128), fp32, Adam, random standardized data, on the selected OpenCL device. PyTorch:
// bench/peers/torch_step.py (the same model, batch, loss and optimizer; eager and torch.compile,
// both with fused Adam where the build has it) run through popen for each configured interpreter, in
// the same run, so the ratio is taken under the same machine load: ferry is measured before and
// after the peers and its figure is the median over both sets of blocks. Both sides report the
// median over blocks of the block's mean step time (--repeat blocks of --steps steps each side),
// after warm-up steps. Ratios are peer step time / ferry step time (> 1: ferry is faster).
//
// Debian's OpenBLAS misdetects some CPUs and runs several times slower; the fair configuration
// of a PyTorch built on it sets OPENBLAS_CORETYPE (chosen from /proc/cpuinfo) and
// OMP_WAIT_POLICY=PASSIVE before torch is imported. By default each interpreter runs twice, with
// that environment ("tuned") and without it ("stock"); each JSON line names the environment.
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>

#include "bench.hpp"
#include "ferry/ferry.hpp"
#include "peer.hpp"
#include "runtime/cli/validators.hpp"
#include "runtime/trainer_internals.hpp"

namespace ferry::bench {
namespace {

namespace fs = std::filesystem;

struct StepBenchOptions {
  std::string model = "mlp";  // mlp (784-1024-1024-10, batch 256) or cnn (models::cnn(), batch 128)
  std::uint32_t batch = 0;    // 0: the model's default
  int warmup = 5;
  int steps = 20;  // steps per timed block
  std::vector<std::string> pythons;
  std::string peer_script;
  std::string peer_env = "both";                            // tuned, stock or both
  std::vector<std::string> peer_modes{"eager", "compile"};  // PyTorch eager and torch.compile, fused Adam
  std::string peer_device = "cpu";                          // where the peer runs: cpu, cuda, cuda:N
  bool ferry = true;
};

// Per-op-kind device time of one traced step, largest first, on stderr (what the step is made of).
// A node's event is that of its last command, so a node of several kernels (packing, GEMM, bias)
// is charged from the end of the previous command on its in-order queue to its own end: the
// whole lane time, gaps where the queue waited included.
void print_breakdown(const graph::Graph& g, std::vector<graph::TimelineEntry> timeline) {
  std::map<std::string, std::string> kind_of;
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) kind_of[g.nodes.name[n]] = graph::op_name(g.nodes.op[n]);
  std::sort(timeline.begin(), timeline.end(), [](const auto& a, const auto& b) { return a.end_ns < b.end_ns; });
  std::map<std::string, std::pair<double, int>> by_kind;
  std::map<graph::Lane, std::uint64_t> lane_end;
  std::uint64_t first = ~0ull, last = 0;
  double total = 0;
  for (const auto& e : timeline) {
    auto prev = lane_end.find(e.lane);
    const std::uint64_t begin = prev == lane_end.end() ? e.start_ns : std::min(prev->second, e.start_ns);
    lane_end[e.lane] = e.end_ns;
    const double ms = double(e.end_ns - begin) * 1e-6;
    auto& row = by_kind[kind_of.count(e.name) ? kind_of[e.name] : e.name];
    row.first += ms;
    row.second += 1;
    total += ms;
    first = std::min(first, e.start_ns);
    last = std::max(last, e.end_ns);
  }
  std::vector<std::pair<std::string, std::pair<double, int>>> rows(by_kind.begin(), by_kind.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
  fmt::print(stderr, "ferry step on the device: {:.2f} ms from first start to last end; per op kind (lane time):\n",
             double(last - first) * 1e-6);
  for (const auto& [kind, v] : rows) {
    fmt::print(stderr, "  {:<22} {:8.3f} ms  {:5.1f}%  ({} nodes)\n", kind, v.first, 100.0 * v.first / total, v.second);
  }
}

// ferry's side: the trainer and its data, kept alive so that it can be measured before and after
// the peers (the machine's load drifts; the ratio uses blocks from both sides of the peers).
class FerrySession {
 public:
  FerrySession(const BenchCommon& common, const StepBenchOptions& o)
      : common_(common),
        o_(o),
        runtime_({.device = common.device, .profiling = !common.trace.empty()}),
        trainer_(runtime_, o.model == "cnn" ? models::cnn() : models::mlp({1024, 1024}), trainer_options(o)) {
    // A few distinct batches of standardized (N(0, 1)) random data, cycled.
    const std::size_t sample = trainer_.model().inputs.at(0).sample.elems();
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_int_distribution<std::int32_t> label(
        0, static_cast<std::int32_t>(trainer_.model().targets.at(0).id_limit) - 1);
    images_.assign(kBatches, std::vector<float>(o.batch * sample));
    labels_.assign(kBatches, std::vector<std::int32_t>(o.batch));
    for (int b = 0; b < kBatches; ++b) {
      for (float& v : images_[b]) v = normal(rng);
      for (auto& l : labels_[b]) l = label(rng);
    }
    for (int w = 0; w < o.warmup; ++w) one();
  }

  // Times --repeat blocks of --steps steps; returns the block means (ms per step).
  std::vector<double> measure() {
    std::vector<double> blocks;
    for (int rep = 0; rep < common_.repeat; ++rep) {
      double run_sum = 0;
      // Each step is submitted before the previous one's result is read (Trainer::submit), as
      // ferry train does: the host stages and enqueues the next batch while the device runs.
      const double block = time_ms([&] {
        std::optional<StepHandle> previous;
        for (int s = 0; s < o_.steps; ++s) {
          const StepHandle h = submit_one();
          if (previous) run_sum += collect(*previous);
          previous = h;
        }
        run_sum += collect(*previous);
      });
      blocks.push_back(block / o_.steps);
      run_ms_.push_back(run_sum / o_.steps);
    }
    return blocks;
  }

  // Median of CompiledStep::run alone over every block measured so far.
  double run_ms() const { return median(run_ms_); }
  float loss() const { return loss_; }
  const Trainer& trainer() const { return trainer_; }
  const Runtime& runtime() const { return runtime_; }

  // With --trace: three more steps into a Chrome trace, and the op breakdown of the last on stderr.
  void trace() {
    if (common_.trace.empty()) return;
    ChromeTrace trace;
    for (int s = 0; s < 3; ++s) {
      one();
      trace.add_step(compiled_train_step(trainer_).timeline(), trainer_.steps_done(),
                     compiled_train_step(trainer_).host_activity());
    }
    print_breakdown(compiled_train_step(trainer_).graph(), compiled_train_step(trainer_).timeline());
    trace.write(common_.trace);
    fmt::print(stderr, "wrote a trace of 3 steps to {}\n", common_.trace);
  }

 private:
  static constexpr int kBatches = 4;
  static TrainerOptions trainer_options(const StepBenchOptions& o) {
    TrainerOptions t;
    t.batch = o.batch;  // optimizer: Adam (the default), lr 1e-3
    return t;
  }
  StepHandle submit_one() {
    const std::size_t b = i_++ % kBatches;
    return trainer_.submit(Batch{{"input", HostView(images_[b])}, {"labels", HostView(labels_[b])}});
  }
  double collect(StepHandle h) {
    const StepResult s = trainer_.result(h);
    loss_ = s.loss;
    return s.step_ms;
  }
  double one() {
    const StepResult s = trainer_.step(images_[i_ % kBatches], labels_[i_ % kBatches]);
    ++i_;
    loss_ = s.loss;
    return s.step_ms;
  }

  const BenchCommon& common_;
  const StepBenchOptions& o_;
  Runtime runtime_;
  Trainer trainer_;
  std::vector<std::vector<float>> images_;
  std::vector<std::vector<std::int32_t>> labels_;
  std::vector<double> run_ms_;
  std::uint64_t i_ = 0;
  float loss_ = 0;
};

struct PeerRun {
  std::string python, config, mode;
  nlohmann::json env;  // variables set for the child (null: removed)
};

// Runs the peer script and returns its JSON line (or a JSON object with "error").
nlohmann::json run_peer(const PeerRun& p, const StepBenchOptions& o, int repeat) {
  std::string cmd = "env";
  for (const auto& [k, v] : p.env.items()) {
    cmd += v.is_null() ? fmt::format(" -u {}", k) : fmt::format(" {}={}", k, shell_quote(v.get<std::string>()));
  }
  cmd += fmt::format(" {} {} --model {} --mode {} --batch {} --warmup {} --steps {} --repeat {} --device {}",
                     shell_quote(p.python), shell_quote(o.peer_script), o.model, p.mode, o.batch, o.warmup, o.steps,
                     repeat, shell_quote(o.peer_device));
  return run_json_command(cmd).back();  // the last line is the peer's result
}

int run_step(const BenchCommon& common, StepBenchOptions o) {
  if (o.model != "mlp" && o.model != "cnn") {
    throw std::invalid_argument(fmt::format("--model must be mlp or cnn, not '{}'", o.model));
  }
  if (o.batch == 0) o.batch = o.model == "cnn" ? 128 : 256;
  if (o.peer_env != "both" && o.peer_env != "tuned" && o.peer_env != "stock") {
    throw std::invalid_argument(fmt::format("--peer-env must be tuned, stock or both, not '{}'", o.peer_env));
  }
  const nlohmann::json base{{"bench", "step"},    {"model_kind", o.model}, {"batch", o.batch},
                            {"warmup", o.warmup}, {"steps", o.steps},      {"repeat", common.repeat}};

  std::unique_ptr<FerrySession> ferry;
  std::vector<double> before, after;
  if (o.ferry) {
    ferry = std::make_unique<FerrySession>(common, o);
    before = ferry->measure();
  }
  std::vector<nlohmann::json> peer_lines;

  // Interpreters: as given, else python3 on PATH and Debian's /usr/bin/python3; each once.
  std::vector<std::string> pythons;
  std::vector<std::string> wanted = o.pythons;
  if (wanted.empty()) wanted = {"python3", "/usr/bin/python3"};
  for (const std::string& name : wanted) {
    const std::string path = find_on_path(name);
    if (path.empty()) {
      peer_lines.push_back(
          {{"bench", "step"}, {"impl", "pytorch"}, {"python", name}, {"error", interpreter_not_found(name)}});
      continue;
    }
    const std::string norm = fs::path(path).lexically_normal().string();
    if (std::find(pythons.begin(), pythons.end(), norm) == pythons.end()) pythons.push_back(norm);
  }

  const std::string coretype = openblas_coretype();
  for (const std::string& py : pythons) {
    std::vector<PeerRun> runs;
    for (const std::string& mode : o.peer_modes) {
      if (o.peer_env != "stock") {
        runs.push_back({py, "tuned", mode, {{"OPENBLAS_CORETYPE", coretype}, {"OMP_WAIT_POLICY", "PASSIVE"}}});
      }
      if (o.peer_env != "tuned") {
        runs.push_back({py, "stock", mode, {{"OPENBLAS_CORETYPE", nullptr}, {"OMP_WAIT_POLICY", nullptr}}});
      }
    }
    for (const PeerRun& p : runs) {
      const nlohmann::json r = run_peer(p, o, common.repeat);
      nlohmann::json j = base;
      j["impl"] = r.value("impl", std::string("pytorch"));
      j["python"] = py;
      j["config"] = p.config;
      j["mode"] = r.value("mode", p.mode);
      nlohmann::json env = nlohmann::json::object();
      for (const auto& [k, v] : p.env.items()) env[k] = v.is_null() ? nlohmann::json("(unset)") : v;
      j["env"] = env;
      if (r.contains("error")) {
        j["error"] = r["error"];
        peer_lines.push_back(j);
        continue;
      }
      const double peer_ms = r.value("step_ms", 0.0);
      j["step_ms"] = peer_ms;
      j["samples_per_s"] = r.value("samples_per_s", 0.0);
      j["block_ms"] = r.value("block_ms", nlohmann::json::array());
      j["threads"] = r.value("threads", 0);
      j["torch_file"] = r.value("torch_file", std::string());
      j["loss"] = r.value("loss", 0.0);
      j["warmup"] = r.value("warmup_steps", o.warmup);  // compile mode runs at least 3
      for (const char* key : {"device_name", "tf32"}) {
        if (r.contains(key)) j[key] = r[key];
      }
      j["peer_device"] = r.value("device", o.peer_device);
      peer_lines.push_back(j);
    }
  }

  // ferry again after the peers; its figure is the median over the blocks on both sides.
  double ferry_ms = 0;
  const double gflop = ferry ? step_gflop(ferry->trainer()) : 0.0;
  if (ferry) {
    after = ferry->measure();
    std::vector<double> all = before;
    all.insert(all.end(), after.begin(), after.end());
    ferry_ms = median(all);
    nlohmann::json j = base;
    j["impl"] = "ferry";
    j["step_ms"] = ferry_ms;
    j["samples_per_s"] = o.batch * 1e3 / ferry_ms;
    add_step_rate(j, gflop);
    j["step_ms_before_peers"] = median(before);
    j["step_ms_after_peers"] = median(after);
    j["run_ms"] = ferry->run_ms();  // CompiledStep::run alone (no batch validation or staging copy)
    j["block_ms"] = all;
    j["device"] = ferry->runtime().device().name;
    j["model"] = ferry->trainer().model().name;
    j["parameters"] = ferry->trainer().parameter_count();
    j["nodes"] = compiled_train_step(ferry->trainer()).node_count();
    j["device_peak_bytes"] = ferry->trainer().device_peak_bytes();
    j["loss"] = ferry->loss();
    emit_json(j);
  }
  for (nlohmann::json& j : peer_lines) {
    const double peer_ms = j.value("step_ms", 0.0);
    if (ferry && peer_ms > 0) {
      j["ratio_ferry_over_peer"] = peer_ms / ferry_ms;
      add_step_rate(j, gflop);
    }
    emit_json(j);
  }
  if (ferry) ferry->trace();
  return 0;
}

BenchRun setup(CLI::App& sub, const BenchCommon& common) {
  auto o = std::make_shared<StepBenchOptions>();
  o->peer_script = peer_script_path("torch_step.py");
  sub.add_option("--model", o->model, "mlp (784-1024-1024-10) or cnn (models::cnn())")->capture_default_str();
  sub.add_option("--batch", o->batch, "batch size (default: 256 for mlp, 128 for cnn)")
      ->check(ferry::cli::positive_number());
  sub.add_option("--peer-mode", o->peer_modes, "PyTorch modes to run: eager, compile; repeatable")
      ->capture_default_str()
      ->check(CLI::IsMember({"eager", "compile"}));
  add_peer_device_option(sub, o->peer_device);
  sub.add_option("--warmup", o->warmup, "untimed steps first")
      ->capture_default_str()
      ->check(ferry::cli::non_negative_number());
  sub.add_option("--steps", o->steps, "steps per timed block (--repeat blocks)")
      ->capture_default_str()
      ->check(ferry::cli::positive_number());
  sub.add_option("--python", o->pythons,
                 "Python interpreter running the PyTorch peer; repeatable (default: python3 on PATH and "
                 "/usr/bin/python3)");
  sub.add_option("--peer-script", o->peer_script, "the PyTorch peer script")->capture_default_str();
  sub.add_option("--peer-env", o->peer_env,
                 "peer environment: tuned (OPENBLAS_CORETYPE from the CPU, OMP_WAIT_POLICY=PASSIVE), stock "
                 "(both unset) or both")
      ->capture_default_str();
  sub.add_flag("!--no-ferry", o->ferry, "run only the peers");
  return [o, &common] { return run_step(common, *o); };
}

FERRY_BENCH("step", "training step of the MLP (batch 256) or the CNN (batch 128), Adam: ferry vs PyTorch", setup);

}  // namespace
}  // namespace ferry::bench
