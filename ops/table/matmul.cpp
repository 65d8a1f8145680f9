// Rows of the batched matmul of two activations (ops::gemm strided-batched).
//
//   matmul         c = alpha op(a) op(b)          in: a b     out: c
//                  MatmulAttrs: transpose_a, a is stored transposed ([..., K, M]); transpose_b, b is
//                  ([..., N, K]); alpha, the scale of the product (0, the default, means 1).
//   matmul_grad_a  da = alpha dy op(b)^T, stored like a   in: dy b    out: da   (the forward's attrs)
//   matmul_grad_b  db = alpha op(a)^T dy, stored like b   in: a dy    out: db   (the forward's attrs)
#include "ops/matmul.hpp"

#include <fmt/format.h>

#include <stdexcept>

#include "ops/attrs.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

float alpha(const NodeAttrs& a) {
  return MatmulAttrs::of(a).product_scale();
}
GemmShape product(const Shape& a, const Shape& b, const NodeAttrs& attrs) {
  const MatmulAttrs at = MatmulAttrs::of(attrs);
  return matmul_shape(a, b, at.transpose_a, at.transpose_b);
}

// The forward product of a gradient node: grad_a knows a's shape from its output da, grad_b knows
// b's from its output db.
GemmShape forward_of_grad_a(const ShapeView& v) {  // in: dy b  out: da
  return product(v.output(0).shape, v.input(1).shape, v.attrs());
}
GemmShape forward_of_grad_b(const ShapeView& v) {  // in: a dy  out: db
  return product(v.input(0).shape, v.output(0).shape, v.attrs());
}

OpInfo matmul_row(OpId grad_a, OpId grad_b) {  // in: a b  out: c
  OpInfo r;
  r.name = "matmul";
  r.infer = [](const ShapeView& v) {
    if (v.input_count() != 2) shape_error(v, fmt::format("matmul takes two inputs (a, b), got {}", v.input_count()));
    const NodeAttrs& at = v.attrs();
    for (int i = 0; i < 2; ++i) {
      const std::int32_t code = MatmulAttrs::transpose_code(at, i);
      if (code != 0 && code != 1) {
        shape_error(v, fmt::format("transpose_{} must be 0 or 1, got {}", i ? "b" : "a", code));
      }
    }
    try {
      const Shape out = matmul_output_shape(v.input(0).shape, v.input(1).shape, MatmulAttrs::of(at).transpose_a,
                                            MatmulAttrs::of(at).transpose_b);
      return std::vector<TensorDesc>{{out, v.input(0).dtype}};
    } catch (const std::invalid_argument& e) {
      shape_error(v, e.what());
    }
  };
  r.scratch_bytes = [](const ShapeView& v, OpEnv& env) {
    return gemm_scratch_elems(env, product(v.input(0).shape, v.input(1).shape, v.attrs())) * sizeof(float);
  };
  r.flops = [](const ShapeView& v) { return product(v.input(0).shape, v.input(1).shape, v.attrs()).flops(); };
  r.bind = [](const BindContext& c) {
    return gemm(c.env(), product(c.input(0).shape, c.input(1).shape, c.attrs()), alpha(c.attrs()), c.in(0), c.in(1),
                0.0f, c.out(0), c.scratch());
  };
  r.backward = [grad_a, grad_b](GradContext& g) {
    const auto in = g.inputs();
    const TensorRef dy = g.grad(g.outputs()[0]);
    if (dy == no_ref) return;
    const TensorRef a = in[0], b = in[1];
    if (g.needs_grad(a)) {
      const TensorRef da = g.new_grad(a);
      const TensorRef ins[] = {dy, b};
      const TensorRef outs[] = {da};
      g.emit(grad_a, ".grad_a", ins, outs, g.attrs());
      g.contribute(a, da);
    }
    if (g.needs_grad(b)) {
      const TensorRef db = g.new_grad(b);
      const TensorRef ins[] = {a, dy};
      const TensorRef outs[] = {db};
      g.emit(grad_b, ".grad_b", ins, outs, g.attrs());
      g.contribute(b, db);
    }
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    ref::gemm<double>(product(c.input(0).shape, c.input(1).shape, c.attrs()), alpha(c.attrs()), c.real(in[0]),
                      c.real(in[1]), 0.0, c.real(c.outputs()[0]));
  };
  return r;
}

OpInfo matmul_grad_a_row() {  // in: dy b  out: da
  OpInfo r;
  r.name = "matmul_grad_a";
  r.op_class = OpClass::backward;
  r.scratch_bytes = [](const ShapeView& v, OpEnv& env) {
    return matmul_grad_a_scratch_elems(env, forward_of_grad_a(v)) * sizeof(float);
  };
  r.flops = [](const ShapeView& v) { return forward_of_grad_a(v).flops(); };  // the same M N K
  r.bind = [](const BindContext& c) {
    return matmul_grad_a(c.env(), forward_of_grad_a(c), alpha(c.attrs()), c.in(0), c.in(1), c.out(0), c.scratch());
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    ref::matmul_grad_a<double>(forward_of_grad_a(c), alpha(c.attrs()), c.real(in[0]), c.real(in[1]),
                               c.real(c.outputs()[0]));
  };
  return r;
}

OpInfo matmul_grad_b_row() {  // in: a dy  out: db
  OpInfo r;
  r.name = "matmul_grad_b";
  r.op_class = OpClass::backward;
  r.scratch_bytes = [](const ShapeView& v, OpEnv& env) {
    return matmul_grad_b_scratch_elems(env, forward_of_grad_b(v)) * sizeof(float);
  };
  r.flops = [](const ShapeView& v) { return forward_of_grad_b(v).flops(); };
  r.bind = [](const BindContext& c) {
    return matmul_grad_b(c.env(), forward_of_grad_b(c), alpha(c.attrs()), c.in(0), c.in(1), c.out(0), c.scratch());
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    ref::matmul_grad_b<double>(forward_of_grad_b(c), alpha(c.attrs()), c.real(in[0]), c.real(in[1]),
                               c.real(c.outputs()[0]));
  };
  return r;
}

}  // namespace

void register_matmul_rows(const AddRow& add) {
  add(matmul_row(builtin::matmul_grad_a, builtin::matmul_grad_b), builtin::matmul);
  add(matmul_grad_a_row(), builtin::matmul_grad_a);
  add(matmul_grad_b_row(), builtin::matmul_grad_b);
}

}  // namespace ferry::ops::table
