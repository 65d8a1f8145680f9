// Mixed precision settings and the dynamic loss scale (ferry/runtime/loss_scale.hpp).
#include "ferry/runtime/loss_scale.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace ferry {
namespace {

constexpr float max_scale = 16777216.0f;  // 2^24

bool power_of_two_in_range(float s) {
  if (!std::isfinite(s) || s < 1.0f || s > max_scale) return false;
  int e = 0;
  return std::frexp(s, &e) == 0.5f;
}

}  // namespace

const char* precision_name(ops::DType t) {
  return t == ops::DType::f16 ? "fp16" : t == ops::DType::bf16 ? "bf16" : "fp32";
}

void validate(const PrecisionConfig& c) {
  if (c.compute != ops::DType::f32 && c.compute != ops::DType::f16 && c.compute != ops::DType::bf16) {
    throw std::invalid_argument(
        fmt::format("precision {}: the choices are fp32, fp16 and bf16", ops::dtype_name(c.compute)));
  }
  if (c.scaling == PrecisionConfig::Scaling::on && c.compute == ops::DType::f32) {
    // The scale is applied where gradients cross into and out of narrow layers (ops::CastScale):
    // with f32 layers there is no such crossing, so a scale would be reported but never applied.
    throw std::invalid_argument(
        "loss scaling on with fp32 layers: no layer is narrow, so there is nothing to scale; give --precision fp16 "
        "or bf16 (PrecisionConfig::compute), or leave --loss-scaling at auto or off (PrecisionConfig::scaling)");
  }
  if (!power_of_two_in_range(c.initial_scale)) {
    throw std::invalid_argument(
        fmt::format("initial loss scale {}: it must be a power of two from 1 to 2^24 (e.g. 65536)", c.initial_scale));
  }
  if (c.growth_interval == 0) {
    throw std::invalid_argument("loss scale growth interval 0: the scale would double every step; use 1 or more");
  }
}

LossScaler::LossScaler(const PrecisionConfig& c)
    : scale_(c.scaled() ? c.initial_scale : 1.0f), interval_(c.growth_interval) {}

void LossScaler::record(bool overflow) {
  if (overflow) {
    ++overflows_;
    clean_ = 0;
    scale_ = std::max(1.0f, scale_ * 0.5f);
    return;
  }
  if (++clean_ >= interval_) {
    clean_ = 0;
    scale_ = std::min(max_scale, scale_ * 2.0f);
  }
}

void LossScaler::restore(float scale, std::uint32_t clean_steps, std::uint64_t overflows) {
  if (!power_of_two_in_range(scale)) {
    throw std::invalid_argument(fmt::format("loss scale {}: it must be a power of two from 1 to 2^24", scale));
  }
  if (clean_steps >= interval_) {
    throw std::invalid_argument(
        fmt::format("loss scaler: {} clean steps in a row, but the scale grows after {}", clean_steps, interval_));
  }
  scale_ = scale;
  clean_ = clean_steps;
  overflows_ = overflows;
}

}  // namespace ferry
