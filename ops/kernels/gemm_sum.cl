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
  float out = alpha * acc;
#if C_PLANES
  const size_t m = e / N, n = e % N;  // one product
  const ulong at = c_off + (ulong)(m / C_PLANES) * N * C_PLANES + (ulong)n * C_PLANES + m % C_PLANES;
#else
  const ulong at = c_off + i;
#endif
  if (beta != 0.0f) out = fma(beta, LOAD(C_NAME, c, at), out);
  if (has_bias) out += bias[bias_off + e % N];
#if C_DACT
  out = DACT(AS_STORED(out, c, at), LOAD(C_NAME, dz, dz_off + i));
#endif
  out = RELU(out);
  STORE(C_NAME, out, c, at);
  GUARD_SET(GUARD_BAD(out), guard, guard_off);
}
