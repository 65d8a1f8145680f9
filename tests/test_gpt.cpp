// The character-level GPT (models::gpt) and its data: the model trains on the device like the
// reference executor, its gradients match finite differences, streamed training is bit-identical
// to resident, prediction is causal, and bad input (token ids, shapes, corpora) is a clear error.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>

#include "ferry/ferry.hpp"
#include "ferry/runtime/text_corpus.hpp"
#include "ops/attention.hpp"
#include "ops/attrs.hpp"
#include "reference_executor.hpp"
#include "runtime/trainer_internals.hpp"
#include "runtime/trainer_variants.hpp"
#include "test_support.hpp"
#include "train_check.hpp"
#include "unprivileged.hpp"

namespace ferry::test {
namespace {

namespace fs = std::filesystem;

models::GptConfig tiny_config() {
  models::GptConfig c;
  c.vocab = 11;
  c.width = 8;
  c.depth = 2;
  c.heads = 2;
  c.context = 6;
  return c;
}

std::vector<std::int32_t> random_ids(std::size_t n, std::uint32_t vocab, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::int32_t> v(n);
  for (auto& x : v) x = static_cast<std::int32_t>(rng() % vocab);
  return v;
}

Batch token_batch(const std::vector<std::int32_t>& tokens, const std::vector<std::int32_t>& next) {
  return Batch{{"tokens", HostView(std::span<const std::int32_t>(tokens))},
               {"next", HostView(std::span<const std::int32_t>(next))}};
}

TrainerOptions gpt_options(std::uint32_t batch) {
  TrainerOptions o;
  o.batch = batch;
  o.lr = 0.01f;
  return o;
}

// SGD: the key projection's bias has a zero gradient (softmax ignores a constant added to a row of
// scores), and Adam would turn the rounding noise there into full-size steps.
TrainerOptions reference_options(std::uint32_t batch) {
  TrainerOptions o = gpt_options(batch);
  o.optimizer.kind = ops::OptimizerConfig::Kind::sgd;
  o.lr = 0.1f;
  return o;
}

// `steps` steps of the trainer and the CPU reference on the same token batches: the losses within
// `loss_tolerance` (relative) and the parameters within 1e-4 at the end.
void train_like_the_reference(Trainer& trainer, const models::GptConfig& c, std::uint32_t steps,
                              double loss_tolerance) {
  const std::uint32_t batch = trainer.options().batch;
  ReferenceExecutor ref(compiled_train_step(trainer).graph(), trainer.options().optimizer);
  load_parameters(ref, trainer);
  for (std::uint32_t s = 0; s < steps; ++s) {
    const auto tokens = random_ids(batch * c.context, c.vocab, 10 + s),
               next = random_ids(batch * c.context, c.vocab, 20 + s);
    const StepResult r = trainer.step(token_batch(tokens, next));
    ASSERT_FALSE(r.overflow) << "step " << s;
    ref.ints(ref.find("tokens")) = tokens;
    ref.ints(ref.find("next")) = next;
    ops::StepInfo info{s + 1, trainer.lr()};
    info.loss_scale = r.loss_scale;
    ref.run(info);
    EXPECT_NEAR(r.loss, ref.loss(), loss_tolerance * std::max(1.0, std::abs(ref.loss()))) << "step " << s;
  }
  expect_parameters_match(trainer, ref, 1e-4);
}

TEST(Gpt, TrainsOnTheDeviceLikeTheReference) {
  Runtime rt;
  const auto c = tiny_config();
  Trainer trainer(rt, models::gpt(c), reference_options(3));
  train_like_the_reference(trainer, c, 4, 1e-4);
}

// Mixed precision: the fused attention reads its narrow q, k, v and writes a narrow o (no casts
// around it; its log-sum-exp stays f32), and training matches the reference, which rounds every
// narrow tensor as the device stores it.
TEST(Gpt, NarrowPrecisionAttentionTrainsLikeTheReference) {
  for (const graph::DType narrow : {graph::DType::bf16, graph::DType::f16}) {
    SCOPED_TRACE(ops::dtype_name(narrow));
    Runtime rt;
    const auto c = tiny_config();
    TrainerOptions o = reference_options(3);
    o.precision.compute = narrow;
    o.precision.initial_scale = 1024.0f;
    Trainer trainer(rt, models::gpt(c), o);
    const graph::Graph& g = compiled_train_step(trainer).graph();
    std::size_t attentions = 0;
    for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
      if (ops::op_info(g.nodes.op[n]).name != "attention") continue;
      ++attentions;
      for (const graph::TensorId x : g.nodes.inputs(n)) EXPECT_EQ(g.tensors.dtype[x], narrow) << g.tensors.name[x];
      EXPECT_EQ(g.tensors.dtype[g.nodes.outputs(n)[0]], narrow);
      EXPECT_EQ(g.tensors.dtype[g.nodes.outputs(n)[1]], graph::DType::f32) << "the log-sum-exp";
    }
    EXPECT_EQ(attentions, c.depth);
    train_like_the_reference(trainer, c, 3, 2e-4);
  }
}

TEST(Gpt, ReferenceGradientsMatchFiniteDifferences) {
  const auto c = tiny_config();
  const std::uint32_t batch = 2;
  ops::OptimizerConfig sgd;
  sgd.kind = ops::OptimizerConfig::Kind::sgd;
  const graph::Graph g = training_graph(models::gpt(c), batch, sgd);
  ReferenceExecutor ref(g, sgd);
  randomize_weights(ref, g, 3, -0.5f, 0.5f);
  ref.ints(ref.find("tokens")) = random_ids(batch * c.context, c.vocab, 1);
  ref.ints(ref.find("next")) = random_ids(batch * c.context, c.vocab, 2);
  ref.run(ops::StepInfo{1, 0.0f});
  // Every weight: embeddings, positions, LayerNorms, attention and MLP projections, the head.
  std::size_t checked = 0;
  for (TensorId w = 0; w < g.tensors.size(); ++w) {
    if (g.tensors.role[w] != graph::Role::weight) continue;
    ASSERT_NE(g.tensors.grad[w], graph::no_tensor) << g.tensors.name[w];
    expect_reference_gradient_matches_finite_differences(ref, w, g.tensors.grad[w], g.tensors.name[w], 4);
    ++checked;
  }
  EXPECT_EQ(checked, 2u + 2 * (4 + 4 + 2 * 2 + 2 * 2) + 2 + 2);  // embeddings, 2 blocks, final LayerNorm, head
}

// Three SGD steps (lr 0.1) of the GPT `c` on random tokens (ids drawn from `seed` on), its
// attention fused or not: the losses and the parameters after them. SGD, as in
// TrainsOnTheDeviceLikeTheReference: Adam would amplify the key bias's zero-gradient noise.
std::pair<std::vector<float>, std::map<std::string, std::vector<float>>> three_sgd_steps(
    Runtime& rt, models::GptConfig c, std::uint32_t batch, bool fused, std::uint32_t seed) {
  c.fused_attention = fused;
  TrainerOptions o = gpt_options(batch);
  o.optimizer.kind = ops::OptimizerConfig::Kind::sgd;
  o.lr = 0.1f;
  Trainer t(rt, models::gpt(c), o);
  std::vector<float> losses;
  for (std::uint32_t s = 0; s < 3; ++s) {
    losses.push_back(t.step(token_batch(random_ids(batch * c.context, c.vocab, seed + s),
                                        random_ids(batch * c.context, c.vocab, seed + 10 + s)))
                         .loss);
  }
  std::map<std::string, std::vector<float>> params;
  for (const auto& name : t.parameter_names()) params[name] = t.read_parameter(name);
  return {losses, params};
}

// The fused attention op and the unfused path (matmuls, causal softmax, dropout) train the same
// model: same parameter names, the same dropout masks, losses and weights equal to f32 tolerance
// over steps with dropout on, head dimensions that do and do not fill a 16-float vector.
TEST(Gpt, FusedAttentionTrainsLikeTheUnfusedPath) {
  Runtime rt;
  for (const std::uint32_t width : {8u, 64u}) {
    models::GptConfig c = tiny_config();
    c.width = width;
    c.context = 20;
    c.dropout = 0.1f;
    const auto [fl, fp] = three_sgd_steps(rt, c, 2, true, 50);
    const auto [ul, up] = three_sgd_steps(rt, c, 2, false, 50);
    ASSERT_EQ(fp.size(), up.size());
    for (const auto& [name, values] : up) ASSERT_TRUE(fp.count(name)) << name << " is missing from the fused model";
    for (std::size_t s = 0; s < fl.size(); ++s) EXPECT_NEAR(fl[s], ul[s], 1e-5 * std::abs(ul[s])) << "step " << s;
    for (const auto& [name, values] : up) {
      const auto& f = fp.at(name);
      for (std::size_t i = 0; i < values.size(); ++i) ASSERT_NEAR(f[i], values[i], 2e-5) << name << "[" << i << "]";
    }
  }
}

// The two micro-batches of an accumulation group fed the same tokens: with dropout each draws its
// own masks (fused attention and the unfused path's dropout op alike), so the group's mean
// gradient is not the one micro-batch's, as it was when both drew the same masks; without dropout
// it is, to the bit (the comparison sees nothing else).
TEST(Gpt, MicroBatchesOfAGroupDrawTheirOwnDropoutMasks) {
  Runtime rt;
  for (const bool fused : {true, false}) {
    for (const float dropout : {0.3f, 0.0f}) {
      SCOPED_TRACE(fmt::format("{}, dropout {}", fused ? "fused" : "unfused", dropout));
      models::GptConfig c = tiny_config();
      c.context = 12;
      c.fused_attention = fused;
      c.dropout = dropout;
      TrainerOptions o = reference_options(2);
      Trainer one(rt, models::gpt(c), o);
      o.accumulate = 2;
      Trainer group(rt, models::gpt(c), o);
      const auto tokens = random_ids(2 * c.context, c.vocab, 80), next = random_ids(2 * c.context, c.vocab, 81);
      one.step(token_batch(tokens, next));
      group.step(token_batch(tokens, next));
      group.step(token_batch(tokens, next));
      ASSERT_EQ(group.steps_done(), 1u);
      bool all_equal = true;
      for (const auto& name : one.parameter_names())
        all_equal &= one.read_parameter(name) == group.read_parameter(name);
      EXPECT_EQ(all_equal, dropout == 0.0f);
    }
  }
}

// Every attention kernel family, run inside a model's compiled step (FERRY_ATTENTION_KERNEL: the
// GPU families on this device too, with their scratch planned by the step and dropout's per-step
// arguments set at each enqueue), trains the fused model as the unfused path does.
TEST(Gpt, EveryAttentionFamilyTrainsLikeTheUnfusedPath) {
  Runtime rt;
  models::GptConfig c = tiny_config();
  c.width = 32;
  c.context = 20;
  c.dropout = 0.1f;
  const std::uint32_t batch = 2;
  const std::vector<float> unfused = three_sgd_steps(rt, c, batch, false, 70).first;
  for (const char* kernel : {"gemm", "blocked TQ=8 TK=16", "tiled BQ=16 BK=8", "cpu RB=3 QB=6 KB=16"}) {
    ScopedEnv env("FERRY_ATTENTION_KERNEL", kernel);
    const ops::AttentionShape shape{batch, c.context, c.heads, c.width / c.heads};
    EXPECT_TRUE(ops::attention_kernel_description(TestDevice::get().env, shape).starts_with(kernel))
        << ops::attention_kernel_description(TestDevice::get().env, shape);
    const std::vector<float> fused = three_sgd_steps(rt, c, batch, true, 70).first;
    for (std::size_t s = 0; s < fused.size(); ++s)
      EXPECT_NEAR(fused[s], unfused[s], 1e-5 * std::abs(unfused[s])) << kernel << ", step " << s;
  }
}

// Streamed under the smallest budget it fits: bit-identical weights and losses to resident.
// Every dropout of the model draws its own stream of the counter RNG (two that shared one would
// drop the same elements), at any depth: block 500's MLP once took block 0's attention stream.
TEST(Gpt, EveryDropoutDrawsItsOwnStream) {
  models::GptConfig c = tiny_config();
  c.depth = 1200;
  c.dropout = 0.1f;
  for (const bool fused : {false, true}) {
    c.fused_attention = fused;
    graph::VariantKey key;
    key.batch = 1;
    const graph::Graph g = forward_graph(models::gpt(c), key);
    std::map<std::uint32_t, std::string> streams;
    for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
      std::uint32_t stream = 0;
      if (g.nodes.op[n] == ops::builtin::dropout) {
        stream = ops::DropoutAttrs::of(g.nodes.attrs[n]).seed;
      } else if (g.nodes.op[n] == ops::builtin::attention) {
        stream = ops::AttentionAttrs::of(g.nodes.attrs[n]).seed;
      } else {
        continue;
      }
      const auto [at, fresh] = streams.emplace(stream, g.nodes.name[n]);
      EXPECT_TRUE(fresh) << g.nodes.name[n] << " draws stream " << stream << " as " << at->second << " does";
    }
    EXPECT_EQ(streams.size(), 3u * c.depth) << "the attention probabilities', its output's and the MLP's";
  }
}

