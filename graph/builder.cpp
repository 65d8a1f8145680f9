// Forward graph construction with shape checking.
#include "ferry/graph/builder.hpp"

#include <fmt/format.h>

#include <cmath>

namespace ferry::graph {

Builder::Builder(Graph& g, std::uint32_t batch, Shape sample_shape, std::uint32_t classes)
    : g_(g), batch_(batch), classes_(classes) {
  if (batch == 0) throw BuildError("batch size must be at least 1");
  if (classes < 2) throw BuildError(fmt::format("a classifier needs at least 2 classes, got {}", classes));
  if (sample_shape.rank == 0 || sample_shape.rank > 3) {
    throw BuildError(fmt::format("sample shape {} must have 1 to 3 dimensions", sample_shape.str()));
  }
  Shape in;
  in.rank = static_cast<std::uint8_t>(sample_shape.rank + 1);
  in.dims[0] = batch;
  for (std::size_t i = 0; i < sample_shape.rank; ++i) in.dims[i + 1] = sample_shape[i];
  input_ = g_.tensors.add("input", in, DType::f32, Role::input);
  labels_ = g_.tensors.add("labels", Shape{batch}, DType::i32, Role::label);
  const TensorId outs[] = {input_, labels_};
  g_.nodes.add(OpKind::upload, "upload", {}, outs, {}, Lane::h2d);
}

std::string Builder::next_name(std::string_view kind) {
  return fmt::format("{}{}", kind, layer_count_++);
}

TensorId Builder::weight(std::string name, Shape s, WeightInit init) {
  TensorId t = g_.tensors.add(std::move(name), s, DType::f32, Role::weight);
  g_.tensors.init[t] = init;
  return t;
}

TensorId Builder::activation_tensor(std::string name, Shape s) {
  return g_.tensors.add(std::move(name), s, DType::f32, Role::activation);
}

TensorId Builder::linear(TensorId x, std::uint32_t out_features, bool bias) {
  const std::string name = next_name("linear");
  const Shape xs = shape(x);  // a copy: adding tensors below reallocates the table
  if (xs.rank != 2) {
    throw BuildError(fmt::format("{}: input {} has shape {}; Linear takes [batch, features] (add flatten() first)",
                                 name, g_.tensors.name[x], xs.str()));
  }
  if (out_features == 0) throw BuildError(fmt::format("{}: out_features must be at least 1", name));
  const std::uint32_t in = xs[1];
  // PyTorch's default for Linear: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias.
  const float bound = 1.0f / std::sqrt(static_cast<float>(in));
  TensorId w = weight(name + ".w", Shape{in, out_features}, {WeightInit::Kind::uniform, bound});
  TensorId b = bias ? weight(name + ".b", Shape{out_features}, {WeightInit::Kind::uniform, bound}) : no_tensor;
  TensorId y = activation_tensor(name + ".y", Shape{xs[0], out_features});
  const TensorId ins[] = {x, w, b};
  const TensorId outs[] = {y};
  g_.nodes.add(OpKind::linear, name, std::span(ins, bias ? 3 : 2), outs);
  return y;
}

TensorId Builder::activation(TensorId x, ops::Activation a) {
  const std::string name = next_name(a == ops::Activation::relu ? "relu" : "gelu");
  TensorId y = activation_tensor(name + ".y", shape(x));
  NodeAttrs attrs;
  attrs.i[0] = static_cast<std::int32_t>(a);
  const TensorId ins[] = {x};
  const TensorId outs[] = {y};
  g_.nodes.add(OpKind::activation, name, ins, outs, attrs);
  return y;
}

TensorId Builder::layernorm(TensorId x, float eps) {
  const std::string name = next_name("layernorm");
  const Shape xs = shape(x);  // a copy: adding tensors below reallocates the table
  if (xs.rank != 2)
    throw BuildError(fmt::format("{}: input has shape {}; LayerNorm takes [batch, features]", name, xs.str()));
  if (!(eps > 0.0f)) throw BuildError(fmt::format("{}: eps must be positive, got {}", name, eps));
  TensorId gamma = weight(name + ".gamma", Shape{xs[1]}, {WeightInit::Kind::ones, 0});
  TensorId beta = weight(name + ".beta", Shape{xs[1]}, {WeightInit::Kind::zeros, 0});
  TensorId y = activation_tensor(name + ".y", xs);
  TensorId mean = activation_tensor(name + ".mean", Shape{xs[0]});
  TensorId rstd = activation_tensor(name + ".rstd", Shape{xs[0]});
  NodeAttrs attrs;
  attrs.f[0] = eps;
  const TensorId ins[] = {x, gamma, beta};
  const TensorId outs[] = {y, mean, rstd};
  g_.nodes.add(OpKind::layernorm, name, ins, outs, attrs);
  return y;
}

TensorId Builder::conv2d(TensorId x, std::uint32_t out_channels, std::uint32_t kernel, std::uint32_t stride,
                         std::uint32_t pad) {
  const std::string name = next_name("conv");
  const Shape xs = shape(x);  // a copy: adding tensors below reallocates the table
  if (xs.rank != 4) throw BuildError(fmt::format("{}: input has shape {}; Conv2d takes [N, C, H, W]", name, xs.str()));
  if (out_channels == 0 || kernel == 0 || stride == 0) {
    throw BuildError(fmt::format("{}: out_channels, kernel and stride must be at least 1", name));
  }
  if (xs[2] + 2 * pad < kernel || xs[3] + 2 * pad < kernel) {
    throw BuildError(
        fmt::format("{}: kernel {} is larger than the padded input {} (pad {})", name, kernel, xs.str(), pad));
  }
  const std::uint32_t c = xs[1];
  const std::uint32_t p = (xs[2] + 2 * pad - kernel) / stride + 1;
  const std::uint32_t q = (xs[3] + 2 * pad - kernel) / stride + 1;
  const float bound = 1.0f / std::sqrt(static_cast<float>(c * kernel * kernel));
  TensorId w = weight(name + ".w", Shape{out_channels, c, kernel, kernel}, {WeightInit::Kind::uniform, bound});
  TensorId b = weight(name + ".b", Shape{out_channels}, {WeightInit::Kind::uniform, bound});
  TensorId y = activation_tensor(name + ".y", Shape{xs[0], out_channels, p, q});
  NodeAttrs attrs;
  attrs.i[0] = static_cast<std::int32_t>(stride);
  attrs.i[1] = static_cast<std::int32_t>(pad);
  const TensorId ins[] = {x, w, b};
  const TensorId outs[] = {y};
  g_.nodes.add(OpKind::conv2d, name, ins, outs, attrs);
  return y;
}

TensorId Builder::maxpool2d(TensorId x, std::uint32_t window, std::uint32_t stride) {
  const std::string name = next_name("maxpool");
  const Shape xs = shape(x);  // a copy: adding tensors below reallocates the table
  if (xs.rank != 4)
    throw BuildError(fmt::format("{}: input has shape {}; MaxPool2d takes [N, C, H, W]", name, xs.str()));
  if (window == 0 || stride == 0 || xs[2] < window || xs[3] < window) {
    throw BuildError(fmt::format("{}: window {} / stride {} do not fit input {}", name, window, stride, xs.str()));
  }
  const Shape ys{xs[0], xs[1], (xs[2] - window) / stride + 1, (xs[3] - window) / stride + 1};
  TensorId y = activation_tensor(name + ".y", ys);
  TensorId argmax = g_.tensors.add(name + ".argmax", ys, DType::i32, Role::activation);
  NodeAttrs attrs;
  attrs.i[0] = static_cast<std::int32_t>(window);
  attrs.i[1] = static_cast<std::int32_t>(stride);
  const TensorId ins[] = {x};
  const TensorId outs[] = {y, argmax};
  g_.nodes.add(OpKind::maxpool2d, name, ins, outs, attrs);
  return y;
}

TensorId Builder::flatten(TensorId x) {
  const Shape xs = shape(x);  // a copy: adding tensors below reallocates the table
  const auto rest = static_cast<std::uint32_t>(xs.elems() / xs[0]);
  return g_.tensors.add(fmt::format("{}.flat", g_.tensors.name[x]), Shape{xs[0], rest}, g_.tensors.dtype[x],
                        g_.tensors.role[x], x);
}

TensorId Builder::add(TensorId a, TensorId b) {
  const std::string name = next_name("add");
  if (!(shape(a) == shape(b))) {
    throw BuildError(fmt::format("{}: shapes differ: {} is {}, {} is {}", name, g_.tensors.name[a], shape(a).str(),
                                 g_.tensors.name[b], shape(b).str()));
  }
  TensorId y = activation_tensor(name + ".y", shape(a));
  const TensorId ins[] = {a, b};
  const TensorId outs[] = {y};
  g_.nodes.add(OpKind::add, name, ins, outs);
  return y;
}

TensorId Builder::softmax_xent(TensorId logits) {
  const Shape ls = shape(logits);
  if (ls.rank != 2 || ls[0] != batch_ || ls[1] != classes_) {
    throw BuildError(
        fmt::format("loss: logits have shape {}, expected [{}, {}] (batch, classes)", ls.str(), batch_, classes_));
  }
  TensorId probs = activation_tensor("loss.probs", ls);
  TensorId stats = g_.tensors.add("loss.stats", Shape{2}, DType::f32, Role::stats);
  const TensorId ins[] = {logits, labels_};
  const TensorId outs[] = {probs, stats};
  g_.nodes.add(OpKind::softmax_xent, "loss", ins, outs);
  return stats;
}

}  // namespace ferry::graph
