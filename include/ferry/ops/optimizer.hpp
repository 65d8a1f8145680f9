// Optimizer updates, one pass over (weight, gradient, state) per kernel. The learning rate and
// the step count come from StepInfo at enqueue time, so schedules need no re-binding.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "ferry/ops/launch.hpp"
#include "ferry/ops/predictor.hpp"
#include "ferry/ops/quant_map.hpp"

namespace ferry::ops {

struct SgdConfig {
  float momentum = 0.9f;
  float weight_decay = 0.0f;  // L2, added to the gradient
  bool nesterov = false;
};

struct AdamConfig {
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  float weight_decay = 0.0f;
  bool decoupled_weight_decay = false;  // true: AdamW (w -= lr * wd * w), false: L2 into the gradient
};

// Which optimizer a step's update nodes run, with its settings (read by the update rows).
// adamw8bit: AdamW whose moments are kept as 8-bit codes (ops/quant_map.hpp), block8bit elements
// sharing one fp32 scale per moment (see adam8bit_update).
struct OptimizerConfig {
  enum class Kind : std::uint8_t { sgd, adam, adamw, adamw8bit } kind = Kind::adam;
  SgdConfig sgd;
  AdamConfig adam;
  std::uint32_t block8bit = 2048;
  // Which weights the weight decay (sgd.weight_decay, adam.weight_decay) applies to: all, or
  // matrices only (weights of rank 2 or more: linear and convolution weights, embedding tables;
  // not biases, nor LayerNorm gains and shifts), as transformers are usually trained.
  enum class DecayOn : std::uint8_t { all, matrices } decay_on = DecayOn::all;
  // The weight-update predictor of the hybrid phases: read only by the variants that fit or
  // apply it (graph::VariantKey).
  PredictorConfig predictor;
  // `adam` with decoupled weight decay set for AdamW (adamw, adamw8bit).
  AdamConfig adam_config() const {
    AdamConfig c = adam;
    c.decoupled_weight_decay = kind == Kind::adamw || kind == Kind::adamw8bit;
    return c;
  }
};
const char* optimizer_name(OptimizerConfig::Kind k);
const char* decay_on_name(OptimizerConfig::DecayOn d);  // "all", "matrices"
// Throws std::invalid_argument naming the setting for a momentum or beta outside [0, 1), a
// negative or non-finite weight decay, an eps that is not a positive number, or (adamw8bit) a
// block the device kernels cannot run. NaN fails every check.
void validate(const OptimizerConfig& c);

// velocity = momentum * velocity + (g + wd * w); w -= lr * (nesterov ? g' + momentum * velocity : velocity)
// `guard` (optional): a float on the device, the step's loss; when it is not finite the update
// does nothing, so a diverged step leaves weights and state as they were. `status` (optional): a
// u32 on the device that the update sets to 1 when it makes a weight not finite (never cleared
// by it), for the step's divergence guard.
LaunchList sgd_update(OpEnv& env, const SgdConfig& c, DeviceSpan w, DeviceSpan g, DeviceSpan velocity, std::size_t n,
                      DeviceSpan guard = {}, DeviceSpan status = {});
// Adam / AdamW with bias correction by StepInfo::step.
// g' = g + wd w (L2 only); m = beta1 m + (1 - beta1) g'; v = beta2 v + (1 - beta2) g'^2;
// w -= lr (m / (1 - beta1^t) / (sqrt(v / (1 - beta2^t)) + eps) + wd w (AdamW only)), t = step.
// Enqueueing with StepInfo::step == 0 throws std::invalid_argument (the correction is undefined).
LaunchList adam_update(OpEnv& env, const AdamConfig& c, DeviceSpan w, DeviceSpan g, DeviceSpan m, DeviceSpan v,
                       std::size_t n, DeviceSpan guard = {}, DeviceSpan status = {});
// adam_update of several parameters in one launch (graph::group_updates: a step's adjacent
// updates, one launch where each was one): the same bits per parameter. At most
// adam_group_slots parameters (std::invalid_argument otherwise, or for none).
struct AdamSlot {
  DeviceSpan w, g, m, v;
  std::size_t n = 0;
};
inline constexpr std::size_t adam_group_slots = 8;  // the kernel's GROUP_SLOTS (checked where it is built)
LaunchList adam_update_group(OpEnv& env, const AdamConfig& c, std::span<const AdamSlot> slots, DeviceSpan guard = {},
                             DeviceSpan status = {});

// 8-bit block-wise Adam / AdamW (ops/kernels/optimizer8bit.cl), one work-group per block of
// `block` elements (the last block may be partial). m and v are u8 codes (m: signed map, v:
// unsigned map); `scales` is f32 [2, blocks]: row 0 the m scales, row 1 the v scales, a block's
// absmax. Per element: dequantize (code value * old scale), the update of adam_update in fp32,
// then the block's new absmax becomes its scale and m, v are requantized to the nearest code.
// Zero scales make every code 0, so zero-initialised state is a valid start.
// Throws std::invalid_argument (check_adam8bit_block) for a block the device cannot run.
// `group` (tests): a work-group size to use instead of the device's (a power of two <= 256).
LaunchList adam8bit_update(OpEnv& env, const AdamConfig& c, std::uint32_t block, DeviceSpan w, DeviceSpan g,
                           DeviceSpan m, DeviceSpan v, DeviceSpan scales, std::size_t n, DeviceSpan guard = {},
                           std::uint32_t group = 0, DeviceSpan status = {});

// The work-group adam8bit_update runs with is a power of two of at most adam8bit_max_group (on
// CPU devices 32, whose smaller groups PoCL runs faster), so a block size that is a multiple of
// adam8bit_max_group, at most adam8bit_max_block, suits every device.
inline constexpr std::uint32_t adam8bit_max_group = 256;
inline constexpr std::uint32_t adam8bit_max_block = 16384;  // a work-item holds block / group elements
// Throws std::invalid_argument saying what to use unless `block` is a positive multiple of
// `group` (the work-group size the kernel runs with) of at most adam8bit_max_block. Config
// parsing calls it with adam8bit_max_group.
void check_adam8bit_block(std::uint32_t block, std::uint32_t group = adam8bit_max_group);
// Blocks (scales per moment) of a tensor of n elements.
inline std::size_t adam8bit_blocks(std::size_t n, std::uint32_t block) {
  return (n + block - 1) / block;
}

// Sets the per-step arguments of an Adam-family kernel: the learning rate at `lr_arg`, then
// 1 / (1 - beta1^t) and 1 / (1 - beta2^t). Throws std::invalid_argument naming `op` for step 0.
std::function<void(cl_kernel, const StepInfo&)> adam_step_args(const char* op, const AdamConfig& c, cl_uint lr_arg);

namespace ref {

template <class T>
void sgd_update(const SgdConfig& c, const StepInfo& s, std::span<T> w, std::span<const T> g, std::span<T> velocity) {
  const T lr = T(s.lr), momentum = T(c.momentum), wd = T(c.weight_decay);
  for (std::size_t i = 0; i < w.size(); ++i) {
    const T gi = g[i] + wd * w[i];
    velocity[i] = momentum * velocity[i] + gi;
    w[i] -= lr * (c.nesterov ? gi + momentum * velocity[i] : velocity[i]);
  }
}

template <class T>
void adam_update(const AdamConfig& c, const StepInfo& s, std::span<T> w, std::span<const T> g, std::span<T> m,
                 std::span<T> v) {
  const T lr = T(s.lr), b1 = T(c.beta1), b2 = T(c.beta2), eps = T(c.eps), wd = T(c.weight_decay);
  const T bc1 = T(1) - std::pow(b1, T(s.step)), bc2 = T(1) - std::pow(b2, T(s.step));
  for (std::size_t i = 0; i < w.size(); ++i) {
    const T gi = c.decoupled_weight_decay ? g[i] : g[i] + wd * w[i];
    m[i] = b1 * m[i] + (T(1) - b1) * gi;
    v[i] = b2 * v[i] + (T(1) - b2) * gi * gi;
    const T update = (m[i] / bc1) / (std::sqrt(v[i] / bc2) + eps);
    w[i] -= lr * (update + (c.decoupled_weight_decay ? wd * w[i] : T(0)));
  }
}

// adam8bit_update in T: m and v hold codes (0..255) as T, scales is [2, blocks] (m, v).
template <class T>
void adam8bit_update(const AdamConfig& c, std::uint32_t block, const StepInfo& s, std::span<T> w, std::span<const T> g,
                     std::span<T> m, std::span<T> v, std::span<T> scales) {
  const T lr = T(s.lr), b1 = T(c.beta1), b2 = T(c.beta2), eps = T(c.eps), wd = T(c.weight_decay);
  const T bc1 = T(1) - std::pow(b1, T(s.step)), bc2 = T(1) - std::pow(b2, T(s.step));
  const std::size_t n = w.size(), blocks = adam8bit_blocks(n, block);
  std::vector<T> m_new(block), v_new(block);
  for (std::size_t b = 0; b < blocks; ++b) {
    const std::size_t start = b * block, len = std::min<std::size_t>(block, n - start);
    T m_max = 0, v_max = 0;
    for (std::size_t k = 0; k < len; ++k) {
      const std::size_t i = start + k;
      const T gi = c.decoupled_weight_decay ? g[i] : g[i] + wd * w[i];
      const T m0 = T(dynamic_value(static_cast<std::uint8_t>(m[i]), true)) * scales[b];
      const T v0 = T(dynamic_value(static_cast<std::uint8_t>(v[i]), false)) * scales[blocks + b];
      m_new[k] = b1 * m0 + (T(1) - b1) * gi;
      v_new[k] = b2 * v0 + (T(1) - b2) * gi * gi;
      const T update = (m_new[k] / bc1) / (std::sqrt(v_new[k] / bc2) + eps);
      w[i] -= lr * (update + (c.decoupled_weight_decay ? wd * w[i] : T(0)));
      m_max = std::max(m_max, std::abs(m_new[k]));
      v_max = std::max(v_max, v_new[k]);
    }
    for (std::size_t k = 0; k < len; ++k) {
      m[start + k] = T(dynamic_quantize(m_max > 0 ? static_cast<float>(m_new[k] / m_max) : 0.0f, true));
      v[start + k] = T(dynamic_quantize(v_max > 0 ? static_cast<float>(v_new[k] / v_max) : 0.0f, false));
    }
    scales[b] = m_max;
    scales[blocks + b] = v_max;
  }
}

}  // namespace ref
}  // namespace ferry::ops
