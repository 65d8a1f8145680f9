// Staged host memory with chunked fetches, what `--host-memory auto` takes on NVIDIA under a device
// budget of 2 GiB or more (ferry::resolve_host_transfers), under each training feature: the same
// losses, phases and final tensors, bit for bit, as pinned host memory with the same options. The
// transfers are copies either way; what differs is the path (pageable homes, pinned staging filled
// on the host, a ring of chunks for fetches, pack nodes for write-backs) and so the hand-offs
// between host and device each feature adds to a step.
#include <fmt/format.h>

#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "classifier.hpp"
#include "ferry/ferry.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

// Layers of a few tens of KiB, so that 4 KiB chunks split every weight and moment into several.
ModelSpec wide_residual() {
  return models::classifier("wide-residual", graph::Shape{48}, 10, [](graph::Builder& b, graph::TensorId x) {
    x = b.linear(x, 96);
    for (int i = 0; i < 2; ++i) x = b.add(x, b.linear(b.gelu(b.linear(b.layernorm(x), 128)), 96));
    return b.linear(b.layernorm(x), 10);
  });
}

constexpr std::uint64_t chunk_bytes = 4 << 10;

TrainerOptions streamed() {
  TrainerOptions o;
  o.batch = 8;
  o.lr = 0.01f;
  o.residency.mode = graph::ResidencyMode::stream;
  o.residency.budget_bytes = 1ull << 30;  // streamed by request, whatever fits
  return o;
}

TrainerOptions staged(TrainerOptions o) {
  o.residency.homes.host_memory = offload::HostMemory::staged;
  o.residency.staging_chunk_bytes = chunk_bytes;
  o.residency.staging_min_bytes = 0;  // every transfer, the biases' too
  return o;
}

TrainerOptions pinned(TrainerOptions o) {
  o.residency.homes.host_memory = offload::HostMemory::pinned;
  return o;
}

struct Trained {
  std::vector<float> losses;
  std::vector<Phase> phases;
  std::vector<bool> overflows;
  std::map<std::string, std::vector<std::byte>> tensors;  // every persistent tensor's bytes (state and predictor's too)
};

StepResult step(Trainer& t, const ModelSpec& m, int s) {
  return t.step(random_vector(8 * sample_elems(m), 500 + s), labels_for(8, 600 + s));
}

void record(Trained& r, const StepResult& s) {
  r.losses.push_back(s.loss);
  r.phases.push_back(s.phase);
  r.overflows.push_back(s.overflow);
}

std::map<std::string, std::vector<std::byte>> tensors_of(const Trainer& t) {
  std::map<std::string, std::vector<std::byte>> out;
  for (const auto& n : t.tensor_names()) out[n] = t.read_tensor(n).bytes;
  return out;
}

Trained train(Runtime& rt, const ModelSpec& m, const TrainerOptions& o, int steps) {
  Trainer t(rt, m, o);
  Trained r;
  for (int s = 0; s < steps; ++s) record(r, step(t, m, s));
  r.tensors = tensors_of(t);
  return r;
}

void expect_same(const Trained& want, const Trained& got) {
  EXPECT_EQ(got.losses, want.losses);
  EXPECT_EQ(got.phases, want.phases);
  EXPECT_EQ(got.overflows, want.overflows);
  ASSERT_EQ(got.tensors.size(), want.tensors.size());
  for (const auto& [name, values] : want.tensors) EXPECT_EQ(got.tensors.at(name), values) << name;
}

// Streamed with `kind`, its updates on the host or on the device.
TrainerOptions optimizer(ops::OptimizerConfig::Kind kind, bool on_host) {
  TrainerOptions o = streamed();
  o.optimizer.kind = kind;
  o.residency.host_optimizer = on_host;
  return o;
}

struct Case {
  const char* name;
  std::function<TrainerOptions()> options;
  int steps = 4;
};

