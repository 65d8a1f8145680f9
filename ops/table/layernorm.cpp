// Rows of LayerNorm over the last axis of [..., features] (rank 1 to 4; attrs.f[0] = eps) and its
// gradient. mean and rstd are [rows], one per position of the leading axes.
#include "ferry/ops/layernorm.hpp"

#include <fmt/format.h>

#include "rows.hpp"

namespace ferry::ops::table {
namespace {

OpInfo layernorm_row() {  // in: x gamma beta  out: y mean rstd
  OpInfo r;
  r.name = "layernorm";
  r.infer = [](const ShapeView& v) {
    const Shape x = v.input(0).shape;
    if (x.rank < 1) shape_error(v, "LayerNorm takes a tensor of rank 1 to 4");
    const std::uint32_t features = x[x.rank - 1u], rows = static_cast<std::uint32_t>(x.elems() / features);
    if (!(v.attrs().f[0] > 0.0f)) shape_error(v, fmt::format("eps must be positive, got {}", v.attrs().f[0]));
    for (std::size_t i = 1; i < 3; ++i) {
      if (!(v.input(i).shape == Shape{features})) {
        shape_error(v, fmt::format("gain/shift {} do not match {} features", v.input(i).shape.str(), features));
      }
    }
    const DType t = v.input(0).dtype;
    return std::vector<TensorDesc>{{x, t}, {Shape{rows}, DType::f32}, {Shape{rows}, DType::f32}};
  };
  r.bind = [](const BindContext& c) {
    const Shape x = c.input(0).shape;
    const std::size_t cols = x[x.rank - 1u], rows = x.elems() / cols;
    return layernorm_forward(c.env(), c.in(0), c.in(1), c.in(2), c.out(0), c.out(1), c.out(2), rows, cols,
                             c.attrs().f[0]);
  };
  r.backward = [](GradContext& g) {
    const auto in = g.inputs();
    const auto out = g.outputs();
    const TensorRef dy = g.grad(out[0]);
    if (dy == no_ref) return;
    const TensorRef dx = g.new_grad(in[0]), dg = g.new_grad(in[1]), db = g.new_grad(in[2]);
    const TensorRef ins[] = {in[0], in[1], out[1], out[2], dy};
    const TensorRef outs[] = {dx, dg, db};
    g.emit(builtin::layernorm_grad, ".grad", ins, outs, g.attrs());
    g.contribute(in[0], dx);
    g.contribute(in[1], dg);
    g.contribute(in[2], db);
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    const auto out = c.outputs();
    const Shape x = c.input(0).shape;
    const std::size_t cols = x[x.rank - 1u], rows = x.elems() / cols;
    ref::layernorm_forward<double>(c.real(in[0]), c.real(in[1]), c.real(in[2]), c.real(out[0]), c.real(out[1]),
                                   c.real(out[2]), rows, cols, double(c.attrs().f[0]));
  };
  return r;
}

OpInfo layernorm_grad_row() {  // in: x gamma mean rstd dy  out: dx dgamma dbeta
  OpInfo r;
  r.name = "layernorm_grad";
  r.op_class = OpClass::backward;
  r.bind = [](const BindContext& c) {
    const Shape x = c.input(0).shape;
    const std::size_t cols = x[x.rank - 1u], rows = x.elems() / cols;
    return layernorm_backward(c.env(), c.in(0), c.in(1), c.in(2), c.in(3), c.in(4), c.out(0), c.out(1), c.out(2), rows,
                              cols);
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    const auto out = c.outputs();
    const Shape x = c.input(0).shape;
    const std::size_t cols = x[x.rank - 1u], rows = x.elems() / cols;
    ref::layernorm_backward<double>(c.real(in[0]), c.real(in[1]), c.real(in[2]), c.real(in[3]), c.real(in[4]),
                                    c.real(out[0]), c.real(out[1]), c.real(out[2]), rows, cols);
  };
  return r;
}

}  // namespace

void register_layernorm_rows(const AddRow& add) {
  add(layernorm_row(), builtin::layernorm);
  add(layernorm_grad_row(), builtin::layernorm_grad);
}

}  // namespace ferry::ops::table
