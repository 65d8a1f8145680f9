// Fused causal attention for GPUs, the "blocked" family (ops/attention.hpp): forward, dq, and dk dv.
// Operands as in attention.cl: q, k, v, o and their gradients [B, T, H HEAD_DIM] in the storage
// type, lse and delta [B H, T] in f32, arithmetic in f32, no atomics (one writer per output, a
// fixed summation order).
//
// Why a second GPU family: the tiled kernels (attention.cl) give each work-item one query (or key)
// and read every operand of a multiply-add from local memory, one local read per multiply-add;
// on an H200 they ran at 3-7 TFLOPS, slower than the unfused GEMMs (bench/RESULTS.md, "Fused
// attention on the GPU"). Here every product of a tile is register-blocked as a GEMM is: a
// work-item holds a 4 x 4 block of the tile's scores and reads its 4 rows and 4 columns of each
// step as two float4s from transposed local tiles (a quarter of a read per multiply-add), and in
// the products whose output runs over the head dimension (p v, ds k, pᵀ do, dsᵀ q) the same 4 rows
// times the columns d = x, x + NC, x + 2 NC, ... of its column index x, so neighbouring work-items
// read neighbouring floats (no bank conflicts) and the output stores coalesce.
//
// Built with -DHEAD_DIM=D -DDP=(D rounded up to 16) -DTQ=queries -DTK=keys per tile (4, 8, 16, 32 or
// 64 each). The forward and dq kernels take TQ queries per work-group and walk the keys TK at a
// time; the dk dv kernel takes TK keys and walks the queries TQ at a time. A work-group holds
// (TQ / 4) (TK / 4) work-items (reqd_work_group_size); ops/attention.cpp sizes TQ and TK per kernel
// to the device's local memory with the same formulas as the arrays below.

#include "attention.clh"

#define NQ (TQ / 4)  // work-items across a tile's queries (4 queries each)
#define NK (TK / 4)  // across its keys
#define NT (NQ * NK)
#define MAX_OF(a, b) ((a) > (b) ? (a) : (b))

// Loops over a work-item's private blocks, unrolled where the host asks (-DUNROLL_BLOCKS=1, GPUs):
// a private array indexed in a loop that stays rolled leaves the registers. PoCL's CPU devices
// unroll by themselves, and an explicit unroll there multiplies their compile time past minutes.
#if UNROLL_BLOCKS
#define UNROLL _Pragma("unroll")
#else
#define UNROLL
#endif

// Rows t0 .. t0 + cols - 1 of head (b, h) of x, times `mul`, as the columns of a transposed tile:
// tile[d * stride + c] = mul x[t0 + c][d], zero past T and past D. Work-items take (column, 4 d)
// pairs with the columns fastest, so their local stores are consecutive.
inline void stage_transposed(__local float* tile, uint stride, uint cols, __global const T_STORAGE* x, ulong x_off,
                             uint b, uint h, uint t0, uint T, uint H, float mul) {
  for (uint e = get_local_id(0); e < cols * (DP / 4); e += NT) {
    const uint c = e % cols, d0 = (e / cols) * 4, t = t0 + c;
    const ulong at = x_off + attention_at(b, min(t, T - 1), h, T, H);
    for (uint u = 0; u < 4; ++u) {
      const uint d = d0 + u;
      tile[d * stride + c] = t < T && d < D ? LOAD_T(x, at + d) * mul : 0.0f;
    }
  }
}

// Rows t0 .. t0 + rows - 1 of head (b, h) of x as a row-major tile [rows, DP], zero past T and D.
inline void stage_rows(__local float* tile, uint rows, __global const T_STORAGE* x, ulong x_off, uint b, uint h,
                       uint t0, uint T, uint H) {
  for (uint e = get_local_id(0); e < rows * DP; e += NT) {
    const uint r = e / DP, d = e - r * DP, t = t0 + r;
    tile[e] = t < T && d < D ? LOAD_T(x, x_off + attention_at(b, min(t, T - 1), h, T, H) + d) : 0.0f;
  }
}

