// ferry-bench peak: the device's fp32 multiply-add peak, the ceiling every GEMM and training-step
// figure is read against.
//
// A kernel of fma() chains: each work-item keeps `accumulators` vectors of `vector_width` floats
// and updates each in place `iters` times, a = fma(a, g, c) with g = 1 + 2^-23 and a tiny c. The
// accumulators' fma()s of one iteration are independent of each other and each needs no register
// beyond its own, g and c, so enough of them hide the FMA latency on a CPU with 16 vector registers
// as on one with 32: the time is the FMA units' throughput and nothing else, no memory traffic
// beyond one store per accumulator at the end. (Chains that turned pairs of accumulators needed a
// copy of one of each pair per iteration: on the AVX2 EPYC the compiler's copies and spills held
// the best candidate at 150 GFLOPS, below the GEMM's 178, where a C loop of the same fmas ran at
// 214.) Every (width, accumulators) pair of the candidate lists is built and timed; the best is the
// peak. CPU devices run one work-item per work-group (as ferry's CPU kernels do, vectorised by its
// explicit vector types); other devices run work-groups as wide as the device allows. Eight
// work-groups per compute unit keep every core or multiprocessor busy.
//
// The result is checked: every accumulator's lanes must equal, bit for bit, the same chain of
// fmaf() on the host (fma is correctly rounded on both sides), so a compiler that dropped or
// shortened the loop fails the run instead of reporting an impossible peak. The chains never
// settle: in [2^e, 2^(e+1)) each step adds a * 2^-23 + c, at least one unit in the last place, so
// one iteration more or less changes every value. They grow by about e^(2^-23) an iteration, from
// [1, 2): over the most iterations a launch runs (kMaxIters, 4e8) by about e^48, far from
// overflow. (A contracting chain such as a = fma(a, 0.9999, 1e-4) reaches its fp32 fixed point
// within ~80k iterations, after which any count gives the same values and the check sees nothing.)
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "bench.hpp"
#include "ferry/cl/error.hpp"
#include "ferry/runtime/runtime.hpp"
#include "runtime/cli/validators.hpp"

