// The attention tuner (see ops/attention_tune.hpp): every candidate's forward and backward timed on
// the shapes below; in each head-dimension class the lowest geometric mean of its shapes' times
// wins, and the winners are cached per device, driver and attention kernel source. Cache file:
//   # ferry attention tuning cache, written by the tuner (`ferry tune`); delete it to tune again.
//   # <comment lines>
//   kernel <class bound> <the class's winner, as AttentionOptions::kernel takes it>   (one per class)
//   # checksum <16 hex digits: FNV-1a of every line above>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>

#include "ferry/cl/context.hpp"
#include "ferry/cl/program.hpp"
#include "gemm_tune_cache.hpp"
#include "gemm_tuning.hpp"
#include "ops/attention_tune.hpp"
#include "ops/tune_deadline.hpp"
#include "tune_signals.hpp"
#include "tune_timer.hpp"

namespace ferry::ops {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* cache_what = "attention tuning cache";
constexpr const char* untuned_default = "blocked TQ=64 TK=32";

// The benchmark's shape class (one sequence of 1024, 12 heads of 64), the 85M GPT's attention (8
// sequences of 256), and both at head dimension 128, the 1B and 7B GPTs' (where the blocked
// kernels' tiles shrink to fit local memory): long rows and many short ones, two per class.
std::vector<AttentionShape> default_shapes() {
  return {{1, 1024, 12, 64}, {8, 256, 12, 64}, {1, 1024, 8, 128}, {8, 256, 16, 128}};
}

// A candidate's forward and backward, the best of three rounds of back-to-back runs (each round
// about 20 ms), in ms.
class Timer {
 public:
  Timer(OpEnv& env, const std::vector<AttentionShape>& shapes) : env_(env), ctx_(env.kernels.context()) {
    for (const AttentionShape& s : shapes) {
      elems_ = std::max(elems_, s.batch * s.context * s.width());
      rows_ = std::max(rows_, s.rows());
    }
    std::mt19937 rng(11);
    auto upload = [&](std::size_t n, const char* what) { return upload_random(ctx_, n, rng, what); };
    for (const char* what : {"attention tuner q", "attention tuner k", "attention tuner v", "attention tuner do"})
      inputs_.push_back(upload(elems_, what));
    for (const char* what : {"attention tuner o", "attention tuner dq", "attention tuner dk", "attention tuner dv"})
      outputs_.push_back(ctx_.create_buffer(elems_ * sizeof(float), what));
    lse_ = ctx_.create_buffer(rows_ * sizeof(float), "attention tuner lse");
  }

  double measure(const AttentionShape& s, const std::string& kernel) {
    const AttentionOptions o{kernel};
    const std::size_t need = std::max<std::size_t>(
        {attention_forward_scratch_elems(env_, s, o), attention_backward_scratch_elems(env_, s, o), 1});
    if (need > scratch_elems_) {
      scratch_ = ctx_.create_buffer(need * sizeof(float), "attention tuner scratch");
      scratch_elems_ = need;
    }
    auto span = [](const cl::Mem& m) { return DeviceSpan{m.get(), 0}; };
    const float scale = 1.0f / std::sqrt(float(s.head_dim));
    LaunchList launches = attention_forward(env_, s, DType::f32, scale, {}, span(inputs_[0]), span(inputs_[1]),
                                            span(inputs_[2]), span(outputs_[0]), span(lse_), span(scratch_), o);
    LaunchList backward = attention_backward(
        env_, s, DType::f32, scale, {}, span(inputs_[0]), span(inputs_[1]), span(inputs_[2]), span(outputs_[0]),
        span(lse_), span(inputs_[3]), span(outputs_[1]), span(outputs_[2]), span(outputs_[3]), span(scratch_), o);
    for (KernelLaunch& l : backward) launches.push_back(std::move(l));
    const double best = best_seconds_per_run(ctx_.compute(), launches, 100, "attention tuner");
    return best * 1e3;
  }

  // Builds what measure(s, kernel) will run (its programs land in the kernel library), on any
  // thread: the launches are made over the tuner's inputs (as arguments only: never enqueued) and
  // dropped, so nothing measure() reallocates is touched.
  void build(const AttentionShape& s, const std::string& kernel) {
    const AttentionOptions o{kernel};
    const DeviceSpan any{inputs_[0].get(), 0};
    attention_forward(env_, s, DType::f32, 1.0f, {}, any, any, any, any, any, any, o);
    attention_backward(env_, s, DType::f32, 1.0f, {}, any, any, any, any, any, any, any, any, any, any, o);
  }

