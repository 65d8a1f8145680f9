// Binding of the activation kernels (ops/kernels/activation.cl).
#include "ferry/ops/activation.hpp"

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
}  // namespace

LaunchList activation_forward(OpEnv& env, Activation a, DeviceSpan x, DeviceSpan y, std::size_t n) {
  cl::Kernel k = env.kernels.kernel("activation", kernel_name(a, false));
  cl::set_args(k.get(), x.buffer, x.elem_offset(), y.buffer, y.elem_offset(), static_cast<cl_uint>(n));
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k), n));
  return list;
}

LaunchList activation_backward(OpEnv& env, Activation a, DeviceSpan x, DeviceSpan dy, DeviceSpan dx, std::size_t n) {
  cl::Kernel k = env.kernels.kernel("activation", kernel_name(a, true));
  cl::set_args(k.get(), x.buffer, x.elem_offset(), dy.buffer, dy.elem_offset(), dx.buffer, dx.elem_offset(),
               static_cast<cl_uint>(n));
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k), n));
  return list;
}

}  // namespace ferry::ops
