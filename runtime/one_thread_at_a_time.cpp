// OneThreadAtATime (include/ferry/runtime/one_thread_at_a_time.hpp).
#include "ferry/runtime/one_thread_at_a_time.hpp"

#include <fmt/format.h>

#include <stdexcept>

namespace ferry {

OneThreadAtATime::Call::Call(const OneThreadAtATime& use, const char* call) : use_(use) {
  const std::thread::id me = std::this_thread::get_id();
  std::thread::id free{};
  if (use.holder_.compare_exchange_strong(free, me, std::memory_order_acquire)) {
    use.call_.store(call, std::memory_order_relaxed);
    use.depth_ = 1;
    return;
  }
  if (free == me) {
    ++use.depth_;
    return;
  }
  const char* other = use.call_.load(std::memory_order_relaxed);
  throw std::logic_error(fmt::format(
      "{} was called while another thread is in {}: a Trainer serves one thread at a time; hold a mutex around "
      "its calls, or give each thread a Trainer of its own (trainers made on one Runtime may run on threads of "
      "their own)",
      call, other != nullptr ? other : "a call of the same object"));
}

OneThreadAtATime::Call::~Call() {
  if (--use_.depth_ > 0) return;
  use_.call_.store(nullptr, std::memory_order_relaxed);
  use_.holder_.store(std::thread::id{}, std::memory_order_release);
}

}  // namespace ferry
