// LayerNorm over the last dimension of a row-major [rows, cols] matrix. Operands are
// (buffer, element offset) pairs.
//
// Reductions are deterministic: fixed strided partial sums per work-item, then a fixed tree in
// local memory (reduce.clh), no atomics.
//
// Residual add fused in (the add_layernorm row): when the forward's `ra` is not null, x is an
// output, x = ra + rb written first (each work-item rereads only what it wrote), then normalised as
// usual. When the backward's `dres` is not null, dx = LayerNorm's gradient + dres: the gradient
// the sum gets from its other readers, added in the same pass.
//
// Under mixed precision (graph::fuse_narrowing_casts) two operands may be narrow, each by its own
// define (dtype.clh; f32 without one): y's storage is D (-DD_F16, -DD_BF16), the f32 result rounded
// as the cast kernel rounds, the copy the next layer reads; rb's is S (-DS_F16, -DS_BF16), widened
// exactly as it is read, the output of the layer whose result the residual adds. LayerNorm still
// computes in f32 from f32 x, and a cast node no longer writes or reads an f32 copy.

#if defined(D_F16) || defined(D_BF16)
#define Y_NARROW 1
#else
#define Y_NARROW 0
#endif
#if defined(S_F16) || defined(S_BF16)
#define RB_NARROW 1
#else
#define RB_NARROW 0
#endif
#if Y_NARROW || RB_NARROW
#define FERRY_WIDE16 1  // LOAD16, STORE16 (dtype.clh), for the CPU kernel's whole chunks
#endif
#include "dtype.clh"
#include "guard.clh"
#include "reduce.clh"
#include "store16.clh"

// One work-group per row. Two passes over the row (mean, then the centred variance), which is
// stable where E[x^2] - E[x]^2 would cancel.
__kernel void layernorm_forward(__global float* x, ulong x_off, __global const float* gamma, ulong gamma_off,
                                __global const float* beta, ulong beta_off, __global D_STORAGE* y, ulong y_off,
                                __global float* mean, ulong mean_off, __global float* rstd, ulong rstd_off, uint cols,
                                float eps, __local float* scratch, __global const float* ra, ulong ra_off,
                                __global const S_STORAGE* rb, ulong rb_off) {
  const ulong row = get_group_id(0);
  const uint lid = get_local_id(0), ls = get_local_size(0);
  __global float* xr = x + x_off + row * cols;
  const ulong yr = y_off + row * cols;  // element index
  if (ra) {
    for (uint c = lid; c < cols; c += ls) xr[c] = ra[ra_off + row * cols + c] + LOAD_S(rb, rb_off + row * cols + c);
  }
  float s = 0.0f;
  for (uint c = lid; c < cols; c += ls) s += xr[c];
  const float mu = group_sum(s, scratch) / (float)cols;
  float q = 0.0f;
  for (uint c = lid; c < cols; c += ls) {
    const float d = xr[c] - mu;
    q = fma(d, d, q);
  }
  const float var = group_sum(q, scratch) / (float)cols;
  const float rs = 1.0f / sqrt(var + eps);
  for (uint c = lid; c < cols; c += ls) STORE_D(fma((xr[c] - mu) * rs, gamma[gamma_off + c], beta[beta_off + c]), y, yr + c);
  if (lid == 0) {
    mean[mean_off + row] = mu;
    rstd[rstd_off + row] = rs;
  }
}

// dx for one row per work-group: with xhat = (x - mean) rstd and g = dy gamma,
// dx = rstd (g - mean(g) - xhat mean(g xhat)).
__kernel void layernorm_backward_dx(__global const float* x, ulong x_off, __global const float* gamma, ulong gamma_off,
                                    __global const float* mean, ulong mean_off, __global const float* rstd,
                                    ulong rstd_off, __global const float* dy, ulong dy_off, __global float* dx,
                                    ulong dx_off, uint cols, __local float* scratch, __global const float* dres,
                                    ulong dres_off) {
  const ulong row = get_group_id(0);
  const uint lid = get_local_id(0), ls = get_local_size(0);
  __global const float* xr = x + x_off + row * cols;
  __global const float* dyr = dy + dy_off + row * cols;
  __global float* dxr = dx + dx_off + row * cols;
  const float mu = mean[mean_off + row], rs = rstd[rstd_off + row];
  float sg = 0.0f, sgx = 0.0f;
  for (uint c = lid; c < cols; c += ls) {
    const float g = dyr[c] * gamma[gamma_off + c];
    sg += g;
    sgx = fma(g, (xr[c] - mu) * rs, sgx);
  }
  const float mean_g = group_sum(sg, scratch) / (float)cols;
  const float mean_gx = group_sum(sgx, scratch) / (float)cols;
  for (uint c = lid; c < cols; c += ls) {
    const float xhat = (xr[c] - mu) * rs;
    const float g = dyr[c] * gamma[gamma_off + c];
    const float v = rs * (g - mean_g - xhat * mean_gx);
    dxr[c] = dres ? v + dres[dres_off + row * cols + c] : v;
  }
}

