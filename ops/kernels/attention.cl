// Fused causal multi-head attention, forward and backward (ops/attention.hpp). Operands are
// (buffer, element offset) pairs; q, k, v, o and their gradients are [B, T, H HEAD_DIM] in the
// storage type T (dtype.clh), lse and delta are [B H, T] in f32. Arithmetic is f32.
//
// Built with -DHEAD_DIM=D -DDP=(D rounded up to 16) and one family's parameters:
//   RB, QB,   CPU devices: a work-item (local size 1) takes QB query rows, RB at a time, and walks
//   KB        the keys in blocks of 16 held as float16 (scores of 16 keys in one vector), its
//             online softmax per KB keys; the backward's key blocks take RB queries at a time. k and v are first
//             staged into f32 scratch per head (attention_stage): transposed [D, Tp] for the score
//             products and row-major [Tp, DP] (zero padded) for the value products, so the hot
//             loops read contiguous f32 only, whatever the storage type.
//   BQ, BK    other devices: a work-group of BQ work-items, one query (or key) each, with tiles of
//             BK keys (or queries) in local memory, read straight from the tensors.
// The backward first takes delta = rowsum(do o); then dk and dv per key block (recomputing the
// probabilities from lse) and dq per query block, or, on CPU devices with enough heads, the whole
// backward of a head in one work-item (attention_backward_head_cpu). No atomics: every output
// element has one writer and a fixed summation order, so runs give the same bits.
//
// Dropout (threshold > 0): the probability (b, h, i, j) is kept with the draw of ops::dropout for
// flat index ((b H + h) T + i) T + j of the [B, H, T, T] probabilities, scaled by inv_keep =
// 1 / (1 - p); step_lo and step_hi are set per step. The fused op and the unfused softmax +
// dropout therefore draw the same mask.

#ifdef RB
#define FERRY_WIDE16 1  // LOAD16_T, STORE16_T (dtype.clh) for the CPU kernels' whole rows
#endif
#include "attention.clh"
#include "reduce.clh"
#include "store16.clh"
#include "transpose16.clh"

#define DV (DP / 16)

// The dropout factors of keys j0 .. j0 + 15 of row i of head bh: attention_keep's draws for 16
// consecutive flat indices, made as one vector.
inline float16 attention_keep16(uint bh, uint T, uint i, uint j0, uint seed, uint threshold, float inv_keep,
                                uint step_lo, uint step_hi) {
  const uint16 r = philox_draws16(((ulong)bh * T + i) * T + j0, step_lo, step_hi, seed);
  return select((float16)0.0f, (float16)inv_keep, r >= (uint16)threshold);
}

// delta[bh, i] = sum_d do[b, i, h, d] o[b, i, h, d], summed as 16 lanes of d (d, d + 16, ...) and
// then across the lanes (attention_backward_head_local_cpu takes the same sums, so both CPU paths
// give the same bits). Work-item (i, bh).
__kernel void attention_delta(__global const T_STORAGE* o, ulong o_off, __global const T_STORAGE* dout, ulong do_off,
                              __global float* delta, ulong delta_off, uint T, uint H) {
  const uint i = get_global_id(0), bh = get_global_id(1);
  if (i >= T) return;
  const uint b = bh / H, h = bh - b * H;
  const ulong at = attention_at(b, i, h, T, H);
  float acc[16];
  for (uint e = 0; e < 16; ++e) acc[e] = 0.0f;
  for (uint d = 0; d < D; ++d) acc[d % 16] = fma(LOAD_T(dout, do_off + at + d), LOAD_T(o, o_off + at + d), acc[d % 16]);
  delta[delta_off + (ulong)bh * T + i] = fold_sum16(vload16(0, acc));
}

#ifdef RB

// Where the CPU kernels' staged f32 operands live. By default in global scratch, which the staging
// kernels below fill for all heads before the products run. Built with -DSTAGE_LOCAL (contexts
// whose staged head fits the device's local memory: ops/attention.cpp), each work-item stages its
// own head into its work-group's local memory and runs the same products on it: no staging kernels,
// and the staged rows never leave the core's caches (PoCL's CPU devices keep a local memory region
// per worker thread). At context 128 the staging kernels and the gaps between the ten launches took
// a third of the op's time (bench/RESULTS.md, "Attention staged per head in local memory").
#ifdef STAGE_LOCAL
#define SCRATCH __local
#define VSTORE16_SCRATCH(v, p) VSTORE16_LOCAL(v, p)
#else
#define SCRATCH __global
#define VSTORE16_SCRATCH(v, p) VSTORE16_GLOBAL(v, p)
#endif

// x[at .. at + D) widened into dst[0 .. D), 16 elements at a time where 16 are left (a narrow
// row's widening is then vector code: f16's is a dozen operations an element).
inline void attention_load_row(__global const T_STORAGE* x, ulong at, float* dst) {
  uint d = 0;
  for (; d + 16 <= D; d += 16) vstore16(LOAD16_T(x, at + d), 0, dst + d);
  for (; d < D; ++d) dst[d] = LOAD_T(x, at + d);
}

// v[0 .. D) stored at out[at .. at + D), rounded to the storage type 16 elements at a time where 16
// are left.
inline void attention_store_values(const float* v, __global T_STORAGE* out, ulong at) {
  uint d = 0;
  for (; d + 16 <= D; d += 16) STORE16_T(vload16(0, v + d), out, at + d);
  for (; d < D; ++d) STORE_T(v[d], out, at + d);
}

// Values d0 .. d0 + 15 of row t of head (b, h) of x as f32: zero past D, and the whole row zero
// past T.
inline float16 attention_row16(__global const T_STORAGE* x, ulong x_off, uint b, uint t, uint h, uint T, uint H,
                               uint d0) {
  if (t >= T) return (float16)0.0f;
  const ulong at = x_off + attention_at(b, t, h, T, H) + d0;
  if (d0 + 16 <= D) return LOAD16_T(x, at);
  float v[16];
  for (uint e = 0; e < 16; ++e) v[e] = d0 + e < D ? LOAD_T(x, at + e) : 0.0f;
  return vload16(0, v);
}

