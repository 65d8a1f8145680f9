// The row of the elementwise sum of two tensors of one shape and dtype.
#include <fmt/format.h>

#include "ops/elementwise.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

OpInfo add_row() {
  OpInfo r;
  r.name = "add";
  r.infer = [](const ShapeView& v) {
    const TensorDesc a = v.input(0), b = v.input(1);
    if (!(a.shape == b.shape)) shape_error(v, fmt::format("shapes differ: {} and {}", a.shape.str(), b.shape.str()));
    if (a.dtype != b.dtype)
      shape_error(v, fmt::format("dtypes differ: {} and {}", dtype_name(a.dtype), dtype_name(b.dtype)));
    return std::vector<TensorDesc>{a};
  };
  r.float_dtypes = add_dtypes;
  r.bind = [](const BindContext& c) {
    return add(c.env(), c.in(0), c.in(1), c.out(0), out_elems(c, 0), c.output(0).dtype);
  };
  // Both inputs receive the output's gradient: no node needed. (Autodiff also uses this row to
  // sum the contributions to a tensor used more than once.)
  r.backward = [](GradContext& g) {
    const TensorRef dy = g.grad(g.outputs()[0]);
    if (dy == no_ref) return;
    g.contribute(g.inputs()[0], dy);
    g.contribute(g.inputs()[1], dy);
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    ref::add<double>(c.real(in[0]), c.real(in[1]), c.real(c.outputs()[0]));
  };
  return r;
}

}  // namespace

void register_add_row(const AddRow& add) {
  add(add_row(), builtin::add);
}

}  // namespace ferry::ops::table
