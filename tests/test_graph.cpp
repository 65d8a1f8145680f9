// Graph contracts: memory plan soundness, autodiff against finite differences (on the reference
// executor, for every op kind), the compiled device step against the reference executor over
// several optimizer steps, failure cancellation and recovery, and bad input.
#include <fmt/format.h>

#include <set>

#include "classifier.hpp"
#include "ferry/ferry.hpp"
#include "graph/bind.hpp"
#include "graph/dependencies.hpp"
#include "graph/memory_plan.hpp"
#include "reference_executor.hpp"
#include "runtime/trainer_internals.hpp"
#include "test_models.hpp"
#include "test_support.hpp"
#include "train_check.hpp"

namespace ferry::test {
namespace {

using graph::TensorId;

std::vector<std::int32_t> random_labels(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::int32_t> l(n);
  for (auto& v : l) v = static_cast<std::int32_t>(rng() % 10);
  return l;
}

class ModelTest : public ::testing::TestWithParam<ModelSpec (*)()> {};

TEST_P(ModelTest, MemoryPlanNeverOverlapsLiveTensors) {
  const ModelSpec m = GetParam()();
  ops::OptimizerConfig opt;
  graph::Graph g = training_graph(m, 6, opt);
  graph::assign_scratch(g, TestDevice::get().env);
  graph::MemoryPlanOptions mopt;
  // Cap buffers at the largest tensor (aligned): forces several buffers.
  std::uint64_t largest = 0;
  for (TensorId id = 0; id < g.tensors.size(); ++id) largest = std::max<std::uint64_t>(largest, g.tensors.bytes(id));
  mopt.max_buffer_bytes = (largest + 255) / 256 * 256;
  const auto plan = graph::plan_memory(g, mopt);
  const auto& t = g.tensors;
  // Recompute lifetimes independently of the planner.
  std::vector<int> first(t.size(), -1), last(t.size(), -1);
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    auto touch = [&](TensorId id) {
      if (id == graph::no_tensor) return;
      id = t.storage(id);
      if (first[id] < 0) first[id] = static_cast<int>(n);
      last[id] = static_cast<int>(n);
    };
    for (TensorId id : g.nodes.inputs(n)) touch(id);
    for (TensorId id : g.nodes.outputs(n)) touch(id);
    touch(g.nodes.scratch[n]);
  }
  std::size_t checked = 0;
  for (TensorId a = 0; a < t.size(); ++a) {
    if (t.alias_of[a] != graph::no_tensor || first[a] < 0) continue;
    EXPECT_EQ(t.placement[a].offset_bytes % mopt.alignment, 0u) << t.name[a];
    // Persistent tensors are packed per home: a placement's buffer counts within its home.
    const auto& buffers = plan.pool[a] == graph::Pool::persistent ? plan.persistent_buffers[static_cast<int>(t.home[a])]
                                                                  : plan.transient_buffers;
    ASSERT_LT(t.placement[a].buffer, buffers.size()) << t.name[a];
    EXPECT_LE(t.placement[a].offset_bytes + t.bytes(a), buffers[t.placement[a].buffer]) << t.name[a];
    for (TensorId b = a + 1; b < t.size(); ++b) {
      if (t.alias_of[b] != graph::no_tensor || first[b] < 0 || plan.pool[a] != plan.pool[b]) continue;
      if (t.placement[a].buffer != t.placement[b].buffer || t.home[a] != t.home[b]) continue;
      const bool persistent = plan.pool[a] == graph::Pool::persistent;
      const bool live_together = persistent || (first[a] <= last[b] && first[b] <= last[a]);
      if (!live_together) continue;
      const auto a0 = t.placement[a].offset_bytes, a1 = a0 + t.bytes(a);
      const auto b0 = t.placement[b].offset_bytes, b1 = b0 + t.bytes(b);
      EXPECT_TRUE(a1 <= b0 || b1 <= a0) << t.name[a] << " and " << t.name[b] << " overlap while both live";
      ++checked;
    }
  }
  EXPECT_GT(checked, 10u);
  EXPECT_GT(plan.transient_buffers.size(), 1u);
  // Reuse must make the step smaller than keeping every transient tensor apart.
  EXPECT_LT(plan.transient_bytes, plan.transient_unshared_bytes);
}

// Whether x's and y's planned bytes overlap (the same buffer, intersecting ranges).
bool placements_overlap(const graph::Graph& g, TensorId x, TensorId y) {
  const auto& px = g.tensors.placement[x];
  const auto& py = g.tensors.placement[y];
  return px.buffer == py.buffer && px.offset_bytes < py.offset_bytes + g.tensors.bytes(y) &&
         py.offset_bytes < px.offset_bytes + g.tensors.bytes(x);
}

// The nodes of other lanes that node n waits for under `plan`'s placements.
std::vector<graph::NodeId> cross_lane_waits(const graph::Graph& g, const graph::MemoryPlan& plan, graph::NodeId n) {
  return graph::cross_lane_dependencies(g.nodes.lane, graph::node_byte_accesses(g, plan.pool))[n];
}

// A fetch's device copy and a write-back's source keep their bytes apart from the compute nodes
// around the copy (MemoryPlanOptions::transfer_slack), so the copy waits for none of them and
// none of them for the copy; without the slack the plan packs them into bytes just freed.
TEST(MemoryPlan, CopiesKeepTheirBytesApartFromTheComputeAroundThem) {
  graph::Graph g;
  auto tensor = [&](const char* name, graph::Role role = graph::Role::activation) {
    return g.tensors.add(name, graph::Shape{256}, graph::DType::f32, role);
  };
  const TensorId a = tensor("a"), b = tensor("b"), c = tensor("c"), w = tensor("w@dev", graph::Role::staged),
                 d = tensor("d"), f = tensor("f"), h = tensor("h"), host_w = tensor("w", graph::Role::weight),
                 host_d = tensor("d.host", graph::Role::gradient);
  g.tensors.home[host_w] = graph::Home::host_pinned;
  g.tensors.home[host_d] = graph::Home::host_pinned;
  auto node = [&](const char* name, std::vector<TensorId> in, std::vector<TensorId> out,
                  graph::Lane lane = graph::Lane::compute) {
    const graph::OpId op = lane == graph::Lane::h2d   ? graph::builtin::fetch
                           : lane == graph::Lane::d2h ? graph::builtin::write_back
                                                      : graph::builtin::scale;
    return g.nodes.add(op, name, in, out, {}, lane);
  };
  node("make a", {}, {a});
  node("a to b", {a}, {b});
  node("b to c", {b}, {c});
  const graph::NodeId fetch = node("fetch w", {host_w}, {w}, graph::Lane::h2d);
  node("use w", {w, c}, {d});
  node("write back d", {d}, {host_d}, graph::Lane::d2h);
  const graph::NodeId after = node("make f", {}, {f});
  node("f to h", {f}, {h});
  const auto overlaps = [&](TensorId x, TensorId y) { return placements_overlap(g, x, y); };
  const auto waits_for = [&](const graph::MemoryPlan& plan, graph::NodeId n) { return cross_lane_waits(g, plan, n); };
  graph::MemoryPlanOptions packed;
  const graph::MemoryPlan tight = graph::plan_memory(g, packed);
  EXPECT_TRUE(overlaps(w, a) || overlaps(w, b)) << "packed, the copy takes bytes the nodes before it freed";
  EXPECT_FALSE(waits_for(tight, fetch).empty());
  graph::MemoryPlanOptions apart;
  apart.transfer_slack = 2;
  const graph::MemoryPlan loose = graph::plan_memory(g, apart);
  for (TensorId x : {a, b, c}) EXPECT_FALSE(overlaps(w, x)) << g.tensors.name[x];
  for (TensorId x : {f, h}) EXPECT_FALSE(overlaps(d, x)) << g.tensors.name[x];
  EXPECT_TRUE(waits_for(loose, fetch).empty()) << "the fetch waits for no compute node";
  EXPECT_TRUE(waits_for(loose, after).empty()) << "the node after the write-back waits for no copy";
  EXPECT_GE(loose.transient_bytes, tight.transient_bytes);
}

// Pinned staging tensors keep their bytes apart from the next `staging_slack` ones, so the host
// fills the next tensor's staging while the link still copies out of this one; packed by liveness
// alone, each staging tensor reuses the bytes of the one before and its unpack waits for that
// one's fetch.
TEST(MemoryPlan, StagedCopiesKeepTheirStagingApartFromTheNextOnes) {
  graph::Graph g;
  constexpr int copies = 4;
  std::vector<TensorId> staging;
  std::vector<graph::NodeId> unpacks, fetches;
  for (int i = 0; i < copies; ++i) {
    auto tensor = [&](const char* what, graph::Role role, graph::Home home) {
      const TensorId x = g.tensors.add(fmt::format("w{}{}", i, what), graph::Shape{256}, graph::DType::f32, role);
      g.tensors.home[x] = home;
      return x;
    };
    const TensorId host = tensor("", graph::Role::weight, graph::Home::host_pinned);
    const TensorId pinned = tensor("@staging", graph::Role::staged, graph::Home::host_pinned);
    const TensorId device = tensor("@device", graph::Role::staged, graph::Home::device);
    const TensorId used = tensor(".used", graph::Role::activation, graph::Home::device);
    staging.push_back(pinned);
    unpacks.push_back(g.nodes.add(graph::builtin::unpack, fmt::format("unpack w{}", i), std::vector{host},
                                  std::vector{pinned}, {}, graph::Lane::unpack));
    fetches.push_back(g.nodes.add(graph::builtin::fetch, fmt::format("fetch w{}", i), std::vector{pinned},
                                  std::vector{device}, {}, graph::Lane::h2d));
    g.nodes.add(graph::builtin::scale, fmt::format("use w{}", i), std::vector{device}, std::vector{used}, {},
                graph::Lane::compute);
  }
  const auto overlaps = [&](TensorId x, TensorId y) { return placements_overlap(g, x, y); };
  const auto waits_for = [&](const graph::MemoryPlan& plan, graph::NodeId n) { return cross_lane_waits(g, plan, n); };
  const graph::MemoryPlan packed = graph::plan_memory(g, {});
  EXPECT_TRUE(overlaps(staging[1], staging[0])) << "packed, each staging tensor takes the bytes just freed";
  const auto waited = waits_for(packed, unpacks[1]);
  EXPECT_NE(std::find(waited.begin(), waited.end(), fetches[0]), waited.end())
      << "packed, the next unpack waits for the fetch before it";
  graph::MemoryPlanOptions apart;
  apart.staging_slack = 2;
  const graph::MemoryPlan ring = graph::plan_memory(g, apart);
  for (int i = 0; i < copies; ++i) {
    for (int j = i + 1; j < std::min(copies, i + 3); ++j) {
      EXPECT_FALSE(overlaps(staging[i], staging[j])) << g.tensors.name[staging[i]] << " " << g.tensors.name[staging[j]];
    }
  }
  for (int i = 1; i < copies; ++i) {
    for (graph::NodeId m : waits_for(ring, unpacks[i])) {  // at most for the fetch three before it
      for (int j = std::max(0, i - 2); j < i; ++j) {
        EXPECT_NE(m, fetches[j]) << "unpack w" << i << " waits for " << g.nodes.name[m];
      }
    }
  }
  EXPECT_EQ(ring.host_staging_bytes, 3 * packed.host_staging_bytes) << "three staged copies in flight, not one";
}

TEST(MemoryPlan, TensorLargerThanAnyBufferIsAnError) {
  graph::Graph g = training_graph(small_mlp(), 6, {});
  graph::MemoryPlanOptions mopt;
  mopt.max_buffer_bytes = 256;
  try {
    graph::plan_memory(g, mopt);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("largest buffer"), std::string::npos) << e.what();
  }
}