TEST(Gpt, StreamedTrainingIsBitIdenticalToResident) {
  Runtime rt;
  const auto c = tiny_config();
  const std::uint32_t batch = 2;
  auto run = [&](const TrainerOptions& o) {
    Trainer t(rt, models::gpt(c), o);
    std::vector<float> losses;
    for (std::uint32_t s = 0; s < 3; ++s) {
      losses.push_back(t.step(token_batch(random_ids(batch * c.context, c.vocab, 30 + s),
                                          random_ids(batch * c.context, c.vocab, 40 + s)))
                           .loss);
    }
    std::map<std::string, std::vector<float>> params;
    for (const auto& name : t.parameter_names()) params[name] = t.read_parameter(name);
    return std::make_tuple(losses, params, t.residency().mode, t.residency().fetches);
  };
  TrainerOptions resident = gpt_options(batch);
  resident.residency.mode = graph::ResidencyMode::resident;
  TrainerOptions streamed = gpt_options(batch);
  streamed.residency.mode = graph::ResidencyMode::stream;
  const std::uint64_t min_budget = ferry::min_stream_budget(rt, models::gpt(c), streamed).value_or(0);
  ASSERT_GT(min_budget, 0u) << "a 1-byte budget must not fit";
  streamed.residency.budget_bytes = min_budget;
  const auto [rl, rp, rmode, rfetches] = run(resident);
  const auto [sl, sp, smode, sfetches] = run(streamed);
  EXPECT_EQ(smode, graph::ResidencyMode::stream);
  EXPECT_GT(sfetches, 0u);
  EXPECT_EQ(sl, rl);
  for (const auto& [name, values] : rp) EXPECT_EQ(sp.at(name), values) << name;
}

