// Register-blocked GEMM for CPU devices (PoCL and the like), in up to three kernels:
//   gemm_pack_b  copies op(B) into k-major panels NB = 16 * NV columns wide, zero-padded past N;
//   gemm_pack_a  (PA = 1) copies A into row blocks of RB rows as f32, k-major: the RB values of
//                one k step are contiguous, so a block is one sequential stream instead of RB
//                floats M apart per k step, widened once (the binding packs a transposed f32 A and
//                any f16 A: ops/gemm.cpp);
//   gemm_packed  gives each work-item RB rows x NB columns of C, held in float16 accumulators:
//                per k step NV vload16 of the B panel, RB scalar broadcasts of A and fma().
// Launch gemm_packed with local size 1 and the row-block index on dimension 0, so that
// consecutive work-groups share one B panel. Parameters (-D): RB (1..16), NV (1..4), PA (0, 1),
// KU (k steps the main loop is unrolled by), WB (row blocks a work-item runs one after another
// against its panel: fewer work-groups, whose set-up PoCL pays each time, and the panel read from
// the core's caches after the first), TRANS_A, TRANS_B, NB_LAYOUT (the packed panels' width),
// OWN_PANEL, K_CHUNK. A last panel that N leaves mostly empty runs in a launch of its own, built
// with fewer vectors and reading the panels as packed (NB_LAYOUT), from panel `panel0`. With
// OWN_PANEL (ops/gemm.cpp `own_panel`) there is no gemm_pack_b launch: gemm_packed
// runs one work-item per panel (dimension 0 is 1), which packs its panel from `b` into the usual
// place and then computes every row block against it; with OWN_TAIL its work-items also pack the
// panel that the narrower launch after it reads.
// A strided batch (GemmShape::batch) runs in the same launches: product z of the batch reads A, B
// and writes C z matrices past their offsets (M K, K N and M N elements), its packed panels follow
// the previous product's; dimension 2 of both kernels counts the products (times the K splits).
//
// The accumulators are named variables, expanded by macros for every row and vector up to the
// maximum and guarded by compile-time conditions: the compiler drops the unused ones and keeps the
// rest in registers (arrays indexed in loops ended up on the stack with PoCL's LLVM).
// Storage types (dtype.clh): -DA_NAME / -DB_NAME / -DC_NAME = F32 | F16 | BF16 with
// -DA_IS_F32 etc. saying whether it is F32. Products and sums are fp32; B is widened while it is
// packed, A when it is packed (an f16 A always is) or else when it is read, C rounded once when it
// is stored. The F32 paths are the original code (pointer arithmetic, vector loads); the narrow
// ones index whole elements (16 at a time through LOAD16 / STORE16 where they can).
#define FERRY_WIDE16 1  // LOAD16, STORE16, ROUND16 (dtype.clh)
#include "dtype.clh"
#include "transpose16.clh"
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

#include "gemm_epilogue.clh"  // C_RELU, C_DACT: after C's type is known

#define NB (16 * NV)
// Width of the packed panels in memory: NB, except in the launch of a narrower last panel
// (ops/gemm.cpp, `tail_panel`), which reads the first NB of its NB_LAYOUT columns.
#ifndef NB_LAYOUT
#define NB_LAYOUT NB
#endif
#ifndef PA
#define PA 0
#endif
#ifndef KU
#define KU 1
#endif
#ifndef WB
#define WB 1  // row blocks per work-item (without OWN_PANEL, which runs all of them)
#endif
#ifndef OWN_PANEL
#define OWN_PANEL 0  // 1: each gemm_packed work-item packs its own panel of B (no gemm_pack_b)
#endif
#if OWN_PANEL && (B_PLANES || DIRECT_B)
#error "OWN_PANEL packs B from rows (not planes, not read in place)"
#endif
#ifndef OWN_TAIL
#define OWN_TAIL 0  // 1 (with OWN_PANEL): a launch of the last panel alone follows, whose panel this one packs
#endif
#ifndef DIRECT_B
#define DIRECT_B 0  // 1: `packed` is B itself, row-major [K, N] (not packed)
#endif
// With DIRECT_B, 1 when N is not a multiple of NB: the last panel reads its columns one by one,
// zeros past N. Compiled only where needed: the branch slowed PoCL's code for the whole-panel loop
// (long-K weight gradients 1.3x slower with it).
#ifndef DIRECT_B_TAIL
#define DIRECT_B_TAIL 0
#endif
// The packs' work-item sizes come from ops/gemm.cpp (PackSizes), which sizes their launches by
// them: PACK_ROWS k rows of op(B) per gemm_pack_b work-item; PACK_A_COLS k columns of a row-major
// A, or PACK_A_TK k rows of PACK_A_GROUP_VALUES / RB row blocks of a transposed A, per gemm_pack_a
// work-item.
#if !defined(PACK_ROWS) || !defined(PACK_A_COLS) || !defined(PACK_A_TK) || !defined(PACK_A_GROUP_VALUES)
#error "gemm_packed.cl is built by ops/gemm.cpp, which defines the packs' work-item sizes (PackSizes)"
#endif
#ifndef B_PLANES
#define B_PLANES 0  // > 0: B's stored matrix is NCHW planes of B_PLANES columns (GemmOptions::b_planes)
#endif
#ifndef C_PLANES
#define C_PLANES 0  // > 0: C element (m, n) at ((m / C_PLANES) * N + n) * C_PLANES + m % C_PLANES
#endif

#define FOR_ROWS(X) FOR_16(X)

