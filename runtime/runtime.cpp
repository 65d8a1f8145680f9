// Runtime: device selection and the objects every compiled step shares.
#include "ferry/runtime/runtime.hpp"

#include <tbb/global_control.h>

namespace ferry {

Runtime::Shared::Shared(const RuntimeOptions& options)
    : context(std::make_unique<cl::Context>(cl::select_device(options.device, options.local_rank),
                                            cl::ContextOptions{.profiling = options.profiling})),
      kernels(std::make_unique<cl::KernelLibrary>(*context)),
      env{*kernels} {
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
