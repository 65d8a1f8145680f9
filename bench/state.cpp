// ferry-bench state: the main job (the deep residual MLP streamed under a 64 MiB device budget,
// on Fashion-MNIST) with its optimizer state in each home and format, in one run: host bytes
// the state takes and the step time, each against fp32 Adam state streamed uncompressed.
#include <fmt/format.h>

#include <iostream>
#include <numeric>
#include <random>

#include "bench.hpp"
#include "ferry/ferry.hpp"
#include "ferry/runtime/memory_profile.hpp"
#include "runtime/cli/validators.hpp"
#include "runtime/trainer_internals.hpp"

namespace ferry::bench {
namespace {

struct StateOptions {
  std::uint32_t width = 1024, depth = 16, batch = 64;
  std::string budget = "64MiB";
  std::uint32_t warmup = 20, steps = 10;
  std::vector<std::string> optimizers{"adam", "adamw8bit"};  // whole names, each run once
  std::string chunk = "1MiB";
  int level = 1;
};

struct Config {
  ops::OptimizerConfig::Kind kind;
  graph::Home home;
};

struct Measured {
  double step_ms = 0;
  std::uint64_t state_bytes = 0, state_host_bytes = 0, staging_bytes = 0, device_peak = 0;
  double loss = 0;
};

// Host bytes the optimizer state takes in its home: the whole home when the state lives alone
// there, else its share by logical size (pinned homes hold every tensor the same way).
std::uint64_t state_host_bytes(const Trainer& t) {
  MemoryProfiler profiler;
  profiler.add_variant("train", compiled_train_step(t));
  const std::string home = offload::home_name(t.state_home());
  for (const auto& h : profiler.homes()) {
    if (h.home != home) continue;
    if (h.tensor_bytes == t.optimizer_state_bytes()) return h.host_bytes;
    return static_cast<std::uint64_t>(static_cast<double>(h.host_bytes) * t.optimizer_state_bytes() / h.tensor_bytes);
  }
  return 0;
}

Measured measure(Runtime& rt, const Dataset& data, const StateOptions& so, const Config& c) {
  TrainerOptions o;
  o.batch = so.batch;
  o.lr = 1e-3f;
  o.optimizer.kind = c.kind;
  o.residency.mode = graph::ResidencyMode::stream;
  o.residency.budget_bytes = parse_bytes(so.budget);
  o.residency.weights_home = graph::Home::host_pinned;
  o.residency.state_home = c.home;
  o.residency.homes.codec.chunk_bytes = parse_bytes(so.chunk);
  o.residency.homes.codec.level = so.level;
  Trainer t(rt, models::deep(so.width, so.depth), o);
  const std::size_t sample = data.sample_elems();
  std::vector<float> images(so.batch * sample);
  std::vector<std::int32_t> labels(so.batch);
  std::mt19937_64 rng(1);
  std::vector<double> times;
  Measured m;
  for (std::uint32_t s = 0; s < so.warmup + so.steps; ++s) {
    for (std::uint32_t i = 0; i < so.batch; ++i) {
      const std::size_t k = rng() % data.count;
      std::copy_n(data.images.begin() + k * sample, sample, images.begin() + i * sample);
      labels[i] = data.labels[k];
    }
    const StepResult r = t.step(images, labels);
    if (s >= so.warmup) times.push_back(r.step_ms);
    m.loss = r.loss;
  }
  m.step_ms = median(times);
  m.state_bytes = t.optimizer_state_bytes();
  m.state_host_bytes = state_host_bytes(t);
  m.staging_bytes = compiled_train_step(t).host_step_bytes();
  m.device_peak = t.device_peak_bytes();
  return m;
}

int run_state(const BenchCommon& common, const StateOptions& so) {
  cli::budget_option("--device-budget", so.budget, ' ',
                     fmt::format("leave --device-budget out for {}", StateOptions{}.budget));
  // The compressed home's codec settings before the first (uncompressed) run, not after it.
  offload::CodecOptions codec;
  codec.chunk_bytes = parse_bytes(so.chunk);
  codec.level = so.level;
  offload::validate(codec);
  Runtime rt({.device = common.device});
  const Dataset data = load_fashion_mnist(default_fashion_mnist_dir(), Split::train);
  // fp32 Adam first (the baseline of the ratios), whatever the order given; each name once.
  std::vector<ops::OptimizerConfig::Kind> kinds;
  for (auto k : {ops::OptimizerConfig::Kind::adam, ops::OptimizerConfig::Kind::adamw8bit}) {
    if (std::find(so.optimizers.begin(), so.optimizers.end(), ops::optimizer_name(k)) != so.optimizers.end())
      kinds.push_back(k);
  }
  if (kinds.empty()) throw std::invalid_argument("--optimizers: name adam and/or adamw8bit");
  Measured baseline;
  bool have_baseline = false;  // fp32 Adam uncompressed ran: the ratios have their baseline
  for (auto kind : kinds) {
    for (auto home : {graph::Home::host_pinned, graph::Home::host_compressed}) {
      std::cerr << fmt::format("ferry-bench state: {} state in {} ({} + {} steps)...\n", ops::optimizer_name(kind),
                               offload::home_name(home), so.warmup, so.steps);
      const Measured m = measure(rt, data, so, {kind, home});
      if (!have_baseline && kind == ops::OptimizerConfig::Kind::adam) {
        baseline = m;  // fp32 Adam, uncompressed: the first configuration
        have_baseline = true;
      }
      // Without fp32 Adam in --optimizers there is nothing to divide by: the ratios are null.
      const auto ratio = [&](double x, double over) {
        return have_baseline ? nlohmann::json(x / over) : nlohmann::json(nullptr);
      };
      const nlohmann::json host_ratio = ratio(double(m.state_host_bytes), double(baseline.state_host_bytes)),
                           logical_ratio = ratio(double(m.state_host_bytes), double(baseline.state_bytes)),
                           time_ratio = ratio(m.step_ms, baseline.step_ms);
      emit_json({{"name", "state"},
                 {"device", rt.device().name},
                 {"model", fmt::format("deep width {} depth {}", so.width, so.depth)},
                 {"batch", so.batch},
                 {"device_budget", so.budget},
                 {"optimizer", ops::optimizer_name(kind)},
                 {"state_home", offload::home_name(home)},
                 {"level", so.level},
                 {"chunk", so.chunk},
                 {"steps", so.steps},
                 {"warmup_steps", so.warmup},
                 {"optimizer_state_bytes", m.state_bytes},
                 {"host_state_bytes", m.state_host_bytes},
                 {"host_staging_bytes", m.staging_bytes},
                 {"device_peak_bytes", m.device_peak},
                 {"step_ms", m.step_ms},
                 {"loss", m.loss},
                 {"host_bytes_vs_fp32_uncompressed", host_ratio},
                 {"host_bytes_vs_fp32_logical", logical_ratio},
                 {"step_time_vs_fp32_uncompressed", time_ratio}});
    }
  }
  return 0;
}

BenchRun setup_state(CLI::App& sub, const BenchCommon& common) {
  auto so = std::make_shared<StateOptions>();
  sub.add_option("--width", so->width, "deep model width")
      ->capture_default_str()
      ->check(ferry::cli::whole_number())
      ->check(CLI::Range(1u, 65536u));
  sub.add_option("--depth", so->depth, "deep model residual blocks")
      ->capture_default_str()
      ->check(ferry::cli::whole_number())
      ->check(CLI::Range(1u, 65536u));
  sub.add_option("--batch", so->batch, "samples per step")
      ->capture_default_str()
      ->check(ferry::cli::whole_number())
      ->check(CLI::Range(1u, 65536u));
  sub.add_option("--device-budget", so->budget, "device budget (streams the layers)")->capture_default_str();
  sub.add_option("--warmup", so->warmup, "steps before timing (the moments fill in)")->capture_default_str();
  sub.add_option("--steps", so->steps, "timed steps (median reported)")
      ->capture_default_str()
      ->check(ferry::cli::whole_number())
      ->check(CLI::Range(1u, 1000000u));  // 0 would report a median of no steps
  sub.add_option("--optimizers", so->optimizers, "adam and/or adamw8bit, comma-separated")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::IsMember({"adam", "adamw8bit"}));
  sub.add_option("--chunk", so->chunk, "compressed home: bytes per chunk")->capture_default_str();
  sub.add_option("--level", so->level, "compressed home: zstd level")->capture_default_str();
  return [&common, so] { return run_state(common, *so); };
}

FERRY_BENCH("state", "the main job with optimizer state uncompressed, compressed and 8-bit: host bytes, step time",
            setup_state);

}  // namespace
}  // namespace ferry::bench
