// The models the CLI and the examples train.
#include <fmt/format.h>

#include "ferry/runtime/model.hpp"

namespace ferry::models {

ModelSpec mlp(std::vector<std::uint32_t> hidden) {
  std::string name = "mlp-784";
  for (auto h : hidden) name += fmt::format("-{}", h);
  name += "-10";
  return {name, graph::Shape{1, 28, 28}, 10, [hidden](graph::Builder& b, TensorId x) {
            x = b.flatten(x);
            for (auto h : hidden) x = b.relu(b.linear(x, h));
            return b.linear(x, 10);
          }};
}

ModelSpec cnn() {
  return {"cnn-conv32-conv64-fc256", graph::Shape{1, 28, 28}, 10, [](graph::Builder& b, TensorId x) {
            x = b.maxpool2d(b.relu(b.conv2d(x, 32, 5, 1, 2)));
            x = b.maxpool2d(b.relu(b.conv2d(x, 64, 5, 1, 2)));
            x = b.relu(b.linear(b.flatten(x), 256));
            return b.linear(x, 10);
          }};
}

ModelSpec deep(std::uint32_t width, std::uint32_t depth) {
  return {fmt::format("deep-residual-w{}-d{}", width, depth), graph::Shape{1, 28, 28}, 10,
          [width, depth](graph::Builder& b, TensorId x) {
            x = b.linear(b.flatten(x), width);
            for (std::uint32_t i = 0; i < depth; ++i) {
              TensorId h = b.linear(b.gelu(b.linear(b.layernorm(x), width)), width);
              x = b.add(x, h);
            }
            return b.linear(b.layernorm(x), 10);
          }};
}

}  // namespace ferry::models
