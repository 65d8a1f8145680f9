// Builds the forward part of a step graph, layer by layer, checking shapes as it goes.
//
// Weights are created by the layer helpers with names derived from the layer's position
// ("linear3.w"), so rebuilding the same model for another batch size or phase yields the same
// parameter names, which is how variants of one model share their weights.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "ferry/graph/ir.hpp"
#include "ferry/ops/activation.hpp"

namespace ferry::graph {

// Thrown for a model that cannot be built (wrong shapes, bad attributes). The message names the
// layer and the shapes involved.
class BuildError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

class Builder {
 public:
  // A graph over batches of `batch` samples; inputs are declared with input().
  explicit Builder(Graph& g, std::uint32_t batch);

  // A batch tensor the caller supplies each step: [batch, sample...] of `dtype` on the device,
  // filled from the host mirror "<name>@host" by an upload node (graph::CompiledStep::host_input).
  // `role` is Role::input for model inputs and Role::label for loss targets (not uploaded when a
  // variant only predicts). `sample` may be rank 0 (one value per sample) to 3.
  TensorId input(std::string name, Shape sample, DType dtype = DType::f32, Role role = Role::input);
  // Marks `t` as a result the host reads after the step: a download node copies it into the host
  // mirror "<name>@host" (graph::CompiledStep::host_output).
  void output(TensorId t, std::string name);

  std::uint32_t batch() const { return batch_; }
  const Graph& graph() const { return g_; }

  // Layers. Each returns the output tensor; names are "<kind><index>".
  // Linear over the last axis: x [..., in] (rank 2 to 4) -> [..., out_features].
  TensorId linear(TensorId x, std::uint32_t out_features, bool bias = true);
  TensorId relu(TensorId x) { return activation(x, ops::Activation::relu); }
  TensorId gelu(TensorId x) { return activation(x, ops::Activation::gelu); }
  TensorId activation(TensorId x, ops::Activation a);
  // LayerNorm over the last axis of a tensor of any rank.
  TensorId layernorm(TensorId x, float eps = 1e-5f);
  TensorId conv2d(TensorId x, std::uint32_t out_channels, std::uint32_t kernel, std::uint32_t stride = 1,
                  std::uint32_t pad = 0);
  TensorId maxpool2d(TensorId x, std::uint32_t window = 2, std::uint32_t stride = 2);
  TensorId flatten(TensorId x);
  // A view of x with another shape of the same element count (no node, no copy).
  TensorId reshape(TensorId x, Shape to);
  TensorId add(TensorId a, TensorId b);
  // x plus a learned tensor of shape `trailing` (x's last axes) broadcast over x's leading axes:
  // a learned positional embedding [T, W] on activations [B, T, W]. Initialised to zeros unless
  // `init_bound` > 0 (uniform in +-init_bound). The weight is "<name>.p".
  TensorId add_parameter(TensorId x, Shape trailing, float init_bound = 0.0f);
  // Layout and elementwise ops (named rows of the op table).
  // y with x's axes reordered: y.shape[k] = x.shape[perm[k]] (a copy; rank 2 to 4).
  TensorId permute(TensorId x, std::initializer_list<std::int32_t> perm);
  TensorId mul(TensorId a, TensorId b);      // elementwise product, same shapes
  TensorId scale(TensorId x, float factor);  // x * factor
  // Batched product of two activations: a [..., M, K] x b [..., K, N] -> [..., M, N] (same
  // leading axes; rank 2 to 4), either operand transposed, times `scale` (attention's 1/sqrt(d)).
  TensorId matmul(TensorId a, TensorId b, bool transpose_a = false, bool transpose_b = false, float scale = 1.0f);
  // Softmax over the last axis. causal: of square scores [..., T, T], row i over columns 0..i
  // only (the rest 0): softmax(causal_mask(x)) in one op.
  TensorId softmax(TensorId x, bool causal = false);
  // Fused causal multi-head attention (the op table's "attention" row): q, k, v [B, T, heads x d]
  // (heads side by side in the last axis, as linear layers give them) -> [B, T, heads x d], the
  // same as softmax(causal, q kᵀ / sqrt(d)) v per head, with dropout p on the probabilities
  // (seeded like dropout(); none in evaluation graphs), without a [T, T] tensor in memory.
  TensorId attention(TensorId q, TensorId k, TensorId v, std::uint32_t heads, float dropout_p = 0.0f,
                     std::uint32_t seed = 0);