// PACK_BLOCK16 packs one block: row r read as the float16 LOAD_ROW(r), row i of its transpose
// stored at STORE_AT(i) (both defined where it is used).
#define BLOCK_LOAD(n) float16 r##n = LOAD_ROW(n);
#define BLOCK_STORE(n) vstore16(r##n, 0, STORE_AT(n));
#define PACK_BLOCK16      \
  {                       \
    FOR_ROWS(BLOCK_LOAD)  \
    TRANSPOSE16           \
    FOR_ROWS(BLOCK_STORE) \
  }

#if TRANS_B && !B_PLANES
// 16 columns j0.. of op(B), B stored [N, K] (op(B)[k][j] = B[j][k]), for k in [k0, k_end), into
// `dst` (op(B) row k at dst + k NB_LAYOUT): 16 k at a time transposed in registers, so that 16
// contiguous runs of B are read and 16 contiguous runs of the panel written (scattering single
// floats with a stride of NB was 2x slower end to end); the last k and the columns past N (zeros)
// element by element. A narrow B is widened 16 elements at a time (LOAD16).
inline void pack_b_columns16(uint N, uint K, __global const STORAGE(B_NAME)* b, ulong b_off, __global float* dst,
                             uint j0, uint k0, uint k_end) {
  uint k = k0;
  if (j0 + 16 <= N) {
    for (; k + 16 <= k_end; k += 16) {
#define LOAD_ROW(r) LOAD16(B_NAME, b, b_off + (ulong)(j0 + r) * K + k)
#define STORE_AT(i) dst + (ulong)(k + i) * NB_LAYOUT
      PACK_BLOCK16
#undef LOAD_ROW
#undef STORE_AT
    }
  }
  for (; k < k_end; ++k) {
    for (uint r = 0; r < 16; ++r) {
      dst[(ulong)k * NB_LAYOUT + r] = j0 + r < N ? LOAD(B_NAME, b, b_off + (ulong)(j0 + r) * K + k) : 0.0f;
    }
  }
}
#endif

#if !TRANS_B && !B_PLANES
// Columns col.. col + 15 of row-major B's row that starts at element `row`, widened where B is
// narrow (16 at a time where 16 lie in the row), into the 16 floats at dst: zeros past N.
inline void pack_b_row16(uint N, __global const STORAGE(B_NAME)* b, ulong row, __global float* dst, uint col) {
  if (col + 16 <= N) {
    vstore16(LOAD16(B_NAME, b, row + col), 0, dst);
  } else {
    for (uint i = 0; i < 16; ++i) dst[i] = col + i < N ? LOAD(B_NAME, b, row + col + i) : 0.0f;
  }
}
#endif

#if !TRANS_B && !B_PLANES
// Columns j0.. j0 + 15 of a row-major B for k in [k0, k_end) into `dst` (op(B) row k at dst + k
// NB_LAYOUT), as pack_b_columns16 does for a transposed B.
// (K is not read: the parameters are pack_b_columns16's, so OWN_PANEL calls either alike.)
inline void pack_b_rows16(uint N, uint K, __global const STORAGE(B_NAME)* b, ulong b_off, __global float* dst,
                          uint j0, uint k0, uint k_end) {
  for (uint k = k0; k < k_end; ++k) pack_b_row16(N, b, b_off + (ulong)k * N, dst + (ulong)k * NB_LAYOUT, j0);
}
#define PACK_OWN_COLUMNS16 pack_b_rows16
#else
#define PACK_OWN_COLUMNS16 pack_b_columns16
#endif

// One work-item packs PACK_ROWS k rows of op(B) of product get_global_id(2): all columns, padding
// included (transposed B: a block of 16 columns, see below).
__kernel void gemm_pack_b(uint N, uint K, __global const STORAGE(B_NAME)* b, ulong b_off, __global float* packed,
                          ulong packed_off) {
  const uint k0 = get_global_id(0) * PACK_ROWS;
  const uint k_end = min(k0 + PACK_ROWS, K);
  const uint n_pad = (N + NB_LAYOUT - 1) / NB_LAYOUT * NB_LAYOUT;
  const ulong product = get_global_id(2);
  b_off += product * ((ulong)K * N);
  packed += packed_off + product * ((ulong)n_pad * K);
#if B_PLANES
  // B an NCHW view: element (i, j) of the stored matrix [rows, cols] at ((j / P) * rows + i) * P
  // + j % P. A work-item fills 16 columns of its PACK_ROWS panel rows (contiguous writes; the reads
  // run along a plane for a row-major B, across channels for a transposed one).
  const uint j0 = get_global_id(1) * 16;
  if (j0 >= n_pad) return;
  const uint rows = TRANS_B ? N : K;
  // Blocks of 16 pixels k within one plane for 16 whole channels j go 16 contiguous runs read (one
  // per channel), transposed in registers, 16 contiguous runs written (element by element this pack
  // ran at a third of the copy bandwidth); rows of a block across planes, and the last columns,
  // element by element.
  for (uint k = k0; k < k_end;) {
#if TRANS_B && B_IS_F32
    if (j0 + 16 <= N && k + 16 <= k_end && k / B_PLANES == (k + 15) / B_PLANES) {
      const ulong base = b_off + (ulong)(k / B_PLANES) * rows * B_PLANES + k % B_PLANES;
      __global float* dst = packed + ((ulong)(j0 / NB_LAYOUT) * K + k) * NB_LAYOUT + j0 % NB_LAYOUT;
#define LOAD_ROW(r) vload16(0, b + base + (ulong)(j0 + r) * B_PLANES)
#define STORE_AT(i) dst + (ulong)(i) * NB_LAYOUT
      PACK_BLOCK16
#undef LOAD_ROW
#undef STORE_AT
      k += 16;
      continue;
    }
#endif
    __global float* dst = packed + ((ulong)(j0 / NB_LAYOUT) * K + k) * NB_LAYOUT + j0 % NB_LAYOUT;
    for (uint r = 0; r < 16; ++r) {
      const uint j = j0 + r;
      const uint si = TRANS_B ? j : k, sj = TRANS_B ? k : j;  // stored row and column
      const ulong at = b_off + ((ulong)(sj / B_PLANES) * rows + si) * B_PLANES + sj % B_PLANES;
      dst[r] = j < N ? LOAD(B_NAME, b, at) : 0.0f;
    }
    ++k;
  }
}
#elif TRANS_B
  // B stored [N, K]: a block of 16 columns j by PACK_ROWS (16) k rows.
  const uint j0 = get_global_id(1) * 16;
  if (j0 >= n_pad) return;
  pack_b_columns16(N, K, b, b_off, packed + ((ulong)(j0 / NB_LAYOUT) * K) * NB_LAYOUT + j0 % NB_LAYOUT, j0, k0, k_end);
}
#else
  // 16 columns at a time, their k rows one after another: each block's rows go to its panel as one
  // contiguous run. Row after row, with panels of 16 columns (NV = 1, the AVX2 row), every row
  // wrote 64 bytes into each of N / 16 panels 64 K bytes apart: 1024 x 1024 packed in 0.23-0.25
  // ms, against 0.06 this way (bench/RESULTS.md, "B's pack by columns").
  for (uint col = 0; col < n_pad; col += 16) {
    for (uint k = k0; k < k_end; ++k) {
      pack_b_row16(N, b, b_off + (ulong)k * N, packed + ((ulong)(col / NB_LAYOUT) * K + k) * NB_LAYOUT + col % NB_LAYOUT,
                   col);
    }
  }
}
#endif  // B_PLANES, TRANS_B, B_IS_F32

