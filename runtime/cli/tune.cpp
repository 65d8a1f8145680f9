// `ferry tune`: the GEMM tuner ahead of time, with progress, a summary and the cached row.
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "ops/gemm_tune.hpp"

namespace ferry::cli {
namespace {

// One progress line, redrawn in place on a terminal; on a pipe, a line per stage change and at the end.
struct ProgressBar {
  bool tty = ::isatty(STDERR_FILENO) != 0;
  std::string last_stage;
  void operator()(const ops::GemmTuneProgress& p) {
    const int width = 24;
    const int filled = p.total ? static_cast<int>(width * p.done / p.total) : 0;
    const std::string bar = std::string(filled, '#') + std::string(width - filled, '.');
    const std::string line = fmt::format("ferry tune: [{}] {:>3}/{} {:<6} best {:.0f} GFLOPS {}", bar, p.done, p.total,
                                         p.stage, p.best_gflops, p.best);
    if (tty) {
      std::fprintf(stderr, "\r%-140s", line.c_str());
    } else if (p.stage != last_stage || p.done == p.total) {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
    last_stage = p.stage;
    std::fflush(stderr);
  }
};

}  // namespace

int cmd_tune(const TuneArgs& a) {
  ferry::Runtime runtime({.device = a.device});
  ops::OpEnv& env = runtime.env();
  const auto& d = runtime.device();
  ops::GemmTuneOptions o;
  o.mode = a.mode == "full" ? ops::TuneMode::full : ops::TuneMode::quick;
  o.budget_seconds = a.budget_seconds;
  if (!a.quiet) {
    std::cerr << fmt::format("ferry tune: GEMM on '{}' ({}), {} search, budget {:.0f} s\n", d.name, d.driver, a.mode,
                             a.budget_seconds);
    o.progress = ProgressBar{};
  }
  const ops::GemmTuneResult r = ops::tune_gemm(env, o);
  const std::string choice = ops::gemm_tuning_choice(env);
  if (!a.quiet) {
    std::cerr << fmt::format("{}ferry tune: {} in {:.1f} s ({} of {} candidates{}): {:.0f} GFLOPS geometric mean\n",
                             ::isatty(STDERR_FILENO) ? "\n" : "", r.best, r.seconds, r.candidates.size(), r.planned,
                             r.budget_ran_out ? ", budget spent" : "", r.best_gflops);
    for (std::size_t i = 0; i < r.shapes.size(); ++i) {
      const auto& s = r.shapes[i];
      std::cerr << fmt::format("  {:>5} x {:>5} x {:>5} {}{}  {:8.0f} GFLOPS\n", s.M, s.N, s.K, s.trans_a ? "T" : "N",
                               s.trans_b ? "T" : "N", r.best_shape_gflops[i]);
    }
    for (const auto& c : r.candidates) {
      if (!c.error.empty()) std::cerr << fmt::format("  skipped {}: {}\n", c.kernel, c.error);
    }
    std::cerr << (r.cache_path.empty() ? std::string("ferry tune: the program cache is off, so nothing was saved\n")
                                       : fmt::format("ferry tune: saved in {}\n", r.cache_path));
    std::cerr << fmt::format("ferry tune: gemm() now runs {}\n", choice);
  }
  if (a.json) {
    nlohmann::json shapes = nlohmann::json::array(), cands = nlohmann::json::array();
    for (std::size_t i = 0; i < r.shapes.size(); ++i) {
      const auto& s = r.shapes[i];
      shapes.push_back({{"m", s.M},
                        {"n", s.N},
                        {"k", s.K},
                        {"trans_a", s.trans_a},
                        {"trans_b", s.trans_b},
                        {"gflops", r.best_shape_gflops[i]}});
    }
    for (const auto& c : r.candidates) {
      cands.push_back({{"kernel", c.kernel},
                       {"probe_gflops", c.probe_gflops},
                       {"score_gflops", c.score_gflops},
                       {"error", c.error}});
    }
    nlohmann::json j = {{"schema", 1},
                        {"command", "tune"},
                        {"family", "gemm"},
                        {"device", d.name},
                        {"driver", d.driver},
                        {"mode", a.mode},
                        {"budget_seconds", a.budget_seconds},
                        {"seconds", r.seconds},
                        {"candidates_planned", r.planned},
                        {"candidates_measured", r.candidates.size()},
                        {"budget_ran_out", r.budget_ran_out},
                        {"best", r.best},
                        {"best_gflops", r.best_gflops},
                        {"shapes", shapes},
                        {"row", r.row},
                        {"cache_path", r.cache_path},
                        {"gemm_tuning", choice},
                        {"candidates", cands}};
    std::cout << j.dump() << std::endl;
  }
  return 0;
}

}  // namespace ferry::cli
