// Winograd convolution F(m x m, r x r) for stride 1, on CPU devices (ops/conv2d_winograd.cpp).
//
// A tile of m x m outputs of one output channel is A^T [ sum_c U_c (.) V_c ] A, where
// V_c = B^T d_c B is the transform of the tile's (m+r-1)^2 input window in channel c and
// U_c = G g_c G^T that of the filter. Per output tile the products take alpha^2 multiply-adds per
// (c, k) where a direct convolution takes m^2 r^2: for F(2x2, 5x5) 36 against 100, for F(4x4, 3x3)
// 36 against 144. The transforms are compiled in, so zero coefficients cost nothing. The weight
// gradient is the same algorithm on the same tiles, with the roles turned: F(r x r, m x m) (below).
//
// Layouts (f32): xt[N][HT][WT][CP] the input zero-padded and channels-last (so a tile's window in
// 16 channels is one vector load per pixel), U[alpha^2][CP][KP] the filter transform, channels
// padded to CP and KP with zeros. y and x are NCHW in the activations' storage type T.
//
// Compiled with conv2d.cl's geometry (-D CONV_C ... CONV_PAD, CONV_RELU) and
//   WINO_M, WINO_R, WINO_A    m, r and alpha = m + r - 1
//   WINO_AT, WINO_BT, WINO_G  {..} initialisers: A^T (m x alpha), B^T (alpha x alpha), G (alpha x r)
//   WINO_TR, WINO_TQ          tiles per output column and row (ceil(P/m), ceil(Q/m))
//   WINO_HT, WINO_WT          rows and columns of xt (TR*m + r - 1, TQ*m + r - 1)
//   WINO_CP, WINO_KP          padded channel counts; WINO_CC channels per pass (a multiple of 16)
//   WINO_TB, WINO_NVK         tiles per work-item, and float16 of output channels per register block
//   WINO_KBLOCKS              register blocks of output channels per work-item (1 if not given)
// (the weight gradient's program adds WINO_WEIGHTS, WINO_DT_H and WINO_DT_W).
#include "dtype.clh"

#define WINO_AA (WINO_A * WINO_A)
#define WINO_MM (WINO_M * WINO_M)
#define WINO_KB (16 * WINO_NVK)
#define WINO_TILES_PER_IMAGE (WINO_TR * WINO_TQ)

// Image, tile row and tile column of a tile of the batch (tiles numbered image by image, row by row).
inline uint3 tile_at(uint tile) {
  const uint n = tile / WINO_TILES_PER_IMAGE, rest = tile - n * WINO_TILES_PER_IMAGE;
  const uint tr = rest / WINO_TQ;
  return (uint3)(n, tr, rest - tr * WINO_TQ);
}

#ifndef CONV_RELU
#define CONV_RELU 0
#endif

__constant float kAT[WINO_M * WINO_A] = WINO_AT;
__constant float kBT[WINO_AA] = WINO_BT;
__constant float kG[WINO_A * WINO_R] = WINO_G;

