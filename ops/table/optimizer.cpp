// Rows of the optimizer updates. In place: the outputs are the weight and state inputs. The
// optional last input is the step's loss statistics: the update skips itself when the loss is
// not finite. Each runs on the device, or on the host lane (TBB workers) for host-resident state
// (the host optimizer), in place on the one host copy or from the current copy into the next
// (hybrid phases). Each reports a weight it makes not finite to the step (step_status on the
// device, report_non_finite_weight on the host), which checks it after its last command.
#include <fmt/format.h>

#include <stdexcept>
#include <vector>

#include "ops/attrs.hpp"
#include "ops/optimizer_host.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

const float* floats(const std::byte* p) {
  return reinterpret_cast<const float*>(p);
}
float* floats(std::byte* p) {
  return reinterpret_cast<float*>(p);
}

// Input i of an update as its slice sees it: the weight, its gradient, and (SGD without momentum)
// the gradient as velocity start at the slice; state tensors are the slice's own size.
DeviceSpan sliced(const BindContext& c, std::size_t i, const UpdateSlice& s) {
  return in_elems(c, i) == in_elems(c, 0) ? c.in(i).advanced(s.first * sizeof(float)) : c.in(i);
}
const float* sliced(const HostContext& c, std::size_t i, const UpdateSlice& s) {
  return floats(c.in(i)) + (in_elems(c, i) == in_elems(c, 0) ? s.first : 0);
}
float* sliced_out(const HostContext& c, std::size_t i, const UpdateSlice& s) {
  return floats(c.out(i)) + (c.output(i).shape.elems() == in_elems(c, 0) ? s.first : 0);
}
// The gradient a host update reads: f32, or the narrow copy a mixed-precision step wrote back,
// which the update widens by UpdateAttrs::grad_scale's factor as it reads it.
HostGradient host_gradient(const HostContext& c, const UpdateSlice& s) {
  const DType type = c.input(1).dtype;
  const std::size_t first = in_elems(c, 1) == in_elems(c, 0) ? s.first : 0;
  if (type == DType::f32) return floats(c.in(1)) + first;
  return {c.in(1) + first * dtype_bytes(type), type, cast_factor(UpdateAttrs::of(c.attrs()).grad_scale, c.step())};
}
// Updates read narrow gradients on the host lane only; the device kernels take f32.
void check_device_gradient(const BindContext& c) {
  if (c.input(1).dtype != DType::f32) {
    throw std::logic_error(
        fmt::format("{}: the device update takes an f32 gradient, not {} (narrow gradients are "
                    "read by host updates only)",
                    c.name(), dtype_name(c.input(1).dtype)));
  }
}
// The optimizer's settings for this update: no weight decay for a weight the configuration
// exempts (OptimizerConfig::decay_on, marked by the optimizer pass in UpdateAttrs).
template <class Context>
OptimizerConfig update_config(Context& c) {
  OptimizerConfig o = c.optimizer();
  if (UpdateAttrs::of(c.attrs()).no_weight_decay) {
    o.sgd.weight_decay = 0.0f;
    o.adam.weight_decay = 0.0f;
  }
  return o;
}
std::span<double> sliced(RefContext& c, TensorRef t, const ShapeView& v, const UpdateSlice& s) {
  auto all = c.real(t);
  return all.size() == in_elems(v, 0) ? all.subspan(s.first, s.count) : all;
}
// The gradient as the reference's update reads it: a narrow copy's values times its widening
// factor (UpdateAttrs::grad_scale), in float as the host update computes them, in `widened`.
std::span<double> ref_gradient(RefContext& c, const UpdateSlice& s, std::vector<double>& widened) {
  const std::span<double> g = sliced(c, c.inputs()[1], c, s);
  if (c.input(1).dtype == DType::f32) return g;
  const float factor = cast_factor(UpdateAttrs::of(c.attrs()).grad_scale, c.step());
  widened.resize(g.size());
  for (std::size_t i = 0; i < g.size(); ++i) widened[i] = static_cast<float>(g[i]) * factor;
  return widened;
}

