// Fused causal attention for GPUs, the "blocked" family (ops/attention.hpp): forward, dq, and dk dv.
// Operands as in attention.cl: q, k, v, o and their gradients [B, T, H HEAD_DIM] in the storage
// type, lse and delta [B H, T] in f32, arithmetic in f32, no atomics (one writer per output, a
// fixed summation order).
//
// Why a second GPU family: the tiled kernels (attention.cl) give each work-item one query (or key)
// and read every operand of a multiply-add from local memory, one local read per multiply-add;
// on an H200 they ran at 3-7 TFLOPS, slower than the unfused GEMMs (bench/RESULTS.md, "Fused
// attention on the GPU"). Here every product of a tile is register-blocked as a GEMM is, and every
// local read is a float4:
//  - Every tile is row-major (a row per query or key, DP floats, padded to RS = DP + 4 where rows
//    are read across work-items) and a work-item's 4 rows (queries or keys) are interleaved with
//    its neighbours' (rows y, y + NQ, y + 2 NQ, y + 3 NQ), so that neighbouring work-items read
//    neighbouring rows, which the padding puts in different banks.
//  - The scores and dp = do vᵀ (products over the head dimension) read, per 4 steps along d, one
//    float4 of each of the work-item's 4 query rows and 4 key rows: 8 reads for 64 multiply-adds.
//  - The products whose output runs over the head dimension (p v, ds k, pᵀ do, dsᵀ q) read, per key
//    (query), the work-item's 4 probabilities as one float4 (written so by the softmax) and its
//    columns of the head dimension as float4s d = 4 (x + N j) .. + 3: 3 reads for 32 multiply-adds
//    at TK = 32, D = 64, where one float per column took 9 (the previous layout, transposed tiles
//    read a float at a time there: 11-12 TFLOPS on an H200 against the GEMM's 29, bench/RESULTS.md).
//
// Built with -DHEAD_DIM=D -DDP=(D rounded up to 16) -DTQ=queries -DTK=keys per tile (4, 8, 16, 32 or
// 64 each). The forward and dq kernels take TQ queries per work-group and walk the keys TK at a
// time; the dk dv kernel takes TK keys and walks the queries TQ at a time. A work-group holds
// (TQ / 4) (TK / 4) work-items (reqd_work_group_size); ops/attention.cpp sizes TQ and TK per kernel
// to the device's local memory with the same formulas as the arrays below (blocked_local_floats).

#include "attention.clh"

#define NQ (TQ / 4)  // work-items across a tile's queries (4 queries each)
#define NK (TK / 4)  // across its keys
#define NT (NQ * NK)
#define RS (DP + 4)       // floats between a padded tile's rows
#define D4 ((D + 3) / 4)  // float4s of a row that hold the head dimension
#define MAX_OF(a, b) ((a) > (b) ? (a) : (b))

// Loops over a work-item's private blocks, unrolled where the host asks (-DUNROLL_BLOCKS=1, GPUs):
// a private array indexed in a loop that stays rolled leaves the registers. PoCL's CPU devices
// unroll by themselves, and an explicit unroll there multiplies their compile time past minutes.
#if UNROLL_BLOCKS
#define UNROLL _Pragma("unroll")
// The loops over the head dimension's float4s and over a step's keys (queries), four iterations at
// a time: their local reads then sit at constant offsets from one address per four iterations
// (rolled, each computed its own: clang's PTX of the forward had 14 integer instructions per 64
// multiply-adds in the score product). Not fully: at head dimension 128 or 64-row tiles a full
// unroll would put thousands of multiply-adds in one loop body.
#define UNROLL4 _Pragma("unroll 4")
#else
#define UNROLL
#define UNROLL4
#endif

