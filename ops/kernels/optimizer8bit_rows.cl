// 8-bit block-wise Adam / AdamW (adamw8bit) for CPU devices: a work-item per block, 16 elements at
// a time, no barriers. The same update as adam8bit_update (optimizer8bit.cl) and the same codes,
// found by the host optimizer's bucket tables (ops/quant_buckets.hpp: a code is one table entry
// and a compare) instead of a binary search: on PoCL the work-group kernel's update ran one
// element at a time and its search was 22 lookups an element.
//
// Built by ops/optimizer8bit.cpp from a source that first defines the tables, from the host's own:
//   Q8_COUNT, Q8_FIRST_EXPONENT  buckets per row and the biased exponent of bucket 1's binade;
//   q8_codes[512]                the signed map's 256 values by code, then the unsigned map's;
//   q8_steps[3 * Q8_COUNT]       the signed map's bucket entries (positive values', then negative
//                                values'), then the unsigned map's: a magnitude index << 17 | the
//                                low 16 bits at which the next index is nearer (1 << 16: none);
// then this file's text. -D parameter: BLOCK, the elements of a block (a multiple of 16).
#include "store16.clh"

#ifndef Q8_COUNT
#error "optimizer8bit_rows.cl is built with the quantization tables in front of it (ops/optimizer8bit.cpp)"
#endif

// table[index] for each lane.
inline float16 q8_gather(__constant const float* t, uint16 i) {
  return (float16)(t[i.s0], t[i.s1], t[i.s2], t[i.s3], t[i.s4], t[i.s5], t[i.s6], t[i.s7], t[i.s8], t[i.s9], t[i.sa],
                   t[i.sb], t[i.sc], t[i.sd], t[i.se], t[i.sf]);
}

// The code of each normalized value r (clamped to [-1, 1], or [0, 1] unsigned; not NaN), as
// ops::quant_buckets::quantize: its bucket from the magnitude's top 16 bits, the bucket's index,
// plus one where the magnitude reaches the bucket's step.
inline uint16 q8_codes_of(float16 r, int is_signed) {
  const float16 m = fabs(r);
  const uint16 bits = as_uint16(m);
  const int16 bucket = max(convert_int16(bits >> 16) - (int)(Q8_FIRST_EXPONENT << 7) + 1, (int16)0);
  // 0 or 1 by select, not by negating a compare's -1 (Oclgrind 21.10 gave other values for that).
  const int16 zero = 0, one = 1;
  const int16 negative = is_signed ? select(zero, one, r < 0.0f) : zero;
  const uint16 row = convert_uint16(bucket + negative * (int)Q8_COUNT) + (is_signed ? 0u : 2u * Q8_COUNT);
  __constant const uint* t = q8_steps;
  const uint16 entry = (uint16)(t[row.s0], t[row.s1], t[row.s2], t[row.s3], t[row.s4], t[row.s5], t[row.s6], t[row.s7],
                                t[row.s8], t[row.s9], t[row.sa], t[row.sb], t[row.sc], t[row.sd], t[row.se], t[row.sf]);
  const int16 a = convert_int16(entry >> 17) + select(zero, one, (bits & 0xffffu) >= (entry & 0x1ffffu));
  if (is_signed) return convert_uint16(128 + a - 2 * negative * a);
  // A positive v never becomes 0: Adam divides by its square root.
  return convert_uint16(a | select(zero, one, (a == 0) & (m > 0.0f)));
}

// q_normalized of optimizer8bit.cl, 16 lanes: x / scale clamped to [lo, 1], 0 for a zero scale or NaN.
inline float16 q8_normalized(float16 x, float scale, float lo) {
  const float16 r = scale > 0.0f ? x / scale : (float16)0.0f;
  return clamp(select(r, (float16)0.0f, isnan(r)), lo, 1.0f);
}

// The new moments of 16 elements from their weights, gradients and old codes, as adam_update's
// (optimizer8bit.cl).
inline void q8_moments(float16 w, float16 g, uint16 m_code, uint16 v_code, float m_scale, float v_scale, float beta1,
                       float beta2, float l2, float16* m_new, float16* v_new) {
  const float16 gi = fma((float16)l2, w, g);
  const float16 m0 = q8_gather(q8_codes, m_code) * m_scale;
  const float16 v0 = q8_gather(q8_codes + 256, v_code) * v_scale;
  *m_new = fma((float16)beta1, m0, (1.0f - beta1) * gi);
  *v_new = fma((float16)beta2, v0, (1.0f - beta2) * gi * gi);
}

