// Binding of the overflow guard kernels (ops/kernels/overflow_guard.cl).
#include "ops/overflow_guard.hpp"

#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_reduce.h>

#include <bit>
#include <cstdint>
#include <functional>
#include <stdexcept>

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

LaunchList overflow_guard_check_scaled(OpEnv& env, DType dtype, DeviceSpan gradient, std::size_t elems, CastScale scale,
                                       DeviceSpan guard) {
  if (dtype != DType::f16 && dtype != DType::bf16) {
    throw std::invalid_argument(fmt::format(
        "overflow_guard_check_scaled: checks an f16 or bf16 gradient, not {} (overflow_guard_check takes f32)",
        dtype_name(dtype)));
  }
  LaunchList list;
  if (elems == 0) return list;
  const cl_uint chunk = env.device().is_cpu() ? 256 : 1;  // CPU devices: 256 elements per work-item
  cl::Kernel k = env.kernels.kernel("overflow_guard", "overflow_guard_check_scaled", dtype_define(dtype));
  cl::set_args(k.get(), gradient.buffer, gradient.elem_offset(dtype_bytes(dtype)),
               element_count("overflow_guard_check_scaled", elems), chunk, 1.0f, guard.buffer, guard.elem_offset());
  KernelLaunch l = elementwise_launch(std::move(k), (elems + chunk - 1) / chunk);
  l.per_step = [scale](cl_kernel kernel, const StepInfo& step) {
    const float factor = cast_factor(scale, step);
    FERRY_CL(clSetKernelArg(kernel, 4, sizeof(float), &factor));
  };
  list.push_back(std::move(l));
  return list;
}

bool all_usable_host(std::span<const float> values) {
  // Blocks of 64K floats (256 KiB) on the TBB workers; within a block no branch per element, so the
  // compiler vectorises the test on the magnitude's bits (NaN's and inf's lie above the limit's).
  constexpr std::size_t block = std::size_t{1} << 16;
  constexpr std::uint32_t limit_bits = std::bit_cast<std::uint32_t>(gradient_limit);
  return !tbb::parallel_reduce(
      tbb::blocked_range<std::size_t>(0, values.size(), block), false,
      [values](const tbb::blocked_range<std::size_t>& r, bool bad) {
        std::uint32_t any = 0;
        for (std::size_t i = r.begin(); i < r.end(); ++i) {
          any |= static_cast<std::uint32_t>((std::bit_cast<std::uint32_t>(values[i]) & 0x7fffffffu) >= limit_bits);
        }
        return bad || any != 0;
      },
      std::logical_or<>());
}

}  // namespace ferry::ops
