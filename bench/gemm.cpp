// ferry-bench gemm: is ferry's GEMM as fast as the best alternatives on this device?
// ferry's kernel (as the tuning data picks it, packing included), CLBlast on the same device and
// OpenBLAS's cblas_sgemm on the host, in one run, square sizes; GFLOPS of the median repeat (of the
// median round with --rounds, whose ratios are taken round by round).
// Every result is checked on a sample of its elements against dot products in double on the host;
// one beyond the tolerance fails the run instead of reporting its GFLOPS.
// --tune runs the library's tuner and prints every candidate and the best as a tuning row.
#include "ops/gemm.hpp"

#include <fmt/format.h>
#include <strings.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <thread>

#include "bench.hpp"
#include "ferry/cl/context.hpp"
#include "ferry/cl/error.hpp"
#include "ferry/cl/program.hpp"
#include "ferry/ops/cast.hpp"
#include "ops/gemm_tune.hpp"
#include "peer.hpp"
#include "runtime/cli/validators.hpp"

#ifdef FERRY_HAVE_OPENBLAS
#include <cblas.h>
extern "C" char* openblas_get_corename(void);
extern "C" int openblas_get_num_threads(void);
#endif

namespace ferry::bench {
namespace {

struct GemmBenchOptions {
  std::vector<std::size_t> sizes{1024, 2048, 1000};
  std::vector<std::size_t> shape;  // M, N, K: one non-square shape instead of --sizes
  std::vector<std::string> impls{"ferry", "clblast", "openblas"};
  bool trans_a = false, trans_b = false;
  std::string kernel;           // GemmOptions::kernel for ferry
  std::string storage = "f32";  // ferry's A, B and C stored as f32, f16 or bf16 (products in f32)
  bool tune = false;
  bool breakdown = false;  // ferry's launches (packing, product, sum of splits) timed one by one
  bool cold = false;       // each run after its operands were pushed out of the caches
  std::string tune_mode = "quick";
  double tune_budget_seconds = 60;
  // Rounds of every implementation in turn (the order reversed every other round); each figure is
  // the median over rounds, each ratio the median of the rounds' own ratios: on a shared machine
  // whose speed drifts, ratios taken round by round hold where one long run of each would not.
  int rounds = 1;
};

std::vector<float> random_matrix(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

bool wants(const GemmBenchOptions& o, std::string_view impl) {
  return std::find(o.impls.begin(), o.impls.end(), impl) != o.impls.end();
}

// `values` in storage type t (rounded to nearest even), as bytes.
std::vector<std::byte> stored_as(ops::DType t, const std::vector<float>& values) {
  std::vector<std::byte> out(values.size() * ops::dtype_bytes(t));
  ops::ref::cast(ops::DType::f32, t, values.data(), out.data(), values.size());
  return out;
}

// `values` as a kernel reads them back from storage type t.
std::vector<float> rounded_to(ops::DType t, const std::vector<float>& values) {
  const std::vector<std::byte> stored = stored_as(t, values);
  std::vector<float> out(values.size());
  ops::ref::cast(t, ops::DType::f32, stored.data(), out.data(), out.size());
  return out;
}

// Device operands for one shape, filled with random data, stored as the shape's dtypes.
struct DeviceOperands {
  cl::Mem a, b, c, scratch;
  DeviceOperands(const cl::Context& ctx, const ops::GemmShape& s, const std::vector<float>& ha,
                 const std::vector<float>& hb, std::size_t scratch_elems) {
    const std::vector<std::byte> sa = stored_as(s.a, ha), sb = stored_as(s.b, hb);
    a = ctx.create_buffer(sa.size(), "gemm bench A");
    b = ctx.create_buffer(sb.size(), "gemm bench B");
    c = ctx.create_buffer(s.M * s.N * ops::dtype_bytes(s.c), "gemm bench C");
    ctx.write(a.get(), 0, sa.data(), sa.size());
    ctx.write(b.get(), 0, sb.data(), sb.size());
    if (scratch_elems) scratch = ctx.create_buffer(scratch_elems * sizeof(float), "gemm bench scratch");
  }
};

struct Measured {
  double ms = 0;      // median
  double ms_min = 0;  // fastest repeat: on a shared, noisy machine the closest to what the code can do
  std::string kernel;
  std::vector<float> c;                               // the result, to compare implementations
  nlohmann::json launches = nlohmann::json::array();  // with --breakdown: {"kernel", "ms"} per launch
};

std::string kernel_name(const ops::KernelLaunch& l) {
  if (l.custom) return "library call";
  std::size_t size = 0;
  cl::check(clGetKernelInfo(l.kernel.get(), CL_KERNEL_FUNCTION_NAME, 0, nullptr, &size), "clGetKernelInfo");
  std::string name(size, '\0');
  cl::check(clGetKernelInfo(l.kernel.get(), CL_KERNEL_FUNCTION_NAME, size, name.data(), nullptr), "clGetKernelInfo");
  if (!name.empty() && name.back() == '\0') name.pop_back();
  return name;
}

// Bytes that push a product's operands out of the caches: four times the largest cache the device
// reports, at least 64 MiB.
std::size_t eviction_bytes(const cl::DeviceInfo& device) {
  return std::max<std::size_t>(std::size_t(64) << 20, 4 * device.global_mem_cache_bytes);
}

// --cold: `repeat` runs, each alone and after evict() (untimed) wrote more than the caches hold,
// so that the product reads its operands from memory as a training step's backward does (its
// operands were made long before, or evicted by the nodes between). Untimed runs for cold_warm_ms
// first, as time_rounds warms up: OpenBLAS's worker threads spin (sched_yield) for about 0.1 s
// after the library loads (and a while after each call), and on a 2-core machine they took a core
// from the first cold runs timed next (single runs of 256 x 1024 x 784: 5.0 ms among 2.4 ms ones).
constexpr double cold_warm_ms = 300.0;
template <class Run, class Evict>
std::vector<double> cold_times(Run&& run, Evict&& evict, int repeat) {
  const auto start = std::chrono::steady_clock::now();
  do {
    run();
  } while (std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() < cold_warm_ms);
  std::vector<double> times;
  for (int r = 0; r < repeat; ++r) {
    evict();
    times.push_back(time_ms(run));
  }
  return times;
}

// Binds once, then times `repeat` rounds of back-to-back runs after a warm-up (time_rounds; its
// first run takes the program builds and CLBlast's compile), or with `cold` each run alone from
// memory (cold_times).
Measured measure_device(ops::OpEnv& env, const cl::Context& ctx, const ops::GemmShape& s, const std::vector<float>& ha,
                        const std::vector<float>& hb, const ops::GemmOptions& options, int repeat, bool keep_c,
                        bool breakdown = false, bool cold = false) {
  DeviceOperands d(ctx, s, ha, hb, ops::gemm_scratch_elems(env, s, options));
  Measured m;
  m.kernel = ops::gemm_kernel_description(env, s, options);
  auto launches =
      ops::gemm(env, s, 1.0f, {d.a.get(), 0}, {d.b.get(), 0}, 0.0f, {d.c.get(), 0}, {d.scratch.get(), 0}, options);
  const auto run = [&] { ops::enqueue(ctx.compute(), launches, {}); };
  const auto finish = [&] { cl::check(clFinish(ctx.compute()), "clFinish"); };
  std::vector<double> times;
  if (cold) {
    const std::size_t bytes = eviction_bytes(env.device());
    const cl::Mem sweep = ctx.create_buffer(bytes, "cache eviction");
    times = cold_times(
        [&] {
          run();
          finish();
        },
        [&] { ctx.zero(sweep.get(), 0, bytes); }, repeat);
  } else {
    times = time_rounds(run, finish, repeat);
  }
  m.ms = median(times);
  m.ms_min = *std::min_element(times.begin(), times.end());
  // Each launch alone, after the whole list ran (its inputs are in place): where the time goes
  // between packing, the product and the sum of K splits. Their sum exceeds the list's time by
  // what back-to-back launches overlap and keep in cache.
  for (std::size_t i = 0; breakdown && i < launches.size(); ++i) {
    const ops::LaunchList one(launches.begin() + i, launches.begin() + i + 1);
    const std::vector<double> t = time_rounds([&] { ops::enqueue(ctx.compute(), one, {}); },
                                              [&] { cl::check(clFinish(ctx.compute()), "clFinish"); }, repeat);
    m.launches.push_back({{"kernel", kernel_name(launches[i])}, {"ms", median(t)}});
  }
  if (keep_c) {
    std::vector<std::byte> stored(s.M * s.N * ops::dtype_bytes(s.c));
    ctx.read(d.c.get(), 0, stored.data(), stored.size());
    m.c.resize(s.M * s.N);
    ops::ref::cast(s.c, ops::DType::f32, stored.data(), m.c.data(), m.c.size());
  }
  return m;
}

#ifdef FERRY_HAVE_OPENBLAS
Measured measure_openblas(const ops::GemmShape& s, const std::vector<float>& ha, const std::vector<float>& hb,
                          int repeat, std::size_t cold_bytes) {
  Measured m;
  m.c.assign(s.M * s.N, 0.0f);
  const int M = static_cast<int>(s.M), N = static_cast<int>(s.N), K = static_cast<int>(s.K);
  auto run = [&] {
    cblas_sgemm(CblasRowMajor, s.trans_a ? CblasTrans : CblasNoTrans, s.trans_b ? CblasTrans : CblasNoTrans, M, N, K,
                1.0f, ha.data(), s.trans_a ? M : K, hb.data(), s.trans_b ? K : N, 0.0f, m.c.data(), N);
  };
  std::vector<double> times;
  if (cold_bytes) {
    std::vector<unsigned char> sweep(cold_bytes);
    unsigned char fill = 0;
    times = cold_times(
        run, [&] { std::memset(sweep.data(), ++fill, sweep.size()); }, repeat);
  } else {
    times = time_rounds(
        run, [] {}, repeat);  // as the device side is timed
  }
  m.ms = median(times);
  m.ms_min = *std::min_element(times.begin(), times.end());
  m.kernel = fmt::format("cblas_sgemm, core {}, {} threads", openblas_get_corename(), openblas_get_num_threads());
  // OpenBLAS's threads spin for a while after a call; let them sleep before the device runs again.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  return m;
}
#endif

// One implementation's rounds as one measurement: the median of the rounds' medians, the fastest
// run of any round, the last round's result, kernel and launches.
Measured over_rounds(const std::vector<Measured>& rounds) {
  Measured m = rounds.back();
  std::vector<double> medians;
  for (const Measured& r : rounds) {
    medians.push_back(r.ms);
    m.ms_min = std::min(m.ms_min, r.ms_min);
  }
  m.ms = median(medians);
  return m;
}

double max_rel_diff(const std::vector<float>& x, const std::vector<float>& ref) {
  double worst = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    worst = std::max(worst, std::abs(double(x[i]) - ref[i]) / (1.0 + std::abs(double(ref[i]))));
  }
  return worst;
}

// The sampled check of one result: its largest error, each element's |c - ref| over the
// magnitude of its products (sum over k of |a_ik b_kj|, ref their sum in double), and where.
struct Check {
  double max_err = 0, tolerance = 0, want = 0;
  std::size_t i = 0, j = 0, samples = 0;
  float got = 0;
  bool passed() const { return max_err <= tolerance; }
};

// Elements of C checked per result: the four corners and this many at random (i, j).
constexpr std::size_t check_samples = 256;

// Checks `c` (row-major [M, N]) against A and B as the implementation read them (`a`, `b`: the
// values after rounding to its storage). Tolerance: C's storage rounding (unit roundoff 2^-24
// f32, 2^-11 f16, 2^-8 bf16) plus the f32 sums' worst case over K terms, K 2^-24, both relative to
// the products' magnitude: a sum in any order stays within it, a wrong element does not.
Check check_result(const ops::GemmShape& s, ops::DType c_storage, const std::vector<float>& a,
                   const std::vector<float>& b, const std::vector<float>& c) {
  const double unit = c_storage == ops::DType::f32 ? 0x1p-24 : c_storage == ops::DType::f16 ? 0x1p-11 : 0x1p-8;
  Check out;
  out.tolerance = unit + double(s.K) * 0x1p-24;
  std::vector<std::pair<std::size_t, std::size_t>> at{{0, 0}, {0, s.N - 1}, {s.M - 1, 0}, {s.M - 1, s.N - 1}};
  std::mt19937_64 rng(3);
  for (std::size_t n = 0; n < check_samples; ++n) at.emplace_back(rng() % s.M, rng() % s.N);
  for (const auto& [i, j] : at) {
    double sum = 0, magnitude = 0;
    for (std::size_t k = 0; k < s.K; ++k) {
      const double p = double(a[s.trans_a ? k * s.M + i : i * s.K + k]) * b[s.trans_b ? j * s.K + k : k * s.N + j];
      sum += p;
      magnitude += std::abs(p);
    }
    const float got = c[i * s.N + j];
    const double err = std::isfinite(got) ? std::abs(double(got) - sum) / std::max(magnitude, 1e-30) : INFINITY;
    if (err >= out.max_err) out = {err, out.tolerance, sum, i, j, 0, got};
  }
  out.samples = at.size();
  return out;
}

double gflops(const ops::GemmShape& s, double ms) {
  return 2.0 * double(s.M) * s.N * s.K / (ms * 1e6);
}

// Host bytes one shape takes: A and B in f32, their copies as stored and as the check reads them,
// and each implementation's C of every round (kept to compare them) with one more being read back.
double host_bytes(const ops::GemmShape& s, int impls, int rounds) {
  const double ab = double(s.M) * double(s.K) + double(s.K) * double(s.N), c = double(s.M) * double(s.N);
  return sizeof(float) * (2 * ab + c * (impls * rounds + 1));
}

// Every shape's host memory, before any is allocated: a size the host cannot hold failed with
// std::bad_alloc, or the kernel's OOM killer ended the process.
void check_shapes_fit(const GemmBenchOptions& o, const std::vector<ops::GemmShape>& shapes) {
  const int impls = int(wants(o, "ferry")) + int(wants(o, "clblast")) + int(wants(o, "openblas"));
  for (const ops::GemmShape& s : shapes) {
    const std::string what =
        o.shape.empty() ? fmt::format("--sizes {}: M = N = K = {}", s.M, s.M)
                        : fmt::format("--shape {},{},{}: M = {}, N = {}, K = {}", s.M, s.N, s.K, s.M, s.N, s.K);
    check_host_memory(fmt::format("{} (A, B and the C of {} implementation(s) x {} round(s), f32 on the host)", what,
                                  impls, o.rounds),
                      host_bytes(s, impls, o.rounds), o.shape.empty() ? "give smaller sizes" : "give a smaller shape");
  }
}

int run_compare(const BenchCommon& common, const GemmBenchOptions& o) {
  std::vector<ops::GemmShape> shapes;
  if (!o.shape.empty()) {
    if (o.shape.size() != 3) throw std::invalid_argument("--shape takes M,N,K");
    shapes.push_back({o.shape[0], o.shape[1], o.shape[2], o.trans_a, o.trans_b});
  } else {
    for (std::size_t n : o.sizes) shapes.push_back({n, n, n, o.trans_a, o.trans_b});
  }
  check_shapes_fit(o, shapes);
  const cl::DeviceInfo device = cl::select_device(common.device);
  cl::Context ctx(device);
  cl::KernelLibrary lib(ctx);
  ops::OpEnv env{lib};
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
#ifdef FERRY_HAVE_OPENBLAS
  const bool have_openblas = true;
  // Only where its choice differs from what the flags suggest (a misdetected CPU).
  if (wants(o, "openblas") && !coretype && !openblas_core_fits(openblas_get_corename())) {
    fmt::print(stderr,
               "warning: OPENBLAS_CORETYPE is not set and OpenBLAS chose core {}; Debian's OpenBLAS misdetects some "
               "CPUs and runs ~4x slower: this CPU's flags suggest OPENBLAS_CORETYPE={}\n",
               openblas_get_corename(), openblas_coretype());
  }
#else
  const bool have_openblas = false;
#endif
  if (o.breakdown && !wants(o, "ferry")) {
    throw std::invalid_argument("--breakdown times ferry's launches: add ferry to --impls");
  }
  if (wants(o, "clblast") && !ops::gemm_have_clblast()) fmt::print(stderr, "note: built without CLBlast; skipped\n");
  if (wants(o, "openblas") && !have_openblas) fmt::print(stderr, "note: built without OpenBLAS; skipped\n");

  const ops::DType storage = ops::parse_dtype(o.storage);
  if (storage != ops::DType::f32 && storage != ops::DType::f16 && storage != ops::DType::bf16) {
    throw std::invalid_argument(fmt::format("--storage {}: the GEMM stores f32, f16 or bf16", o.storage));
  }
  bool failed = false;
  for (const ops::GemmShape& s : shapes) {
    const auto ha = random_matrix(s.M * s.K, 1), hb = random_matrix(s.K * s.N, 2);
    // Each implementation's measurement, every round; a round's measurements come one after another.
    std::map<std::string, std::vector<Measured>> rounds;
    const auto measure = [&](const std::string& impl) {
      if (impl == "ferry" && wants(o, "ferry")) {
        ops::GemmOptions opt;
        opt.backend = ops::GemmBackend::ferry;
        opt.kernel = o.kernel;
        ops::GemmShape stored = s;
        stored.a = stored.b = stored.c = storage;
        rounds[impl].push_back(measure_device(env, ctx, stored, ha, hb, opt, common.repeat, true, o.breakdown, o.cold));
      } else if (impl == "clblast" && wants(o, "clblast") && ops::gemm_have_clblast()) {
        ops::GemmOptions opt;
        opt.backend = ops::GemmBackend::clblast;
        rounds[impl].push_back(measure_device(env, ctx, s, ha, hb, opt, common.repeat, true, false, o.cold));
      }
#ifdef FERRY_HAVE_OPENBLAS
      if (impl == "openblas" && wants(o, "openblas"))
        rounds[impl].push_back(measure_openblas(s, ha, hb, common.repeat, o.cold ? eviction_bytes(env.device()) : 0));
#endif
    };
    std::vector<std::string> order{"ferry", "clblast", "openblas"};
    for (int r = 0; r < o.rounds; ++r) {
      for (const std::string& impl : order) measure(impl);
      std::reverse(order.begin(), order.end());
    }
    std::optional<Measured> ferry_m, clblast_m, openblas_m;
    if (rounds.contains("ferry")) ferry_m = over_rounds(rounds["ferry"]);
    if (rounds.contains("clblast")) clblast_m = over_rounds(rounds["clblast"]);
    if (rounds.contains("openblas")) openblas_m = over_rounds(rounds["openblas"]);
    // A peer's time over ferry's, round by round, and their median.
    const auto ratios = [&](const std::string& peer) {
      std::vector<double> each;
      for (std::size_t r = 0; r < rounds[peer].size() && r < rounds["ferry"].size(); ++r)
        each.push_back(rounds[peer][r].ms / rounds["ferry"][r].ms);
      return each;
    };
    // Each result against the host's dot products; ferry's from its inputs rounded as it stored them.
    std::map<std::string, Check> checks;
    if (ferry_m)
      checks["ferry"] = check_result(s, storage, rounded_to(storage, ha), rounded_to(storage, hb), ferry_m->c);
    if (clblast_m) checks["clblast"] = check_result(s, ops::DType::f32, ha, hb, clblast_m->c);
    if (openblas_m) checks["openblas"] = check_result(s, ops::DType::f32, ha, hb, openblas_m->c);
    const auto valid = [&](const char* impl) { return checks.contains(impl) && checks[impl].passed(); };
    auto line = [&](const char* impl, const Measured& m) {
      const Check& check = checks[impl];
      if (!check.passed()) {
        fmt::print(stderr,
                   "ferry-bench gemm: error: {} computed a wrong product for M={} N={} K={} {}{} ({}): C[{}, {}] = {}, "
                   "the host's dot product in double {} (error {:.3g} of the products' magnitude, tolerance {:.3g}); "
                   "its time is not reported\n",
                   impl, s.M, s.N, s.K, s.trans_a ? "T" : "N", s.trans_b ? "T" : "N",
                   std::string(impl) == "ferry" ? ops::dtype_name(storage) : "f32", check.i, check.j, check.got,
                   check.want, check.max_err, check.tolerance);
        failed = true;
        return;
      }
      nlohmann::json j{{"bench", "gemm"},
                       {"impl", impl},
                       {"m", s.M},
                       {"n", s.N},
                       {"k", s.K},
                       {"trans", fmt::format("{}{}", s.trans_a ? "T" : "N", s.trans_b ? "T" : "N")},
                       {"storage", std::string(impl) == "ferry" ? ops::dtype_name(storage) : "f32"},
                       {"gflops", gflops(s, m.ms)},
                       {"ms", m.ms},
                       {"gflops_best", gflops(s, m.ms_min)},
                       {"repeat", common.repeat},
                       {"cold", o.cold},
                       {"device", std::string(impl) == "openblas" ? "host CPU" : device.name},
                       {"kernel", m.kernel}};
      j["max_rel_err"] = check.max_err;
      j["check_tolerance"] = check.tolerance;
      j["check_samples"] = check.samples;
      j["rounds"] = o.rounds;
      // A peer's ratio: its time over this implementation's, the median of the rounds' (ferry's
      // line), or of one long run each where this is a peer itself.
      const auto ratio = [&](const char* peer, const Measured& p) {
        if (std::string(impl) != "ferry") return nlohmann::json(p.ms / m.ms);
        const std::vector<double> each = ratios(peer);
        j[fmt::format("ratio_vs_{}_rounds", peer)] = each;
        return nlohmann::json(median(each));
      };
      if (openblas_m && valid("openblas")) {
        j["ratio_vs_openblas"] = ratio("openblas", *openblas_m);
        j["openblas_coretype"] = coretype ? nlohmann::json(coretype) : nlohmann::json(nullptr);
      }
      if (clblast_m && valid("clblast")) j["ratio_vs_clblast"] = ratio("clblast", *clblast_m);
      if (std::string(impl) == "ferry" && openblas_m) j["max_rel_diff_vs_openblas"] = max_rel_diff(m.c, openblas_m->c);
      if (!m.launches.empty()) j["launches"] = m.launches;
      emit_json(j);
    };
    if (ferry_m) line("ferry", *ferry_m);
    if (clblast_m) line("clblast", *clblast_m);
    if (openblas_m) line("openblas", *openblas_m);
  }
  return failed ? 1 : 0;
}

// The library's tuner (ops/gemm_tune.hpp, as `ferry tune` runs it): every candidate as a JSON
// line, then the winner and its tuning row. It also saves the winner in the tuning cache.
int run_tune(const BenchCommon& common, const GemmBenchOptions& o) {
  const cl::DeviceInfo device = cl::select_device(common.device);
  cl::Context ctx(device);
  cl::KernelLibrary lib(ctx);
  ops::OpEnv env{lib};
  ops::GemmTuneOptions options;
  options.mode = o.tune_mode == "full" ? ops::TuneMode::full : ops::TuneMode::quick;
  options.budget_seconds = o.tune_budget_seconds;
  const ops::GemmTuneResult r = ops::tune_gemm(env, options);
  for (const auto& c : r.candidates) {
    emit_json({{"bench", "gemm-tune"},
               {"kernel", c.kernel},
               {"probe_gflops", c.probe_gflops},
               {"score_gflops", c.score_gflops},
               {"error", c.error},
               {"device", device.name}});
  }
  emit_json({{"bench", "gemm-tune"},
             {"best", r.best},
             {"gflops_geomean", r.best_gflops},
             {"seconds", r.seconds},
             {"device", device.name},
             {"tuning_row", r.row},
             {"cache_path", r.cache_path}});
  fmt::print(stderr, "tuning row for ops/tuning/gemm.tsv:\n{}\n", r.row);
  return 0;
}

BenchRun setup(CLI::App& sub, const BenchCommon& common) {
  auto o = std::make_shared<GemmBenchOptions>();
  CLI::Option* sizes =
      sub.add_option("--sizes", o->sizes, "square sizes M = N = K")
          ->delimiter(',')
          ->check(ferry::cli::whole_number())  // before the range, whose message for "abc" was "not in range"
          ->check(CLI::Range(1, 1 << 20));
  CLI::Option* shape = sub.add_option("--shape", o->shape, "one shape M,N,K instead of square sizes (not with --sizes)")
                           ->delimiter(',')
                           ->check(ferry::cli::whole_number())
                           ->check(CLI::Range(1, 1 << 24))
                           ->expected(3)
                           ->excludes(sizes);
  sub.add_option("--impls", o->impls, "implementations to run: ferry, clblast, openblas")
      ->delimiter(',')
      ->check(CLI::IsMember({"ferry", "clblast", "openblas"}));
  sub.add_flag("--trans-a", o->trans_a, "A stored [K, M]");
  sub.add_flag("--trans-b", o->trans_b, "B stored [N, K]");
  sub.add_option("--storage", o->storage,
                 "ferry's A, B and C stored as f32, f16 or bf16 (products and sums in f32; the peers run f32)")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  sub.add_option("--kernel", o->kernel,
                 "ferry kernel and parameters, e.g. \"packed RB=4 NV=4\" (default: tuning data)");
  sub.add_option("--rounds", o->rounds,
                 "rounds of every implementation in turn, --repeat runs each (the order reversed every other "
                 "round): GFLOPS from the median round, ratios the median of the rounds' own (ratio_vs_*_rounds), "
                 "which hold on a machine whose speed drifts")
      ->check(ferry::cli::whole_number())
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  CLI::Option* cold =
      sub.add_flag("--cold", o->cold,
                   "time each run alone after writing more than the caches hold (64 MiB, or four times the device's "
                   "largest cache): operands read from memory, as a training step's backward reads them");
  sub.add_flag("--breakdown", o->breakdown,
               "also time each of ferry's launches alone (B and A packing, the product, the sum of K splits): "
               "`launches` in its JSON line")
      ->excludes(cold);
  CLI::Option* tune =
      sub.add_flag("--tune", o->tune,
                   "run the GEMM tuner (as `ferry tune` does): every candidate measured, the best as a tuning row")
          ->excludes(sizes)
          ->excludes(shape);  // the tuner measures its own shapes
  sub.add_option("--tune-mode", o->tune_mode, "with --tune: quick or full")
      ->check(CLI::IsMember({"quick", "full"}))
      ->capture_default_str()
      ->needs(tune);
  sub.add_option("--tune-budget-seconds", o->tune_budget_seconds, "with --tune: the search's budget")
      ->check(ferry::cli::positive_number())
      ->capture_default_str()
      ->needs(tune);
  return [o, &common] { return o->tune ? run_tune(common, *o) : run_compare(common, *o); };
}

FERRY_BENCH("gemm", "SGEMM: ferry's kernel vs CLBlast vs OpenBLAS (GFLOPS, ratios)", setup);

}  // namespace
}  // namespace ferry::bench
