// Straightforward GEMM, one output element per work-item: (column, row, product of the batch) on
// dimensions (0, 1, 2). Correct for every shape and layout; the fallback and the baseline the tuned
// kernels are measured against.
__kernel void gemm_naive(uint M, uint N, uint K, float alpha, __global const float* a, ulong a_off,
                         __global const float* b, ulong b_off, float beta, __global float* c, ulong c_off,
                         __global const float* bias, ulong bias_off, uint has_bias) {
  const uint j = get_global_id(0);
  const uint i = get_global_id(1);
  if (i >= M || j >= N) return;
  const ulong product = get_global_id(2);
  a += a_off + product * ((ulong)M * K);
  b += b_off + product * ((ulong)K * N);
  c_off += product * ((ulong)M * N);
  float acc = 0.0f;
  for (uint k = 0; k < K; ++k) {
#if TRANS_A
    const float av = a[(ulong)k * M + i];
#else
    const float av = a[(ulong)i * K + k];
#endif
#if TRANS_B
    const float bv = b[(ulong)j * K + k];
#else
    const float bv = b[(ulong)k * N + j];
#endif
    acc = fma(av, bv, acc);
  }
  float out = alpha * acc;
  if (beta != 0.0f) out += beta * c[c_off + (ulong)i * N + j];
  if (has_bias) out += bias[bias_off + j];
  c[c_off + (ulong)i * N + j] = out;
}
