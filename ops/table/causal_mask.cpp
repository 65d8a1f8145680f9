// The rows of the causal mask and its gradient (kernels and bindings: ops/sequence.hpp).
//
//   causal_mask      in: x [..., T, T]                       out: y (j > i set to -inf)
//   causal_mask_grad in: dy                                  out: dx (j > i set to 0)
#include <fmt/format.h>

#include <utility>

#include "ops/attrs.hpp"
#include "ops/sequence.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

// [..., T, T] as (matrices, T).
std::pair<std::size_t, std::size_t> mask_dims(const Shape& s) {
  const std::size_t t = s[s.rank - 1u];
  return {t == 0 ? 0 : s.elems() / (t * t), t};
}

OpInfo causal_mask_grad_row() {  // in: dy  out: dx
  OpInfo r;
  r.name = "causal_mask_grad";
  r.op_class = OpClass::backward;
  r.bind = [](const BindContext& c) {
    const auto [m, t] = mask_dims(c.input(0).shape);
    return causal_mask_backward(c.env(), c.in(0), c.out(0), m, t);
  };
  r.reference = [](RefContext& c) {
    ref::causal_mask_backward<double>(c.real(c.inputs()[0]), c.real(c.outputs()[0]),
                                      c.input(0).shape[c.input(0).shape.rank - 1u]);
  };
  return r;
}

OpInfo causal_mask_row(OpId grad_op) {  // in: x  out: y
  OpInfo r;
  r.name = "causal_mask";
  r.infer = [](const ShapeView& v) {
    if (v.input_count() != 1) shape_error(v, fmt::format("causal_mask takes 1 input, got {}", v.input_count()));
    const Shape s = v.input(0).shape;
    if (s.rank < 2 || s[s.rank - 1u] != s[s.rank - 2u] || s[s.rank - 1u] == 0) {
      shape_error(v, fmt::format("scores have shape {}; the causal mask takes [..., T, T] with T >= 1", s.str()));
    }
    return std::vector<TensorDesc>{v.input(0)};
  };
  r.bind = [](const BindContext& c) {
    const auto [m, t] = mask_dims(c.input(0).shape);
    return causal_mask_forward(c.env(), c.in(0), c.out(0), m, t);
  };
  r.backward = [grad_op](GradContext& g) { unary_backward(g, grad_op); };
  r.reference = [](RefContext& c) {
    ref::causal_mask_forward<double>(c.real(c.inputs()[0]), c.real(c.outputs()[0]),
                                     c.input(0).shape[c.input(0).shape.rank - 1u]);
  };
  return r;
}

}  // namespace

void register_causal_mask_rows(const AddRow& add) {
  add(causal_mask_row(builtin::causal_mask_grad), builtin::causal_mask);
  add(causal_mask_grad_row(), builtin::causal_mask_grad);
}

}  // namespace ferry::ops::table
