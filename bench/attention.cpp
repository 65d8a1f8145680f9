// ferry-bench attention: what does fusing causal attention buy, per context length?
//
// Forward + backward of multi-head causal attention at each --contexts length, on one device:
//   fused:    the attention op (ops::attention_forward / _backward: online softmax, no [T, T]
//             tensors);
//   unfused:  the ops the unfused GPT runs, on heads already split as [B, H, T, D] (its permutes
//             left out, in its favour): scores = scale q kᵀ (batched matmul), causal softmax in
//             place, o = p v; backward dp = do vᵀ, dv = pᵀ do, softmax backward in place,
//             dq = scale ds k, dk = scale dsᵀ q. Two [T, T] tensors per head, the fewest it needs.
// Each is timed as time_rounds does (median of --repeat rounds after a warm-up). Device bytes are
// the buffers each path allocates: inputs, outputs, gradients, [T, T] tensors and scratch.
// --peer runs PyTorch's scaled_dot_product_attention (is_causal) forward + backward on the same
// shapes (bench/peers/torch_attention.py) in the same run and reports its time beside ferry's.
#include "ops/attention.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <memory>

#include "bench.hpp"
#include "ferry/cl/error.hpp"
#include "ferry/runtime/runtime.hpp"
#include "ops/matmul.hpp"
#include "ops/softmax.hpp"
#include "peer.hpp"
#include "runtime/cli/validators.hpp"