// dgamma[c] = sum_r dy[r, c] xhat[r, c], dbeta[c] = sum_r dy[r, c]. Work-group (TC, TR) owns TC
// columns; row lane j sums rows j, j + TR, ... in order, then a fixed tree over the TR lanes
// (TR a power of two). Neighbouring work-items read neighbouring columns (coalesced).
__kernel void layernorm_backward_params(__global const float* x, ulong x_off, __global const float* mean,
                                        ulong mean_off, __global const float* rstd, ulong rstd_off,
                                        __global const float* dy, ulong dy_off, __global float* dgamma,
                                        ulong dgamma_off, __global float* dbeta, ulong dbeta_off, uint rows, uint cols,
                                        __local float* partial_gamma, __local float* partial_beta,
                                        __global float* guard, ulong guard_off) {
  const uint lc = get_local_id(0), lr = get_local_id(1);
  const uint tc = get_local_size(0), tr = get_local_size(1);
  const uint c = get_global_id(0);
  float sg = 0.0f, sb = 0.0f;
  if (c < cols) {
    // Four rows' loads issued before their arithmetic (see bias_backward); the sums keep their order.
    const ulong step = (ulong)tr * cols;
    ulong i = (ulong)lr * cols + c;
    uint r = lr;
    for (; r + 3 * tr < rows; r += 4 * tr, i += 4 * step) {
      float d[4], xh[4];
#pragma unroll
      for (uint u = 0; u < 4; ++u) {
        d[u] = dy[dy_off + i + u * step];
        xh[u] = (x[x_off + i + u * step] - mean[mean_off + r + u * tr]) * rstd[rstd_off + r + u * tr];
      }
#pragma unroll
      for (uint u = 0; u < 4; ++u) {
        sg = fma(d[u], xh[u], sg);
        sb += d[u];
      }
    }
    for (; r < rows; r += tr, i += step) {
      const float d = dy[dy_off + i];
      sg = fma(d, (x[x_off + i] - mean[mean_off + r]) * rstd[rstd_off + r], sg);
      sb += d;
    }
  }
  partial_gamma[lr * tc + lc] = sg;
  partial_beta[lr * tc + lc] = sb;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (uint step = tr / 2; step > 0; step /= 2) {
    if (lr < step) {
      partial_gamma[lr * tc + lc] += partial_gamma[(lr + step) * tc + lc];
      partial_beta[lr * tc + lc] += partial_beta[(lr + step) * tc + lc];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (lr == 0 && c < cols) {
    const float g = partial_gamma[lc], b = partial_beta[lc];
    dgamma[dgamma_off + c] = g;
    dbeta[dbeta_off + c] = b;
    guard_set_if(guard, guard_off, unusable_gradient(g) || unusable_gradient(b));
  }
}

// CPU devices: one work-item per row (forward, dx) or per 16 columns (gamma, beta), the row taken
// as float16 chunks and the columns past the last whole chunk one by one; PoCL runs float16
// arithmetic about as fast as scalar, where a work-group per row ran scalar code. Same formulas
// and fixed summation orders within a work-item (not the same bits as the kernels above: the
// partial sums are grouped differently).
__kernel void layernorm_forward16(__global float* x, ulong x_off, __global const float* gamma, ulong gamma_off,
                                  __global const float* beta, ulong beta_off, __global D_STORAGE* y, ulong y_off,
                                  __global float* mean, ulong mean_off, __global float* rstd, ulong rstd_off,
                                  uint rows, uint cols, float eps, __global const float* ra, ulong ra_off,
                                  __global const S_STORAGE* rb, ulong rb_off) {
  const uint row = get_global_id(0);
  if (row >= rows) return;
  __global float* xr = x + x_off + (ulong)row * cols;
  if (ra) {
    __global const float* ar = ra + ra_off + (ulong)row * cols;
    const ulong br = rb_off + (ulong)row * cols;  // element index
    const uint vc = cols / 16 * 16;
    for (uint c = 0; c < vc; c += 16) {
#if RB_NARROW
      const float16 bv = LOAD16(S_NAME, rb, br + c);
#else
      const float16 bv = vload16(0, rb + br + c);
#endif
      VSTORE16_GLOBAL(vload16(0, ar + c) + bv, xr + c);
    }
    for (uint c = vc; c < cols; ++c) xr[c] = ar[c] + LOAD_S(rb, br + c);
  }
  const ulong yr = y_off + (ulong)row * cols;  // element index
  __global const float* g = gamma + gamma_off;
  __global const float* b = beta + beta_off;
  const uint vcols = cols / 16 * 16;
  float16 s16 = 0.0f;
  for (uint c = 0; c < vcols; c += 16) s16 += vload16(0, xr + c);
  float s = fold_sum16(s16);
  for (uint c = vcols; c < cols; ++c) s += xr[c];
  const float mu = s / (float)cols;
  float16 q16 = 0.0f;
  for (uint c = 0; c < vcols; c += 16) {
    const float16 d = vload16(0, xr + c) - mu;
    q16 = fma(d, d, q16);
  }
  float q = fold_sum16(q16);
  for (uint c = vcols; c < cols; ++c) {
    const float d = xr[c] - mu;
    q = fma(d, d, q);
  }
  const float rs = 1.0f / sqrt(q / (float)cols + eps);
  for (uint c = 0; c < vcols; c += 16) {
    const float16 v = fma((vload16(0, xr + c) - mu) * rs, vload16(0, g + c), vload16(0, b + c));
#if Y_NARROW
    STORE16(D_NAME, v, y, yr + c);
#else
    VSTORE16_GLOBAL(v, y + yr + c);
#endif
  }
  for (uint c = vcols; c < cols; ++c) STORE_D(fma((xr[c] - mu) * rs, g[c], b[c]), y, yr + c);
  mean[mean_off + row] = mu;
  rstd[rstd_off + row] = rs;
}

__kernel void layernorm_backward_dx16(__global const float* x, ulong x_off, __global const float* gamma,
                                      ulong gamma_off, __global const float* mean, ulong mean_off,
                                      __global const float* rstd, ulong rstd_off, __global const float* dy,
                                      ulong dy_off, __global float* dx, ulong dx_off, uint rows, uint cols,
                                      __global const float* dres, ulong dres_off) {
  const uint row = get_global_id(0);
  if (row >= rows) return;
  __global const float* xr = x + x_off + (ulong)row * cols;
  __global const float* dyr = dy + dy_off + (ulong)row * cols;
  __global float* dxr = dx + dx_off + (ulong)row * cols;
  __global const float* gm = gamma + gamma_off;
  const float mu = mean[mean_off + row], rs = rstd[rstd_off + row];
  const uint vcols = cols / 16 * 16;
  float16 sg16 = 0.0f, sgx16 = 0.0f;
  for (uint c = 0; c < vcols; c += 16) {
    const float16 g = vload16(0, dyr + c) * vload16(0, gm + c);
    sg16 += g;
    sgx16 = fma(g, (vload16(0, xr + c) - mu) * rs, sgx16);
  }
  float sg = fold_sum16(sg16), sgx = fold_sum16(sgx16);
  for (uint c = vcols; c < cols; ++c) {
    const float g = dyr[c] * gm[c];
    sg += g;
    sgx = fma(g, (xr[c] - mu) * rs, sgx);
  }
  const float mean_g = sg / (float)cols, mean_gx = sgx / (float)cols;
  __global const float* rr = dres ? dres + dres_off + (ulong)row * cols : 0;
  for (uint c = 0; c < vcols; c += 16) {
    const float16 xhat = (vload16(0, xr + c) - mu) * rs;
    const float16 g = vload16(0, dyr + c) * vload16(0, gm + c);
    const float16 v = rs * (g - mean_g - xhat * mean_gx);
    VSTORE16_GLOBAL(rr ? v + vload16(0, rr + c) : v, dxr + c);
  }
  for (uint c = vcols; c < cols; ++c) {
    const float xhat = (xr[c] - mu) * rs;
    const float v = rs * (dyr[c] * gm[c] - mean_g - xhat * mean_gx);
    dxr[c] = rr ? v + rr[c] : v;
  }
}

// dgamma and dbeta for 16 columns per work-item (rows summed in order); a last partial chunk
// column by column.
__kernel void layernorm_backward_params16(__global const float* x, ulong x_off, __global const float* mean,
                                          ulong mean_off, __global const float* rstd, ulong rstd_off,
                                          __global const float* dy, ulong dy_off, __global float* dgamma,
                                          ulong dgamma_off, __global float* dbeta, ulong dbeta_off, uint rows,
                                          uint cols, __global float* guard, ulong guard_off) {
  const uint c0 = get_global_id(0) * 16;
  if (c0 >= cols) return;
  if (c0 + 16 <= cols) {
    float16 sg = 0.0f, sb = 0.0f;
    for (uint r = 0; r < rows; ++r) {
      const ulong i = (ulong)r * cols + c0;
      const float16 d = vload16(0, dy + dy_off + i);
      sg = fma(d, (vload16(0, x + x_off + i) - mean[mean_off + r]) * rstd[rstd_off + r], sg);
      sb += d;
    }
    VSTORE16_GLOBAL(sg, dgamma + dgamma_off + c0);
    VSTORE16_GLOBAL(sb, dbeta + dbeta_off + c0);
    guard_set_if(guard, guard_off, !(all_usable16(sg) && all_usable16(sb)));
    return;
  }
  bool bad = false;
  for (uint c = c0; c < cols; ++c) {
    float sg = 0.0f, sb = 0.0f;
    for (uint r = 0; r < rows; ++r) {
      const ulong i = (ulong)r * cols + c;
      const float d = dy[dy_off + i];
      sg = fma(d, (x[x_off + i] - mean[mean_off + r]) * rstd[rstd_off + r], sg);
      sb += d;
    }
    dgamma[dgamma_off + c] = sg;
    dbeta[dbeta_off + c] = sb;
    bad = bad || unusable_gradient(sg) || unusable_gradient(sb);
  }
  guard_set_if(guard, guard_off, bad);
}