// Streamed state is one host copy: the host holds the weights and Adam moments once, plus the
// step's pinned pool (the gradients spilled there under a tight budget, the batch mirrors), so
// host memory stays within 1.15x the training state (weights, gradients, moments) at any budget,
// and the weights are those of the resident run, bit for bit.
TEST(Gpt, StreamedHostMemoryIsTheStateAndTrainingBitIdentical) {
  Runtime rt;
  models::GptConfig c = tiny_config();  // wider, so that alignment padding does not count
  c.vocab = c.width = 64;
  c.heads = 4;
  c.context = 16;
  const std::uint32_t batch = 4;
  auto run = [&](const TrainerOptions& o, double* host_ratio, std::uint64_t* spilled) {
    Trainer t(rt, models::gpt(c), o);
    if (host_ratio) *host_ratio = double(t.host_state_bytes()) / double(t.training_state_bytes());
    if (spilled) *spilled = compiled_train_step(t).plan().host_transient_bytes;
    for (std::uint32_t s = 0; s < 2; ++s) {
      t.step(
          token_batch(random_ids(batch * c.context, c.vocab, 50 + s), random_ids(batch * c.context, c.vocab, 60 + s)));
    }
    std::map<std::string, std::vector<float>> params;
    for (const auto& name : t.parameter_names()) params[name] = t.read_parameter(name);
    return params;
  };
  TrainerOptions resident = gpt_options(batch);
  resident.residency.mode = graph::ResidencyMode::resident;
  const auto reference = run(resident, nullptr, nullptr);
  TrainerOptions streamed = gpt_options(batch);
  streamed.residency.mode = graph::ResidencyMode::stream;
  const std::uint64_t min_budget = ferry::min_stream_budget(rt, models::gpt(c), streamed).value_or(0);
  ASSERT_GT(min_budget, 0u);
  std::uint64_t pool_roomy = 0, pool_tight = 0;
  for (const std::uint64_t budget : {std::uint64_t{1} << 30, min_budget}) {
    SCOPED_TRACE(fmt::format("budget {}", budget));
    streamed.residency.budget_bytes = budget;
    double ratio = 0;
    const auto params = run(streamed, &ratio, budget == min_budget ? &pool_tight : &pool_roomy);
    EXPECT_LE(ratio, 1.15);
    EXPECT_GT(ratio, 0.5);
    for (const auto& [name, values] : reference) EXPECT_EQ(params.at(name), values) << name;
  }
  EXPECT_GT(pool_tight, pool_roomy) << "under the smallest budget gradients should spill to the host";
  // The host optimizer updates the same one copy in place (the gradients come to the host pool).
  streamed.residency.host_optimizer = true;
  streamed.residency.budget_bytes = 1ull << 30;
  Trainer host(rt, models::gpt(c), streamed);
  EXPECT_LE(double(host.host_state_bytes()) / double(host.training_state_bytes()), 1.15);
  EXPECT_GT(host.residency().host_updates, 0u);
  // Hybrid phases keep the one copy too: the predictor's state is what they add.
  streamed.residency.host_optimizer = false;
  streamed.phases.hybrid = true;
  streamed.residency.budget_bytes = 1;
  streamed.residency.budget_bytes = ferry::min_stream_budget(rt, models::gpt(c), streamed).value_or(0);
  Trainer hybrid(rt, models::gpt(c), streamed);
  EXPECT_GT(hybrid.predictor_state_bytes(), 0u);
  EXPECT_LE(double(hybrid.host_state_bytes() - hybrid.predictor_state_bytes()) / double(hybrid.training_state_bytes()),
            1.15);
}

