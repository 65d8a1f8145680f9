// Host optimizer updates: chunks on TBB workers, each a plain loop over arrays that the compiler
// vectorises once per instruction set (target_clones: AVX-512, AVX2 and the x86-64 baseline, the
// widest chosen at load time on the machine that runs it). This file is compiled with
// -ffp-contract=off and -fno-math-errno (CMakeLists.txt): no clone fuses a multiply into an add,
// so every clone rounds the same way and results do not depend on the machine, and sqrt needs no
// scalar errno path.
#include "ops/optimizer_host.hpp"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <atomic>
#include <cmath>
#include <stdexcept>

// Clones where the compiler makes them (GCC, clang >= 14 on x86-64); not in sanitizer builds, whose
// runtimes are not set up yet when the loader runs a clone's resolver.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define FERRY_HOST_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FERRY_HOST_CLONES
#endif
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

// A second pass over the chunk just written (in cache): keeps the update's loop free of a
// reduction the vectoriser would have to carry.
FERRY_HOST_CLONES bool all_finite(const float* w, std::size_t n) {
  bool ok = true;
  for (std::size_t i = 0; i < n; ++i) ok &= std::isfinite(w[i]);
  return ok;
}

struct AdamChunk {
  float lr, b1, b2, eps, wd, bc1, bc2;
  bool decoupled;
};

// Elements [begin, end). In place (w_in == w_out) each element is read before it is written, so
// there is no dependence between iterations. Inlined into each clone below, so it is compiled for
// that clone's instruction set; the flag is a template argument so the loop has no branch.
template <bool Decoupled>
[[gnu::always_inline]] inline void adam_loop(const AdamChunk& c, const float* grad, const AdamSlots& s,
                                             std::size_t begin, std::size_t end) {
  const float lr = c.lr, b1 = c.b1, b2 = c.b2, eps = c.eps, wd = c.wd, bc1 = c.bc1, bc2 = c.bc2;
  const float* w_in = s.w_in;
  const float* m_in = s.m_in;
  const float* v_in = s.v_in;
  float* w_out = s.w_out;
  float* m_out = s.m_out;
  float* v_out = s.v_out;
  FERRY_NO_LOOP_DEPENDENCE
  for (std::size_t i = begin; i < end; ++i) {
    const float w = w_in[i];
    const float g = Decoupled ? grad[i] : grad[i] + wd * w;  // L2 adds the decay to the gradient
    const float m = b1 * m_in[i] + (1.0f - b1) * g;
    const float v = b2 * v_in[i] + (1.0f - b2) * g * g;
    const float update = (m / bc1) / (std::sqrt(v / bc2) + eps);
    m_out[i] = m;
    v_out[i] = v;
    w_out[i] = Decoupled ? w - lr * (update + wd * w) : w - lr * update;  // AdamW decays the weight
  }
}

FERRY_HOST_CLONES void adam_chunk(const AdamChunk& c, const float* grad, const AdamSlots& s, std::size_t begin,
                                  std::size_t end) {
  if (c.decoupled) {
    adam_loop<true>(c, grad, s, begin, end);
  } else {
    adam_loop<false>(c, grad, s, begin, end);
  }
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
}  // namespace

bool host_adam_update(const AdamConfig& c, const StepInfo& step, const float* grad, AdamSlots s, std::size_t n) {
  if (step.step == 0) throw std::invalid_argument("host Adam update: step must start at 1 (bias correction)");
  const AdamChunk a{step.lr,
                    c.beta1,
                    c.beta2,
                    c.eps,
                    c.weight_decay,
                    1.0f - std::pow(c.beta1, static_cast<float>(step.step)),
                    1.0f - std::pow(c.beta2, static_cast<float>(step.step)),
                    c.decoupled_weight_decay};
  std::atomic<bool> finite{true};
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, chunk), [&](const tbb::blocked_range<std::size_t>& r) {
    adam_chunk(a, grad, s, r.begin(), r.end());
    if (!all_finite(s.w_out + r.begin(), r.size())) finite = false;
  });
  return finite;
}

bool host_sgd_update(const SgdConfig& c, const StepInfo& step, const float* grad, SgdSlots s, std::size_t n) {
  const SgdChunk a{step.lr, c.momentum, c.weight_decay, c.nesterov};
  std::atomic<bool> finite{true};
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, chunk), [&](const tbb::blocked_range<std::size_t>& r) {
    sgd_chunk(a, grad, s, r.begin(), r.end());
    if (!all_finite(s.w_out + r.begin(), r.size())) finite = false;
  });
  return finite;
}

}  // namespace ferry::ops
