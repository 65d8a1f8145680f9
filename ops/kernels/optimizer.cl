// Optimizer updates, one pass over (w, g, state): one work-item per parameter, or per 16 on CPU devices. Arguments after
// `n` that change per step (learning rate, bias corrections) are set just before each enqueue.
// With has_guard, the update is skipped when guard[0] (the step's loss) is not finite, so a
// diverged step leaves weights and state as they were.
// With has_status, a weight this update makes not finite sets status[0] to 1 (atomically: every
// writer stores the same bit), so that the step reports it without reading the weights back.

// The update of one parameter (T = float) or of 16 consecutive ones (T = float16, the CPU
// kernels'): one expression for both, so the two kernels give the same bits.
// SGD with momentum: g' = g + wd w; v = momentum v + g'; w -= lr (nesterov ? g' + momentum v : v).
#define SGD_STEP(T)                                   \
  const T gi = fma((T)(weight_decay), wi, g_in);      \
  const T vi = fma((T)(momentum), velocity_in, gi);   \
  const T step = nesterov ? fma((T)(momentum), vi, gi) : vi; \
  const T wn = fma((T)(-lr), step, wi);

// Adam with L2 (l2 > 0: g' = g + l2 w) or AdamW (decoupled > 0: w -= lr decoupled w, from the
// weight before this update). inv_bc1 = 1 / (1 - beta1^t), inv_bc2 = 1 / (1 - beta2^t).
#define ADAM_STEP(T)                                                 \
  const T gi = fma((T)(l2), wi, g_in);                               \
  const T mi = fma((T)(beta1), m_in, (1.0f - beta1) * gi);           \
  const T vi = fma((T)(beta2), v_in, (1.0f - beta2) * gi * gi);      \
  const T update = (mi * inv_bc1) / (sqrt(vi * inv_bc2) + eps);      \
  const T wn = wi - lr * fma((T)(decoupled), wi, update);

#define SGD_ARGS                                                                                                    \
  __global float *w, ulong w_off, __global const float *g, ulong g_off, __global float *velocity, ulong velocity_off, \
      uint n, float momentum, float weight_decay, uint nesterov, float lr, __global const float *guard,             \
      ulong guard_off, uint has_guard, __global uint *status, ulong status_off, uint has_status
#define ADAM_ARGS                                                                                                     \
  __global float *w, ulong w_off, __global const float *g, ulong g_off, __global float *m, ulong m_off,               \
      __global float *v, ulong v_off, uint n, float beta1, float beta2, float eps, float l2, float decoupled, float lr, \
      float inv_bc1, float inv_bc2, __global const float *guard, ulong guard_off, uint has_guard,                    \
      __global uint *status, ulong status_off, uint has_status

inline void sgd_one(SGD_ARGS, size_t i) {
  const float wi = w[w_off + i], g_in = g[g_off + i], velocity_in = velocity[velocity_off + i];
  SGD_STEP(float)
  velocity[velocity_off + i] = vi;
  w[w_off + i] = wn;
  if (has_status && !isfinite(wn)) atomic_or(status + status_off, 1u);
}

inline void adam_one(ADAM_ARGS, size_t i) {
  const float wi = w[w_off + i], g_in = g[g_off + i], m_in = m[m_off + i], v_in = v[v_off + i];
  ADAM_STEP(float)
  m[m_off + i] = mi;
  v[v_off + i] = vi;
  w[w_off + i] = wn;
  if (has_status && !isfinite(wn)) atomic_or(status + status_off, 1u);
}

#define SGD_PASS w, w_off, g, g_off, velocity, velocity_off, n, momentum, weight_decay, nesterov, lr, guard, guard_off, has_guard, status, status_off, has_status
#define ADAM_PASS w, w_off, g, g_off, m, m_off, v, v_off, n, beta1, beta2, eps, l2, decoupled, lr, inv_bc1, inv_bc2, guard, guard_off, has_guard, status, status_off, has_status

// One work-item per parameter (GPUs).
__kernel void sgd_update(SGD_ARGS) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  if (has_guard && !isfinite(guard[guard_off])) return;
  sgd_one(SGD_PASS, i);
}

__kernel void adam_update(ADAM_ARGS) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  if (has_guard && !isfinite(guard[guard_off])) return;
  adam_one(ADAM_PASS, i);
}

// CPU devices: 16 consecutive parameters per work-item as float16 (the per-element kernels ran at
// a third of the memory bandwidth on PoCL: Adam over 1.86M parameters 4.5-6 ms, these 1.3-2.4);
// parameters past the last whole 16 one by one.
__kernel void sgd_update16(SGD_ARGS) {
  const size_t i = get_global_id(0) * 16;
  if (i >= n) return;
  if (has_guard && !isfinite(guard[guard_off])) return;
  if (i + 16 > n) {
    for (size_t j = i; j < n; ++j) sgd_one(SGD_PASS, j);
    return;
  }
  const float16 wi = vload16(0, w + w_off + i), g_in = vload16(0, g + g_off + i),
                velocity_in = vload16(0, velocity + velocity_off + i);
  SGD_STEP(float16)
  vstore16(vi, 0, velocity + velocity_off + i);
  vstore16(wn, 0, w + w_off + i);
  if (has_status && !all(isfinite(wn))) atomic_or(status + status_off, 1u);
}

__kernel void adam_update16(ADAM_ARGS) {
  const size_t i = get_global_id(0) * 16;
  if (i >= n) return;
  if (has_guard && !isfinite(guard[guard_off])) return;
  if (i + 16 > n) {
    for (size_t j = i; j < n; ++j) adam_one(ADAM_PASS, j);
    return;
  }
  const float16 wi = vload16(0, w + w_off + i), g_in = vload16(0, g + g_off + i), m_in = vload16(0, m + m_off + i),
                v_in = vload16(0, v + v_off + i);
  ADAM_STEP(float16)
  vstore16(mi, 0, m + m_off + i);
  vstore16(vi, 0, v + v_off + i);
  vstore16(wn, 0, w + w_off + i);
  if (has_status && !all(isfinite(wn))) atomic_or(status + status_off, 1u);
}
