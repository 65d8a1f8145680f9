// Adds a bias vector to every row of C[M, N]; the epilogue of GEMM backends that have no bias
// of their own (CLBlast).
__kernel void gemm_add_bias(uint M, uint N, __global float* c, ulong c_off, __global const float* bias,
                            ulong bias_off) {
  const uint j = get_global_id(0);
  const uint i = get_global_id(1);
  if (i >= M || j >= N) return;
  c[c_off + (ulong)i * N + j] += bias[bias_off + j];
}
