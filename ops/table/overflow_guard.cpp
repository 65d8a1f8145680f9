// The rows of the overflow guard (ops/overflow_guard.hpp), class `state_update`, so that they are
// placed with the updates that read the guard.
//
//   overflow_guard_init   in: stats        out: guard [1] (f32)
//   overflow_guard_check  in: guard g      out: guard (in place); also on the host lane, where a
//                         reduced gradient in pinned host memory is checked into the host copy of
//                         the guard that the ranks' agreement sums (graph/residency.cpp)
#include "ops/overflow_guard.hpp"

#include <fmt/format.h>

#include <cstring>
#include <stdexcept>

#include "ops/attrs.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

OpInfo init_row() {
  OpInfo r;
  r.name = "overflow_guard_init";
  r.op_class = OpClass::state_update;
  r.bind = [](const BindContext& c) { return overflow_guard_init(c.env(), c.in(0), c.out(0)); };
  r.reference = [](RefContext& c) { c.real(c.outputs()[0])[0] = c.real(c.inputs()[0])[0]; };
  return r;
}

// An f16 or bf16 gradient is checked as its widening cast would make it: CastAttrs' scale (the
// check's attrs; none, all zeros, for an f32 gradient) gives the factor.
OpInfo check_row() {
  OpInfo r;
  r.name = "overflow_guard_check";
  r.op_class = OpClass::state_update;
  r.float_dtypes = {DType::f32, DType::f16, DType::bf16};
  r.bind = [](const BindContext& c) {
    const DType type = c.input(1).dtype;
    if (type != DType::f32) {
      return overflow_guard_check_scaled(c.env(), type, c.in(1), in_elems(c, 1), CastAttrs::of(c.attrs()).scale,
                                         c.out(0));
    }
    return overflow_guard_check(c.env(), c.in(1), in_elems(c, 1), c.out(0));
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    auto guard = c.real(c.outputs()[0]);
    const float factor = cast_factor(CastAttrs::of(c.attrs()).scale, c.step());
    guard[0] = c.input(1).dtype == DType::f32
                   ? ref::overflow_guard_check<double>(c.real(in[0])[0], c.real(in[1]))
                   : ref::overflow_guard_check_scaled<double>(c.real(in[0])[0], c.real(in[1]), factor);
  };
  r.host = [](const HostContext& c) {
    if (c.input(1).dtype != DType::f32) {
      throw std::logic_error(fmt::format("{}: the host check takes an f32 gradient", c.name()));
    }
    float guard = 0.0f;
    std::memcpy(&guard, c.in(0), sizeof guard);
    if (!all_usable_host({reinterpret_cast<const float*>(c.in(1)), in_elems(c, 1)})) {
      guard = std::numeric_limits<float>::quiet_NaN();
    }
    std::memcpy(c.out(0), &guard, sizeof guard);
  };
  return r;
}

}  // namespace

void register_overflow_guard_rows(const AddRow& add) {
  add(init_row(), builtin::overflow_guard_init);
  add(check_row(), builtin::overflow_guard_check);
}

}  // namespace ferry::ops::table
