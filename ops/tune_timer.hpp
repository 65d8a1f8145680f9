// What the tuners (GEMM, attention) share: their operands and how they time a candidate's launches.
// Private to ops/.
#pragma once

#include <CL/cl.h>
#include <tbb/task_group.h>

#include <atomic>
#include <cstddef>
#include <functional>
#include <random>
#include <vector>

#include "ferry/cl/context.hpp"
#include "ferry/ops/launch.hpp"

namespace ferry::ops {

// Seconds per run of `launches`: one run to build the programs and warm caches and clocks, one
// timed alone, then the best of five rounds of back-to-back runs (as many as fill about 20 ms, at
// most max_runs), each round ended by one clFinish. `what` names the tuner in a failed clFinish.
double best_seconds_per_run(cl_command_queue queue, const LaunchList& launches, int max_runs, const char* what);

// A device buffer of n floats drawn uniformly from [-1, 1) with `rng`: a tuner's operands.
cl::Mem upload_random(const cl::Context& ctx, std::size_t n, std::mt19937& rng, const char* what);

// On a GPU the driver's compiler takes longer than a candidate's timing (a build per candidate and
// shape): a tuner hands the builds of the candidates still to be timed to a BuildAhead, which runs
// them on other threads meanwhile, in the order they will be timed, cl::build_threads() at once
// (KernelLibrary builds them concurrently, and a measurement that reaches a program being built
// waits for that build). Not when `enabled` is false: on a CPU device, whose builds would take the
// cores being timed. A build that fails is left to its measurement, which builds it again and
// records why. Nor on a simulator (cl::build_threads(device)). Destroying it lets the builds under
// way finish and starts no new ones.
class BuildAhead {
 public:
  // Builds on cl::build_threads(device) threads when enabled and `device` is not a simulator.
  BuildAhead(const cl::DeviceInfo& device, bool enabled, std::vector<std::function<void()>> builds);
  ~BuildAhead();
  BuildAhead(const BuildAhead&) = delete;
  BuildAhead& operator=(const BuildAhead&) = delete;

 private:
  const std::vector<std::function<void()>> builds_;
  std::atomic<std::size_t> next_{0};
  std::atomic<bool> stop_{false};
  tbb::task_group builders_;
};

}  // namespace ferry::ops
