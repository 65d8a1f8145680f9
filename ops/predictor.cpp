// Binding of the predictor kernels (ops/kernels/predictor.cl).
#include "ferry/ops/predictor.hpp"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <stdexcept>

#include "ferry/cl/error.hpp"

namespace ferry::ops {
namespace {

// The guard operand: the loss when there is one, else any valid buffer with has_guard 0.
struct Guard {
  cl_mem buffer;
  cl_ulong offset;
  cl_uint has;
};
Guard guard_of(DeviceSpan guard, DeviceSpan fallback) {
  return {guard.buffer ? guard.buffer : fallback.buffer, guard.buffer ? guard.elem_offset() : 0,
          cl_uint(guard.buffer ? 1 : 0)};
}

}  // namespace

const char* predictor_name(PredictorConfig::Kind k) {
  return k == PredictorConfig::Kind::least_squares ? "lsq" : "linear";
}

PredictorConfig::Kind parse_predictor(const std::string& s) {
  if (s == "linear") return PredictorConfig::Kind::linear;
  if (s == "lsq") return PredictorConfig::Kind::least_squares;
  throw std::invalid_argument(fmt::format(
      "unknown predictor '{}': use linear (smoothed recent updates) or lsq (a least-squares gain per tensor)", s));
}

void check_predictor(const PredictorConfig& c) {
  if (!(c.beta >= 0.0f && c.beta < 1.0f)) {
    throw std::invalid_argument(fmt::format("predictor smoothing must be in [0, 1), got {}", c.beta));
  }
  if (!(c.max_gain > 0.0f) || !std::isfinite(c.max_gain)) {
    throw std::invalid_argument(fmt::format("predictor max gain must be positive and finite, got {}", c.max_gain));
  }
}

LaunchList predictor_snapshot(OpEnv& env, DeviceSpan src, DeviceSpan dst, std::size_t n) {
  cl::Kernel k = env.kernels.kernel("predictor", "predictor_copy");
  cl::set_args(k.get(), src.buffer, src.elem_offset(), dst.buffer, dst.elem_offset(), element_count("predictor", n));
  LaunchList list;
  list.push_back(elementwise_launch(std::move(k), n));
  return list;
}

LaunchList predictor_fit(OpEnv& env, const PredictorConfig& c, DeviceSpan w, DeviceSpan before, DeviceSpan d,
                         DeviceSpan st, DeviceSpan scratch, std::size_t n, DeviceSpan guard, DeviceSpan r) {
  check_predictor(c);
  const Guard gd = guard_of(guard, w);
  const cl_uint has_r = r.buffer != nullptr;
  const DeviceSpan rs = has_r ? r : d;  // any valid buffer when there is no residual state
  LaunchList list;
  {
    cl::Kernel k = env.kernels.kernel("predictor", "predictor_fit_pass");
    // A power-of-two work-group (group_sum's tree): 1 on CPU devices, where a work-item walks
    // memory in order, else up to 256.
    const std::size_t local = row_group_size(k, env.device(), 256);
    cl::set_args(k.get(), w.buffer, w.elem_offset(), before.buffer, before.elem_offset(), d.buffer, d.elem_offset(),
                 element_count("predictor", n), c.beta, scratch.buffer, scratch.elem_offset(), gd.buffer, gd.offset,
                 gd.has, rs.buffer, rs.elem_offset(), has_r, st.buffer, st.elem_offset());
    cl::check(clSetKernelArg(k.get(), 18, local * sizeof(float), nullptr), "clSetKernelArg(predictor_fit_pass)");
    KernelLaunch l;
    l.kernel = std::move(k);
    l.global[0] = local * predictor_fit_groups;
    l.local[0] = local;
    list.push_back(std::move(l));
  }
  {
    cl::Kernel k = env.kernels.kernel("predictor", "predictor_stats");
    cl::set_args(k.get(), scratch.buffer, scratch.elem_offset(), cl_uint(predictor_fit_groups), st.buffer,
                 st.elem_offset(), cl_uint(c.kind == PredictorConfig::Kind::least_squares ? 1 : 0), c.beta, c.max_gain,
                 gd.buffer, gd.offset, gd.has, has_r);
    KernelLaunch l;
    l.kernel = std::move(k);
    l.global[0] = 1;
    l.local[0] = 1;
    list.push_back(std::move(l));
  }
  return list;
}

LaunchList predictor_apply(OpEnv& env, DeviceSpan w, DeviceSpan d, DeviceSpan st, std::size_t n, DeviceSpan guard,
                           DeviceSpan r) {
  const Guard gd = guard_of(guard, w);
  const cl_uint has_r = r.buffer != nullptr;
  const DeviceSpan rs = has_r ? r : d;
  cl::Kernel k = env.kernels.kernel("predictor", "predictor_apply");
  cl::set_args(k.get(), w.buffer, w.elem_offset(), d.buffer, d.elem_offset(), st.buffer, st.elem_offset(),
               element_count("predictor", n), gd.buffer, gd.offset, gd.has, 1.0f, rs.buffer, rs.elem_offset(), has_r);
  KernelLaunch l = elementwise_launch(std::move(k), n);
  l.per_step = [](cl_kernel kernel, const StepInfo& s) {
    cl::check(clSetKernelArg(kernel, 10, sizeof(float), &s.predict_scale), "clSetKernelArg(predictor_apply scale)");
  };
  LaunchList list;
  list.push_back(std::move(l));
  return list;
}

}  // namespace ferry::ops