  // Sequence ops (named rows). A table [vocab, dim] looked up by i32 ids [...] -> [..., dim];
  // ids outside [0, vocab) read zeros on the device (validate them where the batch is staged).
  TensorId embedding(TensorId ids, std::uint32_t vocab, std::uint32_t dim);
  // scores [..., T, T] with every (i, j > i) set to -inf, for a following softmax.
  TensorId causal_mask(TensorId scores);
  // x * m / (1 - p), m drawn per step and element from `seed`; the identity in graphs built
  // with training(false) (evaluation) and for p = 0.
  TensorId dropout(TensorId x, float p, std::uint32_t seed);
  // Takes the next n layer names unused. Names carry a count of the layers built so far
  // ("linear7"), and weights are named, and initialised, after their layer: a model with two ways
  // of building one part (models::gpt's fused and unfused attention) reserves the names the other
  // way takes, so that every later weight keeps its name and checkpoints move between the two.
  void reserve_layer_names(std::uint32_t n) { layer_count_ += n; }
  // Whether the graph being built trains (dropout is active); true unless set.
  void set_training(bool training) { training_ = training; }
  bool training() const { return training_; }

  // Losses. Each returns its stats tensor, whose element 0 is the loss, and makes it the graph's
  // loss (the last one built wins; see set_loss).
  // Softmax cross-entropy of logits [..., classes] against i32 labels [...] (the same leading
  // axes: one label per sample, or per position of a sequence), averaged over every label.
  // Stats [2]: mean loss, count of argmax hits.
  TensorId softmax_xent(TensorId logits, TensorId labels);
  // Mean squared error of a prediction against a target of the same shape. Stats [1].
  TensorId mse(TensorId prediction, TensorId target);
  // wa a + wb b of two losses built above (their stats), e.g. a main and an auxiliary loss; each
  // term's gradient is scaled by its weight. Sums nest. Stats [1]. Throws BuildError if a or b is
  // not a loss's stats.
  TensorId loss_sum(TensorId a, TensorId b, float wa = 1.0f, float wb = 1.0f);
  // The tensor autodiff differentiates: a loss's stats. Throws BuildError for anything else
  // (a tensor that is not the stats of a loss op: reduce it with a loss first).
  void set_loss(TensorId loss);

  // Any op of the table (a user's row included) on existing tensors: the row's shape rule makes
  // the outputs, named "<name>.y", "<name>.out1", ... after the node "<row name><index>".
  // Throws BuildError naming the node when the shape rule rejects the operands.
  std::vector<TensorId> apply(ops::OpId op, std::span<const TensorId> inputs, const NodeAttrs& attrs = {});

 private:
  // Adds node `name` running `op` on `inputs`, with outputs from the row's shape rule named
  // "<name><suffix>" (suffixes beyond the list: ".out<i>").
  std::vector<TensorId> emit(ops::OpId op, const std::string& name, std::span<const TensorId> inputs,
                             const NodeAttrs& attrs, std::initializer_list<const char*> suffixes);
  std::string next_name(std::string_view kind);
  bool is_loss_stats(TensorId t) const;  // t is an f32 output of a loss-class row
  std::string loss_name();               // "loss", then "loss<n>"
  TensorId weight(std::string name, Shape s, WeightInit init);
  // Throws BuildError when `t` is not a tensor of this builder's graph (every layer reads its
  // inputs' shapes through it first).
  const Shape& shape(TensorId t) const;

  Graph& g_;
  std::uint32_t batch_;
  std::uint32_t layer_count_ = 0;
  bool training_ = true;
};

}  // namespace ferry::graph
