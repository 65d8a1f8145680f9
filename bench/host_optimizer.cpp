// ferry-bench host-optimizer: how fast does the host optimizer (`--host-optimizer`) update a
// tensor, per thread count, beside PyTorch's CPU AdamW on the same machine?
//
// One tensor of --elements parameters (64 MiB of fp32 weights by default: beyond the caches, as a
// layer of a large model) is updated in place, one step after another, by ferry's host AdamW
// (fp32 moments) and 8-bit AdamW (u8 codes, one scale per block of 2048), each on 1 thread and on
// every hardware thread (--threads). Reported per run: the median ms a step over --repeat steps
// after a warm-up, the bytes a step reads and writes per second (`gbps`: 28 bytes a parameter
// with fp32 moments, 16 plus the scales with 8-bit ones), and the instruction set the host loops
// were dispatched to on this CPU. With --peer, the same tensor updated by PyTorch's AdamW on the
// CPU (bench/peers/torch_host_adam.py: foreach and, where PyTorch has it, fused) at the same
// thread counts in the same run, and for AdamW `speedup_vs_peer` against the faster of its
// variants (PyTorch has no 8-bit AdamW on the CPU: the 8-bit lines carry no ratio).
#include <fmt/format.h>
#include <tbb/global_control.h>
#include <tbb/info.h>

#include <iostream>
#include <random>

#include "bench.hpp"
#include "ferry/ops/optimizer.hpp"
#include "ops/host_clones.hpp"
#include "ops/optimizer_host.hpp"
#include "peer.hpp"
#include "runtime/cli/validators.hpp"

