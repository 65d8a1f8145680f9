// Local-memory tiled GEMM for GPUs. A work-group computes a TSM x TSN tile of C with
// (TSM / WPTM) x (TSN / WPTN) work-items, each holding WPTM x WPTN results in registers. Per step
// of TSK along k the group stages op(A) and op(B) tiles in __local memory (zero-filled past the
// matrix edges, so every shape and both transposes are handled). A work-item's results are strided
// by the group width so that neighbouring work-items touch neighbouring columns of C.
// Parameters (-D): TSM, TSN, TSK, WPTM, WPTN, TRANS_A, TRANS_B, and the storage types
// A_NAME / B_NAME / C_NAME = F32 | F16 | BF16 (dtype.clh; F32 when not given): narrow operands are
// widened as they are staged in local memory and C is rounded as it is stored, so mixed precision
// needs no f32 copies. Offsets are whole elements (no pointer arithmetic on half*).
#include "dtype.clh"
#ifndef A_NAME
#define A_NAME F32
#endif
#ifndef B_NAME
#define B_NAME F32
#endif
#ifndef C_NAME
#define C_NAME F32
#endif
#define RTSM (TSM / WPTM)
#define RTSN (TSN / WPTN)
#define THREADS (RTSM * RTSN)

__kernel __attribute__((reqd_work_group_size(RTSN, RTSM, 1))) void gemm_tiled(
    uint M, uint N, uint K, float alpha, __global const STORAGE(A_NAME)* a, ulong a_off,
    __global const STORAGE(B_NAME)* b, ulong b_off, float beta, __global STORAGE(C_NAME)* c, ulong c_off,
    __global const float* bias, ulong bias_off, uint has_bias) {
  const uint tn = get_local_id(0);
  const uint tm = get_local_id(1);
  const uint tid = tm * RTSN + tn;
  const uint col0 = get_group_id(0) * TSN;
  const uint row0 = get_group_id(1) * TSM;

  __local float as[TSK][TSM];
  __local float bs[TSK][TSN];
  float acc[WPTM][WPTN];
  for (uint i = 0; i < WPTM; ++i) {
    for (uint j = 0; j < WPTN; ++j) acc[i][j] = 0.0f;
  }

  for (uint k0 = 0; k0 < K; k0 += TSK) {
    // Consecutive work-items read consecutive addresses of whichever layout A and B have.
    for (uint i = tid; i < TSK * TSM; i += THREADS) {
#if TRANS_A
      const uint kk = i / TSM, mm = i % TSM;
#else
      const uint mm = i / TSK, kk = i % TSK;
#endif
      const uint gm = row0 + mm, gk = k0 + kk;
#if TRANS_A
      as[kk][mm] = gm < M && gk < K ? LOAD(A_NAME, a, a_off + (ulong)gk * M + gm) : 0.0f;
#else
      as[kk][mm] = gm < M && gk < K ? LOAD(A_NAME, a, a_off + (ulong)gm * K + gk) : 0.0f;
#endif
    }
    for (uint i = tid; i < TSK * TSN; i += THREADS) {
#if TRANS_B
      const uint nn = i / TSK, kk = i % TSK;
#else
      const uint kk = i / TSN, nn = i % TSN;
#endif
      const uint gn = col0 + nn, gk = k0 + kk;
#if TRANS_B
      bs[kk][nn] = gn < N && gk < K ? LOAD(B_NAME, b, b_off + (ulong)gn * K + gk) : 0.0f;
#else
      bs[kk][nn] = gn < N && gk < K ? LOAD(B_NAME, b, b_off + (ulong)gk * N + gn) : 0.0f;
#endif
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint kk = 0; kk < TSK; ++kk) {
      float bv[WPTN];
      for (uint j = 0; j < WPTN; ++j) bv[j] = bs[kk][tn + j * RTSN];
      for (uint i = 0; i < WPTM; ++i) {
        const float av = as[kk][tm + i * RTSM];
        for (uint j = 0; j < WPTN; ++j) acc[i][j] = fma(av, bv[j], acc[i][j]);
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }

  for (uint i = 0; i < WPTM; ++i) {
    const uint row = row0 + tm + i * RTSM;
    if (row >= M) break;
    for (uint j = 0; j < WPTN; ++j) {
      const uint col = col0 + tn + j * RTSN;
      if (col >= N) break;
      const ulong at = c_off + (ulong)row * N + col;
      float out = alpha * acc[i][j];
      if (beta != 0.0f) out = fma(beta, LOAD(C_NAME, c, at), out);  // beta = 0: C is not read (it may hold NaN)
      if (has_bias) out += bias[bias_off + col];
      STORE(C_NAME, out, c, at);
    }
  }
}