// Rows t0 .. t0 + 15 of head (b, h) of x staged transposed at trans (row t0 of a [D, Tp] head):
// each 16 x 16 block transposed in registers, each d then stored as 16 contiguous floats (a row
// at a time wrote single floats Tp apart: 3x slower at T = 4096); zero past T.
inline void attention_stage_trans16(__global const T_STORAGE* x, ulong x_off, uint b, uint t0, uint h, uint T,
                                    uint H, SCRATCH float* trans, uint Tp) {
  for (uint d0 = 0; d0 < D; d0 += 16) {
#define TR_LOAD(n) float16 r##n = attention_row16(x, x_off, b, t0 + n, h, T, H, d0);
#define TR_STORE(n) \
  if (d0 + n < D) VSTORE16_SCRATCH(r##n, trans + (ulong)(d0 + n) * Tp);
    FOR_16(TR_LOAD)
    TRANSPOSE16
    FOR_16(TR_STORE)
  }
}

// Rows t0 .. t0 + 15 of head (b, h) of x staged as f32 rows of DP floats at rows (row t0 of a
// [Tp, DP] head), zero past T and past D.
inline void attention_stage_rows16(__global const T_STORAGE* x, ulong x_off, uint b, uint t0, uint h, uint T, uint H,
                                   SCRATCH float* rows) {
  for (uint c = 0; c < 16; ++c) {
    for (uint d0 = 0; d0 < DP; d0 += 16) {
      VSTORE16_SCRATCH(attention_row16(x, x_off, b, t0 + c, h, T, H, d0), rows + c * DP + d0);
    }
  }
}

#ifndef STAGE_LOCAL

// Stages row t of head bh (of k, v, q or do) as f32 rows [BH, Tp, DP], zero past T and past D.
// Work-item (t, bh) over Tp = T rounded up to 16.
__kernel void attention_stage(__global const T_STORAGE* x, ulong x_off, __global float* rows, ulong rows_off, uint T,
                              uint Tp, uint H) {
  const uint t = get_global_id(0), bh = get_global_id(1);
  const uint b = bh / H, h = bh - b * H;
  __global float* dst = rows + rows_off + ((ulong)bh * Tp + t) * DP;
  for (uint d0 = 0; d0 < DP; d0 += 16) VSTORE16_GLOBAL(attention_row16(x, x_off, b, t, h, T, H, d0), dst + d0);
}

// Stages rows t0 .. t0 + 15 (t0 = 16 get_global_id(0)) of head bh = get_global_id(1) transposed,
// [BH, D, Tp], zero past T.
__kernel void attention_stage_t(__global const T_STORAGE* x, ulong x_off, __global float* trans, ulong trans_off,
                                uint T, uint Tp, uint H) {
  const uint t0 = get_global_id(0) * 16, bh = get_global_id(1);
  const uint b = bh / H, h = bh - b * H;
  attention_stage_trans16(x, x_off, b, t0, h, T, H, trans + trans_off + (ulong)bh * D * Tp + t0, Tp);
}

#endif  // !STAGE_LOCAL

#define KEY_LANES ((int16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))

// Register tiles of up to 8 rows (RB), named (PoCL keeps named float16 values in registers;
// arrays indexed in loops stay on the stack); every step tests r < RB. With AVX2's sixteen
// registers 6 rows of float16 scores are the most that fit beside a key vector.
#define ROWS8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)

// A row of a float16 accumulator times `factor`, stored as D elements of the storage type at `at`.
inline void attention_store_row(const float16* acc, float factor, __global T_STORAGE* out, ulong at) {
  for (uint j = 0; j < DV; ++j) {
    if (16 * j + 16 <= D) {
      STORE16_T(acc[j] * factor, out, at + 16 * j);
      continue;
    }
    float v[16];
    vstore16(acc[j] * factor, 0, v);
    for (uint e = 0; 16 * j + e < D; ++e) STORE_T(v[e], out, at + 16 * j + e);
  }
}

// Keys per block of the forward's online softmax (a multiple of 16): the scores of a block are
// made 16 keys at a time into an L1 array, then each row's maximum, rescale and sum are taken
// once per block rather than per 16 keys (context 2048, head dimension 64: forward 88 ms with
// 16 keys a block, 78 with 64; bench/RESULTS.md).
#ifndef KB
#define KB 64
#endif

// Forward, QB = RB NSUB query rows from i0 of head bh, with an online softmax over blocks of KB
// keys: running maximum m and sum l per row, the accumulated output rescaled whenever the maximum
// grows. Each key block is taken by the work-item's NSUB sub-blocks of RB rows in turn, so its kᵀ
// and v stay in the L1 cache. kt and vr are the head's staged kᵀ [D, Tp] and v rows [Tp, DP].
inline void attention_forward_rows(__global const T_STORAGE* q, ulong q_off, SCRATCH const float* kt,
                                   SCRATCH const float* vr, __global T_STORAGE* o, ulong o_off, __global float* lse,
                                   ulong lse_off, uint i0, uint bh, uint T, uint Tp, uint H, float scale, uint seed,
                                   uint threshold, float inv_keep, uint step_lo, uint step_hi) {
  const uint b = bh / H, h = bh - b * H;
  const uint nr = min((uint)QB, T - i0);

  float qs[QB][D];  // scaled queries
  float16 acc[QB][DV];
  float m[QB], l[QB];
  for (uint r = 0; r < QB; ++r) {
    const ulong at = q_off + attention_at(b, min(i0 + r, T - 1), h, T, H);
    attention_load_row(q, at, qs[r]);
    for (uint d = 0; d < D; ++d) qs[r][d] = r < nr ? qs[r][d] * scale : 0.0f;
    for (uint j = 0; j < DV; ++j) acc[r][j] = 0.0f;
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }

  const uint kend = i0 + nr;  // the rows see keys 0 .. kend - 1
  for (uint kb = 0; kb < kend; kb += KB) {
    for (uint r0 = 0; r0 < nr; r0 += RB) {
      // These rows see keys before `last`: the block's first kn of them (its other keys, and
      // the keys of the last 16 past a row, are masked).
      const uint last = min(i0 + r0 + RB, kend);
      if (kb >= last) continue;
      const uint kn = min((uint)KB, last - kb);
      float p[RB][KB];
#define S_DECL(r) float16 s##r = 0.0f;
#define S_STEP(r) \
  if (r < RB) s##r = fma((float16)qs[r0 + r][d], kv, s##r);
#define S_KEEP(r)                                                                                     \
  if (r < RB) {                                                                                       \
    const uint i = i0 + r0 + r;                                                                       \
    if (j0 + 15 > i) s##r = select(s##r, (float16)(-INFINITY), ((int16)j0 + KEY_LANES) > (int16)i); \
    vstore16(s##r, 0, p[r] + sb);                                                                     \
  }
      for (uint sb = 0; sb < kn; sb += 16) {
        const uint j0 = kb + sb;
        ROWS8(S_DECL)
        for (uint d = 0; d < D; ++d) {
          const float16 kv = vload16(0, kt + (ulong)d * Tp + j0);
          ROWS8(S_STEP)
        }
        ROWS8(S_KEEP)
      }
#define SOFTMAX_ROW(r)                                                                            \
  if (r < RB) {                                                                                   \
    const uint i = i0 + r0 + r;                                                                   \
    float16 mv = vload16(0, p[r]);                                                                \
    for (uint sb = 16; sb < kn; sb += 16) mv = fmax(mv, vload16(0, p[r] + sb));                   \
    const float mnew = fmax(m[r0 + r], fold_max16(mv));                                           \
    float16 sum = 0.0f;                                                                           \
    for (uint sb = 0; sb < kn; sb += 16) {                                                        \
      float16 e = exp(vload16(0, p[r] + sb) - mnew);                                              \
      sum += e;                                                                                   \
      if (threshold) e *= attention_keep16(bh, T, i, kb + sb, seed, threshold, inv_keep, step_lo, step_hi); \
      vstore16(e, 0, p[r] + sb);                                                                  \
    }                                                                                             \
    const float rescale = exp(m[r0 + r] - mnew);                                                  \
    l[r0 + r] = l[r0 + r] * rescale + fold_sum16(sum);                                            \
    m[r0 + r] = mnew;                                                                             \
    if (rescale != 1.0f) {                                                                        \
      for (uint j = 0; j < DV; ++j) acc[r0 + r][j] *= rescale;                                    \
    }                                                                                             \
  }
      ROWS8(SOFTMAX_ROW)
      // o += p v: an RB x 16 register tile per 16 output columns, over the block's keys.
#define T_LOAD(r) float16 t##r = r < RB ? acc[r0 + r][j] : 0.0f;
#define T_STEP(r) \
  if (r < RB) t##r = fma((float16)p[r][c], vv, t##r);
#define T_STORE(r) \
  if (r < RB) acc[r0 + r][j] = t##r;
      for (uint j = 0; j < DV; ++j) {
        ROWS8(T_LOAD)
        for (uint c = 0; c < kn; ++c) {
          const float16 vv = vload16(j, vr + (ulong)(kb + c) * DP);
          ROWS8(T_STEP)
        }
        ROWS8(T_STORE)
      }
    }
  }

  for (uint r = 0; r < nr; ++r) {
    attention_store_row(acc[r], 1.0f / l[r], o, o_off + attention_at(b, i0 + r, h, T, H));
    lse[lse_off + (ulong)bh * T + i0 + r] = m[r] + log(l[r]);
  }
}

#ifndef STAGE_LOCAL

// The forward of QB query rows i0 = QB get_global_id(0) of head bh = get_global_id(1), kᵀ and v
// staged in global scratch.
__kernel void attention_forward_cpu(__global const T_STORAGE* q, ulong q_off, __global const float* kt, ulong kt_off,
                                    __global const float* vr, ulong vr_off, __global T_STORAGE* o, ulong o_off,
                                    __global float* lse, ulong lse_off, uint T, uint Tp, uint H, float scale,
                                    uint seed, uint threshold, float inv_keep, uint step_lo, uint step_hi) {
  const uint i0 = get_global_id(0) * QB, bh = get_global_id(1);
  if (i0 >= T) return;
  attention_forward_rows(q, q_off, kt + kt_off + (ulong)bh * D * Tp, vr + vr_off + (ulong)bh * Tp * DP, o, o_off, lse,
                         lse_off, i0, bh, T, Tp, H, scale, seed, threshold, inv_keep, step_lo, step_hi);
}

#else

// The forward of head bh = get_global_id(0), its kᵀ and v rows staged by the work-item into the
// work-group's local memory (scratch: D Tp + Tp DP floats), then its query blocks in turn.
__kernel void attention_forward_local_cpu(__global const T_STORAGE* q, ulong q_off, __global const T_STORAGE* k,
                                          ulong k_off, __global const T_STORAGE* v, ulong v_off,
                                          __global T_STORAGE* o, ulong o_off, __global float* lse, ulong lse_off,
                                          __local float* scratch, uint T, uint Tp, uint H, float scale, uint seed,
                                          uint threshold, float inv_keep, uint step_lo, uint step_hi) {
  const uint bh = get_global_id(0);
  const uint b = bh / H, h = bh - b * H;
  __local float* kt = scratch;
  __local float* vr = scratch + D * Tp;
  for (uint t0 = 0; t0 < Tp; t0 += 16) {
    attention_stage_trans16(k, k_off, b, t0, h, T, H, kt + t0, Tp);
    attention_stage_rows16(v, v_off, b, t0, h, T, H, vr + t0 * DP);
  }
  for (uint i0 = 0; i0 < T; i0 += QB) {
    attention_forward_rows(q, q_off, kt, vr, o, o_off, lse, lse_off, i0, bh, T, Tp, H, scale, seed, threshold,
                           inv_keep, step_lo, step_hi);
  }
}

#endif  // STAGE_LOCAL

// Key blocks of 16 the one-pass backward takes per walk over the queries: each query's q, do and
// dq rows are read once per group instead of once per block (at long contexts a head's rows
// outgrow L2). Their kᵀ, vᵀ and gradients are private: 16 KiB a block at head dimension 64.
#ifndef KV_GROUP
#define KV_GROUP (D <= 64 ? 4 : 2)
#endif

// dk and dv of the 16 keys j0 .. j0 + 15 of head bh, over every query i >= j0: the probabilities
// p = exp(scale q k - lse) and dp = do v recomputed as 16-key vectors, the gradients accumulated
// transposed ([d] holds 16 keys), as the staged kᵀ and vᵀ are; the queries in groups of RB (named
// registers, see ROWS8), so that each load of kᵀ, vᵀ and each update of the gradients serves
// RB rows (rows past T get p = 0). qr and dr (q and do staged as f32 rows [Tp, DP]: read in
// place, once per key block, contiguous), kt, vt, kr, lse and delta point at head bh's. With dq_acc
// (head bh's f32 rows [Tp, DP]), also dq += ds k for those queries (unscaled).
inline void attention_kv_block(SCRATCH const float* qr, SCRATCH const float* dr, SCRATCH const float* kt,
                               SCRATCH const float* vt, SCRATCH const float* kr,
                               __global const float* lse, SCRATCH const float* delta, SCRATCH float* dq_acc,
                               __global T_STORAGE* dk, ulong dk_off, __global T_STORAGE* dv, ulong dv_off, uint j0,
                               uint nblk, uint bh, uint T, uint Tp, uint H, float scale, uint seed, uint threshold,
                               float inv_keep, uint step_lo, uint step_hi) {
  const uint b = bh / H, h = bh - b * H;
  float16 kT[KV_GROUP][D], vT[KV_GROUP][D], dkT[KV_GROUP][D], dvT[KV_GROUP][D];
  for (uint g = 0; g < nblk; ++g) {
    for (uint d = 0; d < D; ++d) {
      kT[g][d] = vload16(0, kt + (ulong)d * Tp + j0 + 16 * g);
      vT[g][d] = vload16(0, vt + (ulong)d * Tp + j0 + 16 * g);
      dkT[g][d] = 0.0f;
      dvT[g][d] = 0.0f;
    }
  }
  for (uint i0 = j0; i0 < T; i0 += RB) {
    // Row r of the group (rows past T read row T - 1 and get p = 0).
#define KV_ROW(r)                                                     \
  SCRATCH const float* qi##r = qr + (ulong)min(i0 + r, T - 1) * DP;  \
  SCRATCH const float* doi##r = dr + (ulong)min(i0 + r, T - 1) * DP;
#define KV_DECL(r) float16 s##r = 0.0f, dp##r = 0.0f, pd##r, ds##r;
#define KV_SCORE(r) \
  if (r < RB) s##r = fma((float16)qi##r[d], kd, s##r);
#define KV_SCALE(r) \
  if (r < RB) s##r *= scale;
#define KV_DP(r) \
  if (r < RB) dp##r = fma((float16)doi##r[d], vd, dp##r);
#define KV_PROB(r)                                                                                   \
  if (r >= RB || i0 + r >= T) {                                                                      \
    pd##r = ds##r = 0.0f;                                                                            \
  } else {                                                                                           \
    const uint i = i0 + r;                                                                           \
    float16 p = exp(s##r - lse[i]);                                                                  \
    if (jg + 15 > i) p = select(p, (float16)0.0f, ((int16)jg + KEY_LANES) > (int16)i);               \
    pd##r = p;                                                                                       \
    if (threshold) {                                                                                 \
      const float16 keep = attention_keep16(bh, T, i, jg, seed, threshold, inv_keep, step_lo, step_hi); \
      pd##r *= keep;                                                                                 \
      dp##r *= keep;                                                                                 \
    }                                                                                                \
    ds##r = p * (dp##r - delta[i]);                                                                  \
  }
#define KV_GRAD(r)                           \
  if (r < RB) {                              \
    gv = fma(pd##r, (float16)doi##r[d], gv); \
    gk = fma(ds##r, (float16)qi##r[d], gk);  \
  }  // dk = scale sum ds q: scaled as it is stored
    ROWS8(KV_ROW)
    // The group's key blocks in turn, while the rows' q, do and dq are in L1; a block whose first
    // key is past the last row ends the walk (so do the ones after it).
    for (uint g = 0; g < nblk; ++g) {
      const uint jg = j0 + 16 * g;
      if (jg >= i0 + RB) break;
      const uint kn = min(16u, T - jg);
      ROWS8(KV_DECL)
      // Scores and do vᵀ in two loops: together their float16 accumulators (eight for four rows)
      // outnumber an AVX2 core's sixteen registers, and the loads of kᵀ and vᵀ spilled them.
      for (uint d = 0; d < D; ++d) {
        const float16 kd = kT[g][d];
        ROWS8(KV_SCORE)
      }
      ROWS8(KV_SCALE)
      for (uint d = 0; d < D; ++d) {
        const float16 vd = vT[g][d];
        ROWS8(KV_DP)
      }
      ROWS8(KV_PROB)
      for (uint d = 0; d < D; ++d) {
        float16 gv = dvT[g][d], gk = dkT[g][d];
        ROWS8(KV_GRAD)
        dvT[g][d] = gv;
        dkT[g][d] = gk;
      }
      if (dq_acc) {
        // dq rows i0 .. i0 + RB - 1 += ds k over the block's keys (rows past T are neither read nor
        // written: with RB = 6 they can lie past the head's Tp rows).
        float dsa[RB][16];
#define DS_SAVE(r) \
  if (r < RB) vstore16(ds##r, 0, dsa[r]);
#define DQ_LOAD(r) float16 t##r = r < RB && i0 + r < T ? vload16(j, dq_acc + (ulong)(i0 + r) * DP) : 0.0f;
#define DQ_STEP(r) \
  if (r < RB) t##r = fma((float16)dsa[r][c], kv, t##r);
#define DQ_STORE(r) \
  if (r < RB && i0 + r < T) VSTORE16_SCRATCH(t##r, dq_acc + (ulong)(i0 + r) * DP + 16 * j);
        ROWS8(DS_SAVE)
        for (uint j = 0; j < DV; ++j) {
          ROWS8(DQ_LOAD)
          for (uint c = 0; c < kn; ++c) {
            const float16 kv = vload16(j, kr + (ulong)(jg + c) * DP);
            ROWS8(DQ_STEP)
          }
          ROWS8(DQ_STORE)
        }
      }
    }
  }
  // dk and dv are held transposed (a float16 of 16 keys per d): turned back into rows of D in
  // private memory, each key's row then stored 16 elements at a time.
  for (uint g = 0; g < nblk; ++g) {
    const uint jg = j0 + 16 * g, kn = min(16u, T - jg);
    float gk[D][16], gv[D][16];
    for (uint d = 0; d < D; ++d) {
      vstore16(dkT[g][d] * scale, 0, gk[d]);
      vstore16(dvT[g][d], 0, gv[d]);
    }
    for (uint c = 0; c < kn; ++c) {
      float rk[D], rv[D];
      for (uint d = 0; d < D; ++d) {
        rk[d] = gk[d][c];
        rv[d] = gv[d][c];
      }
      const ulong at = attention_at(b, jg + c, h, T, H);
      attention_store_values(rk, dk, dk_off + at);
      attention_store_values(rv, dv, dv_off + at);
    }
  }
}

#ifndef STAGE_LOCAL

// dk and dv of 16 keys j0 = 16 get_global_id(0) of head bh = get_global_id(1) (the two-pass
// backward: dq follows in attention_backward_q_cpu).
__kernel void attention_backward_kv_cpu(__global const float* qr, ulong qr_off, __global const float* dr,
                                        ulong dr_off, __global const float* kt, ulong kt_off,
                                        __global const float* vt, ulong vt_off, __global const float* lse,
                                        ulong lse_off, __global const float* delta, ulong delta_off,
                                        __global T_STORAGE* dk, ulong dk_off, __global T_STORAGE* dv, ulong dv_off,
                                        uint T, uint Tp, uint H, float scale, uint seed, uint threshold,
                                        float inv_keep, uint step_lo, uint step_hi) {
  const uint j0 = get_global_id(0) * 16, bh = get_global_id(1);
  if (j0 >= T) return;
  attention_kv_block(qr + qr_off + (ulong)bh * Tp * DP, dr + dr_off + (ulong)bh * Tp * DP,
                     kt + kt_off + (ulong)bh * D * Tp, vt + vt_off + (ulong)bh * D * Tp, 0, lse + lse_off + (ulong)bh * T,
                     delta + delta_off + (ulong)bh * T, 0, dk, dk_off, dv, dv_off, j0, 1u, bh, T, Tp, H, scale, seed,
                     threshold, inv_keep, step_lo, step_hi);
}

// The whole backward of head bh = get_global_id(0) in one pass, for when there are enough heads
// to keep every core busy: per 16-key block, dk and dv as in attention_backward_kv_cpu and dq +=
// ds k into f32 rows dq_acc [BH, Tp, DP] (scratch) that only this work-item touches, so the scores
// and do vᵀ are computed once, not twice (five products instead of seven) and no atomics are
// needed. dq_acc is scaled and stored at the end.
__kernel void attention_backward_head_cpu(__global const float* qr, ulong qr_off, __global const float* dr,
                                          ulong dr_off, __global const float* kt, ulong kt_off,
                                          __global const float* vt, ulong vt_off, __global const float* kr,
                                          ulong kr_off, __global const float* lse, ulong lse_off,
                                          __global const float* delta, ulong delta_off, __global float* dq_acc,
                                          ulong dq_acc_off, __global T_STORAGE* dq, ulong dq_off,
                                          __global T_STORAGE* dk, ulong dk_off, __global T_STORAGE* dv, ulong dv_off,
                                          uint T, uint Tp, uint H, float scale, uint seed, uint threshold,
                                          float inv_keep, uint step_lo, uint step_hi) {
  const uint bh = get_global_id(0);
  const uint b = bh / H, h = bh - b * H;
  dq_acc += dq_acc_off + (ulong)bh * Tp * DP;
  for (uint i = 0; i < Tp * DV; ++i) VSTORE16_GLOBAL((float16)0.0f, dq_acc + 16 * (ulong)i);
  for (uint j0 = 0; j0 < T; j0 += 16 * KV_GROUP) {
    attention_kv_block(qr + qr_off + (ulong)bh * Tp * DP, dr + dr_off + (ulong)bh * Tp * DP,
                       kt + kt_off + (ulong)bh * D * Tp, vt + vt_off + (ulong)bh * D * Tp,
                       kr + kr_off + (ulong)bh * Tp * DP, lse + lse_off + (ulong)bh * T,
                       delta + delta_off + (ulong)bh * T, dq_acc, dk, dk_off, dv, dv_off, j0,
                       min((uint)KV_GROUP, (T - j0 + 15) / 16), bh, T, Tp, H, scale, seed, threshold, inv_keep,
                       step_lo, step_hi);
  }
  for (uint i = 0; i < T; ++i) {
    float16 row[DV];
    for (uint j = 0; j < DV; ++j) row[j] = vload16(j, dq_acc + (ulong)i * DP);
    attention_store_row(row, scale, dq, dq_off + attention_at(b, i, h, T, H));
  }
}

// dq of QB query rows i0 = QB get_global_id(0) of head bh: dq = scale sum_j ds_ij k_j over the
// keys each row sees, ds recomputed per 16-key block as in attention_backward_kv_cpu, RB rows at
// a time in registers (as the forward).
__kernel void attention_backward_q_cpu(__global const float* qr, ulong qr_off, __global const float* dr,
                                       ulong dr_off, __global const float* kt, ulong kt_off, __global const float* vt,
                                       ulong vt_off, __global const float* kr, ulong kr_off,
                                       __global const float* lse, ulong lse_off, __global const float* delta,
                                       ulong delta_off, __global T_STORAGE* dq, ulong dq_off, uint T, uint Tp, uint H,
                                       float scale, uint seed, uint threshold, float inv_keep, uint step_lo,
                                       uint step_hi) {
  const uint i0 = get_global_id(0) * QB, bh = get_global_id(1);
  if (i0 >= T) return;
  const uint b = bh / H, h = bh - b * H;
  const uint nr = min((uint)QB, T - i0);
  kt += kt_off + (ulong)bh * D * Tp;
  vt += vt_off + (ulong)bh * D * Tp;
  kr += kr_off + (ulong)bh * Tp * DP;
  qr += qr_off + (ulong)bh * Tp * DP;  // q and do as staged f32 rows (as for the key blocks)
  dr += dr_off + (ulong)bh * Tp * DP;

  float qs[QB][D], dos[QB][D], li[QB], di[QB];
  float16 acc[QB][DV];
  for (uint r = 0; r < QB; ++r) {
    for (uint d = 0; d < D; ++d) {
      qs[r][d] = r < nr ? qr[(ulong)(i0 + r) * DP + d] * scale : 0.0f;
      dos[r][d] = r < nr ? dr[(ulong)(i0 + r) * DP + d] : 0.0f;
    }
    li[r] = r < nr ? lse[lse_off + (ulong)bh * T + i0 + r] : 0.0f;
    di[r] = r < nr ? delta[delta_off + (ulong)bh * T + i0 + r] : 0.0f;
    for (uint j = 0; j < DV; ++j) acc[r][j] = 0.0f;
  }

  const uint kend = i0 + nr;
  for (uint kb = 0; kb < kend; kb += 16) {
    for (uint r0 = 0; r0 < nr; r0 += RB) {
      if (kb > i0 + r0 + RB - 1) continue;
#define SD_DECL(r) float16 s##r = 0.0f, dp##r = 0.0f;
#define SD_SCORE(r) \
  if (r < RB) s##r = fma((float16)qs[r0 + r][d], kv, s##r);
#define SD_DP(r) \
  if (r < RB) dp##r = fma((float16)dos[r0 + r][d], vv, dp##r);
      ROWS8(SD_DECL)
      // Two loops, as in attention_kv_block: eight float16 accumulators fill an AVX2 core's registers.
      for (uint d = 0; d < D; ++d) {
        const float16 kv = vload16(0, kt + (ulong)d * Tp + kb);
        ROWS8(SD_SCORE)
      }
      for (uint d = 0; d < D; ++d) {
        const float16 vv = vload16(0, vt + (ulong)d * Tp + kb);
        ROWS8(SD_DP)
      }
      float ds[RB][16];
#define DS_ROW(r)                                                                                  \
  if (r < RB) {                                                                                    \
    const uint i = i0 + r0 + r;                                                                    \
    float16 p = exp(s##r - li[r0 + r]);                                                            \
    if (kb + 15 > i) p = select(p, (float16)0.0f, ((int16)kb + KEY_LANES) > (int16)i);             \
    if (threshold) dp##r *= attention_keep16(bh, T, i, kb, seed, threshold, inv_keep, step_lo, step_hi); \
    vstore16(p * (dp##r - di[r0 + r]), 0, ds[r]);                                                  \
  }
      ROWS8(DS_ROW)
      const uint kn = min(16u, kend - kb);
#define G_STEP(r) \
  if (r < RB) t##r = fma((float16)ds[r][c], kv, t##r);
      for (uint j = 0; j < DV; ++j) {
        ROWS8(T_LOAD)
        for (uint c = 0; c < kn; ++c) {
          const float16 kv = vload16(j, kr + (ulong)(kb + c) * DP);
          ROWS8(G_STEP)
        }
        ROWS8(T_STORE)
      }
    }
  }

  for (uint r = 0; r < nr; ++r) attention_store_row(acc[r], scale, dq, dq_off + attention_at(b, i0 + r, h, T, H));
}

#endif  // !STAGE_LOCAL

#ifdef STAGE_LOCAL

// The one-pass backward of head bh = get_global_id(0) (as attention_backward_head_cpu), its
// operands staged by the work-item into the work-group's local memory (scratch: kᵀ and vᵀ [D, Tp],
// rows of k, q, do and the f32 dq [Tp, DP], delta [Tp]); delta = rowsum(do o) from the staged do
// rows and o (the same sums, in the same order, as attention_delta).
__kernel void attention_backward_head_local_cpu(
    __global const T_STORAGE* q, ulong q_off, __global const T_STORAGE* k, ulong k_off, __global const T_STORAGE* v,
    ulong v_off, __global const T_STORAGE* o, ulong o_off, __global const T_STORAGE* dout, ulong do_off,
    __global const float* lse, ulong lse_off, __global T_STORAGE* dq, ulong dq_off, __global T_STORAGE* dk,
    ulong dk_off, __global T_STORAGE* dv, ulong dv_off, __local float* scratch, uint T, uint Tp, uint H, float scale,
    uint seed, uint threshold, float inv_keep, uint step_lo, uint step_hi) {
  const uint bh = get_global_id(0);
  const uint b = bh / H, h = bh - b * H;
  __local float* kt = scratch;
  __local float* vt = kt + D * Tp;
  __local float* kr = vt + D * Tp;
  __local float* qr = kr + Tp * DP;
  __local float* dr = qr + Tp * DP;
  __local float* dq_acc = dr + Tp * DP;
  __local float* delta = dq_acc + Tp * DP;
  for (uint t0 = 0; t0 < Tp; t0 += 16) {
    attention_stage_trans16(k, k_off, b, t0, h, T, H, kt + t0, Tp);
    attention_stage_rows16(k, k_off, b, t0, h, T, H, kr + t0 * DP);
    attention_stage_trans16(v, v_off, b, t0, h, T, H, vt + t0, Tp);
    attention_stage_rows16(q, q_off, b, t0, h, T, H, qr + t0 * DP);
    attention_stage_rows16(dout, do_off, b, t0, h, T, H, dr + t0 * DP);
  }
  for (uint i = 0; i < T; ++i) {
    float16 acc = 0.0f;
    for (uint d0 = 0; d0 < DP; d0 += 16) {
      acc = fma(vload16(0, dr + i * DP + d0), attention_row16(o, o_off, b, i, h, T, H, d0), acc);
    }
    delta[i] = fold_sum16(acc);
  }
  for (uint i = 0; i < Tp * DV; ++i) VSTORE16_LOCAL((float16)0.0f, dq_acc + 16 * i);
  for (uint j0 = 0; j0 < T; j0 += 16 * KV_GROUP) {
    attention_kv_block(qr, dr, kt, vt, kr, lse + lse_off + (ulong)bh * T, delta, dq_acc, dk, dk_off, dv, dv_off, j0,
                       min((uint)KV_GROUP, (T - j0 + 15) / 16), bh, T, Tp, H, scale, seed, threshold, inv_keep,
                       step_lo, step_hi);
  }
  for (uint i = 0; i < T; ++i) {
    float16 row[DV];
    for (uint j = 0; j < DV; ++j) row[j] = vload16(j, dq_acc + i * DP);
    attention_store_row(row, scale, dq, dq_off + attention_at(b, i, h, T, H));
  }
}

#endif  // STAGE_LOCAL

#endif  // RB

#ifdef BQ

// Forward on work-groups of BQ queries (one per work-item) of one head (longest first), with the
// keys and values of BK keys at a time in local memory; online softmax per 8 keys.
__kernel void attention_forward_tiled(__global const T_STORAGE* q, ulong q_off, __global const T_STORAGE* k,
                                      ulong k_off, __global const T_STORAGE* v, ulong v_off, __global T_STORAGE* o,
                                      ulong o_off, __global float* lse, ulong lse_off, uint T, uint H, float scale,
                                      uint seed, uint threshold, float inv_keep, uint step_lo, uint step_hi) {
  __local float ks[BK][D], vs[BK][D];
  const uint2 group = attention_group_longest_first(1);
  const uint lid = get_local_id(0), bh = group.y;
  const uint b = bh / H, h = bh - b * H;
  const uint first = group.x * BQ, i = first + lid;
  const bool active = i < T;
  float qi[D], acc[D];
  const ulong at = attention_at(b, min(i, T - 1), h, T, H);
  for (uint d = 0; d < D; ++d) {
    qi[d] = LOAD_T(q, q_off + at + d) * scale;
    acc[d] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  const uint kend = min(T, first + BQ);  // keys the group's last row sees
  for (uint kb = 0; kb < kend; kb += BK) {
    for (uint e = lid; e < BK * D; e += BQ) {
      const uint c = e / D, d = e - c * D, key = kb + c;
      const ulong kat = attention_at(b, min(key, T - 1), h, T, H) + d;
      ks[c][d] = key < T ? LOAD_T(k, k_off + kat) : 0.0f;
      vs[c][d] = key < T ? LOAD_T(v, v_off + kat) : 0.0f;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (active) {
      for (uint c0 = 0; c0 < BK && kb + c0 <= i; c0 += 8) {
        float s[8];
        float mx = -INFINITY;
        for (uint c = 0; c < 8; ++c) {
          float acc_s = 0.0f;
          for (uint d = 0; d < D; ++d) acc_s = fma(qi[d], ks[c0 + c][d], acc_s);
          s[c] = kb + c0 + c <= i ? acc_s : -INFINITY;
          mx = fmax(mx, s[c]);
        }
        const float mnew = fmax(m, mx), rescale = exp(m - mnew);
        m = mnew;
        l *= rescale;
        for (uint d = 0; d < D; ++d) acc[d] *= rescale;
        for (uint c = 0; c < 8; ++c) {
          float p = exp(s[c] - mnew);
          l += p;
          if (threshold) {
            p *= attention_keep(((ulong)bh * T + i) * T + kb + c0 + c, seed, threshold, inv_keep, step_lo, step_hi);
          }
          for (uint d = 0; d < D; ++d) acc[d] = fma(p, vs[c0 + c][d], acc[d]);
        }
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (!active) return;
  const float inv = 1.0f / l;
  for (uint d = 0; d < D; ++d) STORE_T(acc[d] * inv, o, o_off + at + d);
  lse[lse_off + (ulong)bh * T + i] = m + log(l);
}

// dk and dv on work-groups of BQ keys (one per work-item), with BK queries at a time (their
// scaled q, do, lse and delta) in local memory.
__kernel void attention_backward_kv_tiled(__global const T_STORAGE* q, ulong q_off, __global const T_STORAGE* k,
                                          ulong k_off, __global const T_STORAGE* v, ulong v_off,
                                          __global const T_STORAGE* dout, ulong do_off, __global const float* lse,
                                          ulong lse_off, __global const float* delta, ulong delta_off,
                                          __global T_STORAGE* dk, ulong dk_off, __global T_STORAGE* dv, ulong dv_off,
                                          uint T, uint H, float scale, uint seed, uint threshold, float inv_keep,
                                          uint step_lo, uint step_hi) {
  __local float qs[BK][D], dos[BK][D], ls[BK], dl[BK];
  const uint2 group = attention_group_longest_first(0);
  const uint lid = get_local_id(0), bh = group.y;
  const uint b = bh / H, h = bh - b * H;
  const uint first = group.x * BQ, j = first + lid;
  const bool active = j < T;
  const ulong at = attention_at(b, min(j, T - 1), h, T, H);
  float kj[D], vj[D], gk[D], gv[D];
  for (uint d = 0; d < D; ++d) {
    kj[d] = LOAD_T(k, k_off + at + d);
    vj[d] = LOAD_T(v, v_off + at + d);
    gk[d] = gv[d] = 0.0f;
  }
  for (uint ib = first; ib < T; ib += BK) {
    for (uint e = lid; e < BK * D; e += BQ) {
      const uint r = e / D, d = e - r * D, row = ib + r;
      const ulong qat = attention_at(b, min(row, T - 1), h, T, H) + d;
      qs[r][d] = row < T ? LOAD_T(q, q_off + qat) * scale : 0.0f;
      dos[r][d] = row < T ? LOAD_T(dout, do_off + qat) : 0.0f;
    }
    for (uint r = lid; r < BK; r += BQ) {
      ls[r] = ib + r < T ? lse[lse_off + (ulong)bh * T + ib + r] : 0.0f;
      dl[r] = ib + r < T ? delta[delta_off + (ulong)bh * T + ib + r] : 0.0f;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (active) {
      for (uint r = 0; r < BK && ib + r < T; ++r) {
        const uint i = ib + r;
        if (i < j) continue;
        float s = 0.0f, dp = 0.0f;
        for (uint d = 0; d < D; ++d) {
          s = fma(qs[r][d], kj[d], s);
          dp = fma(dos[r][d], vj[d], dp);
        }
        const float p = exp(s - ls[r]);
        const float keep =
            threshold ? attention_keep(((ulong)bh * T + i) * T + j, seed, threshold, inv_keep, step_lo, step_hi) : 1.0f;
        const float ds = p * (dp * keep - dl[r]);
        for (uint d = 0; d < D; ++d) {
          gv[d] = fma(p * keep, dos[r][d], gv[d]);
          gk[d] = fma(ds, qs[r][d], gk[d]);
        }
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (!active) return;
  for (uint d = 0; d < D; ++d) {
    STORE_T(gk[d], dk, dk_off + at + d);
    STORE_T(gv[d], dv, dv_off + at + d);
  }
}

// dq on work-groups of BQ queries, with BK keys and values at a time in local memory.
__kernel void attention_backward_q_tiled(__global const T_STORAGE* q, ulong q_off, __global const T_STORAGE* k,
                                         ulong k_off, __global const T_STORAGE* v, ulong v_off,
                                         __global const T_STORAGE* dout, ulong do_off, __global const float* lse,
                                         ulong lse_off, __global const float* delta, ulong delta_off,
                                         __global T_STORAGE* dq, ulong dq_off, uint T, uint H, float scale, uint seed,
                                         uint threshold, float inv_keep, uint step_lo, uint step_hi) {
  __local float ks[BK][D], vs[BK][D];
  const uint2 group = attention_group_longest_first(1);
  const uint lid = get_local_id(0), bh = group.y;
  const uint b = bh / H, h = bh - b * H;
  const uint first = group.x * BQ, i = first + lid;
  const bool active = i < T;
  const ulong at = attention_at(b, min(i, T - 1), h, T, H);
  float qi[D], doi[D], g[D];
  for (uint d = 0; d < D; ++d) {
    qi[d] = LOAD_T(q, q_off + at + d) * scale;
    doi[d] = LOAD_T(dout, do_off + at + d);
    g[d] = 0.0f;
  }
  const float li = active ? lse[lse_off + (ulong)bh * T + i] : 0.0f;
  const float di = active ? delta[delta_off + (ulong)bh * T + i] : 0.0f;
  const uint kend = min(T, first + BQ);
  for (uint kb = 0; kb < kend; kb += BK) {
    for (uint e = lid; e < BK * D; e += BQ) {
      const uint c = e / D, d = e - c * D, key = kb + c;
      const ulong kat = attention_at(b, min(key, T - 1), h, T, H) + d;
      ks[c][d] = key < T ? LOAD_T(k, k_off + kat) : 0.0f;
      vs[c][d] = key < T ? LOAD_T(v, v_off + kat) : 0.0f;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (active) {
      for (uint c = 0; c < BK && kb + c <= i; ++c) {
        float s = 0.0f, dp = 0.0f;
        for (uint d = 0; d < D; ++d) {
          s = fma(qi[d], ks[c][d], s);
          dp = fma(doi[d], vs[c][d], dp);
        }
        const float p = exp(s - li);
        const float keep = threshold ? attention_keep(((ulong)bh * T + i) * T + kb + c, seed, threshold, inv_keep,
                                                      step_lo, step_hi)
                                     : 1.0f;
        const float ds = p * (dp * keep - di);
        for (uint d = 0; d < D; ++d) g[d] = fma(ds, ks[c][d], g[d]);
      }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (!active) return;
  for (uint d = 0; d < D; ++d) STORE_T(g[d] * scale, dq, dq_off + at + d);
}

#endif  // BQ
