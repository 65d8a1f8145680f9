// Rows of the pointwise activations (ActivationAttrs: which one) and their gradient.
#include "ferry/ops/activation.hpp"

#include <fmt/format.h>

#include "ops/attrs.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

Activation kind_of(const NodeAttrs& a) {
  return ActivationAttrs::of(a).kind;
}

OpInfo activation_row() {
  OpInfo r;
  r.name = "activation";
  r.float_dtypes = activation_dtypes;
  r.computes_narrow = true;
  r.is_relu = [](const NodeAttrs& a) { return kind_of(a) == Activation::relu; };
  r.infer = [](const ShapeView& v) {
    const Activation k = kind_of(v.attrs());
    if (k != Activation::relu && k != Activation::gelu) {
      shape_error(v, fmt::format("unknown activation {}", static_cast<int>(k)));
    }
    return std::vector<TensorDesc>{v.input(0)};
  };
  r.bind = [](const BindContext& c) {
    return activation_forward(c.env(), kind_of(c.attrs()), c.in(0), c.out(0), in_elems(c, 0), c.input(0).dtype);
  };
  r.backward = [](GradContext& g) { unary_backward(g, builtin::activation_grad, g.inputs()[0]); };
  r.reference = [](RefContext& c) {
    ref::activation_forward<double>(kind_of(c.attrs()), c.real(c.inputs()[0]), c.real(c.outputs()[0]));
  };
  return r;
}

OpInfo activation_grad_row() {  // in: x dy  out: dx
  OpInfo r;
  r.name = "activation_grad";
  r.float_dtypes = activation_dtypes;
  r.op_class = OpClass::backward;
  r.bind = [](const BindContext& c) {
    return activation_backward(c.env(), kind_of(c.attrs()), c.in(0), c.in(1), c.out(0), in_elems(c, 0),
                               c.input(0).dtype);
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    ref::activation_backward<double>(kind_of(c.attrs()), c.real(in[0]), c.real(in[1]), c.real(c.outputs()[0]));
  };
  return r;
}

}  // namespace

void register_activation_rows(const AddRow& add) {
  add(activation_row(), builtin::activation);
  add(activation_grad_row(), builtin::activation_grad);
}

}  // namespace ferry::ops::table
