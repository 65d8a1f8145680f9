// Copies each way at once, as a step's two copy lanes run them: the planner's link measurement
// (runtime/plan_rates.cpp) and ferry-bench staging time the link so.
#pragma once

#include <exception>
#include <thread>

namespace ferry::offload {

// Runs `to_device` on this thread while `to_host` runs on a thread of its own (blocking copies:
// a driver may stage pageable memory on the calling thread), and returns once both have ended.
// An error of either is rethrown here, this thread's first; none leaves while the other runs.
template <class ToDevice, class ToHost>
void copy_both_ways(ToDevice&& to_device, ToHost&& to_host) {
  std::exception_ptr failed;
  {
    const std::jthread back([&] {
      try {
        to_host();
      } catch (...) {
        failed = std::current_exception();
      }
    });
    to_device();  // an error here leaves once `back` is joined
  }
  if (failed) std::rethrow_exception(failed);
}

}  // namespace ferry::offload
