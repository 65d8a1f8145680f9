// Binding of the elementwise utility kernels (ops/kernels/elementwise.cl).
#include "ops/elementwise.hpp"

#include <fmt/format.h>

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

LaunchList add(OpEnv& env, DeviceSpan a, DeviceSpan b, DeviceSpan out, std::size_t n, DType dtype) {
  if (!add_dtypes.contains(dtype)) {
    throw std::invalid_argument(
        fmt::format("add: dtype {} is not supported (add takes {})", dtype_name(dtype), add_dtypes.str()));
  }
  const std::size_t bytes = dtype_bytes(dtype);
  // On CPU devices 16 elements per work-item (add16).
  const bool wide = env.device().is_cpu();
  cl::Kernel k = env.kernels.kernel("elementwise", wide ? "add16" : "add", dtype_define(dtype));
  cl::set_args(k.get(), a.buffer, a.elem_offset(bytes), b.buffer, b.elem_offset(bytes), out.buffer,
               out.elem_offset(bytes), checked_count(n));
  return single(std::move(k), wide ? (n + 15) / 16 : n);
}

// fill and copy are fp32 kernels; they come from the f32 build of the file, which add shares.
LaunchList fill(OpEnv& env, DeviceSpan out, float value, std::size_t n) {
  cl::Kernel k = env.kernels.kernel("elementwise", "fill", dtype_define(DType::f32));
  cl::set_args(k.get(), out.buffer, out.elem_offset(), value, checked_count(n));
  return single(std::move(k), n);
}

LaunchList copy(OpEnv& env, DeviceSpan in, DeviceSpan out, std::size_t n) {
  cl::Kernel k = env.kernels.kernel("elementwise", "copy", dtype_define(DType::f32));
  cl::set_args(k.get(), in.buffer, in.elem_offset(), out.buffer, out.elem_offset(), checked_count(n));
  return single(std::move(k), n);
}

}  // namespace ferry::ops
