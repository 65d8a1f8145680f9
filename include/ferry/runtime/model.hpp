// A model: a classifier's sample shape, its classes and a forward function that builds its
// layers. The forward function is replayed for each compiled variant (training, evaluation at
// another batch size), always creating the same parameter names.
#pragma once

#include <functional>
#include <string>

#include "ferry/graph/builder.hpp"

namespace ferry {

using graph::TensorId;

struct ModelSpec {
  std::string name;
  graph::Shape sample_shape;  // e.g. {1, 28, 28}
  std::uint32_t classes = 10;
  // Builds the layers from the input and returns the logits [batch, classes].
  std::function<TensorId(graph::Builder&, TensorId input)> forward;
};

namespace models {

// Fully connected: flatten, then Linear + ReLU per hidden width, then Linear to the classes.
ModelSpec mlp(std::vector<std::uint32_t> hidden = {1024, 1024});

// Two conv layers: conv5x5(32)-ReLU-maxpool2, conv5x5(64)-ReLU-maxpool2, Linear(256)-ReLU, Linear.
ModelSpec cnn();

// A deep residual MLP: Linear(784 -> width), then `depth` blocks of
// x + Linear(GELU(Linear(LayerNorm(x)))) with hidden size `width`, then LayerNorm and Linear.
ModelSpec deep(std::uint32_t width = 1024, std::uint32_t depth = 16);

}  // namespace models
}  // namespace ferry
