// The step's loss as a weighted sum of two losses: out[0] = wa a[0] + wb b[0], where a and b are
// the statistics of loss ops (element 0: their loss). One work-item.
__kernel void loss_sum(__global const float* a, ulong a_off, __global const float* b, ulong b_off, __global float* out,
                       ulong out_off, float wa, float wb) {
  if (get_global_id(0) != 0) return;
  out[out_off] = wa * a[a_off] + wb * b[b_off];
}
