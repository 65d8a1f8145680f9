// Host updates overlapped with the next step's forward (ResidencyOptions::overlap_host_updates):
// each step's host updates run in the step after it, each just before its weight's fetch. The
// weights every forward reads, and so every loss and the final state, are bit for bit those of the
// host optimizer's updates after the commit point; the last step's update reaches the state
// before anything reads it (parameters, checkpoints, evaluation); a step that fails part-way
// leaves the updates it did not reach pending, and one that fails inside a deferred update is a
// partial update naming its tensors.
#include <fmt/format.h>

#include <filesystem>
#include <map>
#include <set>

#include "classifier.hpp"
#include "ferry/ferry.hpp"
#include "graph/compiled_step.hpp"
#include "runtime/trainer_internals.hpp"
#include "test_models.hpp"
#include "test_support.hpp"
#include "trainer_state.hpp"

namespace ferry::test {
namespace {

struct Case {
  const char* name;
  ops::OptimizerConfig::Kind kind;
  float momentum = 0.9f;
  ops::DType precision = ops::DType::f32;
  offload::HostMemory memory = offload::HostMemory::pinned;
  std::uint64_t chunk = 0;  // staged memory's chunked fetches
};

TrainerOptions host_options(Runtime& rt, const ModelSpec& m, const Case& c, bool overlap) {
  TrainerOptions o;
  o.batch = 8;
  o.lr = 0.01f;
  o.residency.mode = graph::ResidencyMode::stream;
  o.residency.host_optimizer = true;
  o.optimizer.kind = c.kind;
  o.optimizer.sgd.momentum = c.momentum;
  o.optimizer.adam.weight_decay = 0.01f;
  o.precision.compute = c.precision;
  o.residency.homes.host_memory = c.memory;
  o.residency.staging_chunk_bytes = c.chunk;
  if (c.memory == offload::HostMemory::staged) o.residency.staging_min_bytes = 0;
  const auto min_budget = ferry::min_stream_budget(rt, m, o);
  if (!min_budget) ADD_FAILURE() << "no budget found";
  o.residency.budget_bytes = min_budget.value_or(0) * 2;
  o.residency.overlap_host_updates = overlap;
  return o;
}

struct Trained {
  TensorBytes state;  // weights and optimizer state
  std::vector<float> losses;
};

Trained train(Trainer& trainer, const ModelSpec& m, int steps) {
  Trained r;
  const std::size_t sample = sample_elems(m);
  for (int s = 0; s < steps; ++s) {
    r.losses.push_back(trainer.step(random_vector(8 * sample, 50 + s), labels_for(8, 70 + s)).loss);
  }
  r.state = tensors_of(trainer);
  return r;
}

class OverlappedUpdatesTest : public ::testing::TestWithParam<Case> {};

TEST_P(OverlappedUpdatesTest, AreBitIdenticalToUpdatesAfterTheCommitPoint) {
  Runtime rt;
  const ModelSpec m = small_residual();
  const Case c = GetParam();
  Trainer after_commit(rt, m, host_options(rt, m, c, false));
  Trainer overlapped(rt, m, host_options(rt, m, c, true));
  const Trained reference = train(after_commit, m, 4);
  const Trained run = train(overlapped, m, 4);
  EXPECT_EQ(run.losses, reference.losses);
  ASSERT_EQ(run.state.size(), reference.state.size());
  for (const auto& [name, bytes] : reference.state) EXPECT_EQ(run.state.at(name), bytes) << name;

  // The graph: every host update deferred, before each fetch of its weight; no commit point left to
  // wait for; the step tensors the updates read (the previous step's gradients) share no bytes with
  // any other step tensor.
  const graph::CompiledStep& step = compiled_train_step(overlapped);
  const auto& g = step.graph();
  const auto& nodes = g.nodes;
  EXPECT_FALSE(step.commit_node().has_value());
  std::map<graph::TensorId, graph::NodeId> update_of;  // weight -> its deferred update
  std::set<graph::TensorId> read_by_updates;
  std::size_t deferred_updates = 0;
  for (graph::NodeId n = 0; n < nodes.size(); ++n) {
    if (nodes.lane[n] != graph::Lane::host || ops::op_info(nodes.op[n]).op_class != ops::OpClass::update) continue;
    EXPECT_TRUE(nodes.deferred[n]) << nodes.name[n];
    ++deferred_updates;
    update_of[g.tensors.storage(nodes.outputs(n)[0])] = n;
    for (graph::TensorId x : nodes.inputs(n)) {
      const graph::TensorId s = g.tensors.storage(x);
      if (step.plan().pool[s] == graph::Pool::host_transient) read_by_updates.insert(s);
    }
  }
  EXPECT_EQ(deferred_updates, overlapped.parameter_names().size());
  EXPECT_FALSE(read_by_updates.empty());
  for (graph::NodeId n = 0; n < nodes.size(); ++n) {
    for (graph::TensorId x : nodes.inputs(n)) {
      const auto it = update_of.find(g.tensors.storage(x));
      if (it == update_of.end() || it->second == n) continue;
      EXPECT_LT(it->second, n) << nodes.name[n] << " reads " << g.tensors.name[x] << " before its update";
    }
  }
  for (graph::TensorId a : read_by_updates) {
    const auto& pa = g.tensors.placement[a];
    for (graph::TensorId b = 0; b < g.tensors.size(); ++b) {
      if (b == a || g.tensors.storage(b) != b || step.plan().pool[b] != graph::Pool::host_transient) continue;
      const auto& pb = g.tensors.placement[b];
      if (pa.buffer != pb.buffer || g.tensors.bytes(b) == 0) continue;
      const bool apart = pa.offset_bytes + g.tensors.bytes(a) <= pb.offset_bytes ||
                         pb.offset_bytes + g.tensors.bytes(b) <= pa.offset_bytes;
      EXPECT_TRUE(apart) << g.tensors.name[a] << " shares bytes with " << g.tensors.name[b];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Optimizers, OverlappedUpdatesTest,
    ::testing::Values(Case{"adam", ops::OptimizerConfig::Kind::adam}, Case{"adamw", ops::OptimizerConfig::Kind::adamw},
                      Case{"adamw8bit", ops::OptimizerConfig::Kind::adamw8bit},
                      Case{"sgd_momentum", ops::OptimizerConfig::Kind::sgd},
                      // The update that writes its gradient (velocity) reads an f32 copy a host cast
                      // widens from the narrow one: the cast is deferred with it.
                      Case{"sgd_bf16", ops::OptimizerConfig::Kind::sgd, 0.0f, ops::DType::bf16},
                      // Loss scaling: the first steps overflow and skip their update, deferred or not.
                      Case{"adam_f16", ops::OptimizerConfig::Kind::adam, 0.9f, ops::DType::f16},
                      Case{"adam_staged_chunks", ops::OptimizerConfig::Kind::adam, 0.9f, ops::DType::f32,
                           offload::HostMemory::staged, 4096}),
    [](const auto& info) { return std::string(info.param.name); });

// The last step's update is pending after it (the next step would apply it); reading the
// parameters, saving a checkpoint or evaluating applies it first, so each sees the state the
// steps made, as without the overlap.
TEST(OverlappedUpdates, TheLastUpdateReachesWhatReadsTheState) {
  Runtime rt;
  const ModelSpec m = small_mlp();
  const Case c{"adam", ops::OptimizerConfig::Kind::adam};
  Trainer reference(rt, m, host_options(rt, m, c, false));
  Trainer overlapped(rt, m, host_options(rt, m, c, true));
  const Dataset d = small_mlp_samples(19, 8);
  for (int s = 0; s < 3; ++s) {
    reference.step(std::span(d.images).first(8 * 20), std::span(d.labels).first(8));
    overlapped.step(std::span(d.images).first(8 * 20), std::span(d.labels).first(8));
  }
  EXPECT_TRUE(compiled_train_step(overlapped).has_deferred_updates());
  const auto saved = testing::TempDir() + "/overlapped_updates.ferry";
  overlapped.save_checkpoint(saved);
  EXPECT_FALSE(compiled_train_step(overlapped).has_deferred_updates());
  Trainer loaded(rt, m, host_options(rt, m, c, false));
  loaded.load_checkpoint(saved);
  std::filesystem::remove(saved);
  EXPECT_EQ(tensors_of(loaded), tensors_of(reference));
  // One more step each: its update pending again, evaluation applies it.
  reference.step(std::span(d.images).first(8 * 20), std::span(d.labels).first(8));
  overlapped.step(std::span(d.images).first(8 * 20), std::span(d.labels).first(8));
  EXPECT_TRUE(compiled_train_step(overlapped).has_deferred_updates());
  const auto a = overlapped.evaluate(d), b = reference.evaluate(d);
  EXPECT_FALSE(compiled_train_step(overlapped).has_deferred_updates());
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(tensors_of(overlapped), tensors_of(reference));
}

// A step that fails after some of the deferred updates ran (a compute node in the middle of the
// forward) leaves the others pending: the step run again applies them, and training goes on bit
// for bit as if the failed step had never been tried.
TEST(OverlappedUpdates, AFailedStepLeavesTheUpdatesItDidNotReachPending) {
  Runtime rt;
  const ModelSpec m = small_residual();
  const Case c{"adam", ops::OptimizerConfig::Kind::adam};
  Trainer reference(rt, m, host_options(rt, m, c, false));
  Trainer overlapped(rt, m, host_options(rt, m, c, true));
  const std::size_t sample = sample_elems(m);
  const auto images = random_vector(8 * sample, 5);
  const auto labels = labels_for(8, 6);
  reference.step(images, labels);
  overlapped.step(images, labels);
  const auto& nodes = compiled_train_step(overlapped).graph().nodes;
  // The victim: the first compute node after the second deferred update (the forward's).
  std::vector<graph::NodeId> deferred, compute;
  for (graph::NodeId n = 0; n < nodes.size(); ++n) {
    if (nodes.deferred[n]) deferred.push_back(n);
    if (nodes.lane[n] == graph::Lane::compute && deferred.size() >= 2) compute.push_back(n);
  }
  ASSERT_GT(deferred.size(), 3u);
  ASSERT_FALSE(compute.empty()) << "no compute node after the deferred updates";
  EXPECT_LT(compute.front(), deferred.back()) << "the deferred updates should be spread over the forward";
  compiled_train_step(overlapped).inject_failure(compute.front());
  try {
    overlapped.step(images, labels);
    FAIL() << "the step should fail";
  } catch (const graph::PartialUpdateError& e) {
    FAIL() << "a failure in the forward changes no state of this step: " << e.what();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(nodes.name[compute.front()]), std::string::npos) << e.what();
  }
  for (int s = 0; s < 2; ++s) EXPECT_EQ(overlapped.step(images, labels).loss, reference.step(images, labels).loss);
  EXPECT_EQ(tensors_of(overlapped), tensors_of(reference));
}

// A deferred update that throws from inside its host work has changed part of its weight: a
// partial update naming that weight's tensors; the trainer refuses to go on until a checkpoint
// restores it.
TEST(OverlappedUpdates, AFailingDeferredUpdateIsAPartialUpdateNamingItsTensors) {
  Runtime rt;
  const ModelSpec m = small_residual();
  const Case c{"adam", ops::OptimizerConfig::Kind::adam};
  Trainer trainer(rt, m, host_options(rt, m, c, true));
  const std::size_t sample = sample_elems(m);
  const auto images = random_vector(8 * sample, 15);
  const auto labels = labels_for(8, 16);
  trainer.step(images, labels);
  const auto saved = testing::TempDir() + "/overlapped_updates_partial.ferry";
  trainer.save_checkpoint(saved);
  const TensorBytes before = tensors_of(trainer);
  trainer.step(images, labels);  // its update pending
  const auto& g = compiled_train_step(trainer).graph();
  graph::NodeId victim = 0;
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    if (g.nodes.deferred[n] && ops::op_info(g.nodes.op[n]).op_class == ops::OpClass::update) victim = n;
  }
  compiled_train_step(trainer).inject_failure(victim, graph::Fault::host_throw);
  try {
    trainer.step(images, labels);
    FAIL() << "the step should fail";
  } catch (const graph::PartialUpdateError& e) {
    const std::string weight = g.tensors.name[g.tensors.storage(g.nodes.outputs(victim)[0])];
    EXPECT_NE(std::find(e.tensors().begin(), e.tensors().end(), weight), e.tensors().end()) << e.what();
    EXPECT_NE(std::string(e.what()).find("the update of step 2 deferred into it"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(compiled_train_step(trainer).has_deferred_updates()) << "the update was abandoned";
  EXPECT_THROW(trainer.step(images, labels), std::runtime_error);
  trainer.load_checkpoint(saved);
  EXPECT_EQ(tensors_of(trainer), before);
  EXPECT_TRUE(std::isfinite(trainer.step(images, labels).loss));

  // Failing where the pending update is applied outside a step (a read of the state): the same
  // partial update, and the next step refuses to run until a checkpoint is loaded.
  compiled_train_step(trainer).inject_failure(victim, graph::Fault::host_throw);
  try {
    (void)trainer.read_parameter(trainer.parameter_names().front());
    FAIL() << "the read should apply the pending update, and fail";
  } catch (const graph::PartialUpdateError& e) {
    EXPECT_NE(std::string(e.what()).find("deferred from step"), std::string::npos) << e.what();
  }
  try {
    trainer.step(images, labels);
    FAIL() << "a step after a failed deferred update should be refused";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("failed part-way"), std::string::npos) << e.what();
  }
  trainer.load_checkpoint(saved);
  std::filesystem::remove(saved);
  EXPECT_EQ(tensors_of(trainer), before);
  EXPECT_TRUE(std::isfinite(trainer.step(images, labels).loss));
}

TEST(OverlappedUpdates, ConfigurationsWithoutOneUpdatingVariantAreRefused) {
  Runtime rt;
  const ModelSpec m = small_residual();
  const Case c{"adam", ops::OptimizerConfig::Kind::adam};
  const auto refused = [&](auto change, const char* says) {
    TrainerOptions o = host_options(rt, m, c, true);
    change(o);
    try {
      Trainer t(rt, m, o);
      ADD_FAILURE() << "accepted: " << says;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused([](TrainerOptions& o) { o.residency.host_optimizer = false; }, "add --host-optimizer");
  refused([](TrainerOptions& o) { o.accumulate = 2; }, "accumulation");
  refused([](TrainerOptions& o) { o.phases.hybrid = true; }, "hybrid phases");
  refused([](TrainerOptions& o) { o.residency.homes.pinned_copies = 2; }, "one pinned copy");
}

}  // namespace
}  // namespace ferry::test
