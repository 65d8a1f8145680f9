// Local-memory tiled GEMM for GPUs, strided-batched: C[z] = alpha op(A[z]) op(B[z]) + beta C[z]
// (+ bias) for z = get_group_id(2), each operand z * its batch stride elements past its offset;
// optionally with K split (a product's K in blocks, see the kernel).
//
// A work-group computes a TSM x TSN tile of C with (TSM / WPTM) x (TSN / WPTN) work-items, each
// holding WPTM x WPTN results in registers. Per step of TSK along k the group stages op(A) and
// op(B) tiles in __local memory (zero-filled past the matrix edges, so every shape and both
// transposes are handled). What makes it fast on a GPU:
//  - Double buffering: two local tiles. While the group multiplies out of one, each work-item has
//    already issued its global loads for the next step into registers (stored into the other tile
//    at the next step), so global latency hides behind the arithmetic; one barrier per step.
//  - Vector reads of the local tiles: a work-item's rows (and columns) come in runs of VW
//    consecutive ones, runs strided by the group's extent, so each step reads WPTM / VW + WPTN / VW
//    vectors of VW floats for WPTM x WPTN fused multiply-adds, and neighbouring work-items read
//    neighbouring vectors (no bank conflicts).
//  - The local rows are padded by 4 floats: where the loads walk along k (A not transposed, B
//    transposed), neighbouring work-items store into one column of the tile, which without the
//    padding is one memory bank.
//  - Vector loads from global memory (VG=4): where a group's tile lies wholly inside the matrix
//    and the operand allows it (f32, its offset and leading dimension multiples of 4: the host's
//    `vec_flags`), each work-item loads float4s, a quarter of the load instructions; the edges
//    and the last, partial k step load floats as before. Along m or n a float4 is stored into the
//    local tile as one vector; along k it is stored as four floats (the tile is k-major).
// Parameters (-D): TSM, TSN, TSK, WPTM, WPTN, VW (1, 2 or 4, dividing WPTM and WPTN), VG (1 or 4), TRANS_A,
// TRANS_B, and the storage types A_NAME / B_NAME / C_NAME = F32 | F16 | BF16 (dtype.clh; F32 when
// not given): narrow operands are widened as they are staged in local memory and C is rounded as
// it is stored, so mixed precision needs no f32 copies. Offsets and strides are whole elements (no
// pointer arithmetic on half*). C_RELU and C_DACT select an epilogue (gemm_epilogue.clh) with
// A_IS_F32, B_IS_F32 and C_IS_F32 saying whether each is f32; C_GUARD the overflow guard over C.
#include "dtype.clh"
#ifndef A_NAME
#define A_NAME F32
#define A_IS_F32 1
#endif
#ifndef B_NAME
#define B_NAME F32
#define B_IS_F32 1
#endif
#ifndef C_NAME
#define C_NAME F32
#define C_IS_F32 1
#endif
#include "gemm_epilogue.clh"
#ifndef VW
#define VW 1
#endif
#define RTSM (TSM / WPTM)
#define RTSN (TSN / WPTN)
#define THREADS (RTSM * RTSN)
#define LDA (TSM + 4)
#define LDB (TSN + 4)
#define A_LOADS ((TSK * TSM + THREADS - 1) / THREADS)
#define B_LOADS ((TSK * TSN + THREADS - 1) / THREADS)

