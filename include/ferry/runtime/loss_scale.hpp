// Mixed precision settings and dynamic loss scaling.
//
// With fp16 gradients, small values underflow to zero: the gradient of the loss is multiplied by
// a scale before it enters the narrow layers and divided out again where gradients return to f32
// (ops::CastScale). A step whose scaled gradients overflowed (the overflow guard, ops/
// overflow_guard.hpp) updates nothing; the scale is then halved. After `growth_interval` steps
// in a row without overflow it is doubled, so it stays near the largest scale that does not
// overflow. bf16 has f32's exponent range and needs no scaling.
#pragma once

#include <cstdint>

#include "ferry/ops/types.hpp"

namespace ferry {

struct PrecisionConfig {
  // The layers' compute and storage dtype: f32 (no mixed precision), f16 or bf16. Master weights,
  // optimizer state, biases, LayerNorm, the head and the loss stay f32.
  ops::DType compute = ops::DType::f32;
  // Dynamic loss scaling: on by default with f16, off with bf16 (where it may be turned on).
  enum class Scaling : std::uint8_t { automatic, on, off } scaling = Scaling::automatic;
  float initial_scale = 65536.0f;        // a power of two in [1, 2^24]
  std::uint32_t growth_interval = 2000;  // clean steps before the scale doubles (>= 1)
  bool scaled() const {
    return scaling == Scaling::on || (scaling == Scaling::automatic && compute == ops::DType::f16);
  }
};

// Throws std::invalid_argument naming the setting for an unsupported dtype, scaling turned on with
// f32 layers (nothing would be scaled), a scale that is not a power of two in [1, 2^24], or a
// growth interval of 0.
void validate(const PrecisionConfig& c);
// The compute dtype as `ferry train --precision` spells it: "fp32", "fp16" or "bf16".
const char* precision_name(ops::DType t);

class LossScaler {
 public:
  explicit LossScaler(const PrecisionConfig& c);
  float scale() const noexcept { return scale_; }
  // After a step: an overflow halves the scale (not below 1) and restarts the count of clean
  // steps; the growth_interval-th clean step in a row doubles it (not above 2^24).
  void record(bool overflow);
  std::uint64_t overflows() const noexcept { return overflows_; }
  // Clean steps in a row since the scale last changed.
  std::uint32_t clean_steps() const noexcept { return clean_; }
  // Puts back a state read from scale(), clean_steps() and overflows() (checkpoints). Throws
  // std::invalid_argument, changing nothing, for a scale that is not a power of two in [1, 2^24]
  // or a clean count at or above the growth interval.
  void restore(float scale, std::uint32_t clean_steps, std::uint64_t overflows);

 private:
  float scale_;
  std::uint32_t interval_;
  std::uint32_t clean_ = 0;
  std::uint64_t overflows_ = 0;
};

}  // namespace ferry