// Rows t0 .. t0 + rows - 1 of head (b, h) of x, times `mul`, into a row-major tile whose rows are
// `stride` floats apart: zero past T and past D. Work-items take (row, 4 d) pairs with the d
// fastest, so a row is read and stored by neighbouring work-items.
inline void stage_rows(__local float* tile, uint stride, uint rows, __global const T_STORAGE* x, ulong x_off, uint b,
                       uint h, uint t0, uint T, uint H, float mul) {
#if NT % (DP / 4) == 0
  // A work-item's columns are the same in every row it stages and its rows are NT / (DP / 4) apart,
  // so its addresses advance by constants (each computed anew took about 30 instructions a float4
  // in clang's PTX, beside 16 multiply-adds of a score product per float4 staged).
  const uint per_row = DP / 4, row_step = NT / per_row, d0 = get_local_id(0) % per_row * 4;
  uint r = get_local_id(0) / per_row;
  ulong at = x_off + attention_at(b, t0 + r, h, T, H) + d0;  // past T it is never read
  const ulong at_step = (ulong)row_step * H * D;
  for (; r < rows; r += row_step, at += at_step) {
    float4 v = (float4)(0.0f);
    if (t0 + r < T) {
#if D == DP  // no column past D
      v = (float4)(LOAD_T(x, at), LOAD_T(x, at + 1), LOAD_T(x, at + 2), LOAD_T(x, at + 3)) * mul;
#else
      v = (float4)(d0 < D ? LOAD_T(x, at) : 0.0f, d0 + 1 < D ? LOAD_T(x, at + 1) : 0.0f,
                   d0 + 2 < D ? LOAD_T(x, at + 2) : 0.0f, d0 + 3 < D ? LOAD_T(x, at + 3) : 0.0f) *
          mul;
#endif
    }
    *(__local float4*)(tile + r * stride + d0) = v;
  }
#else
  for (uint e = get_local_id(0); e < rows * (DP / 4); e += NT) {
    const uint r = e / (DP / 4), d0 = (e - r * (DP / 4)) * 4, t = t0 + r;
    const ulong at = x_off + attention_at(b, min(t, T - 1), h, T, H) + d0;
    const bool row = t < T;
    *(__local float4*)(tile + r * stride + d0) =
        (float4)(row && d0 < D ? LOAD_T(x, at) * mul : 0.0f, row && d0 + 1 < D ? LOAD_T(x, at + 1) * mul : 0.0f,
                 row && d0 + 2 < D ? LOAD_T(x, at + 2) * mul : 0.0f, row && d0 + 3 < D ? LOAD_T(x, at + 3) * mul : 0.0f);
  }
#endif
}

// s[r][c] += a[r] . b[c] over one float4 of d, for the work-item's 4 x 4 block.
#define DOT4(acc, a, b) acc = fma((a).x, (b).x, fma((a).y, (b).y, fma((a).z, (b).z, fma((a).w, (b).w, acc))))
#define BLOCK_DOT4(s, a, b)                                        \
  UNROLL                                                           \
  for (uint r_ = 0; r_ < 4; ++r_) {                                \
    UNROLL                                                         \
    for (uint c_ = 0; c_ < 4; ++c_) DOT4(s[r_][c_], a[r_], b[c_]); \
  }

// acc[r][4j .. 4j + 3] += p[r] v for r < 4: a float4 of a work-item's output columns.
#define AXPY4(acc, j, p, v)                                            \
  {                                                                    \
    const float p_[4] = {(p).x, (p).y, (p).z, (p).w};                  \
    UNROLL                                                             \
    for (uint r_ = 0; r_ < 4; ++r_) {                                  \
      acc[r_][4 * (j)] = fma(p_[r_], (v).x, acc[r_][4 * (j)]);         \
      acc[r_][4 * (j) + 1] = fma(p_[r_], (v).y, acc[r_][4 * (j) + 1]); \
      acc[r_][4 * (j) + 2] = fma(p_[r_], (v).z, acc[r_][4 * (j) + 2]); \
      acc[r_][4 * (j) + 3] = fma(p_[r_], (v).w, acc[r_][4 * (j) + 3]); \
    }                                                                  \
  }

