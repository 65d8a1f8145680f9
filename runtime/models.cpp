// The models the CLI and the examples train, and the forward graph of a model's variant.
#include <fmt/format.h>

#include <cmath>

#include "ferry/runtime/model.hpp"
#include "graph/pipeline.hpp"
#include "trainer_variants.hpp"

namespace ferry {

graph::Graph forward_graph(const ModelSpec& model, const graph::VariantKey& key) {
  if (!model.forward) throw graph::BuildError(fmt::format("model '{}' has no forward function", model.name));
  if (!key.predict && !model.loss) throw graph::BuildError(fmt::format("model '{}' has no loss function", model.name));
  if (model.inputs.empty()) {
    throw graph::BuildError(
        fmt::format("model '{}' has no inputs (ModelSpec::inputs is empty): list what its forward reads, e.g. "
                    "{{\"image\", Shape{{28, 28}}}}",
                    model.name));
  }
  graph::Graph g;
  graph::Builder b(g, key.batch);
  b.set_training(key.training);
  std::vector<TensorId> inputs, targets;
  for (const TensorSpec& s : model.inputs) inputs.push_back(b.input(s.name, s.sample, s.dtype, graph::Role::input));
  const TensorId prediction = model.forward(b, inputs);
  if (key.predict) {
    b.output(prediction, "prediction");
    return g;
  }
  for (const TensorSpec& s : model.targets) targets.push_back(b.input(s.name, s.sample, s.dtype, graph::Role::label));
  const TensorId loss = model.loss(b, prediction, targets);
  b.set_loss(loss);
  return g;
}

namespace models {

ModelSpec classifier(std::string name, graph::Shape sample_shape, std::uint32_t classes,
                     std::function<TensorId(graph::Builder&, TensorId input)> forward) {
  if (classes < 2)
    throw graph::BuildError(fmt::format("classifier '{}' needs at least 2 classes, got {}", name, classes));
  ModelSpec m;
  m.name = std::move(name);
  m.inputs = {TensorSpec{"input", sample_shape, graph::DType::f32}};
  m.targets = {TensorSpec{"labels", graph::Shape{}, graph::DType::i32, classes}};
  m.forward = [forward = std::move(forward), classes](graph::Builder& b, std::span<const TensorId> in) {
    if (in.size() != 1) {
      throw graph::BuildError(fmt::format("classifier: its forward takes one input, given {}", in.size()));
    }
    const TensorId logits = forward(b, in[0]);
    if (logits >= b.graph().tensors.size()) {
      throw graph::BuildError(
          fmt::format("classifier: its forward returned tensor id {}, which does not exist", logits));
    }
    const graph::Shape s = b.graph().tensors.shape[logits];
    if (s.rank != 2 || s[0] != b.batch() || s[1] != classes) {
      throw graph::BuildError(fmt::format("classifier: logits have shape {}, expected [{}, {}] (batch, classes)",
                                          s.str(), b.batch(), classes));
    }
    return logits;
  };
  m.loss = [](graph::Builder& b, TensorId logits, std::span<const TensorId> t) {
    if (t.size() != 1)
      throw graph::BuildError(fmt::format("classifier: its loss takes one target, given {}", t.size()));
    return b.softmax_xent(logits, t[0]);
  };
  return m;
}

ModelSpec mlp(std::vector<std::uint32_t> hidden) {
  std::string name = "mlp-784";
  for (auto h : hidden) name += fmt::format("-{}", h);
  name += "-10";
  return classifier(name, graph::Shape{1, 28, 28}, 10, [hidden](graph::Builder& b, TensorId x) {
    x = b.flatten(x);
    for (auto h : hidden) x = b.relu(b.linear(x, h));
    return b.linear(x, 10);
  });
}

ModelSpec cnn() {
  return classifier("cnn-conv32-conv64-fc256", graph::Shape{1, 28, 28}, 10, [](graph::Builder& b, TensorId x) {
    x = b.maxpool2d(b.relu(b.conv2d(x, 32, 5, 1, 2)));
    x = b.maxpool2d(b.relu(b.conv2d(x, 64, 5, 1, 2)));
    x = b.relu(b.linear(b.flatten(x), 256));
    return b.linear(x, 10);
  });
}

ModelSpec deep(std::uint32_t width, std::uint32_t depth) {
  return classifier(fmt::format("deep-residual-w{}-d{}", width, depth), graph::Shape{1, 28, 28}, 10,
                    [width, depth](graph::Builder& b, TensorId x) {
                      x = b.linear(b.flatten(x), width);
                      for (std::uint32_t i = 0; i < depth; ++i) {
                        TensorId h = b.linear(b.gelu(b.linear(b.layernorm(x), width)), width);
                        x = b.add(x, h);
                      }
                      return b.linear(b.layernorm(x), 10);
                    });
}

namespace {

// The counter RNG's stream of one of block i's dropouts (0: the attention probabilities, 1: the
// attention's output, 2: the MLP's output). The first 500 blocks keep the streams they always had
// (2i, 2i + 1 and 1000 + i, and with them the masks models trained with); those streams meet from
// block 500 on, so later blocks take three each from 1500.
std::uint32_t dropout_stream(std::uint32_t block, std::uint32_t which) {
  if (block < 500) return which == 2 ? 1000 + block : 2 * block + which;
  return 1500 + 3 * (block - 500) + which;
}

// Causal multi-head self-attention over x [B, T, W]: separate q, k, v projections, then either the
// fused op on [B, T, W] (heads side by side) or the unfused path: heads split as [B, H, T, D] by a
// view and a permute, scores scaled by 1/sqrt(D), causal softmax, dropout, the value product.
TensorId attention(graph::Builder& b, TensorId x, const GptConfig& c, std::uint32_t seed) {
  const std::uint32_t batch = b.batch(), t = c.context, w = c.width, h = c.heads, d = w / h;
  auto split = [&](TensorId y) { return b.permute(b.reshape(y, graph::Shape{batch, t, h, d}), {0, 2, 1, 3}); };
  if (c.fused_attention) {
    // The unfused path's layer names are reserved where it takes them (a permute after each
    // projection; softmax, dropout, the value product and a permute after the scores), so both
    // paths name, and initialise, every weight alike.
    const TensorId q = b.linear(x, w);
    b.reserve_layer_names(1);
    const TensorId k = b.linear(x, w);
    b.reserve_layer_names(1);
    const TensorId v = b.linear(x, w);
    b.reserve_layer_names(1);
    const TensorId o = b.attention(q, k, v, h, c.dropout, seed);
    b.reserve_layer_names(4);
    return b.linear(o, w);
  }
  const TensorId q = split(b.linear(x, w));
  const TensorId k = split(b.linear(x, w));
  const TensorId v = split(b.linear(x, w));
  TensorId p = b.softmax(b.matmul(q, k, false, true, 1.0f / std::sqrt(static_cast<float>(d))), /*causal=*/true);
  p = b.dropout(p, c.dropout, seed);
  const TensorId o = b.permute(b.matmul(p, v), {0, 2, 1, 3});  // [B, T, H, D]
  return b.linear(b.reshape(o, graph::Shape{batch, t, w}), w);
}

}  // namespace

ModelSpec gpt(const GptConfig& c) {
  if (c.vocab < 2) throw graph::BuildError(fmt::format("gpt: the vocabulary needs at least 2 tokens, got {}", c.vocab));
  if (c.width == 0 || c.depth == 0 || c.heads == 0 || c.context == 0) {
    throw graph::BuildError(fmt::format("gpt: width ({}), depth ({}), heads ({}) and context ({}) must be at least 1",
                                        c.width, c.depth, c.heads, c.context));
  }
  if (c.width % c.heads != 0) {
    throw graph::BuildError(fmt::format(
        "gpt: width {} is not a multiple of heads {} (each head takes width / heads features)", c.width, c.heads));
  }
  if (!(c.dropout >= 0.0f && c.dropout < 1.0f)) {
    throw graph::BuildError(fmt::format("gpt: dropout must be in [0, 1), got {}", c.dropout));
  }
  ModelSpec m;
  m.name = fmt::format("gpt-v{}-w{}-d{}-h{}-t{}", c.vocab, c.width, c.depth, c.heads, c.context);
  m.inputs = {TensorSpec{"tokens", graph::Shape{c.context}, graph::DType::i32, c.vocab}};
  m.targets = {TensorSpec{"next", graph::Shape{c.context}, graph::DType::i32, c.vocab}};
  m.settings = {{"gpt.dropout", "--dropout", fmt::format("{}", c.dropout)},
                {"gpt.attention", "--attention", c.fused_attention ? "fused" : "unfused"}};
  m.forward = [c](graph::Builder& b, std::span<const TensorId> in) {
    TensorId x = b.embedding(in[0], c.vocab, c.width);
    x = b.add_parameter(x, graph::Shape{c.context, c.width}, 1.0f / std::sqrt(static_cast<float>(c.width)));
    for (std::uint32_t i = 0; i < c.depth; ++i) {
      x = b.add(x, b.dropout(attention(b, b.layernorm(x), c, dropout_stream(i, 0)), c.dropout, dropout_stream(i, 1)));
      const TensorId mlp = b.linear(b.gelu(b.linear(b.layernorm(x), 4 * c.width)), c.width);
      x = b.add(x, b.dropout(mlp, c.dropout, dropout_stream(i, 2)));
    }
    return b.linear(b.layernorm(x), c.vocab);
  };
  m.loss = [](graph::Builder& b, TensorId logits, std::span<const TensorId> t) { return b.softmax_xent(logits, t[0]); };
  return m;
}

}  // namespace models
}  // namespace ferry
