// Enqueueing bound kernel launches.
#include "ferry/ops/launch.hpp"

#include "ferry/cl/error.hpp"

namespace ferry::ops {

cl::Event enqueue(cl_command_queue queue, const LaunchList& launches, std::span<const cl_event> wait,
                  const StepInfo& step, cl::Event* first_event) {
  cl::Event last;
  for (std::size_t i = 0; i < launches.size(); ++i) {
    const KernelLaunch& l = launches[i];
    const bool first = i == 0;
    if (l.custom) {
      last = l.custom(queue, first ? wait : std::span<const cl_event>{});
      if (first && first_event) *first_event = last;
      continue;
    }
    if (l.per_step) l.per_step(l.kernel.get(), step);
    const bool any_local = l.local[0] != 0;
    cl::Event ev;
    FERRY_CL(clEnqueueNDRangeKernel(queue, l.kernel.get(), l.dims, nullptr, l.global.data(),
                                    any_local ? l.local.data() : nullptr, first ? static_cast<cl_uint>(wait.size()) : 0,
                                    first && !wait.empty() ? wait.data() : nullptr, ev.out()));
    if (first && first_event) *first_event = ev;
    last = std::move(ev);
  }
  return last;
}

void run_blocking(cl_command_queue queue, const LaunchList& launches, const StepInfo& step) {
  cl::Event ev = enqueue(queue, launches, {}, step);
  FERRY_CL(clFinish(queue));
}

KernelLaunch elementwise_launch(cl::Kernel kernel, std::size_t n) {
  KernelLaunch l;
  l.kernel = std::move(kernel);
  l.global[0] = round_up(n == 0 ? 1 : n, 64);
  l.local[0] = 64;
  return l;
}

}  // namespace ferry::ops
