// The overflow guard (ops/overflow_guard.hpp): guard = the loss, or NaN when a gradient element
// is not one the updates take (guard.clh unusable_gradient: not finite, or 2^64 or more in
// magnitude).
#include "dtype.clh"
#include "guard.clh"

__kernel void overflow_guard_init(__global const float* stats, ulong stats_off, __global float* guard,
                                  ulong guard_off) {
  guard[guard_off] = stats[stats_off];
}

// One work-item per gradient element (GPUs). Writers race only to store the same NaN, through an
// atomic exchange so that the race is well defined (guard.clh).
__kernel void overflow_guard_check(__global const float* g, ulong g_off, uint n, __global float* guard,
                                   ulong guard_off) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  guard_set_if(guard, guard_off, unusable_gradient(g[g_off + i]));
}

// CPU devices: GUARD_CHUNK consecutive elements per work-item read as float16 (elements past the
// last whole chunk one by one): the per-element kernel read gradients at a third of the memory
// bandwidth on PoCL.
#define GUARD_CHUNK 256
__kernel void overflow_guard_check16(__global const float* g, ulong g_off, uint n, __global float* guard,
                                     ulong guard_off) {
  const size_t i = get_global_id(0) * GUARD_CHUNK;
  if (i >= n) return;
  bool bad = false;
  if (i + GUARD_CHUNK <= n) {
    int16 flags = 0;
    for (uint j = 0; j < GUARD_CHUNK / 16; ++j) {
      flags |= ~isless(fabs(vload16(j, g + g_off + i)), (float16)(GUARD_LIMIT));  // -1 in a lane not taken
    }
    bad = any(flags);
  } else {
    for (size_t j = i; j < n; ++j) bad = bad || unusable_gradient(g[g_off + j]);
  }
  guard_set_if(guard, guard_off, bad);
}

// A narrow gradient (built with -DT_F16 or -DT_BF16) checked as the f32 value the cast that widens
// it makes: each element times `factor` (that cast's, set per step), so the guard sees exactly what
// an update of the widened gradient reads, without the f32 copy. GPUs: one work-item per element;
// CPU devices (`chunk` 256): 256 consecutive elements per work-item.
__kernel void overflow_guard_check_scaled(__global const T_STORAGE* g, ulong g_off, uint n, uint chunk, float factor,
                                          __global float* guard, ulong guard_off) {
  const size_t first = get_global_id(0) * chunk;
  if (first >= n) return;
  const size_t last = min((size_t)n, first + chunk);
  int bad = 0;  // no branch per element: the loop vectorises on CPU devices
  for (size_t i = first; i < last; ++i) bad |= unusable_gradient(LOAD_T(g, g_off + i) * factor);
  guard_set_if(guard, guard_off, bad != 0);
}
