// The built-in rows of the op table, one function per op family (ops/table/<family>.cpp).
// Private to the library.
#pragma once

#include <functional>

#include "ferry/ops/op_table.hpp"

namespace ferry::ops::table {

// Registers a row under the id ops::builtin names for it (each id once; any order).
using AddRow = std::function<void(OpInfo, OpId id)>;

void register_transfer_rows(const AddRow& add);  // upload, download, fetch, write_back, unpack, pack
void register_linear_rows(const AddRow& add);    // linear and its two gradients
void register_activation_rows(const AddRow& add);
void register_add_row(const AddRow& add);  // ops/table/add.cpp: the elementwise sum
void register_layernorm_rows(const AddRow& add);
void register_conv2d_rows(const AddRow& add);
void register_pool_rows(const AddRow& add);
void register_softmax_xent_rows(const AddRow& add);
void register_optimizer_rows(const AddRow& add);
void register_optimizer_group_rows(const AddRow& add);
void register_cast_rows(const AddRow& add);      // cast
void register_quantize_rows(const AddRow& add);  // quantize_i8, dequantize_i8

void register_matmul_rows(const AddRow& add);         // ops/table/matmul.cpp: batched matmul
void register_softmax_rows(const AddRow& add);        // ops/table/softmax.cpp: softmax, optionally causal
void register_attention_rows(const AddRow& add);      // ops/table/attention.cpp: fused causal attention
void register_add_layernorm_rows(const AddRow& add);  // ops/table/layernorm.cpp: residual add + LayerNorm
void register_permute_rows(const AddRow& add);        // ops/table/permute.cpp: a materialised transpose
void register_mul_rows(const AddRow& add);            // ops/table/mul.cpp: elementwise product
void register_scale_rows(const AddRow& add);          // ops/table/scale.cpp: scaling by a constant
void register_embedding_rows(const AddRow& add);      // ops/table/embedding.cpp: embedding lookup
void register_causal_mask_rows(const AddRow& add);    // ops/table/causal_mask.cpp: the causal mask
void register_dropout_rows(const AddRow& add);        // ops/table/dropout.cpp: dropout
void register_add_bias_rows(const AddRow& add);       // ops/table/add_bias.cpp: bias broadcast over leading axes
void register_mse_rows(const AddRow& add);            // ops/table/mse.cpp: mean squared error loss
void register_loss_sum_rows(const AddRow& add);       // ops/table/loss_sum.cpp: two weighted losses
// ops/table/optimizer.cpp: 8-bit block-wise Adam/AdamW (adam8bit_update), on the device only.
void register_optimizer8bit_rows(const AddRow& add);
// ops/table/predictor.cpp: the weight-update predictor's snapshot, fit and apply.
void register_predictor_rows(const AddRow& add);
// ops/table/accumulate.cpp: gradient accumulation's sum and mean.
void register_accumulate_rows(const AddRow& add);
// ops/table/overflow_guard.cpp: the overflow guard's init and per-gradient check.
void register_overflow_guard_rows(const AddRow& add);

// ops/table/collective.cpp: data-parallel gradient send, all-reduce and receive.
void register_collective_rows(const AddRow& add);

// All of the above.
void register_builtin_rows(const AddRow& add);

// Helpers the rows share.
// A copy node's launch: input i to output i, host to device (`to_device`) or back, the host side
// from BindContext::host_in/host_out (ops/table/transfer.cpp).
// Elements [first, first + count) of a tensor.
struct ElementRun {
  std::size_t first = 0, count = 0;
};
LaunchList transfer_copies(const BindContext& c, bool to_device, std::span<const ElementRun> runs = {});
// An optimizer update's share of its weight (ZeRO sharding; graph::append_optimizer): elements
// share_first .. + share_count of the weight and its gradient (UpdateAttrs), against state tensors
// of that many elements. share_count 0: the whole weight.
struct UpdateSlice {
  std::size_t first = 0, count = 0;
};
UpdateSlice update_slice(const ShapeView& c);
// Input i copied to output i in the CPU reference.
void copy_reference(RefContext& c);
// The backward rule of a layer y = f(x, w) [+ b] (Linear, Conv2d): `grad_input` (dy, w) -> dx when
// x needs a gradient, and `grad_param` (x, dy) -> dw [db]; dy is the output's gradient unless given
// (a fused epilogue's rule passes its masked one).
void weight_layer_backward(GradContext& g, OpId grad_input, OpId grad_param, TensorRef dy = no_ref);
// The same for a layer with a ReLU fused into its epilogue when `relu` (the fusion pass's conv2d and
// linear): first the mask dz = dy where y > 0 (exactly where the layer's pre-activation is), as
// an activation_grad node named ".relu_grad", then the layer's gradients of dz.
void relu_layer_backward(GradContext& g, OpId grad_input, OpId grad_param, bool relu);
// A double value through a float store of dtype t and back: what a device tensor of type t keeps.
double through_storage(DType t, double v);
// The backward rule of a one-input op y = f(x): when dy flows and x needs a gradient, one node of
// `grad_op` takes (saved, dy), or (dy) alone when `saved` is no_ref, and gives dx; its attributes
// are the forward node's unless given.
void unary_backward(GradContext& g, OpId grad_op, TensorRef saved = no_ref);
void unary_backward(GradContext& g, OpId grad_op, TensorRef saved, const NodeAttrs& attrs);
// The start of a loss row's backward rule: true when `stats` is the step's loss or a term of it
// (g.loss_weight(stats) is then its weight). False when it is not, so the rule does nothing; a
// gradient flowing into it from another op is an error, since a loss's backward is only its seed.
bool loss_backward_applies(GradContext& g, TensorRef stats);
// A shape error that names the node: "<node>: <what>".
[[noreturn]] void shape_error(const ShapeView& v, const std::string& what);
// A shape error unless the node has `n` inputs; `op` names the op in the message.
void expect_inputs(const ShapeView& v, std::size_t n, const char* op);
// Elements of input i / output i.
inline std::size_t in_elems(const ShapeView& v, std::size_t i) {
  return v.input(i).shape.elems();
}
inline std::size_t out_elems(const ShapeView& v, std::size_t i) {
  return v.output(i).shape.elems();
}

}  // namespace ferry::ops::table
