// Binding of the bias kernels (ops/kernels/bias.cl).
#include "ops/bias.hpp"

#include <fmt/format.h>

#include <limits>
#include <stdexcept>

#include "ferry/cl/error.hpp"

namespace ferry::ops {
namespace {
void check_shape(std::size_t rows, std::size_t cols) {
  if (rows * cols > std::numeric_limits<cl_uint>::max()) throw std::invalid_argument("bias: more than 2^32-1 elements");
}

}  // namespace

LaunchList bias_forward(OpEnv& env, DeviceSpan y, DeviceSpan b, std::size_t rows, std::size_t cols) {
  check_shape(rows, cols);
  cl::Kernel k = env.kernels.kernel("bias", "bias_forward");
  cl::set_args(k.get(), y.buffer, y.elem_offset(), b.buffer, b.elem_offset(), cl_uint(rows), cl_uint(cols));
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k), rows * cols));
  return list;
}

LaunchList bias_backward(OpEnv& env, DeviceSpan dy, DeviceSpan db, std::size_t rows, std::size_t cols, DType dy_type,
                         DeviceSpan guard) {
  check_shape(rows, cols);
  if (!dtype_is_float(dy_type)) {
    throw std::invalid_argument(
        fmt::format("bias_backward: dy of dtype {}, expected f32, f16 or bf16", dtype_name(dy_type)));
  }
  const std::string defines = dtype_define(dy_type);
  const std::uint64_t dy_off = dy.elem_offset(dtype_bytes(dy_type));
  if (env.device().is_cpu()) {  // 16 columns per work-item (bias_backward16)
    cl::Kernel k = env.kernels.kernel("bias", "bias_backward16", defines);
    cl::set_args(k.get(), dy.buffer, dy_off, db.buffer, db.elem_offset(), cl_uint(rows), cl_uint(cols));
    set_nullable_arg(k, 6, guard);
    LaunchList list;
    // One work-item per work-group: with the elementwise launch's groups of 64 the 48 work-items of
    // 768 columns were one group, summed by one core while the other idled (the GPT's 25 bias
    // gradients took 14 ms of a 550 ms step on the 2-vCPU EPYC).
    KernelLaunch l;
    l.kernel = std::move(k);
    l.global[0] = (cols + 15) / 16;
    l.local[0] = 1;
    list.push_back(std::move(l));
    return list;
  }
  cl::Kernel k = env.kernels.kernel("bias", "bias_backward", defines);
  const auto [tc, tr] = column_group_size(k, env.device());
  cl::set_args(k.get(), dy.buffer, dy_off, db.buffer, db.elem_offset(), cl_uint(rows), cl_uint(cols),
               cl::LocalBytes{tc * tr * sizeof(float)});
  set_nullable_arg(k, 7, guard);
  KernelLaunch l;
  l.kernel = std::move(k);
  l.dims = 2;
  l.global = {round_up(cols == 0 ? 1 : cols, tc), tr, 1};
  l.local = {tc, tr, 1};
  LaunchList list;
  list.push_back(std::move(l));
  return list;
}

}  // namespace ferry::ops
