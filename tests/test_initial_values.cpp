// A model's initial values (runtime/initial_values.hpp): each element a function of its index, so
// a tensor made in pieces, in parallel or whole has the same values; uniform draws that are
// uniform in their bounds and keyed by seed and name; and every home holding what its tensors
// were made with, including a tensor larger than the device path's host image.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "ferry/ferry.hpp"
#include "runtime/initial_values.hpp"
#include "runtime/trainer_internals.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

graph::WeightInit uniform(float bound) {
  return {graph::WeightInit::Kind::uniform, bound};
}

TEST(InitialValues, AnyPieceHasTheValuesOfTheWhole) {
  const std::uint64_t key = initial_values_key(7, "block0.fc1.w");
  const std::size_t n = 1'000'003;
  std::vector<float> whole(n);
  initial_values(uniform(0.05f), key, 0, whole);
  std::vector<float> pieces(n, -1.0f);
  for (std::size_t first = 0; first < n;) {  // pieces of uneven sizes
    const std::size_t count = std::min<std::size_t>(n - first, 1 + (first * 7919) % 65537);
    initial_values(uniform(0.05f), key, first, {pieces.data() + first, count});
    first += count;
  }
  EXPECT_EQ(std::memcmp(whole.data(), pieces.data(), n * sizeof(float)), 0);
  std::vector<float> parallel(n, -1.0f);
  initial_values_parallel(uniform(0.05f), key, 0, n, 4, reinterpret_cast<std::byte*>(parallel.data()), "w");
  EXPECT_EQ(std::memcmp(whole.data(), parallel.data(), n * sizeof(float)), 0);
  std::vector<float> tail(1000);
  initial_values_parallel(uniform(0.05f), key, n - 1000, 1000, 4, reinterpret_cast<std::byte*>(tail.data()), "w");
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), whole.end() - 1000));
}

TEST(InitialValues, UniformDrawsFillTheirBoundsEvenlyAndAreKeyedBySeedAndName) {
  const float bound = 0.25f;
  const std::size_t n = 1 << 20;
  std::vector<float> v(n);
  initial_values(uniform(bound), initial_values_key(1, "linear0.w"), 0, v);
  double sum = 0, squares = 0;
  std::vector<std::size_t> bins(16, 0);
  for (const float x : v) {
    ASSERT_GE(x, -bound);
    ASSERT_LT(x, bound);
    sum += x;
    squares += double(x) * x;
    ++bins[std::min<std::size_t>(15, static_cast<std::size_t>((x + bound) / (2 * bound) * 16))];
  }
  const double mean = sum / n, variance = squares / n - mean * mean, expected_variance = bound * bound / 3.0;
  EXPECT_LT(std::abs(mean), 5 * std::sqrt(expected_variance / n)) << "mean " << mean;
  EXPECT_NEAR(variance, expected_variance, 0.01 * expected_variance);
  for (std::size_t b = 0; b < bins.size(); ++b) {
    EXPECT_NEAR(double(bins[b]), n / 16.0, 6 * std::sqrt(n / 16.0)) << "bin " << b;
  }
  std::vector<float> again(n), other_name(n), other_seed(n);
  initial_values(uniform(bound), initial_values_key(1, "linear0.w"), 0, again);
  initial_values(uniform(bound), initial_values_key(1, "linear2.w"), 0, other_name);
  initial_values(uniform(bound), initial_values_key(2, "linear0.w"), 0, other_seed);
  EXPECT_EQ(v, again);
  std::size_t same_name = 0, same_seed = 0;
  for (std::size_t i = 0; i < n; ++i) {
    same_name += v[i] == other_name[i];
    same_seed += v[i] == other_seed[i];
  }
  EXPECT_LT(same_name, n / 1000) << "another tensor's draws";
  EXPECT_LT(same_seed, n / 1000) << "another seed's draws";
}

TEST(InitialValues, ZerosOfAnyWidthAndOtherKindsOnlyForF32) {
  std::vector<std::uint16_t> narrow(1001, 0xffff);
  initial_values_parallel({graph::WeightInit::Kind::zeros, 0}, 0, 0, narrow.size(), 2,
                          reinterpret_cast<std::byte*>(narrow.data()), "w.adam_m");
  EXPECT_TRUE(std::all_of(narrow.begin(), narrow.end(), [](std::uint16_t x) { return x == 0; }));
  try {
    initial_values_parallel(uniform(1), 0, 0, narrow.size(), 2, reinterpret_cast<std::byte*>(narrow.data()), "w16");
    ADD_FAILURE() << "uniform values in 2-byte elements";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'w16'"), std::string::npos) << e.what();
  }
  std::vector<float> ones(77, 0.0f);
  initial_values({graph::WeightInit::Kind::ones, 0}, 0, 5, ones);
  EXPECT_TRUE(std::all_of(ones.begin(), ones.end(), [](float x) { return x == 1.0f; }));
}

// A linear layer of 4100 x 4200 weights (68.9 MB, more than the device path's 64 MiB host image),
// LayerNorm's ones and zeros, Adam's zero moments: resident (device buffers), streamed (pinned
// host memory) and compressed-weight, dropped-state trainers hold exactly what initial_values
// makes for each tensor.
TEST(InitialValues, EveryHomeHoldsWhatItsTensorsWereMadeWith) {
  Runtime rt;
  const ModelSpec model = models::classifier("wide", graph::Shape{4200}, 10, [](graph::Builder& b, graph::TensorId x) {
    return b.linear(b.relu(b.layernorm(b.linear(x, 4100))), 10);
  });
  struct Homes {
    graph::ResidencyMode mode;
    std::optional<graph::Home> weights, state;
  };
  const Homes configs[] = {{graph::ResidencyMode::resident, {}, {}},
                           {graph::ResidencyMode::stream, {}, {}},
                           {graph::ResidencyMode::stream, graph::Home::host_compressed, graph::Home::dropped}};
  for (const Homes& homes : configs) {
    const graph::ResidencyMode mode = homes.mode;
    TrainerOptions o;
    o.batch = 2;
    o.seed = 11;
    o.residency.mode = mode;
    if (homes.weights) o.residency.weights_home = *homes.weights;
    if (homes.state) o.residency.state_home = *homes.state;
    Trainer trainer(rt, model, o);
    const auto& t = TrainerInternals::train_step(trainer).graph().tensors;
    std::size_t checked = 0, large = 0;
    for (const std::string& name : trainer.tensor_names()) {
      const auto it = std::find(t.name.begin(), t.name.end(), name);
      ASSERT_NE(it, t.name.end()) << name;
      const auto id = static_cast<graph::TensorId>(it - t.name.begin());
      const Trainer::HostTensor held = trainer.read_tensor(name);
      std::vector<float> made(t.shape[id].elems());
      initial_values(t.init[id], initial_values_key(11, name), 0, made);
      ASSERT_EQ(held.bytes.size(), made.size() * sizeof(float)) << name;
      EXPECT_EQ(std::memcmp(held.bytes.data(), made.data(), held.bytes.size()), 0)
          << name << " in " << graph::residency_mode_name(mode);
      ++checked;
      large += made.size() * sizeof(float) > (std::size_t{64} << 20);
    }
    EXPECT_EQ(checked, 3 * trainer.parameter_names().size()) << "every weight and its two Adam moments";
    EXPECT_EQ(large, 3u) << "the wide weight (made in pieces) and its moments (zeros filled on the device)";
  }
}

}  // namespace
}  // namespace ferry::test
