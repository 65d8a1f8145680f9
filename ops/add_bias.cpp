// Binding of the broadcast bias (ops/kernels/add_bias.cl); its gradient is bias.cl's column sum.
#include "ops/add_bias.hpp"

#include <fmt/format.h>

#include <limits>
#include <stdexcept>

namespace ferry::ops {

std::string add_bias_error(const Shape& x, const Shape& b) {
  if (b.rank == 0 || b.rank > x.rank) {
    return fmt::format("bias {} must have rank 1 to {} (the trailing dims of x {})", b.str(), x.rank, x.str());
  }
  const std::size_t lead = x.rank - b.rank;
  for (std::size_t k = 0; k < b.rank; ++k) {
    if (b[k] != x[lead + k]) {
      return fmt::format("bias {} is not the trailing dims of x {} (dim {} of the bias is {}, of x {})", b.str(),
                         x.str(), k, b[k], x[lead + k]);
    }
  }
  return {};
}

LaunchList add_bias_forward(OpEnv& env, DeviceSpan x, DeviceSpan b, DeviceSpan y, std::size_t rows, std::size_t cols) {
  const std::size_t n = rows * cols;
  if (n > std::numeric_limits<cl_uint>::max()) throw std::invalid_argument("add_bias: more than 2^32-1 elements");
  // CPU devices: a work-item per row and 16 columns (add_bias16).
  const bool wide = env.device().is_cpu();
  cl::Kernel k = env.kernels.kernel("add_bias", wide ? "add_bias16" : "add_bias");
  // cols of 0 (no element to write) is passed as 1 so that no work-item divides by zero.
  cl::set_args(k.get(), x.buffer, x.elem_offset(), b.buffer, b.elem_offset(), y.buffer, y.elem_offset(), cl_uint(n),
               cl_uint(cols == 0 ? 1 : cols));
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k), wide ? rows * ((cols + 15) / 16) : n));
  return list;
}

LaunchList add_bias_backward(OpEnv& env, DeviceSpan dy, DeviceSpan db, std::size_t rows, std::size_t cols) {
  return bias_backward(env, dy, db, rows, cols);
}

}  // namespace ferry::ops
