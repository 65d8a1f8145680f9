// Homes for optimizer state not in use: compressed in place (zstd chunks in host memory) and
// dropped (re-initialised before every update). Compressed training is bit-identical to
// uncompressed, through staging copies or zero-copy; host memory holds the compressed chunks; a
// failed step keeps the previous chunks; a corrupt chunk is an error naming the tensor and chunk.
#include <fmt/format.h>

#include <cstring>
#include <filesystem>

#include "classifier.hpp"
#include "ferry/ferry.hpp"
#include "runtime/trainer_internals.hpp"
#include "test_models.hpp"
#include "test_support.hpp"
#include "train_check.hpp"

namespace ferry::test {
namespace {

using Tensors = std::map<std::string, std::vector<std::byte>>;

TrainerOptions options(graph::ResidencyMode mode = graph::ResidencyMode::resident, std::uint64_t budget = 0) {
  TrainerOptions o;
  o.batch = 8;
  o.lr = 0.01f;
  o.residency.mode = mode;
  o.residency.budget_bytes = budget;
  return o;
}

// Every persistent tensor (weights and optimizer state) as stored.
Tensors tensors_of(const Trainer& t) {
  Tensors out;
  for (const auto& name : t.tensor_names()) out[name] = t.read_tensor(name).bytes;
  return out;
}

void step(Trainer& t, int s) {
  const auto images = random_vector(t.options().batch * sample_elems(t.model()), 50 + s);
  const auto labels = labels_for(t.options().batch, 70 + s);
  t.step(images, labels);
}

struct TrainRun {
  std::vector<float> losses;
  Tensors state;
};

TrainRun train(Runtime& rt, const ModelSpec& m, const TrainerOptions& o, int steps) {
  Trainer trainer(rt, m, o);
  TrainRun r;
  for (int s = 0; s < steps; ++s) {
    const auto images = random_vector(o.batch * sample_elems(m), 50 + s);
    const auto labels = labels_for(o.batch, 70 + s);
    r.losses.push_back(trainer.step(images, labels).loss);
  }
  r.state = tensors_of(trainer);
  return r;
}

TrainerOptions compressed(TrainerOptions o, bool weights_too, std::size_t chunk, unsigned workers, bool zero_copy) {
  o.residency.state_home = graph::Home::host_compressed;
  if (weights_too) o.residency.weights_home = graph::Home::host_compressed;
  o.residency.homes.codec.chunk_bytes = chunk;
  o.residency.homes.codec.workers = workers;
  o.residency.zero_copy_staging = zero_copy;
  return o;
}

class CompressedStateTest : public ::testing::TestWithParam<ModelSpec (*)()> {};

// Weights and every optimizer-state byte equal the uncompressed run's after several steps, with
// chunk sizes that do not divide the tensors, through staging copies and (on unified-memory
// devices) zero-copy, with the weights resident or streamed at the smallest budget.
TEST_P(CompressedStateTest, TrainingIsBitIdenticalToUncompressed) {
  Runtime rt;
  const ModelSpec m = GetParam()();
  const int steps = 3;
  const TrainRun plain = train(rt, m, options(), steps);
  const std::uint64_t min_budget = stream_budget(rt, m, compressed(options(), true, 4096, 0, false));
  ASSERT_GT(min_budget, 0u);
  struct Case {
    std::string what;
    TrainerOptions opt;
  };
  std::vector<Case> cases;
  for (bool zero_copy : {false, true}) {
    if (zero_copy && !rt.device().host_unified_memory) continue;
    const std::string how = zero_copy ? "zero-copy" : "staged copies";
    cases.push_back({"state compressed, weights resident, 1000-byte chunks, " + how,
                     compressed(options(), false, 1000, 0, zero_copy)});
    cases.push_back({"state and weights compressed, minimum budget, one worker, " + how,
                     compressed(options(graph::ResidencyMode::stream, min_budget), true, 4096, 1, zero_copy)});
  }
  TrainerOptions streamed = options(graph::ResidencyMode::stream, min_budget);
  streamed.residency.state_home = graph::Home::host_compressed;
  cases.push_back({"weights streamed uncompressed, state compressed", streamed});
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    const TrainRun r = train(rt, m, c.opt, steps);
    EXPECT_EQ(r.losses, plain.losses);
    ASSERT_EQ(r.state.size(), plain.state.size());
    for (const auto& [name, bytes] : plain.state) EXPECT_EQ(r.state.at(name), bytes) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, CompressedStateTest, ::testing::Values(&small_mlp, &small_residual),
                         [](const auto& info) {
                           return info.index == 0 ? std::string("mlp") : std::string("residual");
                         });

// Host memory holds the compressed chunks, not a plain copy: far less than the state's size while
// it is all zeros, and each state tensor is unpacked and packed once per step.
TEST(CompressedState, HostMemoryHoldsTheChunksAndEachTensorIsPackedOncePerStep) {
  Runtime rt;
  // Staging one transfer at a time: on a device with memory of its own the default keeps a ring of
  // transfer_slack + 1 in flight (MemoryPlan.StagedCopiesKeepTheirStagingApartFromTheNextOnes),
  // which at this model's few tensors is most of the state.
  TrainerOptions opt = compressed(options(), false, 1 << 16, 0, false);
  opt.residency.transfer_slack = 0;
  Trainer t(rt, small_mlp(), opt);
  const std::uint64_t state = t.optimizer_state_bytes();
  EXPECT_LT(compiled_train_step(t).persistent()->host_bytes(), state / 10)
      << "zeros compress to a frame header per chunk";
  std::uint32_t state_tensors = 0;
  for (const auto& name : t.tensor_names()) state_tensors += name.find(".adam_") != std::string::npos;
  EXPECT_EQ(t.residency().unpacks, state_tensors);
  EXPECT_EQ(t.residency().packs, state_tensors);
  EXPECT_GT(compiled_train_step(t).host_step_bytes(), 0u) << "staging for the chunks in flight";
  // Each staged tensor starts on the device's sub-buffer alignment (at least 256 bytes; 512 on
  // NVIDIA), which at this model's size is most of a tensor: one copy of the state is its tensors
  // rounded up to it.
  const std::uint64_t align = std::max<std::uint64_t>(256, rt.device().base_align_bytes);
  std::uint64_t one_copy = 0;
  for (const auto& name : t.tensor_names()) {
    if (name.find(".adam_") != std::string::npos)
      one_copy += (t.read_tensor(name).bytes.size() + align - 1) / align * align;
  }
  EXPECT_LE(compiled_train_step(t).host_step_bytes(), one_copy) << "staging never needs a second full copy";
  for (int s = 0; s < 3; ++s) step(t, s);
  EXPECT_GT(compiled_train_step(t).persistent()->host_bytes(), 0u);
  EXPECT_LT(compiled_train_step(t).persistent()->host_bytes(), state + state / 10) << "chunks of trained moments";
  EXPECT_EQ(t.state_home(), graph::Home::host_compressed);
}

// Compressed state is packed in place after the step's commit point (one set of chunks): a step
// that fails before it leaves every tensor as it was; one that fails while packing is a partial
// update naming the tensors, and the trainer refuses to go on until a checkpoint restores it,
// after which training goes on exactly as if the failed step had never been tried.
TEST(CompressedState, FailedPackIsAPartialUpdateThatACheckpointRestores) {
  Runtime rt;
  const ModelSpec m = small_residual();
  Trainer t(rt, m, compressed(options(), true, 2048, 0, false));
  Trainer reference(rt, m, options());
  step(t, 0);
  step(reference, 0);
  const auto& step_graph = compiled_train_step(t);
  const auto& nodes = step_graph.graph().nodes;
  graph::NodeId first_unpack = 0, last_pack = 0;
  std::uint32_t packs = 0;
  for (graph::NodeId n = nodes.size(); n-- > 0;) {
    if (nodes.op[n] == graph::builtin::unpack) first_unpack = n;
  }
  for (graph::NodeId n = 0; n < nodes.size(); ++n) {
    if (nodes.op[n] != graph::builtin::pack) continue;
    last_pack = n;
    ++packs;
  }
  ASSERT_GT(packs, 3u);
  const auto commit = step_graph.commit_node();
  ASSERT_TRUE(commit.has_value()) << "packing in place needs a commit point";
  EXPECT_LT(first_unpack, *commit);
  EXPECT_GT(last_pack, *commit) << "every pack after the commit point";

  const Tensors before = tensors_of(t);
  compiled_train_step(t).inject_failure(first_unpack);
  EXPECT_THROW(step(t, 1), std::runtime_error);
  EXPECT_EQ(tensors_of(t), before) << "a failure before the commit point changes nothing";
  EXPECT_EQ(t.inconsistent_state(), "");

  const std::string saved = testing::TempDir() + "/compressed_partial.ferry";
  t.save_checkpoint(saved);
  compiled_train_step(t).inject_failure(last_pack);
  try {
    step(t, 1);
    FAIL() << "the step should fail";
  } catch (const graph::PartialUpdateError& e) {
    EXPECT_FALSE(e.tensors().empty());
  }
  EXPECT_NE(t.inconsistent_state(), "");
  EXPECT_THROW(step(t, 1), std::runtime_error) << "refuses to go on from a partial update";
  t.load_checkpoint(saved);
  std::filesystem::remove(saved);
  EXPECT_EQ(tensors_of(t), before);
  for (int s = 1; s < 3; ++s) {
    step(t, s);
    step(reference, s);
  }
  EXPECT_EQ(tensors_of(t), tensors_of(reference));
}

// A corrupt chunk is an error naming the tensor and the chunk, never wrong state; with the
// weights in a home that commits (streamed), they stay as they were and every other tensor can
// still be read (saved). (Device-home weights are updated in place: a step failing after some
// updates leaves those updated, as for any failure in the middle of a step.)
TEST(CompressedState, CorruptChunkIsAnErrorNamingTensorAndChunk) {
  Runtime rt;
  TrainerOptions o = compressed(options(graph::ResidencyMode::stream), false, 256, 0, false);
  Trainer t(rt, small_mlp(), o);
  step(t, 0);
  const auto weights_before = tensors_of(t);
  std::string victim;  // the largest second moment
  for (const auto& name : t.tensor_names()) {
    if (name.ends_with(".adam_v") &&
        (victim.empty() || t.read_tensor(name).bytes.size() > t.read_tensor(victim).bytes.size())) {
      victim = name;
    }
  }
  ASSERT_FALSE(victim.empty());
  const auto entry = compiled_train_step(t).persistent()->find(victim);
  ASSERT_TRUE(entry.has_value());
  ASSERT_EQ(entry->home, graph::Home::host_compressed);
  offload::HomeStore& store = compiled_train_step(t).persistent()->store(entry->home);
  offload::CompressedTensor* chunks = store.chunks({entry->place.buffer, entry->place.offset_bytes});
  ASSERT_NE(chunks, nullptr);
  ASSERT_GT(chunks->chunk_count(), 1u);
  auto bytes = chunks->chunk_data(1);
  bytes[bytes.size() / 2] ^= std::byte{0x5a};
  try {
    step(t, 1);
    FAIL() << "a corrupt chunk must fail the step";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(victim), std::string::npos) << what;
    EXPECT_NE(what.find("chunk 1"), std::string::npos) << what;
  }
  EXPECT_THROW(t.read_tensor(victim), std::runtime_error);
  for (const auto& [name, bytes_before] : weights_before) {
    if (name == victim) continue;
    EXPECT_EQ(t.read_tensor(name).bytes, bytes_before) << name;
  }
}

// Dropped state is not kept: each update starts from zero moments, exactly as a resident run
// whose state is zeroed before every step, and the host holds nothing.
TEST(DroppedState, EveryUpdateStartsFromZeroStateAndNothingIsKept) {
  Runtime rt;
  const ModelSpec m = small_mlp();
  for (bool zero_copy : {false, true}) {
    if (zero_copy && !rt.device().host_unified_memory) continue;
    SCOPED_TRACE(zero_copy ? "zero-copy" : "staged copies");
    TrainerOptions o = options();
    o.residency.state_home = graph::Home::dropped;
    o.residency.zero_copy_staging = zero_copy;
    Trainer dropped(rt, m, o);
    Trainer reference(rt, m, options());
    EXPECT_EQ(compiled_train_step(dropped).persistent()->host_bytes(), 0u);
    EXPECT_EQ(dropped.residency().packs, 0u) << "nothing is written back";
    for (int s = 0; s < 3; ++s) {
      for (const auto& name : reference.tensor_names()) {
        if (name.find(".adam_") == std::string::npos) continue;
        Trainer::HostTensor zero = reference.read_tensor(name);
        std::fill(zero.bytes.begin(), zero.bytes.end(), std::byte{0});
        reference.write_tensor(name, zero);
      }
      step(dropped, s);
      step(reference, s);
    }
    for (const auto& name : reference.parameter_names()) {
      EXPECT_EQ(dropped.read_parameter(name), reference.read_parameter(name)) << name;
    }
    for (const auto& name : dropped.tensor_names()) {
      if (name.find(".adam_") == std::string::npos) continue;
      for (std::byte b : dropped.read_tensor(name).bytes) ASSERT_EQ(b, std::byte{0}) << name;
    }
  }
}

TEST(StateHomes, BadHomesAndCodecSettingsAreClearErrors) {
  Runtime rt;
  const ModelSpec m = small_mlp();
  TrainerOptions weights_dropped = options();
  weights_dropped.residency.weights_home = graph::Home::dropped;
  try {
    Trainer t(rt, m, weights_dropped);
    FAIL() << "weights cannot be dropped";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("only optimizer state"), std::string::npos) << e.what();
  }
  TrainerOptions bad_level = compressed(options(), false, 4096, 0, false);
  bad_level.residency.homes.codec.level = 1000;
  EXPECT_THROW(Trainer(rt, m, bad_level), std::invalid_argument);
  TrainerOptions bad_chunk = compressed(options(), false, 0, 0, false);
  EXPECT_THROW(Trainer(rt, m, bad_chunk), std::invalid_argument);
  TrainerOptions host_opt = compressed(options(graph::ResidencyMode::stream), false, 4096, 0, false);
  host_opt.residency.host_optimizer = true;
  EXPECT_THROW(Trainer(rt, m, host_opt), std::invalid_argument);
}

}  // namespace
}  // namespace ferry::test
