// Binding of the gradient accumulation kernels (ops/kernels/accumulate.cl).
#include "ops/accumulate.hpp"

#include <fmt/format.h>

#include <limits>
#include <stdexcept>

#include "ferry/cl/error.hpp"

namespace ferry::ops {
LaunchList grad_accumulate(OpEnv& env, DeviceSpan acc, DeviceSpan g, std::size_t n, DeviceSpan guard) {
  cl::Kernel k = env.kernels.kernel("accumulate", "grad_accumulate");
  cl::set_args(k.get(), acc.buffer, acc.elem_offset(), g.buffer, g.elem_offset(),
               element_count("gradient accumulation", n), guard.buffer ? guard.buffer : acc.buffer,
               guard.buffer ? guard.elem_offset() : 0, cl_uint(guard.buffer ? 1 : 0), 1.0f);
  KernelLaunch l = elementwise_launch(std::move(k), n);
  l.per_step = [](cl_kernel kernel, const StepInfo& s) {
    cl::check(clSetKernelArg(kernel, 8, sizeof(float), &s.accumulate_keep), "clSetKernelArg(grad_accumulate keep)");
  };
  LaunchList list;
  list.push_back(std::move(l));
  return list;
}

LaunchList grad_mean(OpEnv& env, DeviceSpan acc, DeviceSpan g, std::size_t n, float inv_k) {
  cl::Kernel k = env.kernels.kernel("accumulate", "grad_mean");
  cl::set_args(k.get(), acc.buffer, acc.elem_offset(), g.buffer, g.elem_offset(),
               element_count("gradient accumulation", n), inv_k);
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k), n));
  return list;
}

}  // namespace ferry::ops
