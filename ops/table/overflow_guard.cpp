// The row of the overflow guard (ops/overflow_guard.hpp), class `state_update`, so that it is
// placed with the updates that read it.
//
//   overflow_guard  in: stats g1 .. gk  out: guard [1] (f32)
#include "ferry/ops/overflow_guard.hpp"

#include <vector>

#include "rows.hpp"

namespace ferry::ops::table {
namespace {

OpInfo overflow_guard_row() {
  OpInfo r;
  r.name = "overflow_guard";
  r.op_class = OpClass::state_update;
  r.bind = [](const BindContext& c) {
    std::vector<DeviceSpan> grads;
    std::vector<std::size_t> elems;
    for (std::size_t i = 1; i < c.input_count(); ++i) {
      grads.push_back(c.in(i));
      elems.push_back(in_elems(c, i));
    }
    return overflow_guard(c.env(), c.in(0), grads, elems, c.out(0));
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    std::vector<std::span<const double>> grads;
    for (std::size_t i = 1; i < in.size(); ++i) grads.emplace_back(c.real(in[i]));
    c.real(c.outputs()[0])[0] = ref::overflow_guard<double>(c.real(in[0])[0], grads);
  };
  return r;
}

}  // namespace

void register_overflow_guard_row(const AddNamedRow& add) {
  add(overflow_guard_row());
}

}  // namespace ferry::ops::table
