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
  std::optional<graph::Home> state_home;
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

// Fusing ReLUs into the max-pools and convolutions around them (TrainerOptions::fuse) is exact:
// the same losses and state, bit for bit, as the unfused graph, resident and streamed, with
// non-overlapping and overlapping (window 2, stride 1) pools, a ReLU in a convolution's epilogue
// (the direct first-layer kernel and the GEMM's), and in bf16 mixed precision; so is taking a
// residual add into the LayerNorm that reads its sum (add_layernorm; models::deep is a residual
// stream with a LayerNorm after every add), and under mixed precision a LayerNorm storing the narrow
// copy its next layer reads (fuse_narrowing_casts; f16 with loss scaling too).
TEST(Fusion, FusedReluIsBitIdenticalToTheUnfusedGraph) {
  Runtime rt;
  const ModelSpec conv_relu =
      models::classifier("conv-relu-cnn", graph::Shape{1, 8, 8}, 10, [](graph::Builder& b, TensorId x) {
        x = b.relu(b.conv2d(x, 4, 3, 1, 1));                // direct kernel + ReLU epilogue
        x = b.maxpool2d(b.relu(b.conv2d(x, 24, 3, 1, 1)));  // ReLU into the pool
        x = b.relu(b.conv2d(x, 16, 3, 1, 1));               // GEMM + ReLU epilogue
        return b.linear(b.flatten(x), 10);
      });
  struct Run {
    ModelSpec model;
    graph::ResidencyMode mode;
    ops::DType precision;
  };
  for (const Run& run : {Run{small_cnn(), graph::ResidencyMode::resident, ops::DType::f32},
                         Run{small_cnn(), graph::ResidencyMode::stream, ops::DType::f32},
                         Run{conv_relu, graph::ResidencyMode::resident, ops::DType::f32},
                         Run{conv_relu, graph::ResidencyMode::resident, ops::DType::bf16},
                         Run{models::deep(48, 3), graph::ResidencyMode::resident, ops::DType::f32},
                         Run{models::deep(48, 3), graph::ResidencyMode::stream, ops::DType::f32},
                         Run{models::deep(48, 3), graph::ResidencyMode::resident, ops::DType::bf16},
                         Run{models::deep(48, 3), graph::ResidencyMode::stream, ops::DType::bf16},
                         Run{models::deep(48, 3), graph::ResidencyMode::resident, ops::DType::f16}}) {
    SCOPED_TRACE(fmt::format("{} {}", run.model.name, ops::dtype_name(run.precision)));
    const ModelSpec& m = run.model;
    const auto mode = run.mode;
    TrainerOptions o;
    o.batch = 8;
    o.lr = 0.05f;
    o.seed = 3;
    o.residency.mode = mode;
    o.precision.compute = run.precision;
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
                                                  graph::Home::host_compressed}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace ferry::test
