// Rows of LayerNorm over the last axis of [..., features] (rank 1 to 4; LayerNormAttrs: eps) and its
// gradient, and of add_layernorm: a residual stream's add and the LayerNorm that reads the sum, as
// one node (the fusion pass makes them; graph/passes/fusion.cpp). mean and rstd are [rows], one
// per position of the leading axes.
//
//   layernorm        in: x gamma beta             out: y mean rstd
//   layernorm_grad   in: x gamma mean rstd dy [dres] [guard]   out: dx dgamma dbeta [guard]
//                    (dx += dres when given; the overflow guard over dgamma and dbeta)
//   add_layernorm    in: a b gamma beta           out: x = a + b, y, mean, rstd   (b f32, f16 or bf16)
#include "ops/layernorm.hpp"

#include <fmt/format.h>

#include "ops/attrs.hpp"
#include "ops/overflow_guard.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

// The shape rule LayerNorm and add_layernorm share: x is input 0, gain and shift are inputs
// `gain` and `gain` + 1; outputs [the sum, when `with_sum`,] y like x, mean and rstd [rows] f32.
std::vector<TensorDesc> normalised_outputs(const ShapeView& v, std::size_t gain, bool with_sum) {
  const Shape x = v.input(0).shape;
  if (x.rank < 1) shape_error(v, "LayerNorm takes a tensor of rank 1 to 4");
  const std::uint32_t features = x[x.rank - 1u], rows = static_cast<std::uint32_t>(x.elems() / features);
  if (!(LayerNormAttrs::of(v.attrs()).eps > 0.0f))
    shape_error(v, fmt::format("eps must be positive, got {}", LayerNormAttrs::of(v.attrs()).eps));
  for (std::size_t i = gain; i < gain + 2; ++i) {
    if (!(v.input(i).shape == Shape{features})) {
      shape_error(v, fmt::format("gain/shift {} do not match {} features", v.input(i).shape.str(), features));
    }
  }
  // LayerNorm computes in f32: mixed precision keeps it so (OpInfo::computes_narrow is not set);
  // only y may be narrow, when its attributes say, and add_layernorm's b (casts folded in:
  // graph::fuse_narrowing_casts).
  for (std::size_t i = 0; i < v.input_count(); ++i) {
    const bool narrow_b = with_sum && i == 1 && (v.input(i).dtype == DType::f16 || v.input(i).dtype == DType::bf16);
    if (v.input(i).dtype != DType::f32 && !narrow_b) {
      shape_error(v, fmt::format("LayerNorm computes in f32, and input {} is {}: cast it to f32 first", i,
                                 dtype_name(v.input(i).dtype)));
    }
  }
  const DType y = LayerNormAttrs::of(v.attrs()).y;
  if (y != DType::f32 && y != DType::f16 && y != DType::bf16) {
    shape_error(v, fmt::format("y cannot be stored as {}", dtype_name(y)));
  }
  std::vector<TensorDesc> out;
  if (with_sum) out.push_back({x, DType::f32});
  out.insert(out.end(), {{x, y}, {Shape{rows}, DType::f32}, {Shape{rows}, DType::f32}});
  return out;
}

OpInfo layernorm_row() {  // in: x gamma beta  out: y mean rstd
  OpInfo r;
  r.name = "layernorm";
  r.merge_with_producer = {"add", "add_layernorm"};
  r.float_dtypes = {DType::f32, DType::f16, DType::bf16};  // y only (normalised_outputs)
  r.infer = [](const ShapeView& v) { return normalised_outputs(v, 1, false); };
  r.bind = [](const BindContext& c) {
    const Shape x = c.input(0).shape;
    const std::size_t cols = x[x.rank - 1u], rows = x.elems() / cols;
    const LayerNormAttrs attrs = LayerNormAttrs::of(c.attrs());
    return layernorm_forward(c.env(), c.in(0), c.in(1), c.in(2), c.out(0), c.out(1), c.out(2), rows, cols, attrs.eps,
                             {}, {}, attrs.y);
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
                                   c.real(out[2]), rows, cols, double(LayerNormAttrs::of(c.attrs()).eps));
  };
  return r;
}

