// Host optimizer updates: chunks on TBB workers, each a plain loop over arrays that the compiler
// vectorises once per instruction set (target_clones: AVX-512, AVX2 and the x86-64 baseline, the
// widest chosen at load time on the machine that runs it). This file is compiled with
// -ffp-contract=off and -fno-math-errno (CMakeLists.txt): no clone fuses a multiply into an add,
// so every clone rounds the same way and results do not depend on the machine, and sqrt needs no
// scalar errno path.
#include "ops/optimizer_host.hpp"

#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "ferry/ops/quant_map.hpp"
#include "ops/host_clones.hpp"
#include "ops/quant_buckets.hpp"
#include "ops/quantize_host.hpp"

// No dependence between iterations: the vectoriser needs no run-time check that in-place slots
// (the same memory read and written at the same index) do not overlap.
#if defined(__clang__)
#define FERRY_NO_LOOP_DEPENDENCE _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define FERRY_NO_LOOP_DEPENDENCE _Pragma("GCC ivdep")
#else
#define FERRY_NO_LOOP_DEPENDENCE
#endif

namespace ferry::ops {
namespace {
// Large enough to amortise scheduling, small enough to spread a 1M-element tensor over workers.
constexpr std::size_t chunk = 1 << 14;

// SGD's check of the weights it wrote: a second pass over the chunk just written (in cache). The
// largest magnitude's bits, an integer maximum that vectorises (+-inf and NaN are the patterns
// from 0x7f800000 up), as the Adam loops keep it while they write; a bool reduction of
// std::isfinite compiled to a scalar loop that took 40% of the fp32 Adam update's time.
FERRY_HOST_CLONES bool all_finite(const float* w, std::size_t n) {
  std::uint32_t most = 0;
  for (std::size_t i = 0; i < n; ++i) most = std::max(most, std::bit_cast<std::uint32_t>(w[i]) & 0x7fffffffu);
  return most < 0x7f800000u;
}

// The bias corrections as factors (1 / bc1, 1 / sqrt(bc2)), so an element costs one square root
// and one division, as PyTorch's fused CPU AdamW: each division is a large part of a vector
// loop's time (the device kernels, which the link bounds, divide by bc1 and bc2 as written).
struct AdamChunk {
  float lr, b1, b2, eps, wd, inv_bc1, inv_sqrt_bc2;
  bool decoupled;
};

// Elements [begin, end). In place (w_in == w_out) each element is read before it is written, so
// there is no dependence between iterations. Inlined into each clone below, so it is compiled for
// that clone's instruction set; the flag is a template argument so the loop has no branch.
template <bool Decoupled>
[[gnu::always_inline]] inline bool adam_loop(const AdamChunk& c, const float* grad, const AdamSlots& s,
                                             std::size_t begin, std::size_t end) {
  const float lr = c.lr, b1 = c.b1, b2 = c.b2, eps = c.eps, wd = c.wd, inv_bc1 = c.inv_bc1,
              inv_sqrt_bc2 = c.inv_sqrt_bc2;
  const float* w_in = s.w_in;
  const float* m_in = s.m_in;
  const float* v_in = s.v_in;
  float* w_out = s.w_out;
  float* m_out = s.m_out;
  float* v_out = s.v_out;
  std::uint32_t most = 0;  // the largest magnitude's bits written (finite below 0x7f800000)
  FERRY_NO_LOOP_DEPENDENCE
  for (std::size_t i = begin; i < end; ++i) {
    const float w = w_in[i];
    const float g = Decoupled ? grad[i] : grad[i] + wd * w;  // L2 adds the decay to the gradient
    const float m = b1 * m_in[i] + (1.0f - b1) * g;
    const float v = b2 * v_in[i] + (1.0f - b2) * g * g;
    const float update = (m * inv_bc1) / (std::sqrt(v) * inv_sqrt_bc2 + eps);
    m_out[i] = m;
    v_out[i] = v;
    const float w_new = Decoupled ? w - lr * (update + wd * w) : w - lr * update;  // AdamW decays the weight
    w_out[i] = w_new;
    // v >= 0: an infinite second moment (a gradient whose square overflows) counts as a weight
    // made not finite, since that weight would never move again.
    // (Two-argument maxima: the initializer-list form kept GCC from vectorising the loop, 4x slower.)
    most = std::max(most, std::max(std::bit_cast<std::uint32_t>(w_new) & 0x7fffffffu, std::bit_cast<std::uint32_t>(v)));
  }
  return most < 0x7f800000u;
}

// Whether every weight written is finite (and every second moment).
FERRY_HOST_CLONES bool adam_chunk(const AdamChunk& c, const float* grad, const AdamSlots& s, std::size_t begin,
                                  std::size_t end) {
  return c.decoupled ? adam_loop<true>(c, grad, s, begin, end) : adam_loop<false>(c, grad, s, begin, end);
}

struct SgdChunk {
  float lr, momentum, wd;
  bool nesterov;
};

template <bool Nesterov>
[[gnu::always_inline]] inline void sgd_loop(const SgdChunk& c, const float* grad, const SgdSlots& s, std::size_t begin,
                                            std::size_t end) {
  const float lr = c.lr, momentum = c.momentum, wd = c.wd;
  const float* w_in = s.w_in;
  const float* vel_in = s.velocity_in;
  float* w_out = s.w_out;
  float* vel_out = s.velocity_out;
  FERRY_NO_LOOP_DEPENDENCE
  for (std::size_t i = begin; i < end; ++i) {
    const float w = w_in[i];
    const float g = grad[i] + wd * w;
    const float v = momentum * vel_in[i] + g;
    vel_out[i] = v;
    w_out[i] = w - lr * (Nesterov ? g + momentum * v : v);
  }
}

FERRY_HOST_CLONES void sgd_chunk(const SgdChunk& c, const float* grad, const SgdSlots& s, std::size_t begin,
                                 std::size_t end) {
  if (c.nesterov) {
    sgd_loop<true>(c, grad, s, begin, end);
  } else {
    sgd_loop<false>(c, grad, s, begin, end);
  }
}
// The two maps' 256 values by code (ops/quant_map.hpp), so dequantizing is a load.
struct CodeTables {
  std::array<float, 256> m{}, v{};
};
constexpr CodeTables make_code_tables() {
  CodeTables t;
  for (std::uint32_t c = 0; c < 256; ++c) {
    t.m[c] = dynamic_value(static_cast<std::uint8_t>(c), true);
    t.v[c] = dynamic_value(static_cast<std::uint8_t>(c), false);
  }
  return t;
}
constexpr CodeTables code_tables = make_code_tables();

// dynamic_quantize(x / scale) for each of `count` values (as the kernel's q_normalized and
// q_nearest): the values normalized in place, clamped to the map's range (NaN as 0), then their
// codes by table (ops/quant_buckets.hpp: no search, no branch), each a loop of its own (one loop
// doing both ran 1.7x slower with GCC 12, AVX2 and AVX-512 alike). A scale of 0 (or NaN) makes
// every code the one of 0.
template <bool Signed>
[[gnu::always_inline]] inline void quantize_block(float* x, float scale, std::uint8_t* out, std::size_t count) {
  if (!(scale > 0.0f)) {
    std::fill(out, out + count, static_cast<std::uint8_t>(Signed ? 128 : 0));
    return;
  }
  for (std::size_t k = 0; k < count; ++k) {
    const float r = x[k] / scale;
    x[k] = std::min(std::max(r == r ? r : 0.0f, Signed ? -1.0f : 0.0f), 1.0f);
  }
  FERRY_NO_LOOP_DEPENDENCE
  for (std::size_t k = 0; k < count; ++k) out[k] = static_cast<std::uint8_t>(quant_buckets::quantize<Signed>(x[k]));
}

// The largest |x| (Signed) or x of `count` values, a NaN skipped (as fmax); in 16 lanes, so the
// vectoriser needs no reduction it would not reorder.
template <bool Signed>
[[gnu::always_inline]] inline float block_absmax(const float* x, std::size_t count) {
  constexpr std::size_t lanes = 16;
  float lane_max[lanes] = {};
  std::size_t k = 0;
  for (; k + lanes <= count; k += lanes) {
    for (std::size_t j = 0; j < lanes; ++j)
      lane_max[j] = std::max(lane_max[j], Signed ? std::fabs(x[k + j]) : x[k + j]);
  }
  for (std::size_t j = 0; k + j < count; ++j)
    lane_max[j] = std::max(lane_max[j], Signed ? std::fabs(x[k + j]) : x[k + j]);
  float out = 0.0f;
  for (const float v : lane_max) out = std::max(out, v);
  return out;
}

struct Adam8bitChunk {
  AdamChunk adam;
  std::size_t block, blocks;
};

// Blocks [first, last): update, then requantize each with its new absmax. `m_new` and `v_new`
// hold one block's new moments. Returns whether every weight written is finite.
template <bool Decoupled>
[[gnu::always_inline]] inline bool adam8bit_loop(const Adam8bitChunk& c, const float* grad, const Adam8bitSlots& s,
                                                 std::size_t first, std::size_t last, std::size_t n, float* m_new,
                                                 float* v_new) {
  const AdamChunk& a = c.adam;
  const float lr = a.lr, b1 = a.b1, b2 = a.b2, eps = a.eps, wd = a.wd, inv_bc1 = a.inv_bc1,
              inv_sqrt_bc2 = a.inv_sqrt_bc2;
  std::uint32_t most = 0;  // the largest magnitude's bits written (finite below 0x7f800000)
  for (std::size_t b = first; b < last; ++b) {
    const std::size_t start = b * c.block, len = std::min(c.block, n - start);
    const float m_scale = s.scales_in[b], v_scale = s.scales_in[c.blocks + b];
    const float* w_in = s.w_in + start;
    const float* g_in = grad + (start - first * c.block);  // grad: from the first block's element 0
    const std::uint8_t* m_in = s.m_in + start;
    const std::uint8_t* v_in = s.v_in + start;
    float* w_out = s.w_out + start;
    FERRY_NO_LOOP_DEPENDENCE
    for (std::size_t k = 0; k < len; ++k) {
      const float w = w_in[k];
      const float g = Decoupled ? g_in[k] : g_in[k] + wd * w;
      const float m = b1 * (code_tables.m[m_in[k]] * m_scale) + (1.0f - b1) * g;
      const float v = b2 * (code_tables.v[v_in[k]] * v_scale) + (1.0f - b2) * g * g;
      const float update = (m * inv_bc1) / (std::sqrt(v) * inv_sqrt_bc2 + eps);
      m_new[k] = m;
      v_new[k] = v;
      const float w_new = Decoupled ? w - lr * (update + wd * w) : w - lr * update;
      w_out[k] = w_new;
      most = std::max(most, std::bit_cast<std::uint32_t>(w_new) & 0x7fffffffu);
    }
    const float m_max = block_absmax<true>(m_new, len), v_max = block_absmax<false>(v_new, len);
    most = std::max(most, std::bit_cast<std::uint32_t>(v_max) & 0x7fffffffu);  // as adam_loop's v
    quantize_block<true>(m_new, m_max, s.m_out + start, len);
    quantize_block<false>(v_new, v_max, s.v_out + start, len);
    s.scales_out[b] = m_max;
    s.scales_out[c.blocks + b] = v_max;
  }
  return most < 0x7f800000u;
}

FERRY_HOST_CLONES bool adam8bit_blocks_update(const Adam8bitChunk& c, const float* grad, const Adam8bitSlots& s,
                                              std::size_t first, std::size_t last, std::size_t n, float* m_new,
                                              float* v_new) {
  return c.adam.decoupled ? adam8bit_loop<true>(c, grad, s, first, last, n, m_new, v_new)
                          : adam8bit_loop<false>(c, grad, s, first, last, n, m_new, v_new);
}

// A gradient the updates can read (checked before any element changes, so a bad one leaves the
// state as it was).
void check_gradient(const HostGradient& g, const char* update) {
  if (!cast_supported(g.dtype, DType::f32)) {
    throw std::invalid_argument(fmt::format("{}: the gradient is {}, which does not widen to f32 (ops::cast_supported)",
                                            update, dtype_name(g.dtype)));
  }
}

// Elements [begin, begin + count) of the gradient as f32: in place when it is f32, else widened
// into this worker's buffer (kept between steps, at most a piece long), as ops::cast_host widens
// a narrow copy. The cast runs isolated: a worker waiting inside it must not take another piece
// of the same update, whose widening would overwrite (or reallocate) this buffer.
const float* gradient_range(const HostGradient& g, std::size_t begin, std::size_t count) {
  if (g.dtype == DType::f32 && g.factor == 1.0f) return static_cast<const float*>(g.data) + begin;
  thread_local std::vector<float> widened;
  if (widened.size() < count) widened.resize(count);
  tbb::this_task_arena::isolate([&] {
    cast_host(g.dtype, DType::f32, static_cast<const std::byte*>(g.data) + begin * dtype_bytes(g.dtype), widened.data(),
              count, g.factor);
  });
  return widened.data();
}

// Runs f(piece_begin, piece_end) over [r.begin(), r.end()) in pieces of at most `piece`: a task
// of the default partitioner may be far longer than its grain, and a piece keeps a worker's
// buffers (and the second pass over what it wrote) within the caches.
template <class F>
void for_each_piece(const tbb::blocked_range<std::size_t>& r, std::size_t piece, F&& f) {
  for (std::size_t b = r.begin(); b < r.end(); b += piece) f(b, std::min(r.end(), b + piece));
}

AdamSlots from(const AdamSlots& s, std::size_t k) {
  return {s.w_in + k, s.m_in + k, s.v_in + k, s.w_out + k, s.m_out + k, s.v_out + k};
}
SgdSlots from(const SgdSlots& s, std::size_t k) {
  return {s.w_in + k, s.velocity_in + k, s.w_out + k, s.velocity_out + k};
}

AdamChunk adam_chunk_of(const AdamConfig& c, const StepInfo& step) {
  if (step.step == 0) throw std::invalid_argument("host Adam update: step must start at 1 (bias correction)");
  const float bc1 = 1.0f - std::pow(c.beta1, static_cast<float>(step.step));
  const float bc2 = 1.0f - std::pow(c.beta2, static_cast<float>(step.step));
  return {
      step.lr, c.beta1, c.beta2, c.eps, c.weight_decay, 1.0f / bc1, 1.0f / std::sqrt(bc2), c.decoupled_weight_decay};
}
}  // namespace

bool host_adam_update(const AdamConfig& c, const StepInfo& step, HostGradient grad, AdamSlots s, std::size_t n) {
  check_gradient(grad, "host Adam update");
  const AdamChunk a = adam_chunk_of(c, step);
  std::atomic<bool> finite{true};
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, chunk), [&](const tbb::blocked_range<std::size_t>& r) {
    for_each_piece(r, chunk, [&](std::size_t b, std::size_t e) {
      if (!adam_chunk(a, gradient_range(grad, b, e - b), from(s, b), 0, e - b)) finite = false;
    });
  });
  return finite;
}

