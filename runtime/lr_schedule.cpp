// Learning-rate schedules.
#include "ferry/runtime/lr_schedule.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace ferry {

float LrSchedule::at(std::uint64_t step) const {
  if (warmup_steps > 0 && step < warmup_steps) {
    return peak * static_cast<float>(step + 1) / static_cast<float>(warmup_steps);
  }
  if (kind == Kind::constant) return peak;
  const std::uint64_t s = std::min(step, total_steps - 1);
  // Written as the fp32 expression the `ferry` command has always used, so its runs keep their
  // exact learning rates.
  const float decay = 0.5f * (1.0f + std::cos(static_cast<float>(M_PI) * s / total_steps));
  return min_lr + (peak - min_lr) * decay;
}

void LrSchedule::validate() const {
  if (!std::isfinite(peak) || peak <= 0.0f) {
    throw std::invalid_argument(fmt::format("learning rate must be a positive number, got {}", peak));
  }
  if (!std::isfinite(min_lr) || min_lr < 0.0f || min_lr > peak) {
    throw std::invalid_argument(
        fmt::format("the schedule's minimum learning rate must be in [0, {}] (the peak), got {}", peak, min_lr));
  }
  if (kind == Kind::cosine && total_steps == 0) {
    throw std::invalid_argument("a cosine schedule needs total_steps > 0 (the steps it decays over)");
  }
  if (kind == Kind::cosine && warmup_steps >= total_steps) {
    throw std::invalid_argument(
        fmt::format("warm-up of {} steps is not shorter than the schedule's {} steps", warmup_steps, total_steps));
  }
}

std::uint64_t updates_in(std::uint64_t steps, std::uint32_t accumulate) {
  return std::max<std::uint64_t>(1, steps / std::max<std::uint32_t>(1, accumulate));
}

const char* schedule_name(LrSchedule::Kind k) {
  return k == LrSchedule::Kind::constant ? "constant" : "cosine";
}

LrSchedule::Kind parse_schedule(const std::string& s) {
  if (s == "cosine") return LrSchedule::Kind::cosine;
  if (s == "constant") return LrSchedule::Kind::constant;
  throw std::invalid_argument(fmt::format("unknown schedule '{}': use cosine or constant", s));
}

}  // namespace ferry
