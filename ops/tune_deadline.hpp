// A tuning search's time budget (ferry tune --budget-seconds, FERRY_TUNE_BUDGET_S for first-use
// searches): a candidate starts only when one as long as the last that ran still ends within the
// budget, so a search ends within it unless its first candidate (which always runs) or one longer
// than the one before it runs past.
#pragma once

#include <chrono>
#include <functional>
#include <utility>

namespace ferry::ops {

class TuneDeadline {
 public:
  using Clock = std::chrono::steady_clock;
  // `stop` (optional) is asked between candidates: true ends the search as a spent budget does
  // (ferry tune passes "a stop signal arrived"), so that what was found so far is kept.
  TuneDeadline(double budget_seconds, Clock::time_point start, std::function<bool()> stop = {})
      : budget_(budget_seconds), start_(start), stop_(std::move(stop)) {}

  // Whether another candidate fits: always before the first.
  bool next_fits() const { return last_ < 0 || (elapsed() + last_ <= budget_ && !stopped()); }
  // Whether the search was asked to stop (then next_fits() is false after the first candidate).
  bool stopped() const { return stop_ && stop_(); }
  // Around each candidate's timing.
  void begin() { begun_ = Clock::now(); }
  void end() { last_ = seconds(Clock::now() - begun_); }
  double elapsed() const { return seconds(Clock::now() - start_); }

 private:
  static double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
  double budget_;
  Clock::time_point start_, begun_{};
  std::function<bool()> stop_;
  double last_ = -1;  // seconds the last candidate took; -1 before the first
};

}  // namespace ferry::ops