OpInfo sgd_row() {  // in: w g v [loss]  out: w v
  OpInfo r;
  r.name = "sgd_update";
  r.op_class = OpClass::update;
  r.float_dtypes = {DType::f32, DType::f16, DType::bf16};  // f16 and bf16: a host update's gradient
  // Without momentum the velocity is the gradient itself, which dies at this update: its buffer
  // serves rather than a state tensor kept (and, when streaming, moved).
  r.optimizer_state = [](const OptimizerConfig& o, std::size_t) {
    return std::vector<OptimizerStateDecl>{{.suffix = ".momentum", .is_gradient = o.sgd.momentum == 0.0f}};
  };
  r.bind = [](const BindContext& c) {
    check_device_gradient(c);
    const UpdateSlice s = update_slice(c);
    return sgd_update(c.env(), update_config(c).sgd, sliced(c, 0, s), sliced(c, 1, s), sliced(c, 2, s), s.count,
                      c.input_count() > 3 ? c.in(3) : DeviceSpan{}, c.step_status());
  };
  r.host = [](const HostContext& c) {
    const UpdateSlice s = update_slice(c);
    if (!host_sgd_update(update_config(c).sgd, c.step(), host_gradient(c, s),
                         {sliced(c, 0, s), sliced(c, 2, s), sliced_out(c, 0, s), sliced_out(c, 1, s)}, s.count))
      c.report_non_finite_weight();
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    const UpdateSlice s = update_slice(c);
    std::vector<double> widened;
    ref::sgd_update<double>(update_config(c).sgd, c.step(), sliced(c, in[0], c, s), ref_gradient(c, s, widened),
                            sliced(c, in[2], c, s));
  };
  return r;
}

OpInfo adam_row() {  // in: w g m v [loss]  out: w m v
  OpInfo r;
  r.name = "adam_update";
  r.op_class = OpClass::update;
  r.float_dtypes = {DType::f32, DType::f16, DType::bf16};  // f16 and bf16: a host update's gradient
  r.optimizer_state = [](const OptimizerConfig&, std::size_t) {
    return std::vector<OptimizerStateDecl>{{.suffix = ".adam_m"}, {.suffix = ".adam_v"}};
  };
  r.bind = [](const BindContext& c) {
    check_device_gradient(c);
    const UpdateSlice s = update_slice(c);
    return adam_update(c.env(), update_config(c).adam_config(), sliced(c, 0, s), sliced(c, 1, s), c.in(2), c.in(3),
                       s.count, c.input_count() > 4 ? c.in(4) : DeviceSpan{}, c.step_status());
  };
  r.host = [](const HostContext& c) {
    const UpdateSlice s = update_slice(c);
    if (!host_adam_update(update_config(c).adam_config(), c.step(), host_gradient(c, s),
                          {sliced(c, 0, s), floats(c.in(2)), floats(c.in(3)), sliced_out(c, 0, s), floats(c.out(1)),
                           floats(c.out(2))},
                          s.count))
      c.report_non_finite_weight();
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    const UpdateSlice s = update_slice(c);
    std::vector<double> widened;
    ref::adam_update<double>(update_config(c).adam_config(), c.step(), sliced(c, in[0], c, s),
                             ref_gradient(c, s, widened), c.real(in[2]), c.real(in[3]));
  };
  return r;
}

