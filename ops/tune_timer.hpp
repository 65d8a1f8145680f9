// What the tuners (GEMM, attention) share: their operands and how they time a candidate's launches.
// Private to ops/.
#pragma once

#include <CL/cl.h>

#include <cstddef>
#include <random>

#include "ferry/cl/context.hpp"
#include "ferry/ops/launch.hpp"

namespace ferry::ops {

// Seconds per run of `launches`: one run to build the programs and warm caches and clocks, one
// timed alone, then the best of three rounds of back-to-back runs (as many as fill about 20 ms, at
// most max_runs), each round ended by one clFinish. `what` names the tuner in a failed clFinish.
double best_seconds_per_run(cl_command_queue queue, const LaunchList& launches, int max_runs, const char* what);

// A device buffer of n floats drawn uniformly from [-1, 1) with `rng`: a tuner's operands.
cl::Mem upload_random(const cl::Context& ctx, std::size_t n, std::mt19937& rng, const char* what);

}  // namespace ferry::ops
