// GEMM tuning data: which row a device follows (the tuning file's, the tuner's cached winner or a
// search now), chosen once per process, file and device. The format: gemm_tuning_format.cpp.
#include "gemm_tuning.hpp"

#include <fmt/format.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>

#include "gemm_tune_cache.hpp"
#include "ops/gemm_tune.hpp"
#include "tune_signals.hpp"

namespace ferry::ops {
namespace {

struct TuningState {
  std::recursive_mutex mutex;                                // the tuner, run under it, clears `chosen` when it is done
  std::map<std::string, std::vector<GemmTuningRow>> parsed;  // by file path; "" = embedded
  std::map<std::pair<std::string, cl_device_id>, GemmTuningRow> chosen;  // per tuning file and device
  // Cache files a search of this process has settled since the last forget_gemm_tuning(): a
  // stopped search's row there is not searched again (ferry tune reads back what it just decided).
  std::set<std::string> searched;
  // A first-use search a signal stopped (TuneStopped): thrown again by every later choice until
  // forget_gemm_tuning(), so that a caller which takes any failure for "no plan" (a planner trying
  // options) cannot let the run go on past the signal.
  std::optional<TuneStopped> stopped;
};

TuningState& state() {
  static TuningState s;
  return s;
}

const std::vector<GemmTuningRow>& rows_of(TuningState& st, const std::string& path) {
  auto it = st.parsed.find(path);
  if (it == st.parsed.end()) {
    std::vector<GemmTuningRow> rows;
    if (path.empty()) {
      rows = parse_gemm_tuning(embedded_gemm_tuning(), "ops/tuning/gemm.tsv (embedded)");
    } else {
      // Read as the caches are: a FIFO or /dev/zero named here would otherwise hang the run.
      std::string problem;
      const std::optional<std::string> text = read_tuning_file(path, problem);
      if (!text) {
        throw std::runtime_error(fmt::format(
            "FERRY_GEMM_TUNING: '{}' {}: name a readable tuning file (rows as in ops/tuning/gemm.tsv), or unset it "
            "to use the embedded one",
            path, problem.empty() ? "does not exist" : problem));
      }
      rows = parse_gemm_tuning(*text, path);
    }
    it = st.parsed.emplace(path, std::move(rows)).first;
  }
  return it->second;
}

const GemmTuningRow& first_match(const std::vector<GemmTuningRow>& rows, const std::string& source,
                                 const cl::DeviceInfo& device) {
  for (const GemmTuningRow& row : rows) {
    if (row.matches(device)) return row;
  }
  throw std::runtime_error(fmt::format("GEMM tuning data {} has no row for device '{}' ({}, vendor '{}')", source,
                                       device.name, device.type_name(), device.vendor));
}

// What a stopped search's winner became, for the message that ends the run.
std::string stopped_note(const GemmTuneResult& r) {
  if (r.kept) {
    return fmt::format("the cached row in {}, from a search that measured {} of {} candidates, is kept", r.cache_path,
                       r.kept->measured, r.kept->planned);
  }
  if (!r.save_error.empty()) return fmt::format("its best so far could not be saved ({})", r.save_error);
  if (r.cache_path.empty()) return "its best so far was not saved (the program cache is off)";
  if (r.stopped && r.measured < r.planned) {
    return fmt::format("its best so far, {}, is saved in {} as a stopped search's, which the next run searches again",
                       r.best, r.cache_path);
  }
  return fmt::format("its winner, {}, is saved in {}", r.best, r.cache_path);
}

// First use on a device without a row of its own: the tuner's bounded search, with a line of
// progress on stderr unless env.tune_progress is false (it can take up to a minute, once per
// device and driver). A stop signal ends the search as a spent budget does; TuneStopped follows.
GemmTuningRow tune_now(OpEnv& env, TuneMode mode, double budget_seconds) {
  const cl::DeviceInfo& device = env.device();
  const bool show = env.tune_progress;
  if (show) {
    std::fprintf(stderr,
                 "ferry: tuning the GEMM kernel for '%s' (first use on this device and driver, about %.0f s at most; "
                 "`ferry tune` does it ahead of time, FERRY_TUNE=off skips it)\n",
                 device.name.c_str(), budget_seconds + 5);
  }
  GemmTuneOptions o;
  o.mode = mode;
  o.budget_seconds = budget_seconds;
  if (show) {
    o.progress = [](const GemmTuneProgress& p) {
      std::fprintf(stderr, "\rferry: tuning GEMM %s %zu/%zu, best %.0f GFLOPS   ", p.stage.c_str(), p.done, p.total,
                   p.best_gflops);
      std::fflush(stderr);
    };
  }
  const auto [r, signal] = search_until_signal(env.tune_stop_signals, show, "GEMM", "row is", o,
                                               [&](const GemmTuneOptions& options) { return tune_gemm(env, options); });
  if (signal != 0) {
    throw TuneStopped(signal,
                      fmt::format("GEMM tuning for '{}' stopped by {} after {} of {} candidates; {}", device.name,
                                  TuneStopSignals::name(signal), r.measured, r.planned, stopped_note(r)));
  }
  if (show && r.kept) {
    std::fprintf(stderr,
                 "\rferry: tuned GEMM in %.1f s: %s (%.0f GFLOPS over %zu shapes); kept the cached row in %s, which "
                 "measured %zu of %zu candidates (this search measured %zu)\n",
                 r.seconds, r.best.c_str(), r.best_gflops, r.shapes.size(), r.cache_path.c_str(), r.kept->measured,
                 r.kept->planned, r.measured);
  } else if (show) {
    std::fprintf(stderr, "\rferry: tuned GEMM in %.1f s: %s (%.0f GFLOPS over %zu shapes)%s%s\n", r.seconds,
                 r.best.c_str(), r.best_gflops, r.shapes.size(), r.cache_path.empty() ? "" : ", saved in ",
                 r.cache_path.c_str());
  }
  if (!r.cache_path.empty()) {
    if (auto saved = read_gemm_tune_cache(r.cache_path, device)) return *saved;  // names the file and line
  }
  return parse_gemm_tuning(r.row, "tuned now (not cached)").at(0);
}

}  // namespace

std::string gemm_tuning_choice(OpEnv& env) {
  const GemmTuningRow row = gemm_tuning_for(env);
  const std::string choice = fmt::format("{} ({}:{})", row.config.text(), row.source, row.line);
  if (gemm_backend_for(row) != GemmBackend::clblast) return choice;
  // CLBlast's own kernels run: the row's parameters are not what runs.
  const char* asked = std::getenv("FERRY_GEMM_BACKEND");
  return fmt::format("clblast ({}; ferry's row would be {})",
                     asked && *asked ? "FERRY_GEMM_BACKEND=clblast" : "the row's backend", choice);
}

void forget_gemm_tuning() {
  TuningState& st = state();
  std::lock_guard lock(st.mutex);
  st.chosen.clear();
  st.searched.clear();
  st.stopped.reset();
}

void gemm_cache_settled(const std::string& cache_path) {
  TuningState& st = state();
  std::lock_guard lock(st.mutex);
  st.searched.insert(cache_path);
}

GemmTuningRow gemm_tuning_for(OpEnv& env) {
  const cl::DeviceInfo& device = env.device();
  TuningState& st = state();
  const char* env_file = std::getenv("FERRY_GEMM_TUNING");
  const std::string path = env_file ? env_file : "";
  std::lock_guard lock(st.mutex);
  const auto key = std::make_pair(path, device.id);
  if (auto it = st.chosen.find(key); it != st.chosen.end()) return it->second;
  if (st.stopped) throw *st.stopped;
  // Checked whether or not this device needs them, so a mistyped setting is never silently ignored.
  const TuneMode mode = tune_mode_from_env();
  const double budget = tune_budget_from_env();
  const GemmTuningRow& listed =
      first_match(rows_of(st, path), path.empty() ? "ops/tuning/gemm.tsv (embedded)" : path, device);
  GemmTuningRow row = listed;
  if (!listed.names_device()) {
    // No row of its own: the tuner's cached winner, else a search now. FERRY_TUNE=off: neither,
    // the tuning data alone decides.
    if (mode != TuneMode::off) {
      const std::string cache = gemm_tune_cache_path(env);
      if (cache.empty()) {
        // Without a cache folder every run would search again: the generic row instead, said once.
        std::fprintf(stderr,
                     "ferry: note: not tuning the GEMM for '%s': the program cache is off, so a tuned row could not "
                     "be kept (set FERRY_CACHE_DIR to a writable folder); the generic row of the tuning data runs\n",
                     device.name.c_str());
      } else {
        TuneCoverage coverage;
        std::optional<GemmTuningRow> cached = read_gemm_tune_cache(cache, device, &coverage);
        // (The new search's winner replaces the stopped one's where it measured as many candidates.)
        const bool again =
            search_stopped_winner_again(cached ? std::optional(coverage) : std::nullopt, st.searched.contains(cache),
                                        env.tune_progress, cache, "GEMM row");
        try {
          row = cached && !again ? std::move(*cached) : tune_now(env, mode, budget);
        } catch (const TuneStopped& e) {
          st.stopped = e;
          throw;
        }
      }
    }
  }
  st.chosen.emplace(key, row);
  return row;
}

}  // namespace ferry::ops
