// Learning-rate schedules: the learning rate for each optimizer step, as a library type a trainer
// (the `ferry` command included) asks once per step.
#pragma once

#include <cstdint>
#include <string>

namespace ferry {

struct LrSchedule {
  enum class Kind : std::uint8_t { constant, cosine } kind = Kind::cosine;
  float peak = 1e-3f;              // the learning rate after warm-up
  std::uint64_t total_steps = 0;   // cosine: the steps it decays over (required, > 0)
  std::uint64_t warmup_steps = 0;  // linear warm-up from peak / warmup_steps to peak
  float min_lr = 0.0f;             // cosine: the floor it decays to

  // The learning rate of 0-based step `step` (steps past total_steps keep the last value).
  float at(std::uint64_t step) const;
  // Throws std::invalid_argument naming the setting for a non-finite or negative rate, a floor
  // above the peak, a cosine schedule without total_steps, or a warm-up not shorter than the schedule.
  void validate() const;
};
// The optimizer updates of `steps` micro-batches taken `accumulate` at a time (at least 1): a
// schedule's total_steps for a run of `steps` (an unfinished last group updates nothing).
std::uint64_t updates_in(std::uint64_t steps, std::uint32_t accumulate);
const char* schedule_name(LrSchedule::Kind k);
LrSchedule::Kind parse_schedule(const std::string& s);  // throws std::invalid_argument

}  // namespace ferry
