// ferry-bench peak: the device's fp32 multiply-add peak, the ceiling every GEMM and training-step
// figure is read against.
//
// A kernel of fma() chains: each work-item keeps `accumulators` vectors of `vector_width` floats,
// in pairs (x, y), and updates each `iters` times, both from the pair's values of the iteration
// before: x = fma(y, m, x), y = fma(x, -m, y), a rotation by about m radians per iteration (its
// radius grows by sqrt(1 + m²) each time). The accumulators' fma()s of one iteration are
// independent of each other, one per accumulator as in a chain acc = fma(acc, b, c); enough of
// them hide the FMA latency, so the time is the FMA units' throughput and nothing else: no
// memory traffic beyond one store per lane at the end. Every (width, accumulators) pair of the
// candidate lists is built and timed; the best is the peak. CPU devices run one work-item per
// work-group (as ferry's CPU kernels do, vectorised by its explicit vector types); other devices
// run work-groups as wide as the device allows. Eight work-groups per compute unit keep every
// core or multiprocessor busy.
//
// The result is checked: lane values are compared with the same chain of fmaf() on the host (one
// correctly rounded fma per step on both sides), so a compiler that dropped or shortened the loop
// fails the run instead of reporting an impossible peak. The rotation never settles: one
// iteration more or less turns the pairs by 2^-12 radians, and over the most iterations a launch
// runs (2e9) the radius grows by e^60 at most, far from overflow. (A contracting chain such as
// acc = fma(acc, 0.9999, 1e-4) reaches its fp32 fixed point within ~80k iterations, after which
// any count gives the same values and the check sees nothing.)
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <sstream>

#include "bench.hpp"
#include "ferry/cl/error.hpp"
#include "ferry/runtime/runtime.hpp"

namespace ferry::bench {
namespace {

struct PeakBenchOptions {
  std::vector<int> widths{1, 4, 8, 16};
  std::vector<int> accumulators{4, 8, 12, 16};
  double run_ms = 100;  // each timed launch runs about this long (the iterations are sized to it)
};

constexpr float kTurn = 1.0f / 4096;  // the pairs' rotation per iteration, radians (about)
constexpr std::uint32_t kMaxIters = 2000000000;

// The kernel source for `width`-float vectors and `accs` accumulators, unrolled in the text so the
// accumulators are separate registers whatever the compiler's unrolling does.
std::string peak_source(int width, int accs) {
  const std::string vt = width == 1 ? "float" : fmt::format("float{}", width);
  std::ostringstream s;
  s << "kernel void fma_peak(global float* out, float turn, uint iters) {\n"
    << "  const size_t gid = get_global_id(0);\n"
    << "  const " << vt << " m = (" << vt << ")(turn), n = -m;\n";
  for (int i = 0; i < accs; ++i)
    s << "  " << vt << " a" << i << " = (" << vt << ")(" << i << ".0f / " << accs << ");\n";
  s << "  for (uint it = 0; it < iters; ++it) {\n";
  for (int i = 0; i < accs; i += 2) {
    s << "    const " << vt << " x" << i << " = a" << i << ";\n"
      << "    a" << i << " = fma(a" << i + 1 << ", m, a" << i << ");\n"
      << "    a" << i + 1 << " = fma(x" << i << ", n, a" << i + 1 << ");\n";
  }
  s << "  }\n  " << vt << " sum = a0";
  for (int i = 1; i < accs; ++i) s << " + a" << i;
  s << ";\n";
  if (width == 1) {
    s << "  out[gid] = sum;\n";
  } else {
    s << "  vstore" << width << "(sum, gid, out);\n";
  }
  s << "}\n";
  return s.str();
}

// What the host computes for any lane: the sum over accumulators of the pairs' fma chains, each
// started from i / accs, and the sum of their magnitudes (the scale of the comparison's rounding).
std::pair<float, float> expected_lane(int accs, std::uint32_t iters) {
  float sum = 0, scale = 0;
  for (int i = 0; i < accs; i += 2) {
    float x = float(i) / float(accs), y = float(i + 1) / float(accs);
    for (std::uint32_t it = 0; it < iters; ++it) {
      const float x0 = x;
      x = std::fmaf(y, kTurn, x);
      y = std::fmaf(x0, -kTurn, y);
    }
    sum = i == 0 ? x + y : sum + x + y;
    scale += std::fabs(x) + std::fabs(y);
  }
  return {sum, scale};
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
  cl::Mem out = ctx.create_buffer(global * std::size_t(width) * sizeof(float), "peak bench output");

  auto launch = [&](std::uint32_t iters) {
    cl::set_args(kernel.get(), out, kTurn, cl_uint(iters));
    FERRY_CL(clEnqueueNDRangeKernel(q, kernel.get(), 1, nullptr, &global, &local, 0, nullptr, nullptr));
    FERRY_CL(clFinish(q));
  };
  // Size the iterations after one untimed launch (PoCL builds the work-group function on the first):
  // launches growing 4x until one takes a quarter of run_ms, then scaled to about run_ms.
  std::uint32_t iters = 1024;
  launch(iters);
  for (;;) {
    const double ms = time_ms([&] { launch(iters); });
    if (ms >= o.run_ms / 4 || iters >= (1u << 30)) {
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

  std::vector<float> got(global * std::size_t(width));
  ctx.read(out.get(), 0, got.data(), got.size() * sizeof(float));
  const auto [want, scale] = expected_lane(accs, iters);
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!(std::fabs(got[i] - want) <= 1e-5f * scale)) {
      throw std::runtime_error(fmt::format(
          "peak: the fma kernel (width {}, {} accumulators, {} iterations) computed {} in lane {}, the host {}: the "
          "device did not run the loop as written, so its time is no measure of the peak",
          width, accs, iters, got[i], i, want));
    }
  }
  return m;
}

int run_peak(const BenchCommon& common, const PeakBenchOptions& o) {
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
  sub.add_option("--widths", o->widths, "vector widths to try (1, 2, 4, 8, 16)")
      ->capture_default_str()
      ->check(CLI::IsMember({1, 2, 4, 8, 16}));
  sub.add_option("--accumulators", o->accumulators,
                 "accumulators per work-item to try (even: they turn in pairs; one independent fma each per iteration)")
      ->capture_default_str()
      ->check(CLI::Range(2, 32))
      ->check(CLI::Validator(
          [](const std::string& v) { return std::stoi(v) % 2 == 0 ? std::string() : std::string("must be even"); },
          "EVEN", "even"));
  sub.add_option("--run-ms", o->run_ms, "milliseconds each timed launch runs (iterations sized to it)")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 10000.0));
  return [o, &common] { return run_peak(common, *o); };
}

FERRY_BENCH("peak",
            "the device's fp32 multiply-add peak (GFLOPS): independent fma chains per work-item, the best of several "
            "vector widths and chain counts",
            setup);

}  // namespace
}  // namespace ferry::bench
