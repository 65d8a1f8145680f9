// Batched matmul of two activations: C[b] = alpha op(A[b]) op(B[b]) for every batch b, row-major.
// op(A) is A stored [M, K], or A^T with A stored [K, M]; op(B) is B stored [K, N], or B^T with B
// stored [N, K]. As tensors: a [..., M, K] times b [..., K, N] gives c [..., M, N], with the same
// leading (batch) dims on both operands (rank 2 to 4; rank 2 is a single matrix). Attention's
// scores are q kᵀ: trans_b.
//
// All batches run in one launch (the batch index on a grid dimension). The kernel follows the
// device's GEMM tuning data (ops/tuning/gemm.tsv): a register-blocked kernel over packed panels of
// B on CPU devices (the panels are the op's scratch; a B that is not transposed and at most 64Ki
// floats per batch is read in place, without scratch), local-memory tiles on GPUs.
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "ferry/ops/launch.hpp"
#include "ferry/ops/types.hpp"

namespace ferry::ops {

struct MatmulShape {
  std::size_t batch = 1, M = 0, N = 0, K = 0;
  bool trans_a = false, trans_b = false;
  std::size_t flops() const { return 2 * batch * M * N * K; }
};

// The product of tensors a and b (stored as above). Throws std::invalid_argument saying what does
// not fit: a rank outside 2..4, ranks that differ, batch dims that differ, inner dims that differ.
MatmulShape matmul_shape(const Shape& a, const Shape& b, bool trans_a, bool trans_b);
// The output's shape: a's batch dims, then M, N.
Shape matmul_output_shape(const Shape& a, const Shape& b, bool trans_a, bool trans_b);

struct MatmulOptions {
  // Optional: runs this kernel instead of what the tuning data says, written as in the GEMM tuning
  // file's kernel and params columns: "packed RB=6 NV=4", "tiled TSM=32 TSN=32 TSK=8 WPTM=2 WPTN=2",
  // "naive". For tests and benchmarks. (A packed NV is a maximum: each product takes the panel
  // width up to 16 NV that pads N least.)
  std::string kernel{};
};

// Scratch (in floats) the chosen kernel needs for this shape: packed panels of every batch's B.
std::size_t matmul_scratch_elems(OpEnv& env, const MatmulShape& shape, const MatmulOptions& options = {});

// c = alpha op(a) op(b), batch by batch; c is overwritten, never read.
LaunchList matmul(OpEnv& env, const MatmulShape& shape, float alpha, DeviceSpan a, DeviceSpan b, DeviceSpan c,
                  DeviceSpan scratch, const MatmulOptions& options = {});

// The kernel and parameters matmul() picks on this device, for logs and benchmarks.
std::string matmul_kernel_description(OpEnv& env, const MatmulShape& shape, const MatmulOptions& options = {});

// The backward pass of C = alpha op(A) op(B), as products of the same kind:
//   dA = alpha dY op(B)^T, stored like A (so transposed again when trans_a),
//   dB = alpha op(A)^T dY, stored like B.
// A product over two of (dY, A, B): its shape and whether dY is the first operand.
struct MatmulProduct {
  MatmulShape shape;
  bool dy_first = true;
};

inline MatmulProduct matmul_grad_a_product(const MatmulShape& f) {
  if (!f.trans_a) return {{f.batch, f.M, f.K, f.N, false, !f.trans_b}, true};  // dA[M,K] = dY[M,N] op(B)^T
  return {{f.batch, f.K, f.M, f.N, f.trans_b, true}, false};                   // dA[K,M] = op(B) dY^T
}
inline MatmulProduct matmul_grad_b_product(const MatmulShape& f) {
  if (!f.trans_b) return {{f.batch, f.K, f.N, f.M, !f.trans_a, false}, false};  // dB[K,N] = op(A)^T dY
  return {{f.batch, f.N, f.K, f.M, true, f.trans_a}, true};                     // dB[N,K] = dY^T op(A)
}

// da from (dy, b) and db from (a, dy); `forward` is the forward product's shape.
std::size_t matmul_grad_a_scratch_elems(OpEnv& env, const MatmulShape& forward, const MatmulOptions& options = {});
std::size_t matmul_grad_b_scratch_elems(OpEnv& env, const MatmulShape& forward, const MatmulOptions& options = {});
LaunchList matmul_grad_a(OpEnv& env, const MatmulShape& forward, float alpha, DeviceSpan dy, DeviceSpan b,
                         DeviceSpan da, DeviceSpan scratch, const MatmulOptions& options = {});
LaunchList matmul_grad_b(OpEnv& env, const MatmulShape& forward, float alpha, DeviceSpan a, DeviceSpan dy,
                         DeviceSpan db, DeviceSpan scratch, const MatmulOptions& options = {});

namespace ref {

template <class T>
void matmul(const MatmulShape& s, T alpha, std::span<const T> a, std::span<const T> b, std::span<T> c) {
  for (std::size_t n = 0; n < s.batch; ++n) {
    const T* ab = a.data() + n * s.M * s.K;
    const T* bb = b.data() + n * s.K * s.N;
    T* cb = c.data() + n * s.M * s.N;
    for (std::size_t i = 0; i < s.M; ++i) {
      for (std::size_t j = 0; j < s.N; ++j) {
        T acc = 0;
        for (std::size_t k = 0; k < s.K; ++k) {
          const T av = s.trans_a ? ab[k * s.M + i] : ab[i * s.K + k];
          const T bv = s.trans_b ? bb[j * s.K + k] : bb[k * s.N + j];
          acc += av * bv;
        }
        cb[i * s.N + j] = alpha * acc;
      }
    }
  }
}

template <class T>
void matmul_grad_a(const MatmulShape& forward, T alpha, std::span<const T> dy, std::span<const T> b, std::span<T> da) {
  const MatmulProduct p = matmul_grad_a_product(forward);
  if (p.dy_first) {
    matmul<T>(p.shape, alpha, dy, b, da);
  } else {
    matmul<T>(p.shape, alpha, b, dy, da);
  }
}

template <class T>
void matmul_grad_b(const MatmulShape& forward, T alpha, std::span<const T> a, std::span<const T> dy, std::span<T> db) {
  const MatmulProduct p = matmul_grad_b_product(forward);
  if (p.dy_first) {
    matmul<T>(p.shape, alpha, dy, a, db);
  } else {
    matmul<T>(p.shape, alpha, a, dy, db);
  }
}

}  // namespace ref
}  // namespace ferry::ops