// xt from x (NCHW, C x H x W per image): element (n, hh, ww, c) of xt (HT x WT x CP per image) is
// x[n, c, hh - pad, ww - pad], zero outside x and for c >= C. The geometry is passed, not compiled
// in: the weight gradient pads dy (K x P x Q, no padding) with the same kernel. A work-item fills
// one row hh of xt for 16 channels: blocks of 16 columns read as 16 runs of x (one per channel),
// transposed in registers and written as 16 runs of 16 channels (one per pixel).
// Global (CP / 16, HT, N).
__kernel void winograd_pad(__global const T_STORAGE* x, ulong x_off, __global float* xt, ulong xt_off, uint n_images,
                           uint C, uint H, uint W, uint pad, uint HT, uint WT, uint CP) {
  const uint cb = get_global_id(0), hh = get_global_id(1), n = get_global_id(2);
  if (cb * 16 >= CP || hh >= HT || n >= n_images) return;
  const uint h = hh - pad;  // unsigned: a padding row wraps past H
  __global float* dst = xt + xt_off + (ulong)(n * HT + hh) * WT * CP + cb * 16;
  const ulong x_end = x_off + (ulong)n_images * C * H * W;
  const int16 lane = (int16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (uint w0 = 0; w0 < WT; w0 += 16) {
    float blk[16][16];
    // Lanes of this block that fall inside the row: x columns w0 - pad + lane in [0, W).
    const int16 col = (int)w0 - (int)pad + lane;
    const int16 outside = col < 0 || col >= (int)W;
    for (uint r = 0; r < 16; ++r) {
      const uint c = cb * 16 + r;
      const bool row = c < C && h < H;
      const ulong src = x_off + ((ulong)(n * C + min(c, C - 1)) * H + min(h, H - 1)) * W;
#if T_IS_F32
      // One vector load of the block's 16 columns, reading past the row's ends into its
      // neighbours (masked to zero) wherever that stays inside x.
      const long first = (long)src + (long)w0 - (long)pad;
      if (row && first >= (long)x_off && first + 16 <= (long)x_end) {
        vstore16(select(vload16(0, x + first), (float16)(0.0f), outside), 0, blk[r]);
        continue;
      }
#endif
      for (uint i = 0; i < 16; ++i) {
        const uint w = w0 + i - pad;
        blk[r][i] = row && w < W ? LOAD_T(x, src + w) : 0.0f;
      }
    }
    const uint count = min(16u, WT - w0);
    for (uint i = 0; i < count; ++i) {
      vstore16((float16)(blk[0][i], blk[1][i], blk[2][i], blk[3][i], blk[4][i], blk[5][i], blk[6][i], blk[7][i],
                         blk[8][i], blk[9][i], blk[10][i], blk[11][i], blk[12][i], blk[13][i], blk[14][i], blk[15][i]),
               0, dst + (ulong)(w0 + i) * CP);
    }
  }
}

// U[xi][c][k] = (G g_kc G^T)[xi] for the filter w[K][C][R][R] (T is the weight's storage type
// here), zero for c >= C or k >= K. Global (KP, CP).
__kernel void winograd_filter(__global const T_STORAGE* w, ulong w_off, __global float* u, ulong u_off) {
  const uint k = get_global_id(0), c = get_global_id(1);
  if (k >= WINO_KP || c >= WINO_CP) return;
  float g[WINO_R][WINO_R];
  const bool inside = k < CONV_K && c < CONV_C;
  const ulong base = w_off + ((ulong)k * CONV_C + c) * (WINO_R * WINO_R);
  for (uint i = 0; i < WINO_R; ++i)
    for (uint j = 0; j < WINO_R; ++j) g[i][j] = inside ? LOAD_T(w, base + i * WINO_R + j) : 0.0f;
  float t[WINO_A][WINO_R];  // G g
  for (uint a = 0; a < WINO_A; ++a)
    for (uint j = 0; j < WINO_R; ++j) {
      float acc = 0.0f;
      for (uint i = 0; i < WINO_R; ++i) acc = fma(kG[a * WINO_R + i], g[i][j], acc);
      t[a][j] = acc;
    }
  for (uint a = 0; a < WINO_A; ++a)
    for (uint b = 0; b < WINO_A; ++b) {
      float acc = 0.0f;
      for (uint j = 0; j < WINO_R; ++j) acc = fma(t[a][j], kG[b * WINO_R + j], acc);
      u[u_off + ((ulong)(a * WINO_A + b) * WINO_CP + c) * WINO_KP + k] = acc;
    }
}

// Row i of B^T times the columns of d (or, with the operands' roles swapped, of d times B):
// terms with a zero coefficient are skipped at compile time once the loops are unrolled.
#define BT_TERM(i, l, x) \
  if (kBT[(i) * WINO_A + (l)] != 0.0f) acc = fma((float16)(kBT[(i) * WINO_A + (l)]), (x), acc);

// V = B^T d B for one tile and 16 channels, written as V[xi][tile][16 channels] in `v`. Column
// by column, then row by row, so that few of the 36 input vectors are live at a time.
inline void transform_input(__global const float* d, __private float* v, uint t) {
  float16 rows[WINO_A][WINO_A];  // B^T d
#pragma unroll
  for (uint j = 0; j < WINO_A; ++j) {
    float16 col[WINO_A];
#pragma unroll
    for (uint l = 0; l < WINO_A; ++l) col[l] = vload16(0, d + (l * WINO_WT + j) * WINO_CP);
#pragma unroll
    for (uint i = 0; i < WINO_A; ++i) {
      float16 acc = 0.0f;
#pragma unroll
      for (uint l = 0; l < WINO_A; ++l) BT_TERM(i, l, col[l])
      rows[i][j] = acc;
    }
  }
#pragma unroll
  for (uint i = 0; i < WINO_A; ++i)
#pragma unroll
    for (uint j = 0; j < WINO_A; ++j) {
      float16 acc = 0.0f;
#pragma unroll
      for (uint l = 0; l < WINO_A; ++l) BT_TERM(j, l, rows[i][l])
      vstore16(acc, 0, v + ((i * WINO_A + j) * WINO_TB + t) * WINO_CC);
    }
}

// One work-item: WINO_TB consecutive tiles of the batch (n, tile row, tile column, flattened) x
// WINO_KBLOCKS blocks of WINO_KB output channels. Per pass of WINO_CC channels: transform the
// tiles' windows into V (private, the pass's only copy, made once for all the blocks), then for
// each xi and block the product V[xi] (TB x CC) U[xi] (CC x KB) in TB x NVK float16 accumulators,
// folded at once into the tiles' outputs through A^T (.) A (the output transform is linear, so the
// products of every pass add up there). Blocks per work-item keep a narrow register block (AVX2:
// one float16 of channels) from transforming each window once per block.
// Global (ceil(N*TR*TQ / TB), KP / (KB * KBLOCKS)); local size 1.
#ifndef WINO_KBLOCKS
#define WINO_KBLOCKS 1
#endif
#define WINO_NVO (WINO_NVK * WINO_KBLOCKS)
__kernel void winograd_forward(__global const float* xt, ulong xt_off, __global const float* u, ulong u_off,
                               __global const float* bias, ulong bias_off, uint has_bias, __global T_STORAGE* y,
                               ulong y_off, uint n_tiles) {
  const uint tile0 = get_global_id(0) * WINO_TB, kc0 = get_global_id(1) * WINO_KBLOCKS;
  if (tile0 >= n_tiles) return;
  float v[WINO_AA * WINO_TB * WINO_CC];
  float16 out[WINO_TB][WINO_MM][WINO_NVO];
  for (uint t = 0; t < WINO_TB; ++t)
    for (uint o = 0; o < WINO_MM; ++o)
      for (uint q = 0; q < WINO_NVO; ++q) out[t][o][q] = 0.0f;

  for (uint c0 = 0; c0 < WINO_CP; c0 += WINO_CC) {
    for (uint t = 0; t < WINO_TB; ++t) {
      // Tiles past the last compute the last one again and are never stored.
      const uint tile = min(tile0 + t, n_tiles - 1);
      const uint3 at = tile_at(tile);
      const uint n = at.x, tr = at.y, tq = at.z;
      __global const float* d =
          xt + xt_off + ((ulong)(n * WINO_HT + tr * WINO_M) * WINO_WT + tq * WINO_M) * WINO_CP + c0;
      for (uint cv = 0; cv < WINO_CC; cv += 16) transform_input(d + cv, v + cv, t);
    }
    for (uint xi = 0; xi < WINO_AA; ++xi) {
      const __private float* vx = v + xi * WINO_TB * WINO_CC;
      const uint a = xi / WINO_A, b = xi - a * WINO_A;
      for (uint kb = 0; kb < WINO_KBLOCKS; ++kb) {
        float16 acc[WINO_TB][WINO_NVK];
#pragma unroll
        for (uint t = 0; t < WINO_TB; ++t)
#pragma unroll
          for (uint q = 0; q < WINO_NVK; ++q) acc[t][q] = 0.0f;
        __global const float* uc = u + u_off + ((ulong)xi * WINO_CP + c0) * WINO_KP + (kc0 + kb) * WINO_KB;
        for (uint c = 0; c < WINO_CC; ++c) {
          float16 uv[WINO_NVK];
#pragma unroll
          for (uint q = 0; q < WINO_NVK; ++q) uv[q] = vload16(q, uc + c * WINO_KP);
#pragma unroll
          for (uint t = 0; t < WINO_TB; ++t) {
            const float16 vt = (float16)(vx[t * WINO_CC + c]);
#pragma unroll
            for (uint q = 0; q < WINO_NVK; ++q) acc[t][q] = fma(vt, uv[q], acc[t][q]);
          }
        }
#pragma unroll
        for (uint i = 0; i < WINO_M; ++i)
#pragma unroll
          for (uint j = 0; j < WINO_M; ++j) {
            const float coef = kAT[i * WINO_A + a] * kAT[j * WINO_A + b];
            if (coef != 0.0f) {
#pragma unroll
              for (uint t = 0; t < WINO_TB; ++t)
#pragma unroll
                for (uint q = 0; q < WINO_NVK; ++q)
                  out[t][i * WINO_M + j][kb * WINO_NVK + q] =
                      fma((float16)(coef), acc[t][q], out[t][i * WINO_M + j][kb * WINO_NVK + q]);
            }
          }
      }
    }
  }

  for (uint t = 0; t < WINO_TB; ++t) {
    const uint tile = tile0 + t;
    if (tile >= n_tiles) break;
    const uint3 at = tile_at(tile);
    const uint n = at.x, tr = at.y, tq = at.z;
    for (uint o = 0; o < WINO_MM; ++o) {
      const uint p = tr * WINO_M + o / WINO_M, q = tq * WINO_M + o % WINO_M;
      if (p >= CONV_P || q >= CONV_Q) continue;
      for (uint vq = 0; vq < WINO_NVO; ++vq) {
        float lanes[16];
        vstore16(out[t][o][vq], 0, lanes);
        for (uint l = 0; l < 16; ++l) {
          const uint k = kc0 * WINO_KB + vq * 16 + l;
          if (k >= CONV_K) break;
          float r = lanes[l] + (has_bias ? bias[bias_off + k] : 0.0f);
#if CONV_RELU
          r = isgreater(r, 0.0f) ? r : 0.0f;  // NaN -> 0, as the ReLU
#endif
          STORE_T(r, y, y_off + ((ulong)(n * CONV_K + k) * CONV_P + p) * CONV_Q + q);
        }
      }
    }
  }
}

// ---- Weight gradient -------------------------------------------------------------------------
// dw[k, c] (r x r) = sum over images and output pixels of x_pad[c, p + u, q + v] dy[k, p, q]: per
// tile of m' x m' output pixels (the tiles of the forward) a correlation of the tile's 6 x 6 input
// window with its m' x m' block of dy, i.e. F(r x r, m' x m'). Built with WINO_M = r (the outputs
// of that correlation), WINO_R = m' (its filter: the dy block, also the tile step) and the
// transforms of winograd_transform(r, m'); WINO_CC input channels and WINO_NVK float16 of output
// channels per work-item, WINO_TB tiles per group. dyt is dy channels-last, [N][DT_H][DT_W][KP]
// (winograd_pad with no padding; zero past P, Q and K): reading dy's blocks straight from NCHW
// (16 planes per vector) cost more than that pad.
#ifdef WINO_WEIGHTS
// Per work-item (chunk z of the tiles, WINO_KBLOCKS blocks of output channels from kb0, block cb of
// input channels): for each group of TB tiles the windows' transforms V (TB x CC per xi, made once
// for all the blocks), and per block the dy blocks' W = G g G^T (TB x KB per xi), then for each xi
// M[xi] (CC x KB) += V^T W, in 4 x NVK float16 accumulators loaded from and stored to the
// work-item's own partial sums part[z][xi][c][k].
// Global (chunks, KP / (KB * KBLOCKS), CP / CC); local size 1.
__kernel void winograd_weights(__global const float* xt, ulong xt_off, __global const float* dyt, ulong dyt_off,
                               __global float* part, ulong part_off, uint n_tiles, uint tiles_per_chunk) {
  const uint z = get_global_id(0), kb0 = get_global_id(1) * WINO_KBLOCKS, cb = get_global_id(2);
  const uint begin = z * tiles_per_chunk;
  if (begin >= n_tiles) return;
  const uint end = min(n_tiles, begin + tiles_per_chunk);
  __global float* m0 = part + part_off + (ulong)z * WINO_AA * WINO_CP * WINO_KP + cb * WINO_CC * WINO_KP;
  for (uint xi = 0; xi < WINO_AA; ++xi)
    for (uint c = 0; c < WINO_CC; ++c)
      for (uint q = 0; q < WINO_NVO; ++q)
        vstore16((float16)(0.0f), q, m0 + ((ulong)xi * WINO_CP + c) * WINO_KP + kb0 * WINO_KB);
  float v[WINO_AA * WINO_TB * WINO_CC];
  float g[WINO_AA * WINO_TB * WINO_KB];
  for (uint t0 = begin; t0 < end; t0 += WINO_TB) {
    for (uint t = 0; t < WINO_TB; ++t) {
      const uint tile = min(t0 + t, end - 1);
      const uint3 at = tile_at(tile);
      const uint n = at.x, tr = at.y, tq = at.z;
      __global const float* d =
          xt + xt_off + ((ulong)(n * WINO_HT + tr * WINO_R) * WINO_WT + tq * WINO_R) * WINO_CP + cb * WINO_CC;
      for (uint cv = 0; cv < WINO_CC; cv += 16) transform_input(d + cv, v + cv, t);
    }
    for (uint kb = kb0; kb < kb0 + WINO_KBLOCKS; ++kb) {
      __global float* m = m0 + kb * WINO_KB;
      for (uint t = 0; t < WINO_TB; ++t) {
        const bool valid = t0 + t < end;
        const uint3 at = tile_at(valid ? t0 + t : end - 1);
        const uint n = at.x, tr = at.y, tq = at.z;
        __global const float* e =
            dyt + dyt_off + ((ulong)(n * WINO_DT_H + tr * WINO_R) * WINO_DT_W + tq * WINO_R) * WINO_KP + kb * WINO_KB;
        for (uint kv = 0; kv < WINO_NVK; ++kv) {
          float16 blk[WINO_R][WINO_R];  // the tile's block of dy, 16 output channels (zero for unused tiles)
          for (uint i = 0; i < WINO_R; ++i)
            for (uint j = 0; j < WINO_R; ++j)
              blk[i][j] = valid ? vload16(kv, e + (i * WINO_DT_W + j) * WINO_KP) : (float16)(0.0f);
          float16 gb[WINO_A][WINO_R];  // G blk
          for (uint a = 0; a < WINO_A; ++a)
            for (uint j = 0; j < WINO_R; ++j) {
              float16 acc = 0.0f;
              for (uint i = 0; i < WINO_R; ++i) acc = fma((float16)(kG[a * WINO_R + i]), blk[i][j], acc);
              gb[a][j] = acc;
            }
          for (uint a = 0; a < WINO_A; ++a)
            for (uint b = 0; b < WINO_A; ++b) {
              float16 acc = 0.0f;
              for (uint j = 0; j < WINO_R; ++j) acc = fma(gb[a][j], (float16)(kG[b * WINO_R + j]), acc);
              vstore16(acc, kv, g + ((a * WINO_A + b) * WINO_TB + t) * WINO_KB);
            }
        }
      }
      for (uint xi = 0; xi < WINO_AA; ++xi) {
        const __private float* vx = v + xi * WINO_TB * WINO_CC;
        const __private float* gx = g + xi * WINO_TB * WINO_KB;
        for (uint c4 = 0; c4 < WINO_CC; c4 += 4) {
          __global float* mrow = m + ((ulong)xi * WINO_CP + c4) * WINO_KP;
          float16 acc[4][WINO_NVK];
#pragma unroll
          for (uint i = 0; i < 4; ++i)
#pragma unroll
            for (uint q = 0; q < WINO_NVK; ++q) acc[i][q] = vload16(q, mrow + i * WINO_KP);
          for (uint t = 0; t < WINO_TB; ++t) {
            float16 w[WINO_NVK];
#pragma unroll
            for (uint q = 0; q < WINO_NVK; ++q) w[q] = vload16(q, gx + t * WINO_KB);
#pragma unroll
            for (uint i = 0; i < 4; ++i) {
              const float16 b = (float16)(vx[t * WINO_CC + c4 + i]);
#pragma unroll
              for (uint q = 0; q < WINO_NVK; ++q) acc[i][q] = fma(b, w[q], acc[i][q]);
            }
          }
#pragma unroll
          for (uint i = 0; i < 4; ++i)
#pragma unroll
            for (uint q = 0; q < WINO_NVK; ++q) vstore16(acc[i][q], q, mrow + i * WINO_KP);
        }
      }
    }
  }
}

// dw[k, c] = A^T (sum over chunks of M[xi][c][k]) A for 16 output channels k per work-item (one
// float16 lane each), the chunks added in order (deterministic); stored as T (the weight's storage
// type in this build). Global (KP / 16, C).
__kernel void winograd_weights_sum(__global const float* part, ulong part_off, uint chunks, __global T_STORAGE* dw,
                                   ulong dw_off) {
  const uint k0 = get_global_id(0) * 16, c = get_global_id(1);
  if (k0 >= CONV_K || c >= CONV_C) return;
  float16 s[WINO_AA];
#pragma unroll
  for (uint xi = 0; xi < WINO_AA; ++xi) {
    float16 acc = 0.0f;
    for (uint z = 0; z < chunks; ++z) acc += vload16(0, part + part_off + (((ulong)z * WINO_AA + xi) * WINO_CP + c) * WINO_KP + k0);
    s[xi] = acc;
  }
#pragma unroll
  for (uint u = 0; u < WINO_M; ++u) {
    float16 row[WINO_A];  // (A^T s)[u]
#pragma unroll
    for (uint b = 0; b < WINO_A; ++b) {
      float16 acc = 0.0f;
#pragma unroll
      for (uint a = 0; a < WINO_A; ++a) acc = fma((float16)(kAT[u * WINO_A + a]), s[a * WINO_A + b], acc);
      row[b] = acc;
    }
#pragma unroll
    for (uint w = 0; w < WINO_M; ++w) {
      float16 acc = 0.0f;
#pragma unroll
      for (uint b = 0; b < WINO_A; ++b) acc = fma(row[b], (float16)(kAT[w * WINO_A + b]), acc);
      float lanes[16];
      vstore16(acc, 0, lanes);
      for (uint l = 0; l < 16 && k0 + l < CONV_K; ++l)
        STORE_T(lanes[l], dw, dw_off + (((ulong)(k0 + l) * CONV_C + c) * WINO_M + u) * WINO_M + w);
    }
  }
}
#endif  // WINO_WEIGHTS
