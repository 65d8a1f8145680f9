// Optimizer updates, one work-item per parameter, one pass over (w, g, state). Arguments after
// `n` that change per step (learning rate, bias corrections) are set just before each enqueue.
// With has_guard, the update is skipped when guard[0] (the step's loss) is not finite, so a
// diverged step leaves weights and state as they were.
// With has_status, a weight this update makes not finite sets status[0] to 1 (atomically: every
// writer stores the same bit), so that the step reports it without reading the weights back.

// SGD with momentum: g' = g + wd w; v = momentum v + g'; w -= lr (nesterov ? g' + momentum v : v).
__kernel void sgd_update(__global float* w, ulong w_off, __global const float* g, ulong g_off, __global float* velocity,
                         ulong velocity_off, uint n, float momentum, float weight_decay, uint nesterov, float lr,
                         __global const float* guard, ulong guard_off, uint has_guard, __global uint* status,
                         ulong status_off, uint has_status) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  if (has_guard && !isfinite(guard[guard_off])) return;
  const float wi = w[w_off + i];
  const float gi = fma(weight_decay, wi, g[g_off + i]);
  const float vi = fma(momentum, velocity[velocity_off + i], gi);
  velocity[velocity_off + i] = vi;
  const float step = nesterov ? fma(momentum, vi, gi) : vi;
  const float wn = fma(-lr, step, wi);
  w[w_off + i] = wn;
  if (has_status && !isfinite(wn)) atomic_or(status + status_off, 1u);
}

// Adam with L2 (l2 > 0: g' = g + l2 w) or AdamW (decoupled > 0: w -= lr decoupled w, from the
// weight before this update). inv_bc1 = 1 / (1 - beta1^t), inv_bc2 = 1 / (1 - beta2^t).
__kernel void adam_update(__global float* w, ulong w_off, __global const float* g, ulong g_off, __global float* m,
                          ulong m_off, __global float* v, ulong v_off, uint n, float beta1, float beta2, float eps,
                          float l2, float decoupled, float lr, float inv_bc1, float inv_bc2,
                          __global const float* guard, ulong guard_off, uint has_guard, __global uint* status,
                          ulong status_off, uint has_status) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  if (has_guard && !isfinite(guard[guard_off])) return;
  const float wi = w[w_off + i];
  const float gi = fma(l2, wi, g[g_off + i]);
  const float mi = fma(beta1, m[m_off + i], (1.0f - beta1) * gi);
  const float vi = fma(beta2, v[v_off + i], (1.0f - beta2) * gi * gi);
  m[m_off + i] = mi;
  v[v_off + i] = vi;
  const float update = (mi * inv_bc1) / (sqrt(vi * inv_bc2) + eps);
  const float wn = wi - lr * fma(decoupled, wi, update);
  w[w_off + i] = wn;
  if (has_status && !isfinite(wn)) atomic_or(status + status_off, 1u);
}
