// Registration of the built-in rows under their ops::builtin ids, and helpers the rows share.
#include <fmt/format.h>

#include <stdexcept>

#include "ferry/ops/cast.hpp"
#include "ops/attrs.hpp"
#include "rows.hpp"

namespace ferry::ops::table {

void shape_error(const ShapeView& v, const std::string& what) {
  throw ShapeError(fmt::format("{}: {}", v.name(), what));
}

void expect_inputs(const ShapeView& v, std::size_t n, const char* op) {
  if (v.input_count() != n) shape_error(v, fmt::format("{} takes {} input(s), got {}", op, n, v.input_count()));
}

void weight_layer_backward(GradContext& g, OpId grad_input, OpId grad_param, TensorRef dy) {
  const auto in = g.inputs();
  if (dy == no_ref) dy = g.grad(g.outputs()[0]);
  if (dy == no_ref) return;
  const TensorRef x = in[0], w = in[1];
  const bool has_bias = in.size() > 2;
  if (g.needs_grad(x)) {
    const TensorRef dx = g.new_grad(x);
    const TensorRef ins[] = {dy, w};
    const TensorRef outs[] = {dx};
    g.emit(grad_input, ".grad_input", ins, outs, g.attrs());
    g.contribute(x, dx);
  }
  const TensorRef dw = g.new_grad(w);
  const TensorRef db = has_bias ? g.new_grad(in[2]) : no_ref;
  const TensorRef ins[] = {x, dy};
  const TensorRef outs[] = {dw, db};
  g.emit(grad_param, ".grad_param", ins, std::span(outs, has_bias ? 2 : 1), g.attrs());
  g.contribute(w, dw);
  if (has_bias) g.contribute(in[2], db);
}

double through_storage(DType t, double v) {
  std::uint32_t storage = 0;
  ref::store_float(t, static_cast<float>(v), &storage, 0);
  return ref::load_float(t, &storage, 0);
}

void relu_layer_backward(GradContext& g, OpId grad_input, OpId grad_param, bool relu) {
  if (!relu) {
    weight_layer_backward(g, grad_input, grad_param);
    return;
  }
  const TensorRef y = g.outputs()[0], dy = g.grad(y);
  if (dy == no_ref) return;
  const TensorRef dz = g.new_grad(y);
  const TensorRef ins[] = {y, dy};
  const TensorRef outs[] = {dz};
  g.emit(builtin::activation_grad, ".relu_grad", ins, outs, ActivationAttrs{Activation::relu}.pack());
  weight_layer_backward(g, grad_input, grad_param, dz);
}

void unary_backward(GradContext& g, OpId grad_op, TensorRef saved, const NodeAttrs& attrs) {
  const TensorRef x = g.inputs()[0];
  const TensorRef dy = g.grad(g.outputs()[0]);
  if (dy == no_ref || !g.needs_grad(x)) return;
  const TensorRef dx = g.new_grad(x);
  const TensorRef ins[] = {saved, dy};
  const TensorRef outs[] = {dx};
  g.emit(grad_op, ".grad", saved == no_ref ? std::span(ins).last(1) : std::span(ins), outs, attrs);
  g.contribute(x, dx);
}

bool loss_backward_applies(GradContext& g, TensorRef stats) {
  if (g.is_loss(stats)) return true;
  if (g.grad(stats) != no_ref) {
    throw std::invalid_argument(fmt::format(
        "{}: a loss differentiates only as the step's loss (or a term of a loss_sum), not as an input of another op",
        g.name()));
  }
  return false;
}

void unary_backward(GradContext& g, OpId grad_op, TensorRef saved) {
  unary_backward(g, grad_op, saved, g.attrs());
}

void register_builtin_rows(const AddRow& add) {
  register_transfer_rows(add);
  register_linear_rows(add);
  register_activation_rows(add);
  register_add_row(add);
  register_layernorm_rows(add);
  register_conv2d_rows(add);
  register_pool_rows(add);
  register_softmax_xent_rows(add);
  register_optimizer_rows(add);
  register_cast_rows(add);
  register_quantize_rows(add);
  register_matmul_rows(add);
  register_softmax_rows(add);
  register_permute_rows(add);
  register_mul_rows(add);
  register_scale_rows(add);
  register_embedding_rows(add);
  register_causal_mask_rows(add);
  register_dropout_rows(add);
  register_add_bias_rows(add);
  register_mse_rows(add);
  register_loss_sum_rows(add);
  register_optimizer8bit_rows(add);
  register_predictor_rows(add);
  register_accumulate_rows(add);
  register_overflow_guard_rows(add);
  register_attention_rows(add);
  register_add_layernorm_rows(add);
  register_collective_rows(add);
  register_optimizer_group_rows(add);
}

}  // namespace ferry::ops::table