// s[r][c] += row (r0 + rs r) of tile a . row (c0 + cs c) of tile b over the head dimension, for
// r, c < 4 (padded tiles): the scores and dp = do vᵀ, one float4 of each of the 8 rows at a time.
inline void block_dots(float s[4][4], __local const float4* a, uint r0, uint rs, __local const float4* b, uint c0,
                       uint cs) {
  __local const float4 *ar[4], *br[4];  // the 8 rows, so that each read is a row plus the loop's c4
  UNROLL
  for (uint r = 0; r < 4; ++r) ar[r] = a + (r0 + rs * r) * (RS / 4);
  UNROLL
  for (uint c = 0; c < 4; ++c) br[c] = b + (c0 + cs * c) * (RS / 4);
  UNROLL4
  for (uint c4 = 0; c4 < D4; ++c4) {
    float4 av[4], bv[4];
    UNROLL
    for (uint r = 0; r < 4; ++r) av[r] = ar[r][c4];
    UNROLL
    for (uint c = 0; c < 4; ++c) bv[c] = br[c][c4];
    BLOCK_DOT4(s, av, bv)
  }
}

// ---- Forward: TQ queries per work-group, TK keys a step ---------------------------------------

// Work-item (y, x) = (lid / NK, lid % NK) holds queries y + NQ r (r < 4) of the group: their scores
// against keys x + NK c (c < 4) of each step, and their outputs at the float4 columns x + NK j.
#define FV ((D4 + NK - 1) / NK)

