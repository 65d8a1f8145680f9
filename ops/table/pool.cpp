// Rows of MaxPool2d over [N, C, H, W] (MaxPool2dAttrs: window, stride, and a ReLU fused in, see
// graph/passes/fusion.cpp) and its gradient.
#include "ops/pool.hpp"

#include <fmt/format.h>

#include "ops/attrs.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

Pool2dShape pool_shape(const TensorDesc& xd, const NodeAttrs& a) {
  const Shape& x = xd.shape;
  Pool2dShape s;
  s.dtype = xd.dtype;
  s.N = x[0];
  s.C = x[1];
  s.H = x[2];
  s.W = x[3];
  const MaxPool2dAttrs at = MaxPool2dAttrs::of(a);
  s.window = static_cast<std::size_t>(at.window);
  s.stride = static_cast<std::size_t>(at.stride);
  s.relu = at.relu;
  return s;
}

OpInfo maxpool2d_row() {  // in: x  out: y argmax
  OpInfo r;
  r.name = "maxpool2d";
  r.float_dtypes = {DType::f32, DType::f16, DType::bf16};
  r.computes_narrow = true;
  r.relu_fusion = ReluFusion::reads_its_input;
  r.infer = [](const ShapeView& v) {
    const Shape x = v.input(0).shape;
    const MaxPool2dAttrs at = MaxPool2dAttrs::of(v.attrs());
    const auto window = static_cast<std::uint32_t>(at.window), stride = static_cast<std::uint32_t>(at.stride);
    if (x.rank != 4) shape_error(v, fmt::format("input has shape {}; MaxPool2d takes [N, C, H, W]", x.str()));
    if (window == 0 || stride == 0 || x[2] < window || x[3] < window) {
      shape_error(v, fmt::format("window {} / stride {} do not fit input {}", window, stride, x.str()));
    }
    const Shape y{x[0], x[1], (x[2] - window) / stride + 1, (x[3] - window) / stride + 1};
    return std::vector<TensorDesc>{{y, v.input(0).dtype}, {y, DType::i32}};
  };
  r.bind = [](const BindContext& c) {
    return maxpool2d_forward(c.env(), pool_shape(c.input(0), c.attrs()), c.in(0), c.out(0), c.out(1));
  };
  r.backward = [](GradContext& g) {
    const TensorRef x = g.inputs()[0];
    const TensorRef dy = g.grad(g.outputs()[0]);
    if (dy == no_ref || !g.needs_grad(x)) return;
    const TensorRef dx = g.new_grad(x);
    const TensorRef ins[] = {dy, g.outputs()[1]};
    const TensorRef outs[] = {dx};
    g.emit(builtin::maxpool2d_grad, ".grad", ins, outs, g.attrs());
    g.contribute(x, dx);
  };
  r.reference = [](RefContext& c) {
    const auto out = c.outputs();
    ref::maxpool2d_forward<double>(pool_shape(c.input(0), c.attrs()), c.real(c.inputs()[0]), c.real(out[0]),
                                   c.ints(out[1]));
  };
  return r;
}

OpInfo maxpool2d_grad_row() {  // in: dy argmax  out: dx
  OpInfo r;
  r.name = "maxpool2d_grad";
  r.op_class = OpClass::backward;
  r.float_dtypes = {DType::f32, DType::f16, DType::bf16};
  r.bind = [](const BindContext& c) {
    return maxpool2d_backward(c.env(), pool_shape(c.output(0), c.attrs()), c.in(0), c.in(1), c.out(0));
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    ref::maxpool2d_backward<double>(pool_shape(c.output(0), c.attrs()), c.real(in[0]), c.ints(in[1]),
                                    c.real(c.outputs()[0]));
  };
  return r;
}

}  // namespace

void register_pool_rows(const AddRow& add) {
  add(maxpool2d_row(), builtin::maxpool2d);
  add(maxpool2d_grad_row(), builtin::maxpool2d_grad);
}

}  // namespace ferry::ops::table
