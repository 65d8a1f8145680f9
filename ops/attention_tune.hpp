// Tuning the fused attention for the GPU it runs on: which kernel family (tiled, blocked) and which
// tiles run its forward and backward fastest, measured on the device, as the GEMM is tuned
// (ops/gemm_tune.hpp: the same FERRY_TUNE modes, budget and cache folder).
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
#include <optional>
#include <string>
#include <vector>

#include "ferry/cl/device.hpp"
#include "ops/attention.hpp"
#include "ops/gemm_tune.hpp"

namespace ferry::ops {

// The kernels a search in `mode` lists for a device that is not a CPU, likeliest first (empty for
// CPU devices).
std::vector<std::string> attention_tune_candidates(const cl::DeviceInfo& device, TuneMode mode);

struct AttentionTuneProgress {
  std::size_t done = 0, total = 0;  // candidates measured (or skipped), candidates planned
  std::string best;                 // best kernel so far, "" before the first
  double best_ms = 0;               // its score
};

struct AttentionTuneOptions {
  TuneMode mode = TuneMode::quick;
  double budget_seconds = 60;  // the search stops starting candidates past this
  std::function<void(const AttentionTuneProgress&)> progress;
  // For tests: these candidates and shapes instead of the device's (candidates given, a CPU device
  // may be searched too).
  std::vector<std::string> candidates;
  std::vector<AttentionShape> shapes;
};

struct AttentionTuneCandidate {
  std::string kernel;   // "blocked TQ=64 TK=32", as AttentionOptions::kernel takes it
  double score_ms = 0;  // geometric mean over the shapes of forward + backward (0 if it did not run)
  std::string error;    // why it was skipped, else ""
};

struct AttentionTuneResult {
  std::string device;
  std::string best;    // the winner
  double best_ms = 0;  // its geometric mean over `shapes`
  std::vector<AttentionShape> shapes;
  std::vector<double> best_shape_ms;  // the winner's forward + backward on each of `shapes`
  std::vector<AttentionTuneCandidate> candidates;
  std::size_t planned = 0;
  double seconds = 0;
  bool budget_ran_out = false;
  std::string cache_path;  // where it was saved ("" when the program cache is off)
};

// Runs the search on env's device (a CPU only with candidates given: std::invalid_argument) and saves the winner in the
// cache. Throws std::runtime_error when no candidate could run.
AttentionTuneResult tune_attention(OpEnv& env, const AttentionTuneOptions& options = {});

// The kernel the fused attention runs on env's device when none is named, and where it comes from:
// {"", ...} for the family's defaults (CPU devices, FERRY_TUNE=off, no cache folder), else the
// cached winner or, on first use, the winner of a search run now (progress on stderr).
struct AttentionTuning {
  std::string kernel;
  std::string source;  // "defaults (...)", the cache file, or "tuned now"
};
AttentionTuning attention_tuning_for(OpEnv& env);

// Drops this process's choices, so the next attention reads FERRY_TUNE and the cache again.
void forget_attention_tuning();

// The cache file for env's device ("" when the program cache is off), and the kernel it holds:
// nullopt when there is none, or after a warning naming the file when it is damaged or holds no
// valid kernel (it is then tuned again and replaced).
std::string attention_tune_cache_path(OpEnv& env);
std::optional<std::string> read_attention_tune_cache(OpEnv& env, const std::string& path);

}  // namespace ferry::ops
