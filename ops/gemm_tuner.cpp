// The GEMM tuner (see ops/gemm_tune.hpp): candidates, their measurement in two stages, and
// the winner saved in the tuning cache.
//
// Stage 1 ("probe") times every candidate on one large square product, which ranks a kernel's
// parameters well and costs one build each (the builds dominate on GPUs). Stage 2 ("shapes") times
// the best few on every shape of the set, each fitted to the shape as a tuning row would be, and
// the geometric mean of their rates decides: a row must also serve a training step's skinny
// products, not only squares.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <string_view>
#include <utility>

#include "ferry/cl/context.hpp"
#include "ferry/cl/device.hpp"
#include "ferry/cl/error.hpp"
#include "ferry/cl/program.hpp"
#include "gemm_tiled.hpp"
#include "gemm_tune_cache.hpp"
#include "gemm_tuning.hpp"
#include "ops/gemm_tune.hpp"
#include "ops/tune_deadline.hpp"
#include "tune_timer.hpp"

namespace ferry::ops {
namespace {

using Clock = std::chrono::steady_clock;

// Candidates of the GPU kernel, likeliest first: wide vector reads, large tiles (more results per
// load), k depth 16 then 8 then 32. Groups of 64 to 256 work-items; tiles must fit local memory.
// 128 x 128 tiles come with 8 x 8 results per work-item (256 work-items) and with 16 x 8 and 8 x 16
// (128 work-items, as the fastest published CUDA SGEMMs without tensor cores have it): per k step
// those read 6 vectors of 4 floats from the tiles for 128 multiply-adds where 8 x 8 reads 4 for 64,
// at the price of more registers per work-item.
std::vector<std::string> tiled_candidates(const cl::DeviceInfo& d, TuneMode mode) {
  struct Tile {
    int tsm, tsn, wm, wn;
  };
  const Tile tiles[] = {{128, 128, 8, 8}, {128, 128, 16, 8}, {128, 128, 8, 16}, {128, 64, 8, 4}, {64, 128, 4, 8},
                        {64, 64, 4, 4},   {128, 64, 8, 8},   {64, 128, 8, 8},   {64, 64, 8, 8},  {64, 64, 4, 8},
                        {64, 64, 8, 4},   {32, 32, 2, 2},    {64, 32, 4, 2},    {32, 64, 2, 4},  {32, 32, 4, 4}};
  std::vector<std::string> out;
  for (int vw : {4, 2, 1}) {
    for (int tsk : {16, 8, 32}) {
      for (const Tile& t : tiles) {
        const std::size_t threads = std::size_t(t.tsm / t.wm) * std::size_t(t.tsn / t.wn);
        if (threads < 64 || threads > 256 || threads > d.max_work_group_size) continue;
        if (t.wm % vw || t.wn % vw) continue;
        GemmKernelConfig c;
        c.kernel = GemmKernel::tiled;
        c.params = {{"TSM", t.tsm}, {"TSN", t.tsn}, {"TSK", tsk}, {"WPTM", t.wm}, {"WPTN", t.wn}, {"VW", vw}};
        if (tiled_local_bytes(c) > d.local_mem_bytes) continue;
        // quick: the vector widths and depths that won on the GPUs measured so far, every tile.
        if (mode == TuneMode::quick && (vw == 1 || tsk == 32)) continue;
        out.push_back(c.text());
      }
    }
  }
  return out;
}

// Candidates of the CPU kernel: RB rows x NV float16 accumulators within 32 vector registers
// (NV = 1 for 256-bit units, where a float16 takes two of their 16 registers), likeliest first;
// each block with the k loop unrolled by 4 (the AVX2 EPYC's best) and, in the full search, rolled.
// The quick search lists only the blocks whose accumulators, B vectors and broadcast fit the
// device's registers (`lanes`, its native float width: 16 lanes and 32 registers with AVX-512,
// else 16 registers): on the AVX2 EPYC the others spilled (RB=6 NV=4 at 46 GFLOPS, RB=8 NV=1 at
// 95, against 152 for RB=6 NV=1), and each probe costs a build of 2-3 s there.
// Packing A (PA=1) changes only products with an f32 A transposed (an f16 A is always packed),
// which the probe square is not: the best finalist gets its packed-A twin in stage 2
// (gemm_tune_twins), and twins with 8 row blocks per work-item (WB), which the shapes of the
// scored products tell apart better than the probe.
std::vector<std::string> packed_candidates(TuneMode mode, std::uint32_t lanes) {
  const std::size_t float16_registers = lanes >= 16 || lanes == 0 ? 1 : 16 / lanes;
  const std::size_t registers = lanes >= 16 || lanes == 0 ? 32 : 16;
  std::vector<std::string> out;
  for (int nv : {4, 1, 2, 3}) {
    for (int rb : {6, 4, 8, 5, 3, 7, 10, 12, 2, 9, 11}) {
      if (rb * nv + nv + 1 > 32 || (nv == 2 && rb % 2)) continue;
      if (mode == TuneMode::quick) {
        if (nv == 3 || rb > 8 || rb < 4 || rb == 5 || rb == 7) continue;
        if (std::size_t(rb * nv + nv) * float16_registers + 1 > registers) continue;
      }
      out.push_back(fmt::format("packed RB={} NV={} KU=4", rb, nv));
      if (mode == TuneMode::full) out.push_back(fmt::format("packed RB={} NV={}", rb, nv));
    }
  }
  return out;
}

// The probe shape and the shapes a row is scored on: squares, and the products of the MLP
// (784-1024-1024-10, batch 256) and the 85M GPT (width 768, 2048 tokens a step).
GemmShape probe_shape(const cl::DeviceInfo& d) {
  const std::size_t n = d.is_cpu() ? 1024 : 2048;
  return {n, n, n};
}

std::vector<GemmShape> scored_shapes(const cl::DeviceInfo& d) {
  if (d.is_cpu()) {
    return {{1024, 1024, 1024}, {256, 1024, 784, false, true}, {784, 1024, 256, true, false}, {512, 768, 768}};
  }
  return {{1024, 1024, 1024},
          {2048, 2048, 2048},
          {256, 1024, 784, false, true},
          {2048, 3072, 768, false, true},
          {2048, 768, 3072},
          {768, 3072, 2048, true, false}};
}

// The words of `text` in order: a fitted kernel's parameters come in the order the row gave them
// ("KU=4 WB=8 PA=0" for one twin, "KU=4 PA=0 WB=8" for another), which says nothing of its launches.
std::string sorted_words(const std::string& text) {
  std::vector<std::string> words;
  for (std::size_t at = 0; at < text.size();) {
    const std::size_t end = std::min(text.find(' ', at), text.size());
    if (end > at) words.push_back(text.substr(at, end - at));
    at = end + 1;
  }
  std::sort(words.begin(), words.end());
  std::string out;
  for (const std::string& w : words) out += w + ' ';
  return out;
}

double gflops(const GemmShape& s, double seconds) {
  return 2.0 * double(s.M) * double(s.N) * double(s.K) / seconds * 1e-9;
}

// Operands for the largest shape, shared by every measurement.
struct Operands {
  cl::Mem a, b, c, scratch;
  std::size_t scratch_elems = 0;
};

class Timer {
 public:
  Timer(OpEnv& env, const std::vector<GemmShape>& shapes) : env_(env), ctx_(env.kernels.context()) {
    std::size_t a = 0, b = 0, c = 0;
    for (const GemmShape& s : shapes) {
      a = std::max(a, s.M * s.K);
      b = std::max(b, s.K * s.N);
      c = std::max(c, s.M * s.N);
    }
    std::mt19937 rng(7);
    auto upload = [&](std::size_t n, const char* what) { return upload_random(ctx_, n, rng, what); };
    ops_.a = upload(a, "gemm tuner A");
    ops_.b = upload(b, "gemm tuner B");
    ops_.c = upload(c, "gemm tuner C");
  }

