// MaxPool2d binding (ops/kernels/pool.cl).
#include "ops/pool.hpp"

#include <fmt/format.h>

#include <limits>
#include <stdexcept>

namespace ferry::ops {
namespace {

void validate(const Pool2dShape& s) {
  if (s.window == 0 || s.stride == 0 || s.H < s.window || s.W < s.window) {
    throw std::invalid_argument(
        fmt::format("maxpool2d: window {} stride {} does not fit the input {}x{}", s.window, s.stride, s.H, s.W));
  }
  if (!dtype_is_float(s.dtype)) {
    throw std::invalid_argument(fmt::format("maxpool2d: dtype {}, expected f32, f16 or bf16", dtype_name(s.dtype)));
  }
  if (s.N * s.C * s.H * s.W > std::numeric_limits<std::uint32_t>::max()) {
    throw std::invalid_argument("maxpool2d: input over the 32-bit index limit");
  }
}

std::string defines(const Pool2dShape& s) {
  return fmt::format(
      "-DPOOL_H={} -DPOOL_W={} -DPOOL_P={} -DPOOL_Q={} -DPOOL_WINDOW={} -DPOOL_STRIDE={} -DPOOL_RELU={} {}", s.H, s.W,
      s.P(), s.Q(), s.window, s.stride, int(s.relu), dtype_define(s.dtype));
}

// 2x2 windows with stride 2 run as row kernels (maxpool2x2_*_rows in pool.cl), one work-item per
// output row.
bool by_rows(const Pool2dShape& s) {
  return s.window == 2 && s.stride == 2;
}

KernelLaunch rows_launch(cl::Kernel k, std::size_t rows) {
  KernelLaunch l;
  l.kernel = std::move(k);
  l.global[0] = round_up(std::max<std::size_t>(rows, 1), 16);
  l.local[0] = 16;
  return l;
}

}  // namespace

LaunchList maxpool2d_forward(OpEnv& env, const Pool2dShape& s, DeviceSpan x, DeviceSpan y, DeviceSpan argmax) {
  validate(s);
  const std::size_t t = dtype_bytes(s.dtype);
  LaunchList list;
  if (by_rows(s)) {
    const std::size_t rows = s.N * s.C * s.P();
    cl::Kernel k = env.kernels.kernel("pool", "maxpool2x2_forward_rows", defines(s));
    cl::set_args(k.get(), x.buffer, x.elem_offset(t), y.buffer, y.elem_offset(t), argmax.buffer, argmax.elem_offset(),
                 static_cast<cl_uint>(rows));
    list.push_back(rows_launch(std::move(k), rows));
    return list;
  }
  const std::size_t count = s.N * s.C * s.P() * s.Q();
  cl::Kernel k = env.kernels.kernel("pool", "maxpool2d_forward", defines(s));
  cl::set_args(k.get(), x.buffer, x.elem_offset(t), y.buffer, y.elem_offset(t), argmax.buffer, argmax.elem_offset(),
               static_cast<cl_uint>(count));
  list.push_back(elementwise_launch(std::move(k), count));
  return list;
}

LaunchList maxpool2d_backward(OpEnv& env, const Pool2dShape& s, DeviceSpan dy, DeviceSpan argmax, DeviceSpan dx) {
  validate(s);
  const std::size_t t = dtype_bytes(s.dtype);
  if (by_rows(s)) {
    const std::size_t rows = s.N * s.C * s.P();
    cl::Kernel k = env.kernels.kernel("pool", "maxpool2x2_backward_rows", defines(s));
    cl::set_args(k.get(), dy.buffer, dy.elem_offset(t), argmax.buffer, argmax.elem_offset(), dx.buffer,
                 dx.elem_offset(t), static_cast<cl_uint>(rows));
    LaunchList list;
    list.push_back(rows_launch(std::move(k), rows));
    return list;
  }
  const std::size_t count = s.N * s.C * s.H * s.W;
  cl::Kernel k = env.kernels.kernel("pool", "maxpool2d_backward", defines(s));
  cl::set_args(k.get(), dy.buffer, dy.elem_offset(t), argmax.buffer, argmax.elem_offset(), dx.buffer, dx.elem_offset(t),
               static_cast<cl_uint>(count));
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k), count));
  return list;
}

}  // namespace ferry::ops
