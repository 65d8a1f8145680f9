// A loss made of two weighted losses: total = wa a + wb b, from the statistics of two loss ops
// (element 0 of each is its loss). Its backward makes each a term of the step's loss with its
// weight, which the term's own backward rule uses as the scale of its gradient.
#pragma once

#include <span>

#include "ferry/ops/launch.hpp"

namespace ferry::ops {

LaunchList loss_sum(OpEnv& env, DeviceSpan a, DeviceSpan b, DeviceSpan out, float wa, float wb);

namespace ref {

template <class T>
void loss_sum(std::span<const T> a, std::span<const T> b, std::span<T> out, T wa, T wb) {
  out[0] = wa * a[0] + wb * b[0];
}

}  // namespace ref
}  // namespace ferry::ops
