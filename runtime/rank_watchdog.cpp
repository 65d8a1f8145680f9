// RankWatchdog (runtime/rank_watchdog.hpp).
#include "rank_watchdog.hpp"

#include <algorithm>

namespace ferry {

namespace {

// A limit past a few decades is as good as none, and a larger one (ferry train takes up to the
// largest float of minutes) would overflow the clock's integer ticks.
constexpr std::chrono::duration<double> longest_limit{1e9};

}  // namespace

RankWatchdog::RankWatchdog(std::chrono::duration<double> limit,
                           std::function<void(double idle_seconds, std::uint64_t steps_done)> expire)
    : limit_(std::chrono::duration_cast<Clock::duration>(std::min(limit, longest_limit))),
      expire_(std::move(expire)),
      last_beat_(Clock::now().time_since_epoch().count()),
      thread_([this] { watch(); }) {}

RankWatchdog::~RankWatchdog() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void RankWatchdog::beat(std::uint64_t steps_done) noexcept {
  steps_done_.store(steps_done, std::memory_order_relaxed);
  last_beat_.store(Clock::now().time_since_epoch().count(), std::memory_order_release);
}

void RankWatchdog::watch() {
  // Looks at least once a second (and 20 times within the limit), so that a short limit is kept
  // to within a twentieth of it and the destructor never waits long.
  const Clock::duration period = std::min<Clock::duration>(std::chrono::seconds(1), limit_ / 20);
  std::unique_lock lock(mutex_);
  while (!wake_.wait_for(lock, period, [this] { return stopping_; })) {
    const Clock::time_point last{Clock::duration(last_beat_.load(std::memory_order_acquire))};
    const Clock::duration idle = Clock::now() - last;
    if (idle < limit_) continue;
    lock.unlock();
    expire_(std::chrono::duration<double>(idle).count(), steps_done_.load(std::memory_order_relaxed));
    return;  // once: expire ends the run, or the loop's owner decides what follows
  }
}

}  // namespace ferry