  // GFLOPS of `kernel` fitted to `s`: the best of a few rounds of back-to-back runs, each round long
  // enough (about 20 ms) that launch overhead and timer resolution do not decide. A kernel fitted to
  // `s` as one measured before (a twin whose parameter this shape does not use: PA=1 where A is not
  // transposed) gets that one's rate: the same launches, and no ranking by noise between them.
  // `again` times it once more and keeps the better rate (score_finalists' second pass).
  double measure(const GemmShape& s, const std::string& kernel, bool again = false) {
    const GemmOptions o = options(kernel);
    const std::string key = fmt::format("{}x{}x{}{}{} {}", s.M, s.N, s.K, s.trans_a ? " ta" : "",
                                        s.trans_b ? " tb" : "", sorted_words(gemm_kernel_description(env_, s, o)));
    const auto it = measured_.find(key);
    if (it != measured_.end() && !again) return it->second;
    const std::size_t need = gemm_scratch_elems(env_, s, o);
    if (need > ops_.scratch_elems) {
      ops_.scratch = ctx_.create_buffer(need * sizeof(float), "gemm tuner scratch");
      ops_.scratch_elems = need;
    }
    const LaunchList launches =
        gemm(env_, s, 1.0f, {ops_.a.get(), 0}, {ops_.b.get(), 0}, 0.0f, {ops_.c.get(), 0}, {ops_.scratch.get(), 0}, o);
    const double rate = gflops(s, best_seconds_per_run(ctx_.compute(), launches, 200, "gemm tuner"));
    double& kept = measured_[key];
    kept = std::max(kept, rate);
    return kept;
  }