TEST_P(ModelTest, AutodiffMatchesFiniteDifferences) {
  const ModelSpec m = GetParam()();
  ops::OptimizerConfig opt;
  opt.kind = ops::OptimizerConfig::Kind::sgd;
  opt.sgd.momentum = 0;
  const std::uint32_t batch = 3;
  graph::Graph g = training_graph(m, batch, opt);
  ReferenceExecutor ref(g, opt);
  const auto& t = g.tensors;
  randomize_weights(ref, g, 10, -0.6f, 0.6f);
  ref.value(ref.find("input")) = to_double(random_vector(t.shape[ref.find("input")].elems(), 99));
  ref.ints(ref.find("labels")) = random_labels(batch, 5);
  ref.run(ops::StepInfo{1, 0.0f});  // lr 0: gradients computed, weights unchanged
  std::size_t weights_checked = 0;
  for (TensorId w = 0; w < t.size(); ++w) {
    if (t.role[w] != graph::Role::weight) continue;
    ASSERT_NE(t.grad[w], graph::no_tensor) << "no gradient for " << t.name[w];
    // Max-pooling is piecewise linear: a step of 1e-6 stays inside one piece for random data.
    expect_reference_gradient_matches_finite_differences(ref, w, t.grad[w], t.name[w], 16);
    ++weights_checked;
  }
  EXPECT_GE(weights_checked, 4u);
}

