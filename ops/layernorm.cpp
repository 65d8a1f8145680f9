// Binding of the LayerNorm kernels (ops/kernels/layernorm.cl).
#include "ops/layernorm.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>

#include "ferry/cl/error.hpp"
#include "ferry/ops/types.hpp"

namespace ferry::ops {
namespace {
void check_shape(std::size_t rows, std::size_t cols) {
  if (cols == 0) throw std::invalid_argument("layernorm: cols must be positive");
  if (rows * cols > std::numeric_limits<cl_uint>::max())
    throw std::invalid_argument("layernorm: more than 2^32-1 elements");
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
                             DeviceSpan rstd, std::size_t rows, std::size_t cols, float eps, DeviceSpan a, DeviceSpan b,
                             DType y_dtype, DType b_dtype) {
  if ((a.buffer == nullptr) != (b.buffer == nullptr)) {
    throw std::invalid_argument("layernorm: a residual sum needs both of its operands");
  }
  for (const DType t : {y_dtype, b_dtype}) {
    if (t != DType::f32 && t != DType::f16 && t != DType::bf16) {
      throw std::invalid_argument(fmt::format("layernorm: y and b are f32, f16 or bf16, not {}", dtype_name(t)));
    }
  }
  check_shape(rows, cols);
  LaunchList list;
  if (rows == 0) return list;
  // f32's program is the one built without a define, shared with the backward kernels.
  const std::string y_define = y_dtype == DType::f32 ? "" : dtype_define(y_dtype, "D");
  const std::string b_define = b_dtype == DType::f32 ? "" : dtype_define(b_dtype, "S");
  const std::string defines =
      y_define.empty() || b_define.empty() ? y_define + b_define : fmt::format("{} {}", y_define, b_define);
  const std::uint64_t y_off = y.elem_offset(dtype_bytes(y_dtype)), b_off = b.elem_offset(dtype_bytes(b_dtype));
  if (env.device().is_cpu()) {  // a work-item per row, in float16 chunks (layernorm_forward16)
    cl::Kernel k = env.kernels.kernel("layernorm", "layernorm_forward16", defines);
    cl::set_args(k.get(), x.buffer, x.elem_offset(), gamma.buffer, gamma.elem_offset(), beta.buffer, beta.elem_offset(),
                 y.buffer, y_off, mean.buffer, mean.elem_offset(), rstd.buffer, rstd.elem_offset(), cl_uint(rows),
                 cl_uint(cols), eps, a.buffer, a.elem_offset(), b.buffer, b_off);
    list.push_back(elementwise_launch(std::move(k), rows));
    return list;
  }
  cl::Kernel k = env.kernels.kernel("layernorm", "layernorm_forward", defines);
  const std::size_t local = row_group_size(k, env.device(), cols);
  cl::set_args(k.get(), x.buffer, x.elem_offset(), gamma.buffer, gamma.elem_offset(), beta.buffer, beta.elem_offset(),
               y.buffer, y_off, mean.buffer, mean.elem_offset(), rstd.buffer, rstd.elem_offset(), cl_uint(cols), eps,
               cl::LocalBytes{local * sizeof(float)});
  set_nullable_arg(k, 15, a);
  const cl_ulong b_arg = b_off;  // in elements of b's dtype (set_nullable_arg counts floats)
  FERRY_CL(clSetKernelArg(k.get(), 17, sizeof(cl_mem), &b.buffer));
  FERRY_CL(clSetKernelArg(k.get(), 18, sizeof(cl_ulong), &b_arg));
  list.push_back(per_row_launch(std::move(k), rows, local));
  return list;
}

LaunchList layernorm_backward(OpEnv& env, DeviceSpan x, DeviceSpan gamma, DeviceSpan mean, DeviceSpan rstd,
                              DeviceSpan dy, DeviceSpan dx, DeviceSpan dgamma, DeviceSpan dbeta, std::size_t rows,
                              std::size_t cols, DeviceSpan dres, DeviceSpan guard) {
  check_shape(rows, cols);
  LaunchList list;
  if (env.device().is_cpu()) {  // float16 chunks: a work-item per row (dx), per 16 columns (params)
    if (rows > 0) {
      cl::Kernel k = env.kernels.kernel("layernorm", "layernorm_backward_dx16");
      cl::set_args(k.get(), x.buffer, x.elem_offset(), gamma.buffer, gamma.elem_offset(), mean.buffer,
                   mean.elem_offset(), rstd.buffer, rstd.elem_offset(), dy.buffer, dy.elem_offset(), dx.buffer,
                   dx.elem_offset(), cl_uint(rows), cl_uint(cols), dres.buffer, dres.elem_offset());
      list.push_back(elementwise_launch(std::move(k), rows));
    }
    cl::Kernel kp = env.kernels.kernel("layernorm", "layernorm_backward_params16");
    cl::set_args(kp.get(), x.buffer, x.elem_offset(), mean.buffer, mean.elem_offset(), rstd.buffer, rstd.elem_offset(),
                 dy.buffer, dy.elem_offset(), dgamma.buffer, dgamma.elem_offset(), dbeta.buffer, dbeta.elem_offset(),
                 cl_uint(rows), cl_uint(cols));
    set_nullable_arg(kp, 14, guard);
    list.push_back(elementwise_launch(std::move(kp), (cols + 15) / 16));
    return list;
  }
  if (rows > 0) {
    cl::Kernel k = env.kernels.kernel("layernorm", "layernorm_backward_dx");
    const std::size_t local = row_group_size(k, env.device(), cols);
    cl::set_args(k.get(), x.buffer, x.elem_offset(), gamma.buffer, gamma.elem_offset(), mean.buffer, mean.elem_offset(),
                 rstd.buffer, rstd.elem_offset(), dy.buffer, dy.elem_offset(), dx.buffer, dx.elem_offset(),
                 cl_uint(cols), cl::LocalBytes{local * sizeof(float)});
    set_nullable_arg(k, 14, dres);
    list.push_back(per_row_launch(std::move(k), rows, local));
  }

  // Column sums: 16 columns by 16 row lanes per work-group, fewer lanes where the kernel allows less.
  cl::Kernel kp = env.kernels.kernel("layernorm", "layernorm_backward_params");
  std::size_t tc = 16, tr = 16;
  const std::size_t limit = kernel_group_limit(kp, env.device());
  while (tc * tr > limit && tr > 1) tr /= 2;
  while (tc * tr > limit && tc > 1) tc /= 2;
  cl::set_args(kp.get(), x.buffer, x.elem_offset(), mean.buffer, mean.elem_offset(), rstd.buffer, rstd.elem_offset(),
               dy.buffer, dy.elem_offset(), dgamma.buffer, dgamma.elem_offset(), dbeta.buffer, dbeta.elem_offset(),
               cl_uint(rows), cl_uint(cols), cl::LocalBytes{tc * tr * sizeof(float)},
               cl::LocalBytes{tc * tr * sizeof(float)});
  set_nullable_arg(kp, 16, guard);
  KernelLaunch l;
  l.kernel = std::move(kp);
  l.dims = 2;
  l.global = {round_up(cols, tc), tr, 1};
  l.local = {tc, tr, 1};
  list.push_back(std::move(l));
  return list;
}

}  // namespace ferry::ops
