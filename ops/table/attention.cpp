// Rows of fused causal multi-head attention and its gradient (ops/attention.hpp).
//
//   attention       in: q k v [B, T, H D]   out: o [B, T, H D], lse [B, H, T] (f32)
//                   AttentionAttrs: heads H, the scale of q kᵀ (0: 1 / sqrt(D)), dropout p on the
//                   probabilities (0: none) and its seed
//   attention_grad  in: q k v o lse do      out: dq dk dv   (the forward's attrs)
#include "ops/attention.hpp"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>

#include "ops/attrs.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

std::size_t heads_of(const NodeAttrs& a) {
  const std::int32_t heads = AttentionAttrs::of(a).heads;
  return heads > 0 ? static_cast<std::size_t>(heads) : 0;
}
AttentionShape shape_of(const Shape& q, const NodeAttrs& a) {
  const std::size_t heads = heads_of(a);
  return {q[0], q[1], heads, heads == 0 ? 0 : q[2] / heads};
}
float scale_of(const AttentionShape& s, const NodeAttrs& a) {
  const float scale = AttentionAttrs::of(a).scale;
  return scale != 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(s.head_dim));
}
AttentionDropout dropout_of(const NodeAttrs& a) {
  const AttentionAttrs at = AttentionAttrs::of(a);
  return {at.dropout, at.seed};
}
// The reference's draws in step `s`: keyed as the kernels' (ops::dropout_key).
AttentionDropout dropout_in_step(const NodeAttrs& a, const StepInfo& s) {
  AttentionDropout d = dropout_of(a);
  d.seed = dropout_key(d.seed, s);
  return d;
}
// Multiply-adds of the scores and the value products over the causal half: 2 B H T (T+1)/2 D each.
std::uint64_t forward_flops(const AttentionShape& s) {
  return 2ull * s.batch * s.heads * s.context * (s.context + 1) * s.head_dim;
}

OpInfo attention_row(OpId grad) {  // in: q k v  out: o lse
  OpInfo r;
  r.name = "attention";
  r.float_dtypes = {DType::f32, DType::f16, DType::bf16};
  // Narrow q, k, v and o (the projections around it are narrow layers); the log-sum-exp stays f32.
  r.computes_narrow = true;
  r.narrow_outputs = 1;
  r.infer = [](const ShapeView& v) {
    if (v.input_count() != 3) shape_error(v, fmt::format("attention takes q, k and v, got {} inputs", v.input_count()));
    const Shape q = v.input(0).shape;
    if (q.rank != 3)
      shape_error(v, fmt::format("q has shape {}; attention takes [batch, context, heads x head_dim]", q.str()));
    for (std::size_t i = 1; i < 3; ++i) {
      if (!(v.input(i).shape == q) || v.input(i).dtype != v.input(0).dtype) {
        shape_error(
            v, fmt::format("{} is {} {}, q is {} {}: q, k and v must match", i == 1 ? "k" : "v", v.input(i).shape.str(),
                           dtype_name(v.input(i).dtype), q.str(), dtype_name(v.input(0).dtype)));
      }
    }
    const std::size_t heads = heads_of(v.attrs());
    if (heads == 0 || q[2] % heads != 0) {
      shape_error(v, fmt::format("width {} does not split into {} heads", q[2], AttentionAttrs::of(v.attrs()).heads));
    }
    const float p = AttentionAttrs::of(v.attrs()).dropout;
    if (!(p >= 0.0f && p < 1.0f)) shape_error(v, fmt::format("dropout must be in [0, 1), got {}", p));
    try {
      check_attention_shape(shape_of(q, v.attrs()));
    } catch (const std::invalid_argument& e) {
      shape_error(v, e.what());
    }
    const auto h = static_cast<std::uint32_t>(heads);
    return std::vector<TensorDesc>{{q, v.input(0).dtype}, {Shape{q[0], h, q[1]}, DType::f32}};
  };
  r.scratch_bytes = [](const ShapeView& v, OpEnv& env) {
    return attention_forward_scratch_elems(env, shape_of(v.input(0).shape, v.attrs())) * sizeof(float);
  };
  r.flops = [](const ShapeView& v) { return forward_flops(shape_of(v.input(0).shape, v.attrs())); };
  r.bind = [](const BindContext& c) {
    const AttentionShape s = shape_of(c.input(0).shape, c.attrs());
    return attention_forward(c.env(), s, c.input(0).dtype, scale_of(s, c.attrs()), dropout_of(c.attrs()), c.in(0),
                             c.in(1), c.in(2), c.out(0), c.out(1), c.scratch());
  };
  r.backward = [grad](GradContext& g) {
    const auto in = g.inputs();
    const auto out = g.outputs();
    const TensorRef dout = g.grad(out[0]);
    if (dout == no_ref) return;
    if (!g.needs_grad(in[0]) && !g.needs_grad(in[1]) && !g.needs_grad(in[2])) return;
    const TensorRef dq = g.new_grad(in[0]), dk = g.new_grad(in[1]), dv = g.new_grad(in[2]);
    const TensorRef ins[] = {in[0], in[1], in[2], out[0], out[1], dout};
    const TensorRef outs[] = {dq, dk, dv};
    g.emit(grad, ".grad", ins, outs, g.attrs());
    for (std::size_t i = 0; i < 3; ++i) {
      if (g.needs_grad(in[i])) g.contribute(in[i], outs[i]);
    }
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    const auto out = c.outputs();
    const AttentionShape s = shape_of(c.input(0).shape, c.attrs());
    ref::attention_forward<double>(s, scale_of(s, c.attrs()), dropout_in_step(c.attrs(), c.step()), c.step().step,
                                   c.real(in[0]), c.real(in[1]), c.real(in[2]), c.real(out[0]), c.real(out[1]));
  };
  return r;
}

OpInfo attention_grad_row() {  // in: q k v o lse do  out: dq dk dv
  OpInfo r;
  r.name = "attention_grad";
  r.op_class = OpClass::backward;
  r.float_dtypes = {DType::f32, DType::f16, DType::bf16};
  r.scratch_bytes = [](const ShapeView& v, OpEnv& env) {
    return attention_backward_scratch_elems(env, shape_of(v.input(0).shape, v.attrs())) * sizeof(float);
  };
  // Seven products where the forward has two: the scores and do vᵀ twice (dk dv, then dq), dv, dk, dq.
  r.flops = [](const ShapeView& v) { return forward_flops(shape_of(v.input(0).shape, v.attrs())) * 7 / 2; };
  r.bind = [](const BindContext& c) {
    const AttentionShape s = shape_of(c.input(0).shape, c.attrs());
    return attention_backward(c.env(), s, c.input(0).dtype, scale_of(s, c.attrs()), dropout_of(c.attrs()), c.in(0),
                              c.in(1), c.in(2), c.in(3), c.in(4), c.in(5), c.out(0), c.out(1), c.out(2), c.scratch());
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    const auto out = c.outputs();
    const AttentionShape s = shape_of(c.input(0).shape, c.attrs());
    ref::attention_backward<double>(s, scale_of(s, c.attrs()), dropout_in_step(c.attrs(), c.step()), c.step().step,
                                    c.real(in[0]), c.real(in[1]), c.real(in[2]), c.real(in[3]), c.real(in[4]),
                                    c.real(in[5]), c.real(out[0]), c.real(out[1]), c.real(out[2]));
  };
  return r;
}

}  // namespace

void register_attention_rows(const AddRow& add) {
  add(attention_row(builtin::attention_grad), builtin::attention);
  add(attention_grad_row(), builtin::attention_grad);
}

}  // namespace ferry::ops::table
