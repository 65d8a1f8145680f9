// Determinism: the same seed, device and configuration give the same loss sequence and the same
// training state, bit for bit, in two fresh trainers (resident, streamed, compressed state).
#include <fmt/format.h>

#include <cstring>

#include "classifier.hpp"
#include "ferry/ferry.hpp"
#include "test_models.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

struct TrainingRun {
  std::vector<std::uint32_t> loss_bits;
  std::map<std::string, std::vector<std::byte>> state;  // every persistent tensor, as stored
};

TrainingRun train(Runtime& rt, const ModelSpec& m, const TrainerOptions& o, int steps) {
  Trainer t(rt, m, o);
  TrainingRun r;
  const std::size_t sample = sample_elems(m);
  for (int s = 0; s < steps; ++s) {
    auto images = random_vector(o.batch * sample, 100 + s);
    auto labels = labels_for(o.batch, 200 + s);
    const float loss = t.step(images, labels).loss;
    std::uint32_t bits = 0;
    std::memcpy(&bits, &loss, sizeof bits);
    r.loss_bits.push_back(bits);
  }
  for (const auto& name : t.tensor_names()) r.state[name] = t.read_tensor(name).bytes;
  return r;
}

struct Config {
  const char* name;
  graph::ResidencyMode mode;
  std::optional<graph::Residency> state_home;
};

class DeterminismTest : public ::testing::TestWithParam<Config> {};

TEST_P(DeterminismTest, TwoFreshTrainersGiveTheSameLossesAndStateBitForBit) {
  Runtime rt;
  for (const ModelSpec& m : {small_residual(), small_cnn()}) {
    TrainerOptions o;
    o.batch = 8;
    o.lr = 0.01f;
    o.seed = 7;
    o.residency.mode = GetParam().mode;
    o.residency.state_home = GetParam().state_home;
    if (o.residency.mode == graph::ResidencyMode::stream) {
      o.residency.budget_bytes = 1;
      o.residency.budget_bytes = ferry::min_stream_budget(rt, m, o).value_or(0);
      ASSERT_GT(o.residency.budget_bytes, 0u);
    }
    const TrainingRun a = train(rt, m, o, 6), b = train(rt, m, o, 6);
    EXPECT_EQ(a.loss_bits, b.loss_bits) << m.name;
    ASSERT_EQ(a.state.size(), b.state.size());
    for (const auto& [name, bytes] : a.state) EXPECT_EQ(bytes, b.state.at(name)) << m.name << " " << name;
    // And the seed matters: another one starts elsewhere.
    o.seed = 8;
    EXPECT_NE(train(rt, m, o, 1).loss_bits[0], a.loss_bits[0]) << m.name;
  }
}

// Fusing each ReLU into the max-pool that reads it (TrainerOptions::fuse) is exact: the same
// losses and state, bit for bit, as the unfused graph, resident and streamed, with non-overlapping
// and overlapping (window 2, stride 1) pools.
TEST(Fusion, ReluIntoMaxPoolIsBitIdenticalToTheUnfusedGraph) {
  Runtime rt;
  const ModelSpec m = small_cnn();
  for (const auto mode : {graph::ResidencyMode::resident, graph::ResidencyMode::stream}) {
    TrainerOptions o;
    o.batch = 8;
    o.lr = 0.05f;
    o.seed = 3;
    o.residency.mode = mode;
    if (mode == graph::ResidencyMode::stream) {
      // The unfused graph's budget: it keeps the ReLUs' outputs and needs a little more.
      o.fuse = false;
      o.residency.budget_bytes = 1;
      o.residency.budget_bytes = ferry::min_stream_budget(rt, m, o).value_or(0);
      ASSERT_GT(o.residency.budget_bytes, 0u);
      o.fuse = true;
    }
    const TrainingRun fused = train(rt, m, o, 6);
    o.fuse = false;
    const TrainingRun unfused = train(rt, m, o, 6);
    EXPECT_EQ(fused.loss_bits, unfused.loss_bits);
    ASSERT_EQ(fused.state.size(), unfused.state.size());
    for (const auto& [name, bytes] : fused.state) EXPECT_EQ(bytes, unfused.state.at(name)) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Homes, DeterminismTest,
                         ::testing::Values(Config{"resident", graph::ResidencyMode::resident, std::nullopt},
                                           Config{"stream", graph::ResidencyMode::stream, std::nullopt},
                                           Config{"compressed_state", graph::ResidencyMode::resident,
                                                  graph::Residency::host_compressed}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace ferry::test
