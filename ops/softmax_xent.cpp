// Binding of the fused softmax + cross-entropy kernels (ops/kernels/softmax_xent.cl).
#include "ferry/ops/softmax_xent.hpp"

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

// Local size for a per-row reduction over `extent` elements (a power of two). FERRY_ROW_GROUP_SIZE
// forces one (tests use it to cover the work-group path on any device). Otherwise: on CPU devices
// a work-item per row (local size 1), which is 3-6x faster on PoCL than a work-group per row
// whose barriers become loops over the work-items; on GPUs a work-group per row, no larger than
// the row needs and at most 256. Always within what the compiled kernel allows.
std::size_t row_group_size(const cl::Kernel& k, const cl::DeviceInfo& device, std::size_t extent) {
  std::size_t limit = 0;
  FERRY_CL(clGetKernelWorkGroupInfo(k.get(), device.id, CL_KERNEL_WORK_GROUP_SIZE, sizeof(limit), &limit, nullptr));
  if (device.max_work_group_size != 0) limit = std::min(limit, device.max_work_group_size);
  // The smallest power of two covering `want`, within `cap` and the kernel's limit.
  std::size_t want = device.is_cpu() ? 1 : extent, cap = 256;
  if (const char* forced = std::getenv("FERRY_ROW_GROUP_SIZE"); forced && *forced)
    want = cap = std::strtoull(forced, nullptr, 10);
  cap = std::min(cap, limit);
  std::size_t size = 1;
  while (size * 2 <= cap && size < want) size *= 2;
  return size;
}
}  // namespace

LaunchList softmax_xent_forward(OpEnv& env, DeviceSpan logits, DeviceSpan labels, DeviceSpan probs, DeviceSpan stats,
                                std::size_t rows, std::size_t classes) {
  check_shape(rows, classes);
  LaunchList list;

  cl::Kernel kp = env.kernels.kernel("softmax_xent", "softmax_xent_probs");
  const std::size_t lp = row_group_size(kp, env.device(), classes);
  cl::set_args(kp.get(), logits.buffer, logits.offset, probs.buffer, probs.offset, cl_uint(classes));
  FERRY_CL(clSetKernelArg(kp.get(), 5, lp * sizeof(float), nullptr));
  KernelLaunch probs_launch;
  probs_launch.kernel = std::move(kp);
  probs_launch.global[0] = rows * lp;
  probs_launch.local[0] = lp;
  list.push_back(std::move(probs_launch));

  cl::Kernel ks = env.kernels.kernel("softmax_xent", "softmax_xent_stats");
  const std::size_t ls = row_group_size(ks, env.device(), rows);
  cl::set_args(ks.get(), logits.buffer, logits.offset, probs.buffer, probs.offset, labels.buffer, labels.offset,
               stats.buffer, stats.offset, cl_uint(rows), cl_uint(classes));
  FERRY_CL(clSetKernelArg(ks.get(), 10, ls * sizeof(float), nullptr));
  KernelLaunch stats_launch;
  stats_launch.kernel = std::move(ks);
  stats_launch.global[0] = ls;
  stats_launch.local[0] = ls;
  list.push_back(std::move(stats_launch));
  return list;
}

LaunchList softmax_xent_backward(OpEnv& env, DeviceSpan probs, DeviceSpan labels, DeviceSpan dlogits, std::size_t rows,
                                 std::size_t classes, float scale) {
  check_shape(rows, classes);
  cl::Kernel k = env.kernels.kernel("softmax_xent", "softmax_xent_backward");
  const float coef = static_cast<float>(static_cast<double>(scale) / static_cast<double>(rows));
  cl::set_args(k.get(), probs.buffer, probs.offset, labels.buffer, labels.offset, dlogits.buffer, dlogits.offset,
               cl_uint(rows), cl_uint(classes), coef);
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k), rows * classes));
  return list;
}

}  // namespace ferry::ops
