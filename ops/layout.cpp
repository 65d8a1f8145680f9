// Binding of the layout kernels (ops/kernels/layout.cl): permute, mul, scale.
#include "ops/layout.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <stdexcept>

namespace ferry::ops {
namespace {
std::string perm_str(std::span<const std::int32_t> perm, std::size_t rank) {
  std::string s = "[";
  for (std::size_t k = 0; k < rank; ++k) s += fmt::format("{}{}", k ? ", " : "", perm[k]);
  return s + "]";
}
}  // namespace

std::string permutation_error(const Shape& x, std::span<const std::int32_t> perm) {
  const std::size_t r = x.rank;
  if (r < 2 || r > 4) return fmt::format("permute takes an input of rank 2 to 4, got {}", x.str());
  if (perm.size() < r)
    return fmt::format("permutation has {} entries for an input {} of rank {}", perm.size(), x.str(), r);
  std::array<bool, 4> seen{};
  for (std::size_t k = 0; k < r; ++k) {
    const std::int32_t a = perm[k];
    if (a < 0 || static_cast<std::size_t>(a) >= r) {
      return fmt::format("permutation {} of an input {}: axis {} is out of range [0, {})", perm_str(perm, r), x.str(),
                         a, r);
    }
    if (seen[static_cast<std::size_t>(a)]) {
      return fmt::format("permutation {} of an input {} repeats axis {} (not a permutation)", perm_str(perm, r),
                         x.str(), a);
    }
    seen[static_cast<std::size_t>(a)] = true;
  }
  return {};
}

Shape permuted_shape(const Shape& x, std::span<const std::int32_t> perm) {
  if (std::string e = permutation_error(x, perm); !e.empty()) throw std::invalid_argument(e);
  Shape y = x;
  for (std::size_t k = 0; k < x.rank; ++k) y.dims[k] = x[static_cast<std::size_t>(perm[k])];
  return y;
}

std::array<std::int32_t, 4> inverse_permutation(std::span<const std::int32_t> perm, std::size_t rank) {
  std::array<std::int32_t, 4> inv{};
  for (std::size_t k = 0; k < rank; ++k) inv[static_cast<std::size_t>(perm[k])] = static_cast<std::int32_t>(k);
  return inv;
}

LaunchList permute(OpEnv& env, DeviceSpan x, DeviceSpan y, const Shape& x_shape, std::span<const std::int32_t> perm,
                   DType dtype) {
  if (!permute_dtypes.contains(dtype)) {
    throw std::invalid_argument(
        fmt::format("permute: dtype {} is not supported (permute takes {})", dtype_name(dtype), permute_dtypes.str()));
  }
  const Shape ys = permuted_shape(x_shape, perm);
  const std::size_t r = x_shape.rank;
  const cl_uint n = element_count("permute", x_shape.elems());
  // x's strides, then y's extents and the x strides of y's axes, padded to four leading axes.
  std::array<std::uint64_t, 4> xstride{};
  std::uint64_t s = 1;
  for (std::size_t k = r; k-- > 0;) {
    xstride[k] = s;
    s *= x_shape[k];
  }
  std::array<cl_uint, 4> d{1, 1, 1, 1};
  std::array<cl_ulong, 4> st{0, 0, 0, 0};
  for (std::size_t k = 0; k < r; ++k) {
    d[4 - r + k] = ys[k];
    st[4 - r + k] = xstride[static_cast<std::size_t>(perm[k])];
  }
  const std::size_t bytes = dtype_bytes(dtype);
  if (r == 2 && perm[0] == 1 && dtype == DType::f32 && env.device().is_cpu() && x_shape[0] % 16 == 0 &&
      x_shape[1] % 16 == 0 && n > 0) {
    // A matrix transposed 16 x 16 blocks at a time (transpose16 in layout.cl).
    cl::Kernel k = env.kernels.kernel("layout", "transpose16", dtype_define(dtype));
    cl::set_args(k.get(), x.buffer, x.elem_offset(bytes), y.buffer, y.elem_offset(bytes), cl_uint(x_shape[0]),
                 cl_uint(x_shape[1]));
    KernelLaunch l;
    l.kernel = std::move(k);
    l.dims = 2;
    l.global = {x_shape[0] / 16, x_shape[1] / 16, 1};
    l.local = {1, 1, 1};
    LaunchList list;
    list.push_back(std::move(l));
    return list;
  }
  if (st[3] == 1 && d[3] > 1 && n > 0) {
    // The last axis stays last: copy whole rows.
    const cl_uint rows = n / d[3];
    cl::Kernel k = env.kernels.kernel("layout", "permute_rows", dtype_define(dtype));
    cl::set_args(k.get(), x.buffer, x.elem_offset(bytes), y.buffer, y.elem_offset(bytes), rows, d[1], d[2], d[3], st[0],
                 st[1], st[2]);
    LaunchList list;
    list.push_back(elementwise_launch(std::move(k), rows));
    return list;
  }
  cl::Kernel k = env.kernels.kernel("layout", "permute", dtype_define(dtype));
  // An extent of 0 (no element to write) is passed as 1 so that no work-item divides by zero.
  cl::set_args(k.get(), x.buffer, x.elem_offset(bytes), y.buffer, y.elem_offset(bytes), n, std::max<cl_uint>(d[1], 1),
               std::max<cl_uint>(d[2], 1), std::max<cl_uint>(d[3], 1), st[0], st[1], st[2], st[3]);
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k), n));
  return list;
}

LaunchList mul(OpEnv& env, DeviceSpan a, DeviceSpan b, DeviceSpan out, std::size_t n) {
  cl::Kernel k = env.kernels.kernel("layout", "mul", dtype_define(DType::f32));
  cl::set_args(k.get(), a.buffer, a.elem_offset(), b.buffer, b.elem_offset(), out.buffer, out.elem_offset(),
               element_count("mul", n));
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k), n));
  return list;
}

LaunchList scale(OpEnv& env, DeviceSpan x, DeviceSpan y, float factor, std::size_t n) {
  cl::Kernel k = env.kernels.kernel("layout", "scale", dtype_define(DType::f32));
  cl::set_args(k.get(), x.buffer, x.elem_offset(), y.buffer, y.elem_offset(), factor, element_count("scale", n));
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k), n));
  return list;
}

}  // namespace ferry::ops