 private:
  OpEnv& env_;
  const cl::Context& ctx_;
  std::size_t elems_ = 0, rows_ = 0, scratch_elems_ = 0;
  std::vector<cl::Mem> inputs_, outputs_;
  cl::Mem lse_, scratch_;
};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The kernels of a cache's body by class bound; throws std::invalid_argument on a line that is no
// class's valid kernel, or none.
std::map<std::size_t, std::string> parse_cache_kernels(OpEnv& env, const std::string& body) {
  std::istringstream lines(body);
  std::map<std::size_t, std::string> kernels;
  for (std::string line; std::getline(lines, line);) {
    if (!line.starts_with("kernel ")) continue;
    // "kernel <class bound> <kernel>"
    const std::string rest = line.substr(7);
    const std::size_t used = rest.find(' ');
    const std::string head = rest.substr(0, used);
    const bool digits = !head.empty() && head.size() < 6 && head.find_first_not_of("0123456789") == std::string::npos;
    const std::size_t bound = digits ? std::stoul(head) : 0;
    if (!digits || attention_tune_class(bound) != bound || used == std::string::npos)
      throw std::invalid_argument(fmt::format("'{}' names no head-dimension class", line));
    const std::string kernel = rest.substr(used + 1);
    attention_kernel_description(env, {1, 64, 1, bound}, {kernel});  // parses it
    kernels[bound] = kernel;
  }
  if (kernels.empty()) throw std::invalid_argument("no kernel line");
  return kernels;
}

// The winners written to the cache, unless it holds winners from a search that measured more
// candidates (options.replace_cached aside): those are kept (r.kept).
void record_winner(OpEnv& env, TuneMode mode, const AttentionTuneOptions& options, AttentionTuneResult& r) {
  r.cache_path = attention_tune_cache_path(env);
  if (r.cache_path.empty()) return;
  if (!options.replace_cached) {
    std::optional<std::string> cached = read_tune_cache_text(r.cache_path, cache_what, false);
    try {
      if (cached) parse_cache_kernels(env, *cached);
    } catch (const std::exception&) {
      cached.reset();  // not valid: replaced
    }
    r.kept = tune_cache_to_keep(cached, r.measured);
    if (r.kept) return;
  }
  std::string body = fmt::format(
      "# ferry attention tuning cache, written by the tuner (`ferry tune`); delete it to tune again.\n"
      "# device '{}', driver {}, {} search, {}\n",
      env.device().name, env.device().driver, tune_mode_name(mode),
      tune_coverage_comment(r.measured, r.planned, r.seconds, r.budget_ran_out, r.stopped && r.measured < r.planned));
  for (const AttentionTuneClass& c : r.classes) {
    std::string shapes;
    for (std::size_t i = 0; i < c.shapes.size(); ++i) {
      const AttentionShape& s = c.shapes[i];
      shapes += fmt::format("{}batch {} context {} heads {} x {}: {:.3f} ms", i ? ", " : "", s.batch, s.context,
                            s.heads, s.head_dim, c.best_shape_ms[i]);
    }
    body += fmt::format("# head dims up to {}, forward + backward: {}\nkernel {} {}\n", c.max_head_dim, shapes,
                        c.max_head_dim, c.best);
  }
  r.save_error = write_tune_cache_text(r.cache_path, body, cache_what);
  if (!r.save_error.empty()) r.cache_path.clear();
}

// "64: blocked TQ=64 TK=32; 128: tiled BQ=64 BK=32"
std::string summarize(const std::map<std::size_t, std::string>& kernels) {
  std::string out;
  for (const auto& [bound, kernel] : kernels) out += fmt::format("{}{}: {}", out.empty() ? "" : "; ", bound, kernel);
  return out;
}

struct TuningState {
  std::recursive_mutex mutex;
  std::map<cl_device_id, AttentionTuning> chosen;
  // Cache files a search of this process has settled since the last forget_attention_tuning(): a
  // stopped search's winners there are not searched again (ferry tune reads back what it decided).
  std::set<std::string> searched;
  // A first-use search a signal stopped: thrown again by every later choice until
  // forget_attention_tuning() (as the GEMM's: no caller may let the run go on past it).
  std::optional<TuneStopped> stopped;
};

TuningState& state() {
  static TuningState s;
  return s;
}

// First use on a device without a cached winner: the search, with a line of progress on stderr
// unless env.tune_progress is false. A stop signal ends the search as a spent budget does;
// TuneStopped follows.
AttentionTuning tune_now(OpEnv& env, TuneMode mode, double budget_seconds) {
  const bool show = env.tune_progress;
  if (show) {
    std::fprintf(stderr,
                 "ferry: tuning the attention kernels for '%s' (first use on this device and driver, about %.0f s at "
                 "most; `ferry tune` does it ahead of time, FERRY_TUNE=off skips it)\n",
                 env.device().name.c_str(), budget_seconds + 5);
  }
  AttentionTuneOptions o;
  o.mode = mode;
  o.budget_seconds = budget_seconds;
  if (show) {
    o.progress = [](const AttentionTuneProgress& p) {
      std::fprintf(stderr, "\rferry: tuning attention %zu/%zu, best %s   ", p.done, p.total, p.best.c_str());
      std::fflush(stderr);
    };
  }
  const auto [r, signal] =
      search_until_signal(env.tune_stop_signals, show, "attention", "winners are", o,
                          [&](const AttentionTuneOptions& options) { return tune_attention(env, options); });
  if (signal != 0) {
    std::string note;
    if (r.kept) {
      note = fmt::format("the cached winners in {}, from a search that measured {} of {} candidates, are kept",
                         r.cache_path, r.kept->measured, r.kept->planned);
    } else if (r.cache_path.empty()) {
      note = fmt::format("its best so far could not be saved ({})", r.save_error.empty() ? "no cache" : r.save_error);
    } else {
      note = fmt::format(
          "its best so far, {}, is saved in {}{}", r.best, r.cache_path,
          r.stopped && r.measured < r.planned ? " as a stopped search's, which the next run searches again" : "");
    }
    throw TuneStopped(
        signal, fmt::format("attention tuning for '{}' stopped by {} after {} of {} candidates; {}", env.device().name,
                            TuneStopSignals::name(signal), r.measured, r.planned, note));
  }
  if (show) {
    std::fprintf(stderr, "\rferry: tuned attention in %.1f s: %s%s%s%s\n", r.seconds, r.best.c_str(),
                 r.kept ? "; kept the cached winners of a more complete search" : "",
                 r.cache_path.empty() ? ""
                 : r.kept             ? " in "
                                      : ", saved in ",
                 r.cache_path.c_str());
  }
  if (r.kept) {
    if (auto cached = read_attention_tune_cache(env, r.cache_path)) return {std::move(*cached), r.cache_path};
  }
  AttentionTuning t;
  for (const AttentionTuneClass& c : r.classes) t.kernels.emplace(c.max_head_dim, c.best);
  t.source = r.cache_path.empty() ? std::string("tuned now (not cached)") : r.cache_path;
  return t;
}

}  // namespace

