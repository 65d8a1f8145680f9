// The overflow guard (ops/overflow_guard.hpp): guard = the loss, or NaN when a gradient element
// is not finite.

__kernel void overflow_guard_init(__global const float* stats, ulong stats_off, __global float* guard,
                                  ulong guard_off) {
  guard[guard_off] = stats[stats_off];
}

// One work-item per gradient element. Writers race only to store the same NaN, through an atomic
// exchange so that the race is well defined.
__kernel void overflow_guard_check(__global const float* g, ulong g_off, uint n, __global float* guard,
                                   ulong guard_off) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  if (!isfinite(g[g_off + i])) atomic_xchg((volatile __global float*)(guard + guard_off), NAN);
}
