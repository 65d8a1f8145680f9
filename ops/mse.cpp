// Binding of the mean squared error kernels (ops/kernels/mse.cl).
#include "ops/mse.hpp"

#include <limits>
#include <stdexcept>

#include "ferry/cl/error.hpp"

namespace ferry::ops {
namespace {
void check_count(std::size_t n) {
  if (n == 0) throw std::invalid_argument("mse: the mean of no elements is undefined (n = 0)");
  if (n > std::numeric_limits<cl_uint>::max()) throw std::invalid_argument("mse: more than 2^32-1 elements");
}

}  // namespace

LaunchList mse_forward(OpEnv& env, DeviceSpan p, DeviceSpan t, DeviceSpan stats, std::size_t n) {
  check_count(n);
  cl::Kernel k = env.kernels.kernel("mse", "mse_forward");
  const std::size_t local = row_group_size(k, env.device(), n);
  cl::set_args(k.get(), p.buffer, p.elem_offset(), t.buffer, t.elem_offset(), stats.buffer, stats.elem_offset(),
               cl_uint(n), cl::LocalBytes{local * sizeof(float)});
  KernelLaunch l;
  l.kernel = std::move(k);
  l.global[0] = local;
  l.local[0] = local;
  LaunchList list;
  list.push_back(std::move(l));
  return list;
}

LaunchList mse_backward(OpEnv& env, DeviceSpan p, DeviceSpan t, DeviceSpan dp, std::size_t n, float scale) {
  check_count(n);
  cl::Kernel k = env.kernels.kernel("mse", "mse_backward");
  // scale 2 / n rounded once, from double.
  const auto coef = static_cast<float>(2.0 * static_cast<double>(scale) / static_cast<double>(n));
  cl::set_args(k.get(), p.buffer, p.elem_offset(), t.buffer, t.elem_offset(), dp.buffer, dp.elem_offset(), cl_uint(n),
               coef);
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k), n));
  return list;
}

}  // namespace ferry::ops
