// Binding of the gradient accumulation kernels (ops/kernels/accumulate.cl).
#include "ops/accumulate.hpp"

#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

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

namespace {

// Ranges of 64 Ki elements: a 1B model's largest gradients split over every core, a small one's
// run where it is.
template <class Body>
void over_ranges(std::size_t n, const Body& body) {
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, std::size_t{1} << 16),
                    [&](const tbb::blocked_range<std::size_t>& r) { body(r.begin(), r.end()); });
}

}  // namespace

void grad_accumulate_host(const float* acc, const float* g, float* acc_out, std::size_t n, float keep) {
  over_ranges(n, [&](std::size_t begin, std::size_t end) {
    // keep == 0 must not turn a stale NaN or Inf in acc into NaN: select, not multiply (as the kernel).
    if (keep != 0.0f) {
      for (std::size_t i = begin; i < end; ++i) acc_out[i] = acc[i] + g[i];
    } else {
      for (std::size_t i = begin; i < end; ++i) acc_out[i] = 0.0f + g[i];
    }
  });
}

void grad_mean_host(const float* acc, const float* g, float* g_out, std::size_t n, float inv_k) {
  over_ranges(n, [&](std::size_t begin, std::size_t end) {
    for (std::size_t i = begin; i < end; ++i) g_out[i] = (acc[i] + g[i]) * inv_k;
  });
}

}  // namespace ferry::ops
