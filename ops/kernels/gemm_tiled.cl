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
//  - No index arithmetic in the loops: every load, store and read of a step sits at a constant
//    offset from one base per work-item and step (see FIXED below). Integer instructions share the
//    issue slots with the multiply-adds; computed per access they cost a third of them.
// Parameters (-D): TSM, TSN, TSK, WPTM, WPTN, VW (1, 2 or 4, dividing WPTM and WPTN), VG (1 or 4), TRANS_A,
// TRANS_B, and the storage types A_NAME / B_NAME / C_NAME = F32 | F16 | BF16 (dtype.clh; F32 when
// not given): narrow operands are widened as they are staged in local memory and C is rounded as
// it is stored, so mixed precision needs no f32 copies. Offsets and strides are whole elements. C_RELU and C_DACT select an epilogue (gemm_epilogue.clh) with
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
#if VG == 4 && (A_IS_F32 || B_IS_F32) && (TSM % 4 != 0 || TSN % 4 != 0 || TSK % 4 != 0)
#error "VG=4 needs TSM, TSN and TSK multiples of 4"
#endif
// A step's tile of A holds TSK x TSM elements, of B TSK x TSN. Work-item tid moves element
// i = tid + r THREADS (r < X_LOADS) of a tile, counted in the order the operand lies in global
// memory, so that neighbouring work-items read neighbouring addresses: outer index i / X_IN, inner
// index i % X_IN, the inner dimension being the one along which the operand is contiguous (k for a
// row-major A and a transposed B, m for a transposed A, n for a row-major B). With float4 loads
// (VG=4) the same holds of float4s, X_IN / 4 of them along the inner dimension.
#if TRANS_A
#define A_IN TSM
#define A_OUT TSK
#define A_LOCAL(o, n) ((o) * LDA + (n))  // the tiles are k-major
#else
#define A_IN TSK
#define A_OUT TSM
#define A_LOCAL(o, n) ((n) * LDA + (o))
#endif
#if TRANS_B
#define B_IN TSK
#define B_OUT TSN
#define B_LOCAL(o, n) ((n) * LDB + (o))
#else
#define B_IN TSN
#define B_OUT TSK
#define B_LOCAL(o, n) ((o) * LDB + (n))
#endif
// FIXED: the group's work-items are a multiple of the inner extent (every tile the tuner tries), so
// a work-item's inner index is the same for all its loads and its outer index grows by OSTEP = THREADS
// / X_IN from one to the next: each load's global and local offsets are one base per work-item plus
// a constant, not an index computed per load (clang's PTX of the index form had three integer
// instructions per local read in the k loop, 384 per 1024 multiply-adds of the H200 row).
#define A_FIXED (THREADS % A_IN == 0)
#define B_FIXED (THREADS % B_IN == 0)
#define A_OSTEP (THREADS / A_IN)
#define B_OSTEP (THREADS / B_IN)
#define A_LOADS ((TSK * TSM + THREADS - 1) / THREADS)
#define B_LOADS ((TSK * TSN + THREADS - 1) / THREADS)
#define A_PARTIAL (A_LOADS * THREADS != TSK * TSM)  // the last load of some work-items lies past the tile
#define B_PARTIAL (B_LOADS * THREADS != TSK * TSN)
// float4 loads per work-item and step (the last ones partly idle when a tile has fewer float4s
// than the group has work-items), and the registers that hold a step's loads either way.
#define A_VECS (TSK * TSM / 4)
#define B_VECS (TSK * TSN / 4)
#define A_VLOADS ((A_VECS + THREADS - 1) / THREADS)
#define B_VLOADS ((B_VECS + THREADS - 1) / THREADS)
#define A_VOSTEP (THREADS / (A_IN / 4))
#define B_VOSTEP (THREADS / (B_IN / 4))
// float4 loads of an f32 operand (VG=4) where the group's work-items are a multiple of the float4s
// along its contiguous tile dimension (every tile the tuner tries; an odd tile of a hand-written
// row loads floats, as the edges do).
#define A_VEC (VG == 4 && A_IS_F32 && A_IN % 4 == 0 && THREADS % (A_IN / 4 + (A_IN < 4)) == 0)
#define B_VEC (VG == 4 && B_IS_F32 && B_IN % 4 == 0 && THREADS % (B_IN / 4 + (B_IN < 4)) == 0)
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

  // The operands' leading dimensions, the global offset of the first step's tiles (row0 or col0,
  // k_begin) and how far each step moves them along k.
  const ulong a_ld = TRANS_A ? M : K, b_ld = TRANS_B ? K : N;
  ulong a_tile = TRANS_A ? a_off + (ulong)k_begin * M + row0 : a_off + (ulong)row0 * K + k_begin;
  ulong b_tile = TRANS_B ? b_off + (ulong)col0 * K + k_begin : b_off + (ulong)k_begin * N + col0;
  const ulong a_kstep = TRANS_A ? (ulong)TSK * M : TSK, b_kstep = TRANS_B ? TSK : (ulong)TSK * N;
  // Rows of A and columns of B this group's tiles have inside the matrix (TSM, TSN or fewer).
  const uint a_rows = min((uint)TSM, M - row0), b_cols = min((uint)TSN, N - col0);