bool host_sgd_update(const SgdConfig& c, const StepInfo& step, HostGradient grad, SgdSlots s, std::size_t n) {
  check_gradient(grad, "host SGD update");
  const SgdChunk a{step.lr, c.momentum, c.weight_decay, c.nesterov};
  std::atomic<bool> finite{true};
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, chunk), [&](const tbb::blocked_range<std::size_t>& r) {
    for_each_piece(r, chunk, [&](std::size_t b, std::size_t e) {
      sgd_chunk(a, gradient_range(grad, b, e - b), from(s, b), 0, e - b);
      if (!all_finite(s.w_out + b, e - b)) finite = false;
    });
  });
  return finite;
}

bool host_adam8bit_update(const AdamConfig& c, std::uint32_t block, const StepInfo& step, HostGradient grad,
                          Adam8bitSlots s, std::size_t n) {
  if (block == 0 || block > adam8bit_max_block) {
    throw std::invalid_argument(
        fmt::format("host 8-bit Adam update: block size {} is not in 1..{}", block, adam8bit_max_block));
  }
  check_gradient(grad, "host 8-bit Adam update");
  const Adam8bitChunk a{adam_chunk_of(c, step), block, adam8bit_blocks(n, block)};
  // Pieces of whole blocks, about a chunk's elements each.
  const std::size_t grain = std::max<std::size_t>(1, chunk / block);
  std::atomic<bool> finite{true};
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, a.blocks, grain), [&](const tbb::blocked_range<std::size_t>& r) {
    // One block's new moments, m then v, per worker thread (kept between steps: no allocation per
    // task; one vector, so a failed allocation cannot leave one of two too short).
    thread_local std::vector<float> moments;
    if (moments.size() < 2 * std::size_t{block}) moments.resize(2 * std::size_t{block});
    for_each_piece(r, grain, [&](std::size_t first_block, std::size_t end_block) {
      const std::size_t first = first_block * block, last = std::min(n, end_block * block);
      if (!adam8bit_blocks_update(a, gradient_range(grad, first, last - first), s, first_block, end_block, n,
                                  moments.data(), moments.data() + block))
        finite = false;
    });
  });
  return finite;
}

}  // namespace ferry::ops
