// Forward graph construction: weights and names here, shapes from the op table's rows.
#include "ferry/graph/builder.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/attrs.hpp"

namespace ferry::graph {
namespace {

// The operands of a node being built, for a row's shape rule.
class PendingNode final : public ops::ShapeView {
 public:
  PendingNode(const Graph& g, std::string_view name, std::span<const TensorId> in, const NodeAttrs& attrs)
      : g_(g), name_(name), in_(in), attrs_(attrs) {}
  std::string_view name() const override { return name_; }
  const NodeAttrs& attrs() const override { return attrs_; }
  std::size_t input_count() const override { return in_.size(); }
  std::size_t output_count() const override { return 0; }
  ops::TensorDesc input(std::size_t i) const override { return {g_.tensors.shape[in_[i]], g_.tensors.dtype[in_[i]]}; }
  ops::TensorDesc output(std::size_t) const override {
    throw std::logic_error("a shape rule asked for an output of a node being built");
  }

 private:
  const Graph& g_;
  std::string_view name_;
  std::span<const TensorId> in_;
  const NodeAttrs& attrs_;
};

}  // namespace

Builder::Builder(Graph& g, std::uint32_t batch) : g_(g), batch_(batch) {
  if (batch == 0) throw BuildError("batch size must be at least 1");
}

TensorId Builder::input(std::string name, Shape sample, DType dtype, Role role) {
  if (role != Role::input && role != Role::label) {
    throw BuildError(fmt::format("input '{}': role must be input or label, got {}", name, role_name(role)));
  }
  if (sample.rank > 3) {
    throw BuildError(fmt::format("input '{}': sample shape {} has more than 3 axes", name, sample.str()));
  }
  for (std::size_t i = 0; i < sample.rank; ++i) {
    if (sample[i] == 0)
      throw BuildError(fmt::format("input '{}': sample shape {} has an empty axis", name, sample.str()));
  }
  for (TensorId t = 0; t < g_.tensors.size(); ++t) {
    if (g_.tensors.name[t] == name) throw BuildError(fmt::format("input '{}': a tensor of that name exists", name));
  }
  Shape full;
  full.rank = static_cast<std::uint8_t>(sample.rank + 1);
  full.dims[0] = batch_;
  for (std::size_t i = 0; i < sample.rank; ++i) full.dims[i + 1] = sample[i];
  // The batch arrives in a host mirror (pinned staging the caller fills) and an upload node
  // copies it to the device.
  const TensorId device = g_.tensors.add(name, full, dtype, role);
  const TensorId host = g_.tensors.add(name + "@host", full, dtype, role);
  g_.tensors.home[host] = Home::host_pinned;
  const TensorId ins[] = {host};
  const TensorId outs[] = {device};
  g_.nodes.add(builtin::upload, "upload." + name, ins, outs, {}, Lane::h2d);
  return device;
}

const Shape& Builder::shape(TensorId t) const {
  if (t >= g_.tensors.size()) {
    throw BuildError(
        fmt::format("tensor id {} does not exist (this graph has {} tensors): pass an id a Builder call "
                    "returned for this graph",
                    t, g_.tensors.size()));
  }
  return g_.tensors.shape[t];
}

void Builder::output(TensorId t, std::string name) {
  if (t >= g_.tensors.size()) throw BuildError(fmt::format("output '{}': tensor id {} does not exist", name, t));
  const TensorId host = g_.tensors.add(name + "@host", g_.tensors.shape[t], g_.tensors.dtype[t], Role::output);
  g_.tensors.home[host] = Home::host_pinned;
  const TensorId ins[] = {t};
  const TensorId outs[] = {host};
  g_.nodes.add(builtin::download, "download." + name, ins, outs, {}, Lane::d2h);
}

std::string Builder::next_name(std::string_view kind) {
  return fmt::format("{}{}", kind, layer_count_++);
}

TensorId Builder::weight(std::string name, Shape s, WeightInit init) {
  TensorId t = g_.tensors.add(std::move(name), s, DType::f32, Role::weight);
  g_.tensors.init[t] = init;
  return t;
}

std::vector<TensorId> Builder::emit(ops::OpId op, const std::string& name, std::span<const TensorId> inputs,
                                    const NodeAttrs& attrs, std::initializer_list<const char*> suffixes) {
  const ops::OpInfo& row = ops::op_info(op);
  if (!row.infer)
    throw BuildError(fmt::format("{}: op '{}' has no shape rule, so it cannot be applied", name, row.name));
  if (ops::is_host_lane(row.lane)) {
    // The plan gives activations no host memory: such a node failed at every step instead.
    throw BuildError(fmt::format(
        "{}: op '{}' runs on the {} lane (OpInfo::lane); the ops a model applies run on the device: give its row "
        "Lane::compute and a bind (host-lane rows are for the state updates and transfers ferry places itself)",
        name, row.name, ops::lane_name(row.lane)));
  }
  for (TensorId t : inputs) {
    if (t >= g_.tensors.size()) throw BuildError(fmt::format("{}: input tensor id {} does not exist", name, t));
  }
  std::vector<ops::TensorDesc> outs;
  try {
    outs = row.infer(PendingNode(g_, name, inputs, attrs));
  } catch (const ops::ShapeError& e) {
    throw BuildError(e.what());
  } catch (const std::exception& e) {
    // A user's shape rule that failed some other way: still an error naming the node.
    throw BuildError(fmt::format("{}: the shape rule of op '{}' failed: {}", name, row.name, e.what()));
  }
  for (std::size_t i = 0; i < outs.size(); ++i) {
    // A user's rule may fill a Shape by hand: a rank past its four dimensions, or a dtype no
    // kernel stores, would otherwise be read past their ends further on.
    if (outs[i].shape.rank > outs[i].shape.dims.size()) {
      throw BuildError(
          fmt::format("{}: the shape rule of op '{}' made output {} of rank {}; shapes have at most {} "
                      "dimensions: fold the others into one",
                      name, row.name, i, outs[i].shape.rank, outs[i].shape.dims.size()));
    }
    if (std::find(std::begin(ops::all_dtypes), std::end(ops::all_dtypes), outs[i].dtype) == std::end(ops::all_dtypes)) {
      throw BuildError(
          fmt::format("{}: the shape rule of op '{}' made output {} of dtype {}, which is none of f32, "
                      "f16, bf16, i8, u8 and i32",
                      name, row.name, i, static_cast<int>(outs[i].dtype)));
    }
    if (outs[i].shape.elems() == 0) {
      throw BuildError(fmt::format("{}: the shape rule of op '{}' made output {} of shape {}, which has no elements",
                                   name, row.name, i, outs[i].shape.str()));
    }
  }
  std::vector<TensorId> ids;
  for (std::size_t i = 0; i < outs.size(); ++i) {
    const std::string suffix = i < suffixes.size() ? std::data(suffixes)[i] : fmt::format(".out{}", i);
    ids.push_back(g_.tensors.add(name + suffix, outs[i].shape, outs[i].dtype, Role::activation));
  }
  g_.nodes.add(op, name, inputs, ids, attrs, row.lane);
  return ids;
}

std::vector<TensorId> Builder::apply(ops::OpId op, std::span<const TensorId> inputs, const NodeAttrs& attrs) {
  return emit(op, next_name(ops::op_info(op).name), inputs, attrs, {".y"});
}

TensorId Builder::linear(TensorId x, std::uint32_t out_features, bool bias) {
  const std::string name = next_name("linear");
  const Shape xs = shape(x);  // a copy: adding tensors below reallocates the table
  if (xs.rank < 2) {
    throw BuildError(fmt::format("{}: input {} has shape {}; Linear takes [..., features] of rank 2 to 4", name,
                                 g_.tensors.name[x], xs.str()));
  }
  if (out_features == 0) throw BuildError(fmt::format("{}: out_features must be at least 1", name));
  const std::uint32_t in = xs[xs.rank - 1u];
  // PyTorch's default for Linear: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias.
  const float bound = 1.0f / std::sqrt(static_cast<float>(in));
  TensorId w = weight(name + ".w", Shape{in, out_features}, {WeightInit::Kind::uniform, bound});
  TensorId b = bias ? weight(name + ".b", Shape{out_features}, {WeightInit::Kind::uniform, bound}) : no_tensor;
  const TensorId ins[] = {x, w, b};
  return emit(builtin::linear, name, std::span(ins, bias ? 3 : 2), {}, {".y"})[0];
}

TensorId Builder::activation(TensorId x, ops::Activation a) {
  const TensorId ins[] = {x};
  return emit(builtin::activation, next_name(a == ops::Activation::relu ? "relu" : "gelu"), ins,
              ops::ActivationAttrs{a}.pack(), {".y"})[0];
}

TensorId Builder::layernorm(TensorId x, float eps) {
  const std::string name = next_name("layernorm");
  const Shape xs = shape(x);  // a copy: adding tensors below reallocates the table
  if (xs.rank < 1) throw BuildError(fmt::format("{}: LayerNorm takes a tensor of rank 1 to 4", name));
  const std::uint32_t features = xs[xs.rank - 1u];
  TensorId gamma = weight(name + ".gamma", Shape{features}, {WeightInit::Kind::ones, 0});
  TensorId beta = weight(name + ".beta", Shape{features}, {WeightInit::Kind::zeros, 0});
  const TensorId ins[] = {x, gamma, beta};
  return emit(builtin::layernorm, name, ins, ops::LayerNormAttrs{eps}.pack(), {".y", ".mean", ".rstd"})[0];
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
  const float bound = 1.0f / std::sqrt(static_cast<float>(c * kernel * kernel));
  TensorId w = weight(name + ".w", Shape{out_channels, c, kernel, kernel}, {WeightInit::Kind::uniform, bound});
  TensorId b = weight(name + ".b", Shape{out_channels}, {WeightInit::Kind::uniform, bound});
  const ops::Conv2dAttrs attrs{.stride = static_cast<std::int32_t>(stride), .pad = static_cast<std::int32_t>(pad)};
  const TensorId ins[] = {x, w, b};
  return emit(builtin::conv2d, name, ins, attrs.pack(), {".y"})[0];
}

TensorId Builder::maxpool2d(TensorId x, std::uint32_t window, std::uint32_t stride) {
  const ops::MaxPool2dAttrs attrs{.window = static_cast<std::int32_t>(window),
                                  .stride = static_cast<std::int32_t>(stride)};
  const TensorId ins[] = {x};
  return emit(builtin::maxpool2d, next_name("maxpool"), ins, attrs.pack(), {".y", ".argmax"})[0];
}

TensorId Builder::flatten(TensorId x) {
  const Shape xs = shape(x);  // a copy: adding tensors below reallocates the table
  const auto rest = static_cast<std::uint32_t>(xs.elems() / xs[0]);
  return g_.tensors.add(fmt::format("{}.flat", g_.tensors.name[x]), Shape{xs[0], rest}, g_.tensors.dtype[x],
                        g_.tensors.role[x], x);
}

TensorId Builder::reshape(TensorId x, Shape to) {
  const Shape xs = shape(x);  // a copy: adding tensors below reallocates the table
  if (to.elems() != xs.elems()) {
    throw BuildError(fmt::format("reshape of {}: {} has {} elements, {} has {}", g_.tensors.name[x], xs.str(),
                                 xs.elems(), to.str(), to.elems()));
  }
  return g_.tensors.add(fmt::format("{}.as{}", g_.tensors.name[x], to.str()), to, g_.tensors.dtype[x],
                        g_.tensors.role[x], x);
}

TensorId Builder::permute(TensorId x, std::initializer_list<std::int32_t> perm) {
  const ops::OpId op = builtin::permute;
  NodeAttrs attrs;
  if (perm.size() > attrs.i.size()) throw BuildError("permute: at most 4 axes");
  std::copy(perm.begin(), perm.end(), attrs.i.begin());
  const TensorId ins[] = {x};
  return emit(op, next_name("permute"), ins, attrs, {".y"})[0];
}

TensorId Builder::mul(TensorId a, TensorId b) {
  const ops::OpId op = builtin::mul;
  const TensorId ins[] = {a, b};
  return emit(op, next_name("mul"), ins, {}, {".y"})[0];
}

TensorId Builder::scale(TensorId x, float factor) {
  const ops::OpId op = builtin::scale;
  const TensorId ins[] = {x};
  return emit(op, next_name("scale"), ins, ops::FactorAttrs{factor}.pack(), {".y"})[0];
}

TensorId Builder::matmul(TensorId a, TensorId b, bool transpose_a, bool transpose_b, float scale) {
  const ops::OpId op = builtin::matmul;
  const ops::MatmulAttrs attrs{.transpose_a = transpose_a, .transpose_b = transpose_b, .alpha = scale};
  const TensorId ins[] = {a, b};
  return emit(op, next_name("matmul"), ins, attrs.pack(), {".y"})[0];
}

TensorId Builder::softmax(TensorId x, bool causal) {
  const ops::OpId op = builtin::softmax;
  const TensorId ins[] = {x};
  return emit(op, next_name("softmax"), ins, ops::SoftmaxAttrs{causal}.pack(), {".y"})[0];
}

TensorId Builder::attention(TensorId q, TensorId k, TensorId v, std::uint32_t heads, float dropout_p,
                            std::uint32_t seed) {
  const ops::OpId op = builtin::attention;
  const std::string name = next_name("attention");
  ops::AttentionAttrs attrs{.heads = static_cast<std::int32_t>(heads)};
  if (training_ && dropout_p != 0.0f) {
    attrs.dropout = dropout_p;
    attrs.seed = seed;
  }
  const TensorId ins[] = {q, k, v};
  return emit(op, name, ins, attrs.pack(), {".y", ".lse"})[0];
}

TensorId Builder::embedding(TensorId ids, std::uint32_t vocab, std::uint32_t dim) {
  const ops::OpId op = builtin::embedding;
  const std::string name = next_name("embedding");
  if (vocab == 0 || dim == 0) throw BuildError(fmt::format("{}: vocab and dim must be at least 1", name));
  const TensorId table = weight(name + ".table", Shape{vocab, dim},
                                {WeightInit::Kind::uniform, 1.0f / std::sqrt(static_cast<float>(dim))});
  const TensorId ins[] = {ids, table};
  return emit(op, name, ins, {}, {".y"})[0];
}

TensorId Builder::causal_mask(TensorId scores) {
  const ops::OpId op = builtin::causal_mask;
  const TensorId ins[] = {scores};
  return emit(op, next_name("causal_mask"), ins, {}, {".y"})[0];
}

TensorId Builder::dropout(TensorId x, float p, std::uint32_t seed) {
  const ops::OpId op = builtin::dropout;
  // The name is taken either way, so later layers (and their weights) are named the same in the
  // training and evaluation variants.
  const std::string name = next_name("dropout");
  if (!training_ || p == 0.0f) return x;
  const TensorId ins[] = {x};
  return emit(op, name, ins, ops::DropoutAttrs{.p = p, .seed = seed}.pack(), {".y"})[0];
}

TensorId Builder::add(TensorId a, TensorId b) {
  const TensorId ins[] = {a, b};
  return emit(builtin::add, next_name("add"), ins, {}, {".y"})[0];
}

TensorId Builder::add_parameter(TensorId x, Shape trailing, float init_bound) {
  const ops::OpId op = builtin::add_bias;
  const std::string name = next_name("param");
  const TensorId p = weight(
      name + ".p", trailing,
      init_bound > 0 ? WeightInit{WeightInit::Kind::uniform, init_bound} : WeightInit{WeightInit::Kind::zeros, 0});
  const TensorId ins[] = {x, p};
  return emit(op, name, ins, {}, {".y"})[0];
}

TensorId Builder::softmax_xent(TensorId logits, TensorId labels) {
  const Shape ls = shape(logits), ys = shape(labels);  // copies: views added below reallocate
  bool leading_match = ls.rank == ys.rank + 1;
  for (std::size_t i = 0; leading_match && i < ys.rank; ++i) leading_match = ls[i] == ys[i];
  if (!leading_match || g_.tensors.dtype[labels] != DType::i32) {
    throw BuildError(fmt::format(
        "loss: logits {} need i32 labels of shape {} (one per row of classes), got {} {} ('{}')", ls.str(),
        [&] {
          Shape want = ls;
          want.rank = static_cast<std::uint8_t>(ls.rank - 1);
          return want.str();
        }(),
        dtype_name(g_.tensors.dtype[labels]), ys.str(), g_.tensors.name[labels]));
  }
  // Rows of classes: the op takes [rows, classes] and [rows]; views, not copies.
  const std::uint32_t classes = ls[ls.rank - 1u];
  if (ls.elems() / classes > std::numeric_limits<std::uint32_t>::max()) {
    throw BuildError(fmt::format(
        "loss: logits {} ('{}') have {} rows of classes, more than the {} a shape axis "
        "holds: use a smaller batch (or sequence)",
        ls.str(), g_.tensors.name[logits], ls.elems() / classes, std::numeric_limits<std::uint32_t>::max()));
  }
  const auto rows = static_cast<std::uint32_t>(ls.elems() / classes);
  const TensorId logits2 = ls.rank == 2 ? logits : reshape(logits, Shape{rows, classes});
  const TensorId labels1 = ys.rank == 1 ? labels : reshape(labels, Shape{rows});
  const TensorId ins[] = {logits2, labels1};
  const auto outs = emit(builtin::softmax_xent, loss_name(), ins, {}, {".lse", ".stats"});
  set_loss(outs[1]);
  return outs[1];
}

TensorId Builder::mse(TensorId prediction, TensorId target) {
  const ops::OpId op = builtin::mse;
  const TensorId ins[] = {prediction, target};
  const TensorId stats = emit(op, loss_name(), ins, {}, {".stats"})[0];
  set_loss(stats);
  return stats;
}

TensorId Builder::loss_sum(TensorId a, TensorId b, float wa, float wb) {
  const ops::OpId op = builtin::loss_sum;
  for (TensorId t : {a, b}) {
    if (!is_loss_stats(t)) {
      throw BuildError(fmt::format("loss_sum: '{}' is not the output of a loss op (softmax_xent, mse, loss_sum, ...)",
                                   t < g_.tensors.size() ? g_.tensors.name[t] : std::string("?")));
    }
  }
  const TensorId ins[] = {a, b};
  const TensorId sum = emit(op, next_name("loss_sum"), ins, ops::LossSumAttrs{wa, wb}.pack(), {".y"})[0];
  set_loss(sum);
  return sum;
}

std::string Builder::loss_name() {
  // The first loss is "loss" (its stats "loss.stats"); more losses (terms of a loss_sum) are
  // numbered like layers, so every tensor name stays unique.
  for (TensorId t = 0; t < g_.tensors.size(); ++t) {
    if (g_.tensors.name[t] == "loss.stats") return next_name("loss");
  }
  return "loss";
}

bool Builder::is_loss_stats(TensorId t) const {
  if (t >= g_.tensors.size() || g_.tensors.dtype[t] != DType::f32) return false;
  for (NodeId n = 0; n < g_.nodes.size(); ++n) {
    const auto outs = g_.nodes.outputs(n);
    if (std::find(outs.begin(), outs.end(), t) != outs.end()) {
      return ops::op_info(g_.nodes.op[n]).op_class == ops::OpClass::loss;
    }
  }
  return false;
}

void Builder::set_loss(TensorId loss) {
  if (loss >= g_.tensors.size()) throw BuildError(fmt::format("set_loss: tensor id {} does not exist", loss));
  // The producer must be a loss row: their stats carry the loss in element 0 and their backward
  // rules seed the gradient.
  if (is_loss_stats(loss)) {
    g_.tensors.role[loss] = Role::stats;
    g_.loss = loss;
    return;
  }
  throw BuildError(fmt::format(
      "set_loss: '{}' ({} {}) is not the output of a loss op; a step's loss is a scalar: end the forward pass with "
      "softmax_xent, mse or a user loss row (OpClass::loss)",
      g_.tensors.name[loss], dtype_name(g_.tensors.dtype[loss]), g_.tensors.shape[loss].str()));
}

}  // namespace ferry::graph