namespace ferry::bench {
namespace {

struct HostOptimizerOptions {
  std::size_t elements = 16u << 20;
  std::vector<std::string> optimizers = {"adamw", "adamw8bit"};
  std::vector<int> threads;  // empty: 1 and every hardware thread
  bool peer = false;
  std::string python = "python3", peer_script;
};

constexpr std::uint32_t block8bit = 2048;

// Host AdamW's bytes a step (ops/optimizer_host.hpp, as `ferry plan` counts them).
double bytes_per_step(const std::string& optimizer, std::size_t n) {
  return optimizer == "adamw" ? ops::adam_update_bytes(n) : ops::adam8bit_update_bytes(n, block8bit);
}

// The clone the host loops run (ops/host_clones.hpp): the loader picks the widest this CPU has,
// in builds that make clones (not sanitizer builds).
std::string host_isa() {
#if FERRY_HOST_CLONES_ACTIVE
  if (__builtin_cpu_supports("avx512f")) return "avx512f";
  if (__builtin_cpu_supports("avx2")) return "avx2";
#endif
  return "baseline";
}

// Host bytes one run holds: weights, gradient and moments (fp32 or u8 codes and scales).
double state_bytes(const std::string& optimizer, std::size_t n) {
  return static_cast<double>(n) * (optimizer == "adamw" ? 16.0 : 10.0);
}

// The state of one run: weights, a gradient of spread values, and the moments.
struct HostState {
  std::vector<float> w, g, m, v, scales;
  std::vector<std::uint8_t> m8, v8;
};

HostState make_state(const std::string& optimizer, std::size_t n) {
  HostState s;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> weight(-0.05f, 0.05f), grad(-1e-3f, 1e-3f);
  s.w.resize(n);
  s.g.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    s.w[i] = weight(rng);
    s.g[i] = grad(rng);
  }
  if (optimizer == "adamw") {
    s.m.assign(n, 0.0f);
    s.v.assign(n, 0.0f);
  } else {
    s.m8.assign(n, 128);  // the code of 0 in the signed map
    s.v8.assign(n, 0);
    s.scales.assign(2 * ops::adam8bit_blocks(n, block8bit), 0.0f);
  }
  return s;
}

// Median ms a step on `threads` TBB workers, after one untimed step.
double ferry_step_ms(const std::string& optimizer, HostState& s, int threads, int repeat) {
  const tbb::global_control limit(tbb::global_control::max_allowed_parallelism, static_cast<std::size_t>(threads));
  ops::AdamConfig adam;
  adam.weight_decay = 0.01f;
  adam.decoupled_weight_decay = true;
  const std::size_t n = s.w.size();
  std::uint64_t step = 0;
  bool finite = true;
  const auto run = [&] {
    const ops::StepInfo info{.step = ++step, .lr = 1e-3f};
    if (optimizer == "adamw") {
      finite &= ops::host_adam_update(adam, info, s.g.data(),
                                      {s.w.data(), s.m.data(), s.v.data(), s.w.data(), s.m.data(), s.v.data()}, n);
    } else {
      finite &= ops::host_adam8bit_update(adam, block8bit, info, s.g.data(),
                                          {s.w.data(), s.m8.data(), s.v8.data(), s.scales.data(), s.w.data(),
                                           s.m8.data(), s.v8.data(), s.scales.data()},
                                          n);
    }
  };
  run();
  std::vector<double> ms;
  for (int r = 0; r < repeat; ++r) ms.push_back(time_ms(run));
  if (!finite) throw std::runtime_error(fmt::format("host {} wrote a weight that is not finite", optimizer));
  return median(ms);
}

// PyTorch's AdamW on the CPU at each thread count: one JSON line per (variant, threads).
std::vector<nlohmann::json> peer_results(const HostOptimizerOptions& o, const std::vector<int>& threads, int repeat) {
  const std::string python = find_on_path(o.python);
  if (python.empty()) return {{{"error", interpreter_not_found(o.python)}}};
  std::string list;
  for (int t : threads) list += fmt::format("{}{}", list.empty() ? "" : ",", t);
  const std::string cmd = fmt::format("{} {} --elements {} --threads {} --repeat {}", shell_quote(python),
                                      shell_quote(o.peer_script), o.elements, list, repeat);
  return run_json_command(cmd);
}

// The fastest peer variant of `optimizer` at `threads`, or null when the peer gave none (it has
// no 8-bit AdamW on the CPU).
const nlohmann::json* fastest_peer(const std::vector<nlohmann::json>& peers, const std::string& optimizer,
                                   int threads) {
  const nlohmann::json* best = nullptr;
  for (const nlohmann::json& p : peers) {
    if (p.contains("error") || p.value("optimizer", "") != optimizer || p.value("threads", 0) != threads ||
        !p.contains("ms"))
      continue;
    if (!best || p["ms"].get<double>() < (*best)["ms"].get<double>()) best = &p;
  }
  return best;
}

int run_host_optimizer(const HostOptimizerOptions& o, const BenchCommon& common) {
  // TBB's workers, as the cores this process may run on allow (its affinity mask): more cannot be
  // asked of it, and a figure for more would be one for fewer.
  const int all = std::max(1, tbb::info::default_concurrency());
  std::vector<int> threads = o.threads;
  if (threads.empty()) {
    threads = {1};
    if (all > 1) threads.push_back(all);
  }
  for (int t : threads) {
    if (t > all) {
      throw std::invalid_argument(fmt::format(
          "--threads {}: this process may run {} threads (its CPU affinity); ask for 1 to {}", t, all, all));
    }
  }
  for (const std::string& optimizer : o.optimizers) {
    check_host_memory(fmt::format("--elements {}: {}", o.elements, optimizer), state_bytes(optimizer, o.elements),
                      "ask for fewer");
  }
  std::vector<nlohmann::json> peers;
  if (o.peer) {
    std::cerr << fmt::format("ferry-bench host-optimizer: PyTorch's AdamW on the CPU ({})\n", o.python);
    peers = peer_results(o, threads, common.repeat);
    for (const nlohmann::json& p : peers) {
      if (p.contains("error")) std::cerr << "ferry-bench host-optimizer: peer: " << p["error"] << "\n";
    }
  }
  for (const std::string& optimizer : o.optimizers) {
    HostState state = make_state(optimizer, o.elements);
    for (int t : threads) {
      std::cerr << fmt::format("ferry-bench host-optimizer: {} on {} thread(s)\n", optimizer, t);
      const double ms = ferry_step_ms(optimizer, state, t, common.repeat);
      nlohmann::json j = {{"bench", "host-optimizer"},
                          {"impl", "ferry"},
                          {"optimizer", optimizer},
                          {"elements", o.elements},
                          {"threads", t},
                          {"host_isa", host_isa()},
                          {"ms", ms},
                          {"gbps", bytes_per_step(optimizer, o.elements) / (ms * 1e6)}};
      if (const nlohmann::json* p = fastest_peer(peers, optimizer, t)) {
        j["peer_impl"] = (*p)["impl"];
        j["peer_ms"] = (*p)["ms"];
        j["speedup_vs_peer"] = (*p)["ms"].get<double>() / ms;
      }
      emit_json(j);
    }
  }
  for (nlohmann::json p : peers) {
    if (!p.contains("bench")) p["bench"] = "host-optimizer";  // a peer that printed nothing
    if (!p.contains("impl")) p["impl"] = "torch";
    emit_json(p);
  }
  return 0;
}

BenchRun setup_host_optimizer(CLI::App& sub, const BenchCommon& common) {
  auto o = std::make_shared<HostOptimizerOptions>();
  o->peer_script = peer_script_path("torch_host_adam.py");
  sub.add_option("--elements", o->elements, "parameters in the updated tensor")
      ->check(ferry::cli::whole_number())
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 32));
  sub.add_option("--optimizers", o->optimizers, "which updates to time")->check(CLI::IsMember({"adamw", "adamw8bit"}));
  sub.add_option("--threads", o->threads, "thread counts (default: 1 and every hardware thread)")
      ->check(ferry::cli::positive_number());
  sub.add_flag("--peer", o->peer, "also time PyTorch's AdamW on the CPU in the same run");
  sub.add_option("--python", o->python, "Python interpreter with PyTorch, for --peer");
  return [o, &common] { return run_host_optimizer(*o, common); };
}

FERRY_BENCH("host-optimizer",
            "the host optimizer's AdamW and 8-bit AdamW on 1 and all threads (ms a step, GB/s), beside PyTorch's CPU "
            "AdamW with --peer",
            setup_host_optimizer);

}  // namespace
}  // namespace ferry::bench