std::size_t attention_tune_class(std::size_t head_dim) {
  for (const std::size_t bound : attention_tune_classes) {
    if (head_dim <= bound) return bound;
  }
  return 0;
}

std::string AttentionTuning::kernel_for(std::size_t head_dim) const {
  const auto it = kernels.find(attention_tune_class(head_dim));
  return it == kernels.end() ? std::string() : it->second;
}

std::string AttentionTuning::summary() const {
  return summarize(kernels);
}

std::vector<std::string> attention_tune_candidates(const cl::DeviceInfo& device, TuneMode mode) {
  if (device.is_cpu()) return {};
  struct Tiles {
    const char* family;
    std::size_t a, b;  // blocked: TQ, TK; tiled: BQ, BK
    bool quick;
  };
  const Tiles all[] = {{"blocked", 64, 32, true},  {"blocked", 32, 32, true},  {"blocked", 64, 64, true},
                       {"blocked", 64, 16, true},  {"tiled", 64, 32, true},    {"blocked", 32, 64, false},
                       {"blocked", 32, 16, false}, {"blocked", 16, 32, false}, {"blocked", 16, 16, false},
                       {"tiled", 128, 16, false},  {"tiled", 32, 32, false},   {"tiled", 64, 16, false}};
  std::vector<std::string> out;
  for (const Tiles& t : all) {
    if (mode != TuneMode::full && !t.quick) continue;
    const bool blocked = std::string_view(t.family) == "blocked";
    const std::size_t group = blocked ? (t.a / 4) * (t.b / 4) : t.a;
    if (group > device.max_work_group_size) continue;
    out.push_back(blocked ? fmt::format("blocked TQ={} TK={}", t.a, t.b) : fmt::format("tiled BQ={} BK={}", t.a, t.b));
  }
  out.push_back("gemm");  // the scores through the tuned GEMM (ops/attention_gemm.hpp), in both searches
  // Where NVIDIA's compiler takes a register cap, the blocked tiles of the quick search again with
  // 168 registers a work-item: ptxas gives the dk dv kernel 225-241 at head dimension 64 (sm_90:
  // four work-groups of 64 a compute unit, 8 warps), capped five fit (local memory then limits),
  // with 12 bytes spilled (bench/RESULTS.md, "Registers and occupancy, read from ptxas"). Whether
  // the warps gained beat the spills only a measurement says, so they are candidates, not a rule.
  if (device.has_extension("cl_nv_compiler_options")) {
    for (const Tiles& t : all) {
      if (t.quick && std::string_view(t.family) == "blocked" && (t.a / 4) * (t.b / 4) <= device.max_work_group_size)
        out.push_back(fmt::format("blocked TQ={} TK={} RR=168", t.a, t.b));
    }
  }
  return out;
}

