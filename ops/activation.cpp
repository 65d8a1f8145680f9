// Binding of the activation kernels (ops/kernels/activation.cl).
#include "ferry/ops/activation.hpp"

#include <fmt/format.h>

#include <limits>
#include <stdexcept>

namespace ferry::ops {
namespace {
const char* kernel_name(Activation a, bool backward) {
  switch (a) {
    case Activation::relu:
      return backward ? "relu_backward" : "relu_forward";
    case Activation::gelu:
      return backward ? "gelu_backward" : "gelu_forward";
  }
  throw std::invalid_argument("unknown activation");
}

// The kernel for (a, direction), built for `dtype`; throws for a dtype the kernels do not take.
cl::Kernel typed_kernel(OpEnv& env, Activation a, bool backward, DType dtype, std::size_t n) {
  const char* name = kernel_name(a, backward);
  if (!activation_dtypes.contains(dtype)) {
    throw std::invalid_argument(fmt::format("{}: dtype {} is not supported (activations take {})", name,
                                            dtype_name(dtype), activation_dtypes.str()));
  }
  if (n > std::numeric_limits<cl_uint>::max()) {
    throw std::invalid_argument(fmt::format("{}: {} elements, more than 2^32-1", name, n));
  }
  return env.kernels.kernel("activation", name, dtype_define(dtype));
}
}  // namespace

// GELU in f32 on a CPU device runs 16 elements per work-item (gelu_forward16 and
// gelu_backward16 in activation.cl).
static bool vector_gelu(OpEnv& env, Activation a, DType dtype) {
  return a == Activation::gelu && dtype == DType::f32 && env.device().is_cpu();
}

LaunchList activation_forward(OpEnv& env, Activation a, DeviceSpan x, DeviceSpan y, std::size_t n, DType dtype) {
  if (vector_gelu(env, a, dtype)) {
    typed_kernel(env, a, false, dtype, n);  // checks n
    cl::Kernel k = env.kernels.kernel("activation", "gelu_forward16", dtype_define(dtype));
    cl::set_args(k.get(), x.buffer, x.elem_offset(), y.buffer, y.elem_offset(), static_cast<cl_uint>(n));
    LaunchList list;
    list.push_back(elementwise_launch(std::move(k), (n + 15) / 16));
    return list;
  }
  cl::Kernel k = typed_kernel(env, a, false, dtype, n);
  const std::size_t bytes = dtype_bytes(dtype);
  cl::set_args(k.get(), x.buffer, x.elem_offset(bytes), y.buffer, y.elem_offset(bytes), static_cast<cl_uint>(n));
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k), n));
  return list;
}

LaunchList activation_backward(OpEnv& env, Activation a, DeviceSpan x, DeviceSpan dy, DeviceSpan dx, std::size_t n,
                               DType dtype) {
  if (vector_gelu(env, a, dtype)) {
    typed_kernel(env, a, true, dtype, n);  // checks n
    cl::Kernel k = env.kernels.kernel("activation", "gelu_backward16", dtype_define(dtype));
    cl::set_args(k.get(), x.buffer, x.elem_offset(), dy.buffer, dy.elem_offset(), dx.buffer, dx.elem_offset(),
                 static_cast<cl_uint>(n));
    LaunchList list;
    list.push_back(elementwise_launch(std::move(k), (n + 15) / 16));
    return list;
  }
  cl::Kernel k = typed_kernel(env, a, true, dtype, n);
  const std::size_t bytes = dtype_bytes(dtype);
  cl::set_args(k.get(), x.buffer, x.elem_offset(bytes), dy.buffer, dy.elem_offset(bytes), dx.buffer,
               dx.elem_offset(bytes), static_cast<cl_uint>(n));
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k), n));
  return list;
}

}  // namespace ferry::ops
