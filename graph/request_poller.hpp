// Completes the communication lane's nodes: a thread of the step's own tests each collective a
// comm node started until it completes, then opens the node's async_node gateway. So no TBB worker
// waits for the network, and MPI's progress (Open MPI progresses a non-blocking collective only
// inside MPI calls) is driven by those tests while the workers and the device run the step.
#pragma once

#include <tbb/flow_graph.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "ferry/ops/communicator.hpp"

namespace ferry::graph {

// A flow-graph node whose completion something outside the graph signals (a driver callback, the
// poller): the body hands its gateway over and returns.
using DoneNode = tbb::flow::async_node<tbb::flow::continue_msg, tbb::flow::continue_msg>;

class RequestPoller {
 public:
  // What to do once a request completes: `failure` gets the exception its test threw, if any;
  // `end_ns`, when set, the host clock then (the node's end on the trace); then the gateway opens.
  struct Completion {
    DoneNode::gateway_type* gateway = nullptr;
    std::exception_ptr* failure = nullptr;
    std::uint64_t* end_ns = nullptr;
  };

  RequestPoller() = default;
  RequestPoller(const RequestPoller&) = delete;
  RequestPoller& operator=(const RequestPoller&) = delete;
  // Stops the thread once every request it holds has completed.
  ~RequestPoller();

  // Takes `request` over (reserving a wait on the gateway, so the flow graph's wait_for_all waits
  // for it) and starts the thread on first use.
  void add(std::unique_ptr<ops::CommRequest> request, Completion done);

  // How long the thread sleeps between rounds of tests while requests are pending: short beside a
  // bucket's transfer, long enough that a rank sharing cores with the device's threads (PoCL)
  // does not spin.
  static constexpr auto poll_interval = std::chrono::microseconds(20);

 private:
  struct Pending {
    std::unique_ptr<ops::CommRequest> request;
    Completion done;
  };
  void run();

  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<Pending> incoming_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace ferry::graph
