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
  // A classifier over samples of `sample_shape` (e.g. {1, 28, 28}) into `classes` classes, for
  // batches of `batch`. Creates the input and label tensors and the upload node.
  Builder(Graph& g, std::uint32_t batch, Shape sample_shape, std::uint32_t classes);

  TensorId input() const { return input_; }
  TensorId labels() const { return labels_; }
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
  // Layout and elementwise ops (named rows of the op table).
  // y with x's axes reordered: y.shape[k] = x.shape[perm[k]] (a copy; rank 2 to 4).
  TensorId permute(TensorId x, std::initializer_list<std::int32_t> perm);
  TensorId mul(TensorId a, TensorId b);      // elementwise product, same shapes
  TensorId scale(TensorId x, float factor);  // x * factor
  // Batched product of two activations: a [..., M, K] x b [..., K, N] -> [..., M, N] (same
  // leading axes; rank 2 to 4), either operand transposed, times `scale` (attention's 1/sqrt(d)).
  TensorId matmul(TensorId a, TensorId b, bool transpose_a = false, bool transpose_b = false, float scale = 1.0f);
  // Softmax over the last axis.
  TensorId softmax(TensorId x);

  // Sequence ops (named rows). A table [vocab, dim] looked up by i32 ids [...] -> [..., dim];
  // ids outside [0, vocab) read zeros on the device (validate them where the batch is staged).
  TensorId embedding(TensorId ids, std::uint32_t vocab, std::uint32_t dim);
  // scores [..., T, T] with every (i, j > i) set to -inf, for a following softmax.
  TensorId causal_mask(TensorId scores);
  // x * m / (1 - p), m drawn per step and element from `seed`; the identity in graphs built
  // with training(false) (evaluation) and for p = 0.
  TensorId dropout(TensorId x, float p, std::uint32_t seed);
  // Whether the graph being built trains (dropout is active); true unless set.
  void set_training(bool training) { training_ = training; }
  bool training() const { return training_; }

  // Ends the forward pass: softmax cross-entropy of `logits` [batch, classes] against the labels.
  // Returns the stats tensor ([2]: mean loss, correct count), which becomes the graph's loss.
  TensorId softmax_xent(TensorId logits);

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
  TensorId weight(std::string name, Shape s, WeightInit init);
  const Shape& shape(TensorId t) const { return g_.tensors.shape[t]; }

  Graph& g_;
  std::uint32_t batch_, classes_;
  TensorId input_, labels_;
  std::uint32_t layer_count_ = 0;
  bool training_ = true;
};

}  // namespace ferry::graph
