// Batched matmul of two activations: C[b] = alpha op(A[b]) op(B[b]) for every batch b, row-major,
// all batches in one launch with the batch index on dimension 2 of the global size.
// op(A) is A stored [M, K] (TRANS_A=0) or A^T with A stored [K, M]; op(B) is B stored [K, N]
// (TRANS_B=0) or B^T with B stored [N, K]. Batch b of each operand starts at b times its matrix
// size past the operand's element offset. C is overwritten (never read), so it may hold NaN.
//
// Chosen by the GEMM tuning data of the device (ops/tuning/gemm.tsv), each compiled only when its
// parameters are defined:
//   matmul_pack_b + matmul_packed  (RB, NV, DIRECT_B)  CPU devices: op(B) of every batch is copied
//       into k-major panels NB = 16 NV columns wide (the op's scratch), then a work-item computes RB
//       rows by NB columns with float16 accumulators in named registers, as gemm_packed.cl does.
//       A small B that is not transposed is read in place instead (DIRECT_B=1, no packing).
//   (GPUs run gemm_tiled.cl itself, batched by strides: ops/gemm_tiled.cpp.)
//   matmul_naive  one result per work-item (the fallback).
// No atomics and a fixed k order: the same inputs give the same bits on every run.

#if defined(RB) && defined(NV)
#define NB (16 * NV)
#define PACK_ROWS 16  // k rows of op(B) one pack work-item copies

// One work-item packs PACK_ROWS k rows of op(B) of batch get_global_id(2): all columns, padding
// included (transposed B: a block of 16 columns j0 = 16 get_global_id(1)).
__kernel void matmul_pack_b(uint N, uint K, __global const float* b, ulong b_off, __global float* packed,
                            ulong packed_off) {
  const uint k0 = get_global_id(0) * PACK_ROWS;
  const uint k_end = min(k0 + PACK_ROWS, K);
  const uint n_pad = (N + NB - 1) / NB * NB;
  const ulong batch = get_global_id(2);
  b += b_off + batch * ((ulong)N * K);
  packed += packed_off + batch * ((ulong)n_pad * K);
#if TRANS_B
  // B stored [N, K]: op(B)[k][j] = B[j][k]. 16 columns by PACK_ROWS k rows transposed in registers:
  // 16 contiguous reads of B, 16 contiguous writes of the panel.
  const uint j0 = get_global_id(1) * 16;
  if (j0 >= n_pad) return;
  __global float* dst = packed + ((ulong)(j0 / NB) * K) * NB + j0 % NB;  // op(B) row k at dst + k NB
  if (k_end - k0 == PACK_ROWS && j0 + 16 <= N) {
    float rows[16][PACK_ROWS];
    for (uint r = 0; r < 16; ++r) vstore16(vload16(0, b + (ulong)(j0 + r) * K + k0), 0, rows[r]);
    for (uint i = 0; i < PACK_ROWS; ++i) {
      vstore16((float16)(rows[0][i], rows[1][i], rows[2][i], rows[3][i], rows[4][i], rows[5][i], rows[6][i],
                         rows[7][i], rows[8][i], rows[9][i], rows[10][i], rows[11][i], rows[12][i], rows[13][i],
                         rows[14][i], rows[15][i]),
               0, dst + (ulong)(k0 + i) * NB);
    }
  } else {
    for (uint k = k0; k < k_end; ++k) {
      for (uint r = 0; r < 16; ++r) dst[(ulong)k * NB + r] = j0 + r < N ? b[(ulong)(j0 + r) * K + k] : 0.0f;
    }
  }
#else
  for (uint k = k0; k < k_end; ++k) {
    __global const float* src = b + (ulong)k * N;
    for (uint col = 0; col < n_pad; col += 16) {
      __global float* dst = packed + ((ulong)(col / NB) * K + k) * NB + col % NB;
      if (col + 16 <= N) {
        vstore16(vload16(0, src + col), 0, dst);
      } else {
        for (uint i = 0; i < 16; ++i) dst[i] = col + i < N ? src[col + i] : 0.0f;
      }
    }
  }
#endif
}

// alpha * acc for 16 columns starting at `col` of one row of C.
inline void matmul_store16(float16 acc, __global float* crow, uint col, uint N, float alpha) {
  if (col >= N) return;
  if (col + 16 <= N) {
    vstore16(alpha * acc, 0, crow + col);
  } else {
    float tmp[16];
    vstore16(alpha * acc, 0, tmp);
    for (uint i = 0; col + i < N; ++i) crow[col + i] = tmp[i];
  }
}

#define FOR_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)

#if TRANS_A
#define A_ROW_DECL(r) const uint ai##r = min(row0 + r, M - 1);
#define A_AT(r) ak[ai##r]
#else
#define A_ROW_DECL(r) __global const float* a##r = a + (ulong)min(row0 + r, M - 1) * K;
#define A_AT(r) a##r[k]
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