// The logits at position p depend on tokens 0..p only; prediction gives [samples, T, vocab].
TEST(Gpt, PredictionIsCausal) {
  Runtime rt;
  const auto c = tiny_config();
  Trainer trainer(rt, models::gpt(c), gpt_options(2));
  class Windows final : public DataSource {
   public:
    std::vector<std::int32_t> ids;
    std::size_t size() const override { return ids.size() / 6; }
    void read(std::string_view, std::size_t first, std::size_t count, std::span<std::byte> out) const override {
      std::memcpy(out.data(), ids.data() + first * 6, count * 6 * sizeof(std::int32_t));
    }
  } a, b;
  a.ids = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 1, 2, 3, 4};  // not a whole window at the end: 2 samples
  a.ids.resize(12);
  b.ids = a.ids;
  b.ids[4] = 9;  // sample 0 differs from position 4 on
  const auto pa = trainer.predict(a), pb = trainer.predict(b);
  EXPECT_EQ(pa.shape, (graph::Shape{2, 6, 11}));
  const auto* la = reinterpret_cast<const float*>(pa.bytes.data());
  const auto* lb = reinterpret_cast<const float*>(pb.bytes.data());
  for (std::size_t p = 0; p < 6; ++p) {
    bool same = true;
    for (std::size_t v = 0; v < 11; ++v) same = same && la[p * 11 + v] == lb[p * 11 + v];
    EXPECT_EQ(same, p < 4) << "position " << p;
  }
  for (std::size_t i = 66; i < 132; ++i) EXPECT_EQ(la[i], lb[i]) << "sample 1 is the same";
}

