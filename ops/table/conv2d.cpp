// Rows of Conv2d over [N, C, H, W] with weights [K, C, R, S] (Conv2dAttrs: stride, pad, and a ReLU
// fused into the epilogue, see graph/passes/fusion.cpp) and its two gradients.
#include "ops/conv2d.hpp"

#include <fmt/format.h>

#include "ferry/ops/activation.hpp"
#include "ops/attrs.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

// 2 N K C R S P Q: the forward's multiply-adds, and each gradient's (the same products).
std::uint64_t conv_flops(const Conv2dShape& s) {
  return 2ull * s.N * s.K * s.C * s.R * s.S * s.P() * s.Q();
}

Conv2dShape conv_shape(const TensorDesc& xd, const TensorDesc& wd, const NodeAttrs& a) {
  const Shape &x = xd.shape, &w = wd.shape;
  Conv2dShape s;
  s.act = xd.dtype;
  s.weight = wd.dtype;
  s.N = x[0];
  s.C = x[1];
  s.H = x[2];
  s.W = x[3];
  s.K = w[0];
  s.R = w[2];
  s.S = w[3];
  const Conv2dAttrs at = Conv2dAttrs::of(a);
  s.stride = static_cast<std::size_t>(at.stride);
  s.pad = static_cast<std::size_t>(at.pad);
  return s;
}

OpInfo conv2d_row() {  // in: x w [b]  out: y
  OpInfo r;
  r.name = "conv2d";
  r.float_dtypes = {DType::f32, DType::f16, DType::bf16};
  r.computes_narrow = true;
  r.relu_fusion = ReluFusion::writes_its_output;
  r.int8_weight_layout = [](const Shape& w) -> std::optional<QuantLayout> {
    if (w.rank != 4) return std::nullopt;
    return QuantLayout::conv_weight(w[0], w[1], w[2], w[3]);
  };
  r.infer = [](const ShapeView& v) {
    const Shape x = v.input(0).shape, w = v.input(1).shape;
    const Conv2dAttrs at = Conv2dAttrs::of(v.attrs());
    const auto stride = static_cast<std::uint32_t>(at.stride), pad = static_cast<std::uint32_t>(at.pad);
    if (x.rank != 4) shape_error(v, fmt::format("input has shape {}; Conv2d takes [N, C, H, W]", x.str()));
    if (w.rank != 4 || w[1] != x[1] || w[0] == 0 || w[2] == 0 || w[3] == 0) {
      shape_error(v,
                  fmt::format("weight {} does not take input {} ([K, C, R, S] with C = {})", w.str(), x.str(), x[1]));
    }
    if (stride == 0) shape_error(v, "stride must be at least 1");
    // A pad past half the kernel makes outputs that see only padding (PyTorch rejects it too).
    if (2 * pad > w[2] || 2 * pad > w[3]) {
      shape_error(v, fmt::format("padding {} is more than half the kernel {}x{}", pad, w[2], w[3]));
    }
    if (x[2] + 2 * pad < w[2] || x[3] + 2 * pad < w[3]) {
      shape_error(v, fmt::format("kernel {}x{} is larger than the padded input {} (pad {})", w[2], w[3], x.str(), pad));
    }
    if (v.input_count() > 2 && !(v.input(2).shape == Shape{w[0]})) {
      shape_error(v, fmt::format("bias {} does not match {} output channels", v.input(2).shape.str(), w[0]));
    }
    if (v.input_count() > 2 && v.input(2).dtype != DType::f32) {
      shape_error(v, fmt::format("bias of dtype {}: biases are f32", dtype_name(v.input(2).dtype)));
    }
    const Conv2dShape s = conv_shape(v.input(0), v.input(1), v.attrs());
    return std::vector<TensorDesc>{
        {Shape{x[0], w[0], static_cast<std::uint32_t>(s.P()), static_cast<std::uint32_t>(s.Q())}, v.input(0).dtype}};
  };
  r.scratch_bytes = [](const ShapeView& v, OpEnv& env) {
    return conv2d_scratch_elems(env, conv_shape(v.input(0), v.input(1), v.attrs())) * sizeof(float);
  };
  r.flops = [](const ShapeView& v) { return conv_flops(conv_shape(v.input(0), v.input(1), v.attrs())); };
  r.bind = [](const BindContext& c) {
    const DeviceSpan bias = c.input_count() > 2 ? c.in(2) : DeviceSpan{};
    Conv2dShape s = conv_shape(c.input(0), c.input(1), c.attrs());
    s.relu = Conv2dAttrs::of(c.attrs()).relu;
    return conv2d_forward(c.env(), s, c.in(0), c.in(1), bias, c.out(0), c.scratch());
  };
  r.backward = [](GradContext& g) {
    relu_layer_backward(g, builtin::conv2d_grad_input, builtin::conv2d_grad_param, Conv2dAttrs::of(g.attrs()).relu);
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    std::span<const double> bias = in.size() > 2 ? std::span<const double>(c.real(in[2])) : std::span<const double>{};
    const std::span<double> y = c.real(c.outputs()[0]);
    ref::conv2d_forward<double>(conv_shape(c.input(0), c.input(1), c.attrs()), c.real(in[0]), c.real(in[1]), bias, y);
    if (Conv2dAttrs::of(c.attrs()).relu) {
      for (double& v : y) v = v > 0.0 ? v : 0.0;
    }
  };
  return r;
}

