// Host optimizer updates: one pass per chunk, vectorised by the compiler, chunks on TBB workers.
#include "ops/optimizer_host.hpp"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <atomic>
#include <cmath>
#include <stdexcept>

namespace ferry::ops {
namespace {
// Large enough to amortise scheduling, small enough to spread a 1M-element tensor over workers.
constexpr std::size_t chunk = 1 << 14;

// A second pass over the chunk just written (in cache): keeps the update's loop vectorisable.
bool all_finite(const float* w, std::size_t n) {
  bool ok = true;
  for (std::size_t i = 0; i < n; ++i) ok &= std::isfinite(w[i]);
  return ok;
}
}  // namespace

bool host_adam_update(const AdamConfig& c, const StepInfo& step, const float* grad, AdamSlots s, std::size_t n) {
  if (step.step == 0) throw std::invalid_argument("host Adam update: step must start at 1 (bias correction)");
  const float lr = step.lr, b1 = c.beta1, b2 = c.beta2, eps = c.eps, wd = c.weight_decay;
  const float bc1 = 1.0f - std::pow(b1, static_cast<float>(step.step));
  const float bc2 = 1.0f - std::pow(b2, static_cast<float>(step.step));
  const bool decoupled = c.decoupled_weight_decay;
  std::atomic<bool> finite{true};
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, chunk), [&](const tbb::blocked_range<std::size_t>& r) {
    for (std::size_t i = r.begin(); i < r.end(); ++i) {
      const float w = s.w_in[i];
      const float g = decoupled ? grad[i] : grad[i] + wd * w;
      const float m = b1 * s.m_in[i] + (1.0f - b1) * g;
      const float v = b2 * s.v_in[i] + (1.0f - b2) * g * g;
      const float update = (m / bc1) / (std::sqrt(v / bc2) + eps);
      s.m_out[i] = m;
      s.v_out[i] = v;
      s.w_out[i] = w - lr * (update + (decoupled ? wd * w : 0.0f));
    }
    if (!all_finite(s.w_out + r.begin(), r.size())) finite = false;
  });
  return finite;
}

bool host_sgd_update(const SgdConfig& c, const StepInfo& step, const float* grad, SgdSlots s, std::size_t n) {
  const float lr = step.lr, momentum = c.momentum, wd = c.weight_decay;
  const bool nesterov = c.nesterov;
  std::atomic<bool> finite{true};
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, chunk), [&](const tbb::blocked_range<std::size_t>& r) {
    for (std::size_t i = r.begin(); i < r.end(); ++i) {
      const float w = s.w_in[i];
      const float g = grad[i] + wd * w;
      const float v = momentum * s.velocity_in[i] + g;
      s.velocity_out[i] = v;
      s.w_out[i] = w - lr * (nesterov ? g + momentum * v : v);
    }
    if (!all_finite(s.w_out + r.begin(), r.size())) finite = false;
  });
  return finite;
}

}  // namespace ferry::ops
