// Rows of Linear over the last axis: y = x w + b with x [..., in] (rank 2 to 4; the leading axes
// are rows), w [in, out], b [out]; and its two gradients. The fusion pass may fold a ReLU into
// the forward's epilogue (relu_fused) and an activation's backward into the input gradient's
// (LinearGradInputAttrs, graph/passes/fusion.cpp).
#include <fmt/format.h>

#include "ferry/ops/activation.hpp"
#include "ops/attrs.hpp"
#include "ops/bias.hpp"
#include "ops/gemm.hpp"
#include "ops/overflow_guard.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

// The three GEMMs of x [rows, in] and w [in, out]: y = x w;  dx = dy w^T;  dw = x^T dy. The
// activations x, y and their gradients share one storage type (f32, f16 or bf16: `act`), the
// weight and its gradient another (`weight`); the bias and its gradient are f32.
struct LinearGemms {
  GemmShape forward, grad_input, grad_param;
};
std::uint64_t flops(const GemmShape& s) {
  return 2ull * s.M * s.N * s.K;
}
LinearGemms linear_gemms(const TensorDesc& x, const TensorDesc& w) {
  const std::size_t in = w.shape[0], out = w.shape[1], batch = x.shape.elems() / in;
  const DType a = x.dtype, p = w.dtype;
  return {{batch, out, in, false, false, a, p, a},
          {batch, in, out, false, true, a, p, a},
          {in, out, batch, true, false, a, a, p}};
}

std::span<const double> maybe(RefContext& c, std::size_t i) {
  return i < c.inputs().size() ? std::span<const double>(c.real(c.inputs()[i])) : std::span<const double>{};
}

OpInfo linear_row() {
  OpInfo r;
  r.name = "linear";
  r.float_dtypes = {DType::f32, DType::f16, DType::bf16};
  r.computes_narrow = true;
  r.relu_fusion = ReluFusion::writes_its_output;
  r.int8_weight_layout = [](const Shape& w) -> std::optional<QuantLayout> {
    if (w.rank != 2) return std::nullopt;
    return QuantLayout::linear_weight(w[0], w[1]);
  };
  r.infer = [](const ShapeView& v) {
    const Shape x = v.input(0).shape, w = v.input(1).shape;
    if (x.rank < 2) {
      shape_error(v, fmt::format("input has shape {}; Linear takes [..., features] of rank 2 to 4", x.str()));
    }
    const std::uint32_t features = x[x.rank - 1u];
    if (w.rank != 2 || w[0] != features) {
      shape_error(
          v, fmt::format("weight {} does not take input {} (its last axis, {} features)", w.str(), x.str(), features));
    }
    if (v.input_count() > 2 && !(v.input(2).shape == Shape{w[1]})) {
      shape_error(v, fmt::format("bias {} does not match {} outputs", v.input(2).shape.str(), w[1]));
    }
    if (v.input_count() > 2 && v.input(2).dtype != DType::f32) {
      shape_error(v, fmt::format("bias of dtype {}: biases are f32 (cast the inputs and weight, not the bias)",
                                 dtype_name(v.input(2).dtype)));
    }
    Shape y = x;
    y.dims[x.rank - 1u] = w[1];
    return std::vector<TensorDesc>{{y, v.input(0).dtype}};
  };
  r.scratch_bytes = [](const ShapeView& v, OpEnv& env) {
    return gemm_scratch_elems(env, linear_gemms(v.input(0), v.input(1)).forward) * sizeof(float);
  };
  r.flops = [](const ShapeView& v) { return flops(linear_gemms(v.input(0), v.input(1)).forward); };
  r.bind = [](const BindContext& c) {
    GemmOptions opt;
    if (c.input_count() > 2) opt.bias = c.in(2);
    opt.relu = relu_fused(c.attrs());
    return gemm(c.env(), linear_gemms(c.input(0), c.input(1)).forward, 1.0f, c.in(0), c.in(1), 0.0f, c.out(0),
                c.scratch(), opt);
  };
  r.backward = [](GradContext& g) {
    relu_layer_backward(g, builtin::linear_grad_input, builtin::linear_grad_param, relu_fused(g.attrs()));
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    const std::span<double> y = c.real(c.outputs()[0]);
    ref::gemm<double>(linear_gemms(c.input(0), c.input(1)).forward, 1, c.real(in[0]), c.real(in[1]), 0, y, maybe(c, 2));
    if (relu_fused(c.attrs())) {
      for (double& v : y) v = v > 0.0 ? v : 0.0;
    }
  };
  return r;
}