std::string attention_tune_cache_path(OpEnv& env) {
  const cl::ProgramCacheOptions& cache = env.kernels.cache_options();
  if (!cache.enabled || cache.dir.empty()) return "";
  const std::uint64_t key = tune_cache_key(env.device(), {"attention", "attention_blocked", "attention_gemm"});
  return (cache.dir / fmt::format("attention-tuning-{:016x}.txt", key)).string();
}

std::optional<std::map<std::size_t, std::string>> read_attention_tune_cache(OpEnv& env, const std::string& path,
                                                                            TuneCoverage* coverage) {
  const std::optional<std::string> body = read_tune_cache_text(path, cache_what);
  if (!body) return std::nullopt;
  std::map<std::size_t, std::string> kernels;
  try {
    kernels = parse_cache_kernels(env, *body);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ferry: warning: %s %s holds no valid kernel (%s); it will be tuned again and replaced\n",
                 cache_what, path.c_str(), e.what());
    return std::nullopt;
  }
  if (coverage) *coverage = tune_cache_coverage(*body).value_or(TuneCoverage{});
  return kernels;
}

AttentionTuneResult tune_attention(OpEnv& env, const AttentionTuneOptions& options) {
  const auto t0 = Clock::now();
  const cl::DeviceInfo& device = env.device();
  const TuneMode mode = options.mode == TuneMode::off ? TuneMode::quick : options.mode;
  const std::vector<std::string> candidates =
      options.candidates.empty() ? attention_tune_candidates(device, mode) : options.candidates;
  if (candidates.empty()) {
    throw std::invalid_argument(fmt::format(
        "attention tuning: '{}' is a CPU device, whose attention runs the cpu family's measured defaults; there is "
        "nothing to tune",
        device.name));
  }
  AttentionTuneResult r;
  r.device = device.name;
  r.planned = candidates.size();
  for (const AttentionShape& shape : options.shapes.empty() ? default_shapes() : options.shapes) {
    const std::size_t bound = attention_tune_class(shape.head_dim);
    if (bound == 0)
      throw std::invalid_argument(
          fmt::format("attention tuning: head dimension {} is above every class", shape.head_dim));
    auto it = std::find_if(r.classes.begin(), r.classes.end(), [&](const auto& c) { return c.max_head_dim == bound; });
    if (it == r.classes.end()) it = r.classes.insert(r.classes.end(), AttentionTuneClass{.max_head_dim = bound});
    it->shapes.push_back(shape);
  }
  std::sort(r.classes.begin(), r.classes.end(),
            [](const auto& a, const auto& b) { return a.max_head_dim < b.max_head_dim; });
  std::vector<AttentionShape> all;
  for (const AttentionTuneClass& c : r.classes) all.insert(all.end(), c.shapes.begin(), c.shapes.end());
  Timer timer(env, all);
  AttentionTuneProgress progress;
  progress.total = candidates.size();
  // Every (candidate, shape) in the order of the timing (on the H200, 12 candidates took 30.5 s,
  // probably mostly their builds, before builds went ahead: bench/RESULTS.md, "Third GPU run").
  std::vector<std::function<void()>> builds;
  for (const std::string& kernel : candidates) {
    for (const AttentionShape& s : all) builds.push_back([&timer, s, kernel] { timer.build(s, kernel); });
  }
  // The gemm family runs the GEMM's row for this device: settled here, before anything builds or is
  // timed, so that a first GEMM search (a device no row names, no cached winner) does not start on
  // a build-ahead thread and time its products beside these candidates.
  if (std::any_of(candidates.begin(), candidates.end(), [](const std::string& k) { return k.starts_with("gemm"); }))
    gemm_tuning_for(env);
  const BuildAhead ahead(device, !device.is_cpu() || options.build_ahead_on_cpus, std::move(builds));
  TuneDeadline deadline(options.budget_seconds, t0, options.stop);
  for (const std::string& kernel : candidates) {
    const bool every_class_won =
        std::all_of(r.classes.begin(), r.classes.end(), [](const auto& c) { return !c.best.empty(); });
    if (!deadline.next_fits() && every_class_won) {
      (deadline.stopped() ? r.stopped : r.budget_ran_out) = true;
      break;
    }
    AttentionTuneCandidate c;
    c.kernel = kernel;
    deadline.begin();
    for (AttentionTuneClass& cls : r.classes) {
      std::vector<double> times;
      double score = 0;
      try {
        double log_sum = 0;
        for (const AttentionShape& s : cls.shapes) {
          times.push_back(timer.measure(s, kernel));
          log_sum += std::log(times.back());
        }
        score = std::exp(log_sum / double(times.size()));
      } catch (const std::exception& e) {
        // A candidate this device cannot build or run at these head dims: skipped there, and said so.
        if (c.error.empty()) c.error = fmt::format("head dims up to {}: {}", cls.max_head_dim, e.what());
      }
      c.score_ms.push_back(score);
      if (score > 0 && (cls.best.empty() || score < cls.best_ms)) {
        cls.best = kernel;
        cls.best_ms = score;
        cls.best_shape_ms = times;
      }
    }
    deadline.end();
    r.candidates.push_back(std::move(c));
    ++r.measured;
    std::map<std::size_t, std::string> so_far;
    for (const AttentionTuneClass& cls : r.classes) {
      if (!cls.best.empty()) so_far.emplace(cls.max_head_dim, fmt::format("{} ({:.3f} ms)", cls.best, cls.best_ms));
    }
    progress.best = summarize(so_far);
    ++progress.done;
    if (options.progress) options.progress(progress);
  }
  std::map<std::size_t, std::string> winners;
  for (const AttentionTuneClass& cls : r.classes) {
    if (cls.best.empty()) {
      throw std::runtime_error(fmt::format(
          "attention tuning on '{}': no candidate could run at head dims up to {}; the first failed with: {}",
          device.name, cls.max_head_dim, r.candidates.at(0).error));
    }
    winners.emplace(cls.max_head_dim, cls.best);
  }
  r.best = summarize(winners);
  r.seconds = seconds_since(t0);
  record_winner(env, mode, options, r);
  forget_attention_tuning();  // later attention ops read the new winner
  if (!r.cache_path.empty()) {
    TuningState& st = state();
    std::lock_guard lock(st.mutex);
    st.searched.insert(r.cache_path);
  }
  return r;
}

