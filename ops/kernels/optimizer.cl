// Optimizer updates, one pass over (w, g, state): one work-item per parameter, or per 16 on CPU devices. Arguments after
// `n` that change per step (learning rate, bias corrections) are set just before each enqueue.
// With has_guard, the update is skipped when guard[0] (the step's loss) is not finite, so a
// diverged step leaves weights and state as they were.
// With has_status, a weight this update makes not finite sets status[0] to 1 (atomically: every
// writer stores the same bit), so that the step reports it without reading the weights back; so
// does an Adam second moment made infinite by a gradient whose square overflows (its weight would
// never move again).

#include "optimizer_group.clh"
#include "guard.clh"
#include "store16.clh"

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

// 16 consecutive parameters from i as one float16 (the CPU kernels').
inline void adam_sixteen(ADAM_ARGS, size_t i) {
  const float16 wi = vload16(0, w + w_off + i), g_in = vload16(0, g + g_off + i), m_in = vload16(0, m + m_off + i),
                v_in = vload16(0, v + v_off + i);
  ADAM_STEP(float16)
  VSTORE16_GLOBAL(mi, m + m_off + i);
  VSTORE16_GLOBAL(vi, v + v_off + i);
  VSTORE16_GLOBAL(wn, w + w_off + i);
  if (has_status && !(all_finite16(wn) && all_finite16(vi))) atomic_or(status + status_off, 1u);
}

inline void adam_one(ADAM_ARGS, size_t i) {
  const float wi = w[w_off + i], g_in = g[g_off + i], m_in = m[m_off + i], v_in = v[v_off + i];
  ADAM_STEP(float)
  m[m_off + i] = mi;
  v[v_off + i] = vi;
  w[w_off + i] = wn;
  if (has_status && !(isfinite(wn) && isfinite(vi))) atomic_or(status + status_off, 1u);
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
  VSTORE16_GLOBAL(vi, velocity + velocity_off + i);
  VSTORE16_GLOBAL(wn, w + w_off + i);
  if (has_status && !all_finite16(wn)) atomic_or(status + status_off, 1u);
}

__kernel void adam_update16(ADAM_ARGS) {
  const size_t i = get_global_id(0) * 16;
  if (i >= n) return;
  if (has_guard && !isfinite(guard[guard_off])) return;
  if (i + 16 > n) {
    for (size_t j = i; j < n; ++j) adam_one(ADAM_PASS, j);
    return;
  }
  adam_sixteen(ADAM_PASS, i);
}

// Adam over a group of up to GROUP_SLOTS parameters in one launch (ops::adam_update_group; the
// graph's adjacent updates, graph::group_updates): slot s updates the n.s<s> parameters of its
// (w, g, m, v), each with its element offset; its work-items start at first.s<s> (ascending; a
// slot past the group's last has n 0 and first at the launch's end). The same expression per
// parameter as adam_update (adam_update16's chunks of 16 from each slot's first parameter on CPU
// devices), so the same bits. The guard and status as there.
#define SLOT_ARGS(s) __global float *w##s, __global const float *g##s, __global float *m##s, __global float *v##s
// Component s of an 8-vector by a chain of selects (no private array: indexing one by a value the
// compiler cannot fold puts it in memory on GPUs, and every work-item of a group pays it).
#define COMPONENT8(v, s)                                                                       \
  ((s) == 0 ? (v).s0 : (s) == 1 ? (v).s1 : (s) == 2 ? (v).s2 : (s) == 3 ? (v).s3 : (s) == 4 ? (v).s4 \
   : (s) == 5 ? (v).s5 : (s) == 6 ? (v).s6 : (v).s7)
#define SLOT_POINTER(p, s)                                                                                   \
  ((s) == 0 ? p##0 : (s) == 1 ? p##1 : (s) == 2 ? p##2 : (s) == 3 ? p##3 : (s) == 4 ? p##4 : (s) == 5 ? p##5 \
   : (s) == 6 ? p##6 : p##7)
#define ADAM_GROUP_ARGS                                                                                              \
  SLOT_ARGS(0), SLOT_ARGS(1), SLOT_ARGS(2), SLOT_ARGS(3), SLOT_ARGS(4), SLOT_ARGS(5), SLOT_ARGS(6), SLOT_ARGS(7),    \
      ulong8 w_offs, ulong8 g_offs, ulong8 m_offs, ulong8 v_offs, uint8 ns, uint8 firsts, float beta1, float beta2, \
      float eps, float l2, float decoupled, float lr, float inv_bc1, float inv_bc2, __global const float *guard,     \
      ulong guard_off, uint has_guard, __global uint *status, ulong status_off, uint has_status

// The slot of work-item `item` (the last slot whose first item is at or before it), its pointers,
// offsets and parameter count, and the item's place within the slot.
#define GROUP_SLOT(item)                                                                                     \
  const uint slot = ((item) >= firsts.s1) + ((item) >= firsts.s2) + ((item) >= firsts.s3) +                \
                    ((item) >= firsts.s4) + ((item) >= firsts.s5) + ((item) >= firsts.s6) +                \
                    ((item) >= firsts.s7);                                                                 \
  __global float* w = SLOT_POINTER(w, slot);                                                                 \
  __global const float* g = SLOT_POINTER(g, slot);                                                           \
  __global float* m = SLOT_POINTER(m, slot);                                                                 \
  __global float* v = SLOT_POINTER(v, slot);                                                                 \
  const ulong w_off = COMPONENT8(w_offs, slot), g_off = COMPONENT8(g_offs, slot);                           \
  const ulong m_off = COMPONENT8(m_offs, slot), v_off = COMPONENT8(v_offs, slot);                           \
  const uint n = COMPONENT8(ns, slot);                                                                       \
  const size_t local_item = (item) - COMPONENT8(firsts, slot);

__kernel void adam_update_group(ADAM_GROUP_ARGS) {
  const size_t item = get_global_id(0);
  GROUP_SLOT(item)
  const size_t i = local_item;
  if (i >= n) return;
  if (has_guard && !isfinite(guard[guard_off])) return;
  adam_one(ADAM_PASS, i);
}

// CPU devices: GROUP_CHUNK parameters per work-item, 16 at a time as adam_update16 takes them (its
// chunks of 16 from the slot's first parameter, the parameters past the last whole 16 one by one),
// so that finding the slot, which a work-item of 16 parameters would pay as much for as for the
// update, is paid once per 256.
__kernel void adam_update_group16(ADAM_GROUP_ARGS) {
  const size_t item = get_global_id(0);
  GROUP_SLOT(item)
  const size_t begin = local_item * GROUP_CHUNK;
  if (begin >= n) return;
  if (has_guard && !isfinite(guard[guard_off])) return;
  const size_t end = min((size_t)n, begin + GROUP_CHUNK);
  size_t i = begin;
  for (; i + 16 <= end; i += 16) adam_sixteen(ADAM_PASS, i);
  for (; i < end; ++i) adam_one(ADAM_PASS, i);
}
