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

// The kernel for (a, direction), built for `dtype`, and how many work-items cover n elements.
// GELU on a CPU device runs 16 elements per work-item (gelu_forward16 and gelu_backward16 in
// activation.cl: PoCL's vector exp is about ten times faster than 16 scalar ones), in any dtype. Throws for
// a dtype the kernels do not take.
struct TypedKernel {
  cl::Kernel kernel;
  std::size_t items;
};
TypedKernel typed_kernel(OpEnv& env, Activation a, bool backward, DType dtype, std::size_t n) {
  const char* name = kernel_name(a, backward);
  if (!activation_dtypes.contains(dtype)) {
    throw std::invalid_argument(fmt::format("{}: dtype {} is not supported (activations take {})", name,
                                            dtype_name(dtype), activation_dtypes.str()));
  }
  if (n > std::numeric_limits<cl_uint>::max()) {
    throw std::invalid_argument(fmt::format("{}: {} elements, more than 2^32-1", name, n));
  }
  if (a == Activation::gelu && env.device().is_cpu()) {
    return {env.kernels.kernel("activation", backward ? "gelu_backward16" : "gelu_forward16", dtype_define(dtype)),
            (n + 15) / 16};
  }
  return {env.kernels.kernel("activation", name, dtype_define(dtype)), n};
}
}  // namespace

LaunchList activation_forward(OpEnv& env, Activation a, DeviceSpan x, DeviceSpan y, std::size_t n, DType dtype) {
  TypedKernel k = typed_kernel(env, a, false, dtype, n);
  const std::size_t bytes = dtype_bytes(dtype);
  cl::set_args(k.kernel.get(), x.buffer, x.elem_offset(bytes), y.buffer, y.elem_offset(bytes), static_cast<cl_uint>(n));
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k.kernel), k.items));
  return list;
}

LaunchList activation_backward(OpEnv& env, Activation a, DeviceSpan x, DeviceSpan dy, DeviceSpan dx, std::size_t n,
                               DType dtype) {
  TypedKernel k = typed_kernel(env, a, true, dtype, n);
  const std::size_t bytes = dtype_bytes(dtype);
  cl::set_args(k.kernel.get(), x.buffer, x.elem_offset(bytes), dy.buffer, dy.elem_offset(bytes), dx.buffer,
               dx.elem_offset(bytes), static_cast<cl_uint>(n));
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k.kernel), k.items));
  return list;
}

}  // namespace ferry::ops