// acc[r][c] += a[r] b[c] for the 4 x 4 block of a work-item (written out: private arrays indexed
// in loops the compiler does not unroll leave the registers).
#define OUTER_ROW(acc, r, ar, bv)          \
  acc[r][0] = fma(ar, bv.x, acc[r][0]);  \
  acc[r][1] = fma(ar, bv.y, acc[r][1]);  \
  acc[r][2] = fma(ar, bv.z, acc[r][2]);  \
  acc[r][3] = fma(ar, bv.w, acc[r][3]);
#define OUTER4(acc, av, bv)      \
  {                              \
    OUTER_ROW(acc, 0, av.x, bv)  \
    OUTER_ROW(acc, 1, av.y, bv)  \
    OUTER_ROW(acc, 2, av.z, bv)  \
    OUTER_ROW(acc, 3, av.w, bv)  \
  }

// acc[r][j] += a[r] b for r < 4: column j of a work-item's 4-row block.
#define AXPY4(acc, j, av, b)               \
  acc[0][j] = fma(av.x, b, acc[0][j]);     \
  acc[1][j] = fma(av.y, b, acc[1][j]);     \
  acc[2][j] = fma(av.z, b, acc[2][j]);     \
  acc[3][j] = fma(av.w, b, acc[3][j]);

// ---- Forward: TQ queries per work-group, TK keys a step ---------------------------------------

// Work-item (y, x) = (lid / NK, lid % NK) holds rows 4y .. 4y + 3 of the group's queries: their
// scores against keys 4x .. 4x + 3 of each step, and their outputs at d = x + NK j.
#define FDT (DP / NK)

__kernel __attribute__((reqd_work_group_size(NT, 1, 1))) void attention_forward_blocked(
    __global const T_STORAGE* q, ulong q_off, __global const T_STORAGE* k, ulong k_off, __global const T_STORAGE* v,
    ulong v_off, __global T_STORAGE* o, ulong o_off, __global float* lse, ulong lse_off, uint T, uint H, float scale,
    uint seed, uint threshold, float inv_keep, uint step_lo, uint step_hi) {
  __local float4 qt[DP * NQ];               // scaled qᵀ: qt[d NQ + y] = rows 4y .. 4y + 3 at d
  __local float4 kp[MAX_OF(DP, TQ) * NK];  // the step's kᵀ ([d NK + x]), then its probabilities ([key NQ + y])
  __local float vs[TK * DP];                // the step's v rows
  __local float red[TQ * NK];               // per-row partial maxima, then partial sums
  const uint lid = get_local_id(0), y = lid / NK, x = lid - y * NK;
  const uint bh = get_group_id(1), b = bh / H, h = bh - b * H;
  const uint first = get_group_id(0) * TQ;
  stage_transposed((__local float*)qt, TQ, TQ, q, q_off, b, h, first, T, H, scale);
  float m[4], l[4], acc[4][FDT];
  UNROLL
  for (uint r = 0; r < 4; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
    UNROLL
    for (uint j = 0; j < FDT; ++j) acc[r][j] = 0.0f;
  }
  const uint kend = min(T, first + TQ);  // keys the group's last query sees
  for (uint kb = 0; kb < kend; kb += TK) {
    stage_transposed((__local float*)kp, TK, TK, k, k_off, b, h, kb, T, H, 1.0f);
    stage_rows(vs, TK, v, v_off, b, h, kb, T, H);
    barrier(CLK_LOCAL_MEM_FENCE);
    float s[4][4] = {{0.0f}};
    for (uint d = 0; d < D; ++d) {
      const float4 qv = qt[d * NQ + y], kv = kp[d * NK + x];
      OUTER4(s, qv, kv)
    }
    UNROLL
    for (uint r = 0; r < 4; ++r) {
      const uint i = first + 4 * y + r;
      float mx = -INFINITY;
      UNROLL
      for (uint c = 0; c < 4; ++c) {
        const uint j = kb + 4 * x + c;
        if (j > i || j >= T) s[r][c] = -INFINITY;
        mx = fmax(mx, s[r][c]);
      }
      red[(4 * y + r) * NK + x] = mx;
    }
    barrier(CLK_LOCAL_MEM_FENCE);  // the maxima are written, and every work-item is done with kᵀ
    float p[4][4];
    UNROLL
    for (uint r = 0; r < 4; ++r) {
      const uint i = first + 4 * y + r;
      float mx = m[r];
      for (uint u = 0; u < NK; ++u) mx = fmax(mx, red[(4 * y + r) * NK + u]);
      const float rescale = mx == -INFINITY ? 1.0f : exp(m[r] - mx);
      m[r] = mx;
      l[r] *= rescale;
      UNROLL
      for (uint j = 0; j < FDT; ++j) acc[r][j] *= rescale;
      UNROLL
      for (uint c = 0; c < 4; ++c) {
        const float pr = s[r][c] == -INFINITY ? 0.0f : exp(s[r][c] - mx);
        l[r] += pr;
        p[r][c] = threshold ? pr * attention_keep(((ulong)bh * T + i) * T + kb + 4 * x + c, seed, threshold, inv_keep,
                                                  step_lo, step_hi)
                            : pr;
      }
    }
    UNROLL
    for (uint c = 0; c < 4; ++c) kp[(4 * x + c) * NQ + y] = (float4)(p[0][c], p[1][c], p[2][c], p[3][c]);
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint key = 0; key < TK; ++key) {
      const float4 pv = kp[key * NQ + y];
      UNROLL
      for (uint j = 0; j < FDT; ++j) {
        const float vv = vs[key * DP + x + NK * j];
        AXPY4(acc, j, pv, vv)
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);  // before the next step overwrites kp and vs
  }
  UNROLL
  for (uint r = 0; r < 4; ++r) red[(4 * y + r) * NK + x] = l[r];
  barrier(CLK_LOCAL_MEM_FENCE);
  UNROLL
  for (uint r = 0; r < 4; ++r) {
    const uint i = first + 4 * y + r;
    if (i >= T) break;
    float sum = 0.0f;
    for (uint u = 0; u < NK; ++u) sum += red[(4 * y + r) * NK + u];
    const float inv = 1.0f / sum;
    const ulong at = o_off + attention_at(b, i, h, T, H);
    UNROLL
    for (uint j = 0; j < FDT; ++j) {
      const uint d = x + NK * j;
      if (d < D) STORE_T(acc[r][j] * inv, o, at + d);
    }
    if (x == 0) lse[lse_off + (ulong)bh * T + i] = m[r] + log(sum);
  }
}

