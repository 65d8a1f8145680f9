// The batched matmul's shape rule and backward products; the products themselves are gemm().
#include "ops/matmul.hpp"

#include <fmt/format.h>

#include <stdexcept>
#include <utility>

namespace ferry::ops {
namespace {

// The operands of a backward product in its order.
std::pair<DeviceSpan, DeviceSpan> operands(const MatmulProduct& p, DeviceSpan dy, DeviceSpan other) {
  return p.dy_first ? std::pair{dy, other} : std::pair{other, dy};
}

}  // namespace

GemmShape matmul_shape(const Shape& a, const Shape& b, bool trans_a, bool trans_b) {
  if (a.rank < 2 || a.rank > 4 || b.rank < 2 || b.rank > 4) {
    throw std::invalid_argument(fmt::format(
        "matmul takes operands of rank 2 to 4 ([..., M, K] and [..., K, N]), got {} and {}", a.str(), b.str()));
  }
  if (a.rank != b.rank) {
    throw std::invalid_argument(
        fmt::format("matmul operands {} and {} have different ranks (the batch dims must match)", a.str(), b.str()));
  }
  GemmShape s;
  s.trans_a = trans_a;
  s.trans_b = trans_b;
  const std::size_t r = a.rank;
  for (std::size_t i = 0; i + 2 < r; ++i) {
    if (a[i] != b[i]) {
      throw std::invalid_argument(fmt::format("matmul operands {} and {} have different batch dims (dim {}: {} vs {})",
                                              a.str(), b.str(), i, a[i], b[i]));
    }
    s.batch *= a[i];
  }
  s.M = trans_a ? a[r - 1] : a[r - 2];
  const std::size_t ka = trans_a ? a[r - 2] : a[r - 1];
  const std::size_t kb = trans_b ? b[r - 1] : b[r - 2];
  s.N = trans_b ? b[r - 2] : b[r - 1];
  if (ka != kb) {
    throw std::invalid_argument(fmt::format("matmul: {}{} times {}{}: inner dims {} and {} differ", a.str(),
                                            trans_a ? "^T" : "", b.str(), trans_b ? "^T" : "", ka, kb));
  }
  s.K = ka;
  return s;
}

Shape matmul_output_shape(const Shape& a, const Shape& b, bool trans_a, bool trans_b) {
  const GemmShape s = matmul_shape(a, b, trans_a, trans_b);
  Shape out = a;
  out.dims[a.rank - 2] = static_cast<std::uint32_t>(s.M);
  out.dims[a.rank - 1] = static_cast<std::uint32_t>(s.N);
  return out;
}

std::size_t matmul_grad_a_scratch_elems(OpEnv& env, const GemmShape& forward, const GemmOptions& options) {
  return gemm_scratch_elems(env, matmul_grad_a_product(forward).shape, options);
}

std::size_t matmul_grad_b_scratch_elems(OpEnv& env, const GemmShape& forward, const GemmOptions& options) {
  return gemm_scratch_elems(env, matmul_grad_b_product(forward).shape, options);
}

LaunchList matmul_grad_a(OpEnv& env, const GemmShape& forward, float alpha, DeviceSpan dy, DeviceSpan b, DeviceSpan da,
                         DeviceSpan scratch, const GemmOptions& options) {
  const MatmulProduct p = matmul_grad_a_product(forward);
  const auto [x, y] = operands(p, dy, b);
  return gemm(env, p.shape, alpha, x, y, 0.0f, da, scratch, options);
}

LaunchList matmul_grad_b(OpEnv& env, const GemmShape& forward, float alpha, DeviceSpan a, DeviceSpan dy, DeviceSpan db,
                         DeviceSpan scratch, const GemmOptions& options) {
  const MatmulProduct p = matmul_grad_b_product(forward);
  const auto [x, y] = operands(p, dy, a);
  return gemm(env, p.shape, alpha, x, y, 0.0f, db, scratch, options);
}

}  // namespace ferry::ops
