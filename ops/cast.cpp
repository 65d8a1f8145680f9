// Binding of the conversion and int8 quantization kernels (ops/kernels/cast.cl), and their CPU
// references.
#include "ferry/ops/cast.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "ferry/cl/error.hpp"

namespace ferry::ops {
namespace {

constexpr DTypeSet cast_types{DType::f32, DType::f16, DType::bf16};

void check_cast(DType from, DType to) {
  if (!cast_supported(from, to)) {
    throw std::invalid_argument(fmt::format("cast {} -> {} is not supported: cast converts between {} (any pair)",
                                            dtype_name(from), dtype_name(to), cast_types.str()));
  }
}

void check_layout(const char* op, QuantLayout l) {
  if (l.channels != 0 &&
      (l.outer > std::numeric_limits<cl_uint>::max() / l.channels ||
       l.outer * l.channels > std::numeric_limits<cl_uint>::max() / std::max<std::size_t>(1, l.inner))) {
    throw std::invalid_argument(
        fmt::format("{}: layout [{}, {}, {}] has more than 2^32-1 elements", op, l.outer, l.channels, l.inner));
  }
  element_count(op, l.channels);
  element_count(op, l.inner);
}

// The reference quantization follows cast.cl step for step (absmax on the bits, NaN skipped; then
// the host's IEEE division, which the kernel's div_rn reproduces; nearbyint: ties to even).
bool finite_bits(float v) {
  return (std::bit_cast<std::uint32_t>(v) & 0x7fffffffu) < 0x7f800000u;
}

}  // namespace

bool cast_supported(DType from, DType to) {
  return cast_types.contains(from) && cast_types.contains(to);
}

float cast_factor(CastScale scale, const StepInfo& step) {
  switch (scale) {
    case CastScale::none:
      return 1.0f;
    case CastScale::loss_scale:
      return step.loss_scale;
    case CastScale::inverse_loss_scale:
      return 1.0f / step.loss_scale;
  }
  return 1.0f;
}

LaunchList cast(OpEnv& env, DType from, DType to, DeviceSpan in, DeviceSpan out, std::size_t n, CastScale scale) {
  check_cast(from, to);
  const cl_uint count = element_count("cast", n);
  if (scale != CastScale::none) {
    cl::Kernel k =
        env.kernels.kernel("cast", "cast_scaled", fmt::format("{} {}", dtype_define(from, "S"), dtype_define(to, "D")));
    cl::set_args(k.get(), in.buffer, in.elem_offset(dtype_bytes(from)), out.buffer, out.elem_offset(dtype_bytes(to)),
                 count, 1.0f);
    KernelLaunch l = elementwise_launch(std::move(k), n);
    l.per_step = [scale](cl_kernel kernel, const StepInfo& step) {
      const float f = cast_factor(scale, step);
      cl::check(clSetKernelArg(kernel, 5, sizeof(float), &f), "clSetKernelArg(cast_scaled scale)");
    };
    LaunchList list;
    list.push_back(std::move(l));
    return list;
  }
  cl::Kernel k = from == to ? env.kernels.kernel("cast", "cast_identity", dtype_define(from, "S"))
                            : env.kernels.kernel("cast", "cast",
                                                 fmt::format("{} {}", dtype_define(from, "S"), dtype_define(to, "D")));
  cl::set_args(k.get(), in.buffer, in.elem_offset(dtype_bytes(from)), out.buffer, out.elem_offset(dtype_bytes(to)),
               count);
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k), n));
  return list;
}

