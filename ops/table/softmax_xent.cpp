// Rows of the fused softmax cross-entropy loss over [rows, classes] logits and int32 labels, and
// of its gradient. Its first output is each row's log-sum-exp (the backward recomputes the
// probabilities from it and the logits: no [rows, classes] tensor is kept); its second, stats =
// [mean loss, correct count], is the step's loss.
//
//   softmax_xent       in: logits labels       out: lse [rows], stats [2]
//   softmax_xent_grad  in: logits lse labels   out: dlogits   (LossGradAttrs: the loss's weight)
#include "ops/softmax_xent.hpp"

#include <fmt/format.h>

#include "ops/attrs.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

OpInfo softmax_xent_row() {  // in: logits labels  out: lse stats
  OpInfo r;
  r.name = "softmax_xent";
  r.op_class = OpClass::loss;
  r.infer = [](const ShapeView& v) {
    const Shape l = v.input(0).shape;
    const TensorDesc labels = v.input(1);
    if (l.rank != 2) shape_error(v, fmt::format("logits have shape {}; the loss takes [batch, classes]", l.str()));
    if (labels.dtype != DType::i32 || !(labels.shape == Shape{l[0]})) {
      shape_error(v, fmt::format("labels must be i32 [{}] for logits {}, got {} {}", l[0], l.str(),
                                 dtype_name(labels.dtype), labels.shape.str()));
    }
    return std::vector<TensorDesc>{{Shape{l[0]}, DType::f32}, {Shape{2}, DType::f32}};
  };
  r.bind = [](const BindContext& c) {
    const Shape l = c.input(0).shape;
    return softmax_xent_forward(c.env(), c.in(0), c.in(1), c.out(0), c.out(1), l[0], l[1]);
  };
  r.backward = [](GradContext& g) {
    const auto in = g.inputs();
    const auto out = g.outputs();
    if (!loss_backward_applies(g, out[1])) return;
    const TensorRef logits = in[0];
    if (!g.needs_grad(logits)) return;
    const TensorRef dl = g.new_grad(logits);
    const TensorRef ins[] = {logits, out[0], in[1]};
    const TensorRef outs[] = {dl};
    // d(step loss)/d(this loss): 1, or a loss_sum's weight
    g.emit(builtin::softmax_xent_grad, ".grad", ins, outs,
           LossGradAttrs::with_weight(g.attrs(), g.loss_weight(out[1])));
    g.contribute(logits, dl);
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    const auto out = c.outputs();
    const Shape l = c.input(0).shape;
    ref::softmax_xent_forward<double>(c.real(in[0]), c.ints(in[1]), c.real(out[0]), c.real(out[1]), l[0], l[1]);
  };
  return r;
}

OpInfo softmax_xent_grad_row() {  // in: logits lse labels  out: dlogits  attrs: f1 the loss's weight
  OpInfo r;
  r.name = "softmax_xent_grad";
  r.op_class = OpClass::backward;
  r.bind = [](const BindContext& c) {
    const Shape l = c.input(0).shape;
    return softmax_xent_backward(c.env(), c.in(0), c.in(1), c.in(2), c.out(0), l[0], l[1],
                                 LossGradAttrs::weight(c.attrs()));
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    const Shape l = c.input(0).shape;
    ref::softmax_xent_backward<double>(c.real(in[0]), c.real(in[1]), c.ints(in[2]), c.real(c.outputs()[0]), l[0], l[1],
                                       LossGradAttrs::weight(c.attrs()));
  };
  return r;
}

}  // namespace

void register_softmax_xent_rows(const AddRow& add) {
  add(softmax_xent_row(), builtin::softmax_xent);
  add(softmax_xent_grad_row(), builtin::softmax_xent_grad);
}

}  // namespace ferry::ops::table
