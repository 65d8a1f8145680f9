// 8-bit block-wise Adam / AdamW (adamw8bit): the moments m and v are u8 codes of a dynamic,
// monotone map (include/ferry/ops/quant_map.hpp, mirrored here), each block of WG * PER elements
// sharing one fp32 scale per moment, its absmax. One work-group per block dequantizes, updates
// (as adam_update in optimizer.cl) and requantizes; the block's new absmax comes from a
// deterministic work-group reduction.
//
// -D parameters: WG, the work-group size (a power of two); PER, the elements of the block each
// work-item holds in private memory between the update and the requantization. Work-item l of a
// block takes its elements l, l + WG, l + 2 WG, ..., so neighbouring work-items touch
// neighbouring elements.
//
// The maps need no stored table, but a work-group computes both (256 values each, with the
// functions below) into local memory once: dequantizing is then a load, and quantizing a binary
// search over loads that runs for all PER elements of a work-item at once (8 halvings, each over
// the PER elements), which on CPUs is several times faster than one search after another.

#include "reduce.clh"

__constant uint q_pow10[9] = {1u, 10u, 100u, 1000u, 10000u, 100000u, 1000000u, 10000000u, 100000000u};

// The magnitude of code a >= 1 of the map whose top exponent is `top`: (2^e + 9 (j + 1)) /
// (10^(top+1-e) 2^e), e = floor(log2 a), j = a - 2^e.
float q_magnitude(uint a, uint top) {
  const uint e = 31u - clz(a);
  const uint numerator = (1u << e) + 9u * (a - (1u << e) + 1u);
  const uint denominator = q_pow10[top + 1u - e] << e;
  return (float)numerator / (float)denominator;
}

// Unsigned map (v): code 0 is 0, code 255 is 1.
float q_unsigned(uint c) {
  return c == 0u ? 0.0f : q_magnitude(c, 7u);
}

// Signed map (m): code 128 is 0, 255 is +1, 1 (and 0) is -1.
float q_signed(uint c) {
  const int s = (int)c - 128;
  if (s == 0) return 0.0f;
  const float m = q_magnitude(min((uint)abs(s), 127u), 6u);
  return s < 0 ? -m : m;
}

// x / scale as quantize takes it: clamped to [lo, 1], 0 for a zero scale or NaN.
float q_normalized(float x, float scale, float lo) {
  const float r = scale > 0.0f ? x / scale : 0.0f;
  return isnan(r) ? 0.0f : clamp(r, lo, 1.0f);
}

// The nearest code to x in `table` (a map's 256 values, non-decreasing): the largest code whose
// value is <= x, then the nearer of it and the next one, a tie to the lower. Signed code 0 equals
// code 1 (-1), so the largest code is never 0 there.
uchar q_nearest(float x, uint c, __local const float* table) {
  const float above = c < 255u ? table[c + 1u] - x : INFINITY;
  return (uchar)(above < x - table[c] ? c + 1u : c);
}

// Adam with L2 (l2 > 0) or AdamW (decoupled > 0) as adam_update, on 8-bit state. scales holds
// [2, blocks] floats: the m scales, then the v scales. inv_bc1 = 1 / (1 - beta1^t), inv_bc2 =
// 1 / (1 - beta2^t). With has_guard, nothing changes when guard[0] (the step's loss) is not finite;
// with has_status, a weight made not finite sets status[0] to 1.
__kernel __attribute__((reqd_work_group_size(WG, 1, 1))) void adam8bit_update(
    __global float* w, ulong w_off, __global const float* g, ulong g_off, __global uchar* m, ulong m_off,
    __global uchar* v, ulong v_off, __global float* scales, ulong scales_off, uint n, uint blocks, float beta1,
    float beta2, float eps, float l2, float decoupled, float lr, float inv_bc1, float inv_bc2,
    __global const float* guard, ulong guard_off, uint has_guard, __global uint* status, ulong status_off,
    uint has_status) {
  if (has_guard && !isfinite(guard[guard_off])) return;  // the same for every work-item: no barrier skipped
  __local float scratch[WG];
  __local float table_m[256], table_v[256];
  __local float old_scales[2];
  const uint block = get_group_id(0), lid = get_local_id(0);
  for (uint c = lid; c < 256u; c += WG) {
    table_m[c] = q_signed(c);
    table_v[c] = q_unsigned(c);
  }
  // Work-item 0 alone reads the block's scales in global memory, as it alone writes them at the
  // end: read by every work-item, they would race with that write, which the barriers between
  // (local-memory fences) do not order (Oclgrind reported it).
  if (lid == 0) {
    old_scales[0] = scales[scales_off + block];
    old_scales[1] = scales[scales_off + blocks + block];
  }
  barrier(CLK_LOCAL_MEM_FENCE);

  // Dequantize with the old scales, update w, keep the new moments.
  const ulong start = (ulong)block * (WG * PER);
  const float m_scale = old_scales[0], v_scale = old_scales[1];
  float m_new[PER], v_new[PER];
  float m_max = 0.0f, v_max = 0.0f;
  for (uint k = 0; k < PER; ++k) {
    const ulong i = start + (ulong)k * WG + lid;
    m_new[k] = 0.0f;
    v_new[k] = 0.0f;
    if (i >= n) continue;
    const float wi = w[w_off + i];
    const float gi = fma(l2, wi, g[g_off + i]);
    const float m0 = table_m[m[m_off + i]] * m_scale;
    const float v0 = table_v[v[v_off + i]] * v_scale;
    const float mi = fma(beta1, m0, (1.0f - beta1) * gi);
    const float vi = fma(beta2, v0, (1.0f - beta2) * gi * gi);
    const float update = (mi * inv_bc1) / (sqrt(vi * inv_bc2) + eps);
    const float wn = wi - lr * fma(decoupled, wi, update);
    w[w_off + i] = wn;
    if (has_status && !(isfinite(wn) && isfinite(vi))) atomic_or(status + status_off, 1u);  // as adam_update
    m_new[k] = mi;
    v_new[k] = vi;
    m_max = fmax(m_max, fabs(mi));
    v_max = fmax(v_max, vi);
  }

  // The block's new scales, then its codes.
  m_max = group_max(m_max, scratch);
  v_max = group_max(v_max, scratch);
  uint cm[PER], cv[PER];
  for (uint k = 0; k < PER; ++k) {
    m_new[k] = q_normalized(m_new[k], m_max, -1.0f);
    v_new[k] = q_normalized(v_new[k], v_max, 0.0f);
    cm[k] = 0u;
    cv[k] = 0u;
  }
  for (uint step = 128u; step > 0u; step >>= 1) {
    for (uint k = 0; k < PER; ++k) {
      const uint pm = cm[k] + step, pv = cv[k] + step;
      cm[k] = table_m[pm] <= m_new[k] ? pm : cm[k];
      cv[k] = table_v[pv] <= v_new[k] ? pv : cv[k];
    }
  }
  for (uint k = 0; k < PER; ++k) {
    const ulong i = start + (ulong)k * WG + lid;
    if (i >= n) break;
    m[m_off + i] = q_nearest(m_new[k], cm[k], table_m);
    // A positive v never becomes 0 (as the host's dynamic_quantize): a zero sqrt(v) under a
    // non-zero m would give an update of m / eps.
    const uchar qv = q_nearest(v_new[k], cv[k], table_v);
    v[v_off + i] = (qv == 0 && v_new[k] > 0.0f) ? (uchar)1 : qv;
  }
  if (lid == 0) {
    scales[scales_off + block] = m_max;
    scales[scales_off + blocks + block] = v_max;
  }
}