// in: x gamma mean rstd dy [dres] [guard]  out: dx dgamma dbeta [guard]. With the overflow guard
// (graph::fuse_guard_checks; a fourth output), the node checks dgamma and dbeta as it stores them.
OpInfo layernorm_grad_row() {
  OpInfo r;
  r.name = "layernorm_grad";
  r.op_class = OpClass::backward;
  r.checks_outputs = 0b110;  // dgamma, dbeta
  r.bind = [](const BindContext& c) {
    const Shape x = c.input(0).shape;
    const std::size_t cols = x[x.rank - 1u], rows = x.elems() / cols;
    const bool guarded = c.output_count() > 3;
    const bool has_dres = c.input_count() > (guarded ? 6u : 5u);
    return layernorm_backward(c.env(), c.in(0), c.in(1), c.in(2), c.in(3), c.in(4), c.out(0), c.out(1), c.out(2), rows,
                              cols, has_dres ? c.in(5) : DeviceSpan{}, guarded ? c.out(3) : DeviceSpan{});
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    const auto out = c.outputs();
    const Shape x = c.input(0).shape;
    const std::size_t cols = x[x.rank - 1u], rows = x.elems() / cols;
    const bool guarded = out.size() > 3;
    ref::layernorm_backward<double>(c.real(in[0]), c.real(in[1]), c.real(in[2]), c.real(in[3]), c.real(in[4]),
                                    c.real(out[0]), c.real(out[1]), c.real(out[2]), rows, cols);
    if (in.size() > (guarded ? 6u : 5u)) {
      const auto dres = c.real(in[5]);
      const auto dx = c.real(out[0]);
      for (std::size_t i = 0; i < dx.size(); ++i) dx[i] += dres[i];
    }
    if (guarded) {
      const double g = ref::overflow_guard_check<double>(c.real(in.back())[0], c.real(out[1]));
      c.real(out[3])[0] = ref::overflow_guard_check<double>(g, c.real(out[2]));
    }
  };
  return r;
}

OpInfo add_layernorm_row() {  // in: a b gamma beta  out: x y mean rstd
  OpInfo r;
  r.name = "add_layernorm";
  r.float_dtypes = {DType::f32, DType::f16, DType::bf16};  // y only (normalised_outputs)
  r.infer = [](const ShapeView& v) {
    if (v.input_count() != 4)
      shape_error(v, fmt::format("add_layernorm takes a, b, gain and shift, got {} inputs", v.input_count()));
    const Shape x = v.input(0).shape;
    if (!(v.input(1).shape == x)) {
      shape_error(v, fmt::format("the residual's operands differ: {} and {}", x.str(), v.input(1).shape.str()));
    }
    return normalised_outputs(v, 2, true);
  };
  r.bind = [](const BindContext& c) {
    const Shape x = c.input(0).shape;
    const std::size_t cols = x[x.rank - 1u], rows = x.elems() / cols;
    const LayerNormAttrs attrs = LayerNormAttrs::of(c.attrs());
    return layernorm_forward(c.env(), c.out(0), c.in(2), c.in(3), c.out(1), c.out(2), c.out(3), rows, cols, attrs.eps,
                             c.in(0), c.in(1), attrs.y, c.input(1).dtype);
  };
  // The sum's gradient is LayerNorm's dx plus what the sum's other readers send back (dres, added
  // in the same kernel); both operands of the add get it.
  r.backward = [](GradContext& g) {
    const auto in = g.inputs();
    const auto out = g.outputs();
    const TensorRef dy = g.grad(out[1]), dres = g.grad(out[0]);
    if (dy == no_ref) {
      if (dres == no_ref) return;
      g.contribute(in[0], dres);
      g.contribute(in[1], dres);
      return;
    }
    const TensorRef dx = g.new_grad(out[0]), dg = g.new_grad(in[2]), db = g.new_grad(in[3]);
    const TensorRef ins[] = {out[0], in[2], out[2], out[3], dy, dres};
    const TensorRef outs[] = {dx, dg, db};
    g.emit(builtin::layernorm_grad, ".grad", std::span(ins, dres == no_ref ? 5 : 6), outs, g.attrs());
    g.contribute(in[0], dx);
    g.contribute(in[1], dx);
    g.contribute(in[2], dg);
    g.contribute(in[3], db);
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    const auto out = c.outputs();
    const Shape x = c.input(0).shape;
    const std::size_t cols = x[x.rank - 1u], rows = x.elems() / cols;
    const auto a = c.real(in[0]), b = c.real(in[1]);
    const auto sum = c.real(out[0]);
    for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = a[i] + b[i];
    ref::layernorm_forward<double>(sum, c.real(in[2]), c.real(in[3]), c.real(out[1]), c.real(out[2]), c.real(out[3]),
                                   rows, cols, double(LayerNormAttrs::of(c.attrs()).eps));
  };
  return r;
}

}  // namespace

void register_add_layernorm_rows(const AddRow& add) {
  add(add_layernorm_row(), builtin::add_layernorm);
}

void register_layernorm_rows(const AddRow& add) {
  add(layernorm_row(), builtin::layernorm);
  add(layernorm_grad_row(), builtin::layernorm_grad);
}

}  // namespace ferry::ops::table
