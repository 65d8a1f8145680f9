// Tuning the fused attention for the GPU it runs on: which kernel family (tiled, blocked) and which
// tiles run its forward and backward fastest, measured on the device, as the GEMM is tuned
// (ops/gemm_tune.hpp: the same FERRY_TUNE modes, budget and cache folder).
//
// A winner per head-dimension class (attention_tune_classes): head dims up to 64 (the GPTs up to the
// 85M one) and up to 128 (the 1B and 7B GPTs), where the blocked kernels' tiles shrink to fit local
// memory and another family or tile may win.
//
// When it runs: on first use of the fused attention on a device that is not a CPU, without a cached
// winner (FERRY_TUNE=quick, the default: a few candidates; full: all of them; at most about
// FERRY_TUNE_BUDGET_S seconds, once per device, driver and attention kernel source), or ahead of
// time with `ferry tune`. FERRY_TUNE=off and a disabled program cache run the untuned default
// (blocked TQ=64 TK=32). CPU devices run the cpu family with its measured defaults and are not
// tuned; a kernel named in AttentionOptions::kernel always runs as named.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ferry/cl/device.hpp"
#include "ops/attention.hpp"
#include "ops/gemm_tune.hpp"

namespace ferry::ops {

// The head-dimension classes tuned apart: class i covers head dims above class i-1's bound up to its
// own (the largest is the fused attention's limit).
inline constexpr std::size_t attention_tune_classes[] = {64, 128};
// The bound of the class `head_dim` falls in (0 when it is above the largest).
std::size_t attention_tune_class(std::size_t head_dim);

// The kernels a search in `mode` lists for a device that is not a CPU, likeliest first (empty for
// CPU devices).
std::vector<std::string> attention_tune_candidates(const cl::DeviceInfo& device, TuneMode mode);

struct AttentionTuneProgress {
  std::size_t done = 0, total = 0;  // candidates measured (or skipped), candidates planned
  std::string best;                 // the best kernel of each class so far with its score, "" before the first
};

struct AttentionTuneOptions {
  TuneMode mode = TuneMode::quick;
  double budget_seconds = 60;  // the search's time limit (ops/tune_deadline.hpp: what it bounds)
  std::function<void(const AttentionTuneProgress&)> progress;
  // Optional, asked between candidates: true ends the search as a spent budget does (each class's
  // best so far wins and is saved; AttentionTuneResult::stopped), as GemmTuneOptions::stop.
  std::function<bool()> stop;
  // For tests: these candidates and shapes instead of the device's (candidates given, a CPU device
  // may be searched too). Only the classes the shapes fall in are tuned.
  std::vector<std::string> candidates;
  std::vector<AttentionShape> shapes;
  // Candidates build on other threads ahead of their timing on GPUs only; true does it on a CPU
  // device too, where those builds compete with the timing (for tests of that path).
  bool build_ahead_on_cpus = false;
  // Save the winners even over cached ones whose search measured more candidates (ferry tune
  // --force); false keeps those (AttentionTuneResult::kept), as GemmTuneOptions::replace_cached.
  bool replace_cached = false;
};

struct AttentionTuneCandidate {
  std::string kernel;            // "blocked TQ=64 TK=32", as AttentionOptions::kernel takes it
  std::vector<double> score_ms;  // per class of the result: geometric mean of forward + backward over its
                                 // shapes (0 where it did not run)
  std::string error;             // why it was skipped (in some class), else ""
};

// One head-dimension class's shapes and winner.
struct AttentionTuneClass {
  std::size_t max_head_dim = 0;  // one of attention_tune_classes
  std::vector<AttentionShape> shapes;
  std::string best;                   // the winner
  double best_ms = 0;                 // its geometric mean over `shapes`
  std::vector<double> best_shape_ms;  // its forward + backward on each of `shapes`
};

struct AttentionTuneResult {
  std::string device;
  std::string best;                         // every class's winner: "64: blocked TQ=64 TK=32; 128: tiled BQ=64 BK=32"
  std::vector<AttentionTuneClass> classes;  // those the shapes fall in, by bound
  std::vector<AttentionTuneCandidate> candidates;
  std::size_t planned = 0;
  double seconds = 0;
  bool budget_ran_out = false;
  bool stopped = false;      // AttentionTuneOptions::stop ended the search early
  std::size_t measured = 0;  // candidates timed (every listed one)
  std::string cache_path;    // where it was saved ("" when the program cache is off or the save failed)
  std::string save_error;    // why it could not be saved ("" when it was, or the program cache is off)
  // Set when the cache held winners from a search that measured more candidates: those were kept
  // (in cache_path) and these not saved; what that search covered.
  std::optional<TuneCoverage> kept;
};

// Runs the search on env's device (a CPU only with candidates given: std::invalid_argument) and saves the winners in
// the cache under the GEMM cache's rule (ops/gemm_tune.hpp: not over winners of a search that measured more
// candidates). Throws std::runtime_error when no candidate could run.
AttentionTuneResult tune_attention(OpEnv& env, const AttentionTuneOptions& options = {});

// The kernels the fused attention runs on env's device when none is named, and where they come
// from: none for the family's defaults (CPU devices, FERRY_TUNE=off, no cache folder), else the
// cached winners or, on first use (or where the cached ones come from a search a signal stopped),
// the winners of a search run now (progress on stderr unless OpEnv::tune_progress is false; a stop
// signal during it throws TuneStopped, as gemm_tuning_for's search does).
struct AttentionTuning {
  std::map<std::size_t, std::string> kernels;  // by class bound (attention_tune_classes)
  std::string source;                          // "defaults (...)", the cache file, or "tuned now"
  // The kernel for `head_dim`: its class's winner, "" (the defaults) when that class was not tuned.
  std::string kernel_for(std::size_t head_dim) const;
  // "64: blocked TQ=64 TK=32; 128: tiled BQ=64 BK=32", or "" when nothing was tuned.
  std::string summary() const;
};
AttentionTuning attention_tuning_for(OpEnv& env);

// Drops this process's choices, so the next attention reads FERRY_TUNE and the cache again.
void forget_attention_tuning();

// The cache file for env's device ("" when the program cache is off), and the kernels it holds by
// class bound: nullopt when there is none, or after a warning naming the file when it is damaged
// or holds a line that is no class's valid kernel (it is then tuned again and replaced).
// `coverage`, when given, receives what its search covered ({} where its comment does not say).
std::string attention_tune_cache_path(OpEnv& env);
std::optional<std::map<std::size_t, std::string>> read_attention_tune_cache(OpEnv& env, const std::string& path,
                                                                            TuneCoverage* coverage = nullptr);

}  // namespace ferry::ops
