// GEMM: C[M,N] = alpha * op(A) * op(B) + beta * C (+ bias broadcast over rows), row-major.
// op(A) is A stored [M,K], or A^T with A stored [K,M]; op(B) is B stored [K,N], or B^T with B
// stored [N,K]. This is the workhorse of Linear, Conv2d (through im2col) and, strided-batched
// (GemmShape::batch), of the batched matmul of two activations (ops/matmul.hpp): one routine,
// one kernel family per device, one tuning path.
//
// A, B and C may each be stored as f32, f16 or bf16 (GemmShape::a, b, c); products and sums are
// always fp32 and C is rounded to its storage type once, at the end (the bias is f32). ferry's
// packed kernel reads and writes the narrow types itself; the other kernels and CLBlast work on
// f32 copies in scratch, converted before and after.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "ferry/ops/activation.hpp"
#include "ferry/ops/launch.hpp"
#include "ferry/ops/types.hpp"

namespace ferry::ops {

struct GemmShape {
  std::size_t M = 0, N = 0, K = 0;
  bool trans_a = false, trans_b = false;
  DType a = DType::f32, b = DType::f32, c = DType::f32;  // storage types (f32, f16, bf16)
  // Products computed in one launch: product z reads A, B and writes C at z times the operand's
  // matrix size (M K, K N, M N elements) past its offset. The bias is the same for every product.
  std::size_t batch = 1;
  bool all_f32() const { return a == DType::f32 && b == DType::f32 && c == DType::f32; }
  std::size_t flops() const { return 2 * batch * M * N * K; }
};

// Which implementation runs a GEMM. `automatic` follows the per-device tuning data.
enum class GemmBackend : std::uint8_t { automatic, ferry, clblast };

struct GemmOptions {
  GemmBackend backend = GemmBackend::automatic;
  DeviceSpan bias{};  // optional: length N, added to every row of C after the product
  // Optional: runs ferry's kernel with these parameters instead of what the tuning data says,
  // written as in the tuning file's kernel and params columns, e.g. "packed RB=4 NV=4" or
  // "tiled TSM=32 TSN=32 TSK=8 WPTM=2 WPTN=2". For tests and the tuner (ops/gemm_tune.hpp).
  std::string kernel{};
  // With `kernel`: fit it to each shape as a row of the tuning data is fitted (a smaller tile for
  // a product with fewer tiles than compute units, a narrower panel), so the tuner measures a
  // candidate row as gemm() would run it.
  bool kernel_as_row = false;
  // Optional NCHW views of B and C for convolutions (only where gemm_takes_planes() says so; one
  // product, batch 1, as for the gathered A below):
  // with b_planes = P, B's stored matrix [rows, cols] ([K, N], or [N, K] transposed) is a batch of
  // planes of P columns, element (i, j) at ((j / P) * rows + i) * P + j % P: the [channels, G*PQ]
  // view of an NCHW tensor, read without a permute. With c_planes = P, C element (m, n) is at
  // ((m / P) * N + n) * P + m % P: rows m = g*PQ + pq written straight to NCHW (P = M: C^T).
  std::size_t b_planes = 0, c_planes = 0;
  // Optional implicit A (f32, not transposed): A(m, k) = a[rows[m] + cols[k]] with two int32
  // tables, M and K long: a convolution's column matrix read straight from a padded input.
  DeviceSpan a_gather_rows{}, a_gather_cols{};
  // Optional, with a gathered A: rows come in runs of a_gather_run consecutive rows whose offsets
  // are a_gather_step apart (rows[m + i] = rows[m] + i * step for m a multiple of the run; M a
  // multiple of it): the kernel's register block then takes exactly a_gather_run rows (at most 16)
  // and reads one table entry per block, addressing the others by constant offsets. For a
  // stride-1 convolution whose output rows are the run, a block of 14 rows x 32 columns needs two
  // general registers where a table entry per row needed 14 (and spilled).
  std::size_t a_gather_run = 0, a_gather_step = 0;
  // Optional: C = max(0, alpha op(A) op(B) + beta C + bias), a ReLU fused into the epilogue (a
  // convolution's, a Linear's) of ferry's packed and tiled kernels; the others run the ReLU over C
  // after the product.
  bool relu = false;
  // Optional: C = act'(z) * (alpha op(A) op(B) + beta C + bias), with z = dact_input stored like C
  // (its dtype and layout, every product of a batch) and act = dact: an activation's backward
  // fused into the product that makes its output gradient (the next Linear's dy w^T). ferry's
  // packed and tiled kernels apply it in their epilogues where that gives the activation kernel's
  // bits; otherwise, and on the other kernels, the activation's backward kernel runs over C after
  // the product. Not with `relu` or the NCHW view of C.
  DeviceSpan dact_input{};
  Activation dact = Activation::relu;
  // Optional: the overflow guard over C (ops/overflow_guard.hpp), one f32: set to NaN when a value
  // stored in C is not finite, as overflow_guard_check over C would set it. ferry's packed and
  // tiled kernels check in their epilogues (no second pass over C); the others, and products whose
  // activation runs after them, are followed by overflow_guard_check. Needs an f32 C in rows.
  DeviceSpan guard{};
};

// Scratch (in floats) the chosen kernel needs for this shape, e.g. packed panels of B. The caller
// (the memory planner) provides it; it is only used during the launches.
std::size_t gemm_scratch_elems(OpEnv& env, const GemmShape& shape, const GemmOptions& options = {});

LaunchList gemm(OpEnv& env, const GemmShape& shape, float alpha, DeviceSpan a, DeviceSpan b, float beta, DeviceSpan c,
                DeviceSpan scratch, const GemmOptions& options = {});

// Whether gemm() on this device honours GemmOptions::b_planes, c_planes and a_gather_* (ferry's packed
// kernel with native dtypes); elsewhere those options must stay unset.
bool gemm_takes_planes(OpEnv& env);

// Row blocks of RB rows per group of the packed kernel's traversal on this device for this shape
// (0: none, all of A fits the cache share); see gemm_packed in ops/kernels/gemm_packed.cl.
std::uint32_t gemm_traversal_group_blocks(OpEnv& env, const GemmShape& shape, std::size_t rb);

// Describes the kernel and parameters gemm() picks on this device, for logs and benchmarks.
std::string gemm_kernel_description(OpEnv& env, const GemmShape& shape, const GemmOptions& options = {});

// Per-device tuning data (ops/tuning/gemm.tsv, embedded; FERRY_GEMM_TUNING=path replaces it) picks
// the backend that `automatic` means and ferry's kernel and parameters; FERRY_GEMM_BACKEND=ferry|clblast
// overrides `automatic`. A malformed file or row throws std::runtime_error naming file and line.

// Whether this build can run GemmBackend::clblast.
bool gemm_have_clblast();
struct GemmTuningRow;
// The backend a gemm() without GemmOptions::backend runs on a device whose tuning row is `row`:
// FERRY_GEMM_BACKEND's when set (throws std::runtime_error for another value), else the row's
// (CLBlast only where this build has it).
GemmBackend gemm_backend_for(const GemmTuningRow& row);

namespace ref {

// Every product of the batch; with beta = 0, C is not read (it may hold NaN).
template <class T>
void gemm(const GemmShape& s, T alpha, std::span<const T> a, std::span<const T> b, T beta, std::span<T> c,
          std::span<const T> bias = {}) {
  for (std::size_t z = 0; z < s.batch; ++z) {
    const T* az = a.data() + z * s.M * s.K;
    const T* bz = b.data() + z * s.K * s.N;
    T* cz = c.data() + z * s.M * s.N;
    for (std::size_t i = 0; i < s.M; ++i) {
      for (std::size_t j = 0; j < s.N; ++j) {
        T acc = 0;
        for (std::size_t k = 0; k < s.K; ++k) {
          const T av = s.trans_a ? az[k * s.M + i] : az[i * s.K + k];
          const T bv = s.trans_b ? bz[j * s.K + k] : bz[k * s.N + j];
          acc += av * bv;
        }
        T out = alpha * acc + (beta == T(0) ? T(0) : beta * cz[i * s.N + j]);
        if (!bias.empty()) out += bias[j];
        cz[i * s.N + j] = out;
      }
    }
  }
}

}  // namespace ref
}  // namespace ferry::ops
