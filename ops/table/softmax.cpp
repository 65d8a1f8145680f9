// Rows of softmax over the last axis (optionally causal: the masked scores of attention).
//
//   softmax        y = softmax(x) over the last axis      in: x       out: y
//                  SoftmaxAttrs::causal: (square [..., T, T] scores, entries past the diagonal masked)
//   softmax_grad   dx = y (dy - sum(dy y, last axis))     in: y dy    out: dx
#include "ops/softmax.hpp"

#include <fmt/format.h>

#include "ops/attrs.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

// [rows, cols] of a tensor seen as rows of its last axis.
std::pair<std::size_t, std::size_t> rows_cols(const Shape& s) {
  const std::size_t cols = s[s.rank - 1];
  return {cols == 0 ? 0 : s.elems() / cols, cols};
}

OpInfo softmax_row(OpId grad) {  // in: x  out: y
  OpInfo r;
  r.name = "softmax";
  r.infer = [](const ShapeView& v) {
    if (v.input_count() != 1) shape_error(v, fmt::format("softmax takes one input, got {}", v.input_count()));
    const Shape x = v.input(0).shape;
    if (x.rank == 0 || x[x.rank - 1] == 0) {
      shape_error(v, fmt::format("input has shape {}; softmax needs a non-empty last axis", x.str()));
    }
    if (SoftmaxAttrs::of(v.attrs()).causal && (x.rank < 2 || x[x.rank - 1] != x[x.rank - 2])) {
      shape_error(v, fmt::format("causal softmax takes square [..., T, T] scores, got {}", x.str()));
    }
    return std::vector<TensorDesc>{{x, v.input(0).dtype}};
  };
  r.bind = [](const BindContext& c) {
    const auto [rows, cols] = rows_cols(c.input(0).shape);
    return softmax_forward(c.env(), c.in(0), c.out(0), rows, cols, SoftmaxAttrs::of(c.attrs()).causal);
  };
  r.backward = [grad](GradContext& g) { unary_backward(g, grad, g.outputs()[0]); };  // (y, dy) -> dx
  r.reference = [](RefContext& c) {
    const auto [rows, cols] = rows_cols(c.input(0).shape);
    ref::softmax_forward<double>(c.real(c.inputs()[0]), c.real(c.outputs()[0]), rows, cols,
                                 SoftmaxAttrs::of(c.attrs()).causal);
  };
  return r;
}

OpInfo softmax_grad_row() {  // in: y dy  out: dx
  OpInfo r;
  r.name = "softmax_grad";
  r.op_class = OpClass::backward;
  r.bind = [](const BindContext& c) {
    const auto [rows, cols] = rows_cols(c.input(0).shape);
    return softmax_backward(c.env(), c.in(0), c.in(1), c.out(0), rows, cols);
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    const auto [rows, cols] = rows_cols(c.input(0).shape);
    ref::softmax_backward<double>(c.real(in[0]), c.real(in[1]), c.real(c.outputs()[0]), rows, cols);
  };
  return r;
}

}  // namespace

void register_softmax_rows(const AddRow& add) {
  add(softmax_row(builtin::softmax_grad), builtin::softmax);
  add(softmax_grad_row(), builtin::softmax_grad);
}

}  // namespace ferry::ops::table
