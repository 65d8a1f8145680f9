// `ferry tune`: the GEMM and attention tuners ahead of time, with progress, a summary and the
// cached winners.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli.hpp"
#include "ferry/runtime/training_loop.hpp"
#include "ops/attention_tune.hpp"
#include "ops/gemm_tune.hpp"
#include "ops/gemm_tuning.hpp"

namespace ferry::cli {
namespace {

// One progress line, redrawn in place on a terminal; on a pipe, a line per stage change and at the end.
struct ProgressBar {
  bool tty = ::isatty(STDERR_FILENO) != 0;
  std::string last_stage;
  void operator()(const ops::GemmTuneProgress& p) {
    draw(p.done, p.total, p.stage, fmt::format("best {:.0f} GFLOPS {}", p.best_gflops, p.best));
  }
  void operator()(const ops::AttentionTuneProgress& p) {
    draw(p.done, p.total, "attention", fmt::format("best {}", p.best));
  }
  void draw(std::size_t done, std::size_t total, const std::string& stage, const std::string& best) {
    const int width = 24;
    const int filled = total ? static_cast<int>(width * done / total) : 0;
    const std::string bar = std::string(filled, '#') + std::string(width - filled, '.');
    const std::string line =
        fmt::format("ferry tune: [{}] {:>3}/{} measurements, {:<6} {}", bar, done, total, stage, best);
    if (tty) {
      std::fprintf(stderr, "\r%-140s", line.c_str());
    } else if (stage != last_stage || done == total) {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
    last_stage = stage;
    std::fflush(stderr);
  }
};

// The fields every `ferry tune --json` line starts with, for one family's search.
template <typename Result>
nlohmann::json json_head(const TuneArgs& a, const cl::DeviceInfo& d, const char* family, const Result& r) {
  return {{"schema", 1},
          {"command", "tune"},
          {"family", family},
          {"device", d.name},
          {"driver", d.driver},
          {"mode", a.mode},
          {"budget_seconds", a.budget_seconds},
          {"seconds", r.seconds},
          {"candidates_planned", r.planned},
          {"candidates_measured", r.measured},
          {"budget_ran_out", r.budget_ran_out},
          {"stopped", r.stopped},
          {"best", r.best},
          {"cache_path", r.cache_path},
          {"kept_cached", r.kept.has_value()}};
}

bool stop_signal_arrived() {
  return StopSignals::received() != 0;
}

// Why a search ended before every candidate ran ("" when none ended it), for the summary line.
template <typename Result>
std::string ended_early(const Result& r) {
  if (r.stopped) return fmt::format(", stopped by {}", StopSignals::name(StopSignals::received()));
  return r.budget_ran_out ? ", budget spent" : "";
}

// Where the winners went, for the progress output.
template <typename Result>
std::string saved_text(const Result& r, const char* what) {
  if (!r.save_error.empty()) return fmt::format("ferry tune: not saved ({})\n", r.save_error);
  if (r.cache_path.empty()) return "ferry tune: the program cache is off, so nothing was saved\n";
  if (r.kept) {
    return fmt::format(
        "ferry tune: kept the cached {} in {}, which measured {} of {} candidates (this run measured {}); "
        "--force replaces it\n",
        what, r.cache_path, r.kept->measured, r.kept->planned, r.measured);
  }
  return fmt::format("ferry tune: saved in {}\n", r.cache_path);
}

// What a family's search left: why its winner could not be saved ("" when it was, or the cache is
// off), and whether a more complete search's cached result was kept instead.
struct FamilyOutcome {
  std::string save_error;
  bool kept = false;
};

// The GEMM's search: progress, the winner per shape, and its JSON line.
FamilyOutcome tune_gemm_family(const TuneArgs& a, ops::OpEnv& env, const cl::DeviceInfo& d) {
  ops::GemmTuneOptions o;
  o.mode = a.mode == "full" ? ops::TuneMode::full : ops::TuneMode::quick;
  o.budget_seconds = a.budget_seconds;
  o.stop = stop_signal_arrived;
  o.replace_cached = a.force;
  if (!a.quiet) {
    std::cerr << fmt::format("ferry tune: GEMM on '{}' ({}), {} search, budget {:g} s\n", d.name, d.driver, a.mode,
                             a.budget_seconds);
    o.progress = ProgressBar{};
  }
  const ops::GemmTuneResult r = ops::tune_gemm(env, o);
  // Read back from the cache; a row that could not be saved is not there, and reading would start
  // a first-use search of its own.
  const std::string choice =
      r.save_error.empty() ? ops::gemm_tuning_choice(env) : std::string("what it ran before (nothing was saved)");
  if (!a.quiet) {
    std::cerr << fmt::format("{}ferry tune: {} in {:.1f} s ({} of {} candidates{}): {:.0f} GFLOPS geometric mean\n",
                             ::isatty(STDERR_FILENO) ? "\n" : "", r.best, r.seconds, r.measured, r.planned,
                             ended_early(r), r.best_gflops);
    for (std::size_t i = 0; i < r.shapes.size(); ++i) {
      const auto& s = r.shapes[i];
      std::cerr << fmt::format("  {:>5} x {:>5} x {:>5} {}{}  {:8.0f} GFLOPS\n", s.M, s.N, s.K, s.trans_a ? "T" : "N",
                               s.trans_b ? "T" : "N", r.best_shape_gflops[i]);
    }
    for (const auto& c : r.candidates) {
      if (!c.error.empty()) std::cerr << fmt::format("  skipped {}: {}\n", c.kernel, c.error);
    }
    std::cerr << saved_text(r, "row");
    // A row of the tuning data naming the device wins over the tuner's (ops/tuning/gemm.tsv's header): said, so
    // that a faster winner that does not run is not a surprise.
    // (The row in use is the tuning data's only where it is not the cache's own, which names the device too.)
    const ops::GemmTuningRow& in_use = ops::gemm_tuning_for(env);
    if (r.save_error.empty() && !r.cache_path.empty() && in_use.names_device() &&
        !in_use.source.starts_with(r.cache_path)) {
      std::cerr << fmt::format(
          "ferry tune: gemm() still runs {}: a row of the tuning data names this device and wins over the tuned "
          "one (FERRY_GEMM_TUNING=FILE replaces the tuning data)\n",
          choice);
    } else {
      std::cerr << fmt::format("ferry tune: gemm() now runs {}\n", choice);
    }
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
    nlohmann::json j = json_head(a, d, "gemm", r);
    j["best_gflops"] = r.best_gflops;
    j["shapes"] = shapes;
    j["row"] = r.row;
    j["gemm_tuning"] = choice;
    j["candidates"] = cands;
    std::cout << j.dump() << std::endl;
  }
  return {r.save_error, r.kept.has_value()};
}

// The attention's search (devices that are not CPUs): progress, the winner per shape, and its
// JSON line.
FamilyOutcome tune_attention_family(const TuneArgs& a, ops::OpEnv& env, const cl::DeviceInfo& d) {
  ops::AttentionTuneOptions o;
  o.mode = a.mode == "full" ? ops::TuneMode::full : ops::TuneMode::quick;
  o.budget_seconds = a.budget_seconds;
  o.stop = stop_signal_arrived;
  o.replace_cached = a.force;
  if (!a.quiet) {
    std::cerr << fmt::format("ferry tune: attention on '{}' ({}), {} search, budget {:g} s\n", d.name, d.driver, a.mode,
                             a.budget_seconds);
    o.progress = ProgressBar{};
  }
  const ops::AttentionTuneResult r = ops::tune_attention(env, o);
  const ops::AttentionTuning now = ops::attention_tuning_for(env);
  if (!a.quiet) {
    std::cerr << fmt::format("{}ferry tune: {} in {:.1f} s ({} of {} candidates{})\n",
                             ::isatty(STDERR_FILENO) ? "\n" : "", r.best, r.seconds, r.measured, r.planned,
                             ended_early(r));
    for (const ops::AttentionTuneClass& c : r.classes) {
      std::cerr << fmt::format("  head dims up to {}: {}, {:.3f} ms geometric mean\n", c.max_head_dim, c.best,
                               c.best_ms);
      for (std::size_t i = 0; i < c.shapes.size(); ++i) {
        const auto& s = c.shapes[i];
        std::cerr << fmt::format("    batch {} context {:>5} heads {} x {}  forward + backward {:8.3f} ms\n", s.batch,
                                 s.context, s.heads, s.head_dim, c.best_shape_ms[i]);
      }
    }
    for (const auto& c : r.candidates) {
      if (!c.error.empty()) std::cerr << fmt::format("  skipped {}: {}\n", c.kernel, c.error);
    }
    std::cerr << saved_text(r, "winners");
  }
  if (a.json) {
    nlohmann::json classes = nlohmann::json::array(), cands = nlohmann::json::array();
    for (const ops::AttentionTuneClass& c : r.classes) {
      nlohmann::json shapes = nlohmann::json::array();
      for (std::size_t i = 0; i < c.shapes.size(); ++i) {
        const auto& s = c.shapes[i];
        shapes.push_back({{"batch", s.batch},
                          {"context", s.context},
                          {"heads", s.heads},
                          {"head_dim", s.head_dim},
                          {"ms", c.best_shape_ms[i]}});
      }
      classes.push_back(
          {{"max_head_dim", c.max_head_dim}, {"best", c.best}, {"best_ms", c.best_ms}, {"shapes", shapes}});
    }
    for (const auto& c : r.candidates)
      cands.push_back({{"kernel", c.kernel}, {"score_ms", c.score_ms}, {"error", c.error}});
    nlohmann::json j = json_head(a, d, "attention", r);
    j["classes"] = classes;
    j["attention_tuning"] = now.kernels.empty() ? now.source : now.summary();
    j["candidates"] = cands;
    std::cout << j.dump() << std::endl;
  }
  return {r.save_error, r.kept.has_value()};
}

// What would keep the search's winners from being saved is known before searching: the program
// cache off (or its folder unusable), a cache folder that is a file or cannot be made or written
// (a temporary file is created there and removed), a cache file that is a folder. Refused then,
// not after the search (which a later run would repeat).
void check_cache_usable(ops::OpEnv& env, const TuneArgs& a) {
  namespace fs = std::filesystem;
  std::vector<std::string> paths;
  if (a.family != "attention") paths.push_back(ops::gemm_tune_cache_path(env));
  if (a.family != "gemm" && !env.device().is_cpu()) paths.push_back(ops::attention_tune_cache_path(env));
  for (const std::string& path : paths) {
    if (path.empty()) {
      throw std::runtime_error(
          "ferry tune: the program cache is off (FERRY_PROGRAM_CACHE=0, or its folder is not usable: see the note "
          "above), and the tuned rows are kept beside it, so what the search finds could not be saved: turn the cache "
          "on or name a writable folder with FERRY_CACHE_DIR (nothing was searched)");
    }
    std::error_code ec;
    if (fs::is_directory(path, ec)) {
      throw std::runtime_error(fmt::format(
          "ferry tune: '{}', where the tuned row is saved, is a folder: remove it (rm -r) or name another cache "
          "folder with FERRY_CACHE_DIR (nothing was searched)",
          path));
    }
    // The nearest existing folder on the way to it (the cache folder may not be made yet).
    fs::path folder = fs::path(path).parent_path();
    while (!folder.empty() && folder != folder.root_path() && !fs::exists(folder, ec)) folder = folder.parent_path();
    if (!folder.empty() && fs::exists(folder, ec) && !fs::is_directory(folder, ec)) {
      throw std::runtime_error(fmt::format(
          "ferry tune: the cache folder '{}' is not a folder, so what the search finds could not be saved: name a "
          "folder with FERRY_CACHE_DIR (nothing was searched)",
          folder.string()));
    }
    const std::string dir = fs::path(path).parent_path().string();
    if (const std::string problem = ops::tune_cache_folder_problem(dir); !problem.empty()) {
      throw std::runtime_error(fmt::format(
          "ferry tune: the cache folder '{}' is not usable ({}), so what the search finds could not be saved: make "
          "it writable or name another folder with FERRY_CACHE_DIR (nothing was searched)",
          dir, problem));
    }
  }
}

}  // namespace

int cmd_tune(const TuneArgs& a) {
  ferry::Runtime runtime({.device = a.device});
  ops::OpEnv& env = runtime.env();
  const auto& d = runtime.device();
  if (a.family == "attention" && d.is_cpu()) {
    throw std::invalid_argument(fmt::format(
        "ferry tune --family attention: '{}' is a CPU device, whose fused attention runs the cpu family's measured "
        "tiles; the attention is tuned on GPUs and other devices",
        d.name));
  }
  check_cache_usable(env, a);
  // A search can take many minutes: a stop signal ends it as a spent budget does, and what it found
  // is saved (the row is written whole or not at all); a second signal ends the process at once.
  const StopSignals signals(
      "the search stops after the candidate being timed, and what it found is saved unless a more complete search's "
      "is cached; a second signal stops at once, saving nothing",
      "ferry tune");
  std::vector<FamilyOutcome> outcomes;
  if (a.family != "attention") outcomes.push_back(tune_gemm_family(a, env, d));
  bool attention_skipped = false;
  if (a.family == "attention" || (a.family == "all" && !d.is_cpu())) {
    attention_skipped = stop_signal_arrived();
    if (!attention_skipped) outcomes.push_back(tune_attention_family(a, env, d));
  }
  std::vector<std::string> not_saved;
  bool kept = false;
  for (const FamilyOutcome& o : outcomes) {
    not_saved.push_back(o.save_error);
    kept = kept || o.kept;
  }
  if (a.family == "all" && d.is_cpu() && !a.quiet) {
    std::cerr << "ferry tune: attention not tuned: on CPU devices it runs the cpu family's measured tiles\n";
  }
  std::erase(not_saved, std::string());
  if (!not_saved.empty()) {
    throw std::runtime_error(fmt::format(
        "ferry tune could not save what it found ({}), so later runs cannot use it: make the cache folder writable, "
        "or name another with FERRY_CACHE_DIR",
        fmt::join(not_saved, "; ")));
  }
  if (const int signal = StopSignals::received(); signal != 0) {
    std::cerr << fmt::format(
        "ferry tune: stopped by {}; {} (run ferry tune again to search further){}\n", StopSignals::name(signal),
        kept ? "the cached result of a more complete search is kept (above), not the best found before it"
             : "the best found before it is saved",
        attention_skipped ? "; the attention was not tuned: ferry tune --family attention tunes it" : "");
    return 128 + signal;
  }
  return 0;
}

}  // namespace ferry::cli