namespace {

// The element kernels' [rows, cols] view of a layout (cast.cl): with inner == 1 the rows are the
// outer index and the columns the channels, otherwise a row is one (outer, channel) pair.
std::size_t quant_cols(QuantLayout l) {
  return l.inner == 1 ? l.channels : l.inner;
}

// The element kernel's division in double where that is exact for every float (cast.cl): the
// device has doubles and keeps float denormals.
std::string quantize_options(const cl::DeviceInfo& device) {
  cl_device_fp_config single = 0;
  if (clGetDeviceInfo(device.id, CL_DEVICE_SINGLE_FP_CONFIG, sizeof single, &single, nullptr) != CL_SUCCESS) return {};
  return device.has_extension("cl_khr_fp64") && (single & CL_FP_DENORM) != 0 ? "-DQUANT_FP64" : "";
}

// Its launch: 64 columns a work-group (16 for short rows: a convolution's 3 x 3 x C).
KernelLaunch quant_elements_launch(cl::Kernel k, QuantLayout l) {
  const std::size_t cols = std::max<std::size_t>(1, quant_cols(l)), rows = l.elems() / cols;
  KernelLaunch launch;
  launch.kernel = std::move(k);
  launch.dims = 2;
  const std::size_t group = cols >= 64 ? 64 : 16;
  launch.global = {(cols + group - 1) / group * group, std::max<std::size_t>(1, rows), 1};
  launch.local = {group, 1, 1};
  return launch;
}

// The scales' launch. CPU devices: a work-item per channel (quantize_i8_scales). GPUs, and any
// device under FERRY_ROW_GROUP_SIZE (tests): work-groups whose lanes split each channel
// (quantize_i8_scales_lanes), 16 channels by 16 lanes where channels are columns (inner == 1),
// else a channel by as many lanes as its runs need, up to 256.
KernelLaunch quant_scales_launch(OpEnv& env, DeviceSpan x, DeviceSpan scales, QuantLayout l) {
  const bool lanes = !env.device().is_cpu() || row_group_forced();
  cl::Kernel k = env.kernels.kernel("cast", lanes ? "quantize_i8_scales_lanes" : "quantize_i8_scales");
  cl::set_args(k.get(), x.buffer, x.elem_offset(4), scales.buffer, scales.elem_offset(4), static_cast<cl_uint>(l.outer),
               static_cast<cl_uint>(l.channels), static_cast<cl_uint>(l.inner));
  if (!lanes) return elementwise_launch(std::move(k), l.channels);
  const auto [tc, tr] = l.inner == 1 ? column_group_size(k, env.device())
                                     : std::pair<std::size_t, std::size_t>{1, row_group_size(k, env.device(), l.inner)};
  FERRY_CL(clSetKernelArg(k.get(), 7, tc * tr * sizeof(cl_uint), nullptr));
  KernelLaunch launch;
  launch.kernel = std::move(k);
  launch.dims = 2;
  launch.global = {round_up(l.channels, tc), tr, 1};
  launch.local = {tc, tr, 1};
  return launch;
}

}  // namespace

LaunchList quantize_i8(OpEnv& env, DeviceSpan x, DeviceSpan q, DeviceSpan scales, QuantLayout layout) {
  check_layout("quantize_i8", layout);
  KernelLaunch scales_launch = quant_scales_launch(env, x, scales, layout);
  cl::Kernel kq = env.kernels.kernel("cast", "quantize_i8", quantize_options(env.device()));
  cl::set_args(kq.get(), x.buffer, x.elem_offset(4), scales.buffer, scales.elem_offset(4), q.buffer, q.elem_offset(1),
               static_cast<cl_uint>(quant_cols(layout)), static_cast<cl_uint>(layout.channels),
               static_cast<cl_uint>(layout.inner));
  LaunchList list;
  list.push_back(std::move(scales_launch));
  list.push_back(quant_elements_launch(std::move(kq), layout));
  return list;
}

LaunchList dequantize_i8(OpEnv& env, DeviceSpan q, DeviceSpan scales, DeviceSpan x, QuantLayout layout) {
  check_layout("dequantize_i8", layout);
  cl::Kernel k = env.kernels.kernel("cast", "dequantize_i8");
  cl::set_args(k.get(), q.buffer, q.elem_offset(1), scales.buffer, scales.elem_offset(4), x.buffer, x.elem_offset(4),
               static_cast<cl_uint>(quant_cols(layout)), static_cast<cl_uint>(layout.channels),
               static_cast<cl_uint>(layout.inner));
  LaunchList list;
  list.push_back(quant_elements_launch(std::move(k), layout));
  return list;
}

