// Rows of the optimizer updates. In place: the outputs are the weight and state inputs. The
// optional last input is the step's loss statistics: the update skips itself when the loss is
// not finite. Each runs on the device, or on the host lane (TBB workers) for host-resident
// state, where it reads the current copy and writes the next. adam8bit_update (a named row) runs
// on the device only. Each reports a weight it makes not finite to the step (step_status on the
// device, report_non_finite_weight on the host), which checks it after its last command.
#include "ferry/ops/optimizer_host.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

const float* floats(const std::byte* p) {
  return reinterpret_cast<const float*>(p);
}
float* floats(std::byte* p) {
  return reinterpret_cast<float*>(p);
}

OpInfo sgd_row() {  // in: w g v [loss]  out: w v
  OpInfo r;
  r.name = "sgd_update";
  r.op_class = OpClass::update;
  r.bind = [](const BindContext& c) {
    return sgd_update(c.env(), c.optimizer().sgd, c.in(0), c.in(1), c.in(2), in_elems(c, 0),
                      c.input_count() > 3 ? c.in(3) : DeviceSpan{}, c.step_status());
  };
  r.host = [](const HostContext& c) {
    if (!host_sgd_update(c.optimizer().sgd, c.step(), floats(c.in(1)),
                         {floats(c.in(0)), floats(c.in(2)), floats(c.out(0)), floats(c.out(1))}, in_elems(c, 0)))
      c.report_non_finite_weight();
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    ref::sgd_update<double>(c.optimizer().sgd, c.step(), c.real(in[0]), c.real(in[1]), c.real(in[2]));
  };
  return r;
}

OpInfo adam_row() {  // in: w g m v [loss]  out: w m v
  OpInfo r;
  r.name = "adam_update";
  r.op_class = OpClass::update;
  r.bind = [](const BindContext& c) {
    return adam_update(c.env(), c.optimizer().adam_config(), c.in(0), c.in(1), c.in(2), c.in(3), in_elems(c, 0),
                       c.input_count() > 4 ? c.in(4) : DeviceSpan{}, c.step_status());
  };
  r.host = [](const HostContext& c) {
    if (!host_adam_update(
            c.optimizer().adam_config(), c.step(), floats(c.in(1)),
            {floats(c.in(0)), floats(c.in(2)), floats(c.in(3)), floats(c.out(0)), floats(c.out(1)), floats(c.out(2))},
            in_elems(c, 0)))
      c.report_non_finite_weight();
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    ref::adam_update<double>(c.optimizer().adam_config(), c.step(), c.real(in[0]), c.real(in[1]), c.real(in[2]),
                             c.real(in[3]));
  };
  return r;
}

// 8-bit block-wise Adam/AdamW, attrs.i[0] = the block size. No host version: its state is codes
// and scales, which only the kernel (and the reference) read.
OpInfo adam8bit_row() {  // in: w g m(u8) v(u8) scales(f32 [2, blocks]) [loss]  out: w m v scales
  OpInfo r;
  r.name = "adam8bit_update";
  r.op_class = OpClass::update;
  r.bind = [](const BindContext& c) {
    return adam8bit_update(c.env(), c.optimizer().adam_config(), static_cast<std::uint32_t>(c.attrs().i[0]), c.in(0),
                           c.in(1), c.in(2), c.in(3), c.in(4), in_elems(c, 0),
                           c.input_count() > 5 ? c.in(5) : DeviceSpan{}, 0, c.step_status());
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    ref::adam8bit_update<double>(c.optimizer().adam_config(), static_cast<std::uint32_t>(c.attrs().i[0]), c.step(),
                                 c.real(in[0]), c.real(in[1]), c.real(in[2]), c.real(in[3]), c.real(in[4]));
  };
  return r;
}

}  // namespace

void register_optimizer_rows(const AddRow& add) {
  add(sgd_row(), builtin::sgd_update);
  add(adam_row(), builtin::adam_update);
}

void register_optimizer8bit_rows(const AddNamedRow& add) {
  add(adam8bit_row());
}

}  // namespace ferry::ops::table
