// A model: its batch tensors (inputs, and the targets its loss compares against), a forward
// function that builds its layers and a loss. The functions are replayed for each compiled
// variant (training, evaluation and prediction at other batch sizes), always creating the same
// parameter names.
#pragma once

#include <functional>
#include <span>
#include <string>
#include <vector>

#include "ferry/graph/builder.hpp"
#include "ferry/runtime/training_setting.hpp"

namespace ferry {

using graph::TensorId;

// One batch tensor, per sample.
struct TensorSpec {
  std::string name;
  graph::Shape sample;  // rank 0 (one value per sample) to 3
  graph::DType dtype = graph::DType::f32;
  // i32 only: every value must lie in [0, id_limit) (class labels, token ids), checked on the host
  // before a step runs. 0: not checked.
  std::uint32_t id_limit = 0;
  std::size_t sample_bytes() const { return sample.elems() * graph::dtype_bytes(dtype); }
};

struct ModelSpec {
  std::string name;
  std::vector<TensorSpec> inputs;   // what forward reads
  std::vector<TensorSpec> targets;  // what the loss reads besides the prediction (labels)
  // Builds the layers from the inputs (in `inputs` order) and returns the prediction.
  std::function<TensorId(graph::Builder&, std::span<const TensorId> inputs)> forward;
  // The loss of the prediction against the targets (in `targets` order): a Builder loss such as
  // softmax_xent or mse, or a user's loss row made the loss with Builder::set_loss.
  std::function<TensorId(graph::Builder&, TensorId prediction, std::span<const TensorId> targets)> loss;
  // Options of the model that decide what it computes and do not show in its parameters' names
  // and shapes (dropout, which attention path): ranks must agree on them and a checkpoint keeps
  // them (ferry/runtime/training_setting.hpp).
  std::vector<TrainingSetting> settings;
};

namespace models {

// A classifier: input "input" f32 [sample_shape], target "labels" i32 in [0, classes), softmax
// cross-entropy of the logits [batch, classes] that `forward` returns.
ModelSpec classifier(std::string name, graph::Shape sample_shape, std::uint32_t classes,
                     std::function<TensorId(graph::Builder&, TensorId input)> forward);

// Fully connected: flatten, then Linear + ReLU per hidden width, then Linear to the classes.
ModelSpec mlp(std::vector<std::uint32_t> hidden = {1024, 1024});

// Two conv layers: conv5x5(32)-ReLU-maxpool2, conv5x5(64)-ReLU-maxpool2, Linear(256)-ReLU, Linear.
ModelSpec cnn();

// A deep residual MLP: Linear(784 -> width), then `depth` blocks of
// x + Linear(GELU(Linear(LayerNorm(x)))) with hidden size `width`, then LayerNorm and Linear.
ModelSpec deep(std::uint32_t width = 1024, std::uint32_t depth = 16);

// A GPT-style decoder over token ids: token embedding plus a learned position embedding, `depth`
// pre-LayerNorm blocks of causal self-attention (`heads` heads) and a GELU MLP (4 x width), a
// final LayerNorm and a linear head to the vocabulary. Input "tokens" i32 [context], target
// "next" i32 [context] (the following token at each position), softmax cross-entropy over every
// position; the prediction is the logits [context, vocab].
struct GptConfig {
  std::uint32_t vocab = 0;
  std::uint32_t width = 192, depth = 4, heads = 4, context = 128;
  float dropout = 0.0f;
  // Attention as one fused op (Builder::attention: no [T, T] tensors, head dimension up to 128)
  // or as the unfused reference path (batched matmuls, causal softmax, dropout). The parameters
  // are the same either way, so a checkpoint moves between the two where the loader accepts
  // another setting (LoadOptions::accept_other_settings): the results differ by f32 rounding.
  bool fused_attention = true;
};
ModelSpec gpt(const GptConfig& config);

}  // namespace models
}  // namespace ferry