namespace ref {

float load_float(DType t, const void* p, std::size_t i) {
  switch (t) {
    case DType::f32: {
      float v;
      std::memcpy(&v, static_cast<const char*>(p) + i * 4, 4);
      return v;
    }
    case DType::f16:
    case DType::bf16: {
      std::uint16_t h;
      std::memcpy(&h, static_cast<const char*>(p) + i * 2, 2);
      return t == DType::f16 ? half_to_float(h) : bf16_to_float(h);
    }
    default:
      throw std::invalid_argument(
          fmt::format("ref::load_float: {} is not a float storage type (use {})", dtype_name(t), cast_types.str()));
  }
}

void store_float(DType t, float v, void* p, std::size_t i) {
  switch (t) {
    case DType::f32:
      std::memcpy(static_cast<char*>(p) + i * 4, &v, 4);
      return;
    case DType::f16:
    case DType::bf16: {
      const std::uint16_t h = t == DType::f16 ? float_to_half(v) : float_to_bf16(v);
      std::memcpy(static_cast<char*>(p) + i * 2, &h, 2);
      return;
    }
    default:
      throw std::invalid_argument(
          fmt::format("ref::store_float: {} is not a float storage type (use {})", dtype_name(t), cast_types.str()));
  }
}

void cast(DType from, DType to, const void* in, void* out, std::size_t n, float factor) {
  check_cast(from, to);
  if (factor != 1.0f) {
    for (std::size_t i = 0; i < n; ++i) store_float(to, load_float(from, in, i) * factor, out, i);
    return;
  }
  if (from == to) {
    std::memmove(out, in, n * dtype_bytes(from));
    return;
  }
  for (std::size_t i = 0; i < n; ++i) store_float(to, load_float(from, in, i), out, i);
}

void quantize_i8(std::span<const float> x, QuantLayout l, std::span<std::int8_t> q, std::span<float> scales) {
  if (x.size() != l.elems() || q.size() != l.elems() || scales.size() != l.channels) {
    throw std::invalid_argument(fmt::format("ref::quantize_i8: x {}, q {}, scales {} elements for layout [{}, {}, {}]",
                                            x.size(), q.size(), scales.size(), l.outer, l.channels, l.inner));
  }
  for (std::size_t c = 0; c < l.channels; ++c) {
    std::uint32_t amax = 0;
    for (std::size_t o = 0; o < l.outer; ++o) {
      for (std::size_t i = 0; i < l.inner; ++i) {
        const std::uint32_t a = std::bit_cast<std::uint32_t>(x[(o * l.channels + c) * l.inner + i]) & 0x7fffffffu;
        if (a <= 0x7f800000u && a > amax) amax = a;
      }
    }
    const float absmax = std::bit_cast<float>(amax);
    scales[c] = absmax / 127.0f;
  }
  for (std::size_t idx = 0; idx < x.size(); ++idx) {
    const float s = scales[(idx / std::max<std::size_t>(1, l.inner)) % l.channels];
    const float v = x[idx];
    float t = 0.0f;
    if (std::bit_cast<std::uint32_t>(s) != 0 && finite_bits(s) && finite_bits(v)) {
      t = std::clamp(std::nearbyint(v / s), -127.0f, 127.0f);
    }
    q[idx] = static_cast<std::int8_t>(t);
  }
}

void dequantize_i8(std::span<const std::int8_t> q, std::span<const float> scales, QuantLayout l, std::span<float> x) {
  if (x.size() != l.elems() || q.size() != l.elems() || scales.size() != l.channels) {
    throw std::invalid_argument(
        fmt::format("ref::dequantize_i8: q {}, scales {}, x {} elements for layout [{}, {}, {}]", q.size(),
                    scales.size(), x.size(), l.outer, l.channels, l.inner));
  }
  for (std::size_t idx = 0; idx < x.size(); ++idx) {
    x[idx] = static_cast<float>(q[idx]) * scales[(idx / std::max<std::size_t>(1, l.inner)) % l.channels];
  }
}

}  // namespace ref
}  // namespace ferry::ops