OpInfo conv2d_grad_input_row() {  // in: dy w  out: dx
  OpInfo r;
  r.name = "conv2d_grad_input";
  r.float_dtypes = {DType::f32, DType::f16, DType::bf16};
  r.op_class = OpClass::backward;
  r.scratch_bytes = [](const ShapeView& v, OpEnv& env) {
    return conv2d_scratch_elems(env, conv_shape(v.output(0), v.input(1), v.attrs())) * sizeof(float);
  };
  r.flops = [](const ShapeView& v) { return conv_flops(conv_shape(v.output(0), v.input(1), v.attrs())); };
  r.bind = [](const BindContext& c) {
    return conv2d_backward_data(c.env(), conv_shape(c.output(0), c.input(1), c.attrs()), c.in(0), c.in(1), c.out(0),
                                c.scratch());
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    ref::conv2d_backward_data<double>(conv_shape(c.output(0), c.input(1), c.attrs()), c.real(in[0]), c.real(in[1]),
                                      c.real(c.outputs()[0]));
  };
  return r;
}

OpInfo conv2d_grad_param_row() {  // in: x dy  out: dw [db]
  OpInfo r;
  r.name = "conv2d_grad_param";
  r.float_dtypes = {DType::f32, DType::f16, DType::bf16};
  r.op_class = OpClass::backward;
  r.scratch_bytes = [](const ShapeView& v, OpEnv& env) {
    return conv2d_scratch_elems(env, conv_shape(v.input(0), v.output(0), v.attrs())) * sizeof(float);
  };
  r.flops = [](const ShapeView& v) { return conv_flops(conv_shape(v.input(0), v.output(0), v.attrs())); };
  r.bind = [](const BindContext& c) {
    const DeviceSpan dbias = c.output_count() > 1 ? c.out(1) : DeviceSpan{};
    return conv2d_backward_weights(c.env(), conv_shape(c.input(0), c.output(0), c.attrs()), c.in(0), c.in(1), c.out(0),
                                   dbias, c.scratch());
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    const auto out = c.outputs();
    std::span<double> dbias = out.size() > 1 ? c.real(out[1]) : std::span<double>{};
    ref::conv2d_backward_weights<double>(conv_shape(c.input(0), c.output(0), c.attrs()), c.real(in[0]), c.real(in[1]),
                                         c.real(out[0]), dbias);
  };
  return r;
}

}  // namespace

void register_conv2d_rows(const AddRow& add) {
  add(conv2d_row(), builtin::conv2d);
  add(conv2d_grad_input_row(), builtin::conv2d_grad_input);
  add(conv2d_grad_param_row(), builtin::conv2d_grad_param);
}

}  // namespace ferry::ops::table
