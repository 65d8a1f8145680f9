// Tuning ferry's GEMM kernel for the device it runs on: a bounded search over the kernel's
// parameters (register blocks of the CPU kernel; tiles, work per work-item, local depth and vector
// width of the GPU kernel), measured on square products and the products of the MLP and GPT
// training steps. The winner is cached per device, driver and kernel source beside the program
// cache, and gemm() uses it wherever ops/tuning/gemm.tsv has no row naming the device.
//
// When it runs: on first use of a GEMM on a device without a cached row or a row of the tuning
// data naming it (FERRY_TUNE=quick, the default: at most about FERRY_TUNE_BUDGET_S = 60 s, once per
// device and driver), or ahead of time with `ferry tune`. FERRY_TUNE=off neither tunes nor reads
// the cache (the tuning data's generic row runs); FERRY_TUNE=full searches every candidate on first use.
// FERRY_GEMM_TUNING=path replaces the shipped tuning data under the same rules.
//
// A cached row records how much of its search it covered (its comment: "N of M candidates", and
// whether a signal stopped it). A new winner replaces a cached row only when its search measured
// at least as many candidates (or GemmTuneOptions::replace_cached: ferry tune --force), so a
// shorter or interrupted search never replaces a more complete one; a row from a search a signal
// stopped is searched again on first use. First use says what it does on stderr unless
// OpEnv::tune_progress is false (ferry train --quiet), and a signal during it (SIGINT, SIGTERM,
// SIGHUP: their handlers are replaced while it runs) ends the search as a spent budget does, then
// throws TuneStopped.
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "ferry/cl/device.hpp"
#include "ops/gemm.hpp"

