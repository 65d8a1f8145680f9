// The sum of a split-K GEMM's partial products (gemm_packed.cl and gemm_tiled.cl split a long K
// into blocks of rows, each product into its own f32 M x N block): C's type, the bias and the
// epilogues as the product kernels have them. Built with C_NAME (F32 when not given), C_RELU,
// C_DACT, C_GUARD and C_PLANES (a C stored as NCHW planes; 0 when not given).
#include "dtype.clh"
#ifndef C_NAME
#define C_NAME F32
#define C_IS_F32 1
#endif
#include "gemm_epilogue.clh"
#ifndef C_PLANES
#define C_PLANES 0
#endif

// Element i (element e of its product, at `at` in c) of C from `out` = alpha times its splits' sum:
// beta C, the bias, the epilogue and the guard.
inline void store_sum(float out, size_t i, size_t e, ulong at, uint N, float beta, __global STORAGE(C_NAME)* c,
                      __global const float* bias, ulong bias_off, uint has_bias, __global const STORAGE(C_NAME)* dz,
                      ulong dz_off, __global float* guard, ulong guard_off) {
  if (beta != 0.0f) out = fma(beta, LOAD(C_NAME, c, at), out);
  if (has_bias) out += bias[bias_off + e % N];
#if C_DACT
  out = DACT(AS_STORED(out, c, at), LOAD(C_NAME, dz, dz_off + i));
#endif
  out = RELU(out);
  STORE(C_NAME, out, c, at);
  GUARD_SET(GUARD_BAD(out), guard, guard_off);
}

// c = alpha * (sum over the splits s of part[s]) + beta * c + bias, the splits added in order
// (deterministic). One work-item per element of the batch's c; product z's splits are blocks
// z splits .. (z + 1) splits - 1 of part.
__kernel void gemm_sum_splits(uint M, uint N, uint splits, uint batch, __global const float* part, ulong part_off,
                              float alpha, float beta, __global STORAGE(C_NAME)* c, ulong c_off,
                              __global const float* bias, ulong bias_off, uint has_bias,
                              __global const STORAGE(C_NAME)* dz, ulong dz_off, __global float* guard,
                              ulong guard_off) {
  const size_t i = get_global_id(0);
  const size_t mn = (size_t)M * N;
  if (i >= mn * batch) return;
  // No division for one product: two 64-bit divisions per element cost a single long-K weight
  // gradient's sum about 5%.
  const size_t product = batch > 1 ? i / mn : 0, e = i - product * mn;
  __global const float* p = part + part_off + product * splits * mn + e;
  float acc = 0.0f;
  for (uint s = 0; s < splits; ++s) acc += p[s * mn];
#if C_PLANES
  const size_t m = e / N, n = e % N;  // one product
  const ulong at = c_off + (ulong)(m / C_PLANES) * N * C_PLANES + (ulong)n * C_PLANES + m % C_PLANES;
#else
  const ulong at = c_off + i;
#endif
  store_sum(alpha * acc, i, e, at, N, beta, c, bias, bias_off, has_bias, dz, dz_off, guard, guard_off);
}

#if !C_PLANES
// The same on CPU devices, 16 consecutive elements per work-item (M N a multiple of 16, so that
// they lie in one product), the splits summed as one float16 in the same order: PoCL vectorises
// the per-element kernel's work-items poorly around its loop over splits (a long-K weight
// gradient's sum of 8 splits ran at about 17 GB/s from the last-level cache).
__kernel void gemm_sum_splits16(uint M, uint N, uint splits, uint batch, __global const float* part, ulong part_off,
                                float alpha, float beta, __global STORAGE(C_NAME)* c, ulong c_off,
                                __global const float* bias, ulong bias_off, uint has_bias,
                                __global const STORAGE(C_NAME)* dz, ulong dz_off, __global float* guard,
                                ulong guard_off) {
  const size_t i0 = get_global_id(0) * 16;
  const size_t mn = (size_t)M * N;
  if (i0 >= mn * batch) return;
  const size_t product = batch > 1 ? i0 / mn : 0, e0 = i0 - product * mn;
  __global const float* p = part + part_off + product * splits * mn + e0;
  float16 acc = (float16)(0.0f);
  for (uint s = 0; s < splits; ++s) acc += vload16(0, p + s * mn);
  float out[16];
  vstore16(alpha * acc, 0, out);
  for (uint j = 0; j < 16; ++j)
    store_sum(out[j], i0 + j, e0 + j, c_off + i0 + j, N, beta, c, bias, bias_off, has_bias, dz, dz_off, guard,
              guard_off);
}
#endif
