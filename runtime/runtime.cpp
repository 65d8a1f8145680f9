// Runtime: device selection and the objects every compiled step shares.
#include "ferry/runtime/runtime.hpp"

namespace ferry {

Runtime::Runtime(RuntimeOptions options)
    : options_(std::move(options)),
      context_(std::make_unique<cl::Context>(cl::select_device(options_.device),
                                             cl::ContextOptions{.profiling = options_.profiling})),
      kernels_(std::make_unique<cl::KernelLibrary>(*context_)),
      env_{*kernels_} {}

}  // namespace ferry
