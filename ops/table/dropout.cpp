// The rows of dropout and its gradient (kernels and bindings: ops/sequence.hpp).
//
//   dropout          DropoutAttrs: p, seed      in: x     out: y
//   dropout_grad     attrs as dropout              in: dy    out: dx
#include <fmt/format.h>

#include <utility>

#include "ops/attrs.hpp"
#include "ops/sequence.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

float dropout_p(const NodeAttrs& a) {
  return DropoutAttrs::of(a).p;
}
std::uint32_t dropout_seed(const NodeAttrs& a) {
  return DropoutAttrs::of(a).seed;
}

OpInfo dropout_grad_row() {  // in: dy  out: dx
  OpInfo r;
  r.name = "dropout_grad";
  r.op_class = OpClass::backward;
  r.bind = [](const BindContext& c) {
    return dropout_backward(c.env(), c.in(0), c.out(0), in_elems(c, 0), dropout_p(c.attrs()), dropout_seed(c.attrs()));
  };
  r.reference = [](RefContext& c) {
    ref::dropout_backward<double>(c.real(c.inputs()[0]), c.real(c.outputs()[0]), dropout_p(c.attrs()),
                                  dropout_key(dropout_seed(c.attrs()), c.step()), c.step().step);
  };
  return r;
}

OpInfo dropout_row(OpId grad_op) {  // in: x  out: y
  OpInfo r;
  r.name = "dropout";
  r.infer = [](const ShapeView& v) {
    if (v.input_count() != 1) shape_error(v, fmt::format("dropout takes 1 input, got {}", v.input_count()));
    const float p = dropout_p(v.attrs());
    if (!(p >= 0.0f && p < 1.0f)) shape_error(v, fmt::format("dropout probability p must be in [0, 1), got {}", p));
    return std::vector<TensorDesc>{v.input(0)};
  };
  r.bind = [](const BindContext& c) {
    return dropout_forward(c.env(), c.in(0), c.out(0), in_elems(c, 0), dropout_p(c.attrs()), dropout_seed(c.attrs()));
  };
  r.backward = [grad_op](GradContext& g) { unary_backward(g, grad_op); };
  r.reference = [](RefContext& c) {
    ref::dropout_forward<double>(c.real(c.inputs()[0]), c.real(c.outputs()[0]), dropout_p(c.attrs()),
                                 dropout_key(dropout_seed(c.attrs()), c.step()), c.step().step);
  };
  return r;
}

}  // namespace

void register_dropout_rows(const AddRow& add) {
  add(dropout_row(builtin::dropout_grad), builtin::dropout);
  add(dropout_grad_row(), builtin::dropout_grad);
}

}  // namespace ferry::ops::table