TEST(Gpt, BadInputIsAClearError) {
  Runtime rt;
  const auto c = tiny_config();
  Trainer trainer(rt, models::gpt(c), gpt_options(2));
  auto tokens = random_ids(12, c.vocab, 1), next = random_ids(12, c.vocab, 2);
  const auto before = trainer.read_parameter("embedding0.table");
  auto expect_error = [&](const Batch& b, const char* needle) {
    try {
      trainer.step(b);
      ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto bad = tokens;
  bad[7] = 11;  // the vocabulary is [0, 11)
  expect_error(token_batch(bad, next), "'tokens' value 11 (element 1 of sample 1) is outside [0, 11)");
  bad[7] = -1;
  expect_error(token_batch(bad, next), "outside [0, 11)");
  expect_error(Batch{{"tokens", HostView(std::span<const std::int32_t>(tokens))}}, "no 'next'");
  const std::vector<float> floats(12);
  expect_error(Batch{{"tokens", HostView(std::span<const float>(floats))},
                     {"next", HostView(std::span<const std::int32_t>(next))}},
               "'tokens' is f32");
  auto extra = token_batch(tokens, next);
  extra.emplace("labels", HostView(std::span<const std::int32_t>(next)));
  expect_error(extra, "does not take");
  EXPECT_EQ(trainer.read_parameter("embedding0.table"), before);
  EXPECT_EQ(trainer.steps_done(), 0u);
  // Model configurations that cannot work are build errors naming the setting.
  auto odd = c;
  odd.heads = 3;  // 8 is not a multiple of 3
  try {
    Trainer t(rt, models::gpt(odd), gpt_options(2));
    ADD_FAILURE() << "width 8 with 3 heads must not build";
  } catch (const graph::BuildError& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of heads"), std::string::npos) << e.what();
  }
  odd = c;
  odd.vocab = 1;
  EXPECT_THROW(models::gpt(odd), graph::BuildError);
}

// A loss must be the stats of a loss op, and losses check their operands.
TEST(Losses, SequenceCrossEntropyAndMseCheckTheirOperands) {
  graph::Graph g;
  graph::Builder b(g, 2);
  const TensorId x = b.input("x", graph::Shape{3, 4});
  const TensorId labels = b.input("labels", graph::Shape{3}, graph::DType::i32, graph::Role::label);
  const TensorId wrong = b.input("wrong", graph::Shape{4}, graph::DType::i32, graph::Role::label);
  const TensorId target = b.input("target", graph::Shape{3, 4}, graph::DType::f32, graph::Role::label);
  EXPECT_THROW(b.softmax_xent(x, wrong), graph::BuildError);
  EXPECT_THROW(b.softmax_xent(x, target), graph::BuildError);  // f32 labels
  EXPECT_THROW(b.set_loss(x), graph::BuildError);              // not a loss's stats
  const TensorId stats = b.softmax_xent(x, labels);            // over [2, 3] positions
  EXPECT_EQ(g.loss, stats);
  EXPECT_EQ(g.tensors.shape[stats], (graph::Shape{2}));
  const TensorId mse = b.mse(b.linear(x, 4), target);
  EXPECT_EQ(g.loss, mse);
  EXPECT_EQ(g.tensors.shape[mse], (graph::Shape{1}));
  EXPECT_THROW(b.mse(x, labels), graph::BuildError);
}

// A regression model with an MSE loss trains on the device like the reference and learns.
TEST(Losses, MseRegressionTrainsLikeTheReference) {
  Runtime rt;
  ModelSpec m;
  m.name = "regression";
  m.inputs = {TensorSpec{"x", graph::Shape{5}}};
  m.targets = {TensorSpec{"y", graph::Shape{2}}};
  m.forward = [](graph::Builder& b, std::span<const TensorId> in) { return b.linear(b.gelu(b.linear(in[0], 16)), 2); };
  m.loss = [](graph::Builder& b, TensorId p, std::span<const TensorId> t) { return b.mse(p, t[0]); };
  TrainerOptions o;
  o.batch = 8;
  o.lr = 0.01f;
  Trainer trainer(rt, m, o);
  ReferenceExecutor ref(compiled_train_step(trainer).graph(), o.optimizer);
  load_parameters(ref, trainer);
  const auto x = random_vector(8 * 5, 1);
  std::vector<float> y(8 * 2);
  for (std::size_t i = 0; i < 8; ++i) {  // a smooth target of x
    y[i * 2] = 0.5f * x[i * 5] - x[i * 5 + 1];
    y[i * 2 + 1] = x[i * 5 + 2] * x[i * 5 + 3];
  }
  const Batch batch{{"x", HostView(std::span<const float>(x))}, {"y", HostView(std::span<const float>(y))}};
  float first = 0, last = 0;
  for (std::uint32_t s = 0; s < 60; ++s) {
    const StepResult r = trainer.step(batch);
    EXPECT_EQ(r.correct, 0u);
    if (s < 3) {
      ref.value(ref.find("x")) = to_double(x);
      ref.value(ref.find("y")) = to_double(y);
      ref.run(ops::StepInfo{s + 1, o.lr});
      EXPECT_NEAR(r.loss, ref.loss(), 1e-4 * std::max(1.0, std::abs(ref.loss()))) << "step " << s;
    }
    if (s == 0) first = r.loss;
    last = r.loss;
  }
  EXPECT_LT(last, 0.2f * first) << "the regression learns its batch";
}

// A sum of two weighted losses: classes by cross-entropy and a regression head by MSE from one
// trunk. Each term's gradient carries its weight (finite differences of the summed loss), and the
// device trains like the reference.
ModelSpec two_headed() {
  ModelSpec m;
  m.name = "two-heads";
  m.inputs = {TensorSpec{"x", graph::Shape{6}}};
  m.targets = {TensorSpec{"labels", graph::Shape{}, graph::DType::i32, 3}, TensorSpec{"y", graph::Shape{2}}};
  m.forward = [](graph::Builder& b, std::span<const TensorId> in) { return b.gelu(b.linear(in[0], 8)); };
  m.loss = [](graph::Builder& b, TensorId trunk, std::span<const TensorId> t) {
    const TensorId xent = b.softmax_xent(b.linear(trunk, 3), t[0]);
    const TensorId mse = b.mse(b.linear(trunk, 2), t[1]);
    return b.loss_sum(xent, mse, 1.0f, 0.5f);
  };
  return m;
}

TEST(Losses, WeightedSumOfTwoLossesHasTheGradientsOfTheSum) {
  ops::OptimizerConfig sgd;
  sgd.kind = ops::OptimizerConfig::Kind::sgd;
  const graph::Graph g = training_graph(two_headed(), 4, sgd);
  ReferenceExecutor ref(g, sgd);
  randomize_weights(ref, g, 5, -0.7f, 0.7f);
  ref.value(ref.find("x")) = to_double(random_vector(4 * 6, 1));
  ref.ints(ref.find("labels")) = {0, 2, 1, 2};
  ref.value(ref.find("y")) = to_double(random_vector(4 * 2, 2));
  ref.run(ops::StepInfo{1, 0.0f});
  for (TensorId w = 0; w < g.tensors.size(); ++w) {
    if (g.tensors.role[w] != graph::Role::weight) continue;
    ASSERT_NE(g.tensors.grad[w], graph::no_tensor) << g.tensors.name[w];
    expect_reference_gradient_matches_finite_differences(ref, w, g.tensors.grad[w], g.tensors.name[w], 6);
  }
}

TEST(Losses, WeightedSumTrainsOnTheDeviceLikeTheReference) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 4;
  o.lr = 0.05f;
  o.optimizer.kind = ops::OptimizerConfig::Kind::sgd;
  Trainer trainer(rt, two_headed(), o);
  ReferenceExecutor ref(compiled_train_step(trainer).graph(), o.optimizer);
  load_parameters(ref, trainer);
  for (std::uint32_t s = 0; s < 3; ++s) {
    const auto x = random_vector(4 * 6, 10 + s), y = random_vector(4 * 2, 20 + s);
    const std::vector<std::int32_t> labels = {static_cast<std::int32_t>(s % 3), 1, 2, 0};
    const StepResult r = trainer.step(Batch{{"x", HostView(std::span<const float>(x))},
                                            {"labels", HostView(std::span<const std::int32_t>(labels))},
                                            {"y", HostView(std::span<const float>(y))}});
    ref.value(ref.find("x")) = to_double(x);
    ref.ints(ref.find("labels")) = labels;
    ref.value(ref.find("y")) = to_double(y);
    ref.run(ops::StepInfo{s + 1, o.lr});
    EXPECT_NEAR(r.loss, ref.loss(), 1e-5 * std::max(1.0, std::abs(ref.loss()))) << "step " << s;
  }
  expect_parameters_match(trainer, ref, 1e-5);
  // Both losses' statistics are results the host can read, under distinct names.
  EXPECT_NO_THROW(compiled_train_step(trainer).host_output("loss.stats"));
  EXPECT_NO_THROW(compiled_train_step(trainer).host_output("loss4.stats"));
}

TEST(Losses, LossSumTakesOnlyLosses) {
  graph::Graph g;
  graph::Builder b(g, 2);
  const TensorId x = b.input("x", graph::Shape{4});
  const TensorId y = b.input("y", graph::Shape{4}, graph::DType::f32, graph::Role::label);
  const TensorId l = b.mse(x, y);
  try {
    b.loss_sum(l, x);
    FAIL();
  } catch (const graph::BuildError& e) {
    EXPECT_NE(std::string(e.what()).find("'x' is not the output of a loss op"), std::string::npos) << e.what();
  }
}

fs::path temp_dir(const char* name) {
  const fs::path d = fs::temp_directory_path() / fmt::format("ferry_text_{}_{}", name, ::getpid());
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

TEST(TextCorpus, ReadsFilesVocabularySplitAndWindows) {
  const fs::path d = temp_dir("ok");
  std::ofstream(d / "b") << "hello world\n";
  std::ofstream(d / "a") << "abc\n";
  std::ofstream(d / "a.dat") << "index, skipped";
  fs::create_symlink(d / "a", d / "link-to-a");  // the same file twice: read once
  const auto files = fortune_files(d);
  ASSERT_EQ(files.size(), 2u);
  const TextCorpus c = load_text_corpus(files, 0.25);
  EXPECT_EQ(c.decode(c.ids), "abc\nhello world\n");
  EXPECT_EQ(c.vocab_size(), 12u);  // \n, space, a b c d e h l o r w
  EXPECT_EQ(c.vocab[0], '\n');
  EXPECT_EQ(c.train_end, 12u);  // 16 characters, a quarter held out: "rld\n"
  EXPECT_EQ(c.encode("hello"), std::vector<std::int32_t>(c.ids.begin() + 4, c.ids.begin() + 9));
  EXPECT_THROW(c.encode("xyz"), std::invalid_argument);
  const TextWindows val = TextWindows::held_out(c, 1, 0);  // windows of 1 + 1 at 12, 13, 14
  EXPECT_EQ(val.size(), 3u);
  EXPECT_EQ(TextWindows::held_out(c, 1, 2).starts(), (std::vector<std::size_t>{12, 13}));
  EXPECT_THROW(TextWindows::held_out(c, 4, 0), std::invalid_argument);  // 4 + 1 > 4 held out
  std::vector<std::int32_t> t(3), n(3);
  val.read("tokens", 0, 3, std::as_writable_bytes(std::span(t)));
  val.read("next", 0, 3, std::as_writable_bytes(std::span(n)));
  EXPECT_EQ(c.decode(t), "rld");
  EXPECT_EQ(c.decode(n), "ld\n");
  EXPECT_THROW(val.read("labels", 0, 1, std::as_writable_bytes(std::span(t).first(1))), std::invalid_argument);
  fs::remove_all(d);
}

TEST(TextCorpus, MissingOrEmptyTextIsAClearError) {
  const fs::path d = temp_dir("bad");
  try {
    fortune_files(d / "nowhere");
    ADD_FAILURE();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("apt-get install fortunes"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("give --text"), std::string::npos) << e.what();
  }
  // A folder without text (what is in it is skipped): the message says what is skipped.
  fs::create_directories(d / "sub");
  std::ofstream(d / ".hidden") << "text";
  std::ofstream(d / "x.dat") << "text";
  try {
    fortune_files(d);
    ADD_FAILURE();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("hidden files, subfolders"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("give --text"), std::string::npos) << e.what();
  }
  fs::remove_all(d / "sub");
  fs::remove(d / ".hidden");
  fs::remove(d / "x.dat");
  std::ofstream(d / "empty");
  try {
    load_text_corpus({d / "empty"});
    ADD_FAILURE();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("is empty"), std::string::npos) << e.what();
  }
  EXPECT_THROW(load_text_corpus({d / "missing"}), std::runtime_error);
  EXPECT_THROW(load_text_corpus({d / "empty"}, 1.5), std::invalid_argument);
  fs::remove_all(d);
}

// A binary file is refused at the first megabyte holding a NUL, not after all of it is read (a 3 GB
// one took 40 s); control characters are judged over the whole file; text longer than a read's
// chunk arrives whole.
TEST(TextCorpus, BinaryFilesAreRefusedWhereTheirFirstNulIs) {
  const fs::path d = temp_dir("binary");
  const std::size_t mib = std::size_t{1} << 20;
  {
    std::ofstream out(d / "blob", std::ios::binary);
    const std::string text_part(mib + 10, 'a');
    out << text_part << std::string(1, '\0') << std::string(4 * mib, 'b');  // the NUL in the second megabyte
  }
  try {
    load_text_corpus({d / "blob"});
    ADD_FAILURE() << "a file with a NUL was read as text";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(fmt::format("looks binary, not text (1 NUL bytes, 0.0% control characters in "
                                                     "the first {} bytes)",
                                                     2 * mib)),
              std::string::npos)
        << e.what();
  }
  std::string escapes;
  for (int i = 0; i < 3000; ++i) escapes += std::string(48, 'x') + "\x1b\n";  // 2% escape characters
  std::ofstream(d / "escapes", std::ios::binary) << escapes;
  try {
    load_text_corpus({d / "escapes"});
    ADD_FAILURE() << "a file of 2% control characters was read as text";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(fmt::format("2.0% control characters in {} bytes", escapes.size())),
              std::string::npos)
        << e.what();
  }
  // A short text file with a few control characters (a fortune with two backspaces, 2.5% of its
  // 79 bytes, alone in a file) is text: the share is judged per file from 4 KiB on, and over the
  // whole corpus, where it is small; a corpus of such files is refused, naming the worst.
  const std::string fortune = "*__\b\bUN*lucky, but it is a line of text all the same, and more of it here.\n";
  std::ofstream(d / "fortune", std::ios::binary) << fortune;
  std::ofstream(d / "long", std::ios::binary) << std::string(8000, 'x') << "\n";
  EXPECT_EQ(load_text_corpus({d / "fortune", d / "long"}, 0.5).ids.size(), fortune.size() + 8001);
  std::ofstream(d / "more", std::ios::binary) << "\x1b[1m\b\b\b x\n";
  try {
    load_text_corpus({d / "fortune", d / "more"}, 0.5);
    ADD_FAILURE() << "a corpus of 6% control characters was read as text";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("are control characters, more than text has (the most in"), std::string::npos)
        << e.what();
  }
  // Compressed and UTF-16 files are named as such, with what to do.
  std::ofstream(d / "gz", std::ios::binary) << "\x1f\x8b\x08 compressed";
  std::ofstream(d / "utf16", std::ios::binary) << std::string("\xff\xfeh\0i\0", 6);
  for (const auto& [file, needle] : {std::pair{"gz", "is gzip-compressed: gunzip it"},
                                     std::pair{"utf16", "is UTF-16 text: convert it to UTF-8 (iconv"}}) {
    try {
      load_text_corpus({d / file}, 0.5);
      ADD_FAILURE() << file;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
  std::string long_text;
  for (std::size_t i = 0; long_text.size() < 2 * mib + 7; ++i) long_text += "line " + std::to_string(i) + "\n";
  std::ofstream(d / "long", std::ios::binary) << long_text;
  const TextCorpus c = load_text_corpus({d / "long"}, 0.5);
  EXPECT_EQ(c.decode(c.ids), long_text);
  fs::remove_all(d);
}

// Bytes above 127 are characters like any other (no sign extension in the widening), and a corpus
// that would not fit this machine's memory as 4-byte ids is refused by its size, before a byte is
// read (a sparse file: no disk is used).
TEST(TextCorpus, WideBytesReadAndTextBeyondMemoryRefusedUnread) {
  const fs::path d = temp_dir("wide");
  std::ofstream(d / "utf8", std::ios::binary) << "caf\xc3\xa9 \xff\n";
  const TextCorpus c = load_text_corpus({d / "utf8"}, 0.5);
  EXPECT_EQ(c.decode(c.ids), "caf\xc3\xa9 \xff\n");
  EXPECT_EQ(c.vocab.back(), 0xff);
  EXPECT_EQ(c.id_of[0xc3], 6);  // after \n, space, a, c, f and 0xa9

  const std::uint64_t physical = physical_memory_bytes();
  ASSERT_GT(physical, 0u);
  std::ofstream(d / "huge").close();
  fs::resize_file(d / "huge", physical / 4 + 1);
  try {
    load_text_corpus({d / "utf8", d / "huge"});
    ADD_FAILURE() << "a corpus larger than memory as ids was read";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(fmt::format("of host memory as token ids (4 bytes a character), more than this machine's {}",
                                    format_bytes(physical))),
              std::string::npos)
        << what;
    EXPECT_NE(what.find(fmt::format("a folder with at most {} of text", format_bytes(physical / 4))), std::string::npos)
        << what;
  }
  fs::remove_all(d);
}