  // Builds the programs `kernel` fitted to `s` runs, without running it: safe on other threads
  // while measure() runs (the launches are dropped unenqueued, so any buffer stands in for the
  // scratch, which measure() may be reallocating).
  void build(const GemmShape& s, const std::string& kernel) {
    gemm(env_, s, 1.0f, {ops_.a.get(), 0}, {ops_.b.get(), 0}, 0.0f, {ops_.c.get(), 0}, {ops_.a.get(), 0},
         options(kernel));
  }

 private:
  static GemmOptions options(const std::string& kernel) {
    GemmOptions o;
    o.backend = GemmBackend::ferry;
    o.kernel = kernel;
    o.kernel_as_row = true;
    return o;
  }
  OpEnv& env_;
  const cl::Context& ctx_;
  Operands ops_;
  std::map<std::string, double> measured_;  // GFLOPS by shape and fitted kernel (measure())
};

// The (shape, kernel) pairs to be timed, as builds for a BuildAhead: on GPUs only, unless a test asks.
BuildAhead build_ahead(Timer& timer, const cl::DeviceInfo& device, const GemmTuneOptions& options,
                       const std::vector<std::pair<GemmShape, std::string>>& pairs) {
  std::vector<std::function<void()>> builds;
  for (const auto& pair : pairs) builds.push_back([&timer, pair] { timer.build(pair.first, pair.second); });
  return BuildAhead(device, !device.is_cpu() || options.build_ahead_on_cpus, std::move(builds));
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

TuneMode tune_mode_from_env() {
  const char* v = std::getenv("FERRY_TUNE");
  if (!v || !*v) return TuneMode::quick;
  const std::string_view s(v);
  if (s == "off") return TuneMode::off;
  if (s == "quick") return TuneMode::quick;
  if (s == "full") return TuneMode::full;
  throw std::invalid_argument(fmt::format("FERRY_TUNE='{}': expected off, quick or full", s));
}

const char* tune_mode_name(TuneMode mode) {
  switch (mode) {
    case TuneMode::off:
      return "off";
    case TuneMode::quick:
      return "quick";
    case TuneMode::full:
      return "full";
  }
  return "?";
}

double tune_budget_from_env() {
  const char* v = std::getenv("FERRY_TUNE_BUDGET_S");
  if (!v || !*v) return 60;
  // Digits with at most one '.', and some digit: strtod alone takes hexadecimal, exponents, "inf"
  // and leading blanks, none of which a person means by a number of seconds.
  const std::string_view s(v);
  const bool decimal = s.find_first_not_of("0123456789.") == std::string_view::npos &&
                       s.find_first_of("0123456789") != std::string_view::npos &&
                       std::count(s.begin(), s.end(), '.') <= 1 && s.back() != '.';
  const double seconds = decimal ? std::strtod(v, nullptr) : 0;
  if (!decimal || seconds < 0.001 || seconds > 604800) {
    throw std::invalid_argument(fmt::format(
        "FERRY_TUNE_BUDGET_S='{}': expected a decimal number of seconds from 0.001 to 604800 (a week), the time "
        "first-use tuning may take",
        v));
  }
  return seconds;
}

std::vector<std::string> gemm_tune_candidates(const cl::DeviceInfo& device, TuneMode mode) {
  if (mode == TuneMode::off) mode = TuneMode::quick;
  return device.is_cpu() ? packed_candidates(mode, device.native_float_width) : tiled_candidates(device, mode);
}

// PA=1 matters to the weight gradient's transposed A; SK=1 (instead of halving the tile) to the
// GPT's down-projection and weight gradient, 96 and 144 tiles of 128 x 128 on 132 compute units.
std::vector<std::string> gemm_tune_twins(const std::string& kernel, const cl::DeviceInfo& device) {
  const GemmKernelConfig c = parse_gemm_kernel_spec(kernel, "gemm tuner");
  auto given = [&](const char* key) { return kernel.find(fmt::format(" {}=", key)) != std::string::npos; };
  std::vector<std::string> twins;
  if (c.kernel == GemmKernel::packed) {
    if (!given("PA")) twins.push_back(kernel + " PA=1");
    // Row blocks one after another against a panel: fewer work-items and their set-up, and the
    // panel from one core's cache (bench/RESULTS.md, "Row blocks per work-item").
    if (!given("WB")) {
      twins.push_back(kernel + " WB=8");
      if (!given("PA")) twins.push_back(kernel + " PA=1 WB=8");
    }
  }
  if (c.kernel != GemmKernel::tiled || given("SK") || given("VG") || given("RR")) return twins;
  twins.push_back(kernel + " SK=1");
  if (c.param("TSM") % 4 || c.param("TSN") % 4 || c.param("TSK") % 4) return twins;
  twins.push_back(kernel + " SK=1 VG=4");
  // A cap of 128 registers lets two groups of 256 work-items with 64 results each share a
  // compute unit; 128 results per work-item would spill under it.
  if (device.has_extension("cl_nv_compiler_options") && c.param("WPTM") * c.param("WPTN") == 64) {
    twins.push_back(kernel + " SK=1 VG=4 RR=128");
  }
  return twins;
}

std::string gemm_tune_cache_path(OpEnv& env) {
  const cl::ProgramCacheOptions& cache = env.kernels.cache_options();
  if (!cache.enabled || cache.dir.empty()) return "";
  return gemm_tune_cache_file(cache.dir.string(), env.device());
}

namespace {

// Stage 1: every candidate on the probe shape, until the budget's share of stage 1 runs out.
void probe_candidates(Timer& timer, const GemmShape& probe, const std::vector<std::string>& candidates,
                      TuneDeadline deadline, GemmTuneProgress& progress, const GemmTuneOptions& options,
                      const cl::DeviceInfo& device, GemmTuneResult& r) {
  progress.stage = "probe";
  std::vector<std::pair<GemmShape, std::string>> jobs;
  for (const std::string& kernel : candidates) jobs.emplace_back(probe, kernel);
  const BuildAhead ahead = build_ahead(timer, device, options, jobs);
  for (const std::string& kernel : candidates) {
    // (Not before a candidate has run: a search whose first candidates fail goes on.)
    if (progress.best_gflops > 0 && !deadline.next_fits()) {
      (deadline.stopped() ? r.stopped : r.budget_ran_out) = true;
      break;
    }
    GemmTuneCandidate c;
    c.kernel = kernel;
    deadline.begin();
    ++r.measured;
    try {
      c.probe_gflops = timer.measure(probe, kernel);
    } catch (const std::exception& e) {
      c.error = e.what();  // a candidate this device cannot build or run: skipped, and said so
    }
    deadline.end();
    if (c.error.empty() && c.probe_gflops > progress.best_gflops) {
      progress.best_gflops = c.probe_gflops;
      progress.best = kernel;
    }
    r.candidates.push_back(std::move(c));
    ++progress.done;
    if (options.progress) options.progress(progress);
  }
}

// The geometric mean of `kernel`'s rates on `shapes` (Timer::measure, `again` as there), the rates
// in `rates`.
double score_on_shapes(Timer& timer, const std::vector<GemmShape>& shapes, const std::string& kernel, bool again,
                       std::vector<double>& rates) {
  rates.clear();
  double log_sum = 0;
  for (const GemmShape& s : shapes) {
    rates.push_back(timer.measure(s, kernel, again));
    log_sum += std::log(rates.back());
  }
  return std::exp(log_sum / double(rates.size()));
}

// Twins (gemm_tune_twins) of how many finalists stage 2 scores. On CPU devices a twin's programs are
// built in turn with the timing (1-2 s each on PoCL, most of first use), so only the best finalist's
// twins run: their parameters (PA, WB) tune the kernel the register block has already won, and with
// every finalist twinned a first-use search took about the whole 60 s default budget on the AVX2
// EPYC. GPUs build ahead on other threads, and a tile's twins there (SK, VG, RR) change it more.
std::size_t twinned_finalists(const cl::DeviceInfo& device, std::size_t finalists) {
  return device.is_cpu() ? 1 : finalists;
}

// Stage 2: the best `finalists` of stage 1 on every scored shape, then the twins of the best
// scored ones (twinned_finalists); the winner has the highest geometric mean.
void score_finalists(Timer& timer, std::size_t finalists, TuneDeadline deadline, const cl::DeviceInfo& device,
                     GemmTuneProgress& progress, const GemmTuneOptions& options, GemmTuneResult& r) {
  std::vector<std::size_t> ranked;  // indices into r.candidates
  for (std::size_t i = 0; i < r.candidates.size(); ++i) {
    if (r.candidates[i].error.empty()) ranked.push_back(i);
  }
  if (ranked.empty()) {
    throw std::runtime_error(
        fmt::format("GEMM tuning on '{}': no candidate kernel could run; the first failed with: {}", device.name,
                    r.candidates.empty() ? "-" : r.candidates[0].error));
  }
  std::sort(ranked.begin(), ranked.end(),
            [&](std::size_t x, std::size_t y) { return r.candidates[x].probe_gflops > r.candidates[y].probe_gflops; });
  ranked.resize(std::min(ranked.size(), finalists));
  const std::size_t probed = r.candidates.size();
  progress.stage = "shapes";
  progress.total = progress.done + ranked.size();
  progress.best_gflops = 0;

  // Times candidate i on every shape (`again`: once more, each shape keeping its better rate). Once
  // the budget (or a stop) ends the search, i and the rest keep their scores (0 if never scored).
  // The first always runs: a winner needs a score on every shape. A second timing the budget leaves
  // out is no candidate left unmeasured: only a stop is reported then.
  bool ended = false;
  std::set<std::size_t> scored;  // candidates with a score
  auto score = [&](std::size_t i, bool again) {
    if (ended || (!r.best.empty() && !deadline.next_fits())) {
      if (!ended && (deadline.stopped() || !again)) (deadline.stopped() ? r.stopped : r.budget_ran_out) = true;
      ended = true;
      return;
    }
    GemmTuneCandidate& c = r.candidates[i];
    std::vector<double> rates;
    deadline.begin();
    if (i >= probed && !again) ++r.measured;  // a twin (its finalist was counted when probed)
    try {
      c.score_gflops = score_on_shapes(timer, r.shapes, c.kernel, again, rates);
      scored.insert(i);
    } catch (const std::exception& e) {
      c.error = e.what();
    }
    deadline.end();
    if (c.score_gflops > r.best_gflops) {
      r.best_gflops = c.score_gflops;
      r.best = c.kernel;
      progress.best_gflops = r.best_gflops;
      progress.best = r.best;
    }
    ++progress.done;
    if (options.progress) options.progress(progress);
  };
  auto build_all = [&](const std::vector<std::size_t>& indices) {
    std::vector<std::pair<GemmShape, std::string>> jobs;
    for (std::size_t i : indices) {
      for (const GemmShape& s : r.shapes) jobs.emplace_back(s, r.candidates[i].kernel);
    }
    return build_ahead(timer, device, options, jobs);
  };

  {
    const BuildAhead ahead = build_all(ranked);
    for (std::size_t i : ranked) score(i, false);
  }
  // The finalists by score (failed ones last), and the twins of the best few: listed even where the
  // budget leaves them unmeasured.
  std::vector<std::size_t> by_score = ranked;
  std::stable_sort(by_score.begin(), by_score.end(), [&](std::size_t x, std::size_t y) {
    return r.candidates[x].score_gflops > r.candidates[y].score_gflops;
  });
  by_score.resize(std::min(by_score.size(), twinned_finalists(device, finalists)));
  std::vector<std::size_t> twins;
  for (std::size_t i : by_score) {
    for (std::string& kernel : gemm_tune_twins(r.candidates[i].kernel, device)) {
      GemmTuneCandidate t;
      t.kernel = std::move(kernel);
      // The probe square is not split, needs no packed A, and twins are not probed: 0 says so
      // for float4 loads, register caps and row blocks per work-item, which would change it.
      const bool same_on_probe = t.kernel.find("VG=") == std::string::npos && t.kernel.find("WB=") == std::string::npos;
      t.probe_gflops = same_on_probe ? r.candidates[i].probe_gflops : 0.0;
      r.candidates.push_back(std::move(t));
      twins.push_back(r.candidates.size() - 1);
      ++r.planned;
    }
  }
  progress.total += twins.size();
  if (options.progress && !twins.empty()) options.progress(progress);
  {
    const BuildAhead ahead = build_all(twins);
    for (std::size_t i : twins) score(i, false);
  }
  if (r.best.empty()) {
    throw std::runtime_error(fmt::format("GEMM tuning on '{}': every finalist failed on the scored shapes: {}",
                                         device.name, r.candidates[ranked[0]].error));
  }
  // A second pass over every scored candidate, last first, its programs built: on the 2-vCPU AVX2
  // EPYC a kernel's timings of one shape varied by up to 30% from one moment to the next (best of
  // five rounds each), more than the candidates differ, so one pass ranked them by the machine's
  // moments. Each shape keeps the better of its two rates.
  const std::vector<std::size_t> again(scored.rbegin(), scored.rend());
  progress.total += again.size();
  for (std::size_t i : again) score(i, true);
  // The scores from the rates kept (a shape one candidate timed again serves every candidate
  // fitted to it alike).
  r.best_gflops = 0;
  for (std::size_t i : scored) {
    GemmTuneCandidate& c = r.candidates[i];
    if (!c.error.empty()) continue;
    std::vector<double> kept;
    c.score_gflops = score_on_shapes(timer, r.shapes, c.kernel, false, kept);
    if (c.score_gflops > r.best_gflops) {
      r.best_gflops = c.score_gflops;
      r.best = c.kernel;
      r.best_shape_gflops = std::move(kept);
    }
  }
}

// The winner as a tuning row, written to the cache beside the program cache (when there is one)
// with what was measured as its comment, unless the cache holds a row from a search that measured
// more candidates (options.replace_cached aside): that row is kept (r.kept).
void record_winner(OpEnv& env, TuneMode mode, const GemmTuneOptions& options, GemmTuneResult& r) {
  const cl::DeviceInfo& device = env.device();
  const std::size_t space = r.best.find(' ');
  r.row = fmt::format("{}\t*\t{}\tferry\t{}\t{}",
                      device.is_cpu()   ? "cpu"
                      : device.is_gpu() ? "gpu"
                                        : "*",
                      device.platform_name + " " + device.name, r.best.substr(0, space), r.best.substr(space + 1));
  r.cache_path = gemm_tune_cache_path(env);
  if (r.cache_path.empty()) return;
  if (!options.replace_cached) {
    r.kept = tune_cache_to_keep(valid_gemm_tune_cache_body(r.cache_path, device), r.measured);
    if (r.kept) return;
  }
  std::string shapes;
  for (std::size_t i = 0; i < r.shapes.size(); ++i) {
    const GemmShape& s = r.shapes[i];
    shapes += fmt::format("{}{}x{}x{}{}{}: {:.0f}", i ? ", " : "", s.M, s.N, s.K, s.trans_a ? " ta" : "",
                          s.trans_b ? " tb" : "", r.best_shape_gflops[i]);
  }
  // Marked as stopped (first use searches again) only where the signal left candidates unmeasured,
  // not where it cut the second timings short.
  const bool cut_short = r.stopped && r.measured < r.planned;
  const std::string comment = fmt::format(
      "device '{}', driver {}, {} search, {}\nGFLOPS per shape: {}", device.name, device.driver, tune_mode_name(mode),
      tune_coverage_comment(r.measured, r.planned, r.seconds, r.budget_ran_out, cut_short), shapes);
  r.save_error = write_gemm_tune_cache(r.cache_path, r.row, comment);
  if (!r.save_error.empty()) r.cache_path.clear();
}

}  // namespace

GemmTuneResult tune_gemm(OpEnv& env, const GemmTuneOptions& options) {
  const auto t0 = Clock::now();
  const cl::DeviceInfo& device = env.device();
  const TuneMode mode = options.mode == TuneMode::off ? TuneMode::quick : options.mode;
  const std::vector<std::string> candidates = gemm_tune_candidates(device, mode);
  GemmTuneResult r;
  r.device = device.name;
  r.planned = candidates.size();
  r.shapes = scored_shapes(device);
  const GemmShape probe = probe_shape(device);
  std::vector<GemmShape> all = r.shapes;
  all.push_back(probe);
  Timer timer(env, all);

  // Stage 2 takes the best few; its share of the budget is held back from stage 1. Its first
  // finalist always runs (a winner needs a score on every shape), and takes several probes' time
  // (each shape its own program to build): a budget below a probe and a finalist is exceeded by
  // that finalist (cold caches on the 2-vCPU AVX-512 CPU: 13.9 s at 10 s; 43.7 s at 60 s).
  constexpr std::size_t finalists = 3;
  GemmTuneProgress progress;
  progress.total = candidates.size() + finalists;  // the twins are added in stage 2
  probe_candidates(timer, probe, candidates, TuneDeadline(options.budget_seconds * 0.6, t0, options.stop), progress,
                   options, device, r);
  score_finalists(timer, finalists, TuneDeadline(options.budget_seconds, t0, options.stop), device, progress, options,
                  r);
  r.seconds = seconds_since(t0);
  record_winner(env, mode, options, r);
  forget_gemm_tuning();  // later plans read the new row
  if (!r.cache_path.empty()) gemm_cache_settled(r.cache_path);
  return r;
}

}  // namespace ferry::ops
