// Register-blocked GEMM for CPU devices (PoCL and the like), in two kernels:
//   gemm_pack_b  copies op(B) into k-major panels NB = 16 * NV columns wide, zero-padded past N;
//   gemm_packed  gives each work-item RB rows x NB columns of C, held in float16 accumulators:
//                per k step NV vload16 of the B panel, RB scalar broadcasts of A and fma().
// Launch with local size 1 and the row-block index on dimension 0, so that consecutive
// work-groups share one B panel. Parameters (-D): RB, NV, TRANS_A, TRANS_B.
#define NB (16 * NV)

// One work-item packs 16 columns (one float16) of one k row of a panel.
__kernel void gemm_pack_b(uint N, uint K, __global const float* b, ulong b_off, __global float* packed,
                          ulong packed_off) {
  const uint col = get_global_id(0) * 16;
  const uint k = get_global_id(1);
  __global float* dst = packed + packed_off + ((ulong)(col / NB) * K + k) * NB + col % NB;
  b += b_off;
#if TRANS_B
  // B stored [N, K]: column j of op(B) is row j of B.
  for (uint i = 0; i < 16; ++i) dst[i] = col + i < N ? b[(ulong)(col + i) * K + k] : 0.0f;
#else
  __global const float* src = b + (ulong)k * N + col;
  if (col + 16 <= N) {
    vstore16(vload16(0, src), 0, dst);
  } else {
    for (uint i = 0; i < 16; ++i) dst[i] = col + i < N ? src[i] : 0.0f;
  }
#endif
}

__kernel void gemm_packed(uint M, uint N, uint K, float alpha, __global const float* a, ulong a_off,
                          __global const float* packed, ulong packed_off, float beta, __global float* c, ulong c_off,
                          __global const float* bias, ulong bias_off, uint has_bias) {
  const uint row0 = get_global_id(0) * RB;
  const uint panel = get_global_id(1);
  __global const float* bp = packed + packed_off + (ulong)panel * K * NB;
  a += a_off;

  // Rows past M read row M-1 (valid memory) and are never stored, keeping the k loop branch-free.
#if TRANS_A
  uint arow[RB];  // A stored [K, M]: the RB scalars of one k step are contiguous
  for (uint r = 0; r < RB; ++r) arow[r] = min(row0 + r, M - 1);
#else
  __global const float* arow[RB];
  for (uint r = 0; r < RB; ++r) arow[r] = a + (ulong)min(row0 + r, M - 1) * K;
#endif

  float16 acc[RB][NV];
  for (uint r = 0; r < RB; ++r) {
    for (uint v = 0; v < NV; ++v) acc[r][v] = (float16)(0.0f);
  }

  for (uint k = 0; k < K; ++k) {
    float16 bv[NV];
    for (uint v = 0; v < NV; ++v) bv[v] = vload16(v, bp + (ulong)k * NB);
#if TRANS_A
    __global const float* ak = a + (ulong)k * M;
#endif
    for (uint r = 0; r < RB; ++r) {
#if TRANS_A
      const float16 x = (float16)(ak[arow[r]]);
#else
      const float16 x = (float16)(arow[r][k]);
#endif
      for (uint v = 0; v < NV; ++v) acc[r][v] = fma(x, bv[v], acc[r][v]);
    }
  }

  const uint col0 = panel * NB;
  for (uint r = 0; r < RB; ++r) {
    const uint row = row0 + r;
    if (row >= M) break;
    __global float* crow = c + c_off + (ulong)row * N;
    for (uint v = 0; v < NV; ++v) {
      const uint col = col0 + v * 16;
      if (col >= N) break;
      if (col + 16 <= N) {
        float16 out = alpha * acc[r][v];
        if (beta != 0.0f) out = fma((float16)(beta), vload16(0, crow + col), out);  // beta = 0: C is not read
        if (has_bias) out += vload16(0, bias + bias_off + col);
        vstore16(out, 0, crow + col);
      } else {
        float tmp[16];
        vstore16(alpha * acc[r][v], 0, tmp);
        for (uint i = 0; col + i < N; ++i) {
          float out = tmp[i];
          if (beta != 0.0f) out = fma(beta, crow[col + i], out);
          if (has_bias) out += bias[bias_off + col + i];
          crow[col + i] = out;
        }
      }
    }
  }
}