AttentionTuning attention_tuning_for(OpEnv& env) {
  const cl::DeviceInfo& device = env.device();
  if (device.is_cpu()) return {{}, "defaults (CPU devices run the cpu family's measured tiles)"};
  TuningState& st = state();
  std::lock_guard lock(st.mutex);
  if (auto it = st.chosen.find(device.id); it != st.chosen.end()) return it->second;
  if (st.stopped) throw *st.stopped;
  const TuneMode mode = tune_mode_from_env();
  const double budget = tune_budget_from_env();
  AttentionTuning t{{}, fmt::format("defaults (FERRY_TUNE=off: {})", untuned_default)};
  if (mode != TuneMode::off) {
    const std::string cache = attention_tune_cache_path(env);
    if (cache.empty()) {
      std::fprintf(stderr,
                   "ferry: note: not tuning the attention kernels for '%s': the program cache is off, so a winner "
                   "could not be kept (set FERRY_CACHE_DIR to a writable folder); %s runs\n",
                   device.name.c_str(), untuned_default);
      t.source = fmt::format("defaults (no program cache: {})", untuned_default);
    } else {
      TuneCoverage coverage;
      auto cached = read_attention_tune_cache(env, cache, &coverage);
      const bool again =
          search_stopped_winner_again(cached ? std::optional(coverage) : std::nullopt, st.searched.contains(cache),
                                      env.tune_progress, cache, "attention kernels");
      try {
        t = cached && !again ? AttentionTuning{std::move(*cached), cache} : tune_now(env, mode, budget);
      } catch (const TuneStopped& e) {
        st.stopped = e;
        throw;
      }
    }
  }
  st.chosen.emplace(device.id, t);
  return t;
}

void forget_attention_tuning() {
  TuningState& st = state();
  std::lock_guard lock(st.mutex);
  st.chosen.clear();
  st.searched.clear();
  st.stopped.reset();
}

}  // namespace ferry::ops