TEST_P(ModelTest, DeviceStepsMatchReferenceExecutor) {
  const ModelSpec m = GetParam()();
  Runtime runtime;
  TrainerOptions topt;
  topt.batch = 6;
  topt.lr = 0.05f;
  topt.optimizer.kind = ops::OptimizerConfig::Kind::sgd;
  topt.optimizer.sgd.momentum = 0.9f;
  Trainer trainer(runtime, m, topt);
  const auto& g = compiled_train_step(trainer).graph();
  ReferenceExecutor ref(g, topt.optimizer);
  for (const auto& name : trainer.parameter_names())
    ref.value(ref.find(name)) = to_double(trainer.read_parameter(name));

  const std::size_t sample = sample_elems(m);
  for (std::uint32_t s = 0; s < 3; ++s) {
    auto images = random_vector(topt.batch * sample, 200 + s);
    auto labels = random_labels(topt.batch, 300 + s);
    const auto r = trainer.step(images, labels);
    ref.value(ref.find("input")) = to_double(images);
    ref.ints(ref.find("labels")) = labels;
    ref.run(ops::StepInfo{s + 1, topt.lr});
    EXPECT_NEAR(r.loss, ref.loss(), 1e-4 * std::max(1.0, std::abs(ref.loss()))) << "step " << s;
  }
  for (const auto& name : trainer.parameter_names()) {
    expect_near(trainer.read_parameter(name), to_float(ref.value(ref.find(name))), 2e-5f, 1e-4f, name.c_str());
  }
}