namespace ferry::bench {
namespace {

struct PeakBenchOptions {
  std::vector<int> widths{1, 4, 8, 16};
  std::vector<int> accumulators{4, 8, 12, 16};
  double run_ms = 100;  // each timed launch runs about this long (the iterations are sized to it)
};

constexpr float kGrow = 1.0f + 0x1p-23f;  // the chains' factor per iteration (the float after 1)
constexpr float kAdd = 0x1p-30f;          // and addend: an fma, not a multiply the compiler may fold
constexpr std::uint32_t kMaxIters = 400000000;

// Accumulator i's start, in [1, 2): the kernel's text gives it as a hexadecimal literal, so the
// kernel and the host start from the same float.
float start_value(int i, int accs) {
  return 1.0f + float(i) / float(accs);
}

// The kernel source for `width`-float vectors and `accs` accumulators, unrolled in the text so the
// accumulators are separate registers whatever the compiler's unrolling does. Accumulator i of
// work-item gid ends at out[gid * accs + i] (a vector of `width` floats).
std::string peak_source(int width, int accs) {
  const std::string vt = width == 1 ? "float" : fmt::format("float{}", width);
  std::ostringstream s;
  s << "kernel void fma_peak(global float* out, float grow, float add, uint iters) {\n"
    << "  const size_t gid = get_global_id(0);\n"
    << "  const " << vt << " g = (" << vt << ")(grow), c = (" << vt << ")(add);\n";
  for (int i = 0; i < accs; ++i)
    s << "  " << vt << " a" << i << " = (" << vt << ")(" << fmt::format("{:a}", start_value(i, accs)) << "f);\n";
  s << "  for (uint it = 0; it < iters; ++it) {\n";
  for (int i = 0; i < accs; ++i) s << "    a" << i << " = fma(a" << i << ", g, c);\n";
  s << "  }\n";
  for (int i = 0; i < accs; ++i) {
    if (width == 1) {
      s << "  out[gid * " << accs << " + " << i << "] = a" << i << ";\n";
    } else {
      s << "  vstore" << width << "(a" << i << ", gid * " << accs << " + " << i << ", out);\n";
    }
  }
  s << "}\n";
  return s.str();
}

// What the host computes for accumulator i of any lane: the same fmaf chain from the same start.
float expected_value(int i, int accs, std::uint32_t iters) {
  float a = start_value(i, accs);
  for (std::uint32_t it = 0; it < iters; ++it) a = std::fmaf(a, kGrow, kAdd);
  return a;
}

struct Measured {
  int width = 0, accs = 0;
  std::uint32_t iters = 0;
  double gflops = 0;
  std::vector<double> runs_gflops;
};

Measured measure(Runtime& runtime, int width, int accs, std::size_t groups, std::size_t local,
                 const PeakBenchOptions& o, int repeat) {
  const cl::Context& ctx = runtime.context();
  const cl_command_queue q = ctx.compute();
  cl_program program =
      runtime.env().kernels.program_from_source(fmt::format("fma_peak_w{}_a{}", width, accs), peak_source(width, accs));
  cl_int status = CL_SUCCESS;
  cl::Kernel kernel(clCreateKernel(program, "fma_peak", &status));
  cl::check(status, "clCreateKernel(fma_peak)");
  const std::size_t global = groups * local;
  const std::size_t values = global * std::size_t(accs) * std::size_t(width);
  cl::Mem out = ctx.create_buffer(values * sizeof(float), "peak bench output");

  auto launch = [&](std::uint32_t iters) {
    cl::set_args(kernel.get(), out, kGrow, kAdd, cl_uint(iters));
    FERRY_CL(clEnqueueNDRangeKernel(q, kernel.get(), 1, nullptr, &global, &local, 0, nullptr, nullptr));
    FERRY_CL(clFinish(q));
  };
  // Size the iterations after one untimed launch (PoCL builds the work-group function on the first):
  // launches growing 4x until one takes a quarter of run_ms, then scaled to about run_ms.
  std::uint32_t iters = 1024;
  launch(iters);
  for (;;) {
    const double ms = time_ms([&] { launch(iters); });
    if (ms >= o.run_ms / 4 || iters > kMaxIters / 4) {
      iters = static_cast<std::uint32_t>(
          std::clamp(double(iters) * o.run_ms / std::max(ms, 1e-3), 1024.0, double(kMaxIters)));
      break;
    }
    iters *= 4;
  }
  Measured m{width, accs, iters, 0, {}};
  const double flops = 2.0 * double(global) * width * accs * iters;
  for (int r = 0; r < repeat; ++r) m.runs_gflops.push_back(flops / (time_ms([&] { launch(iters); }) * 1e6));
  m.gflops = median(m.runs_gflops);

  std::vector<float> got(values);
  ctx.read(out.get(), 0, got.data(), got.size() * sizeof(float));
  std::vector<float> want(accs);
  for (int i = 0; i < accs; ++i) want[i] = expected_value(i, accs, iters);
  for (std::size_t v = 0; v < got.size(); ++v) {
    const int i = static_cast<int>(v / width % accs);
    if (std::memcmp(&got[v], &want[i], sizeof(float)) != 0) {
      throw std::runtime_error(fmt::format(
          "peak: the fma kernel (width {}, {} accumulators, {} iterations) left {} in accumulator {} of work-item {} "
          "(lane {}), the host's fmaf chain {}: the device did not run the loop as written, so its time is no "
          "measure of the peak",
          width, accs, iters, got[v], i, v / width / accs, v % width, want[i]));
    }
  }
  return m;
}

// A value given twice would build and time the same candidates again: refused.
void refuse_repeats(const char* flag, const std::vector<int>& values, const char* what) {
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (std::find(values.begin(), values.begin() + i, values[i]) != values.begin() + i) {
      throw std::invalid_argument(fmt::format("{}: {} is given twice: give each {} once", flag, values[i], what));
    }
  }
}

int run_peak(const BenchCommon& common, const PeakBenchOptions& o) {
  refuse_repeats("--widths", o.widths, "width");
  refuse_repeats("--accumulators", o.accumulators, "accumulator count");
  Runtime runtime({.device = common.device});
  const cl::DeviceInfo& dev = runtime.device();
  const std::size_t units = std::max<std::uint32_t>(dev.compute_units, 1);
  const std::size_t local =
      dev.is_cpu() ? 1 : std::min<std::size_t>(256, std::max<std::size_t>(dev.max_work_group_size, 1));
  const std::size_t groups = 8 * units;

  std::vector<Measured> all;
  for (int w : o.widths) {
    for (int a : o.accumulators) {
      all.push_back(measure(runtime, w, a, groups, local, o, common.repeat));
      std::fprintf(stderr, "peak: width %2d, %2d accumulators: %8.1f GFLOPS\n", w, a, all.back().gflops);
    }
  }
  const Measured& best = *std::max_element(all.begin(), all.end(),
                                           [](const Measured& x, const Measured& y) { return x.gflops < y.gflops; });
  nlohmann::json candidates = nlohmann::json::array();
  for (const Measured& m : all) {
    candidates.push_back(
        {{"vector_width", m.width}, {"accumulators", m.accs}, {"gflops", m.gflops}, {"runs_gflops", m.runs_gflops}});
  }
  emit_json({{"bench", "peak"},
             {"device", dev.name},
             {"compute_units", units},
             {"work_groups", groups},
             {"local_size", local},
             {"repeat", common.repeat},
             {"peak_gflops", best.gflops},
             {"vector_width", best.width},
             {"accumulators", best.accs},
             {"iters", best.iters},
             {"candidates", candidates}});
  return 0;
}

BenchRun setup(CLI::App& sub, const BenchCommon& common) {
  auto o = std::make_shared<PeakBenchOptions>();
  sub.add_option("--widths", o->widths, "vector widths to try (1, 2, 4, 8, 16), each once")
      ->capture_default_str()
      ->delimiter(',')
      ->check(ferry::cli::whole_number())
      ->check(CLI::IsMember({1, 2, 4, 8, 16}));
  sub.add_option("--accumulators", o->accumulators,
                 "accumulators per work-item to try (1 to 32, each once; each an independent fma chain, one fma per "
                 "iteration)")
      ->capture_default_str()
      ->delimiter(',')
      ->check(ferry::cli::whole_number())
      ->check(CLI::Range(1, 32));
  // positive_number first: CLI::Range lets NaN through (every comparison with it is false).
  sub.add_option("--run-ms", o->run_ms, "milliseconds each timed launch runs (iterations sized to it)")
      ->capture_default_str()
      ->check(ferry::cli::positive_number())
      ->check(CLI::Range(1.0, 10000.0));
  return [o, &common] { return run_peak(common, *o); };
}

FERRY_BENCH("peak",
            "the device's fp32 multiply-add peak (GFLOPS): independent fma chains per work-item, the best of several "
            "vector widths and chain counts",
            setup);

}  // namespace
}  // namespace ferry::bench
