// Rows of gradient accumulation (ops/accumulate.hpp), class `state_update`.
//
//   grad_accumulate  in: acc g [loss]  out: acc (in place)   acc = keep acc + g, keep per step
//   grad_mean        in: acc g         out: g (in place)     g = (acc + g) f0, f0 = 1 / k
#include "ops/accumulate.hpp"

#include <cmath>

#include "ops/attrs.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

OpInfo accumulate_row() {
  OpInfo r;
  r.name = "grad_accumulate";
  r.op_class = OpClass::state_update;
  r.bind = [](const BindContext& c) {
    return grad_accumulate(c.env(), c.in(0), c.in(1), in_elems(c, 0), c.input_count() > 2 ? c.in(2) : DeviceSpan{});
  };
  r.host = [](const HostContext& c) {  // the host optimizer's sums (graph::move_accumulation_to_host)
    grad_accumulate_host(reinterpret_cast<const float*>(c.in(0)), reinterpret_cast<const float*>(c.in(1)),
                         reinterpret_cast<float*>(c.out(0)), c.input(0).shape.elems(), c.step().accumulate_keep);
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    if (in.size() > 2 && !std::isfinite(c.real(in[2])[0])) return;
    auto acc = c.real(in[0]);
    if (c.step().accumulate_keep == 0.0f) std::fill(acc.begin(), acc.end(), 0.0);
    ref::grad_accumulate<double>(acc, c.real(in[1]), 1.0);
  };
  return r;
}

OpInfo mean_row() {
  OpInfo r;
  r.name = "grad_mean";
  r.op_class = OpClass::state_update;
  r.bind = [](const BindContext& c) {
    return grad_mean(c.env(), c.in(0), c.in(1), in_elems(c, 0), FactorAttrs::of(c.attrs()).factor);
  };
  r.host = [](const HostContext& c) {
    grad_mean_host(reinterpret_cast<const float*>(c.in(0)), reinterpret_cast<const float*>(c.in(1)),
                   reinterpret_cast<float*>(c.out(0)), c.input(0).shape.elems(), FactorAttrs::of(c.attrs()).factor);
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    ref::grad_mean<double>(c.real(in[0]), c.real(in[1]), FactorAttrs::of(c.attrs()).factor);
  };
  return r;
}

}  // namespace

void register_accumulate_rows(const AddRow& add) {
  add(accumulate_row(), builtin::grad_accumulate);
  add(mean_row(), builtin::grad_mean);
}

}  // namespace ferry::ops::table
