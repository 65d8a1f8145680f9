// Rows of the bias broadcast over the leading axes and of its bias gradient.
//
//   add_bias       in: x [..., trailing dims] b [trailing dims]   out: y = x + b
//   add_bias_grad  in: dy                                         out: db (dy summed over the leading axes)
//
// The gradient of x is dy itself: the backward rule contributes dy to x without a node.
#include "ops/add_bias.hpp"

#include <fmt/format.h>

#include "rows.hpp"

namespace ferry::ops::table {
namespace {

// x (or dy) as [rows, cols] with cols = b's (or db's) elements.
struct BiasDims {
  std::size_t rows, cols;
};
BiasDims bias_dims(std::size_t x_elems, std::size_t b_elems) {
  return {b_elems == 0 ? 0 : x_elems / b_elems, b_elems};
}

OpInfo add_bias_grad_row() {  // in: dy  out: db
  OpInfo r;
  r.name = "add_bias_grad";
  r.op_class = OpClass::backward;
  r.bind = [](const BindContext& c) {
    const BiasDims d = bias_dims(in_elems(c, 0), out_elems(c, 0));
    return add_bias_backward(c.env(), c.in(0), c.out(0), d.rows, d.cols);
  };
  r.reference = [](RefContext& c) {
    const BiasDims d = bias_dims(in_elems(c, 0), out_elems(c, 0));
    ref::add_bias_backward<double>(c.real(c.inputs()[0]), c.real(c.outputs()[0]), d.rows, d.cols);
  };
  return r;
}

OpInfo add_bias_row(OpId grad_op) {  // in: x b  out: y
  OpInfo r;
  r.name = "add_bias";
  r.infer = [](const ShapeView& v) {
    if (v.input_count() != 2) shape_error(v, fmt::format("add_bias takes 2 inputs (x, b), got {}", v.input_count()));
    const TensorDesc x = v.input(0), b = v.input(1);
    if (std::string e = add_bias_error(x.shape, b.shape); !e.empty()) shape_error(v, e);
    if (x.dtype != DType::f32 || b.dtype != DType::f32) {
      shape_error(v,
                  fmt::format("add_bias takes f32 x and b, got {} and {}", dtype_name(x.dtype), dtype_name(b.dtype)));
    }
    return std::vector<TensorDesc>{x};
  };
  r.bind = [](const BindContext& c) {
    const BiasDims d = bias_dims(in_elems(c, 0), in_elems(c, 1));
    return add_bias_forward(c.env(), c.in(0), c.in(1), c.out(0), d.rows, d.cols);
  };
  r.backward = [grad_op](GradContext& g) {
    const TensorRef x = g.inputs()[0], b = g.inputs()[1];
    const TensorRef dy = g.grad(g.outputs()[0]);
    if (dy == no_ref) return;
    g.contribute(x, dy);  // a no-op unless x needs a gradient
    if (!g.needs_grad(b)) return;
    const TensorRef db = g.new_grad(b);
    const TensorRef ins[] = {dy};
    const TensorRef outs[] = {db};
    g.emit(grad_op, ".grad_bias", ins, outs, g.attrs());
    g.contribute(b, db);
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    const BiasDims d = bias_dims(in_elems(c, 0), in_elems(c, 1));
    ref::add_bias_forward<double>(c.real(in[0]), c.real(in[1]), c.real(c.outputs()[0]), d.rows, d.cols);
  };
  return r;
}

}  // namespace

void register_add_bias_rows(const AddRow& add) {
  add(add_bias_row(builtin::add_bias_grad), builtin::add_bias);
  add(add_bias_grad_row(), builtin::add_bias_grad);
}

}  // namespace ferry::ops::table