INSTANTIATE_TEST_SUITE_P(Models, ModelTest, ::testing::Values(&small_mlp, &small_cnn, &small_residual),
                         [](const auto& info) {
                           return info.index == 0 ? "mlp" : info.index == 1 ? "cnn" : "residual";
                         });

TEST(CompiledStep, FailingNodeCancelsStepNamesItAndTrainerRecovers) {
  Runtime runtime;
  TrainerOptions topt;
  topt.batch = 4;
  topt.optimizer.kind = ops::OptimizerConfig::Kind::sgd;
  Trainer trainer(runtime, small_mlp(), topt);
  const auto& nodes = compiled_train_step(trainer).graph().nodes;
  graph::NodeId victim = 0;
  for (graph::NodeId n = 0; n < nodes.size(); ++n) {
    if (nodes.op[n] == graph::builtin::linear_grad_param) victim = n;
  }
  ASSERT_NE(victim, 0u);
  const auto before = trainer.read_parameter("linear0.w");
  auto images = random_vector(4 * 20, 1);
  auto labels = random_labels(4, 2);
  compiled_train_step(trainer).inject_failure(victim);
  try {
    trainer.step(images, labels);
    FAIL() << "the step should have thrown";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(nodes.name[victim]), std::string::npos) << e.what();
  }
  // The failure came before any optimizer update: the weights are untouched.
  EXPECT_EQ(trainer.read_parameter("linear0.w"), before);
  // And the trainer still works.
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(std::isfinite(trainer.step(images, labels).loss));
  EXPECT_NE(trainer.read_parameter("linear0.w"), before);
}