#if VW == 1
#define VTYPE float
#define UNPACK(v, dst) (dst)[0] = (v)
#elif VW == 2
#define VTYPE float2
#define UNPACK(v, dst) ((dst)[0] = (v).s0, (dst)[1] = (v).s1)
#elif VW == 4
#define VTYPE float4
#define UNPACK(v, dst) ((dst)[0] = (v).s0, (dst)[1] = (v).s1, (dst)[2] = (v).s2, (dst)[3] = (v).s3)
#else
#error "VW must be 1, 2 or 4"
#endif
#if WPTM % VW != 0 || WPTN % VW != 0
#error "VW must divide WPTM and WPTN"
#endif
#ifndef VG
#define VG 1
#endif
#if VG != 1 && VG != 4
#error "VG must be 1 or 4"
#endif
#define A_VEC (VG == 4 && A_IS_F32)
#define B_VEC (VG == 4 && B_IS_F32)
#if (A_VEC || B_VEC) && (TSM % 4 != 0 || TSN % 4 != 0 || TSK % 4 != 0)
#error "VG=4 needs TSM, TSN and TSK multiples of 4"
#endif
// float4 loads per work-item and step (the last ones partly idle when a tile has fewer float4s
// than the group has work-items), and the registers that hold a step's loads either way.
#define A_VECS (TSK * TSM / 4)
#define B_VECS (TSK * TSN / 4)
#define A_VLOADS ((A_VECS + THREADS - 1) / THREADS)
#define B_VLOADS ((B_VECS + THREADS - 1) / THREADS)
#define MAX_OF(x, y) ((x) > (y) ? (x) : (y))
#if A_VEC
#define A_REGS MAX_OF(A_LOADS, 4 * A_VLOADS)
#else
#define A_REGS A_LOADS
#endif
#if B_VEC
#define B_REGS MAX_OF(B_LOADS, 4 * B_VLOADS)
#else
#define B_REGS B_LOADS
#endif