namespace ferry::bench {
namespace {

struct AttentionBenchOptions {
  std::vector<std::size_t> contexts{256, 512, 1024, 2048, 4096};
  std::size_t batch = 1, heads = 12, head_dim = 64;
  std::string kernel;  // ops::AttentionOptions::kernel
  bool unfused = true;
  bool peer = false;
  std::string python = "python3", peer_script, peer_device = "cpu";
};

// Device buffers of one benchmark case, counted as they are allocated.
class Buffers {
 public:
  explicit Buffers(const cl::Context& ctx) : ctx_(ctx) {}
  ops::DeviceSpan make(std::size_t floats, const char* what) {
    const std::size_t bytes = std::max<std::size_t>(floats, 1) * sizeof(float);
    mems_.push_back(ctx_.create_buffer(bytes, what));
    std::vector<float> init(std::max<std::size_t>(floats, 1));
    for (std::size_t i = 0; i < init.size(); ++i)
      init[i] = static_cast<float>((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
    ctx_.write(mems_.back().get(), 0, init.data(), bytes);
    bytes_ += bytes;
    return {mems_.back().get(), 0};
  }
  std::uint64_t bytes() const { return bytes_; }

 private:
  const cl::Context& ctx_;
  std::vector<cl::Mem> mems_;
  std::uint64_t bytes_ = 0;
};

double time_lists(cl_command_queue q, const std::vector<const ops::LaunchList*>& lists, int repeat) {
  const auto times = time_rounds(
      [&] {
        for (const auto* l : lists) ops::enqueue(q, *l, {});
      },
      [&] { FERRY_CL(clFinish(q)); }, repeat, 300.0, 20.0);
  return median(times);
}

// Each launch of the lists timed alone, as [kernel name, ms] pairs: where the fused op's time goes.
nlohmann::json per_kernel_ms(cl_command_queue q, std::vector<ops::LaunchList*> lists, int repeat) {
  nlohmann::json out = nlohmann::json::array();
  for (ops::LaunchList* list : lists) {
    for (ops::KernelLaunch& launch : *list) {
      char name[128] = {};
      FERRY_CL(clGetKernelInfo(launch.kernel.get(), CL_KERNEL_FUNCTION_NAME, sizeof(name) - 1, name, nullptr));
      ops::LaunchList one;
      one.push_back(std::move(launch));
      out.push_back({name, time_lists(q, {&one}, repeat)});
      launch = std::move(one.front());
    }
  }
  return out;
}

// Forward + backward flops of causal attention counted as FlashAttention's benchmarks do:
// 4 B H T^2 D forward, 2.5 times that backward, halved for causal.
double attention_useful_flops(std::size_t bh, std::size_t t, std::size_t head_dim) {
  return 4.0 * static_cast<double>(bh) * static_cast<double>(t) * static_cast<double>(t) *
         static_cast<double>(head_dim) * 3.5 / 2.0;
}

// Refuses a context whose buffers the device cannot hold, before anything is allocated (a context
// of a million would otherwise allocate until the host runs out of memory). The inputs, outputs
// and their gradients: nine tensors of B x T x H x D floats for the fused op, eight and two
// B x H x T x T score tensors for the unfused ops; scratch is left out.
void check_fits_device(const cl::DeviceInfo& device, const AttentionBenchOptions& o, std::size_t t) {
  const double n = static_cast<double>(o.batch) * t * o.heads * o.head_dim, bh = static_cast<double>(o.batch) * o.heads;
  const double fused = 4 * 9 * n, scores = 4 * bh * t * t, unfused = 4 * 8 * n + 2 * scores;
  const double largest = o.unfused ? std::max(4 * n, scores) : 4 * n,
               total = o.unfused ? std::max(fused, unfused) : fused;
  if (total <= static_cast<double>(device.global_mem_bytes) && largest <= static_cast<double>(device.max_alloc_bytes)) {
    return;
  }
  throw std::invalid_argument(fmt::format(
      "context {}: the fused op needs {:.1f} GiB of device memory{}, more than {} has ({:.1f} GiB, buffers of at most "
      "{:.1f} GiB): give shorter --contexts, fewer --heads or a smaller --batch{}",
      t, fused / (1u << 30),
      o.unfused ? fmt::format(" and the unfused ops {:.1f} GiB (scores of {:.1f} GiB)", unfused / (1u << 30),
                              scores / (1u << 30))
                : std::string(),
      device.name, static_cast<double>(device.global_mem_bytes) / (1u << 30),
      static_cast<double>(device.max_alloc_bytes) / (1u << 30), o.unfused ? ", or --no-unfused" : ""));
}

int run_attention(const BenchCommon& common, const AttentionBenchOptions& o) {
  Runtime runtime({.device = common.device});
  const cl::Context& ctx = runtime.context();
  ops::OpEnv& env = runtime.env();
  const cl_command_queue q = ctx.compute();
  for (const std::size_t t : o.contexts) check_fits_device(runtime.device(), o, t);
  for (const std::size_t t : o.contexts) {
    const ops::AttentionShape s{o.batch, t, o.heads, o.head_dim};
    const float scale = 1.0f / std::sqrt(static_cast<float>(o.head_dim));
    const std::size_t n = o.batch * t * o.heads * o.head_dim, bh = o.batch * o.heads;
    nlohmann::json j{{"bench", "attention"},
                     {"device", runtime.device().name},
                     {"context", t},
                     {"batch", o.batch},
                     {"heads", o.heads},
                     {"head_dim", o.head_dim},
                     {"repeat", common.repeat},
                     {"dtype", "f32"}};
    std::fprintf(stderr, "ferry-bench attention: context %zu\n", t);
    double fused_ms = 0;
    {
      const ops::AttentionOptions opt{o.kernel};
      Buffers b(ctx);
      const auto qq = b.make(n, "q"), kk = b.make(n, "k"), vv = b.make(n, "v"), out = b.make(n, "o"),
                 lse = b.make(s.rows(), "lse"), dout = b.make(n, "do"), dq = b.make(n, "dq"), dk = b.make(n, "dk"),
                 dv = b.make(n, "dv");
      const auto scratch = b.make(std::max(ops::attention_forward_scratch_elems(env, s, opt),
                                           ops::attention_backward_scratch_elems(env, s, opt)),
                                  "attention scratch");
      ops::LaunchList fwd =
          ops::attention_forward(env, s, ops::DType::f32, scale, {}, qq, kk, vv, out, lse, scratch, opt);
      ops::LaunchList bwd = ops::attention_backward(env, s, ops::DType::f32, scale, {}, qq, kk, vv, out, lse, dout, dq,
                                                    dk, dv, scratch, opt);
      fused_ms = time_lists(q, {&fwd, &bwd}, common.repeat);
      j["fused_ms"] = fused_ms;
      j["fused_forward_ms"] = time_lists(q, {&fwd}, common.repeat);
      j["fused_device_bytes"] = b.bytes();
      j["fused_kernels_ms"] = per_kernel_ms(q, {&fwd, &bwd}, common.repeat);
      j["fused_kernel"] = ops::attention_kernel_description(env, s, opt);
      // Useful work as FlashAttention counts it, whichever kernel runs (the two-pass backward does 7
      // products, the one-pass 5): 2 products of T x T x D forward, 5 backward, 2 flops per
      // multiply-add, halved for the causal mask: 7 B H T^2 D flops.
      j["fused_gflops"] = attention_useful_flops(bh, t, o.head_dim) / (fused_ms * 1e6);
    }
    if (o.unfused) {
      Buffers b(ctx);
      const auto qq = b.make(n, "q"), kk = b.make(n, "k"), vv = b.make(n, "v"), out = b.make(n, "o"),
                 dout = b.make(n, "do"), dq = b.make(n, "dq"), dk = b.make(n, "dk"), dv = b.make(n, "dv");
      const auto p = b.make(bh * t * t, "probabilities"), dp = b.make(bh * t * t, "probability gradients");
      const ops::GemmShape scores{.M = t, .N = t, .K = o.head_dim, .trans_b = true, .batch = bh},
          values{.M = t, .N = o.head_dim, .K = t, .batch = bh};
      const std::size_t scratch_elems =
          std::max({ops::gemm_scratch_elems(env, scores), ops::gemm_scratch_elems(env, values),
                    ops::matmul_grad_a_scratch_elems(env, values), ops::matmul_grad_b_scratch_elems(env, values),
                    ops::matmul_grad_a_scratch_elems(env, scores), ops::matmul_grad_b_scratch_elems(env, scores)});
      const auto scratch = b.make(scratch_elems, "matmul scratch");
      ops::LaunchList fwd = ops::gemm(env, scores, scale, qq, kk, 0.0f, p, scratch);
      for (auto& l : ops::softmax_forward(env, p, p, bh * t, t, true)) fwd.push_back(std::move(l));
      for (auto& l : ops::gemm(env, values, 1.0f, p, vv, 0.0f, out, scratch)) fwd.push_back(std::move(l));
      ops::LaunchList bwd = ops::matmul_grad_a(env, values, 1.0f, dout, vv, dp, scratch);
      for (auto& l : ops::matmul_grad_b(env, values, 1.0f, p, dout, dv, scratch)) bwd.push_back(std::move(l));
      for (auto& l : ops::softmax_backward(env, p, dp, dp, bh * t, t)) bwd.push_back(std::move(l));
      for (auto& l : ops::matmul_grad_a(env, scores, scale, dp, kk, dq, scratch)) bwd.push_back(std::move(l));
      for (auto& l : ops::matmul_grad_b(env, scores, scale, qq, dp, dk, scratch)) bwd.push_back(std::move(l));
      const double unfused_ms = time_lists(q, {&fwd, &bwd}, common.repeat);
      j["unfused_ms"] = unfused_ms;
      j["unfused_device_bytes"] = b.bytes();
      j["speedup_vs_unfused"] = unfused_ms / fused_ms;
    }
    if (o.peer) {
      const std::string python = find_on_path(o.python);
      if (python.empty()) {
        j["peer_error"] = interpreter_not_found(o.python);
      } else {
        const std::string cmd = fmt::format(
            "{} {} --batch {} --heads {} --context {} --head-dim {} --repeat {} --device {}", shell_quote(python),
            shell_quote(o.peer_script), o.batch, o.heads, t, o.head_dim, common.repeat, shell_quote(o.peer_device));
        const nlohmann::json r = run_json_command(cmd).back();
        if (r.contains("error")) {
          j["peer_error"] = r["error"];
        } else {
          j["peer"] = r.value("impl", "torch-sdpa");
          j["peer_device"] = r.value("device", o.peer_device);
          j["peer_torch_version"] = r.value("torch_version", "");
          j["peer_threads"] = r.value("threads", 0);
          j["peer_ms"] = r["ms"];
          j["speedup_vs_peer"] = r["ms"].get<double>() / fused_ms;
        }
      }
    }
    emit_json(j);
  }
  return 0;
}

BenchRun setup(CLI::App& sub, const BenchCommon& common) {
  auto o = std::make_shared<AttentionBenchOptions>();
  o->peer_script = peer_script_path("torch_attention.py");
  sub.add_option("--contexts", o->contexts, "context lengths, one JSON line each")
      ->delimiter(',')
      ->capture_default_str()
      ->check(ferry::cli::positive_number());
  sub.add_option("--batch", o->batch, "sequences")->capture_default_str()->check(ferry::cli::positive_number());
  sub.add_option("--heads", o->heads, "attention heads")->capture_default_str()->check(ferry::cli::positive_number());
  sub.add_option("--head-dim", o->head_dim, "features per head")
      ->capture_default_str()
      ->check(ferry::cli::whole_number())
      ->check(CLI::Range(std::size_t{1}, ops::attention_max_head_dim));
  sub.add_option("--kernel", o->kernel,
                 "fused kernel instead of the device's default: \"cpu RB=n QB=n KB=n PASS=0|1|2 LT=n\", \"tiled BQ=n "
                 "BK=n\", \"blocked TQ=n TK=n [RR=n]\" or \"gemm [MIB=n]\" (ops/attention.hpp)");
  sub.add_flag("!--no-unfused", o->unfused, "skip the unfused ops");
  CLI::Option* peer = sub.add_flag("--peer", o->peer,
                                   "also time PyTorch's scaled_dot_product_attention (is_causal) forward + backward");
  sub.add_option("--python", o->python, "Python interpreter with torch for --peer")->capture_default_str()->needs(peer);
  sub.add_option("--peer-script", o->peer_script, "the PyTorch peer script")->capture_default_str()->needs(peer);
  add_peer_device_option(sub, o->peer_device)->needs(peer);
  return [o, &common] { return run_attention(common, *o); };
}

FERRY_BENCH("attention",
            "causal attention forward + backward per context: the fused op vs the unfused ops (and PyTorch's SDPA "
            "with --peer): ms and device bytes",
            setup);

}  // namespace
}  // namespace ferry::bench
