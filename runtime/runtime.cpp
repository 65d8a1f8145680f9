// Runtime: device selection and the objects every compiled step shares.
#include "ferry/runtime/runtime.hpp"

#include <fmt/format.h>
#include <tbb/global_control.h>

#include <stdexcept>

namespace ferry {

namespace {

// The device, with the driver's count read before its context exists (what other processes hold).
std::unique_ptr<cl::Context> make_context(const RuntimeOptions& options,
                                          std::unique_ptr<cl::DriverMemoryWatch>& driver_memory) {
  if (options.local_rank < 0) {
    throw std::invalid_argument(
        fmt::format("RuntimeOptions::local_rank is {}: a rank's place among the ranks of its node is 0 or more "
                    "(ferry::local_rank() reads it from the launcher)",
                    options.local_rank));
  }
  const cl::DeviceInfo device = cl::select_device(options.device, options.local_rank);
  driver_memory = std::make_unique<cl::DriverMemoryWatch>(
      options.watch_driver_memory ? cl::DriverMemory::for_device(device)
                                  : cl::DriverMemory("not watched (RuntimeOptions::watch_driver_memory is off)"));
  auto context = std::make_unique<cl::Context>(device, cl::ContextOptions{.profiling = options.profiling});
  driver_memory->context_made();
  return context;
}

}  // namespace

Runtime::Shared::Shared(const RuntimeOptions& options)
    : context(make_context(options, driver_memory)),
      kernels(std::make_unique<cl::KernelLibrary>(*context)),
      env{*kernels, options.tune_progress, options.tune_stop_signals} {
  // Oclgrind's OpenCL runtime is not thread-safe (jrprice/Oclgrind#28, open): enqueues from
  // several flow-graph workers at once corrupt its command bookkeeping and crash it now and then
  // (seen in asyncQueueRetain). It runs commands inside clFlush and clFinish on the calling
  // thread, so with one thread every OpenCL call comes from one thread at a time. The limit is
  // process-wide and lasts as long as this runtime and its trainers.
  if (context->device().platform_name.find("Oclgrind") != std::string::npos) {
    one_thread = std::make_shared<tbb::global_control>(tbb::global_control::max_allowed_parallelism, 1);
  }
}

Runtime::Runtime(RuntimeOptions options) : options_(std::move(options)), shared_(std::make_shared<Shared>(options_)) {}

}  // namespace ferry
