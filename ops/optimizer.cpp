// Binding of the optimizer kernels (ops/kernels/optimizer.cl). Per-step scalars (learning rate,
// Adam bias corrections) are set by KernelLaunch::per_step just before each enqueue.
#include "ferry/ops/optimizer.hpp"

#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <limits>
#include <stdexcept>

#include "ferry/cl/error.hpp"

namespace ferry::ops {

const char* optimizer_name(OptimizerConfig::Kind k) {
  switch (k) {
    case OptimizerConfig::Kind::sgd:
      return "sgd";
    case OptimizerConfig::Kind::adam:
      return "adam";
    case OptimizerConfig::Kind::adamw:
      return "adamw";
    case OptimizerConfig::Kind::adamw8bit:
      return "adamw8bit";
  }
  return "?";
}

void validate(const OptimizerConfig& c) {
  auto fail = [&](const char* what, float v, const char* range) {
    throw std::invalid_argument(fmt::format("{} {} {} = {}: it must be {}", optimizer_name(c.kind),
                                            c.kind == OptimizerConfig::Kind::sgd ? "SGD" : "Adam", what, v, range));
  };
  if (c.kind == OptimizerConfig::Kind::sgd) {
    if (!(c.sgd.momentum >= 0.0f && c.sgd.momentum < 1.0f)) fail("momentum", c.sgd.momentum, "in [0, 1)");
    if (!(c.sgd.weight_decay >= 0.0f && std::isfinite(c.sgd.weight_decay)))
      fail("weight decay", c.sgd.weight_decay, "a finite number >= 0");
    return;
  }
  if (!(c.adam.beta1 >= 0.0f && c.adam.beta1 < 1.0f)) fail("beta1", c.adam.beta1, "in [0, 1)");
  if (!(c.adam.beta2 >= 0.0f && c.adam.beta2 < 1.0f)) fail("beta2", c.adam.beta2, "in [0, 1)");
  if (!(c.adam.eps > 0.0f && std::isfinite(c.adam.eps))) fail("eps", c.adam.eps, "a finite number > 0");
  if (!(c.adam.weight_decay >= 0.0f && std::isfinite(c.adam.weight_decay)))
    fail("weight decay", c.adam.weight_decay, "a finite number >= 0");
  if (c.kind == OptimizerConfig::Kind::adamw8bit) check_adam8bit_block(c.block8bit);
}

namespace {
cl_uint checked_count(std::size_t n) {
  if (n > std::numeric_limits<cl_uint>::max()) throw std::invalid_argument("optimizer: more than 2^32-1 parameters");
  return static_cast<cl_uint>(n);
}

constexpr cl_uint kSgdLrArg = 10;
constexpr cl_uint kAdamLrArg = 14;  // followed by inv_bc1, inv_bc2

// The update kernel `name` for this device and the work-items that cover n parameters: on CPU
// devices its 16-wide twin (`name`16, 16 parameters per work-item as one float16), elsewhere one
// work-item per parameter.
struct UpdateKernel {
  cl::Kernel kernel;
  std::size_t items;
};
UpdateKernel update_kernel(OpEnv& env, const char* name, std::size_t n) {
  if (!env.device().is_cpu()) return {env.kernels.kernel("optimizer", name), n};
  return {env.kernels.kernel("optimizer", fmt::format("{}16", name)), (n + 15) / 16};
}
}  // namespace

std::function<void(cl_kernel, const StepInfo&)> adam_step_args(const char* op, const AdamConfig& c, cl_uint lr_arg) {
  return [op, lr_arg, beta1 = double(c.beta1), beta2 = double(c.beta2)](cl_kernel kernel, const StepInfo& s) {
    if (s.step == 0) throw std::invalid_argument(fmt::format("{}: StepInfo::step is 1-based, got 0", op));
    const double t = static_cast<double>(s.step);
    const float inv_bc1 = static_cast<float>(1.0 / (1.0 - std::pow(beta1, t)));
    const float inv_bc2 = static_cast<float>(1.0 / (1.0 - std::pow(beta2, t)));
    FERRY_CL(clSetKernelArg(kernel, lr_arg, sizeof(float), &s.lr));
    FERRY_CL(clSetKernelArg(kernel, lr_arg + 1, sizeof(float), &inv_bc1));
    FERRY_CL(clSetKernelArg(kernel, lr_arg + 2, sizeof(float), &inv_bc2));
  };
}

LaunchList sgd_update(OpEnv& env, const SgdConfig& c, DeviceSpan w, DeviceSpan g, DeviceSpan velocity, std::size_t n,
                      DeviceSpan guard, DeviceSpan status) {
  UpdateKernel k = update_kernel(env, "sgd_update", n);
  cl::set_args(k.kernel.get(), w.buffer, w.elem_offset(), g.buffer, g.elem_offset(), velocity.buffer,
               velocity.elem_offset(), checked_count(n), c.momentum, c.weight_decay, cl_uint(c.nesterov ? 1 : 0), 0.0f,
               guard.buffer ? guard.buffer : w.buffer, guard.elem_offset(), cl_uint(guard.buffer ? 1 : 0),
               status.buffer ? status.buffer : w.buffer, status.elem_offset(), cl_uint(status.buffer ? 1 : 0));
  KernelLaunch l = elementwise_launch(std::move(k.kernel), k.items);
  l.per_step = [](cl_kernel kernel, const StepInfo& s) {
    FERRY_CL(clSetKernelArg(kernel, kSgdLrArg, sizeof(float), &s.lr));
  };
  LaunchList list;
  list.push_back(std::move(l));
  return list;
}

LaunchList adam_update(OpEnv& env, const AdamConfig& c, DeviceSpan w, DeviceSpan g, DeviceSpan m, DeviceSpan v,
                       std::size_t n, DeviceSpan guard, DeviceSpan status) {
  const float l2 = c.decoupled_weight_decay ? 0.0f : c.weight_decay;
  const float decoupled = c.decoupled_weight_decay ? c.weight_decay : 0.0f;
  UpdateKernel k = update_kernel(env, "adam_update", n);
  cl::set_args(k.kernel.get(), w.buffer, w.elem_offset(), g.buffer, g.elem_offset(), m.buffer, m.elem_offset(),
               v.buffer, v.elem_offset(), checked_count(n), c.beta1, c.beta2, c.eps, l2, decoupled, 0.0f, 1.0f, 1.0f,
               guard.buffer ? guard.buffer : w.buffer, guard.elem_offset(), cl_uint(guard.buffer ? 1 : 0),
               status.buffer ? status.buffer : w.buffer, status.elem_offset(), cl_uint(status.buffer ? 1 : 0));
  KernelLaunch l = elementwise_launch(std::move(k.kernel), k.items);
  l.per_step = adam_step_args("adam_update", c, kAdamLrArg);
  LaunchList list;
  list.push_back(std::move(l));
  return list;
}

}  // namespace ferry::ops
