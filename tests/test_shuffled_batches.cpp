// ShuffledBatches: the order a user's loop and `ferry train` draw (std::shuffle with
// std::mt19937_64(seed) each epoch), full batches, shards that split every batch, and resuming
// from a saved engine and order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <vector>

#include "ferry/runtime/fashion_mnist.hpp"
#include "ferry/runtime/shuffled_batches.hpp"

namespace ferry::test {
namespace {

// A data set whose sample i has every pixel equal to i and label i % 10.
Dataset numbered(std::size_t count) {
  Dataset d;
  d.rows = d.cols = 28;
  d.count = count;
  d.images.resize(count * 784);
  d.labels.resize(count);
  for (std::size_t i = 0; i < count; ++i) {
    std::fill_n(d.images.begin() + static_cast<std::ptrdiff_t>(i * 784), 784, static_cast<float>(i));
    d.labels[i] = static_cast<std::int32_t>(i % 10);
  }
  return d;
}

// A classifier of 28 x 28 images: what the batches are gathered for.
ModelSpec mnist_mlp() {
  return models::mlp({16});
}

// The samples a batch holds, read back from its "input" view (every pixel is the sample's number).
std::vector<std::size_t> samples_of(const Batch& b, std::size_t rows) {
  const HostView& v = b.at("input");
  EXPECT_EQ(v.bytes.size(), rows * 784 * sizeof(float));
  std::vector<std::size_t> out;
  for (std::size_t r = 0; r < rows; ++r) {
    float x;
    std::memcpy(&x, v.bytes.data() + r * 784 * sizeof(float), sizeof x);
    out.push_back(static_cast<std::size_t>(x));
    std::int32_t label;
    std::memcpy(&label, b.at("labels").bytes.data() + r * sizeof label, sizeof label);
    EXPECT_EQ(label, static_cast<std::int32_t>(out.back() % 10));
  }
  return out;
}

TEST(ShuffledBatches, EpochsAreShuffledOrdersOfFullBatches) {
  const Dataset data = numbered(103);
  ShuffledBatches batches(data, mnist_mlp(), 10, 7);
  EXPECT_EQ(batches.steps_per_epoch(), 10u);  // the last 3 samples of each epoch are dropped
  std::vector<std::size_t> order(103);
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::mt19937_64 rng(7);
  for (int epoch = 0; epoch < 3; ++epoch) {
    std::shuffle(order.begin(), order.end(), rng);
    std::set<std::size_t> seen;
    for (std::size_t s = 0; s < batches.steps_per_epoch(); ++s) {
      const auto got = samples_of(batches.next(), 10);
      EXPECT_EQ(got, std::vector<std::size_t>(order.begin() + s * 10, order.begin() + s * 10 + 10));
      seen.insert(got.begin(), got.end());
    }
    EXPECT_EQ(seen.size(), 100u) << "an epoch holds no sample twice";
  }
}

TEST(ShuffledBatches, ShardsSplitEveryBatchAmongRanks) {
  const Dataset data = numbered(64);
  ShuffledBatches whole(data, mnist_mlp(), 8, 3);
  std::vector<ShuffledBatches> ranks;
  for (int r = 0; r < 3; ++r) ranks.emplace_back(data, mnist_mlp(), 8, 3, shard_of(8, r, 3));
  for (std::size_t s = 0; s < 2 * whole.steps_per_epoch(); ++s) {
    const auto all = samples_of(whole.next(), 8);
    std::vector<std::size_t> joined;
    for (int r = 0; r < 3; ++r) {
      const Shard sh = shard_of(8, r, 3);
      const auto part = samples_of(ranks[r].next(), sh.count);
      joined.insert(joined.end(), part.begin(), part.end());
    }
    EXPECT_EQ(joined, all) << "step " << s;
  }
}

TEST(ShuffledBatches, ASavedEngineAndOrderGoOnExactly) {
  const Dataset data = numbered(50);
  ShuffledBatches a(data, mnist_mlp(), 5, 11);
  for (int s = 0; s < 13; ++s) a.next();  // into the second epoch, at its batch 3
  std::stringstream engine;
  engine << a.engine();
  const std::vector<std::size_t> order(a.order().begin(), a.order().end());

  ShuffledBatches b(data, mnist_mlp(), 5, 999);
  engine >> b.engine();
  b.set_order(order);
  EXPECT_EQ(samples_of(b.batch(3), 5), samples_of(a.batch(3), 5));
  for (int s = 0; s < 20; ++s) EXPECT_EQ(samples_of(b.next(), 5), samples_of(a.next(), 5)) << s;

  std::vector<std::size_t> twice = order;
  twice[1] = twice[0];
  EXPECT_THROW(b.set_order(twice), std::invalid_argument);
  EXPECT_THROW(b.set_order(std::vector<std::size_t>(order.begin(), order.end() - 1)), std::invalid_argument);
  EXPECT_THROW(b.batch(10), std::out_of_range);
}

TEST(ShuffledBatches, BadSizesAreClearErrors) {
  const Dataset data = numbered(4);
  const auto expect_error = [&](std::uint32_t batch, Shard shard, const char* needle) {
    try {
      ShuffledBatches b(data, mnist_mlp(), batch, 1, shard);
      ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(5, {}, "larger than the 4 samples");
  expect_error(0, {}, "at least one sample");
  expect_error(4, {3, 2}, "outside the batch of 4");
}

}  // namespace
}  // namespace ferry::test
