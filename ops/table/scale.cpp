// The row of scaling by a constant factor (FactorAttrs; kernel and binding: ops/layout.hpp). Its
// backward rule scales the gradient by the same factor.
#include <fmt/format.h>

#include <cmath>

#include "ops/attrs.hpp"
#include "ops/layout.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

OpInfo scale_row() {  // FactorAttrs   in: x  out: y = x * factor
  OpInfo r;
  r.name = "scale";
  r.infer = [](const ShapeView& v) {
    expect_inputs(v, 1, "scale");
    if (!std::isfinite(FactorAttrs::of(v.attrs()).factor))
      shape_error(v, fmt::format("scale factor must be finite, got {}", FactorAttrs::of(v.attrs()).factor));
    return std::vector<TensorDesc>{v.input(0)};
  };
  r.bind = [](const BindContext& c) {
    return scale(c.env(), c.in(0), c.out(0), FactorAttrs::of(c.attrs()).factor, out_elems(c, 0));
  };
  r.backward = [](GradContext& g) { unary_backward(g, builtin::scale); };
  r.reference = [](RefContext& c) {
    ref::scale<double>(c.real(c.inputs()[0]), double(FactorAttrs::of(c.attrs()).factor), c.real(c.outputs()[0]));
  };
  return r;
}

}  // namespace

void register_scale_rows(const AddRow& add) {
  add(scale_row(), builtin::scale);
}

}  // namespace ferry::ops::table