// A transposed A ([K, M]): a work-item copies PACK_A_TK k rows of PACK_A_GROUP row blocks (about
// PACK_A_GROUP_VALUES values of each row).
#define PACK_A_GROUP (PACK_A_GROUP_VALUES / RB)

// RB floats from src to dst in vector moves where RB is a sum of a few vector widths (element by
// element the transposed pack ran at 1.5 floats a cycle).
#if RB == 16
#define COPY_RB(dst, src) vstore16(vload16(0, src), 0, dst)
#elif RB == 12
#define COPY_RB(dst, src) (vstore8(vload8(0, src), 0, dst), vstore4(vload4(0, (src) + 8), 0, (dst) + 8))
#elif RB == 8
#define COPY_RB(dst, src) vstore8(vload8(0, src), 0, dst)
#elif RB == 6
#define COPY_RB(dst, src) (vstore4(vload4(0, src), 0, dst), vstore2(vload2(0, (src) + 4), 0, (dst) + 4))
#elif RB == 4
#define COPY_RB(dst, src) vstore4(vload4(0, src), 0, dst)
#else
#define COPY_RB(dst, src)                              \
  {                                                    \
    for (uint r_ = 0; r_ < RB; ++r_) (dst)[r_] = (src)[r_]; \
  }
#endif

// Packed row k of a row block holds op(A)(block RB + r, k) for r < RB, rows past M repeating row
// M - 1 (their results are never stored). The binding packs a transposed f32 A and any f16 A
// (ops/gemm.cpp, fit_packed); the kernel still builds in every program of this file, where it may
// never be launched. Dimension 2 counts the products of a batch.
__kernel void gemm_pack_a(uint M, uint K, __global const STORAGE(A_NAME)* a, ulong a_off, __global float* packed,
                          ulong packed_off) {
  const ulong product = get_global_id(2);
  const uint blocks = (M + RB - 1) / RB;
  a_off += product * ((ulong)M * K);
  packed += packed_off + product * blocks * ((ulong)K * RB);
#if TRANS_A
  // A stored [K, M]: the block's RB values of one k are contiguous, so the work-item's k rows are
  // read along their length, block after block. One block by 128 k rows a work-item instead read
  // 128 lines M floats apart, which for M a power of two all fall in one cache set and came again
  // from memory for the next block: 16 GB/s on the Zen 5 EPYC. PACK_A_TK rows stay within a set's
  // ways. A narrow A's values are widened 16 at once where 16 from the block's first lie in the row
  // (RB <= 16; the rest are not used).
  const uint k0 = get_global_id(1) * PACK_A_TK, k_end = min(k0 + PACK_A_TK, K);
  const uint first = get_global_id(0) * PACK_A_GROUP, last = min(first + PACK_A_GROUP, blocks);
  for (uint block = first; block < last; ++block) {
    __global float* dst = packed + block * ((ulong)K * RB);
    for (uint k = k0; k < k_end; ++k) {
      const ulong at = a_off + (ulong)k * M + block * RB;
#if !A_IS_F32
      if (block * RB + 16 <= M) {
        float t[16];
        vstore16(LOAD16(A_NAME, a, at), 0, t);
        for (uint r = 0; r < RB; ++r) dst[(ulong)k * RB + r] = t[r];
        continue;
      }
#endif
      if (block * RB + RB <= M) {
#if A_IS_F32
        COPY_RB(dst + (ulong)k * RB, a + at);
#else
        for (uint r = 0; r < RB; ++r) dst[(ulong)k * RB + r] = LOAD(A_NAME, a, at + r);
#endif
      } else {
        for (uint r = 0; r < RB; ++r) {
          dst[(ulong)k * RB + r] = LOAD(A_NAME, a, a_off + (ulong)k * M + min(block * RB + r, M - 1));
        }
      }
    }
  }
#else
  // A stored [M, K], a work-item PACK_A_COLS k of one block: 16 k of each of the block's rows read
  // and widened at once, then written as one contiguous run of 16 RB floats.
  const uint block = get_global_id(0);
  const uint k0 = get_global_id(1) * PACK_A_COLS, k_end = min(k0 + PACK_A_COLS, K);
  __global float* dst = packed + block * ((ulong)K * RB);
  uint k = k0;
  for (; k + 16 <= k_end; k += 16) {
    float t[RB][16];
    for (uint r = 0; r < RB; ++r) {
      vstore16(LOAD16(A_NAME, a, a_off + (ulong)min(block * RB + r, M - 1) * K + k), 0, t[r]);
    }
    for (uint j = 0; j < 16; ++j) {
      for (uint r = 0; r < RB; ++r) dst[(ulong)(k + j) * RB + r] = t[r][j];
    }
  }
  for (; k < k_end; ++k) {
    for (uint r = 0; r < RB; ++r) dst[(ulong)k * RB + r] = LOAD(A_NAME, a, a_off + (ulong)min(block * RB + r, M - 1) * K + k);
  }
#endif
}