__kernel __attribute__((reqd_work_group_size(RTSN, RTSM, 1))) void gemm_tiled(
    uint M, uint N, uint K, float alpha, __global const STORAGE(A_NAME)* a, ulong a_off,
    __global const STORAGE(B_NAME)* b, ulong b_off, float beta, __global STORAGE(C_NAME)* c, ulong c_off,
    __global const float* bias, ulong bias_off, uint has_bias, ulong a_batch, ulong b_batch, ulong c_batch,
    __global const STORAGE(C_NAME)* dz, ulong dz_off, uint k_chunk, uint splits, uint vec_flags, __global float* guard,
    ulong guard_off) {
  const uint tn = get_local_id(0);
  const uint tm = get_local_id(1);
  const uint tid = tm * RTSN + tn;
  const uint col0 = get_group_id(0) * TSN;
  const uint row0 = get_group_id(1) * TSM;
  // Dimension 2 counts the products times `splits`: split s of product z / splits sums k in
  // [s k_chunk, (s + 1) k_chunk) into M x N block z of c (f32 partial products that gemm_sum_splits
  // adds; the host passes alpha 1, beta 0, no bias and no epilogue then). One split: k_chunk = K.
  const ulong z = get_group_id(2), product = z / splits;
  const uint k_begin = (uint)(z % splits) * k_chunk, k_end = min(K, k_begin + k_chunk);
  a_off += product * a_batch;
  b_off += product * b_batch;
  c_off += z * c_batch;
  dz_off += z * c_batch;  // z of C_DACT, stored like C (one split)

  // Vector-typed so that the compute loop's reads are aligned vector loads; stored as floats.
  // One dimension each: tile `buf`, row kk starts at (buf * TSK + kk) * LDA floats.
  __local VTYPE as[2 * TSK * LDA / VW] __attribute__((aligned(16)));
  __local VTYPE bs[2 * TSK * LDB / VW] __attribute__((aligned(16)));
  __local float* const asf = (__local float*)as;
  __local float* const bsf = (__local float*)bs;

  float acc[WPTM][WPTN];
#pragma unroll
  for (uint i = 0; i < WPTM; ++i) {
#pragma unroll
    for (uint j = 0; j < WPTN; ++j) acc[i][j] = 0.0f;
  }
  float ra[A_REGS], rb[B_REGS];
  // Whether this group's tile lies inside the matrix along m (n) with float4s allowed (VG=4), and
  // whether the registers hold float4s from the last step's loads (a whole k step).
  const bool a_vec_tile = A_VEC && (vec_flags & 1u) && row0 + TSM <= M;
  const bool b_vec_tile = B_VEC && (vec_flags & 2u) && col0 + TSN <= N;
  bool a_vec = false, b_vec = false;

  // Each step stores the registers loaded during the previous one into tile t % 2, waits for the
  // group, issues the global loads of the next step into the registers and multiplies out of the
  // tile while they are in flight. One barrier per step suffices: a work-item storing into tile
  // t % 2 at step t has passed the barrier of step t - 1, which every work-item reached only after
  // it had finished reading that tile at step t - 2.
  // A last split past K (chunks rounded up to TSK rows) is empty: it stores zeros.
  const uint steps = k_end > k_begin ? (k_end - k_begin + TSK - 1) / TSK : 0;
  for (uint t = 0; t <= steps; ++t) {
    const uint buf = t & 1;
    if (t > 0) {  // the same for the whole group, so the barrier below is reached by all
#if A_VEC
      if (a_vec) {
#pragma unroll
        for (uint r = 0; r < A_VLOADS; ++r) {
          const uint v = tid + r * THREADS;
          if (v >= A_VECS) continue;
#if TRANS_A
          const uint kk = v / (TSM / 4), mm = v % (TSM / 4) * 4;  // a float4 along m: one vector store
          *(__local float4*)(asf + (buf * TSK + kk) * LDA + mm) =
              (float4)(ra[4 * r], ra[4 * r + 1], ra[4 * r + 2], ra[4 * r + 3]);
#else
          const uint mm = v / (TSK / 4), kk = v % (TSK / 4) * 4;  // a float4 along k: four rows of the tile
#pragma unroll
          for (uint q = 0; q < 4; ++q) asf[(buf * TSK + kk + q) * LDA + mm] = ra[4 * r + q];
#endif
        }
      } else
#endif
      {
#pragma unroll
        for (uint r = 0; r < A_LOADS; ++r) {
          const uint i = tid + r * THREADS;
          const uint kk = TRANS_A ? i / TSM : i % TSK, mm = TRANS_A ? i % TSM : i / TSK;
          if (i < TSK * TSM) asf[(buf * TSK + kk) * LDA + mm] = ra[r];
        }
      }
#if B_VEC
      if (b_vec) {
#pragma unroll
        for (uint r = 0; r < B_VLOADS; ++r) {
          const uint v = tid + r * THREADS;
          if (v >= B_VECS) continue;
#if TRANS_B
          const uint nn = v / (TSK / 4), kk = v % (TSK / 4) * 4;  // along k
#pragma unroll
          for (uint q = 0; q < 4; ++q) bsf[(buf * TSK + kk + q) * LDB + nn] = rb[4 * r + q];
#else
          const uint kk = v / (TSN / 4), nn = v % (TSN / 4) * 4;  // along n
          *(__local float4*)(bsf + (buf * TSK + kk) * LDB + nn) =
              (float4)(rb[4 * r], rb[4 * r + 1], rb[4 * r + 2], rb[4 * r + 3]);
#endif
        }
      } else
#endif
      {
#pragma unroll
        for (uint r = 0; r < B_LOADS; ++r) {
          const uint i = tid + r * THREADS;
          const uint kk = TRANS_B ? i % TSK : i / TSN, nn = TRANS_B ? i / TSK : i % TSN;
          if (i < TSK * TSN) bsf[(buf * TSK + kk) * LDB + nn] = rb[r];
        }
      }
      barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (t < steps) {
      // Global -> registers for step t (multiplied at step t + 1). Consecutive work-items read
      // consecutive addresses of whichever layout A and B have.
      const uint k0 = k_begin + t * TSK;
      const bool whole_k = k0 + TSK <= k_end;
      a_vec = a_vec_tile && whole_k;
      b_vec = b_vec_tile && whole_k;
#if A_VEC
      if (a_vec) {
#pragma unroll
        for (uint r = 0; r < A_VLOADS; ++r) {
          const uint v = tid + r * THREADS;
#if TRANS_A
          const uint kk = v / (TSM / 4), mm = v % (TSM / 4) * 4;
          const ulong at = a_off + (ulong)(k0 + kk) * M + row0 + mm;
#else
          const uint mm = v / (TSK / 4), kk = v % (TSK / 4) * 4;
          const ulong at = a_off + (ulong)(row0 + mm) * K + k0 + kk;
#endif
          const float4 x = v < A_VECS ? *(__global const float4*)(a + at) : (float4)(0.0f);
          ra[4 * r] = x.s0, ra[4 * r + 1] = x.s1, ra[4 * r + 2] = x.s2, ra[4 * r + 3] = x.s3;
        }
      } else
#endif
      {
#pragma unroll
        for (uint r = 0; r < A_LOADS; ++r) {
          const uint i = tid + r * THREADS;
          const uint kk = TRANS_A ? i / TSM : i % TSK, mm = TRANS_A ? i % TSM : i / TSK;
          const uint gm = row0 + mm, gk = k0 + kk;
          const ulong at = TRANS_A ? a_off + (ulong)gk * M + gm : a_off + (ulong)gm * K + gk;
          ra[r] = i < TSK * TSM && gm < M && gk < k_end ? LOAD(A_NAME, a, at) : 0.0f;
        }
      }
#if B_VEC
      if (b_vec) {
#pragma unroll
        for (uint r = 0; r < B_VLOADS; ++r) {
          const uint v = tid + r * THREADS;
#if TRANS_B
          const uint nn = v / (TSK / 4), kk = v % (TSK / 4) * 4;
          const ulong at = b_off + (ulong)(col0 + nn) * K + k0 + kk;
#else
          const uint kk = v / (TSN / 4), nn = v % (TSN / 4) * 4;
          const ulong at = b_off + (ulong)(k0 + kk) * N + col0 + nn;
#endif
          const float4 x = v < B_VECS ? *(__global const float4*)(b + at) : (float4)(0.0f);
          rb[4 * r] = x.s0, rb[4 * r + 1] = x.s1, rb[4 * r + 2] = x.s2, rb[4 * r + 3] = x.s3;
        }
      } else
#endif
      {
#pragma unroll
        for (uint r = 0; r < B_LOADS; ++r) {
          const uint i = tid + r * THREADS;
          const uint kk = TRANS_B ? i % TSK : i / TSN, nn = TRANS_B ? i / TSK : i % TSN;
          const uint gn = col0 + nn, gk = k0 + kk;
          const ulong at = TRANS_B ? b_off + (ulong)gn * K + gk : b_off + (ulong)gk * N + gn;
          rb[r] = i < TSK * TSN && gn < N && gk < k_end ? LOAD(B_NAME, b, at) : 0.0f;
        }
      }
    }
    if (t > 0) {
#pragma unroll
      for (uint kk = 0; kk < TSK; ++kk) {
        float av[WPTM], bv[WPTN];
#pragma unroll
        for (uint g = 0; g < WPTM / VW; ++g) {
          const VTYPE v = as[(buf * TSK + kk) * (LDA / VW) + g * RTSM + tm];
          UNPACK(v, av + g * VW);
        }
#pragma unroll
        for (uint g = 0; g < WPTN / VW; ++g) {
          const VTYPE v = bs[(buf * TSK + kk) * (LDB / VW) + g * RTSN + tn];
          UNPACK(v, bv + g * VW);
        }
#pragma unroll
        for (uint i = 0; i < WPTM; ++i) {
#pragma unroll
          for (uint j = 0; j < WPTN; ++j) acc[i][j] = fma(av[i], bv[j], acc[i][j]);
        }
      }
    }
  }

  // Result (i, j) is row (i / VW * RTSM + tm) * VW + i % VW of the tile, and likewise for columns.
  bool guard_bad = false;  // C_GUARD: a stored value was not finite
#pragma unroll
  for (uint i = 0; i < WPTM; ++i) {
    const uint row = row0 + ((i / VW) * RTSM + tm) * VW + i % VW;
    if (row >= M) continue;
#pragma unroll
    for (uint j = 0; j < WPTN; ++j) {
      const uint col = col0 + ((j / VW) * RTSN + tn) * VW + j % VW;
      if (col >= N) continue;
      const ulong at = c_off + (ulong)row * N + col;
      float out = alpha * acc[i][j];
      if (beta != 0.0f) out = fma(beta, LOAD(C_NAME, c, at), out);  // beta = 0: C is not read (it may hold NaN)
      if (has_bias) out += bias[bias_off + col];
#if C_DACT
      out = DACT(AS_STORED(out, c, at), LOAD(C_NAME, dz, dz_off + (ulong)row * N + col));
#endif
      out = RELU(out);
      STORE(C_NAME, out, c, at);
      guard_bad = guard_bad || GUARD_BAD(out);
    }
  }
  GUARD_SET(guard_bad, guard, guard_off);
}