// Arguments as adam8bit_update's. A block's new moments wait in local memory for its new scales.
__kernel __attribute__((reqd_work_group_size(1, 1, 1))) void adam8bit_update_rows(
    __global float* w, ulong w_off, __global const float* g, ulong g_off, __global uchar* m, ulong m_off,
    __global uchar* v, ulong v_off, __global float* scales, ulong scales_off, uint n, uint blocks, float beta1,
    float beta2, float eps, float l2, float decoupled, float lr, float inv_bc1, float inv_bc2,
    __global const float* guard, ulong guard_off, uint has_guard, __global uint* status, ulong status_off,
    uint has_status) {
  if (has_guard && !isfinite(guard[guard_off])) return;
  __local float moments[2 * BLOCK];  // m, then v
  const uint block = get_group_id(0);
  const ulong start = (ulong)block * BLOCK;
  const uint len = (uint)min((ulong)BLOCK, (ulong)n - start);
  const uint whole = len / 16 * 16;
  w += w_off + start;
  g += g_off + start;
  m += m_off + start;
  v += v_off + start;
  const float m_scale = scales[scales_off + block], v_scale = scales[scales_off + blocks + block];
  float16 m_max = 0.0f, v_max = 0.0f;
  int16 bad = 0;
  for (uint i = 0; i < len; i += 16) {
    float16 wi, gi, mi, vi;
    uint16 mc, vc;
    if (i < whole) {
      wi = vload16(0, w + i);
      gi = vload16(0, g + i);
      mc = convert_uint16(vload16(0, m + i));
      vc = convert_uint16(vload16(0, v + i));
    } else {  // the tail, padded with zeros and the codes of 0 (which change no maximum)
      float wt[16], gt[16];
      uint mt[16], vt[16];
      for (uint l = 0; l < 16; ++l) {
        const bool in = i + l < len;
        wt[l] = in ? w[i + l] : 0.0f;
        gt[l] = in ? g[i + l] : 0.0f;
        mt[l] = in ? m[i + l] : 128u;
        vt[l] = in ? v[i + l] : 0u;
      }
      wi = vload16(0, wt);
      gi = vload16(0, gt);
      mc = vload16(0, mt);
      vc = vload16(0, vt);
    }
    q8_moments(wi, gi, mc, vc, m_scale, v_scale, beta1, beta2, l2, &mi, &vi);
    const float16 update = (mi * inv_bc1) / (sqrt(vi * inv_bc2) + eps);
    const float16 wn = wi - lr * fma((float16)decoupled, wi, update);
    if (i < whole) {
      VSTORE16_GLOBAL(wn, w + i);
    } else {
      float wt[16];
      vstore16(wn, 0, wt);
      for (uint l = 0; i + l < len; ++l) w[i + l] = wt[l];
    }
    bad |= ~(isfinite(wn) & isfinite(vi));  // -1 in a lane made not finite
    vstore16(mi, 0, moments + i);
    vstore16(vi, 0, moments + BLOCK + i);
    m_max = fmax(m_max, fabs(mi));
    v_max = fmax(v_max, vi);
  }
  if (has_status && any(bad)) atomic_or(status + status_off, 1u);  // as adam_update
  // The block's new scales (a tail's zero lanes change neither), then its codes.
  float lanes_m[16], lanes_v[16], mm = 0.0f, vm = 0.0f;
  vstore16(m_max, 0, lanes_m);
  vstore16(v_max, 0, lanes_v);
  for (int l = 0; l < 16; ++l) {
    mm = fmax(mm, lanes_m[l]);
    vm = fmax(vm, lanes_v[l]);
  }
  for (uint i = 0; i < len; i += 16) {
    const uint16 cm = q8_codes_of(q8_normalized(vload16(0, moments + i), mm, -1.0f), 1);
    const uint16 cv = q8_codes_of(q8_normalized(vload16(0, moments + BLOCK + i), vm, 0.0f), 0);
    if (i < whole) {
      vstore16(convert_uchar16(cm), 0, m + i);
      vstore16(convert_uchar16(cv), 0, v + i);
    } else {
      uchar mt[16], vt[16];
      vstore16(convert_uchar16(cm), 0, mt);
      vstore16(convert_uchar16(cv), 0, vt);
      for (uint l = 0; i + l < len; ++l) {
        m[i + l] = mt[l];
        v[i + l] = vt[l];
      }
    }
  }
  scales[scales_off + block] = mm;
  scales[scales_off + blocks + block] = vm;
}
