// Rows of the mean squared error loss and of its gradient. Its output, stats = [mean loss], is
// the step's loss.
//
//   mse       in: p t (f32, one shape)   out: stats [1]
//   mse_grad  in: p t                    out: dp = w 2 (p - t) / n, w the loss's weight (attrs f1)
#include "ops/mse.hpp"

#include <fmt/format.h>

#include "ops/attrs.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

OpInfo mse_grad_row() {  // in: p t  out: dp  attrs: f1 the loss's weight
  OpInfo r;
  r.name = "mse_grad";
  r.op_class = OpClass::backward;
  r.bind = [](const BindContext& c) {
    return mse_backward(c.env(), c.in(0), c.in(1), c.out(0), in_elems(c, 0), LossGradAttrs::weight(c.attrs()));
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    ref::mse_backward<double>(c.real(in[0]), c.real(in[1]), c.real(c.outputs()[0]), LossGradAttrs::weight(c.attrs()));
  };
  return r;
}

OpInfo mse_row(OpId grad_op) {  // in: p t  out: stats
  OpInfo r;
  r.name = "mse";
  r.op_class = OpClass::loss;
  r.infer = [](const ShapeView& v) {
    if (v.input_count() != 2) {
      shape_error(v, fmt::format("mse takes 2 inputs (prediction, target), got {}", v.input_count()));
    }
    const TensorDesc p = v.input(0), t = v.input(1);
    if (!(p.shape == t.shape)) {
      shape_error(v, fmt::format("prediction {} and target {} must have the same shape", p.shape.str(), t.shape.str()));
    }
    if (p.dtype != DType::f32 || t.dtype != DType::f32) {
      shape_error(v, fmt::format("mse takes an f32 prediction and target, got {} and {}", dtype_name(p.dtype),
                                 dtype_name(t.dtype)));
    }
    if (p.shape.elems() == 0) shape_error(v, fmt::format("prediction {} has no elements to average", p.shape.str()));
    return std::vector<TensorDesc>{{Shape{1}, DType::f32}};
  };
  r.bind = [](const BindContext& c) { return mse_forward(c.env(), c.in(0), c.in(1), c.out(0), in_elems(c, 0)); };
  r.backward = [grad_op](GradContext& g) {
    const TensorRef p = g.inputs()[0], t = g.inputs()[1];
    const TensorRef stats = g.outputs()[0];
    if (!loss_backward_applies(g, stats)) return;
    if (g.needs_grad(t)) {
      throw std::invalid_argument(fmt::format(
          "{}: MSE does not differentiate its target (input 1), but the target depends on a weight; compare the "
          "prediction with a target that does not",
          g.name()));
    }
    if (!g.needs_grad(p)) return;
    const TensorRef dp = g.new_grad(p);
    const TensorRef ins[] = {p, t};
    const TensorRef outs[] = {dp};
    // d(step loss)/d(this loss): 1, or a loss_sum's weight
    g.emit(grad_op, ".grad", ins, outs, LossGradAttrs::with_weight(g.attrs(), g.loss_weight(stats)));
    g.contribute(p, dp);
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    ref::mse_forward<double>(c.real(in[0]), c.real(in[1]), c.real(c.outputs()[0]));
  };
  return r;
}

}  // namespace

void register_mse_rows(const AddRow& add) {
  add(mse_row(builtin::mse_grad), builtin::mse);
  add(mse_grad_row(), builtin::mse_grad);
}

}  // namespace ferry::ops::table