#if A_FIXED
  const uint a_o = tid / A_IN, a_n = tid % A_IN;  // this work-item's first element of a tile
  const ulong a_at = (ulong)a_o * a_ld + a_n, a_rstep = (ulong)A_OSTEP * a_ld;
#endif
#if B_FIXED
  const uint b_o = tid / B_IN, b_n = tid % B_IN;
  const ulong b_at = (ulong)b_o * b_ld + b_n, b_rstep = (ulong)B_OSTEP * b_ld;
#endif
#if A_VEC
  const uint a_vo = tid / (A_IN / 4), a_vn = tid % (A_IN / 4) * 4;  // its first float4
  const ulong a_vat = (ulong)a_vo * a_ld + a_vn, a_vrstep = (ulong)A_VOSTEP * a_ld;
#endif
#if B_VEC
  const uint b_vo = tid / (B_IN / 4), b_vn = tid % (B_IN / 4) * 4;
  const ulong b_vat = (ulong)b_vo * b_ld + b_vn, b_vrstep = (ulong)B_VOSTEP * b_ld;
#endif
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
    __local float* const a_buf = asf + buf * (TSK * LDA);
    __local float* const b_buf = bsf + buf * (TSK * LDB);
    if (t > 0) {  // the same for the whole group, so the barrier below is reached by all
#if A_VEC
      if (a_vec) {
        __local float* const to = a_buf + A_LOCAL(a_vo, a_vn);
#pragma unroll
        for (uint r = 0; r < A_VLOADS; ++r) {
          if ((r + 1) * THREADS > A_VECS && a_vo + r * A_VOSTEP >= A_OUT) continue;
#if TRANS_A  // the float4 runs along m: one vector store
          *(__local float4*)(to + r * A_VOSTEP * LDA) =
              (float4)(ra[4 * r], ra[4 * r + 1], ra[4 * r + 2], ra[4 * r + 3]);
#else  // along k: four rows of the tile
#pragma unroll
          for (uint q = 0; q < 4; ++q) to[r * A_VOSTEP + q * LDA] = ra[4 * r + q];
#endif
        }
      } else
#endif
      {
#if A_FIXED
        __local float* const to = a_buf + A_LOCAL(a_o, a_n);
#pragma unroll
        for (uint r = 0; r < A_LOADS; ++r) {
          if (!A_PARTIAL || a_o + r * A_OSTEP < A_OUT) to[A_LOCAL(r * A_OSTEP, 0)] = ra[r];
        }
#else
#pragma unroll
        for (uint r = 0; r < A_LOADS; ++r) {
          const uint i = tid + r * THREADS;
          if (i < TSK * TSM) a_buf[A_LOCAL(i / A_IN, i % A_IN)] = ra[r];
        }
#endif
      }
#if B_VEC
      if (b_vec) {
        __local float* const to = b_buf + B_LOCAL(b_vo, b_vn);
#pragma unroll
        for (uint r = 0; r < B_VLOADS; ++r) {
          if ((r + 1) * THREADS > B_VECS && b_vo + r * B_VOSTEP >= B_OUT) continue;
#if TRANS_B  // along k
#pragma unroll
          for (uint q = 0; q < 4; ++q) to[r * B_VOSTEP + q * LDB] = rb[4 * r + q];
#else  // along n
          *(__local float4*)(to + r * B_VOSTEP * LDB) =
              (float4)(rb[4 * r], rb[4 * r + 1], rb[4 * r + 2], rb[4 * r + 3]);
#endif
        }
      } else
#endif
      {
#if B_FIXED
        __local float* const to = b_buf + B_LOCAL(b_o, b_n);
#pragma unroll
        for (uint r = 0; r < B_LOADS; ++r) {
          if (!B_PARTIAL || b_o + r * B_OSTEP < B_OUT) to[B_LOCAL(r * B_OSTEP, 0)] = rb[r];
        }
#else
#pragma unroll
        for (uint r = 0; r < B_LOADS; ++r) {
          const uint i = tid + r * THREADS;
          if (i < TSK * TSN) b_buf[B_LOCAL(i / B_IN, i % B_IN)] = rb[r];
        }
#endif
      }
      barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (t < steps) {
      // Global -> registers for step t (multiplied at step t + 1). Inside the matrix (a whole tile
      // and a whole k step) without bounds checks; at the edges zeros past them.
      const uint k0 = k_begin + t * TSK;
      const uint k_left = min((uint)TSK, k_end - k0);
      const bool whole_k = k_left == TSK;
      a_vec = a_vec_tile && whole_k;
      b_vec = b_vec_tile && whole_k;
      // The tile's extent along the outer and inner dimensions of each operand.
      const uint a_olim = TRANS_A ? k_left : a_rows, a_nlim = TRANS_A ? a_rows : k_left;
      const uint b_olim = TRANS_B ? b_cols : k_left, b_nlim = TRANS_B ? k_left : b_cols;
#if A_VEC
      if (a_vec) {
#pragma unroll
        for (uint r = 0; r < A_VLOADS; ++r) {
          const bool in = (r + 1) * THREADS <= A_VECS || a_vo + r * A_VOSTEP < A_OUT;
          const float4 x = in ? *(__global const float4*)(a + a_tile + a_vat + r * a_vrstep) : (float4)(0.0f);
          ra[4 * r] = x.s0, ra[4 * r + 1] = x.s1, ra[4 * r + 2] = x.s2, ra[4 * r + 3] = x.s3;
        }
      } else
#endif
      {
#if A_FIXED
        if (a_olim == A_OUT && a_nlim == A_IN) {
#pragma unroll
          for (uint r = 0; r < A_LOADS; ++r) {
            const bool in = !A_PARTIAL || a_o + r * A_OSTEP < A_OUT;
            ra[r] = in ? LOAD(A_NAME, a, a_tile + a_at + r * a_rstep) : 0.0f;
          }
        } else {
#pragma unroll
          for (uint r = 0; r < A_LOADS; ++r) {
            const bool in = a_o + r * A_OSTEP < a_olim && a_n < a_nlim;
            ra[r] = in ? LOAD(A_NAME, a, a_tile + a_at + r * a_rstep) : 0.0f;
          }
        }
#else
#pragma unroll
        for (uint r = 0; r < A_LOADS; ++r) {
          const uint i = tid + r * THREADS, o = i / A_IN, n = i % A_IN;
          const bool in = i < TSK * TSM && o < a_olim && n < a_nlim;
          ra[r] = in ? LOAD(A_NAME, a, a_tile + (ulong)o * a_ld + n) : 0.0f;
        }
#endif
      }
#if B_VEC
      if (b_vec) {
#pragma unroll
        for (uint r = 0; r < B_VLOADS; ++r) {
          const bool in = (r + 1) * THREADS <= B_VECS || b_vo + r * B_VOSTEP < B_OUT;
          const float4 x = in ? *(__global const float4*)(b + b_tile + b_vat + r * b_vrstep) : (float4)(0.0f);
          rb[4 * r] = x.s0, rb[4 * r + 1] = x.s1, rb[4 * r + 2] = x.s2, rb[4 * r + 3] = x.s3;
        }
      } else
#endif
      {
#if B_FIXED
        if (b_olim == B_OUT && b_nlim == B_IN) {
#pragma unroll
          for (uint r = 0; r < B_LOADS; ++r) {
            const bool in = !B_PARTIAL || b_o + r * B_OSTEP < B_OUT;
            rb[r] = in ? LOAD(B_NAME, b, b_tile + b_at + r * b_rstep) : 0.0f;
          }
        } else {
#pragma unroll
          for (uint r = 0; r < B_LOADS; ++r) {
            const bool in = b_o + r * B_OSTEP < b_olim && b_n < b_nlim;
            rb[r] = in ? LOAD(B_NAME, b, b_tile + b_at + r * b_rstep) : 0.0f;
          }
        }
#else
#pragma unroll
        for (uint r = 0; r < B_LOADS; ++r) {
          const uint i = tid + r * THREADS, o = i / B_IN, n = i % B_IN;
          const bool in = i < TSK * TSN && o < b_olim && n < b_nlim;
          rb[r] = in ? LOAD(B_NAME, b, b_tile + (ulong)o * b_ld + n) : 0.0f;
        }
#endif
      }
      a_tile += a_kstep;
      b_tile += b_kstep;
    }
    if (t > 0) {
      // This work-item's rows (columns) of the tile: runs of VW from tm (tn) on, strided by the
      // group's extent; one base pointer per step, every read at a constant offset from it.
      __local const VTYPE* const a_rd = (__local const VTYPE*)a_buf + tm;
      __local const VTYPE* const b_rd = (__local const VTYPE*)b_buf + tn;
#pragma unroll
      for (uint kk = 0; kk < TSK; ++kk) {
        float av[WPTM], bv[WPTN];
#pragma unroll
        for (uint g = 0; g < WPTM / VW; ++g) {
          const VTYPE v = a_rd[kk * (LDA / VW) + g * RTSM];
          UNPACK(v, av + g * VW);
        }
#pragma unroll
        for (uint g = 0; g < WPTN / VW; ++g) {
          const VTYPE v = b_rd[kk * (LDB / VW) + g * RTSN];
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
  bool guard_bad = false;  // C_GUARD: a stored value was not a usable gradient (guard.clh)
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