// C_STREAM = 1 (ops/gemm.cpp `stream_c`): an f32 C larger than the caches keep is written past
// them, a whole 64-byte line by non-temporal stores where the 16 values are one line, so that
// storing C does not first read every line of it from memory (a write-allocate) and evict what the
// product reads; an sfence after a work-item's stores orders them before its completion is seen.
// Only on x86 CPU devices (elsewhere, and where the compiler lacks the builtins, the usual store).
#ifndef C_STREAM
#define C_STREAM 0
#endif
#if C_STREAM && defined(__x86_64__) && defined(__has_builtin)
#if __has_builtin(__builtin_nontemporal_store) && __has_builtin(__builtin_ia32_sfence)
#define FERRY_STREAM_C 1
#endif
#endif
#ifdef FERRY_STREAM_C
#define STORE16_C(v, p)                                                   \
  if (((ulong)(p) & 63) == 0) {                                           \
    __builtin_nontemporal_store((v).lo, (__global float8*)(p));           \
    __builtin_nontemporal_store((v).hi, (__global float8*)(p) + 1);       \
  } else {                                                                \
    VSTORE16_GLOBAL(v, p);                                                \
  }
#else
#define STORE16_C(v, p) VSTORE16_GLOBAL(v, p)
#endif

// out = alpha * acc + beta * C + bias for 16 columns starting at `col` of one row of C (then the
// ReLU or the activation's derivative at z, whose row starts at element zrow of zb).
#if C_PLANES
// C as NCHW planes: `row` is m; the 16 columns are channels, C_PLANES apart.
inline bool store16(float16 acc, __global STORAGE(C_NAME)* c, ulong c_base, uint row, uint col, uint N, float alpha,
                    float beta, __global const float* bias, uint has_bias, __global const STORAGE(C_NAME)* zb,
                    ulong zrow) {
  if (col >= N) return false;
  float tmp[16];
  vstore16(alpha * acc, 0, tmp);
  const ulong base = c_base + (ulong)(row / C_PLANES) * N * C_PLANES + row % C_PLANES;
  for (uint i = 0; i < 16 && col + i < N; ++i) {
    const ulong at = base + (ulong)(col + i) * C_PLANES;
    float out = tmp[i];
    if (beta != 0.0f) out = fma(beta, LOAD(C_NAME, c, at), out);
    if (has_bias) out += bias[col + i];
    STORE(C_NAME, RELU(out), c, at);
  }
  return false;  // no C_GUARD with planes
}
#elif C_IS_F32
// Returns whether a value it stored is not finite (always false without C_GUARD).
inline bool store16(float16 acc, __global float* crow, uint col, uint N, float alpha, float beta,
                    __global const float* bias, uint has_bias, __global const float* zb, ulong zrow) {
  if (col >= N) return false;
  if (col + 16 <= N) {
    float16 out = alpha * acc;
    if (beta != 0.0f) out = fma((float16)(beta), vload16(0, crow + col), out);  // beta = 0: C is not read
    if (has_bias) out += vload16(0, bias + col);
#if C_DACT
    out = DACT16(out, vload16(0, zb + zrow + col));
#endif
    out = RELU16(out);
    STORE16_C(out, crow + col);
    return GUARD_BAD16(out);
  }
  float tmp[16];
  vstore16(alpha * acc, 0, tmp);
  bool bad = false;
  for (uint i = 0; col + i < N; ++i) {
    float out = tmp[i];
    if (beta != 0.0f) out = fma(beta, crow[col + i], out);
    if (has_bias) out += bias[col + i];
#if C_DACT
    out = DACT(out, zb[zrow + col + i]);
#endif
    out = RELU(out);
    crow[col + i] = out;
    bad = bad || GUARD_BAD(out);
  }
  return bad;
}
#else
// A narrow C: `crow` is the element index of the row's first element in c.
// Whole chunks 16 wide: each lane as the loop below computes it (ROUND16 is AS_STORED).
inline bool store16(float16 acc, __global STORAGE(C_NAME)* c, ulong crow, uint col, uint N, float alpha, float beta,
                    __global const float* bias, uint has_bias, __global const STORAGE(C_NAME)* zb, ulong zrow) {
  if (col >= N) return false;
  if (col + 16 <= N) {
    float16 out = alpha * acc;
    if (beta != 0.0f) out = fma((float16)(beta), LOAD16(C_NAME, c, crow + col), out);
    if (has_bias) out += vload16(0, bias + col);
#if C_DACT
    out = DACT16(ROUND16(C_NAME, out), LOAD16(C_NAME, zb, zrow + col));
#endif
    STORE16(C_NAME, RELU16(out), c, crow + col);
    return false;  // no C_GUARD with a narrow C
  }
  float tmp[16];
  vstore16(alpha * acc, 0, tmp);
  for (uint i = 0; i < 16 && col + i < N; ++i) {
    float out = tmp[i];
    if (beta != 0.0f) out = fma(beta, LOAD(C_NAME, c, crow + col + i), out);
    if (has_bias) out += bias[col + i];
#if C_DACT
    out = DACT(AS_STORED(out, c, crow + col + i), LOAD(C_NAME, zb, zrow + col + i));
#endif
    STORE(C_NAME, RELU(out), c, crow + col + i);
  }
  return false;  // no C_GUARD with a narrow C
}
#endif

