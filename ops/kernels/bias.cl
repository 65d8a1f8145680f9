// Bias over the rows of a row-major [rows, cols] matrix. The bias and its gradient are f32; dy of
// the backward kernels is stored as T (-DT_F16 / -DT_BF16, see dtype.clh; f32 without).
#include "dtype.clh"
#include "guard.clh"
#include "store16.clh"

// y[r, c] += b[c], one work-item per element.
__kernel void bias_forward(__global float* y, ulong y_off, __global const float* b, ulong b_off, uint rows, uint cols) {
  const size_t i = get_global_id(0);
  if (i >= (size_t)rows * cols) return;
  y[y_off + i] += b[b_off + i % cols];
}

// db[c] = sum over r of dy[r, c], deterministic: work-group (TC, TR) owns TC columns; row lane
// j sums rows j, j + TR, j + 2 TR, ... in order, then the TR partial sums are combined by a
// fixed tree in local memory (TR a power of two). Neighbouring work-items read neighbouring
// columns, so the reads are coalesced. With a guard (not null), a sum that is not finite sets it
// to NaN (guard.clh).
__kernel void bias_backward(__global const T_STORAGE* dy, ulong dy_off, __global float* db, ulong db_off, uint rows,
                            uint cols, __local float* partial, __global float* guard, ulong guard_off) {
  const uint lc = get_local_id(0), lr = get_local_id(1);
  const uint tc = get_local_size(0), tr = get_local_size(1);
  const uint c = get_global_id(0);
  float s = 0.0f;
  if (c < cols) {
    // Four rows' loads issued before their adds: the sum over a few thousand rows waits on memory
    // latency, not bandwidth (768 columns are 48 work-groups). The adds keep their order: same bits.
    const ulong step = (ulong)tr * cols;
    ulong at = dy_off + (ulong)lr * cols + c;
    uint r = lr;
    for (; r + 3 * tr < rows; r += 4 * tr, at += 4 * step) {
      const float v0 = LOAD_T(dy, at), v1 = LOAD_T(dy, at + step), v2 = LOAD_T(dy, at + 2 * step),
                  v3 = LOAD_T(dy, at + 3 * step);
      s += v0;
      s += v1;
      s += v2;
      s += v3;
    }
    for (; r < rows; r += tr, at += step) s += LOAD_T(dy, at);
  }
  partial[lr * tc + lc] = s;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (uint step = tr / 2; step > 0; step /= 2) {
    if (lr < step) partial[lr * tc + lc] += partial[(lr + step) * tc + lc];
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  if (lr == 0 && c < cols) {
    const float sum = partial[lc];
    db[db_off + c] = sum;
    guard_set_if(guard, guard_off, unusable_gradient(sum));
  }
}

// db on CPU devices: a work-item sums the rows of 16 columns as one float16, in order (a last
// partial chunk column by column). The work-group version above runs scalar code there.
__kernel void bias_backward16(__global const T_STORAGE* dy, ulong dy_off, __global float* db, ulong db_off, uint rows,
                              uint cols, __global float* guard, ulong guard_off) {
  const uint c0 = get_global_id(0) * 16;
  if (c0 >= cols) return;
  bool bad = false;
#if !T_IS_F32
  // A narrow dy: the same sums in the same order, one element at a time.
  for (uint c = c0; c < min(c0 + 16u, cols); ++c) {
    float s = 0.0f;
    for (uint r = 0; r < rows; ++r) s += LOAD_T(dy, dy_off + (ulong)r * cols + c);
    db[db_off + c] = s;
    bad = bad || unusable_gradient(s);
  }
#else
  if (c0 + 16 <= cols) {
    float16 s = 0.0f;
    for (uint r = 0; r < rows; ++r) s += vload16(0, dy + dy_off + (ulong)r * cols + c0);
    VSTORE16_GLOBAL(s, db + db_off + c0);
    guard_set_if(guard, guard_off, !all_usable16(s));
    return;
  }
  for (uint c = c0; c < cols; ++c) {
    float s = 0.0f;
    for (uint r = 0; r < rows; ++r) s += dy[dy_off + (ulong)r * cols + c];
    db[db_off + c] = s;
    bad = bad || unusable_gradient(s);
  }
#endif
  guard_set_if(guard, guard_off, bad);
}