#define ACC_STORE(r)                                                      \
  if (r < RB && row0 + r < M) {                                           \
    __global float* crow = c + (ulong)(row0 + r) * N;                     \
    matmul_store16(c##r##_0, crow, col0, N, alpha);                       \
    if (NV > 1) matmul_store16(c##r##_1, crow, col0 + 16, N, alpha);      \
    if (NV > 2) matmul_store16(c##r##_2, crow, col0 + 32, N, alpha);      \
    if (NV > 3) matmul_store16(c##r##_3, crow, col0 + 48, N, alpha);      \
  }

// Work-item (row block, panel, batch) computes rows RB row_block .. + RB of one panel of C[batch].
// Launched with local size 1 and the row block on dimension 0, so that neighbouring work-groups
// share a panel of B. With DIRECT_B (B not transposed and small enough to stay in cache) op(B) is
// read where it is instead of from packed panels: rows of B are NB-wide runs N apart, and the
// last, partial panel loads its columns one by one, zero past N.
__kernel void matmul_packed(uint M, uint N, uint K, float alpha, __global const float* a, ulong a_off,
                            __global const float* packed, ulong packed_off, __global float* c, ulong c_off) {
  const uint row0 = get_global_id(0) * RB;
  const uint panel = get_global_id(1);
  const ulong batch = get_global_id(2);
  const uint col0 = panel * NB;
  a += a_off + batch * ((ulong)M * K);
  c += c_off + batch * ((ulong)M * N);

  // Rows past M read row M-1 (valid memory) and are never stored, keeping the k loop branch-free.
  FOR_ROWS(A_ROW_DECL)
  FOR_ROWS(ACC_DECL)

#if DIRECT_B
  __global const float* bp = packed + packed_off + batch * ((ulong)K * N) + col0;
  if (col0 + NB <= N) {
    for (uint k = 0; k < K; ++k, bp += N) {
      const float16 b0 = vload16(0, bp);
      const float16 b1 = NV > 1 ? vload16(1, bp) : 0.0f;
      const float16 b2 = NV > 2 ? vload16(2, bp) : 0.0f;
      const float16 b3 = NV > 3 ? vload16(3, bp) : 0.0f;
#if TRANS_A
      __global const float* ak = a + (ulong)k * M;
#endif
      FOR_ROWS(ACC_STEP)
    }
  } else {
    for (uint k = 0; k < K; ++k, bp += N) {
      float row[NB];
      for (uint j = 0; j < NB; ++j) row[j] = col0 + j < N ? bp[j] : 0.0f;
      const float16 b0 = vload16(0, row);
      const float16 b1 = NV > 1 ? vload16(1, row) : 0.0f;
      const float16 b2 = NV > 2 ? vload16(2, row) : 0.0f;
      const float16 b3 = NV > 3 ? vload16(3, row) : 0.0f;
#if TRANS_A
      __global const float* ak = a + (ulong)k * M;
#endif
      FOR_ROWS(ACC_STEP)
    }
  }
#else
  const uint n_pad = (N + NB - 1) / NB * NB;
  __global const float* bp = packed + packed_off + batch * ((ulong)n_pad * K) + (ulong)panel * K * NB;
  for (uint k = 0; k < K; ++k, bp += NB) {
    const float16 b0 = vload16(0, bp);
    const float16 b1 = NV > 1 ? vload16(1, bp) : 0.0f;
    const float16 b2 = NV > 2 ? vload16(2, bp) : 0.0f;
    const float16 b3 = NV > 3 ? vload16(3, bp) : 0.0f;
#if TRANS_A
    __global const float* ak = a + (ulong)k * M;
#endif
    FOR_ROWS(ACC_STEP)
  }
#endif

  FOR_ROWS(ACC_STORE)
}
#endif  // RB && NV


// One result per work-item: (column, row, batch) on dimensions (0, 1, 2), guarded past N and M.
__kernel void matmul_naive(uint M, uint N, uint K, float alpha, __global const float* a, ulong a_off,
                           __global const float* b, ulong b_off, __global float* c, ulong c_off) {
  const uint col = get_global_id(0), row = get_global_id(1);
  const ulong batch = get_global_id(2);
  if (row >= M || col >= N) return;
  a += a_off + batch * ((ulong)M * K);
  b += b_off + batch * ((ulong)K * N);
  float acc = 0.0f;
  for (uint k = 0; k < K; ++k) {
#if TRANS_A
    const float av = a[(ulong)k * M + row];
#else
    const float av = a[(ulong)row * K + k];
#endif
#if TRANS_B
    const float bv = b[(ulong)col * K + k];
#else
    const float bv = b[(ulong)k * N + col];
#endif
    acc = fma(av, bv, acc);
  }
  c[c_off + batch * ((ulong)M * N) + (ulong)row * N + col] = alpha * acc;
}
