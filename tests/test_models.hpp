// Small models that exercise every layer kind, shared by the graph and residency tests.
#pragma once

#include "ferry/runtime/model.hpp"

namespace ferry::test {

using graph::TensorId;

inline ModelSpec small_mlp() {
  return models::classifier("small-mlp", graph::Shape{1, 4, 5}, 10, [](graph::Builder& b, TensorId x) {
    x = b.flatten(x);
    x = b.relu(b.linear(x, 13));
    return b.linear(x, 10);
  });
}

inline ModelSpec small_cnn() {
  return models::classifier("small-cnn", graph::Shape{1, 8, 8}, 10, [](graph::Builder& b, TensorId x) {
    x = b.maxpool2d(b.relu(b.conv2d(x, 3, 3, 1, 1)));
    x = b.maxpool2d(b.relu(b.conv2d(x, 4, 3, 1, 1)), 2, 1);
    return b.linear(b.flatten(x), 10);
  });
}

// Residual blocks, LayerNorm, GELU and a tensor used twice (gradient summation).
inline ModelSpec small_residual() {
  return models::classifier("small-residual", graph::Shape{12}, 10, [](graph::Builder& b, TensorId x) {
    x = b.linear(x, 9);
    for (int i = 0; i < 2; ++i) x = b.add(x, b.linear(b.gelu(b.linear(b.layernorm(x), 7)), 9));
    return b.linear(b.layernorm(x), 10);
  });
}

}  // namespace ferry::test
