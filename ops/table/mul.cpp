// The row of the elementwise product (kernel and binding: ops/layout.hpp). Its backward rule
// multiplies the gradient by the other factor, with nodes of this row.
#include <fmt/format.h>

#include "ops/layout.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

OpInfo mul_row() {  // in: a b  out: y = a * b
  OpInfo r;
  r.name = "mul";
  r.infer = [](const ShapeView& v) {
    expect_inputs(v, 2, "mul");
    const TensorDesc a = v.input(0), b = v.input(1);
    if (!(a.shape == b.shape)) {
      shape_error(v,
                  fmt::format("mul takes two tensors of the same shape, got {} and {}", a.shape.str(), b.shape.str()));
    }
    if (a.dtype != b.dtype)
      shape_error(v, fmt::format("dtypes differ: {} and {}", dtype_name(a.dtype), dtype_name(b.dtype)));
    return std::vector<TensorDesc>{a};
  };
  r.bind = [](const BindContext& c) { return mul(c.env(), c.in(0), c.in(1), c.out(0), out_elems(c, 0)); };
  r.backward = [](GradContext& g) {
    const auto in = g.inputs();
    const TensorRef dy = g.grad(g.outputs()[0]);
    if (dy == no_ref) return;
    // da = dy * b, db = dy * a: each a node of this row, only for an input that needs it.
    const char* suffixes[] = {".grad_a", ".grad_b"};
    for (std::size_t i = 0; i < 2; ++i) {
      if (!g.needs_grad(in[i])) continue;
      const TensorRef d = g.new_grad(in[i]);
      const TensorRef ins[] = {dy, in[1 - i]};
      const TensorRef outs[] = {d};
      g.emit(builtin::mul, suffixes[i], ins, outs, {});
      g.contribute(in[i], d);
    }
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    ref::mul<double>(c.real(in[0]), c.real(in[1]), c.real(c.outputs()[0]));
  };
  return r;
}

}  // namespace

void register_mul_rows(const AddRow& add) {
  add(mul_row(), builtin::mul);
}

}  // namespace ferry::ops::table
