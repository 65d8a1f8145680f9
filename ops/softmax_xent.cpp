// Binding of the fused softmax + cross-entropy kernels (ops/kernels/softmax_xent.cl).
#include "ops/softmax_xent.hpp"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <stdexcept>

#include "ferry/cl/error.hpp"

namespace ferry::ops {
namespace {
void check_shape(std::size_t rows, std::size_t classes) {
  if (rows == 0 || classes == 0) throw std::invalid_argument("softmax_xent: rows and classes must be positive");
  if (rows * classes > std::numeric_limits<cl_uint>::max() ||
      classes > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
    throw std::invalid_argument("softmax_xent: more than 2^32-1 elements");
}

}  // namespace

LaunchList softmax_xent_forward(OpEnv& env, DeviceSpan logits, DeviceSpan labels, DeviceSpan lse, DeviceSpan stats,
                                std::size_t rows, std::size_t classes) {
  check_shape(rows, classes);
  LaunchList list;

  if (env.device().is_cpu() && !row_group_forced()) {  // a row per work-item, 16 classes at a time
    cl::Kernel k = env.kernels.kernel("softmax_xent", "softmax_xent_lse16");
    cl::set_args(k.get(), logits.buffer, logits.elem_offset(), lse.buffer, lse.elem_offset(), cl_uint(rows),
                 cl_uint(classes));
    list.push_back(elementwise_launch(std::move(k), rows));
  } else {
    cl::Kernel kl = env.kernels.kernel("softmax_xent", "softmax_xent_lse");
    const std::size_t ll = row_group_size(kl, env.device(), classes);
    cl::set_args(kl.get(), logits.buffer, logits.elem_offset(), lse.buffer, lse.elem_offset(), cl_uint(classes),
                 cl::LocalBytes{ll * sizeof(float)});
    KernelLaunch lse_launch;
    lse_launch.kernel = std::move(kl);
    lse_launch.global[0] = rows * ll;
    lse_launch.local[0] = ll;
    list.push_back(std::move(lse_launch));
  }

  cl::Kernel ks = env.kernels.kernel("softmax_xent", "softmax_xent_stats");
  const std::size_t ls = row_group_size(ks, env.device(), rows);
  cl::set_args(ks.get(), logits.buffer, logits.elem_offset(), lse.buffer, lse.elem_offset(), labels.buffer,
               labels.elem_offset(), stats.buffer, stats.elem_offset(), cl_uint(rows), cl_uint(classes),
               cl::LocalBytes{ls * sizeof(float)});
  KernelLaunch stats_launch;
  stats_launch.kernel = std::move(ks);
  stats_launch.global[0] = ls;
  stats_launch.local[0] = ls;
  list.push_back(std::move(stats_launch));
  return list;
}

LaunchList softmax_xent_backward(OpEnv& env, DeviceSpan logits, DeviceSpan lse, DeviceSpan labels, DeviceSpan dlogits,
                                 std::size_t rows, std::size_t classes, float scale) {
  check_shape(rows, classes);
  // CPU devices: a work-item per row and 16 classes (softmax_xent_backward16).
  const bool wide = env.device().is_cpu();
  cl::Kernel k = env.kernels.kernel("softmax_xent", wide ? "softmax_xent_backward16" : "softmax_xent_backward");
  const float coef = static_cast<float>(static_cast<double>(scale) / static_cast<double>(rows));
  cl::set_args(k.get(), logits.buffer, logits.elem_offset(), lse.buffer, lse.elem_offset(), labels.buffer,
               labels.elem_offset(), dlogits.buffer, dlogits.elem_offset(), cl_uint(rows), cl_uint(classes), coef);
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k), wide ? rows * ((classes + 15) / 16) : rows * classes));
  return list;
}

}  // namespace ferry::ops
