// Small models that exercise every layer kind, shared by the graph and residency tests.
#pragma once

#include "ferry/runtime/fashion_mnist.hpp"
#include "ferry/runtime/model.hpp"
#include "test_support.hpp"

namespace ferry::test {

using graph::TensorId;

inline ModelSpec small_mlp() {
  return models::classifier("small-mlp", graph::Shape{1, 4, 5}, 10, [](graph::Builder& b, TensorId x) {
    x = b.flatten(x);
    x = b.relu(b.linear(x, 13));
    return b.linear(x, 10);
  });
}

// `count` random samples of small_mlp's 4 x 5 input with random labels (images from `seed`,
// labels from `seed` + 1): a data source for evaluation.
inline Dataset small_mlp_samples(std::size_t count, std::uint32_t seed) {
  Dataset d;
  d.count = count;
  d.rows = 4;
  d.cols = 5;
  d.images = random_vector(count * 20, seed);
  d.labels = labels_for(count, seed + 1);
  return d;
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
