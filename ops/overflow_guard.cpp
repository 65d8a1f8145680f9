// Binding of the overflow guard kernels (ops/kernels/overflow_guard.cl).
#include "ops/overflow_guard.hpp"

#include "ferry/cl/error.hpp"

namespace ferry::ops {

LaunchList overflow_guard_init(OpEnv& env, DeviceSpan stats, DeviceSpan guard) {
  cl::Kernel k = env.kernels.kernel("overflow_guard", "overflow_guard_init");
  cl::set_args(k.get(), stats.buffer, stats.elem_offset(), guard.buffer, guard.elem_offset());
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k), 1));
  return list;
}

LaunchList overflow_guard_check(OpEnv& env, DeviceSpan gradient, std::size_t elems, DeviceSpan guard) {
  LaunchList list;
  if (elems == 0) return list;
  // CPU devices: 256 elements per work-item (kGuardChunk, GUARD_CHUNK in the kernel).
  constexpr std::size_t kGuardChunk = 256;
  const bool wide = env.device().is_cpu();
  cl::Kernel k = env.kernels.kernel("overflow_guard", wide ? "overflow_guard_check16" : "overflow_guard_check");
  cl::set_args(k.get(), gradient.buffer, gradient.elem_offset(), element_count("overflow_guard_check", elems),
               guard.buffer, guard.elem_offset());
  list.push_back(elementwise_launch(std::move(k), wide ? (elems + kGuardChunk - 1) / kGuardChunk : elems));
  return list;
}

}  // namespace ferry::ops
