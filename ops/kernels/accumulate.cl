// Gradient accumulation (ops/accumulate.hpp). Operands are (buffer, element offset)
// pairs; one work-item per element.

// acc = keep acc + g; keep (0 or 1) is set per step. Skipped when guard[0] (the loss) is not finite.
__kernel void grad_accumulate(__global float* acc, ulong acc_off, __global const float* g, ulong g_off, uint n,
                              __global const float* guard, ulong guard_off, uint has_guard, float keep) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  if (has_guard && !isfinite(guard[guard_off])) return;
  // keep == 0 must not turn a stale NaN or Inf in acc into NaN: select, not multiply.
  acc[acc_off + i] = (keep != 0.0f ? acc[acc_off + i] : 0.0f) + g[g_off + i];
}

// g = (acc + g) inv_k.
__kernel void grad_mean(__global const float* acc, ulong acc_off, __global float* g, ulong g_off, uint n,
                        float inv_k) {
  const size_t i = get_global_id(0);
  if (i < n) g[g_off + i] = (acc[acc_off + i] + g[g_off + i]) * inv_k;
}
