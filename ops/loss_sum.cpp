// Binding of the weighted loss sum (ops/kernels/loss_sum.cl).
#include "ops/loss_sum.hpp"

namespace ferry::ops {

LaunchList loss_sum(OpEnv& env, DeviceSpan a, DeviceSpan b, DeviceSpan out, float wa, float wb) {
  cl::Kernel k = env.kernels.kernel("loss_sum", "loss_sum");
  cl::set_args(k.get(), a.buffer, a.elem_offset(), b.buffer, b.elem_offset(), out.buffer, out.elem_offset(), wa, wb);
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k), 1));
  return list;
}

}  // namespace ferry::ops
