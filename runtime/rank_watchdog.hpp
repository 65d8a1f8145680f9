// RankWatchdog: ends a data-parallel run whose steps stopped finishing, where a rank that was
// stopped, hung or lost would otherwise leave the others waiting in a collective forever (Open MPI
// has no time limit on one; a waiting rank spins at 100% of a core, printing nothing).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

namespace ferry {

class RankWatchdog {
 public:
  // Watches on a thread of its own: once `limit` passes with no beat(), `expire` is called there,
  // once, with the seconds since the last beat and the steps done then (it ends the run: the loop
  // is stuck in a collective and cannot be asked to).
  RankWatchdog(std::chrono::duration<double> limit,
               std::function<void(double idle_seconds, std::uint64_t steps_done)> expire);
  ~RankWatchdog();
  RankWatchdog(const RankWatchdog&) = delete;
  RankWatchdog& operator=(const RankWatchdog&) = delete;
  // Progress: a step finished (or a boundary's work did), `steps_done` in all.
  void beat(std::uint64_t steps_done) noexcept;

 private:
  void watch();

  using Clock = std::chrono::steady_clock;
  const Clock::duration limit_;
  const std::function<void(double, std::uint64_t)> expire_;
  std::atomic<Clock::rep> last_beat_;  // Clock ticks since its epoch
  std::atomic<std::uint64_t> steps_done_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;  // last: started once the rest is made
};

}  // namespace ferry