OpInfo linear_grad_input_row() {  // in: dy w [z]  out: dx (times act'(z) when LinearGradInputAttrs::fused)
  OpInfo r;
  r.name = "linear_grad_input";
  r.op_class = OpClass::backward;
  r.float_dtypes = {DType::f32, DType::f16, DType::bf16};
  r.scratch_bytes = [](const ShapeView& v, OpEnv& env) {
    return gemm_scratch_elems(env, linear_gemms(v.output(0), v.input(1)).grad_input) * sizeof(float);
  };
  r.flops = [](const ShapeView& v) { return flops(linear_gemms(v.output(0), v.input(1)).grad_input); };
  r.bind = [](const BindContext& c) {
    GemmOptions opt;
    if (const LinearGradInputAttrs at = LinearGradInputAttrs::of(c.attrs()); at.fused) {
      if (c.input_count() < 3 || c.input(2).dtype != c.output(0).dtype ||
          c.input(2).shape.elems() != c.output(0).shape.elems()) {
        throw std::invalid_argument(fmt::format(
            "linear_grad_input: a fused activation derivative takes z of the input gradient's shape and dtype ({} {})",
            c.output(0).shape.str(), dtype_name(c.output(0).dtype)));
      }
      opt.dact_input = c.in(2);
      opt.dact = at.act;
    }
    return gemm(c.env(), linear_gemms(c.output(0), c.input(1)).grad_input, 1.0f, c.in(0), c.in(1), 0.0f, c.out(0),
                c.scratch(), opt);
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    const std::span<double> dx = c.real(c.outputs()[0]);
    ref::gemm<double>(linear_gemms(c.output(0), c.input(1)).grad_input, 1, c.real(in[0]), c.real(in[1]), 0, dx);
    if (const LinearGradInputAttrs at = LinearGradInputAttrs::of(c.attrs()); at.fused) {
      // The product as the unfused graph stores it (rounded to dx's type), then the derivative.
      const DType t = c.output(0).dtype;
      std::vector<double> product(dx.size());
      for (std::size_t i = 0; i < dx.size(); ++i) product[i] = through_storage(t, dx[i]);
      ref::activation_backward<double>(at.act, c.real(in[2]), product, dx);
    }
  };
  return r;
}

// in: x dy [guard]  out: dw [db] [guard]. With the overflow guard (graph::fuse_guard_checks), the
// node checks what it makes: the weight gradient in the product's epilogue, the bias gradient as its
// column sums are stored.
OpInfo linear_grad_param_row() {
  OpInfo r;
  r.name = "linear_grad_param";
  r.op_class = OpClass::backward;
  r.float_dtypes = {DType::f32, DType::f16, DType::bf16};
  r.checks_outputs = 0b11;  // dw, db
  r.scratch_bytes = [](const ShapeView& v, OpEnv& env) {
    return gemm_scratch_elems(env, linear_gemms(v.input(0), v.output(0)).grad_param) * sizeof(float);
  };
  r.flops = [](const ShapeView& v) { return flops(linear_gemms(v.input(0), v.output(0)).grad_param); };
  r.bind = [](const BindContext& c) {
    const bool guarded = c.input_count() > 2;
    const bool has_bias = c.output_count() > (guarded ? 2u : 1u);
    const std::size_t cols = c.output(0).shape[1], rows = c.input(1).shape.elems() / cols;
    GemmOptions options;
    if (guarded) options.guard = c.out(c.output_count() - 1);
    auto list = gemm(c.env(), linear_gemms(c.input(0), c.output(0)).grad_param, 1.0f, c.in(0), c.in(1), 0.0f, c.out(0),
                     c.scratch(), options);
    if (has_bias) {
      auto bias = bias_backward(c.env(), c.in(1), c.out(1), rows, cols, c.input(1).dtype, options.guard);
      std::move(bias.begin(), bias.end(), std::back_inserter(list));
    }
    return list;
  };
  r.reference = [](RefContext& c) {
    const auto in = c.inputs();
    const auto out = c.outputs();
    const bool guarded = in.size() > 2;
    const bool has_bias = out.size() > (guarded ? 2u : 1u);
    ref::gemm<double>(linear_gemms(c.input(0), c.output(0)).grad_param, 1, c.real(in[0]), c.real(in[1]), 0,
                      c.real(out[0]));
    if (has_bias) {
      const std::size_t cols = c.output(0).shape[1];
      ref::bias_backward<double>(c.real(in[1]), c.real(out[1]), c.input(1).shape.elems() / cols, cols);
    }
    if (guarded) {
      double g = ref::overflow_guard_check<double>(c.real(in[2])[0], c.real(out[0]));
      if (has_bias) g = ref::overflow_guard_check<double>(g, c.real(out[1]));
      c.real(out.back())[0] = g;
    }
  };
  return r;
}

}  // namespace

void register_linear_rows(const AddRow& add) {
  add(linear_row(), builtin::linear);
  add(linear_grad_input_row(), builtin::linear_grad_input);
  add(linear_grad_param_row(), builtin::linear_grad_param);
}

}  // namespace ferry::ops::table