const Case cases[] = {
    {"adam_on_the_device", [] { return streamed(); }},
    {"adamw_on_the_host", [] { return optimizer(ops::OptimizerConfig::Kind::adamw, true); }},
    {"adamw8bit_on_the_device", [] { return optimizer(ops::OptimizerConfig::Kind::adamw8bit, false); }},
    {"adamw8bit_on_the_host", [] { return optimizer(ops::OptimizerConfig::Kind::adamw8bit, true); }},
    // Narrow gradients cross the link and are widened on the host.
    {"bf16_host_optimizer",
     [] {
       TrainerOptions o = streamed();
       o.precision.compute = graph::DType::bf16;
       o.residency.host_optimizer = true;
       return o;
     }},
    // Overflowing steps (a loss scale too large at first) skip their updates.
    {"fp16_loss_scaling",
     [] {
       TrainerOptions o = streamed();
       o.precision.compute = graph::DType::f16;
       o.precision.initial_scale = 16777216.0f;
       o.precision.growth_interval = 2;
       return o;
     },
     6},
    {"accumulate",
     [] {
       TrainerOptions o = streamed();
       o.accumulate = 2;
       return o;
     },
     6},
    // Predict steps with int8 weights move the quantized weights, Full steps the state.
    {"hybrid_int8",
     [] {
       TrainerOptions o = streamed();
       o.phases.hybrid = true;
       o.phases.warmup_steps = 2;
       o.phases.min_full_steps = 1;
       o.phases.max_predict_steps = 4;
       o.phases.confidence = 0.01f;  // predict as soon as allowed
       o.phases.max_loss_gap = 1e6f;
       o.phases.sigma_limit = 1e6f;
       o.phases.predict_int8 = true;
       return o;
     },
     12},
    {"compressed_state",
     [] {
       TrainerOptions o = streamed();
       o.residency.state_home = graph::Home::host_compressed;
       return o;
     }},
    {"recompute",
     [] {
       TrainerOptions o = streamed();
       o.recompute = 1;
       return o;
     }},
};

class StagedTransfers : public ::testing::TestWithParam<Case> {};

TEST_P(StagedTransfers, TrainLikePinnedMemory) {
  const Case& c = GetParam();
  Runtime rt;
  const ModelSpec m = wide_residual();
  const Trained want = train(rt, m, pinned(c.options()), c.steps);
  {
    Trainer probe(rt, m, staged(c.options()));
    ASSERT_EQ(probe.host_memory(), offload::HostMemory::staged);
    ASSERT_GT(probe.residency().fetches, 0u) << "the case should stream";
    EXPECT_GT(probe.residency().packs, 0u) << "write-backs should go through staging";
  }
  expect_same(want, train(rt, m, staged(c.options()), c.steps));
  if (c.options().phases.hybrid) {
    EXPECT_NE(std::find(want.phases.begin(), want.phases.end(), Phase::predict), want.phases.end())
        << "the hybrid case should predict some steps";
  }
  if (c.options().precision.scaled()) {
    EXPECT_NE(std::find(want.overflows.begin(), want.overflows.end(), true), want.overflows.end())
        << "the fp16 case should overflow at first";
  }
}

INSTANTIATE_TEST_SUITE_P(Features, StagedTransfers, ::testing::ValuesIn(cases),
                         [](const auto& info) { return std::string(info.param.name); });

// A checkpoint saved from staged memory and loaded into another staged trainer goes on as the
// uninterrupted pinned run does (the save and the load read and write the pageable homes).
TEST(StagedTransfersCheckpoint, ResumeLikeAnUninterruptedPinnedRun) {
  Runtime rt;
  const ScopedTempFile file("staged-transfers.ckpt", "");
  const std::filesystem::path path = file.path();
  const ModelSpec m = wide_residual();
  TrainerOptions o = streamed();
  o.residency.host_optimizer = true;
  o.optimizer.kind = ops::OptimizerConfig::Kind::adamw;
  const Trained want = train(rt, m, pinned(o), 5);
  Trained got;
  {
    Trainer first(rt, m, staged(o));
    for (int s = 0; s < 2; ++s) record(got, step(first, m, s));
    first.save_checkpoint(path);
  }
  TrainerOptions other = staged(o);
  other.seed = 99;  // its own weights, replaced by the load
  Trainer second(rt, m, other);
  second.load_checkpoint(path);
  for (int s = 2; s < 5; ++s) record(got, step(second, m, s));
  got.tensors = tensors_of(second);
  expect_same(want, got);
}

}  // namespace
}  // namespace ferry::test