// ---- dq: TQ queries per work-group, TK keys a step ---------------------------------------------

// Work-item (y, x) = (lid / NK, lid % NK): rows 4y .. 4y + 3, keys 4x .. 4x + 3 of each step, dq at
// d = x + NK j. dq = scale sum_j ds_ij k_j with ds = p (dp keep - delta), dp = do v.
#define QDT (DP / NK)
#define KT_STRIDE (TK + 4)  // kᵀ rows padded: float4 reads for the scores, strided d reads for ds k

__kernel __attribute__((reqd_work_group_size(NT, 1, 1))) void attention_backward_q_blocked(
    __global const T_STORAGE* q, ulong q_off, __global const T_STORAGE* k, ulong k_off, __global const T_STORAGE* v,
    ulong v_off, __global const T_STORAGE* dout, ulong do_off, __global const float* lse, ulong lse_off,
    __global const float* delta, ulong delta_off, __global T_STORAGE* dq, ulong dq_off, uint T, uint H, float scale,
    uint seed, uint threshold, float inv_keep, uint step_lo, uint step_hi) {
  __local float4 qt[DP * NQ], dot[DP * NQ];  // scaled qᵀ and doᵀ: [d NQ + y]
  __local float4 kt[DP * KT_STRIDE / 4];     // the step's kᵀ, rows KT_STRIDE floats apart
  __local float4 vt[DP * NK];                // the step's vᵀ: [d NK + x]
  __local float4 dst[TK * NQ];               // dsᵀ: [key NQ + y]
  __local const float* ktf = (__local const float*)kt;
  const uint lid = get_local_id(0), y = lid / NK, x = lid - y * NK;
  const uint bh = get_group_id(1), b = bh / H, h = bh - b * H;
  const uint first = get_group_id(0) * TQ;
  stage_transposed((__local float*)qt, TQ, TQ, q, q_off, b, h, first, T, H, scale);
  stage_transposed((__local float*)dot, TQ, TQ, dout, do_off, b, h, first, T, H, 1.0f);
  float li[4], di[4], g[4][QDT];
  UNROLL
  for (uint r = 0; r < 4; ++r) {
    const uint i = first + 4 * y + r;
    li[r] = i < T ? lse[lse_off + (ulong)bh * T + i] : 0.0f;
    di[r] = i < T ? delta[delta_off + (ulong)bh * T + i] : 0.0f;
    UNROLL
    for (uint j = 0; j < QDT; ++j) g[r][j] = 0.0f;
  }
  const uint kend = min(T, first + TQ);
  for (uint kb = 0; kb < kend; kb += TK) {
    stage_transposed((__local float*)kt, KT_STRIDE, TK, k, k_off, b, h, kb, T, H, 1.0f);
    stage_transposed((__local float*)vt, TK, TK, v, v_off, b, h, kb, T, H, 1.0f);
    barrier(CLK_LOCAL_MEM_FENCE);
    float s[4][4] = {{0.0f}}, dp[4][4] = {{0.0f}};
    for (uint d = 0; d < D; ++d) {
      const float4 qv = qt[d * NQ + y], dv = dot[d * NQ + y];
      const float4 kv = kt[(d * KT_STRIDE) / 4 + x], vv = vt[d * NK + x];
      OUTER4(s, qv, kv)
      OUTER4(dp, dv, vv)
    }
    float ds[4][4];
    UNROLL
    for (uint r = 0; r < 4; ++r) {
      const uint i = first + 4 * y + r;
      UNROLL
      for (uint c = 0; c < 4; ++c) {
        const uint j = kb + 4 * x + c;
        const float p = j <= i && j < T && i < T ? exp(s[r][c] - li[r]) : 0.0f;
        const float keep =
            threshold ? attention_keep(((ulong)bh * T + i) * T + j, seed, threshold, inv_keep, step_lo, step_hi) : 1.0f;
        ds[r][c] = p * (dp[r][c] * keep - di[r]);
      }
    }
    UNROLL
    for (uint c = 0; c < 4; ++c) dst[(4 * x + c) * NQ + y] = (float4)(ds[0][c], ds[1][c], ds[2][c], ds[3][c]);
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint key = 0; key < TK; ++key) {
      const float4 dsv = dst[key * NQ + y];
      UNROLL
      for (uint j = 0; j < QDT; ++j) {
        const float kk = ktf[(x + NK * j) * KT_STRIDE + key];
        AXPY4(g, j, dsv, kk)
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  UNROLL
  for (uint r = 0; r < 4; ++r) {
    const uint i = first + 4 * y + r;
    if (i >= T) break;
    const ulong at = dq_off + attention_at(b, i, h, T, H);
    UNROLL
    for (uint j = 0; j < QDT; ++j) {
      const uint d = x + NK * j;
      if (d < D) STORE_T(g[r][j] * scale, dq, at + d);
    }
  }
}

// ---- dk and dv: TK keys per work-group, TQ queries a step -------------------------------------

// Work-item (y, x) = (lid / NQ, lid % NQ): keys 4y .. 4y + 3, queries 4x .. 4x + 3 of each step, dk
// and dv at d = x + NQ j. dv = sum_i p_ij keep do_i, dk = sum_i ds_ij (scale q_i).
#define KDT (DP / NQ)
#define QT_STRIDE (TQ + 4)  // qᵀ and doᵀ rows padded, as kᵀ in the dq kernel

__kernel __attribute__((reqd_work_group_size(NT, 1, 1))) void attention_backward_kv_blocked(
    __global const T_STORAGE* q, ulong q_off, __global const T_STORAGE* k, ulong k_off, __global const T_STORAGE* v,
    ulong v_off, __global const T_STORAGE* dout, ulong do_off, __global const float* lse, ulong lse_off,
    __global const float* delta, ulong delta_off, __global T_STORAGE* dk, ulong dk_off, __global T_STORAGE* dv,
    ulong dv_off, uint T, uint H, float scale, uint seed, uint threshold, float inv_keep, uint step_lo,
    uint step_hi) {
  __local float4 kt[DP * NK], vt[DP * NK];                    // the group's kᵀ and vᵀ: [d NK + y]
  __local float4 qt[DP * QT_STRIDE / 4], dot[DP * QT_STRIDE / 4];  // the step's scaled qᵀ and doᵀ
  __local float4 pt[TQ * NK], dst[TQ * NK];                   // p keep and ds, [query NK + y]
  __local float ls[TQ], dl[TQ];
  __local const float* qtf = (__local const float*)qt;
  __local const float* dotf = (__local const float*)dot;
  const uint lid = get_local_id(0), y = lid / NQ, x = lid - y * NQ;
  const uint bh = get_group_id(1), b = bh / H, h = bh - b * H;
  const uint first = get_group_id(0) * TK;
  stage_transposed((__local float*)kt, TK, TK, k, k_off, b, h, first, T, H, 1.0f);
  stage_transposed((__local float*)vt, TK, TK, v, v_off, b, h, first, T, H, 1.0f);
  float gk[4][KDT], gv[4][KDT];
  UNROLL
  for (uint r = 0; r < 4; ++r) {
    UNROLL
    for (uint j = 0; j < KDT; ++j) gk[r][j] = gv[r][j] = 0.0f;
  }
  for (uint ib = (first / TQ) * TQ; ib < T; ib += TQ) {  // the queries that see a key of the group
    stage_transposed((__local float*)qt, QT_STRIDE, TQ, q, q_off, b, h, ib, T, H, scale);
    stage_transposed((__local float*)dot, QT_STRIDE, TQ, dout, do_off, b, h, ib, T, H, 1.0f);
    for (uint e = lid; e < TQ; e += NT) {
      ls[e] = ib + e < T ? lse[lse_off + (ulong)bh * T + ib + e] : 0.0f;
      dl[e] = ib + e < T ? delta[delta_off + (ulong)bh * T + ib + e] : 0.0f;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    float s[4][4] = {{0.0f}}, dp[4][4] = {{0.0f}};
    for (uint d = 0; d < D; ++d) {
      const float4 kv = kt[d * NK + y], vv = vt[d * NK + y];
      const float4 qv = qt[(d * QT_STRIDE) / 4 + x], dov = dot[(d * QT_STRIDE) / 4 + x];
      OUTER4(s, kv, qv)
      OUTER4(dp, vv, dov)
    }
    float pk[4][4], ds[4][4];
    UNROLL
    for (uint r = 0; r < 4; ++r) {
      const uint j = first + 4 * y + r;
      UNROLL
      for (uint c = 0; c < 4; ++c) {
        const uint i = ib + 4 * x + c;
        const float p = j <= i && i < T && j < T ? exp(s[r][c] - ls[4 * x + c]) : 0.0f;
        const float keep =
            threshold ? attention_keep(((ulong)bh * T + i) * T + j, seed, threshold, inv_keep, step_lo, step_hi) : 1.0f;
        pk[r][c] = p * keep;
        ds[r][c] = p * (dp[r][c] * keep - dl[4 * x + c]);
      }
    }
    UNROLL
    for (uint c = 0; c < 4; ++c) {
      pt[(4 * x + c) * NK + y] = (float4)(pk[0][c], pk[1][c], pk[2][c], pk[3][c]);
      dst[(4 * x + c) * NK + y] = (float4)(ds[0][c], ds[1][c], ds[2][c], ds[3][c]);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint qq = 0; qq < TQ; ++qq) {
      const float4 pv = pt[qq * NK + y], dsv = dst[qq * NK + y];
      UNROLL
      for (uint j = 0; j < KDT; ++j) {
        const uint at = (x + NQ * j) * QT_STRIDE + qq;
        const float dov = dotf[at], qv = qtf[at];
        AXPY4(gv, j, pv, dov)
        AXPY4(gk, j, dsv, qv)
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  UNROLL
  for (uint r = 0; r < 4; ++r) {
    const uint j = first + 4 * y + r;
    if (j >= T) break;
    const ulong kat = dk_off + attention_at(b, j, h, T, H), vat = dv_off + attention_at(b, j, h, T, H);
    UNROLL
    for (uint c = 0; c < KDT; ++c) {
      const uint d = x + NQ * c;
      if (d < D) {
        STORE_T(gk[r][c], dk, kat + d);
        STORE_T(gv[r][c], dv, vat + d);
      }
    }
  }
}