// The error of reading the corpus in `dir`, or "".
std::string corpus_error(const fs::path& dir) {
  try {
    load_text_corpus(fortune_files(dir));
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// A folder or a file of the corpus out of this user's reach names itself, the reason and a fix
// (the folder gave a bare "filesystem error: directory iterator cannot open directory").
TEST(TextCorpus, FoldersAndFilesOutOfReachSayWhatToDo) {
  const fs::path d = temp_dir("reach");
  fs::create_directories(d / "locked");
  fs::create_directories(d / "open");
  std::ofstream(d / "locked" / "a") << "some text\n";
  std::ofstream(d / "open" / "a") << "some text\n";
  // Out of reach of others when root runs this as nobody, else of anyone.
  const fs::perms none = ::geteuid() == 0 ? fs::perms::owner_all : fs::perms::none;
  fs::permissions(d / "locked", none);
  fs::permissions(d / "open" / "a", none & ~fs::perms::owner_exec);
  const std::string folder = unprivileged([&] { return corpus_error(d / "locked"); });
  EXPECT_NE(
      folder.find(fmt::format("text corpus: cannot list the folder {}: Permission denied", (d / "locked").string())),
      std::string::npos)
      << folder;
  EXPECT_NE(folder.find("chmod a+rx"), std::string::npos) << folder;
  const std::string file = unprivileged([&] { return corpus_error(d / "open"); });
  EXPECT_NE(file.find("text corpus: cannot open "), std::string::npos) << file;
  EXPECT_NE(file.find("Permission denied: give this user read permission on it (chmod a+r"), std::string::npos) << file;
  fs::permissions(d / "locked", fs::perms::owner_all);
  fs::remove_all(d);
}

// One character repeated is no text to learn from: the corpus is named with what to do (the model
// builder said only "the vocabulary needs at least 2 tokens, got 1").
TEST(TextCorpus, ASingleRepeatedCharacterIsRefusedNamingTheCorpus) {
  const fs::path d = temp_dir("one");
  std::ofstream(d / "a") << std::string(100, 'z');
  std::ofstream(d / "b") << std::string(50, 'z');
  const std::string err = corpus_error(d);
  EXPECT_NE(
      err.find(fmt::format("text corpus (the 2 files in {}): it holds a single distinct character ('z', 150 times)",
                           fs::canonical(d).string())),
      std::string::npos)
      << err;
  EXPECT_NE(err.find("give --text"), std::string::npos) << err;
  std::ofstream(d / "b") << "zy";  // two characters: enough
  EXPECT_EQ(corpus_error(d), "");
  fs::remove_all(d);
}

}  // namespace
}  // namespace ferry::test
