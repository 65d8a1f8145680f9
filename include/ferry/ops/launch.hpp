// The contract between ops and whoever runs them (the step graph, tests, benchmarks).
//
// An op is "bound" once: its kernels are created and their arguments set for fixed operand
// locations (the memory plan fixes every offset before the step runs). Each step then only
// enqueues the recorded launches with a wait list, so a launch costs one clEnqueueNDRangeKernel
// and no two threads ever set arguments on the same cl_kernel.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ferry/cl/context.hpp"
#include "ferry/cl/handle.hpp"
#include "ferry/cl/program.hpp"

namespace ferry::ops {

// An operand on the device: a buffer of the arena and a byte offset into it. Kernels index typed
// pointers, so launch code passes elem_offset(bytes per element); the memory plan aligns every
// tensor to at least 256 bytes, so the division is exact (checked).
struct DeviceSpan {
  cl_mem buffer = nullptr;
  std::uint64_t offset_bytes = 0;

  // The offset in elements of `elem_bytes` bytes (fp32 and i32: 4). Throws std::logic_error if
  // the byte offset is not a multiple of the element size.
  std::uint64_t elem_offset(std::size_t elem_bytes = 4) const;
  // The span `bytes` further into the same buffer.
  DeviceSpan advanced(std::uint64_t bytes) const { return {buffer, offset_bytes + bytes}; }
};

// Values that change from step to step and that some kernels read (optimizer step, learning rate).
class Communicator;

struct StepInfo {
  std::uint64_t step = 1;  // 1-based count of optimizer updates (Adam bias correction)
  float lr = 0.0f;
  float predict_scale = 1.0f;  // hybrid phases: the factor of this Predict step's update
  // Gradient accumulation: 0 on the first micro-batch of a group (the sum restarts), else 1.
  float accumulate_keep = 1.0f;
  // Mixed precision with fp16: gradients in narrow types are this many times the true ones (a
  // power of two; 1 without loss scaling). See ops::CastScale.
  float loss_scale = 1.0f;
  // The index of this step's first sample among all the samples of its optimizer update: the
  // micro-batches of an accumulation group, then the ranks' shares of each, laid end to end
  // (micro-batch m of rank r: m * global batch + the rank's first row). Dropout keys its draws by
  // it (ops::dropout_key), so no two micro-batches or ranks of one update draw the same mask; 0
  // on one rank without accumulation.
  std::uint64_t first_row = 0;
  // Data-parallel training: the ranks whose gradients a step sums (ops::Communicator); null on
  // one rank.
  Communicator* communicator = nullptr;
};

struct KernelLaunch {
  cl::Kernel kernel;
  cl_uint dims = 1;
  std::array<std::size_t, 3> global{1, 1, 1};
  std::array<std::size_t, 3> local{0, 0, 0};  // all zero: the driver chooses
  // Sets the arguments that vary per step just before the enqueue; empty for most kernels.
  std::function<void(cl_kernel, const StepInfo&)> per_step;
  // Optional: a deferred call of a library that enqueues its own work (CLBlast). When set,
  // enqueue() calls it instead of clEnqueueNDRangeKernel with the wait list of this launch (the
  // list's for the first, else the launch before it) and takes the event it returns; `kernel` and
  // the sizes are unused. A call that enqueues several commands sets *first (when not null) to its
  // first command's event, for timelines (a node's span starts there).
  std::function<cl::Event(cl_command_queue, std::span<const cl_event>, cl::Event* first)> custom;
};

using LaunchList = std::vector<KernelLaunch>;

// Enqueues the launches in order on `queue`; the first waits on `wait`, each other one on the
// launch before it (so that the last event reports a failure of any of them on every
// implementation). Returns the event of the last launch (null if the list is empty; the caller
// then forwards its wait list).
// With `first`, also returns the event of the first launch (for timelines of multi-kernel ops).
cl::Event enqueue(cl_command_queue queue, const LaunchList& launches, std::span<const cl_event> wait,
                  const StepInfo& step = {}, cl::Event* first = nullptr);

// Enqueue and wait: for tests and benchmarks, never inside a compiled step.
void run_blocking(cl_command_queue queue, const LaunchList& launches, const StepInfo& step = {});

// What an op needs to bind its kernels.
struct OpEnv {
  cl::KernelLibrary& kernels;
  // First-use tuning (the GEMM's row, the attention's kernels: ops/gemm_tune.hpp) says on stderr
  // that it searches, how far it has come and what won; false keeps it quiet (warnings, errors
  // and a stop signal's acknowledgement still print). RuntimeOptions::tune_progress sets it.
  bool tune_progress = true;
  // SIGINT, SIGTERM and SIGHUP during a first-use search stop it after the candidate being timed
  // (ops/tune_signals.hpp replaces their handlers while it runs, as TrainingLoop's catch_signals
  // does while it trains) and end it with TuneStopped; false leaves the program's handlers alone.
  // RuntimeOptions::tune_stop_signals sets it.
  bool tune_stop_signals = true;
  const cl::DeviceInfo& device() const { return kernels.context().device(); }
};

// `n` as a kernel's element count; throws std::invalid_argument naming `op` when it is over
// 2^32-1 (kernels index with uint).
cl_uint element_count(const char* op, std::size_t n);

// Global size rounded up to a multiple of `multiple`.
inline std::size_t round_up(std::size_t n, std::size_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

// The largest work-group `k` may run with on `device` (the kernel's and the device's limits).
std::size_t kernel_group_limit(const cl::Kernel& k, const cl::DeviceInfo& device);

// Local size for a per-row reduction over `extent` elements (a power of two). FERRY_ROW_GROUP_SIZE
// forces one (tests use it to cover the work-group path on any device). Otherwise: on CPU devices
// a work-item per row (local size 1), which is 3-6x faster on PoCL than a work-group per row
// whose barriers become loops over the work-items; on GPUs a work-group per row, no larger than
// the row needs and at most 256. Always within what the compiled kernel allows.
std::size_t row_group_size(const cl::Kernel& k, const cl::DeviceInfo& device, std::size_t extent);
// Local size (columns, row lanes) for a per-column reduction over rows (bias gradients, int8
// scales): 16 neighbouring columns by 16 row lanes, halving the lanes and then the columns (powers
// of two) until the kernel's and the device's limit allows it.
std::pair<std::size_t, std::size_t> column_group_size(const cl::Kernel& k, const cl::DeviceInfo& device);
// Whether FERRY_ROW_GROUP_SIZE forces the work-group kernels (kernels with a CPU twin that takes a
// row per work-item run the work-group one then, so that tests cover it on a CPU device).
bool row_group_forced();

// A one-dimensional launch over n elements with the library's default work-group size.
KernelLaunch elementwise_launch(cl::Kernel kernel, std::size_t n);

// A nullable (buffer, element offset) operand at arguments `index` and `index + 1`: the kernel sees
// a null pointer when p has no buffer. For operands after a __local argument, which cl::set_args
// cannot pass.
void set_nullable_arg(const cl::Kernel& k, cl_uint index, DeviceSpan p);

}  // namespace ferry::ops
