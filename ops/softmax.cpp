// Binding of the softmax kernels (ops/kernels/softmax.cl).
#include "ops/softmax.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <stdexcept>

#include "ferry/cl/error.hpp"

namespace ferry::ops {
namespace {

void check_shape(const char* what, std::size_t cols) {
  if (cols == 0) throw std::invalid_argument(fmt::format("{}: the last axis must not be empty", what));
  if (cols > std::numeric_limits<cl_uint>::max()) {
    throw std::invalid_argument(fmt::format("{}: a row of {} elements is more than 2^32-1", what, cols));
  }
}

// The kernel and its local size: a work-item per row (CPU devices) takes its row in float16
// chunks (VW=16); a work-group per row spreads the columns over its work-items (VW=1).
std::pair<cl::Kernel, std::size_t> row_kernel(OpEnv& env, const char* name, std::size_t cols) {
  if (env.device().is_cpu()) {
    cl::Kernel k = env.kernels.kernel("softmax", name, "-DVW=16");
    const std::size_t local = row_group_size(k, env.device(), cols);
    if (local == 1) return {std::move(k), local};
  }
  cl::Kernel k = env.kernels.kernel("softmax", name, "-DVW=1");
  const std::size_t local = row_group_size(k, env.device(), cols);
  return {std::move(k), local};
}

KernelLaunch per_row_launch(cl::Kernel k, std::size_t rows, std::size_t local) {
  KernelLaunch l;
  l.kernel = std::move(k);
  l.global[0] = rows * local;
  l.local[0] = local;
  return l;
}

}  // namespace

LaunchList softmax_forward(OpEnv& env, DeviceSpan x, DeviceSpan y, std::size_t rows, std::size_t cols, bool causal) {
  cl::OpScope scope("softmax");
  check_shape("softmax", cols);
  LaunchList list;
  if (rows == 0) return list;
  auto [k, local] = row_kernel(env, "softmax_forward", cols);
  cl::set_args(k.get(), x.buffer, x.elem_offset(), y.buffer, y.elem_offset(), cl_uint(cols), cl_uint(causal ? cols : 0),
               cl::LocalBytes{local * sizeof(float)});
  list.push_back(per_row_launch(std::move(k), rows, local));
  return list;
}

LaunchList softmax_backward(OpEnv& env, DeviceSpan y, DeviceSpan dy, DeviceSpan dx, std::size_t rows,
                            std::size_t cols) {
  cl::OpScope scope("softmax_grad");
  check_shape("softmax_grad", cols);
  LaunchList list;
  if (rows == 0) return list;
  auto [k, local] = row_kernel(env, "softmax_backward", cols);
  cl::set_args(k.get(), y.buffer, y.elem_offset(), dy.buffer, dy.elem_offset(), dx.buffer, dx.elem_offset(),
               cl_uint(cols), cl::LocalBytes{local * sizeof(float)});
  list.push_back(per_row_launch(std::move(k), rows, local));
  return list;
}

}  // namespace ferry::ops
