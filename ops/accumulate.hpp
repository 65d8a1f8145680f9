// Gradient accumulation: k micro-batches summed into one gradient, the optimizer every k.
//
// Per weight, a persistent sum `acc` ("<w>.grad_sum", homed with the weights). A micro-step
// (no optimizer) runs grad_accumulate: acc = keep * acc + g, keep = StepInfo::accumulate_keep
// (0 on the first micro-batch of a group, so the sum restarts without a separate clear). The
// group's last micro-step runs grad_mean: g = (acc + g) / k in place, then the optimizer reads g.
// Each micro-batch's loss is a mean over its samples, so the mean of k equal micro-batches'
// gradients is the gradient of the mean loss over all k * batch samples.
// With `guard` (the step's loss) not finite, grad_accumulate leaves acc as it was.
#pragma once

#include <cstddef>
#include <span>

#include "ferry/ops/launch.hpp"

namespace ferry::ops {

LaunchList grad_accumulate(OpEnv& env, DeviceSpan acc, DeviceSpan g, std::size_t n, DeviceSpan guard = {});
LaunchList grad_mean(OpEnv& env, DeviceSpan acc, DeviceSpan g, std::size_t n, float inv_k);

// The host lane's versions, for sums in pinned host memory (the host optimizer's; graph::
// move_accumulation_to_host): acc_out = (keep != 0 ? acc : 0) + g and g_out = (acc + g) inv_k in
// f32, the kernels' bits, over all cores. No guard: host nodes that change state wait for the
// step's commit point.
void grad_accumulate_host(const float* acc, const float* g, float* acc_out, std::size_t n, float keep);
void grad_mean_host(const float* acc, const float* g, float* g_out, std::size_t n, float inv_k);

namespace ref {

template <class T>
void grad_accumulate(std::span<T> acc, std::span<const T> g, T keep) {
  for (std::size_t i = 0; i < acc.size(); ++i) acc[i] = keep * acc[i] + g[i];
}

template <class T>
void grad_mean(std::span<const T> acc, std::span<T> g, T inv_k) {
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = (acc[i] + g[i]) * inv_k;
}

}  // namespace ref
}  // namespace ferry::ops