__kernel __attribute__((reqd_work_group_size(NT, 1, 1))) void attention_forward_blocked(
    __global const T_STORAGE* q, ulong q_off, __global const T_STORAGE* k, ulong k_off, __global const T_STORAGE* v,
    ulong v_off, __global T_STORAGE* o, ulong o_off, __global float* lse, ulong lse_off, uint T, uint H, float scale,
    uint seed, uint threshold, float inv_keep, uint step_lo, uint step_hi) {
  __local float4 qs[TQ * RS / 4];                // the group's scaled q rows
  __local float4 kp[TK * MAX_OF(RS, TQ) / 4];  // the step's k rows, then its probabilities ([key NQ + y])
  __local float4 vs[TK * DP / 4];                // the step's v rows (read along d only: not padded)
  __local float red[TQ * NK];                    // per-row partial maxima, then partial sums
  const uint lid = get_local_id(0), y = lid / NK, x = lid - y * NK;
  const uint2 group = attention_group_longest_first(1);
  const uint bh = group.y, b = bh / H, h = bh - b * H;
  const uint first = group.x * TQ;
  stage_rows((__local float*)qs, RS, TQ, q, q_off, b, h, first, T, H, scale);
  float m[4], l[4], acc[4][4 * FV];
  UNROLL
  for (uint r = 0; r < 4; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
    UNROLL
    for (uint j = 0; j < 4 * FV; ++j) acc[r][j] = 0.0f;
  }
  const uint kend = min(T, first + TQ);  // keys the group's last query sees
  for (uint kb = 0; kb < kend; kb += TK) {
    stage_rows((__local float*)kp, RS, TK, k, k_off, b, h, kb, T, H, 1.0f);
    stage_rows((__local float*)vs, DP, TK, v, v_off, b, h, kb, T, H, 1.0f);
    barrier(CLK_LOCAL_MEM_FENCE);
    float s[4][4] = {{0.0f}};
    block_dots(s, qs, y, NQ, kp, x, NK);
    UNROLL
    for (uint r = 0; r < 4; ++r) {
      const uint i = first + y + NQ * r;
      float mx = -INFINITY;
      UNROLL
      for (uint c = 0; c < 4; ++c) {
        const uint j = kb + x + NK * c;
        if (j > i || j >= T) s[r][c] = -INFINITY;
        mx = fmax(mx, s[r][c]);
      }
      red[(y + NQ * r) * NK + x] = mx;
    }
    barrier(CLK_LOCAL_MEM_FENCE);  // the maxima are written, and every work-item is done with the k rows
    float p[4][4];
    UNROLL
    for (uint r = 0; r < 4; ++r) {
      const uint i = first + y + NQ * r;
      float mx = m[r];
      for (uint u = 0; u < NK; ++u) mx = fmax(mx, red[(y + NQ * r) * NK + u]);
      const float rescale = mx == -INFINITY ? 1.0f : exp(m[r] - mx);
      m[r] = mx;
      l[r] *= rescale;
      UNROLL
      for (uint j = 0; j < 4 * FV; ++j) acc[r][j] *= rescale;
      UNROLL
      for (uint c = 0; c < 4; ++c) {
        const float pr = s[r][c] == -INFINITY ? 0.0f : exp(s[r][c] - mx);
        l[r] += pr;
        p[r][c] = threshold ? pr * attention_keep(((ulong)bh * T + i) * T + kb + x + NK * c, seed, threshold,
                                                  inv_keep, step_lo, step_hi)
                            : pr;
      }
    }
    UNROLL
    for (uint c = 0; c < 4; ++c) kp[(x + NK * c) * NQ + y] = (float4)(p[0][c], p[1][c], p[2][c], p[3][c]);
    barrier(CLK_LOCAL_MEM_FENCE);
    __local const float4 *const p_y = kp + y, *const v_x = vs + x;  // reads at constant offsets from these
    UNROLL4
    for (uint key = 0; key < TK; ++key) {
      const float4 pv = p_y[key * NQ];
      UNROLL
      for (uint j = 0; j < FV; ++j) {
        if (D4 % NK != 0 && x + NK * j >= D4) break;
        const float4 vv = v_x[key * (DP / 4) + NK * j];
        AXPY4(acc, j, pv, vv)
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);  // before the next step overwrites kp and vs
  }
  UNROLL
  for (uint r = 0; r < 4; ++r) red[(y + NQ * r) * NK + x] = l[r];
  barrier(CLK_LOCAL_MEM_FENCE);
  UNROLL
  for (uint r = 0; r < 4; ++r) {
    const uint i = first + y + NQ * r;
    if (i >= T) break;
    float sum = 0.0f;
    for (uint u = 0; u < NK; ++u) sum += red[(y + NQ * r) * NK + u];
    const float inv = 1.0f / sum;
    const ulong at = o_off + attention_at(b, i, h, T, H);
    UNROLL
    for (uint j = 0; j < 4 * FV; ++j) {
      const uint d = 4 * (x + NK * (j / 4)) + j % 4;
      if (d < D) STORE_T(acc[r][j] * inv, o, at + d);
    }
    if (x == 0) lse[lse_off + (ulong)bh * T + i] = m[r] + log(sum);
  }
}

// ---- dq: TQ queries per work-group, TK keys a step ---------------------------------------------

// Work-item (y, x) = (lid / NK, lid % NK): queries y + NQ r, keys x + NK c of each step, dq at the
// float4 columns x + NK j. dq = scale sum_j ds_ij k_j with ds = p (dp keep - delta), dp = do v.

__kernel __attribute__((reqd_work_group_size(NT, 1, 1))) void attention_backward_q_blocked(
    __global const T_STORAGE* q, ulong q_off, __global const T_STORAGE* k, ulong k_off, __global const T_STORAGE* v,
    ulong v_off, __global const T_STORAGE* dout, ulong do_off, __global const float* lse, ulong lse_off,
    __global const float* delta, ulong delta_off, __global T_STORAGE* dq, ulong dq_off, uint T, uint H, float scale,
    uint seed, uint threshold, float inv_keep, uint step_lo, uint step_hi) {
  __local float4 qs[TQ * RS / 4], dos[TQ * RS / 4];  // the group's scaled q rows and do rows
  __local float4 ks[TK * RS / 4], vs[TK * RS / 4];   // the step's k rows and v rows
  __local float4 dst[TK * NQ];                       // ds: [key NQ + y]
  const uint lid = get_local_id(0), y = lid / NK, x = lid - y * NK;
  const uint2 group = attention_group_longest_first(1);
  const uint bh = group.y, b = bh / H, h = bh - b * H;
  const uint first = group.x * TQ;
  stage_rows((__local float*)qs, RS, TQ, q, q_off, b, h, first, T, H, scale);
  stage_rows((__local float*)dos, RS, TQ, dout, do_off, b, h, first, T, H, 1.0f);
  float li[4], di[4], g[4][4 * FV];
  UNROLL
  for (uint r = 0; r < 4; ++r) {
    const uint i = first + y + NQ * r;
    li[r] = i < T ? lse[lse_off + (ulong)bh * T + i] : 0.0f;
    di[r] = i < T ? delta[delta_off + (ulong)bh * T + i] : 0.0f;
    UNROLL
    for (uint j = 0; j < 4 * FV; ++j) g[r][j] = 0.0f;
  }
  const uint kend = min(T, first + TQ);
  for (uint kb = 0; kb < kend; kb += TK) {
    stage_rows((__local float*)ks, RS, TK, k, k_off, b, h, kb, T, H, 1.0f);
    stage_rows((__local float*)vs, RS, TK, v, v_off, b, h, kb, T, H, 1.0f);
    barrier(CLK_LOCAL_MEM_FENCE);
    float s[4][4] = {{0.0f}}, dp[4][4] = {{0.0f}};
    block_dots(s, qs, y, NQ, ks, x, NK);
    block_dots(dp, dos, y, NQ, vs, x, NK);
    float ds[4][4];
    UNROLL
    for (uint r = 0; r < 4; ++r) {
      const uint i = first + y + NQ * r;
      UNROLL
      for (uint c = 0; c < 4; ++c) {
        const uint j = kb + x + NK * c;
        const float p = j <= i && j < T && i < T ? exp(s[r][c] - li[r]) : 0.0f;
        const float keep =
            threshold ? attention_keep(((ulong)bh * T + i) * T + j, seed, threshold, inv_keep, step_lo, step_hi) : 1.0f;
        ds[r][c] = p * (dp[r][c] * keep - di[r]);
      }
    }
    UNROLL
    for (uint c = 0; c < 4; ++c) dst[(x + NK * c) * NQ + y] = (float4)(ds[0][c], ds[1][c], ds[2][c], ds[3][c]);
    barrier(CLK_LOCAL_MEM_FENCE);
    __local const float4 *const ds_y = dst + y, *const k_x = ks + x;
    UNROLL4
    for (uint key = 0; key < TK; ++key) {
      const float4 dsv = ds_y[key * NQ];
      UNROLL
      for (uint j = 0; j < FV; ++j) {
        if (D4 % NK != 0 && x + NK * j >= D4) break;
        const float4 kv = k_x[key * (RS / 4) + NK * j];
        AXPY4(g, j, dsv, kv)
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  UNROLL
  for (uint r = 0; r < 4; ++r) {
    const uint i = first + y + NQ * r;
    if (i >= T) break;
    const ulong at = dq_off + attention_at(b, i, h, T, H);
    UNROLL
    for (uint j = 0; j < 4 * FV; ++j) {
      const uint d = 4 * (x + NK * (j / 4)) + j % 4;
      if (d < D) STORE_T(g[r][j] * scale, dq, at + d);
    }
  }
}

// ---- dk and dv: TK keys per work-group, TQ queries a step -------------------------------------

// Work-item (y, x) = (lid / NQ, lid % NQ): keys y + NK r, queries x + NQ c of each step, dk and dv
// at the float4 columns x + NQ j. dv = sum_i p_ij keep do_i, dk = sum_i ds_ij (scale q_i).
#define KV ((D4 + NQ - 1) / NQ)

__kernel __attribute__((reqd_work_group_size(NT, 1, 1))) void attention_backward_kv_blocked(
    __global const T_STORAGE* q, ulong q_off, __global const T_STORAGE* k, ulong k_off, __global const T_STORAGE* v,
    ulong v_off, __global const T_STORAGE* dout, ulong do_off, __global const float* lse, ulong lse_off,
    __global const float* delta, ulong delta_off, __global T_STORAGE* dk, ulong dk_off, __global T_STORAGE* dv,
    ulong dv_off, uint T, uint H, float scale, uint seed, uint threshold, float inv_keep, uint step_lo,
    uint step_hi) {
  __local float4 ks[TK * RS / 4], vs[TK * RS / 4];   // the group's k rows and v rows
  __local float4 qs[TQ * RS / 4], dos[TQ * RS / 4];  // the step's scaled q rows and do rows
  __local float4 pt[TQ * NK], dst[TQ * NK];          // p keep and ds: [query NK + y]
  __local float ls[TQ], dl[TQ];
  const uint lid = get_local_id(0), y = lid / NQ, x = lid - y * NQ;
  const uint2 group = attention_group_longest_first(0);
  const uint bh = group.y, b = bh / H, h = bh - b * H;
  const uint first = group.x * TK;
  stage_rows((__local float*)ks, RS, TK, k, k_off, b, h, first, T, H, 1.0f);
  stage_rows((__local float*)vs, RS, TK, v, v_off, b, h, first, T, H, 1.0f);
  float gk[4][4 * KV], gv[4][4 * KV];
  UNROLL
  for (uint r = 0; r < 4; ++r) {
    UNROLL
    for (uint j = 0; j < 4 * KV; ++j) gk[r][j] = gv[r][j] = 0.0f;
  }
  for (uint ib = (first / TQ) * TQ; ib < T; ib += TQ) {  // the queries that see a key of the group
    stage_rows((__local float*)qs, RS, TQ, q, q_off, b, h, ib, T, H, scale);
    stage_rows((__local float*)dos, RS, TQ, dout, do_off, b, h, ib, T, H, 1.0f);
    for (uint e = lid; e < TQ; e += NT) {
      ls[e] = ib + e < T ? lse[lse_off + (ulong)bh * T + ib + e] : 0.0f;
      dl[e] = ib + e < T ? delta[delta_off + (ulong)bh * T + ib + e] : 0.0f;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    float s[4][4] = {{0.0f}}, dp[4][4] = {{0.0f}};
    block_dots(s, ks, y, NK, qs, x, NQ);   // s[key][query]
    block_dots(dp, vs, y, NK, dos, x, NQ);
    float pk[4][4], ds[4][4];
    UNROLL
    for (uint r = 0; r < 4; ++r) {
      const uint j = first + y + NK * r;
      UNROLL
      for (uint c = 0; c < 4; ++c) {
        const uint qi = x + NQ * c, i = ib + qi;
        const float p = j <= i && i < T && j < T ? exp(s[r][c] - ls[qi]) : 0.0f;
        const float keep =
            threshold ? attention_keep(((ulong)bh * T + i) * T + j, seed, threshold, inv_keep, step_lo, step_hi) : 1.0f;
        pk[r][c] = p * keep;
        ds[r][c] = p * (dp[r][c] * keep - dl[qi]);
      }
    }
    UNROLL
    for (uint c = 0; c < 4; ++c) {
      pt[(x + NQ * c) * NK + y] = (float4)(pk[0][c], pk[1][c], pk[2][c], pk[3][c]);
      dst[(x + NQ * c) * NK + y] = (float4)(ds[0][c], ds[1][c], ds[2][c], ds[3][c]);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    __local const float4 *const p_y = pt + y, *const ds_y = dst + y, *const do_x = dos + x, *const q_x = qs + x;
    UNROLL4
    for (uint qq = 0; qq < TQ; ++qq) {
      const float4 pv = p_y[qq * NK], dsv = ds_y[qq * NK];
      UNROLL
      for (uint j = 0; j < KV; ++j) {
        if (D4 % NQ != 0 && x + NQ * j >= D4) break;
        const float4 dov = do_x[qq * (RS / 4) + NQ * j], qv = q_x[qq * (RS / 4) + NQ * j];
        AXPY4(gv, j, pv, dov)
        AXPY4(gk, j, dsv, qv)
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  UNROLL
  for (uint r = 0; r < 4; ++r) {
    const uint j = first + y + NK * r;
    if (j >= T) break;
    const ulong kat = dk_off + attention_at(b, j, h, T, H), vat = dv_off + attention_at(b, j, h, T, H);
    UNROLL
    for (uint c = 0; c < 4 * KV; ++c) {
      const uint d = 4 * (x + NQ * (c / 4)) + c % 4;
      if (d < D) {
        STORE_T(gk[r][c], dk, kat + d);
        STORE_T(gv[r][c], dv, vat + d);
      }
    }
  }
}