// 8-bit block-wise Adam/AdamW, UpdateAttrs::block8bit the block size: its state is codes and scales.
OpInfo adam8bit_row() {  // in: w g m(u8) v(u8) scales(f32 [2, blocks]) [loss]  out: w m v scales
  OpInfo r;
  r.name = "adam8bit_update";
  r.op_class = OpClass::update;
  r.float_dtypes = {DType::f32, DType::f16, DType::bf16};  // f16 and bf16: a host update's gradient
  // 8-bit moments (u8 codes) and their block scales [2, blocks]; zero scales make every code 0.
  r.optimizer_state = [](const OptimizerConfig& o, std::size_t elems) {
    check_adam8bit_block(o.block8bit);
    const auto blocks = static_cast<std::uint32_t>(adam8bit_blocks(elems, o.block8bit));
    return std::vector<OptimizerStateDecl>{{.suffix = ".adam8_m", .dtype = DType::u8},
                                           {.suffix = ".adam8_v", .dtype = DType::u8},
                                           {.suffix = ".adam8_scales", .shape = Shape{2, blocks}}};
  };
  r.update_bound = UpdateBound::quantization;
  r.update_attrs = [](const OptimizerConfig& o) {
    return UpdateAttrs{.block8bit = static_cast<std::int32_t>(o.block8bit)}.pack();
  };
  r.bind = [](const BindContext& c) {
    check_device_gradient(c);
    const UpdateSlice s = update_slice(c);
    return adam8bit_update(c.env(), update_config(c).adam_config(),
                           static_cast<std::uint32_t>(UpdateAttrs::of(c.attrs()).block8bit), sliced(c, 0, s),
                           sliced(c, 1, s), c.in(2), c.in(3), c.in(4), s.count,
                           c.input_count() > 5 ? c.in(5) : DeviceSpan{}, 0, c.step_status());
  };
  r.host = [](const HostContext& c) {
    const UpdateSlice s = update_slice(c);
    const auto codes = [](const std::byte* p) { return reinterpret_cast<const std::uint8_t*>(p); };
    const auto codes_out = [](std::byte* p) { return reinterpret_cast<std::uint8_t*>(p); };
    if (!host_adam8bit_update(update_config(c).adam_config(),
                              static_cast<std::uint32_t>(UpdateAttrs::of(c.attrs()).block8bit), c.step(),
                              host_gradient(c, s),
                              {sliced(c, 0, s), codes(c.in(2)), codes(c.in(3)), floats(c.in(4)), sliced_out(c, 0, s),
                               codes_out(c.out(1)), codes_out(c.out(2)), floats(c.out(3))},
                              s.count))
      c.report_non_finite_weight();
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    const UpdateSlice s = update_slice(c);
    std::vector<double> widened;
    ref::adam8bit_update<double>(
        update_config(c).adam_config(), static_cast<std::uint32_t>(UpdateAttrs::of(c.attrs()).block8bit), c.step(),
        sliced(c, in[0], c, s), ref_gradient(c, s, widened), c.real(in[2]), c.real(in[3]), c.real(in[4]));
  };
  return r;
}

// Adjacent whole-tensor Adam updates in one launch (graph::group_updates makes these nodes from
// adam_update nodes; the optimizer pass never does): in: (w g m v) x k [guard]  out: (w m v) x k.
OpInfo adam_group_row() {
  OpInfo r;
  r.name = "adam_update_group";
  r.op_class = OpClass::update;
  r.bind = [](const BindContext& c) {
    const std::size_t k = c.input_count() / 4;
    std::vector<AdamSlot> slots(k);
    for (std::size_t i = 0; i < k; ++i) {
      slots[i] = {c.in(4 * i), c.in(4 * i + 1), c.in(4 * i + 2), c.in(4 * i + 3), in_elems(c, 4 * i)};
    }
    return adam_update_group(c.env(), update_config(c).adam_config(), slots,
                             c.input_count() % 4 == 1 ? c.in(c.input_count() - 1) : DeviceSpan{}, c.step_status());
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    for (std::size_t i = 0; i + 3 < in.size(); i += 4) {
      ref::adam_update<double>(update_config(c).adam_config(), c.step(), c.real(in[i]), c.real(in[i + 1]),
                               c.real(in[i + 2]), c.real(in[i + 3]));
    }
  };
  return r;
}

}  // namespace

UpdateSlice update_slice(const ShapeView& c) {
  const std::size_t elems = in_elems(c, 0);
  const UpdateAttrs at = UpdateAttrs::of(c.attrs());
  const auto first = static_cast<std::size_t>(at.share_first);
  const auto count = static_cast<std::size_t>(at.share_count);
  if (count == 0) return {0, elems};
  if (at.share_first < 0 || at.share_count < 0 || first + count > elems) {
    shape_error(c, fmt::format("an update of elements {}..{} of a weight of {}", first, first + count, elems));
  }
  return {first, count};
}

void register_optimizer_rows(const AddRow& add) {
  add(sgd_row(), builtin::sgd_update);
  add(adam_row(), builtin::adam_update);
}

void register_optimizer8bit_rows(const AddRow& add) {
  add(adam8bit_row(), builtin::adam8bit_update);
}

void register_optimizer_group_rows(const AddRow& add) {
  add(adam_group_row(), builtin::adam_update_group);
}

}  // namespace ferry::ops::table
