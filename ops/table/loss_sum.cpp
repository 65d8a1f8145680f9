// Row of a loss made of two weighted losses (a main loss and an auxiliary one, say).
//
//   loss_sum  in: a b (the f32 stats of loss ops)  out: [1] = wa a[0] + wb b[0]  attrs: f0 wa, f1 wb
//
// No gradient node: its backward makes a and b terms of the step's loss with weights wa and wb
// (times its own weight, so sums nest), and their rows scale their gradients by that weight.
#include "ops/loss_sum.hpp"

#include <fmt/format.h>

#include <cmath>

#include "ops/attrs.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

OpInfo loss_sum_row() {
  OpInfo r;
  r.name = "loss_sum";
  r.op_class = OpClass::loss;
  r.infer = [](const ShapeView& v) {
    if (v.input_count() != 2) shape_error(v, fmt::format("loss_sum takes 2 losses, got {}", v.input_count()));
    for (std::size_t i = 0; i < 2; ++i) {
      const TensorDesc d = v.input(i);
      if (d.dtype != DType::f32 || d.shape.elems() == 0) {
        shape_error(
            v, fmt::format("input {} must be a loss's f32 stats, got {} {}", i, dtype_name(d.dtype), d.shape.str()));
      }
    }
    for (float w : v.attrs().f) {
      if (!std::isfinite(w)) shape_error(v, fmt::format("the weights must be finite, got {}", w));
    }
    return std::vector<TensorDesc>{{Shape{1}, DType::f32}};
  };
  r.bind = [](const BindContext& c) {
    return loss_sum(c.env(), c.in(0), c.in(1), c.out(0), LossSumAttrs::of(c.attrs()).weight_a,
                    LossSumAttrs::of(c.attrs()).weight_b);
  };
  r.backward = [](GradContext& g) {
    const TensorRef out = g.outputs()[0];
    if (!loss_backward_applies(g, out)) return;
    const float w = g.loss_weight(out);
    g.add_loss_term(g.inputs()[0], w * LossSumAttrs::of(g.attrs()).weight_a);
    g.add_loss_term(g.inputs()[1], w * LossSumAttrs::of(g.attrs()).weight_b);
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    ref::loss_sum<double>(c.real(in[0]), c.real(in[1]), c.real(c.outputs()[0]), LossSumAttrs::of(c.attrs()).weight_a,
                          LossSumAttrs::of(c.attrs()).weight_b);
  };
  return r;
}

}  // namespace

void register_loss_sum_rows(const AddRow& add) {
  add(loss_sum_row(), builtin::loss_sum);
}

}  // namespace ferry::ops::table
