// Residency under a device budget: streamed and mapped training give bit-identical weights to
// the all-resident run, the planned peak never exceeds the budget, too small a budget is a clear
// compile-time error naming the minimum, and a step that fails mid-way leaves the state as it was.
#include <fmt/format.h>

#include <filesystem>
#include <map>
#include <set>

#include "classifier.hpp"
#include "ferry/ferry.hpp"
#include "ferry/offload/pinned_host.hpp"
#include "ops/attrs.hpp"
#include "runtime/trainer_internals.hpp"
#include "test_models.hpp"
#include "test_support.hpp"
#include "trainer_state.hpp"

namespace ferry::test {
namespace {

TrainerOptions options(graph::ResidencyMode mode, std::uint64_t budget, std::uint32_t lookahead = 2) {
  TrainerOptions o;
  o.batch = 8;
  o.lr = 0.01f;
  o.residency.mode = mode;
  o.residency.budget_bytes = budget;
  o.residency.lookahead = lookahead;
  return o;
}

// Trains `steps` steps on fixed random batches and returns every parameter and the losses.
struct RunResult {
  Parameters params;
  std::vector<float> losses;
};

// Every parameter of `t` equals `expected` bit for bit.
void expect_parameters(const Trainer& t, const Parameters& expected) {
  for (const auto& [name, values] : expected) EXPECT_EQ(t.read_parameter(name), values) << name;
}

RunResult train(Runtime& rt, const ModelSpec& m, const TrainerOptions& o, int steps) {
  Trainer trainer(rt, m, o);
  RunResult r;
  const std::size_t sample = sample_elems(m);
  for (int s = 0; s < steps; ++s) {
    auto images = random_vector(o.batch * sample, 50 + s);
    auto labels = labels_for(o.batch, 70 + s);
    r.losses.push_back(trainer.step(images, labels).loss);
  }
  r.params = parameters_of(trainer);
  return r;
}

std::uint64_t min_stream_budget(Runtime& rt, const ModelSpec& m) {
  const auto budget = ferry::min_stream_budget(rt, m, options(graph::ResidencyMode::stream, 1));
  if (!budget) ADD_FAILURE() << "a 1-byte budget should not fit";
  return budget.value_or(0);
}

class ResidencyTest : public ::testing::TestWithParam<ModelSpec (*)()> {};

TEST_P(ResidencyTest, StreamedAndMappedTrainingAreBitIdenticalToResident) {
  Runtime rt;
  const ModelSpec m = GetParam()();
  const int steps = 4;
  const RunResult resident = train(rt, m, options(graph::ResidencyMode::resident, 0), steps);
  const std::uint64_t min_budget = min_stream_budget(rt, m);
  ASSERT_GT(min_budget, 0u);

  struct Case {
    const char* what;
    TrainerOptions opt;
    bool fetch_filler = false;  // chunked fetches filled by the ring's own thread
  };
  std::vector<Case> cases = {
      {"stream at the minimum budget, no lookahead", options(graph::ResidencyMode::stream, min_budget, 0)},
      {"stream at 1.5x the minimum, lookahead 2", options(graph::ResidencyMode::stream, min_budget * 3 / 2, 2)},
      {"stream with room for everything", options(graph::ResidencyMode::stream, 1ull << 30, 3)},
  };
  // Homes per role: one role on the device, the other streamed (or mapped).
  auto homes = [](graph::ResidencyMode mode, std::optional<graph::Home> weights, std::optional<graph::Home> state) {
    TrainerOptions o = options(mode, 0);
    o.residency.weights_home = weights;
    o.residency.state_home = state;
    return o;
  };
  cases.push_back({"weights on the device, optimizer state streamed",
                   homes(graph::ResidencyMode::resident, std::nullopt, graph::Home::host_pinned)});
  cases.push_back({"weights streamed, optimizer state on the device",
                   homes(graph::ResidencyMode::stream, std::nullopt, graph::Home::device)});
  // Pageable host memory (what NVIDIA gets by default): the same copies, staged by the driver; and
  // mapped mode asked for it (its home and the pool kernels use stay pinned).
  auto pageable = [](TrainerOptions o) {
    o.residency.homes.host_memory = offload::HostMemory::pageable;
    return o;
  };
  cases.push_back({"stream at the minimum budget, pageable host memory",
                   pageable(options(graph::ResidencyMode::stream, min_budget, 0))});
  // Registered host memory: ferry's pages handed to the driver, otherwise as pinned (no staging,
  // steps run ahead).
  auto registered = [](TrainerOptions o) {
    o.residency.homes.host_memory = offload::HostMemory::registered;
    return o;
  };
  cases.push_back({"stream at the minimum budget, registered host memory",
                   registered(options(graph::ResidencyMode::stream, min_budget, 0))});
  // Staged host memory: every copy through pinned staging, however small.
  auto staged = [](TrainerOptions o) {
    o.residency.homes.host_memory = offload::HostMemory::staged;
    o.residency.staging_min_bytes = 0;
    return o;
  };
  cases.push_back({"stream at 1.5x the minimum, lookahead 2, staged host memory",
                   staged(options(graph::ResidencyMode::stream, min_budget * 3 / 2, 2))});
  cases.push_back({"optimizer state streamed, staged host memory",
                   staged(homes(graph::ResidencyMode::resident, std::nullopt, graph::Home::host_pinned))});
  // Chunked fetches: chunks of 4 KiB, so most tensors take several and the four slots go round
  // within a fetch and from one fetch to the next.
  auto chunked = [&](TrainerOptions o) {
    o = staged(o);
    o.residency.staging_chunk_bytes = 4096;
    return o;
  };
  cases.push_back({"stream at the minimum budget, staged host memory, chunked fetches",
                   chunked(options(graph::ResidencyMode::stream, min_budget, 0))});
  cases.push_back({"stream at 1.5x the minimum, lookahead 2, staged host memory, chunked fetches",
                   chunked(options(graph::ResidencyMode::stream, min_budget * 3 / 2, 2))});
  if (!cl::is_simulator(rt.device().facts())) {  // a simulator fills inline only (FetchRing::filling_for)
    cases.push_back({"stream at the minimum budget, staged host memory, chunked fetches, a filler thread",
                     chunked(options(graph::ResidencyMode::stream, min_budget, 0)), true});
    cases.push_back({"stream at 1.5x the minimum, lookahead 2, staged host memory, chunked fetches, a filler thread",
                     chunked(options(graph::ResidencyMode::stream, min_budget * 3 / 2, 2)), true});
  }
  // Two host copies (HomeStoreOptions::pinned_copies = 2, an option no default uses): updates run
  // before the commit point into the next copy, made current at commit.
  auto two_copies = [](TrainerOptions o) {
    o.residency.homes.pinned_copies = 2;
    return o;
  };
  TrainerOptions two = two_copies(options(graph::ResidencyMode::stream, 1, 0));
  two.residency.budget_bytes = ferry::min_stream_budget(rt, m, two).value_or(0);  // its own: updates run early
  cases.push_back({"stream at its minimum budget, two host copies", two});
  TrainerOptions compressed_two = two_copies(options(graph::ResidencyMode::stream, 1ull << 30, 2));
  compressed_two.residency.state_home = graph::Home::host_compressed;
  cases.push_back({"stream with room, compressed optimizer state, two copies", compressed_two});
  if (rt.device().host_unified_memory) {
    cases.push_back({"mapped, pageable host memory asked for", pageable(options(graph::ResidencyMode::mapped, 0))});
    cases.push_back({"mapped", options(graph::ResidencyMode::mapped, 0)});
    cases.push_back({"weights mapped, optimizer state streamed",
                     homes(graph::ResidencyMode::mapped, std::nullopt, graph::Home::host_pinned)});
  }
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    const ScopedFetchFiller filler(c.fetch_filler);
    Trainer probe(rt, m, c.opt);
    EXPECT_LE(probe.device_peak_bytes(), probe.device_budget_bytes());
    const RunResult r = train(rt, m, c.opt, steps);
    EXPECT_EQ(r.losses, resident.losses);
    for (const auto& [name, values] : resident.params) EXPECT_EQ(r.params.at(name), values) << name;
  }
}

TEST_P(ResidencyTest, SmallBudgetStreamsMoreAndStaysWithinIt) {
  Runtime rt;
  const ModelSpec m = GetParam()();
  const std::uint64_t min_budget = min_stream_budget(rt, m);
  Trainer tight(rt, m, options(graph::ResidencyMode::stream, min_budget, 0));
  Trainer roomy(rt, m, options(graph::ResidencyMode::stream, 1ull << 30, 0));
  EXPECT_LE(tight.device_peak_bytes(), min_budget);
  // Every weight and state tensor is fetched at least once and written back once per step.
  const auto weights = tight.parameter_names().size();
  EXPECT_GE(roomy.residency().fetches, 3 * weights);  // weight + two Adam moments
  EXPECT_EQ(roomy.residency().write_backs, 3 * weights);
  // Under the tight budget weights are evicted between forward and backward and fetched again.
  EXPECT_GT(tight.residency().fetch_bytes, roomy.residency().fetch_bytes);
  EXPECT_LT(tight.device_peak_bytes(), roomy.device_peak_bytes());
  // One host copy of weights and state (plus alignment: the device's, 512 bytes on NVIDIA); under
  // the tight budget the gradients may also spill to the host step pool, which is never more than
  // one more copy of the weights.
  const std::uint64_t align = std::max<std::uint64_t>(256, rt.device().base_align_bytes);
  const std::uint64_t homes = tight.weight_bytes() + tight.optimizer_state_bytes() + align * 3 * weights;
  EXPECT_GE(compiled_train_step(tight).persistent()->host_bytes(),
            tight.weight_bytes() + tight.optimizer_state_bytes());
  EXPECT_LE(compiled_train_step(tight).persistent()->host_bytes(), homes);
  EXPECT_EQ(compiled_train_step(roomy).persistent()->host_bytes(),
            compiled_train_step(tight).persistent()->host_bytes());
  EXPECT_GE(tight.host_state_bytes(), roomy.host_state_bytes());
  EXPECT_LE(tight.host_state_bytes(),
            homes + tight.weight_bytes() + compiled_train_step(tight).plan().host_transient_bytes);
}

// A lookahead far past what the budget holds is brought down to one that fits (halved while long),
// not dropped to none after the planner's tries.
TEST(Residency, ALookaheadFarPastWhatFitsIsBroughtDownNotDropped) {
  Runtime rt;
  const ModelSpec m = small_residual();
  const std::uint64_t budget = min_stream_budget(rt, m) * 3 / 2;
  Trainer near(rt, m, options(graph::ResidencyMode::stream, budget, 2));
  ASSERT_EQ(near.residency().lookahead, 2u) << "the case needs a budget that holds a lookahead of 2";
  Trainer far(rt, m, options(graph::ResidencyMode::stream, budget, 1000));
  EXPECT_GE(far.residency().lookahead, 2u);
  EXPECT_LT(far.residency().lookahead, 1000u) << "a lookahead of 1000 should not fit this budget";
  EXPECT_LE(far.device_peak_bytes(), budget);
}

INSTANTIATE_TEST_SUITE_P(Models, ResidencyTest, ::testing::Values(&small_mlp, &small_cnn, &small_residual),
                         [](const auto& info) {
                           return info.index == 0 ? "mlp" : info.index == 1 ? "cnn" : "residual";
                         });

TEST(Residency, TooSmallBudgetIsACompileTimeErrorNamingTheMinimum) {
  Runtime rt;
  const std::uint64_t min_budget = min_stream_budget(rt, small_residual());
  try {
    Trainer t(rt, small_residual(), options(graph::ResidencyMode::stream, min_budget - 1));
    FAIL() << "should not fit";
  } catch (const graph::BudgetError& e) {
    EXPECT_EQ(e.min_budget(), min_budget);
    EXPECT_NE(std::string(e.what()).find("at least"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(Trainer(rt, small_residual(), options(graph::ResidencyMode::stream, min_budget)));
  // Resident mode with a budget below the model is an error too, not a silent switch.
  EXPECT_THROW(Trainer(rt, small_residual(), options(graph::ResidencyMode::resident, 4096)), graph::BudgetError);
  // Automatic mode picks streaming (or mapping) by itself under the same budget.
  Trainer automatic(rt, small_residual(), options(graph::ResidencyMode::automatic, min_budget * 2));
  EXPECT_NE(automatic.residency().mode, graph::ResidencyMode::resident);
}

class FailedStepTest : public ::testing::TestWithParam<graph::ResidencyMode> {};

TEST_P(FailedStepTest, LeavesTheStateUnchanged) {
  Runtime rt;
  const graph::ResidencyMode mode = GetParam();
  if (mode == graph::ResidencyMode::mapped && !rt.device().host_unified_memory) {
    GTEST_SKIP() << "mapped mode needs a unified-memory device";
  }
  const ModelSpec m = small_residual();
  const std::uint64_t budget = mode == graph::ResidencyMode::stream ? min_stream_budget(rt, m) : 0;
  Trainer trainer(rt, m, options(mode, budget));
  ASSERT_EQ(trainer.residency().mode, mode);
  Trainer reference(rt, m, options(graph::ResidencyMode::resident, 0));
  const std::size_t sample = sample_elems(m);
  auto images = random_vector(8 * sample, 5);
  auto labels = labels_for(8, 6);
  trainer.step(images, labels);
  reference.step(images, labels);

  // Fail the last compute node that is not an optimizer update. Streaming places updates early,
  // so by then most updated tensors have been written back (into the other host slot).
  const auto& nodes = compiled_train_step(trainer).graph().nodes;
  graph::NodeId victim = 0, write_backs_before = 0;
  for (graph::NodeId n = 0; n < nodes.size(); ++n) {
    const bool update = ops::op_info(nodes.op[n]).op_class == ops::OpClass::update;  // adam_update_group too
    if (nodes.lane[n] == graph::Lane::compute && !update) victim = n;
  }
  for (graph::NodeId n = 0; n < victim; ++n) write_backs_before += nodes.op[n] == graph::builtin::write_back;
  if (mode == graph::ResidencyMode::stream) {
    ASSERT_GT(write_backs_before, 3u);
  }
  auto before = parameters_of(trainer);
  compiled_train_step(trainer).inject_failure(victim);
  EXPECT_THROW(trainer.step(images, labels), std::runtime_error);
  expect_parameters(trainer, before);

  // The trainer goes on exactly as if the failed step had never been tried.
  for (int s = 0; s < 2; ++s) EXPECT_EQ(trainer.step(images, labels).loss, reference.step(images, labels).loss);
  for (const auto& name : trainer.parameter_names()) {
    EXPECT_EQ(trainer.read_parameter(name), reference.read_parameter(name)) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, FailedStepTest,
                         ::testing::Values(graph::ResidencyMode::stream, graph::ResidencyMode::mapped,
                                           graph::ResidencyMode::resident),
                         [](const auto& info) { return std::string(graph::residency_mode_name(info.param)); });

TEST(Residency, MappedModeKeepsWeightsAndTheirGradientsInHostMemory) {
  Runtime rt;
  if (!rt.device().host_unified_memory) GTEST_SKIP() << "mapped mode needs a unified-memory device";
  const ModelSpec m = small_residual();
  Trainer resident(rt, m, options(graph::ResidencyMode::resident, 0));
  Trainer mapped(rt, m, options(graph::ResidencyMode::mapped, 0));
  EXPECT_EQ(mapped.residency().fetches, 0u);
  // One slot of weights and optimizer state in host memory (plus alignment padding).
  const std::uint64_t homes = compiled_train_step(mapped).persistent()->host_bytes();
  EXPECT_GE(homes, resident.weight_bytes() + resident.optimizer_state_bytes());
  const std::uint64_t tensors = 3 * resident.parameter_names().size();  // weight and two Adam moments each
  EXPECT_LE(homes, resident.weight_bytes() + resident.optimizer_state_bytes() + 256 * tensors);
  EXPECT_GE(compiled_train_step(mapped).host_step_bytes(), resident.weight_bytes());  // the weight gradients
  EXPECT_EQ(mapped.host_state_bytes(), homes + compiled_train_step(mapped).host_bytes());
  EXPECT_LT(mapped.device_peak_bytes(), resident.device_peak_bytes() - resident.weight_bytes());
}

// Staged host memory: each fetch and write-back goes through pinned staging that host-lane nodes
// fill and drain, and the staging area holds a few transfers, not the state.
TEST(Residency, StagedHostMemoryCopiesThroughASmallPinnedArea) {
  Runtime rt;
  const ModelSpec m = small_residual();
  TrainerOptions o = options(graph::ResidencyMode::stream, 1ull << 30);
  o.residency.homes.host_memory = offload::HostMemory::staged;
  o.residency.staging_min_bytes = 0;
  Trainer t(rt, m, o);
  const auto& r = t.residency();
  EXPECT_GT(r.fetches, 0u);
  EXPECT_EQ(r.unpacks, r.fetches);
  EXPECT_EQ(r.packs, r.write_backs);
  const graph::MemoryPlan& plan = compiled_train_step(t).plan();
  std::uint64_t largest = 0;
  for (const auto& name : t.parameter_names())
    largest = std::max<std::uint64_t>(largest, t.read_parameter(name).size());
  largest *= sizeof(float);
  EXPECT_GT(plan.host_staging_bytes, 0u);
  // Two fetches' and two write-backs' staging at most (with alignment), far below the state.
  EXPECT_LE(plan.host_staging_bytes, 4 * (largest + 256));
  EXPECT_LT(plan.host_staging_bytes, t.weight_bytes() + t.optimizer_state_bytes());
  EXPECT_EQ(plan.host_transient_buffers.size() - plan.host_staging_from, plan.host_staging_bytes > 0 ? 1u : 0u);

  // Chunked fetches: each fetch copies itself through the ring (no unpack node); the write-backs
  // still go through staging and pack nodes, and the ring is one more pinned staging buffer of
  // four chunks.
  // (A model with fetches larger than the chunk: 128 KiB weights.)
  const ModelSpec wide = models::classifier("wide", graph::Shape{64}, 10, [](graph::Builder& b, TensorId x) {
    return b.linear(b.gelu(b.linear(x, 512)), 10);
  });
  o.residency.staging_chunk_bytes = 64 << 10;
  Trainer chunked(rt, wide, o);
  EXPECT_EQ(chunked.residency().unpacks, 0u);
  EXPECT_EQ(chunked.residency().packs, chunked.residency().write_backs);
  const graph::MemoryPlan& cplan = compiled_train_step(chunked).plan();
  EXPECT_EQ(cplan.fetch_ring_chunk_bytes, 64u << 10);
  EXPECT_EQ(cplan.host_transient_buffers.back(), 4u * (64u << 10));
  EXPECT_GE(cplan.host_staging_bytes, 4u * (64u << 10));
  // Every fetch is marked with the chunk, or its own size where that is smaller.
  const auto marked_fetches = [](const graph::CompiledStep& step, std::uint64_t chunk) {
    std::size_t marked = 0;
    const graph::Graph& g = step.graph();
    for (graph::NodeId id = 0; id < g.nodes.size(); ++id) {
      if (g.nodes.op[id] != graph::builtin::fetch) continue;
      const std::uint64_t bytes = g.tensors.bytes(g.tensors.storage(g.nodes.inputs(id)[0]));
      if (std::uint64_t(ops::FetchAttrs::of(g.nodes.attrs[id]).chunk_kib) == (std::min(chunk, bytes) + 1023) / 1024)
        ++marked;
    }
    return marked;
  };
  EXPECT_EQ(marked_fetches(compiled_train_step(chunked), 64 << 10), chunked.residency().fetches);
  // A chunk beyond the largest fetch: the ring's four slots are the largest fetch's size, not the
  // chunk's (a 256 MiB chunk for 4 MiB layers had held 1 GiB of pinned memory).
  o.residency.staging_chunk_bytes = 64 << 20;
  Trainer beyond(rt, wide, o);
  const std::uint64_t widest = 64 * 512 * sizeof(float);
  EXPECT_EQ(compiled_train_step(beyond).plan().fetch_ring_chunk_bytes, widest);
  EXPECT_EQ(compiled_train_step(beyond).plan().host_transient_buffers.back(), 4 * widest);
  EXPECT_EQ(marked_fetches(compiled_train_step(beyond), 64 << 20), beyond.residency().fetches);
  const auto images = random_vector(8 * sample_elems(wide), 5);
  const auto labels = labels_for(8, 6);
  EXPECT_EQ(beyond.step(images, labels).loss, chunked.step(images, labels).loss)
      << "the same numbers whatever the chunk";
  // A chunk out of range, or chunks without staged memory: an error before anything is allocated.
  o.residency.staging_chunk_bytes = 1024;
  EXPECT_THROW(Trainer(rt, m, o), std::invalid_argument);
  o.residency.staging_chunk_bytes = 64 << 10;
  o.residency.homes.host_memory = offload::HostMemory::pageable;
  EXPECT_THROW(Trainer(rt, m, o), std::invalid_argument);
  o.residency.homes.host_memory = offload::HostMemory::staged;
  o.residency.staging_chunk_bytes = 0;

  // Transfers under the threshold copy straight from pageable memory: no staging at all.
  o.residency.staging_min_bytes = 1ull << 40;
  Trainer direct(rt, m, o);
  EXPECT_EQ(direct.residency().unpacks, 0u);
  EXPECT_EQ(compiled_train_step(direct).plan().host_staging_bytes, 0u);
}

// Pageable host memory: a fetch of what the step itself wrote (a tensor written back and fetched
// again) goes through staging, since NVIDIA's driver read pageable memory when such a copy was
// enqueued; the other copies stay direct.
TEST(Residency, PageableMemoryStagesTheFetchesOfWhatTheStepWrote) {
  Runtime rt;
  const ModelSpec m = small_residual();
  TrainerOptions o = options(graph::ResidencyMode::stream, min_stream_budget(rt, m), 0);
  Trainer pinned(rt, m, o);
  EXPECT_EQ(pinned.residency().unpacks, 0u);
  o.residency.homes.host_memory = offload::HostMemory::pageable;
  Trainer pageable(rt, m, o);
  EXPECT_EQ(pageable.residency().packs, 0u);
  EXPECT_GT(pageable.residency().unpacks, 0u);
  EXPECT_LT(pageable.residency().unpacks, pageable.residency().fetches);
  const graph::Graph& g = compiled_train_step(pageable).graph();
  const auto& n = g.nodes;
  std::set<graph::TensorId> written;  // host tensors a write-back filled so far
  for (graph::NodeId id = 0; id < n.size(); ++id) {
    if (n.op[id] == graph::builtin::write_back) written.insert(g.tensors.storage(n.outputs(id)[0]));
    if (n.op[id] != graph::builtin::unpack) continue;
    const graph::TensorId host = g.tensors.storage(n.inputs(id)[0]);
    EXPECT_TRUE(written.contains(host) || !graph::is_persistent(g.tensors.role[host])) << n.name[id];
  }
  EXPECT_EQ(compiled_train_step(pageable).plan().host_staging_from + 1,
            compiled_train_step(pageable).plan().host_transient_buffers.size());
}

TEST(Residency, EvaluationOfAStreamedModelSeesTheTrainedWeights) {
  Runtime rt;
  const ModelSpec m = small_mlp();
  Trainer streamed(rt, m, options(graph::ResidencyMode::stream, min_stream_budget(rt, m)));
  Trainer resident(rt, m, options(graph::ResidencyMode::resident, 0));
  const Dataset d = small_mlp_samples(19, 8);
  for (int s = 0; s < 5; ++s) {
    streamed.step(std::span(d.images).first(8 * 20), std::span(d.labels).first(8));
    resident.step(std::span(d.images).first(8 * 20), std::span(d.labels).first(8));
  }
  const auto a = streamed.evaluate(d), b = resident.evaluate(d);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.accuracy, b.accuracy);
}

}  // namespace
}  // namespace ferry::test

namespace ferry::test {
namespace {

// A transfer failing before the commit point (the overflow guard's last check) leaves the state
// as it was; streamed state is one host copy written back in place after that point, so a
// transfer failing there is a partial update the trainer reports and refuses to step past until
// a checkpoint restores it, as for state on the device.
TEST(Residency, TransferFailingMidStepLeavesTheStateUnchangedBeforeTheCommitPoint) {
  Runtime rt;
  const ModelSpec m = small_residual();
  Trainer trainer(rt, m, options(graph::ResidencyMode::stream, min_stream_budget(rt, m)));
  const auto& nodes = compiled_train_step(trainer).graph().nodes;
  // Fetches before the commit point that follow a write-back (of a gradient spilled under the
  // tight budget), and fetches after it (of the update phase).
  std::vector<graph::NodeId> before_commit, after_commit;
  graph::NodeId first_write_back = 0, commit = 0;
  for (graph::NodeId n = 0; n < nodes.size(); ++n) {
    for (graph::TensorId x : nodes.outputs(n)) {
      if (x == compiled_train_step(trainer).graph().guard) commit = n;
    }
  }
  ASSERT_GT(commit, 0u);
  for (graph::NodeId n = 0; n < nodes.size(); ++n) {
    if (nodes.op[n] == graph::builtin::write_back && first_write_back == 0) first_write_back = n;
    if (nodes.op[n] != graph::builtin::fetch) continue;
    if (n > commit) {
      after_commit.push_back(n);
    } else if (first_write_back != 0) {
      before_commit.push_back(n);
    }
  }
  ASSERT_FALSE(before_commit.empty());
  ASSERT_FALSE(after_commit.empty());
  const std::size_t sample = sample_elems(m);
  auto images = random_vector(8 * sample, 15);
  auto labels = labels_for(8, 16);
  auto before = parameters_of(trainer);
  compiled_train_step(trainer).inject_failure(before_commit[before_commit.size() / 2]);
  try {
    trainer.step(images, labels);
    FAIL() << "the step should fail";
  } catch (const graph::PartialUpdateError& e) {
    FAIL() << "a failure before the commit point changed state: " << e.what();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("fetch."), std::string::npos) << e.what();
  }
  expect_parameters(trainer, before);
  EXPECT_TRUE(std::isfinite(trainer.step(images, labels).loss));

  // After the commit point: a partial update, named, and the trainer refuses to go on.
  const auto saved = testing::TempDir() + "/one_copy_restore.ferry";
  trainer.save_checkpoint(saved);
  const auto restored = parameters_of(trainer);
  compiled_train_step(trainer).inject_failure(after_commit[after_commit.size() / 2]);
  try {
    trainer.step(images, labels);
    FAIL() << "the step should fail";
  } catch (const graph::PartialUpdateError& e) {
    EXPECT_FALSE(e.tensors().empty());
    EXPECT_NE(std::string(e.what()).find("fetch."), std::string::npos) << e.what();
  }
  EXPECT_THROW(trainer.step(images, labels), std::runtime_error);
  trainer.load_checkpoint(saved);
  expect_parameters(trainer, restored);
  EXPECT_TRUE(std::isfinite(trainer.step(images, labels).loss));
  std::filesystem::remove(saved);
}

TEST(Residency, FailedHostAllocationIsAClearError) {
  auto& ctx = TestDevice::get().context;
  try {
    offload::allocate_pinned_host(ctx, ctx.device().max_alloc_bytes + 1, "the weights of a huge model");
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("pinned host memory"), std::string::npos) << what;
    EXPECT_NE(what.find("the weights of a huge model"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace ferry::test

namespace ferry::test {
namespace {

TrainerOptions host_optimizer_options(std::uint64_t budget, ops::OptimizerConfig::Kind kind) {
  TrainerOptions o = options(graph::ResidencyMode::stream, budget);
  o.residency.host_optimizer = true;
  o.optimizer.kind = kind;
  o.optimizer.sgd.momentum = 0.9f;
  o.optimizer.adam.weight_decay = 0.01f;
  return o;
}

class HostOptimizerTest : public ::testing::TestWithParam<ops::OptimizerConfig::Kind> {};

TEST_P(HostOptimizerTest, MatchesDeviceUpdatesAndMovesOnlyWeightsAndGradients) {
  Runtime rt;
  const ModelSpec m = small_residual();
  const std::uint64_t budget = min_stream_budget(rt, m) * 2;
  TrainerOptions device_opt = options(graph::ResidencyMode::resident, 0);
  device_opt.optimizer = host_optimizer_options(budget, GetParam()).optimizer;
  const RunResult reference = train(rt, m, device_opt, 4);
  const TrainerOptions host_opt = host_optimizer_options(budget, GetParam());
  const RunResult host = train(rt, m, host_opt, 4);
  // The same arithmetic in another rounding order: equal to float precision, not bit for bit.
  for (std::size_t s = 0; s < host.losses.size(); ++s) EXPECT_NEAR(host.losses[s], reference.losses[s], 1e-5f);
  for (const auto& [name, values] : reference.params)
    expect_near(host.params.at(name), values, 1e-5f, 1e-4f, name.c_str());
  // In pageable host memory (NVIDIA's default) the host updates are the same, bit for bit.
  TrainerOptions pageable_opt = host_opt;
  pageable_opt.residency.homes.host_memory = offload::HostMemory::pageable;
  const RunResult pageable = train(rt, m, pageable_opt, 4);
  EXPECT_EQ(pageable.losses, host.losses);
  for (const auto& [name, values] : host.params) EXPECT_EQ(pageable.params.at(name), values) << name;
  // Staged (the weights fetched and the gradients written back through pinned staging): the same.
  TrainerOptions staged_opt = host_opt;
  staged_opt.residency.homes.host_memory = offload::HostMemory::staged;
  staged_opt.residency.staging_min_bytes = 0;
  const RunResult staged = train(rt, m, staged_opt, 4);
  EXPECT_EQ(staged.losses, host.losses);
  for (const auto& [name, values] : host.params) EXPECT_EQ(staged.params.at(name), values) << name;

  Trainer t(rt, m, host_opt);
  const auto& r = t.residency();
  const auto weights = t.parameter_names().size();
  EXPECT_EQ(r.host_updates, weights);
  // Only gradients come back (one write-back per weight); weights are fetched, optimizer state never.
  EXPECT_EQ(r.write_backs, weights);
  EXPECT_EQ(r.write_back_bytes, t.weight_bytes());
  for (graph::NodeId n = 0; n < compiled_train_step(t).graph().nodes.size(); ++n) {
    const auto& nodes = compiled_train_step(t).graph().nodes;
    if (nodes.op[n] != graph::builtin::fetch) continue;
    const auto role = compiled_train_step(t).graph().tensors.role[nodes.inputs(n)[0]];
    EXPECT_EQ(role, graph::Role::weight) << nodes.name[n];
  }
  Trainer device_updates(rt, m, options(graph::ResidencyMode::stream, budget));
  EXPECT_LT(r.fetch_bytes + r.write_back_bytes,
            (device_updates.residency().fetch_bytes + device_updates.residency().write_back_bytes) / 2);
}

// With accumulation the host optimizer's gradient sums are summed on the host lane: a micro-batch
// step writes each gradient back once and fetches only weights (on the device its sums were fetched
// and written back beside the gradients), and the sums are the device's bit for bit (the same f32
// additions: two micro-batches of a group of three, before any update, against the device
// optimizer's), the weights after the update equal to float precision.
TEST(HostOptimizer, AccumulatesOnTheHostAsTheDeviceDid) {
  Runtime rt;
  const ModelSpec m = small_residual();
  TrainerOptions device_opt = options(graph::ResidencyMode::stream, min_stream_budget(rt, m) * 2);
  device_opt.accumulate = 3;
  TrainerOptions host_opt = device_opt;
  host_opt.residency.host_optimizer = true;
  Trainer host(rt, m, host_opt), device(rt, m, device_opt);
  const std::size_t sample = sample_elems(m);
  auto step = [&](Trainer& t, int s) { return t.step(random_vector(8 * sample, 50 + s), labels_for(8, 70 + s)); };
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(step(host, s).loss, step(device, s).loss) << "micro-batch " << s;
    for (const auto& name : host.parameter_names()) {
      EXPECT_EQ(host.read_tensor(name + ".grad_sum").bytes, device.read_tensor(name + ".grad_sum").bytes)
          << name << ", micro-batch " << s;
    }
  }
  // A micro-batch whose loss is not finite adds nothing to the sums (the host nodes after the commit
  // point skip, as the kernel skipped its sum).
  const auto sums_before = host.read_tensor(host.parameter_names().front() + ".grad_sum").bytes;
  const std::vector<float> bad(8 * sample, 3e38f);                      // finite inputs whose products overflow
  EXPECT_THROW(host.step(bad, labels_for(8, 80)), std::runtime_error);  // "training diverged at optimizer update ..."
  EXPECT_EQ(host.read_tensor(host.parameter_names().front() + ".grad_sum").bytes, sums_before);
  EXPECT_NEAR(step(host, 2).loss, step(device, 2).loss, 1e-6f);
  for (const auto& name : host.parameter_names()) {
    expect_near(host.read_parameter(name), device.read_parameter(name), 1e-5f, 1e-4f, name.c_str());
  }

  const std::size_t weights = host.parameter_names().size();
  std::size_t micro_steps = 0;
  for (const auto& [key, step_of] : compiled_variants(host)) {
    const graph::Graph& g = step_of->graph();
    std::size_t on_host = 0;
    for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
      if (g.nodes.op[n] == graph::builtin::grad_accumulate) {
        EXPECT_EQ(g.nodes.lane[n], graph::Lane::host) << g.nodes.name[n];
        ++on_host;
      }
      if (g.nodes.op[n] == graph::builtin::fetch) {
        EXPECT_EQ(g.tensors.role[g.nodes.inputs(n)[0]], graph::Role::weight) << g.nodes.name[n];
      }
    }
    if (on_host == 0) continue;
    ++micro_steps;
    EXPECT_EQ(on_host, weights);
    EXPECT_EQ(step_of->residency().write_backs, weights) << "each gradient once, no sum";
    EXPECT_EQ(step_of->residency().write_back_bytes, host.weight_bytes());
  }
  EXPECT_EQ(micro_steps, 1u);
  const graph::Graph& train = compiled_train_step(host).graph();
  std::size_t means = 0;
  for (graph::NodeId n = 0; n < train.nodes.size(); ++n) {
    if (train.nodes.op[n] != graph::builtin::grad_mean) continue;
    EXPECT_EQ(train.nodes.lane[n], graph::Lane::host) << train.nodes.name[n];
    ++means;
  }
  EXPECT_EQ(means, weights);
  EXPECT_EQ(host.residency().write_back_bytes, host.weight_bytes());
  EXPECT_EQ(host.residency().fetch_bytes, host.weight_bytes()) << "weights only: no sum fetched";
}

INSTANTIATE_TEST_SUITE_P(Optimizers, HostOptimizerTest,
                         ::testing::Values(ops::OptimizerConfig::Kind::adam, ops::OptimizerConfig::Kind::adamw,
                                           ops::OptimizerConfig::Kind::sgd),
                         [](const auto& info) { return std::string(ops::optimizer_name(info.param)); });

// A traced step's host-lane nodes say how long each waited, and how long the host took to begin
// after the driver reported the device commands it waited for done (the two figures
// bench/trace_summary.py reads to tell a slow report or a busy host from the lane's order).
// The timeline of one step of the small residual model with Adam on the host, traced.
std::vector<graph::TimelineEntry> traced_host_optimizer_step() {
  Runtime rt({.profiling = true});
  const ModelSpec m = small_residual();
  Trainer trainer(rt, m, host_optimizer_options(min_stream_budget(rt, m) * 2, ops::OptimizerConfig::Kind::adam));
  const std::size_t sample = sample_elems(m);
  trainer.step(random_vector(8 * sample, 31), labels_for(8, 32));
  return compiled_train_step(trainer).timeline();
}

TEST(HostOptimizer, TimelineGivesEachHostNodesWait) {
  int host = 0;
  for (const auto& e : traced_host_optimizer_step()) {
    if (!graph::is_host_lane(e.lane)) {
      EXPECT_EQ(e.ready_ns, 0u) << e.name;
      EXPECT_EQ(e.events_done_ns, 0u) << e.name;
      continue;
    }
    ++host;
    EXPECT_NE(e.ready_ns, 0u) << e.name;
    EXPECT_NE(e.events_done_ns, 0u) << e.name;
    EXPECT_LE(e.ready_ns, e.events_done_ns) << e.name << ": its commands were reported done before it waited";
    EXPECT_LE(e.events_done_ns, e.start_ns) << e.name << ": it began before its commands were reported done";
  }
  EXPECT_GT(host, 2) << "the host optimizer's updates run on the host lane";
}

// Each entry of a traced step names the node it waited for that ended last (`after`, which
// bench/trace_summary.py follows back through a lane's idle stretch): a node listed before it, on
// its own lane or another, that ended before it started where both run on the device's clock.
TEST(HostOptimizer, TimelineNamesWhatEachNodeWaitedFor) {
  const auto timeline = traced_host_optimizer_step();
  ASSERT_FALSE(timeline.empty());
  std::map<std::string, std::size_t> index;
  std::set<graph::Lane> lanes_seen;
  int cross_lane = 0;
  for (std::size_t i = 0; i < timeline.size(); ++i) {
    const auto& e = timeline[i];
    const bool first_on_lane = lanes_seen.insert(e.lane).second;
    if (e.after.empty()) {
      EXPECT_TRUE(first_on_lane) << e.name << " names nothing, though a node ran before it on its lane";
    } else {
      const auto it = index.find(e.after);
      ASSERT_NE(it, index.end()) << e.name << " names " << e.after << ", not listed before it";
      const auto& before = timeline[it->second];
      if (before.lane != e.lane) ++cross_lane;
      if (!graph::is_host_lane(before.lane) && !graph::is_host_lane(e.lane)) {
        EXPECT_LE(before.end_ns, e.start_ns) << e.name << " started before " << e.after << " ended";
      }
    }
    index.emplace(e.name, i);
  }
  EXPECT_GT(cross_lane, 0) << "fetches, updates and write-backs wait for other lanes' nodes";
}

// The host optimizer updates the one host copy in place after the commit point: a failing host
// update is a partial update naming exactly the tensors that may have changed (the host updates
// that ran before it, on other workers), or, if none had, a plain error with the state as it was.
// Either way the trainer goes on from a checkpoint.
TEST(HostOptimizer, FailingHostUpdateIsAPartialUpdateNamingWhatChanged) {
  Runtime rt;
  const ModelSpec m = small_residual();
  Trainer trainer(rt, m, host_optimizer_options(min_stream_budget(rt, m) * 2, ops::OptimizerConfig::Kind::adam));
  const auto& nodes = compiled_train_step(trainer).graph().nodes;
  std::vector<graph::NodeId> host_nodes;
  for (graph::NodeId n = 0; n < nodes.size(); ++n) {
    if (nodes.lane[n] == graph::Lane::host) host_nodes.push_back(n);
  }
  ASSERT_GT(host_nodes.size(), 2u);
  ASSERT_TRUE(compiled_train_step(trainer).commit_node().has_value());
  EXPECT_GT(host_nodes.front(), *compiled_train_step(trainer).commit_node())
      << "host updates wait for the commit point";
  const std::size_t sample = sample_elems(m);
  auto images = random_vector(8 * sample, 25);
  auto labels = labels_for(8, 26);
  trainer.step(images, labels);
  const auto saved = testing::TempDir() + "/host_optimizer_restore.ferry";
  trainer.save_checkpoint(saved);
  auto before = parameters_of(trainer);
  const graph::NodeId victim = host_nodes[host_nodes.size() / 2];
  compiled_train_step(trainer).inject_failure(victim);
  std::vector<std::string> changed;
  bool partial = false;
  try {
    trainer.step(images, labels);
    FAIL() << "the step should fail";
  } catch (const graph::PartialUpdateError& e) {
    partial = true;
    changed = e.tensors();
    EXPECT_NE(std::string(e.what()).find(nodes.name[victim]), std::string::npos) << e.what();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(nodes.name[victim]), std::string::npos) << e.what();
    // Injected where the host work runs, after the event gate: what a failing host update does.
    EXPECT_NE(std::string(e.what()).find("(host "), std::string::npos) << e.what();
  }
  for (const auto& [name, values] : before) {
    if (std::find(changed.begin(), changed.end(), name) == changed.end()) {
      EXPECT_EQ(trainer.read_parameter(name), values) << name << " changed but was not named";
    }
  }
  if (partial) {
    EXPECT_THROW(trainer.step(images, labels), std::runtime_error);
    trainer.load_checkpoint(saved);
    expect_parameters(trainer, before);
  }
  EXPECT_TRUE(std::isfinite(trainer.step(images, labels).loss));
  std::filesystem::remove(saved);
  EXPECT_THROW(Trainer(rt, m,
                       [] {
                         TrainerOptions o = options(graph::ResidencyMode::resident, 0);
                         o.residency.host_optimizer = true;
                         return o;
                       }()),
               std::invalid_argument);
}

}  // namespace
}  // namespace ferry::test

namespace ferry::test {
namespace {

struct DivergeCase {
  const char* name;
  graph::ResidencyMode mode;
  bool host_optimizer;
};

class DivergedStepTest : public ::testing::TestWithParam<DivergeCase> {};

TEST_P(DivergedStepTest, SkipsTheUpdateAndKeepsTheState) {
  Runtime rt;
  const DivergeCase c = GetParam();
  if (c.mode == graph::ResidencyMode::mapped && !rt.device().host_unified_memory) GTEST_SKIP();
  const ModelSpec m = small_mlp();
  TrainerOptions o = options(c.mode, c.mode == graph::ResidencyMode::stream ? min_stream_budget(rt, m) * 2 : 0);
  o.residency.host_optimizer = c.host_optimizer;
  o.optimizer.kind = ops::OptimizerConfig::Kind::sgd;
  o.optimizer.sgd.momentum = 0;
  o.lr = 1e30f;  // the first step blows the weights up; the next loss is not finite
  Trainer trainer(rt, m, o);
  const std::size_t sample = sample_elems(m);
  auto images = random_vector(8 * sample, 35);
  auto labels = labels_for(8, 36);
  trainer.step(images, labels);
  auto before = parameters_of(trainer);
  const auto steps = trainer.steps_done();
  bool diverged = false;
  for (int s = 0; s < 3 && !diverged; ++s) {
    try {
      trainer.step(images, labels);
      before = parameters_of(trainer);
    } catch (const std::runtime_error& e) {
      diverged = true;
      EXPECT_NE(std::string(e.what()).find("update was skipped"), std::string::npos) << e.what();
    }
  }
  ASSERT_TRUE(diverged) << "a learning rate of 1e30 should make the loss non-finite";
  expect_parameters(trainer, before);
  EXPECT_LE(trainer.steps_done(), steps + 2);
}

INSTANTIATE_TEST_SUITE_P(Modes, DivergedStepTest,
                         ::testing::Values(DivergeCase{"resident", graph::ResidencyMode::resident, false},
                                           DivergeCase{"mapped", graph::ResidencyMode::mapped, false},
                                           DivergeCase{"stream", graph::ResidencyMode::stream, false},
                                           DivergeCase{"stream_host_optimizer", graph::ResidencyMode::stream, true}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace ferry::test

namespace ferry::test {
namespace {

TEST(Optimizer, SgdWithoutMomentumKeepsNoStateAndMatchesTheReference) {
  Runtime rt;
  const ModelSpec m = small_residual();
  TrainerOptions o = options(graph::ResidencyMode::resident, 0);
  o.optimizer.kind = ops::OptimizerConfig::Kind::sgd;
  o.optimizer.sgd.momentum = 0;
  Trainer plain(rt, m, o);
  EXPECT_EQ(plain.optimizer_state_bytes(), 0u);
  const RunResult resident = train(rt, m, o, 3);
  TrainerOptions streamed = o;
  streamed.residency.mode = graph::ResidencyMode::stream;
  streamed.residency.budget_bytes = min_stream_budget(rt, m) * 2;
  EXPECT_EQ(train(rt, m, streamed, 3).params, resident.params);
  streamed.residency.host_optimizer = true;
  const RunResult host = train(rt, m, streamed, 3);
  for (const auto& [name, values] : resident.params)
    expect_near(host.params.at(name), values, 1e-6f, 1e-5f, name.c_str());
}

// Optimizer state streamed from pinned host memory while the weights stay on the device: the
// device holds no state, the host holds one copy of it, only the state crosses the link.
TEST(ResidencyHomes, StreamingOnlyTheOptimizerStateMovesOnlyTheState) {
  Runtime rt;
  const ModelSpec m = small_mlp();
  TrainerOptions all = options(graph::ResidencyMode::resident, 0);
  TrainerOptions state = all;
  state.residency.state_home = graph::Home::host_pinned;
  // Copies held apart from the compute around them (the default slack of 4 nodes) would keep all of
  // this small MLP's state on the device during its updates: its six updates are the step's tail.
  state.residency.transfer_slack = 0;
  Trainer resident(rt, m, all), streamed(rt, m, state);
  EXPECT_EQ(compiled_train_step(resident).persistent()->host_bytes(), 0u);
  const std::uint64_t homes = compiled_train_step(streamed).persistent()->host_bytes();
  EXPECT_GE(homes, streamed.optimizer_state_bytes());
  EXPECT_LE(homes, streamed.optimizer_state_bytes() + 256 * 16);
  EXPECT_LT(streamed.device_peak_bytes(), resident.device_peak_bytes());
  // Each state tensor is fetched once and written back once per step; no weight crosses.
  EXPECT_EQ(streamed.residency().fetch_bytes, streamed.optimizer_state_bytes());
  EXPECT_EQ(streamed.residency().write_back_bytes, streamed.optimizer_state_bytes());
}

TEST(ResidencyHomes, HomesWithoutAStoreOrThatConflictAreClearErrors) {
  Runtime rt;
  const ModelSpec m = small_mlp();
  for (auto home : {graph::Home::host_int8}) {
    TrainerOptions o = options(graph::ResidencyMode::resident, 0);
    o.residency.state_home = home;
    try {
      Trainer t(rt, m, o);
      FAIL() << offload::home_name(home);
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(offload::home_name(home)), std::string::npos) << e.what();
    }
  }
  // An explicit mode or setting the homes leave nothing to do: refused, not ignored.
  TrainerOptions still = options(graph::ResidencyMode::stream, 0);
  still.residency.weights_home = still.residency.state_home = graph::Home::device;
  EXPECT_THROW(Trainer(rt, m, still), std::invalid_argument) << "stream mode that streams nothing";
  still.residency.state_home = graph::Home::host_pinned;
  EXPECT_NO_THROW(Trainer(rt, m, still)) << "stream mode with the state streamed";
  TrainerOptions unused_chunk = options(graph::ResidencyMode::resident, 0);
  unused_chunk.residency.homes.host_memory = offload::HostMemory::staged;
  unused_chunk.residency.staging_chunk_bytes = 64 << 10;
  EXPECT_THROW(Trainer(rt, m, unused_chunk), std::invalid_argument) << "a staging chunk nothing fetches through";
  unused_chunk.residency.state_home = graph::Home::host_pinned;
  EXPECT_NO_THROW(Trainer(rt, m, unused_chunk)) << "a staging chunk for the state's fetches";
  TrainerOptions host_opt = options(graph::ResidencyMode::stream, 0);
  host_opt.residency.host_optimizer = true;
  host_opt.residency.weights_home = graph::Home::device;
  EXPECT_THROW(Trainer(rt, m, host_opt), std::invalid_argument);
  if (!rt.device().host_unified_memory) {
    TrainerOptions mapped = options(graph::ResidencyMode::resident, 0);
    mapped.residency.weights_home = graph::Home::host_mapped;
    EXPECT_THROW(Trainer(rt, m, mapped), std::invalid_argument);
  }
}

}  // namespace
}  // namespace ferry::test

namespace ferry::test {
namespace {

// Every persistent tensor is listed, read and written by name, in every home, and bad writes
// change nothing.
TEST(ResidencyHomes, PersistentTensorsAreReadAndWrittenByNameInEveryHome) {
  Runtime rt;
  std::vector<TrainerOptions> configs = {options(graph::ResidencyMode::resident, 0),
                                         options(graph::ResidencyMode::stream, 0)};
  if (rt.device().host_unified_memory) configs.push_back(options(graph::ResidencyMode::mapped, 0));
  for (const auto& o : configs) {
    Trainer t(rt, small_mlp(), o);
    const auto names = t.tensor_names();
    ASSERT_EQ(names.size(), 3 * t.parameter_names().size()) << "Adam keeps two moments per weight";
    for (const auto& name : names) {
      Trainer::HostTensor v = t.read_tensor(name);
      auto* f = reinterpret_cast<float*>(v.bytes.data());
      for (std::size_t i = 0; i < v.shape.elems(); ++i) f[i] = 0.5f + static_cast<float>(i % 7);
      t.write_tensor(name, v);
      EXPECT_EQ(t.read_tensor(name).bytes, v.bytes) << name;
    }
    Trainer::HostTensor w = t.read_tensor(names[0]);
    const auto before = w.bytes;
    reinterpret_cast<float*>(w.bytes.data())[3] = std::nanf("");
    EXPECT_THROW(t.write_tensor(names[0], w), std::invalid_argument);
    w.shape = graph::Shape{1};
    EXPECT_THROW(t.write_tensor(names[0], w), std::invalid_argument);
    EXPECT_THROW(t.write_tensor("no.such.tensor", w), std::invalid_argument);
    Trainer::HostTensor half = t.read_tensor(names[0]);  // its dtype and shape, half its bytes
    half.bytes.resize(half.bytes.size() / 2);
    try {
      t.write_tensor(names[0], half);
      ADD_FAILURE() << "a value of half the tensor's bytes was written";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("but holds"), std::string::npos) << e.what();
    }
    EXPECT_EQ(t.read_tensor(names[0]).bytes, before) << "a refused write changes nothing";
  }
}

}  // namespace
}  // namespace ferry::test