#ifndef A_GATHER
#define A_GATHER 0  // 1: A(m, k) = a[arows[m] + acols[k]] (GemmOptions::a_gather; f32 A, not transposed)
#endif

#ifndef A_GATHER_STEP
#define A_GATHER_STEP 0  // > 0: rows of a block are A_GATHER_STEP apart (GemmOptions::a_gather_run)
#endif

#if PA
// A packed by gemm_pack_a: one pointer, RB floats per k step.
#define A_ROW_DECL(r)
#define A_AT(r) ak[r]
#elif A_GATHER && A_GATHER_STEP
// One table entry per block; M is a multiple of RB, so every row of the block exists.
#define A_ROW_DECL(r) \
  if (r == 0) ar0 = arows[row0];
#define A_AT(r) a[ar0 + kc + r * A_GATHER_STEP]
#elif A_GATHER
#define A_ROW_DECL(r) const int ar##r = arows[min(row0 + r, M - 1)];
#define A_AT(r) a[ar##r + kc]
#elif TRANS_A
// A stored [K, M]: the RB scalars of one k step are contiguous.
#define A_ROW_DECL(r) const uint ai##r = min(row0 + r, M - 1);
#if A_IS_F32
#define A_AT(r) ak[ai##r]
#else
#define A_AT(r) LOAD(A_NAME, a, ak + ai##r)
#endif
#elif A_IS_F32
#define A_ROW_DECL(r) __global const float* a##r = a + (ulong)min(row0 + r, M - 1) * K;
#define A_AT(r) a##r[k]
#else
#define A_ROW_DECL(r) const ulong a##r = a_off + (ulong)min(row0 + r, M - 1) * K;
#define A_AT(r) LOAD(A_NAME, a, a##r + k)
#endif

#define ACC_DECL(r) float16 c##r##_0 = 0.0f, c##r##_1 = 0.0f, c##r##_2 = 0.0f, c##r##_3 = 0.0f;

#define ACC_STEP(r)                              \
  if (r < RB) {                                  \
    const float16 x = (float16)(A_AT(r));        \
    c##r##_0 = fma(x, b0, c##r##_0);             \
    if (NV > 1) c##r##_1 = fma(x, b1, c##r##_1); \
    if (NV > 2) c##r##_2 = fma(x, b2, c##r##_2); \
    if (NV > 3) c##r##_3 = fma(x, b3, c##r##_3); \
  }

// What a k step needs of A beside the row pointers: the column of the gathered A, or row k of a
// transposed A.
#if PA
#define A_K __global const float* ak = ap + (ulong)k * RB;
#elif A_GATHER
#define A_K const int kc = acols[k];
#elif TRANS_A && A_IS_F32
#define A_K __global const float* ak = a + (ulong)k * M;
#elif TRANS_A
#define A_K const ulong ak = a_off + (ulong)k * M;
#else
#define A_K
#endif

// One k step: NB floats of panel row k from `row`, RB rows of A, RB x NB fma.
#define K_STEP(row)                                     \
  {                                                     \
    const float16 b0 = vload16(0, row);                 \
    const float16 b1 = NV > 1 ? vload16(1, row) : 0.0f; \
    const float16 b2 = NV > 2 ? vload16(2, row) : 0.0f; \
    const float16 b3 = NV > 3 ? vload16(3, row) : 0.0f; \
    A_K                                                 \
    FOR_ROWS(ACC_STEP)                                  \
  }