TEST(Trainer, RejectsBadBatchesBeforeRunning) {
  Runtime runtime;
  TrainerOptions topt;
  topt.batch = 4;
  Trainer trainer(runtime, small_mlp(), topt);
  auto images = random_vector(4 * 20, 1);
  auto labels = random_labels(4, 2);
  const auto before = trainer.read_parameter("linear0.w");
  auto expect_error = [&](std::span<const float> im, std::span<const std::int32_t> lab, const char* needle) {
    try {
      trainer.step(im, lab);
      ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(std::span(images).first(3 * 20), std::span(labels).first(3), "compiled for 4 samples");
  auto bad_labels = labels;
  bad_labels[2] = 10;
  expect_error(images, bad_labels, "outside [0, 10)");
  auto bad_images = images;
  bad_images[25] = std::nanf("");
  expect_error(bad_images, labels, "not finite");
  // Labels as floats: the same byte count, so only the dtype can be named.
  const std::vector<float> float_labels(labels.begin(), labels.end());
  try {
    trainer.step(Batch{{"input", HostView(images)}, {"labels", HostView(float_labels)}});
    ADD_FAILURE() << "expected a dtype error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'labels' is f32, but model"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("full batches"), std::string::npos) << e.what();
  }
  EXPECT_EQ(trainer.read_parameter("linear0.w"), before);
  EXPECT_EQ(trainer.steps_done(), 0u);
}

TEST(Builder, ShapeErrorsNameTheLayer) {
  graph::Graph g;
  ClassifierBuilder b(g, 4, graph::Shape{1, 28, 28}, 10);
  try {
    b.linear(b.reshape(b.input(), graph::Shape{4 * 28 * 28}), 10);  // rank 1: no rows
    FAIL();
  } catch (const graph::BuildError& e) {
    EXPECT_NE(std::string(e.what()).find("linear0"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 2 to 4"), std::string::npos) << e.what();
  }
  // Linear applies to the last axis of any rank.
  EXPECT_EQ(g.tensors.shape[b.linear(b.input(), 10)], (graph::Shape{4, 1, 28, 10}));
  TensorId x = b.linear(b.flatten(b.input()), 7);
  EXPECT_THROW(b.softmax_xent(b.linear(b.input(), 10)), graph::BuildError);  // [4, 1, 28, 10]: one label per row
  {
    // Rows of a sequence loss past what a shape axis holds (batch x sequence >= 2^32): refused,
    // not cut to their low bits by the views the loss takes.
    graph::Graph big;
    graph::Builder bb(big, 1u << 16);
    const TensorId logits = bb.input("logits", graph::Shape{1u << 16, 3});
    const TensorId labels = bb.input("labels", graph::Shape{1u << 16}, graph::DType::i32, graph::Role::label);
    try {
      bb.softmax_xent(logits, labels);
      ADD_FAILURE() << "2^32 rows of classes were accepted";
    } catch (const graph::BuildError& e) {
      EXPECT_NE(std::string(e.what()).find("4294967296 rows of classes"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(b.add(x, b.linear(x, 8)), graph::BuildError);
  EXPECT_THROW(b.conv2d(x, 4, 3), graph::BuildError);
  // Convolutions: a kernel larger than the padded input, a padding past half the kernel.
  const auto expect_conv_error = [&](TensorId in, std::uint32_t kernel, std::uint32_t stride, std::uint32_t pad,
                                     const std::string& needle) {
    try {
      b.conv2d(in, 4, kernel, stride, pad);
      FAIL() << "kernel " << kernel << " pad " << pad;
    } catch (const graph::BuildError& e) {
      EXPECT_NE(std::string(e.what()).find("conv"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const TensorId small = b.reshape(b.linear(x, 16), graph::Shape{4, 1, 4, 4});
  expect_conv_error(small, 7, 1, 0, "larger than the padded input");
  expect_conv_error(small, 3, 1, 2, "more than half the kernel");
  EXPECT_EQ(g.tensors.shape[b.conv2d(small, 4, 7, 1, 3)], (graph::Shape{4, 4, 4, 4}));
}

TEST(Runtime, UnknownDeviceListsTheDevices) {
  try {
    Runtime runtime({.device = "no-such-device-xyz"});
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("no-such-device-xyz"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("[0]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Runtime({.device = "999"}), std::runtime_error);
}

TEST(Trainer, EvaluationVariantsShareWeightsAndCoverEverySample) {
  Runtime runtime;
  TrainerOptions topt;
  topt.batch = 8;
  Trainer trainer(runtime, small_mlp(), topt);
  Dataset d;
  d.count = 21;  // 8 + 8 + 4 + 1: three variants
  d.rows = 4;
  d.cols = 5;
  d.images = random_vector(d.count * 20, 3);
  d.labels = random_labels(d.count, 4);
  // Train on the same data until it is memorised, then evaluation must see the learned weights.
  for (int i = 0; i < 150; ++i) trainer.step(std::span(d.images).first(8 * 20), std::span(d.labels).first(8));
  Dataset first8 = d;
  first8.count = 8;
  first8.images.resize(8 * 20);
  first8.labels.resize(8);
  EXPECT_EQ(trainer.evaluate(first8).accuracy, 1.0);
  const auto all = trainer.evaluate(d);
  EXPECT_EQ(all.samples, 21u);
  // Evaluation runs in the training step's buffers: its variants add no device memory.
  ASSERT_EQ(compiled_variants(trainer).size(), 3u);
  for (const auto& [key, step] : compiled_variants(trainer)) {
    EXPECT_FALSE(key.training);
    EXPECT_EQ(step->plan().new_transient_bytes, 0u) << "eval batch " << key.batch;
  }
  EXPECT_GE(all.accuracy, 8.0 / 21.0 - 1e-9);
  // Every dataset size from 1 to 20 reuses power-of-two variants: batch 8 gives at most 8, 4, 2, 1.
  double loss_of_21 = all.loss;
  for (std::size_t count = 1; count <= 20; ++count) {
    Dataset part = d;
    part.count = count;
    const auto r = trainer.evaluate(part);
    EXPECT_EQ(r.samples, count);
    EXPECT_TRUE(std::isfinite(r.loss));
  }
  EXPECT_EQ(compiled_variants(trainer).size(), 4u);
  EXPECT_EQ(trainer.evaluate(d).loss, loss_of_21) << "evaluation is deterministic";
}

// Prediction returns the model's logits for any number of samples, the same as a batch of one.
TEST(Trainer, PredictReturnsTheLogitsOfEverySample) {
  Runtime runtime;
  TrainerOptions topt;
  topt.batch = 4;
  Trainer trainer(runtime, small_mlp(), topt);
  Dataset d;
  d.count = 7;
  d.rows = 4;
  d.cols = 5;
  d.images = random_vector(d.count * 20, 5);
  d.labels = random_labels(d.count, 6);
  const Trainer::HostTensor all = trainer.predict(d);
  EXPECT_EQ(all.dtype, graph::DType::f32);
  EXPECT_EQ(all.shape, (graph::Shape{7, 10}));
  ASSERT_EQ(all.bytes.size(), 7u * 10u * 4u);
  const auto* logits = reinterpret_cast<const float*>(all.bytes.data());
  // The logits against a hand computation from the weights: relu(x W0 + b0) W1 + b1.
  const auto w0 = trainer.read_parameter("linear0.w"), b0 = trainer.read_parameter("linear0.b");
  const auto w1 = trainer.read_parameter("linear2.w"), b1 = trainer.read_parameter("linear2.b");
  for (std::size_t s = 0; s < 7; ++s) {
    std::vector<double> h(13);
    for (std::size_t j = 0; j < 13; ++j) {
      double acc = b0[j];
      for (std::size_t i = 0; i < 20; ++i) acc += double(d.images[s * 20 + i]) * w0[i * 13 + j];
      h[j] = std::max(acc, 0.0);
    }
    for (std::size_t k = 0; k < 10; ++k) {
      double acc = b1[k];
      for (std::size_t j = 0; j < 13; ++j) acc += h[j] * w1[j * 10 + k];
      EXPECT_NEAR(logits[s * 10 + k], acc, 1e-4) << "sample " << s << " class " << k;
    }
  }
  // Prediction variants read only the inputs: no labels are staged or checked.
  for (const auto& [key, step] : compiled_variants(trainer)) {
    EXPECT_TRUE(key.predict);
    EXPECT_THROW(step->host_input("labels"), std::invalid_argument);
  }
}

}  // namespace
}  // namespace ferry::test
