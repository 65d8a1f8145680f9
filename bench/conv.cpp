// ferry-bench conv: how close do the CNN's convolutions run to the GEMM's peak on this device?
// Each convolution of models::cnn() (conv5x5 1->32 on 28x28, conv5x5 32->64 on 14x14, batch 128
// by default) timed alone, forward, data gradient and weight gradient (with the bias gradient),
// im2col, packing and epilogues included; GFLOPS = 2 N K C R S P Q / time, beside ferry's GEMM on
// a square n = 1024 product measured in the same run (the yardstick: what the device's register-
// blocked GEMM reaches). The first layer's data gradient is measured too though a model never
// needs it (its input is the data). Medians of --repeat runs after a warm-up.
#include <fmt/format.h>

#include <algorithm>
#include <random>

#include "bench.hpp"
#include "ferry/cl/context.hpp"
#include "ferry/cl/error.hpp"
#include "ferry/cl/program.hpp"
#include "ops/conv2d.hpp"
#include "ops/gemm.hpp"
#include "runtime/cli/validators.hpp"

namespace ferry::bench {
namespace {

struct ConvBenchOptions {
  std::size_t batch = 128;
  std::size_t gemm_n = 1024;
  bool breakdown = false;  // also time every launch of a pass alone
};

std::string kernel_name(const ops::KernelLaunch& l) {
  if (l.custom) return "library call";
  std::size_t size = 0;
  FERRY_CL(clGetKernelInfo(l.kernel.get(), CL_KERNEL_FUNCTION_NAME, 0, nullptr, &size));
  std::string name(size, '\0');
  FERRY_CL(clGetKernelInfo(l.kernel.get(), CL_KERNEL_FUNCTION_NAME, size, name.data(), nullptr));
  while (!name.empty() && name.back() == '\0') name.pop_back();
  return name;
}

cl::Mem random_buffer(const cl::Context& ctx, std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(std::max<std::size_t>(n, 1));
  for (float& x : v) x = dist(rng);
  cl::Mem m = ctx.create_buffer(v.size() * sizeof(float), "conv bench operand");
  ctx.write(m.get(), 0, v.data(), v.size() * sizeof(float));
  return m;
}

// Median milliseconds per run of the launches over `repeat` rounds (time_rounds).
double time_launches(const cl::Context& ctx, const ops::LaunchList& launches, int repeat) {
  return median(time_rounds([&] { ops::enqueue(ctx.compute(), launches, {}); },
                            [&] { cl::check(clFinish(ctx.compute()), "clFinish"); }, repeat));
}

int run(const BenchCommon& common, const ConvBenchOptions& o) {
  const cl::DeviceInfo device = cl::select_device(common.device);
  cl::Context ctx(device);
  cl::KernelLibrary lib(ctx);
  ops::OpEnv env{lib};

  // The yardstick: ferry's GEMM on a square product.
  const ops::GemmShape g{o.gemm_n, o.gemm_n, o.gemm_n};
  cl::Mem ga = random_buffer(ctx, g.M * g.K, 1), gb = random_buffer(ctx, g.K * g.N, 2),
          gc = ctx.create_buffer(g.M * g.N * sizeof(float), "conv bench gemm C");
  const std::size_t gs_elems = ops::gemm_scratch_elems(env, g);
  cl::Mem gs = ctx.create_buffer(std::max<std::size_t>(gs_elems, 1) * sizeof(float), "conv bench gemm scratch");
  const double gemm_ms = time_launches(
      ctx, ops::gemm(env, g, 1.0f, {ga.get(), 0}, {gb.get(), 0}, 0.0f, {gc.get(), 0}, {gs.get(), 0}), common.repeat);
  const double peak = 2.0 * double(g.M) * g.N * g.K / (gemm_ms * 1e6);
  emit_json({{"bench", "conv"},
             {"what", "gemm_peak"},
             {"device", device.name},
             {"shape", fmt::format("{}x{}x{}", g.M, g.N, g.K)},
             {"kernel", ops::gemm_kernel_description(env, g)},
             {"ms", gemm_ms},
             {"gflops", peak}});

  struct Layer {
    const char* name;
    ops::Conv2dShape s;
  };
  std::vector<Layer> layers(2);
  layers[0].name = "conv1_5x5_1to32_28x28";
  layers[0].s = {o.batch, 1, 28, 28, 32, 5, 5, 1, 2};
  layers[1].name = "conv2_5x5_32to64_14x14";
  layers[1].s = {o.batch, 32, 14, 14, 64, 5, 5, 1, 2};
  for (const Layer& layer : layers) {
    const ops::Conv2dShape& s = layer.s;
    const std::size_t xe = s.N * s.C * s.H * s.W, we = s.K * s.C * s.R * s.S, ye = s.N * s.K * s.P() * s.Q();
    cl::Mem x = random_buffer(ctx, xe, 3), w = random_buffer(ctx, we, 4), b = random_buffer(ctx, s.K, 5),
            dy = random_buffer(ctx, ye, 6);
    cl::Mem y = ctx.create_buffer(ye * sizeof(float), "y"), dx = ctx.create_buffer(xe * sizeof(float), "dx"),
            dw = ctx.create_buffer(we * sizeof(float), "dw"), db = ctx.create_buffer(s.K * sizeof(float), "db"),
            scratch = ctx.create_buffer(ops::conv2d_scratch_elems(env, s) * sizeof(float), "scratch");
    const ops::DeviceSpan sc{scratch.get(), 0};
    const double flop = 2.0 * double(s.N) * s.K * s.C * s.R * s.S * s.P() * s.Q();
    const ops::Conv2dAlgorithms algorithms = ops::conv2d_algorithms(env, s);
    struct Pass {
      const char* name;
      const std::string& algorithm;
      ops::LaunchList launches;
    };
    const Pass passes[] = {
        {"forward", algorithms.forward,
         ops::conv2d_forward(env, s, {x.get(), 0}, {w.get(), 0}, {b.get(), 0}, {y.get(), 0}, sc)},
        {"data_grad", algorithms.data_grad,
         ops::conv2d_backward_data(env, s, {dy.get(), 0}, {w.get(), 0}, {dx.get(), 0}, sc)},
        {"weight_grad", algorithms.weight_grad,
         ops::conv2d_backward_weights(env, s, {x.get(), 0}, {dy.get(), 0}, {dw.get(), 0}, {db.get(), 0}, sc)},
    };
    for (const auto& [pass, algorithm, launches] : passes) {
      const double ms = time_launches(ctx, launches, common.repeat);
      const double gf = flop / (ms * 1e6);
      emit_json({{"bench", "conv"},
                 {"what", pass},
                 {"layer", layer.name},
                 {"algorithm", algorithm},
                 {"batch", s.N},
                 {"launches", launches.size()},
                 {"ms", ms},
                 {"gflops", gf},
                 {"gemm_peak_gflops", peak},
                 {"fraction_of_peak", gf / peak}});
      if (!o.breakdown) continue;
      // Each launch alone (the pass ran whole above, so its inputs are in place), summed by kernel.
      std::vector<std::pair<std::string, double>> by_kernel;
      for (const ops::KernelLaunch& l : launches) {
        ops::LaunchList one;
        one.push_back(l);
        const double t = time_launches(ctx, one, common.repeat);
        const std::string name = kernel_name(l);
        auto it = std::find_if(by_kernel.begin(), by_kernel.end(), [&](const auto& e) { return e.first == name; });
        if (it == by_kernel.end()) {
          by_kernel.emplace_back(name, t);
        } else {
          it->second += t;
        }
      }
      for (const auto& [name, t] : by_kernel) {
        emit_json({{"bench", "conv"},
                   {"what", "launch_breakdown"},
                   {"pass", pass},
                   {"layer", layer.name},
                   {"kernel", name},
                   {"ms", t},
                   {"share_of_pass", t / ms}});
      }
    }
  }
  return 0;
}

BenchRun setup(CLI::App& sub, const BenchCommon& common) {
  auto o = std::make_shared<ConvBenchOptions>();
  sub.add_option("--batch", o->batch, "images per convolution")
      ->capture_default_str()
      ->check(ferry::cli::positive_number());
  sub.add_option("--gemm-n", o->gemm_n, "size of the square GEMM measured as the peak")
      ->capture_default_str()
      ->check(ferry::cli::positive_number());
  sub.add_flag("--breakdown", o->breakdown,
               "also time each launch of a pass alone and print the milliseconds per kernel (what=launch_breakdown)");
  return [o, &common] { return run(common, *o); };
}

}  // namespace

FERRY_BENCH("conv", "the CNN's convolutions (forward, data and weight gradients) in GFLOPS beside the GEMM peak",
            setup);

}  // namespace ferry::bench
