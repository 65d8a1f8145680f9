// ferry-bench: a registry of benchmarks, one per question (`ferry-bench gemm`, ...).
//
// A benchmark file registers itself with FERRY_BENCH(name, help, setup): `setup` receives its
// CLI11 subcommand, adds its own options there and returns the function that runs it. Options
// every benchmark shares (--device, --trace, --repeat) live in BenchCommon. Each result is one
// JSON line on stdout (emit_json); warnings and progress go to stderr.
#pragma once

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace ferry::bench {

struct BenchCommon {
  std::string device;  // index or name substring for ferry::cl::select_device; empty: default
  std::string trace;   // Chrome trace file to write (overlap and step; the others refuse --trace)
  int repeat = 5;      // timed repetitions after the warm-up; results report the median
};

using BenchRun = std::function<int()>;
// Adds the benchmark's options to its subcommand and returns the function that runs it; the
// common options are filled in by the time that function is called.
using BenchSetup = std::function<BenchRun(CLI::App& sub, const BenchCommon& common)>;

struct BenchInfo {
  std::string name, help;
  BenchSetup setup;
};

std::vector<BenchInfo>& registry();

struct BenchRegistrar {
  BenchRegistrar(std::string name, std::string help, BenchSetup setup) {
    registry().push_back({std::move(name), std::move(help), std::move(setup)});
  }
};

#define FERRY_BENCH_CONCAT2(a, b) a##b
#define FERRY_BENCH_CONCAT(a, b) FERRY_BENCH_CONCAT2(a, b)
#define FERRY_BENCH(name, help, setup) \
  static const ::ferry::bench::BenchRegistrar FERRY_BENCH_CONCAT(ferry_bench_registrar_, __LINE__)(name, help, setup)

// The version of the JSON lines' layout (docs/outputs.md); every line carries it as "schema".
inline constexpr int bench_json_schema = 1;

// Prints one result as a single JSON line on stdout, with "schema": bench_json_schema added, and
// flushes.
void emit_json(const nlohmann::json& result);

// Refuses a run whose host memory, `bytes`, is more than half of this machine's physical memory
// (ferry::physical_memory_bytes), before anything is allocated: "<what> needs 53.6 GiB of host
// memory, more than half of this machine's 7.7 GiB; <remedy>".
void check_host_memory(const std::string& what, double bytes, const std::string& remedy);

// Median of a sample (copies; samples are small).
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Milliseconds taken by fn().
template <class F>
double time_ms(F&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Milliseconds per run of `repeat` rounds of enqueue() (then finish()). First one untimed run
// (program builds, first touch), then a warm-up of `warm_ms` (caches, page faults and the OS's
// thread placement settle), whose runs also size a round: as many enqueue() calls back to back as
// fill about `round_ms`, then one finish(). Runs are timed the way a training step issues them,
// queued behind each other, not one wait each: waiting after every sub-millisecond run on PoCL let
// the OS wake both worker threads on one core, and a 0.6 ms GEMM measured at half speed in about
// one process of three (bench/RESULTS.md, "Timing rounds").
template <class Enqueue, class Finish>
std::vector<double> time_rounds(Enqueue&& enqueue, Finish&& finish, int repeat, double warm_ms = 300.0,
                                double round_ms = 20.0) {
  const auto run_one = [&] {
    enqueue();
    finish();
  };
  run_one();
  int warm_runs = 0;
  double warm_elapsed = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (warm_elapsed < warm_ms && warm_runs < 2000) {
    run_one();
    ++warm_runs;
    warm_elapsed = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  const double per_run = std::max(warm_elapsed / warm_runs, 1e-3);
  const int per_round = static_cast<int>(std::clamp(round_ms / per_run, 1.0, 1000.0));
  std::vector<double> times;
  for (int r = 0; r < repeat; ++r) {
    times.push_back(time_ms([&] {
                      for (int i = 0; i < per_round; ++i) enqueue();
                      finish();
                    }) /
                    per_round);
  }
  return times;
}

}  // namespace ferry::bench
