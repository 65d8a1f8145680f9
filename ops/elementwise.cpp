// Binding of the elementwise utility kernels (ops/kernels/elementwise.cl).
#include "ferry/ops/elementwise.hpp"

#include <limits>
#include <stdexcept>

namespace ferry::ops {
namespace {
cl_uint checked_count(std::size_t n) {
  if (n > std::numeric_limits<cl_uint>::max()) throw std::invalid_argument("elementwise op: more than 2^32-1 elements");
  return static_cast<cl_uint>(n);
}

LaunchList single(cl::Kernel k, std::size_t n) {
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k), n));
  return list;
}
}  // namespace

LaunchList add(OpEnv& env, DeviceSpan a, DeviceSpan b, DeviceSpan out, std::size_t n) {
  cl::Kernel k = env.kernels.kernel("elementwise", "add");
  cl::set_args(k.get(), a.buffer, a.elem_offset(), b.buffer, b.elem_offset(), out.buffer, out.elem_offset(),
               checked_count(n));
  return single(std::move(k), n);
}

LaunchList fill(OpEnv& env, DeviceSpan out, float value, std::size_t n) {
  cl::Kernel k = env.kernels.kernel("elementwise", "fill");
  cl::set_args(k.get(), out.buffer, out.elem_offset(), value, checked_count(n));
  return single(std::move(k), n);
}

LaunchList copy(OpEnv& env, DeviceSpan in, DeviceSpan out, std::size_t n) {
  cl::Kernel k = env.kernels.kernel("elementwise", "copy");
  cl::set_args(k.get(), in.buffer, in.elem_offset(), out.buffer, out.elem_offset(), checked_count(n));
  return single(std::move(k), n);
}

}  // namespace ferry::ops
