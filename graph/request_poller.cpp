#include "request_poller.hpp"

#include <utility>

#include "compiled_step_impl.hpp"

namespace ferry::graph {

RequestPoller::~RequestPoller() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void RequestPoller::add(std::unique_ptr<ops::CommRequest> request, Completion done) {
  done.gateway->reserve_wait();
  {
    std::lock_guard lock(mutex_);
    incoming_.push_back({std::move(request), done});
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  }
  wake_.notify_one();
}

void RequestPoller::run() {
  std::vector<Pending> mine;
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      if (mine.empty()) wake_.wait(lock, [this] { return stop_ || !incoming_.empty(); });
      // Requests still pending are waited for even when stopping: the flow graph waits for them.
      if (stop_ && incoming_.empty() && mine.empty()) return;
      for (Pending& p : incoming_) mine.push_back(std::move(p));
      incoming_.clear();
    }
    for (std::size_t i = 0; i < mine.size();) {
      bool complete = false;
      try {
        complete = mine[i].request->test();
      } catch (...) {
        *mine[i].done.failure = std::current_exception();
        complete = true;
      }
      if (!complete) {
        ++i;
        continue;
      }
      const Completion done = mine[i].done;
      mine[i].request.reset();
      if (i + 1 != mine.size()) mine[i] = std::move(mine.back());
      mine.pop_back();
      if (done.end_ns) *done.end_ns = steady_ns();
      done.gateway->try_put(tbb::flow::continue_msg{});
      done.gateway->release_wait();
    }
    if (!mine.empty()) std::this_thread::sleep_for(poll_interval);
  }
}

}  // namespace ferry::graph
