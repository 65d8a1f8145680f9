// Binding of the overflow guard kernels (ops/kernels/overflow_guard.cl).
#include "ops/overflow_guard.hpp"

#include <tbb/blocked_range.h>
#include <tbb/parallel_reduce.h>

#include <bit>
#include <cstdint>
#include <functional>

#include "ferry/cl/error.hpp"

namespace ferry::ops {

LaunchList overflow_guard_init(OpEnv& env, DeviceSpan stats, DeviceSpan guard) {
  cl::Kernel k = env.kernels.kernel("overflow_guard", "overflow_guard_init");
  cl::set_args(k.get(), stats.buffer, stats.elem_offset(), guard.buffer, guard.elem_offset());
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k), 1));
  return list;
}

LaunchList overflow_guard_check(OpEnv& env, DeviceSpan gradient, std::size_t elems, DeviceSpan guard) {
  LaunchList list;
  if (elems == 0) return list;
  // CPU devices: 256 elements per work-item (kGuardChunk, GUARD_CHUNK in the kernel).
  constexpr std::size_t kGuardChunk = 256;
  const bool wide = env.device().is_cpu();
  cl::Kernel k = env.kernels.kernel("overflow_guard", wide ? "overflow_guard_check16" : "overflow_guard_check");
  cl::set_args(k.get(), gradient.buffer, gradient.elem_offset(), element_count("overflow_guard_check", elems),
               guard.buffer, guard.elem_offset());
  list.push_back(elementwise_launch(std::move(k), wide ? (elems + kGuardChunk - 1) / kGuardChunk : elems));
  return list;
}

bool all_finite_host(std::span<const float> values) {
  // Blocks of 64K floats (256 KiB) on the TBB workers; within a block no branch per element, so the
  // compiler vectorises the test on the exponent bits (all ones: inf or NaN).
  constexpr std::size_t block = std::size_t{1} << 16;
  return !tbb::parallel_reduce(
      tbb::blocked_range<std::size_t>(0, values.size(), block), false,
      [values](const tbb::blocked_range<std::size_t>& r, bool bad) {
        std::uint32_t any = 0;
        for (std::size_t i = r.begin(); i < r.end(); ++i) {
          any |= static_cast<std::uint32_t>((std::bit_cast<std::uint32_t>(values[i]) & 0x7f800000u) == 0x7f800000u);
        }
        return bad || any != 0;
      },
      std::logical_or<>());
}

}  // namespace ferry::ops
