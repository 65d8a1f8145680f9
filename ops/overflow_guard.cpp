// Binding of the overflow guard kernels (ops/kernels/overflow_guard.cl).
#include "ferry/ops/overflow_guard.hpp"

#include <stdexcept>

#include "ferry/cl/error.hpp"

namespace ferry::ops {

LaunchList overflow_guard(OpEnv& env, DeviceSpan stats, std::span<const DeviceSpan> gradients,
                          std::span<const std::size_t> elems, DeviceSpan guard) {
  if (gradients.size() != elems.size()) throw std::invalid_argument("overflow_guard: one element count per gradient");
  LaunchList list;
  cl::Kernel init = env.kernels.kernel("overflow_guard", "overflow_guard_init");
  cl::set_args(init.get(), stats.buffer, stats.elem_offset(), guard.buffer, guard.elem_offset());
  list.push_back(elementwise_launch(std::move(init), 1));
  for (std::size_t i = 0; i < gradients.size(); ++i) {
    if (elems[i] == 0) continue;
    cl::Kernel k = env.kernels.kernel("overflow_guard", "overflow_guard_check");
    cl::set_args(k.get(), gradients[i].buffer, gradients[i].elem_offset(), element_count("overflow_guard", elems[i]),
                 guard.buffer, guard.elem_offset());
    list.push_back(elementwise_launch(std::move(k), elems[i]));
  }
  return list;
}

}  // namespace ferry::ops
