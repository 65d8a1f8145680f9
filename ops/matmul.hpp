// Batched matmul of two activations: C[b] = alpha op(A[b]) op(B[b]) for every batch b, row-major.
// op(A) is A stored [M, K], or A^T with A stored [K, M]; op(B) is B stored [K, N], or B^T with B
// stored [N, K]. As tensors: a [..., M, K] times b [..., K, N] gives c [..., M, N], with the same
// leading (batch) dims on both operands (rank 2 to 4; rank 2 is a single matrix). Attention's
// scores are q kᵀ: trans_b.
//
// The product is ops::gemm strided-batched (GemmShape::batch, beta = 0): the same kernels, tuning
// data and CPU reference as Linear's GEMM, all batches in one launch. This header holds what is
// particular to two activations: the shape rule over tensors and the backward products.
#pragma once

#include <cstddef>
#include <span>

#include "ferry/ops/launch.hpp"
#include "ferry/ops/types.hpp"
#include "ops/gemm.hpp"

namespace ferry::ops {

// The product of tensors a and b (stored as above) as a batched GEMM of f32 operands. Throws
// std::invalid_argument saying what does not fit: a rank outside 2..4, ranks that differ, batch
// dims that differ, inner dims that differ.
GemmShape matmul_shape(const Shape& a, const Shape& b, bool trans_a, bool trans_b);
// The output's shape: a's batch dims, then M, N.
Shape matmul_output_shape(const Shape& a, const Shape& b, bool trans_a, bool trans_b);

// The backward pass of C = alpha op(A) op(B), as products of the same kind:
//   dA = alpha dY op(B)^T, stored like A (so transposed again when trans_a),
//   dB = alpha op(A)^T dY, stored like B.
// A product over two of (dY, A, B): its shape and whether dY is the first operand.
struct MatmulProduct {
  GemmShape shape;
  bool dy_first = true;
};

inline MatmulProduct matmul_grad_a_product(const GemmShape& f) {
  if (!f.trans_a)
    return {{.M = f.M, .N = f.K, .K = f.N, .trans_a = false, .trans_b = !f.trans_b, .batch = f.batch},
            true};  // dA[M,K] = dY[M,N] op(B)^T
  return {{.M = f.K, .N = f.M, .K = f.N, .trans_a = f.trans_b, .trans_b = true, .batch = f.batch},
          false};  // dA[K,M] = op(B) dY^T
}
inline MatmulProduct matmul_grad_b_product(const GemmShape& f) {
  if (!f.trans_b)
    return {{.M = f.K, .N = f.N, .K = f.M, .trans_a = !f.trans_a, .trans_b = false, .batch = f.batch},
            false};  // dB[K,N] = op(A)^T dY
  return {{.M = f.N, .N = f.K, .K = f.M, .trans_a = true, .trans_b = f.trans_a, .batch = f.batch},
          true};  // dB[N,K] = dY^T op(A)
}

// da from (dy, b) and db from (a, dy), each one gemm(); `forward` is the forward product's shape.
// The scratch is gemm_scratch_elems() of the backward product's shape.
std::size_t matmul_grad_a_scratch_elems(OpEnv& env, const GemmShape& forward, const GemmOptions& options = {});
std::size_t matmul_grad_b_scratch_elems(OpEnv& env, const GemmShape& forward, const GemmOptions& options = {});
LaunchList matmul_grad_a(OpEnv& env, const GemmShape& forward, float alpha, DeviceSpan dy, DeviceSpan b, DeviceSpan da,
                         DeviceSpan scratch, const GemmOptions& options = {});
LaunchList matmul_grad_b(OpEnv& env, const GemmShape& forward, float alpha, DeviceSpan a, DeviceSpan dy, DeviceSpan db,
                         DeviceSpan scratch, const GemmOptions& options = {});

namespace ref {

template <class T>
void matmul_grad_a(const GemmShape& forward, T alpha, std::span<const T> dy, std::span<const T> b, std::span<T> da) {
  const MatmulProduct p = matmul_grad_a_product(forward);
  if (p.dy_first) {
    gemm<T>(p.shape, alpha, dy, b, T(0), da);
  } else {
    gemm<T>(p.shape, alpha, b, dy, T(0), da);
  }
}

template <class T>
void matmul_grad_b(const GemmShape& forward, T alpha, std::span<const T> a, std::span<const T> dy, std::span<T> db) {
  const MatmulProduct p = matmul_grad_b_product(forward);
  if (p.dy_first) {
    gemm<T>(p.shape, alpha, dy, a, T(0), db);
  } else {
    gemm<T>(p.shape, alpha, a, dy, T(0), db);
  }
}

}  // namespace ref
}  // namespace ferry::ops