namespace ferry::ops {

enum class TuneMode { off, quick, full };

// What a cached winner's search covered, as its cache file's comment records it.
struct TuneCoverage {
  std::size_t measured = 0, planned = 0;  // candidates timed, candidates listed
  bool stopped = false;                   // a signal ended the search (first use searches again)
};

// A first-use search (gemm_tuning_for, attention_tuning_for) ended by SIGINT, SIGTERM or SIGHUP:
// thrown once the search has ended as a spent budget ends it and its best so far was saved under
// the cache's rule (above); what() says how far it came and what was kept. `signal` is the
// signal's number: ferry's commands exit with 128 + it, as a training run stopped by one does.
// Every later first-use choice throws it again (a planner that takes any failure for "this option
// does not fit" cannot go on past it) until forget_gemm_tuning() / forget_attention_tuning().
struct TuneStopped : std::runtime_error {
  TuneStopped(int signal_number, const std::string& what) : std::runtime_error(what), signal(signal_number) {}
  int signal;
};

// FERRY_TUNE: off | quick | full (quick when unset); throws std::invalid_argument on anything else.
TuneMode tune_mode_from_env();
const char* tune_mode_name(TuneMode mode);
// FERRY_TUNE_BUDGET_S (seconds, > 0; 60 when unset): the first-use search's budget. Throws
// std::invalid_argument on a value that is not a positive number.
double tune_budget_from_env();

// The kernels a search in `mode` lists for a device, likeliest first: the CPU kernel's register
// blocks on CPUs, the GPU kernel's tiles elsewhere (those fitting its work-group and local memory).
std::vector<std::string> gemm_tune_candidates(const cl::DeviceInfo& device, TuneMode mode);

// A finalist's twins: the same block or tile with options that the probe square does not decide,
// scored after the finalists on every shape (on CPUs the best finalist's only, on GPUs every
// finalist's). The CPU kernel: A packed (PA=1; only transposed A differs), 8 row blocks per
// work-item (WB=8) and both. The
// GPU kernel: K split where the last wave is short (SK=1), that with float4 loads (VG=4, where the
// tile allows), and on NVIDIA, for 8 x 8 blocks, that with registers capped at 128 (RR=128, two
// 256-item work-groups per compute unit).
std::vector<std::string> gemm_tune_twins(const std::string& kernel, const cl::DeviceInfo& device);

// Drops this process's choices of rows, so the next GEMM plan reads the tuning data, the cache and
// FERRY_TUNE again (tune_gemm does this itself; tests use it after changing the environment).
void forget_gemm_tuning();

struct GemmTuneProgress {
  // Measurements done (or skipped) and planned: each candidate on the probe shape, then each
  // finalist on every scored shape, then the twins (the total grows when they join); not
  // GemmTuneResult::planned, which counts candidates.
  std::size_t done = 0, total = 0;
  std::string stage;  // "probe" (every candidate, one shape) or "shapes" (the best few, all shapes)
  std::string best;   // best kernel so far, "" before the first
  double best_gflops = 0;
};

struct GemmTuneOptions {
  TuneMode mode = TuneMode::quick;  // quick: a short list of likely candidates; full: all of them
  double budget_seconds = 60;       // the search's time limit (ops/tune_deadline.hpp: what it bounds)
  std::function<void(const GemmTuneProgress&)> progress;  // optional, after each candidate
  // Optional, asked between candidates: true ends the search as a spent budget does (the best so
  // far wins and is saved as the cache's rule allows; GemmTuneResult::stopped). ferry tune passes
  // "a stop signal arrived".
  std::function<bool()> stop;
  // Candidates build on other threads ahead of their timing on GPUs only; true does it on a CPU
  // device too, where those builds compete with the timing (for tests of that path).
  bool build_ahead_on_cpus = false;
  // Save the winner even over a cached row whose search measured more candidates (ferry tune
  // --force); false keeps that row (GemmTuneResult::kept).
  bool replace_cached = false;
};

struct GemmTuneCandidate {
  std::string kernel;       // "tiled TSM=128 ..." as a tuning row writes it
  double probe_gflops = 0;  // on the probe shape
  double score_gflops = 0;  // geometric mean over all shapes (0 if it did not reach stage 2)
  std::string error;        // why it was skipped (its kernel failed to build or run), else ""
};

struct GemmTuneResult {
  std::string device;
  std::string best;        // the winner, "kernel KEY=VALUE ..."
  double best_gflops = 0;  // its geometric mean over `shapes`
  std::vector<GemmShape> shapes;
  std::vector<double> best_shape_gflops;      // the winner on each of `shapes`
  std::vector<GemmTuneCandidate> candidates;  // in the order measured
  std::size_t planned = 0;                    // candidates the mode lists
  double seconds = 0;
  bool budget_ran_out = false;
  bool stopped = false;      // GemmTuneOptions::stop ended the search early
  std::size_t measured = 0;  // candidates timed (or failed): twins past the budget are listed, not timed
  std::string row;           // the tuning-file row for this device
  std::string cache_path;    // where it was saved ("" when the program cache is off or the save failed)
  std::string save_error;    // why it could not be saved ("" when it was, or the program cache is off)
  // Set when the cache held a row from a search that measured more candidates: that row was kept
  // (in cache_path) and this winner not saved; what that search covered.
  std::optional<TuneCoverage> kept;
};

// Runs the search on env's device and saves the winner in the tuning cache, replacing a cached
// row whose search measured no more candidates (GemmTuneOptions::replace_cached: any). Throws
// std::runtime_error when no candidate could run at all.
GemmTuneResult tune_gemm(OpEnv& env, const GemmTuneOptions& options = {});

// The row gemm() follows on env's device and where it comes from, e.g. "tiled TSM=128 ... VW=4
// (<cache file>)" or "packed RB=6 NV=1 (ops/tuning/gemm.tsv (embedded):23)". May tune first (see
// gemm_tuning_for's order in the header comment above).
std::string gemm_tuning_choice(OpEnv& env);

// The cache file for env's device ("" when the program cache is off: FERRY_PROGRAM_CACHE=0 or no
// cache folder).
std::string gemm_tune_cache_path(OpEnv& env);

// Why a tuning cache file could not be written in the folder `dir` ("" when it can): the folder
// (and those above it) is made where missing, and a temporary file is created there, written and
// removed. E.g. "cannot create it: Read-only file system", "cannot write a file there:
// Permission denied". ferry tune asks before it measures anything.
std::string tune_cache_folder_problem(const std::string& dir);

}  // namespace ferry::ops