#if C_PLANES
#define C_ROW(r) const uint crow = row0 + r;
#define C_AT c, c_base, crow
#elif C_IS_F32
#define C_ROW(r) __global float* crow = c + (ulong)(row0 + r) * N;
#define C_AT crow
#else
#define C_ROW(r) const ulong crow = c_base + (ulong)(row0 + r) * N;
#define C_AT c, crow
#endif
#define ACC_STORE(r)                                                                          \
  if (r < RB && row0 + r < M) {                                                               \
    C_ROW(r)                                                                                  \
    const ulong zrow = z_base + (ulong)(row0 + r) * N;                                        \
    guard_bad |= store16(c##r##_0, C_AT, col0, N, alpha, beta, bias, has_bias, dz, zrow);                  \
    if (NV > 1) guard_bad |= store16(c##r##_1, C_AT, col0 + 16, N, alpha, beta, bias, has_bias, dz, zrow); \
    if (NV > 2) guard_bad |= store16(c##r##_2, C_AT, col0 + 32, N, alpha, beta, bias, has_bias, dz, zrow); \
    if (NV > 3) guard_bad |= store16(c##r##_3, C_AT, col0 + 48, N, alpha, beta, bias, has_bias, dz, zrow); \
  }

// K_CHUNK > 0 (ops/gemm.cpp `k_chunk_rows`): the k loop in chunks, below. Between chunks a block's
// sums are parked in C as they are and resumed from it: an f32 C in rows, beta = 0, one split, and
// the row blocks of a work-item run one after another (OWN_PANEL or WB > 1), as the binding chooses.
#ifndef K_CHUNK
#define K_CHUNK 0
#endif
// With OWN_PANEL, K_CHUNK packs the panels a chunk at a time, each just before its row blocks read
// it. PREFETCH_B = 1 (ops/gemm.cpp `prefetch_b_rows`; a row-major B whose rows lie a page or more
// apart): each row block of a chunk also prefetches its share of the next chunk's rows of B, one
// row every few k steps. The hardware prefetcher does not follow such a stride, and each row waited
// for memory when packed (15% of 192 x 768 x 4096 TN's time in perf on the AVX2 EPYC).
// PREFETCH_B = 2 (ops/gemm.cpp `prefetch_b_rows`; OWN_PANEL with K unchunked, few rows): the row
// blocks prefetch, share by share in the same way, what the next panel is packed from (its columns
// of each row of a row-major B, or its rows of a transposed one) for the work-item that packs it,
// where a device that hands its threads runs of consecutive work-groups runs it next on this core.
// Each pack of a weight that is in no cache otherwise waits for memory with the FMA units idle.
#ifndef PREFETCH_B
#define PREFETCH_B 0
#endif
#if PREFETCH_B == 1 && !(K_CHUNK && OWN_PANEL && !TRANS_B)
#error "PREFETCH_B=1 prefetches the next chunk of a row-major B packed by OWN_PANEL in K_CHUNK chunks"
#endif
#if PREFETCH_B == 2 && !(OWN_PANEL && !K_CHUNK && OWN_PANELS == 1)
#error "PREFETCH_B=2 prefetches the next panel of a B packed by OWN_PANEL a panel at a time"
#endif
// x86 only, as C_STREAM: Oclgrind's interpreter has no llvm.prefetch and cannot create the kernel.
#if PREFETCH_B && defined(__x86_64__) && defined(__has_builtin)
#if __has_builtin(__builtin_prefetch)
#define FERRY_PREFETCH_B PREFETCH_B
#endif
#endif
// Cache lines are taken as 64 bytes: elements of B per line.
#define B_LINE_ELEMS (64 / (uint)sizeof(STORAGE(B_NAME)))
// OWN_PANELS > 1 (ops/gemm.cpp `own_panels`, with K_CHUNK and OWN_PANEL): a work-item runs that
// many neighbouring panels, each chunk of them packed together and then run panel after panel: a
// row of B is then read OWN_PANELS x 64 bytes at a time (one page walk where it was one per panel),
// and the chunk of A, in L2, serves every panel of the work-item.
#ifndef OWN_PANELS
#define OWN_PANELS 1
#endif
#if OWN_PANELS > 1 && !(K_CHUNK && OWN_PANEL && NB == 16)
#error "OWN_PANELS runs several 16-wide panels of OWN_PANEL chunk by chunk (K_CHUNK)"
#endif
#if K_CHUNK && (!C_IS_F32 || C_PLANES || !(OWN_PANEL || WB > 1))
#error "K_CHUNK parks sums in an f32 C in rows, for a work-item's row blocks in turn"
#endif
#define ACC_PARK(r)                                                    \
  if (r < RB && row0 + r < M) {                                        \
    __global float* parked = c + (ulong)(row0 + r) * N + col0;         \
    vstore16(c##r##_0, 0, parked);                                     \
    if (NV > 1) vstore16(c##r##_1, 1, parked);                         \
    if (NV > 2) vstore16(c##r##_2, 2, parked);                         \
    if (NV > 3) vstore16(c##r##_3, 3, parked);                         \
  }
#define ACC_RESUME(r)                                                  \
  if (r < RB && row0 + r < M) {                                        \
    __global const float* parked = c + (ulong)(row0 + r) * N + col0;   \
    c##r##_0 = vload16(0, parked);                                     \
    if (NV > 1) c##r##_1 = vload16(1, parked);                         \
    if (NV > 2) c##r##_2 = vload16(2, parked);                         \
    if (NV > 3) c##r##_3 = vload16(3, parked);                         \
  }

// Dimension 2 counts the products of the batch times `splits`, the splits of K (k_chunk rows each;
// one split: k_chunk = K): split s sums k in [s k_chunk, (s + 1) k_chunk) into its own M x N block
// of c, gemm_sum_splits adds the blocks. Neighbouring work-items then share a B sub-panel that
// stays in cache, where a long K (a weight gradient over many rows) streams the whole panel from
// memory for every row block. Block z = product splits + s of c is the z-th M x N matrix either way.
__kernel void gemm_packed(uint M, uint N, uint K, float alpha, __global const STORAGE(A_NAME)* a, ulong a_off,
                          __global const float* packed, ulong packed_off, float beta, __global STORAGE(C_NAME)* c,
                          ulong c_off, __global const float* bias, ulong bias_off, uint has_bias, uint k_chunk,
                          uint splits, __global const int* arows, ulong arows_off, __global const int* acols,
                          ulong acols_off, __global const float* apacked, ulong apacked_off, uint group_blocks,
                          __global const STORAGE(C_NAME)* dz, ulong dz_off, __global float* guard,
                          ulong guard_off, uint panel0, __global const STORAGE(B_NAME)* b, ulong b_off) {
  // Work-groups run in the order of their linear index (row blocks fastest). With group_blocks
  // > 0 that index walks groups of group_blocks row blocks: every panel for one group, then the
  // next group, so a group's rows of A stay in cache while all of B streams past them (row blocks
  // fastest over the whole of M re-reads all of A from memory for every panel once A outgrows the
  // caches).
  uint block = get_global_id(0), panel = get_global_id(1) * OWN_PANELS;
  if (group_blocks > 0) {
    const uint blocks = get_global_size(0), panels = get_global_size(1);
    const uint linear = block + panel * blocks;
    const uint first = linear / (group_blocks * panels) * group_blocks;
    const uint rows_in = min(group_blocks, blocks - first);
    const uint within = linear - first * panels;
    panel = within / rows_in;
    block = first + within % rows_in;
  }
  // Without OWN_PANEL the block's row0 (and PA's rows) are computed here, before the rest, as they
  // always were: computed after the pointers below, the same code ran 768 x 192 x 4096 TN's
  // product in 3.83 ms instead of 3.07 on PoCL (its LLVM placed the k loop's values otherwise).
#if !OWN_PANEL
  const uint row0 = block * RB;
#endif
  const uint z = get_global_id(2);
  const ulong product = z / splits;
  const uint k_begin = (z % splits) * k_chunk, k_end = min(K, k_begin + k_chunk);
  panel += panel0;  // panel0: the launch's first panel (a narrower last one runs alone)
  const uint col0 = panel * NB_LAYOUT;
  a_off += product * ((ulong)M * K);
#if DIRECT_B
  // B in place: panel row k is B's row k from column panel NB on (contiguous), rows N apart.
  __global const float* bp = packed + packed_off + product * ((ulong)K * N) + (ulong)k_begin * N + col0;
  const uint b_step = N;
#else
  const uint n_pad = (N + NB_LAYOUT - 1) / NB_LAYOUT * NB_LAYOUT;
  __global const float* bp =
      packed + packed_off + product * ((ulong)n_pad * K) + ((ulong)panel * K + k_begin) * NB_LAYOUT;
  const uint b_step = NB_LAYOUT;
#endif
// Row block `blk`'s packed rows (gemm_pack_a); a and a_off are not read.
#define PACKED_A_ROWS(blk) (apacked + apacked_off + (product * ((M + RB - 1) / RB) + (blk)) * ((ulong)K * RB))
#if PA && !OWN_PANEL
  __global const float* ap = PACKED_A_ROWS(block);
#elif A_IS_F32 && !PA
  a += a_off;
#endif
#if C_IS_F32 && !C_PLANES
  c += c_off + (ulong)z * M * N;
#else
  const ulong c_base = c_off + (ulong)z * M * N;
#endif
  const ulong z_base = dz_off + (ulong)z * M * N;  // z of C_DACT, stored like C
  bias += bias_off;
  arows += arows_off;
  acols += acols_off;

#if OWN_PANEL || WB > 1
  // Row blocks [block_first, block_last) one after another against this panel, from its first row
  // each time: the panel's rows come from this core's caches for all but the first.
  __global const float* const panel_rows = bp;
#endif
#if OWN_PANEL
  // One work-item per panel (and split and product): it packs its rows of op(B) into the panel's
  // place itself, then runs every row block against them while they are in its core's cache.
  const ulong b_product = b_off + product * ((ulong)K * N);  // this product's B
// Rows [k_lo, k_hi) of the panel whose k_begin-th row is at `rows` and whose columns start at first_col.
#define PACK_OWN_PANEL(rows, first_col, k_lo, k_hi)                                                 \
  for (uint j = 0; j < NB; j += 16) {                                                               \
    PACK_OWN_COLUMNS16(N, K, b, b_product, (__global float*)(rows) - (ulong)k_begin * NB_LAYOUT + j, \
                       (first_col) + j, k_lo, k_hi);                                                \
  }
#if !K_CHUNK
  PACK_OWN_PANEL(panel_rows, col0, k_begin, k_end)  // (with K_CHUNK a chunk at a time, below)
#endif
#if K_CHUNK
  // This work-item's panels (OWN_PANELS of them but past N; K_CHUNK runs whole panels of N only).
  const uint own_panels = min((uint)OWN_PANELS, N / NB_LAYOUT - panel);
#endif
#if OWN_TAIL
  {
    // The panel after this launch's, which the next launch (built narrower) reads packed: every
    // work-item of the split packs an equal share of its k rows.
    const uint items = get_global_size(1), tail = panel0 + items;
    const uint share = (k_end - k_begin + items - 1) / items;
    const uint k_lo = min(k_end, k_begin + (panel - panel0) * share), k_hi = min(k_end, k_lo + share);
    __global float* tail_panel = (__global float*)panel_rows + ((ulong)(tail - panel) * K - k_begin) * NB_LAYOUT;
    for (uint j = 0; tail * NB_LAYOUT + j < N; j += 16) {
      PACK_OWN_COLUMNS16(N, K, b, b_product, tail_panel + j, tail * NB_LAYOUT + j, k_lo, k_hi);
    }
  }
#endif
  const uint block_first = 0, block_last = (M + RB - 1) / RB;  // every row block
#elif WB > 1
  const uint block_first = block * WB, block_last = min(block_first + WB, (M + RB - 1) / RB);
#endif
#if K_CHUNK
  // K in chunks of K_CHUNK rows, every row block against one chunk before the next: the chunk of a
  // transposed A read in place (its K_CHUNK rows of M floats) stays in the core's L2 and the
  // panel's chunk in L1 across the row blocks. The sums so far wait in C between chunks (f32, raw)
  // and are read back into the accumulators, so each sum takes its k steps in the same order as
  // unchunked: the same bits.
  for (uint chunk_begin = k_begin; chunk_begin < k_end; chunk_begin += K_CHUNK) {
    const uint chunk_end = min(k_end, chunk_begin + K_CHUNK);
#if OWN_PANEL && OWN_PANELS > 1 && !TRANS_B
    // A row of B at a time across all the work-item's panels (one page, one walk).
    for (uint k = chunk_begin; k < chunk_end; ++k) {
      for (uint q = 0; q < own_panels; ++q) {
        pack_b_row16(N, b, b_product + (ulong)k * N,
                     (__global float*)panel_rows + ((ulong)q * K + k - k_begin) * NB_LAYOUT, col0 + q * NB_LAYOUT);
      }
    }
#elif OWN_PANEL
    for (uint q = 0; q < own_panels; ++q) {
      PACK_OWN_PANEL(panel_rows + (ulong)q * K * NB_LAYOUT, col0 + q * NB_LAYOUT, chunk_begin, chunk_end)
    }
#endif
#else
  const uint chunk_begin = k_begin, chunk_end = k_end;
#endif
#if OWN_PANELS > 1
  // The chunk against each panel in turn: col0 and panel_rows name the panel below.
  for (uint q = 0; q < own_panels; ++q) {
    const uint col0_q = col0 + q * NB_LAYOUT;
    __global const float* const panel_rows_q = panel_rows + (ulong)q * K * NB_LAYOUT;
    {
      const uint col0 = col0_q;
      __global const float* const panel_rows = panel_rows_q;
#endif
#if OWN_PANEL || WB > 1
  for (block = block_first; block < block_last; ++block) {
    const uint row0 = block * RB;
#if PA
    __global const float* ap = PACKED_A_ROWS(block);
#endif
    // The k loop below advances it, per block.
    __global const float* bp = panel_rows + (ulong)(chunk_begin - k_begin) * b_step;
#if FERRY_PREFETCH_B == 1
    // An equal share of the next chunk's rows of B for each row block (see above), one row every
    // prefetch_every k steps of its k loop, a multiple of KU so that the unrolled loop takes them all.
    const uint share = (K_CHUNK + block_last - block_first - 1) / (block_last - block_first);
    const uint prefetch_lo = chunk_end + (block - block_first) * share, prefetch_hi = min(k_end, prefetch_lo + share);
    const uint prefetch_every = max((uint)KU, K_CHUNK / share / KU * KU);
#elif FERRY_PREFETCH_B == 2
    // The next panel's source in units of one line: a row k of a row-major B (its NB columns from
    // next_col0), or a line of one of the NB rows of a transposed B (none past N); an equal share of
    // them for each row block, as above.
    const uint next_col0 = col0 + NB_LAYOUT, k_lines = (k_end - k_begin + B_LINE_ELEMS - 1) / B_LINE_ELEMS;
    const uint units = next_col0 >= N ? 0 : TRANS_B ? min((uint)NB, N - next_col0) * k_lines : k_end - k_begin;
    const uint share = (units + block_last - block_first - 1) / (block_last - block_first);
    const uint prefetch_lo = min(units, (block - block_first) * share), prefetch_hi = min(units, prefetch_lo + share);
    const uint prefetch_every = max((uint)KU, share == 0 ? 0u : (k_end - k_begin) / share / KU * KU);
#endif
#endif

  // Rows past M read row M-1 (valid memory) and are never stored, keeping the k loop branch-free.
#if A_GATHER && A_GATHER_STEP
  int ar0 = 0;
#endif
  FOR_ROWS(A_ROW_DECL)
  FOR_ROWS(ACC_DECL)
#if K_CHUNK
  if (chunk_begin != k_begin) {
    FOR_ROWS(ACC_RESUME)
  }
#endif

#if DIRECT_B && DIRECT_B_TAIL
  if (col0 + NB > N) {
    // The last panel of a B read in place: its columns one by one, zeros past N.
    for (uint k = k_begin; k < k_end; ++k, bp += b_step) {
      float row[NB];
      for (uint j = 0; j < NB; ++j) row[j] = col0 + j < N ? bp[j] : 0.0f;
      K_STEP(row)
    }
  } else
#endif
  {
    // Unrolled KU k steps at a time: PoCL's LLVM leaves the loop rolled, and its counter and
    // pointer updates then take issue slots from the fma.
    uint k = chunk_begin;
#ifdef FERRY_PREFETCH_B
    for (uint p = prefetch_lo; p < prefetch_hi; ++p) {
#if FERRY_PREFETCH_B == 1
      __global const STORAGE(B_NAME)* row = b + b_product + (ulong)p * N + col0;
      __builtin_prefetch(row, 0, 2);
      __builtin_prefetch(row + NB - 1, 0, 2);
#elif TRANS_B
      const ulong line = (ulong)(next_col0 + p / k_lines) * K + k_begin + p % k_lines * B_LINE_ELEMS;
      __builtin_prefetch(b + b_product + line, 0, 2);
#else
      __global const STORAGE(B_NAME)* row = b + b_product + (ulong)(k_begin + p) * N + next_col0;
      __builtin_prefetch(row, 0, 2);
      __builtin_prefetch(row + NB - 1, 0, 2);
#endif
      const uint k_stop = min(chunk_end, k + prefetch_every);
#if KU > 1
#pragma unroll KU
#endif
      for (; k < k_stop; ++k, bp += b_step) K_STEP(bp)
    }
#endif
#if KU > 1
#pragma unroll KU
#endif
    for (; k < chunk_end; ++k, bp += b_step) K_STEP(bp)
  }

#if K_CHUNK
  if (chunk_end != k_end) {
    FOR_ROWS(ACC_PARK)
  } else
#endif
  {
    bool guard_bad = false;  // C_GUARD: a stored value was not a usable gradient (guard.clh)
    FOR_ROWS(ACC_STORE)
    GUARD_SET(guard_bad, guard, guard_off);
  }
#if OWN_PANEL || WB > 1
  }
#endif
#if OWN_PANELS > 1
    }
  }
#endif
#if K_CHUNK
  }
#endif
#ifdef FERRY_STREAM_C
  __builtin_ia32_sfence();
#endif
}
