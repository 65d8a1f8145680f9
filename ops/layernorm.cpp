// Binding of the LayerNorm kernels (ops/kernels/layernorm.cl).
#include "ferry/ops/layernorm.hpp"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <stdexcept>

#include "ferry/cl/error.hpp"

namespace ferry::ops {
namespace {
void check_shape(std::size_t rows, std::size_t cols) {
  if (cols == 0) throw std::invalid_argument("layernorm: cols must be positive");
  if (rows * cols > std::numeric_limits<cl_uint>::max())
    throw std::invalid_argument("layernorm: more than 2^32-1 elements");
}

std::size_t kernel_group_limit(const cl::Kernel& k, const cl::DeviceInfo& device) {
  std::size_t limit = 0;
  FERRY_CL(clGetKernelWorkGroupInfo(k.get(), device.id, CL_KERNEL_WORK_GROUP_SIZE, sizeof(limit), &limit, nullptr));
  return std::max<std::size_t>(1,
                               std::min(limit, device.max_work_group_size == 0 ? limit : device.max_work_group_size));
}

// Local size for a per-row reduction over `extent` elements (a power of two). FERRY_ROW_GROUP_SIZE
// forces one (tests use it to cover the work-group path on any device). Otherwise: on CPU devices
// a work-item per row (local size 1), which is 3-6x faster on PoCL than a work-group per row
// whose barriers become loops over the work-items; on GPUs a work-group per row, no larger than
// the row needs and at most 256. Always within what the compiled kernel allows.
std::size_t row_group_size(const cl::Kernel& k, const cl::DeviceInfo& device, std::size_t extent) {
  const std::size_t limit = kernel_group_limit(k, device);
  // The smallest power of two covering `want`, within `cap` and the kernel's limit.
  std::size_t want = device.is_cpu() ? 1 : extent, cap = 256;
  if (const char* forced = std::getenv("FERRY_ROW_GROUP_SIZE"); forced && *forced)
    want = cap = std::strtoull(forced, nullptr, 10);
  cap = std::min(cap, limit);
  std::size_t size = 1;
  while (size * 2 <= cap && size < want) size *= 2;
  return size;
}

KernelLaunch per_row_launch(cl::Kernel k, std::size_t rows, std::size_t local) {
  KernelLaunch l;
  l.kernel = std::move(k);
  l.global[0] = std::max<std::size_t>(rows, 1) * local;
  l.local[0] = local;
  return l;
}
}  // namespace

LaunchList layernorm_forward(OpEnv& env, DeviceSpan x, DeviceSpan gamma, DeviceSpan beta, DeviceSpan y, DeviceSpan mean,
                             DeviceSpan rstd, std::size_t rows, std::size_t cols, float eps) {
  check_shape(rows, cols);
  LaunchList list;
  if (rows == 0) return list;
  cl::Kernel k = env.kernels.kernel("layernorm", "layernorm_forward");
  const std::size_t local = row_group_size(k, env.device(), cols);
  cl::set_args(k.get(), x.buffer, x.offset, gamma.buffer, gamma.offset, beta.buffer, beta.offset, y.buffer, y.offset,
               mean.buffer, mean.offset, rstd.buffer, rstd.offset, cl_uint(cols), eps);
  FERRY_CL(clSetKernelArg(k.get(), 14, local * sizeof(float), nullptr));
  list.push_back(per_row_launch(std::move(k), rows, local));
  return list;
}

LaunchList layernorm_backward(OpEnv& env, DeviceSpan x, DeviceSpan gamma, DeviceSpan mean, DeviceSpan rstd,
                              DeviceSpan dy, DeviceSpan dx, DeviceSpan dgamma, DeviceSpan dbeta, std::size_t rows,
                              std::size_t cols) {
  check_shape(rows, cols);
  LaunchList list;
  if (rows > 0) {
    cl::Kernel k = env.kernels.kernel("layernorm", "layernorm_backward_dx");
    const std::size_t local = row_group_size(k, env.device(), cols);
    cl::set_args(k.get(), x.buffer, x.offset, gamma.buffer, gamma.offset, mean.buffer, mean.offset, rstd.buffer,
                 rstd.offset, dy.buffer, dy.offset, dx.buffer, dx.offset, cl_uint(cols));
    FERRY_CL(clSetKernelArg(k.get(), 13, local * sizeof(float), nullptr));
    list.push_back(per_row_launch(std::move(k), rows, local));
  }

  // Column sums: 16 columns by 16 row lanes per work-group, fewer lanes where the kernel allows less.
  cl::Kernel kp = env.kernels.kernel("layernorm", "layernorm_backward_params");
  std::size_t tc = 16, tr = 16;
  const std::size_t limit = kernel_group_limit(kp, env.device());
  while (tc * tr > limit && tr > 1) tr /= 2;
  while (tc * tr > limit && tc > 1) tc /= 2;
  cl::set_args(kp.get(), x.buffer, x.offset, mean.buffer, mean.offset, rstd.buffer, rstd.offset, dy.buffer, dy.offset,
               dgamma.buffer, dgamma.offset, dbeta.buffer, dbeta.offset, cl_uint(rows), cl_uint(cols));
  FERRY_CL(clSetKernelArg(kp.get(), 14, tc * tr * sizeof(float), nullptr));
  FERRY_CL(clSetKernelArg(kp.get(), 15, tc * tr * sizeof(float), nullptr));
  KernelLaunch l;
  l.kernel = std::move(kp);
  l.dims = 2;
  l.global = {round_up(cols, tc), tr, 1};
  l.local = {tc, tr, 1};
  list.push_back(std::move(l));
  return list;
}

}  // namespace ferry::ops
