// Binding of the optimizer kernels (ops/kernels/optimizer.cl). Per-step scalars (learning rate,
// Adam bias corrections) are set by KernelLaunch::per_step just before each enqueue.
#include "ferry/ops/optimizer.hpp"

#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <limits>
#include <stdexcept>

#include "ferry/cl/error.hpp"
#include "ops/kernels/optimizer_group.clh"

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

const char* decay_on_name(OptimizerConfig::DecayOn d) {
  return d == OptimizerConfig::DecayOn::matrices ? "matrices" : "all";
}

void validate(const OptimizerConfig& c) {
  auto fail = [&](const char* what, float v, const char* range) {
    throw std::invalid_argument(
        fmt::format("optimizer {}: {} = {}: it must be {}", optimizer_name(c.kind), what, v, range));
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

static_assert(adam_group_slots == GROUP_SLOTS,
              "ops::adam_group_slots is the kernel's GROUP_SLOTS (optimizer_group.clh)");

LaunchList adam_update_group(OpEnv& env, const AdamConfig& c, std::span<const AdamSlot> slots, DeviceSpan guard,
                             DeviceSpan status) {
  if (slots.empty() || slots.size() > adam_group_slots) {
    throw std::invalid_argument(
        fmt::format("adam_update_group: {} parameters, expected 1 to {}", slots.size(), adam_group_slots));
  }
  const bool cpu = env.device().is_cpu();
  cl::Kernel k = env.kernels.kernel("optimizer", cpu ? "adam_update_group16" : "adam_update_group");
  // Slot s's work-items start at first[s]; the slots past the group's last take slot 0's buffers,
  // no parameters and the launch's end as their first item, so no work-item falls in them.
  cl_ulong8 w_offs{}, g_offs{}, m_offs{}, v_offs{};
  cl_uint8 ns{}, firsts{};
  std::size_t items = 0;
  for (std::size_t s = 0; s < adam_group_slots; ++s) {
    const AdamSlot& x = slots[s < slots.size() ? s : 0];
    const cl_uint args = 4 * static_cast<cl_uint>(s);
    FERRY_CL(clSetKernelArg(k.get(), args, sizeof(cl_mem), &x.w.buffer));
    FERRY_CL(clSetKernelArg(k.get(), args + 1, sizeof(cl_mem), &x.g.buffer));
    FERRY_CL(clSetKernelArg(k.get(), args + 2, sizeof(cl_mem), &x.m.buffer));
    FERRY_CL(clSetKernelArg(k.get(), args + 3, sizeof(cl_mem), &x.v.buffer));
    w_offs.s[s] = x.w.elem_offset();
    g_offs.s[s] = x.g.elem_offset();
    m_offs.s[s] = x.m.elem_offset();
    v_offs.s[s] = x.v.elem_offset();
    if (s < slots.size()) {
      ns.s[s] = checked_count(x.n);
      firsts.s[s] = checked_count(items);
      items += cpu ? (x.n + GROUP_CHUNK - 1) / GROUP_CHUNK : x.n;
    }
  }
  for (std::size_t s = slots.size(); s < adam_group_slots; ++s) firsts.s[s] = checked_count(items);
  const float l2 = c.decoupled_weight_decay ? 0.0f : c.weight_decay;
  const float decoupled = c.decoupled_weight_decay ? c.weight_decay : 0.0f;
  const cl_uint first_arg = 4 * adam_group_slots;
  const cl_uint has_guard = guard.buffer ? 1 : 0, has_status = status.buffer ? 1 : 0;
  const cl_mem guard_mem = guard.buffer ? guard.buffer : slots[0].w.buffer;
  const cl_mem status_mem = status.buffer ? status.buffer : slots[0].w.buffer;
  const cl_ulong guard_off = guard.elem_offset(), status_off = status.elem_offset();
  const float zero = 0.0f, one = 1.0f;
  const auto set = [&](cl_uint i, std::size_t size, const void* value) {
    FERRY_CL(clSetKernelArg(k.get(), first_arg + i, size, value));
  };
  set(0, sizeof w_offs, &w_offs);
  set(1, sizeof g_offs, &g_offs);
  set(2, sizeof m_offs, &m_offs);
  set(3, sizeof v_offs, &v_offs);
  set(4, sizeof ns, &ns);
  set(5, sizeof firsts, &firsts);
  set(6, sizeof(float), &c.beta1);
  set(7, sizeof(float), &c.beta2);
  set(8, sizeof(float), &c.eps);
  set(9, sizeof(float), &l2);
  set(10, sizeof(float), &decoupled);
  set(11, sizeof(float), &zero);  // lr, inv_bc1, inv_bc2: per step
  set(12, sizeof(float), &one);
  set(13, sizeof(float), &one);
  set(14, sizeof(cl_mem), &guard_mem);
  set(15, sizeof(cl_ulong), &guard_off);
  set(16, sizeof(cl_uint), &has_guard);
  set(17, sizeof(cl_mem), &status_mem);
  set(18, sizeof(cl_ulong), &status_off);
  set(19, sizeof(cl_uint), &has_status);
  KernelLaunch l = elementwise_launch(std::move(k), items);
  l.per_step = adam_step_args("adam_update_group", c, first_arg + 11);
  LaunchList list;
  list.push_back(std::move(l));
  return list;
}

}  // namespace ferry::ops
