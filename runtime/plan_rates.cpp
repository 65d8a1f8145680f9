// The rates a step-time prediction uses, measured on the runtime's device and on this machine's
// cores (ferry/runtime/plan.hpp): the link each way and both at once, a GEMM, the device's memory,
// a launch, 8-bit AdamW's updates on the device, the host optimizer and the codec. Each is the
// best of three timed runs after one that warms up (kernel builds, first touch).
#include <chrono>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "ferry/cl/error.hpp"
#include "ferry/offload/chunk_codec.hpp"
#include "ferry/offload/host_memory.hpp"
#include "ferry/ops/optimizer.hpp"
#include "ferry/runtime/plan.hpp"
#include "offload/both_ways.hpp"
#include "ops/elementwise.hpp"
#include "ops/gemm.hpp"
#include "ops/optimizer_host.hpp"

namespace ferry {

namespace {

// The shortest of three timed runs of `run`, after one that is not timed (it builds kernels and
// touches the memory), in seconds.
template <class Run>
double best_seconds(Run&& run) {
  run();
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < 3; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// `amount` (bytes or flops) per `seconds`, in G per second; 0 for a time too short to read.
double rate(double amount, double seconds) {
  return seconds > 0 ? amount / seconds * 1e-9 : 0.0;
}

// Values in [-0.5, 0.5) from a fixed generator, so every run of a measurement times the same data.
class SpreadValues {
 public:
  float next() {
    state_ = state_ * 1664525u + 1013904223u;
    return static_cast<float>(state_ >> 8) / 16777216.0f - 0.5f;
  }

 private:
  std::uint32_t state_ = 12345;
};

}  // namespace

LinkRates measure_link(Runtime& runtime, offload::HostMemory memory) {
  constexpr std::size_t bytes = 64ull << 20;
  const cl::Context& ctx = runtime.context();
  const offload::HostMemory source = offload::link_source_memory(offload::resolve_host_memory(memory, ctx.device()));
  const offload::HostBuffer up_host = offload::allocate_host(ctx, bytes, source, "the link measurement's host buffer");
  const offload::HostBuffer down_host =
      offload::allocate_host(ctx, bytes, source, "the link measurement's second host buffer");
  std::memset(up_host.data(), 1, bytes);  // the copy back's host pages are touched by its untimed first run
  const cl::Mem up_device = ctx.create_buffer(bytes, "the link measurement's device buffer");
  const cl::Mem down_device = ctx.create_buffer(bytes, "the link measurement's second device buffer");
  // Written once, so the copy back reads memory of its own: an untouched buffer of a CPU device reads
  // the kernel's one zero page, from the caches (21.9 GB/s back against 10.5-13.3 written).
  ctx.write(down_device.get(), 0, up_host.data(), bytes);
  const auto to_device = [&] {
    cl::check(clEnqueueWriteBuffer(ctx.queue(cl::QueueKind::h2d), up_device.get(), CL_TRUE, 0, bytes, up_host.data(), 0,
                                   nullptr, nullptr),
              "clEnqueueWriteBuffer (link measurement)");
  };
  const auto to_host = [&] {
    cl::check(clEnqueueReadBuffer(ctx.queue(cl::QueueKind::d2h), down_device.get(), CL_TRUE, 0, bytes, down_host.data(),
                                  0, nullptr, nullptr),
              "clEnqueueReadBuffer (link measurement)");
  };
  LinkRates r;
  r.h2d_gbps = rate(static_cast<double>(bytes), best_seconds(to_device));
  r.d2h_gbps = rate(static_cast<double>(bytes), best_seconds(to_host));
  // Both at once, each direction from a thread of its own.
  const double both_seconds = best_seconds([&] { offload::copy_both_ways(to_device, to_host); });
  // Never above the two alone: more would be the clock's noise.
  r.both_gbps = std::min(rate(2.0 * static_cast<double>(bytes), both_seconds), r.h2d_gbps + r.d2h_gbps);
  return r;
}

double measure_gemm_gflops(Runtime& runtime) {
  constexpr std::size_t n = 1024;
  const cl::Context& ctx = runtime.context();
  const ops::GemmShape shape{n, n, n};
  const std::vector<float> values(n * n, 0.5f);
  const cl::Mem a = ctx.create_buffer(n * n * sizeof(float), "the GEMM measurement's a");
  const cl::Mem b = ctx.create_buffer(n * n * sizeof(float), "the GEMM measurement's b");
  const cl::Mem c = ctx.create_buffer(n * n * sizeof(float), "the GEMM measurement's c");
  ctx.write(a.get(), 0, values.data(), values.size() * sizeof(float));
  ctx.write(b.get(), 0, values.data(), values.size() * sizeof(float));
  const std::size_t scratch_elems = ops::gemm_scratch_elems(runtime.env(), shape);
  cl::Mem scratch;
  if (scratch_elems) scratch = ctx.create_buffer(scratch_elems * sizeof(float), "the GEMM measurement's scratch");
  const ops::LaunchList launches =
      ops::gemm(runtime.env(), shape, 1.0f, {a.get(), 0}, {b.get(), 0}, 0.0f, {c.get(), 0}, {scratch.get(), 0});
  return rate(2.0 * n * n * n, best_seconds([&] { ops::run_blocking(ctx.compute(), launches); }));
}

double measure_device_gbps(Runtime& runtime) {
  constexpr std::size_t n = 16u << 20;  // 64 MiB an operand
  const cl::Context& ctx = runtime.context();
  const cl::Mem a = ctx.create_buffer(n * sizeof(float), "the memory measurement's a");
  const cl::Mem b = ctx.create_buffer(n * sizeof(float), "the memory measurement's b");
  const cl::Mem c = ctx.create_buffer(n * sizeof(float), "the memory measurement's c");
  const ops::LaunchList fill_a = ops::fill(runtime.env(), {a.get(), 0}, 1.0f, n);
  const ops::LaunchList fill_b = ops::fill(runtime.env(), {b.get(), 0}, 2.0f, n);
  ops::run_blocking(ctx.compute(), fill_a);
  ops::run_blocking(ctx.compute(), fill_b);
  const ops::LaunchList launches = ops::add(runtime.env(), {a.get(), 0}, {b.get(), 0}, {c.get(), 0}, n);
  return rate(3.0 * n * sizeof(float), best_seconds([&] { ops::run_blocking(ctx.compute(), launches); }));
}

double measure_launch_us(Runtime& runtime) {
  constexpr std::size_t n = 64, launches = 256;
  const cl::Context& ctx = runtime.context();
  const cl::Mem a = ctx.create_buffer(n * sizeof(float), "the launch measurement's a");
  const cl::Mem b = ctx.create_buffer(n * sizeof(float), "the launch measurement's b");
  const ops::LaunchList one = ops::add(runtime.env(), {a.get(), 0}, {a.get(), 0}, {b.get(), 0}, n);
  ops::LaunchList many;
  for (std::size_t i = 0; i < launches; ++i) many.insert(many.end(), one.begin(), one.end());
  return best_seconds([&] { ops::run_blocking(ctx.compute(), many); }) * 1e6 / static_cast<double>(many.size());
}

double measure_device_8bit_gbps(Runtime& runtime) {
  constexpr std::size_t n = 8u << 20;  // as measure_host_update_gbps
  constexpr std::uint32_t block = 2048;
  const std::size_t blocks = ops::adam8bit_blocks(n, block);
  const cl::Context& ctx = runtime.context();
  const cl::Mem w = ctx.create_buffer(n * sizeof(float), "the 8-bit update measurement's weights");
  const cl::Mem g = ctx.create_buffer(n * sizeof(float), "the 8-bit update measurement's gradients");
  const cl::Mem m = ctx.create_buffer(n, "the 8-bit update measurement's first moments");
  const cl::Mem v = ctx.create_buffer(n, "the 8-bit update measurement's second moments");
  const cl::Mem scales = ctx.create_buffer(2 * blocks * sizeof(float), "the 8-bit update measurement's scales");
  const std::vector<float> values(n, 0.25f);
  const std::vector<std::uint8_t> codes(n, 128);
  const std::vector<float> zero_scales(2 * blocks, 0.0f);
  ctx.write(w.get(), 0, values.data(), n * sizeof(float));
  ctx.write(g.get(), 0, values.data(), n * sizeof(float));
  ctx.write(m.get(), 0, codes.data(), n);
  ctx.write(v.get(), 0, codes.data(), n);
  ctx.write(scales.get(), 0, zero_scales.data(), zero_scales.size() * sizeof(float));
  const ops::LaunchList launches = ops::adam8bit_update(runtime.env(), ops::AdamConfig{}, block, {w.get(), 0},
                                                        {g.get(), 0}, {m.get(), 0}, {v.get(), 0}, {scales.get(), 0}, n);
  const double bytes = ops::adam8bit_update_bytes(n, block);
  return rate(bytes, best_seconds([&] { ops::run_blocking(ctx.compute(), launches); }));
}

double measure_host_update_gbps(bool eight_bit) {
  constexpr std::size_t n = 8u << 20;  // 32 MiB an fp32 operand: beyond the caches
  constexpr std::uint32_t block = 2048;
  std::vector<float> w(n), g(n), m(eight_bit ? 0 : n, 0.0f), v(eight_bit ? 0 : n, 0.0f);
  // Gradients spread over three decades, as a layer's are: 8-bit moments then spread over the code
  // tables as in training. With one value everywhere every lookup hit the same table line, and
  // the 8-bit rate read up to 1.5x high.
  SpreadValues spread;
  for (std::size_t i = 0; i < n; ++i) {
    const float u = spread.next();
    g[i] = u * std::exp2(-10.0f * static_cast<float>(i % 7) / 6.0f) * 2e-3f;
    w[i] = u * 0.1f;
  }
  std::vector<std::uint8_t> m8(eight_bit ? n : 0, 128), v8(eight_bit ? n : 0, 0);
  std::vector<float> scales(2 * ops::adam8bit_blocks(n, block), 0.0f);
  const double bytes = eight_bit ? ops::adam8bit_update_bytes(n, block) : ops::adam_update_bytes(n);
  ops::AdamConfig adam;  // Adam for fp32 moments; 8-bit state is always AdamW's
  adam.decoupled_weight_decay = eight_bit;
  adam.weight_decay = eight_bit ? 0.01f : 0.0f;
  std::uint64_t steps = 0;
  return rate(
      bytes, best_seconds([&] {
        const ops::StepInfo step{.step = ++steps, .lr = 1e-3f};
        if (eight_bit) {
          ops::host_adam8bit_update(
              adam, block, step, g.data(),
              {w.data(), m8.data(), v8.data(), scales.data(), w.data(), m8.data(), v8.data(), scales.data()}, n);
        } else {
          ops::host_adam_update(adam, step, g.data(), {w.data(), m.data(), v.data(), w.data(), m.data(), v.data()}, n);
        }
      }));
}

double measure_codec_gbps() {
  constexpr std::size_t n = 16u << 20;  // 64 MiB
  // Second moments of small gradients: squares of a spread of values around 1e-3 (a fixed
  // generator, so every run times the same bytes).
  std::vector<float> values(n);
  SpreadValues spread;
  for (float& v : values) {
    const float g = spread.next() * 2e-3f;
    v = g * g;
  }
  std::vector<float> back(n);
  const offload::ChunkCodec codec;
  const auto bytes = std::as_bytes(std::span(values));
  return rate(2.0 * static_cast<double>(bytes.size()), best_seconds([&] {
                const offload::CompressedTensor packed = codec.compress(bytes, sizeof(float), "the codec measurement");
                codec.decompress(packed, std::as_writable_bytes(std::span(back)), "the codec measurement");
              }));
}

}  // namespace ferry
