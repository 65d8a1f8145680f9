// Sequence ops (embedding, causal mask, dropout): device forward and backward against the CPU
// references over shapes that are not multiples of the work-group size, the references' gradients
// against finite differences, out-of-range ids, the dropout mask's statistics and its
// reproducibility from (seed, step, index), shape errors through Builder::apply, and a tiny model
// using all three trained on the device like the reference executor.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>

#include "classifier.hpp"
#include "ferry/ferry.hpp"
#include "ferry/ops/op_table.hpp"
#include "graph/pipeline.hpp"
#include "ops/attrs.hpp"
#include "ops/sequence.hpp"
#include "reference_executor.hpp"
#include "runtime/trainer_internals.hpp"
#include "test_support.hpp"
#include "train_check.hpp"

namespace ferry::test {
namespace {

using graph::TensorId;

// An i32 tensor on the test device (DeviceTensor moves bytes; the floats only carry the bits).
DeviceTensor int_tensor(const std::vector<std::int32_t>& ids, std::uint64_t offset = 5) {
  std::vector<float> bits(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) bits[i] = std::bit_cast<float>(ids[i]);
  return DeviceTensor(bits, offset);
}

std::vector<std::int32_t> random_ids(std::size_t n, std::int32_t vocab, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::int32_t> dist(0, vocab - 1);
  std::vector<std::int32_t> ids(n);
  for (auto& v : ids) v = dist(rng);
  return ids;
}

// ----- embedding -----

struct EmbeddingRun {
  std::vector<float> y, dtable;
};

EmbeddingRun run_embedding(const std::vector<std::int32_t>& ids, const std::vector<float>& table,
                           const std::vector<float>& dy, std::size_t vocab, std::size_t dim) {
  auto& dev = TestDevice::get();
  const std::size_t n = ids.size();
  DeviceTensor d_ids = int_tensor(ids), d_table(table, 3), d_dy(dy, 9), y(n * dim, 4), dtable(vocab * dim, 6);
  ops::run_blocking(dev.context.compute(),
                    ops::embedding_forward(dev.env, d_ids.span(), d_table.span(), y.span(), n, vocab, dim));
  ops::run_blocking(dev.context.compute(),
                    ops::embedding_backward(dev.env, d_ids.span(), d_dy.span(), dtable.span(), n, vocab, dim));
  return {y.download(), dtable.download()};
}

// (positions, vocab, dim)
class EmbeddingTest : public ::testing::TestWithParam<std::tuple<std::size_t, std::size_t, std::size_t>> {};

TEST_P(EmbeddingTest, ForwardAndBackwardMatchReference) {
  auto [n, vocab, dim] = GetParam();
  const auto ids = random_ids(n, std::int32_t(vocab), 3);
  const auto table = random_vector(vocab * dim, 4), dy = random_vector(n * dim, 5);
  const EmbeddingRun got = run_embedding(ids, table, dy, vocab, dim);
  // A gather is exact; the gradient sums in position order, as the float reference does.
  std::vector<float> y(n * dim), dtable(vocab * dim);
  ops::ref::embedding_forward<float>(ids, table, y, vocab, dim);
  ops::ref::embedding_backward<float>(ids, dy, dtable, vocab, dim);
  EXPECT_TRUE(same_bits(got.y, y));
  expect_near(got.dtable, dtable, 0.0f, 0.0f, "dtable (same order as the float reference)");
  std::vector<double> dtable_d(vocab * dim);
  ops::ref::embedding_backward<double>(ids, to_double(dy), dtable_d, vocab, dim);
  expect_near(got.dtable, to_float(dtable_d), 1e-5f * float(std::sqrt(double(n)) + 1), 1e-5f, "dtable (double)");
  // Deterministic: the same bits again.
  const EmbeddingRun again = run_embedding(ids, table, dy, vocab, dim);
  EXPECT_TRUE(same_bits(got.dtable, again.dtable));
}

INSTANTIATE_TEST_SUITE_P(Shapes, EmbeddingTest,
                         ::testing::Values(std::make_tuple(1, 1, 1), std::make_tuple(37, 11, 13),
                                           std::make_tuple(257, 65, 33), std::make_tuple(1000, 3, 70)));

TEST(Embedding, OutOfRangeIdsAreZerosOnTheDeviceAndAnErrorInTheReference) {
  const std::size_t vocab = 7, dim = 5;
  std::vector<std::int32_t> ids = {0, 6, -1, 3, 7, 1 << 30, 3, std::numeric_limits<std::int32_t>::min(), 2};
  const std::size_t n = ids.size();
  const auto table = random_vector(vocab * dim, 8), dy = random_vector(n * dim, 9);
  const EmbeddingRun got = run_embedding(ids, table, dy, vocab, dim);
  // The device: zero rows for the bad ids, and they add nothing to the gradient.
  std::vector<std::int32_t> valid_ids = ids;
  std::vector<float> valid_dy = dy;
  for (std::size_t p = 0; p < n; ++p) {
    if (ids[p] < 0 || ids[p] >= std::int32_t(vocab)) {
      valid_ids[p] = 0;
      for (std::size_t d = 0; d < dim; ++d) valid_dy[p * dim + d] = 0.0f;
    }
  }
  std::vector<float> y(n * dim), dtable(vocab * dim);
  ops::ref::embedding_forward<float>(valid_ids, table, y, vocab, dim);
  ops::ref::embedding_backward<float>(valid_ids, valid_dy, dtable, vocab, dim);
  for (std::size_t p = 0; p < n; ++p) {
    if (valid_ids[p] != ids[p]) {
      for (std::size_t d = 0; d < dim; ++d) y[p * dim + d] = 0.0f;
    }
  }
  expect_near(got.y, y, 0.0f, 0.0f, "y");
  expect_near(got.dtable, dtable, 1e-6f, 1e-6f, "dtable");
  // The reference names the first bad position and its id.
  std::vector<double> yd(n * dim), dtd(vocab * dim);
  for (int pass = 0; pass < 2; ++pass) {
    try {
      if (pass == 0) {
        ops::ref::embedding_forward<double>(ids, to_double(table), yd, vocab, dim);
      } else {
        ops::ref::embedding_backward<double>(ids, to_double(dy), dtd, vocab, dim);
      }
      ADD_FAILURE() << "the reference accepted id -1 (pass " << pass << ")";
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("position 2"), std::string::npos) << what;
      EXPECT_NE(what.find("id -1"), std::string::npos) << what;
    }
  }
}

TEST(Embedding, ReferenceBackwardMatchesFiniteDifferences) {
  const std::size_t n = 23, vocab = 6, dim = 4;
  const auto ids = random_ids(n, vocab, 12);
  const auto table = to_double(random_vector(vocab * dim, 13)), r = to_double(random_vector(n * dim, 14));
  auto loss = [&](const std::vector<double>& t) {
    std::vector<double> y(n * dim);
    ops::ref::embedding_forward<double>(ids, t, y, vocab, dim);
    return weighted_sum(y, r);
  };
  std::vector<double> dtable(vocab * dim);
  ops::ref::embedding_backward<double>(ids, r, dtable, vocab, dim);
  expect_gradient_matches_finite_differences(loss, table, dtable, "dtable");
}

// ----- causal mask -----

class CausalMaskTest : public ::testing::TestWithParam<std::tuple<std::size_t, std::size_t>> {};  // (matrices, T)

TEST_P(CausalMaskTest, ForwardAndBackwardMatchReference) {
  auto [m, t] = GetParam();
  auto& dev = TestDevice::get();
  const auto x = random_vector(m * t * t, 21), dy = random_vector(m * t * t, 22);
  DeviceTensor d_x(x, 3), d_dy(dy, 5), y(x.size(), 2), dx(x.size(), 11);
  ops::run_blocking(dev.context.compute(), ops::causal_mask_forward(dev.env, d_x.span(), y.span(), m, t));
  ops::run_blocking(dev.context.compute(), ops::causal_mask_backward(dev.env, d_dy.span(), dx.span(), m, t));
  std::vector<float> y_ref(x.size()), dx_ref(x.size());
  ops::ref::causal_mask_forward<float>(x, y_ref, t);
  ops::ref::causal_mask_backward<float>(dy, dx_ref, t);
  const auto got_y = y.download(), got_dx = dx.download();
  EXPECT_TRUE(same_bits(got_y, y_ref));
  EXPECT_TRUE(same_bits(got_dx, dx_ref));
  // What the mask means, independently of the reference.
  std::size_t masked = 0;
  for (std::size_t k = 0; k < x.size(); ++k) {
    const std::size_t j = k % t, i = (k / t) % t;
    if (j > i) {
      ++masked;
      ASSERT_TRUE(std::isinf(got_y[k]) && got_y[k] < 0) << k;
      ASSERT_EQ(got_dx[k], 0.0f) << k;
    } else {
      ASSERT_EQ(got_y[k], x[k]) << k;
      ASSERT_EQ(got_dx[k], dy[k]) << k;
    }
  }
  EXPECT_EQ(masked, m * t * (t - 1) / 2);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CausalMaskTest,
                         ::testing::Values(std::make_tuple(1, 1), std::make_tuple(1, 7), std::make_tuple(15, 33),
                                           std::make_tuple(4, 65)));

TEST(CausalMask, ReferenceBackwardMatchesFiniteDifferences) {
  const std::size_t m = 3, t = 5;
  const auto x = to_double(random_vector(m * t * t, 31)), r = to_double(random_vector(m * t * t, 32));
  auto loss = [&](const std::vector<double>& xv) {  // over the finite outputs (what a softmax sees)
    std::vector<double> y(xv.size());
    ops::ref::causal_mask_forward<double>(xv, y, t);
    double s = 0;
    for (std::size_t k = 0; k < y.size(); ++k) s += std::isfinite(y[k]) ? y[k] * r[k] : 0.0;
    return s;
  };
  std::vector<double> dx(x.size());
  ops::ref::causal_mask_backward<double>(r, dx, t);
  expect_gradient_matches_finite_differences(loss, x, dx, "dx");
}

// ----- dropout -----

TEST(Dropout, PhiloxMatchesTheKnownAnswers) {
  // Random123's known-answer vectors for philox4x32_10.
  using A4 = std::array<std::uint32_t, 4>;
  EXPECT_EQ(ops::philox4x32_10({0, 0, 0, 0}, {0, 0}), (A4{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  EXPECT_EQ(ops::philox4x32_10({~0u, ~0u, ~0u, ~0u}, {~0u, ~0u}),
            (A4{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  EXPECT_EQ(ops::philox4x32_10({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u}),
            (A4{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
}

std::vector<float> run_dropout(const std::vector<float>& x, float p, std::uint32_t seed, std::uint64_t step,
                               bool backward = false, std::uint64_t first_row = 0) {
  auto& dev = TestDevice::get();
  DeviceTensor d_x(x, 3), y(x.size(), 6);
  const auto launches = backward ? ops::dropout_backward(dev.env, d_x.span(), y.span(), x.size(), p, seed)
                                 : ops::dropout_forward(dev.env, d_x.span(), y.span(), x.size(), p, seed);
  ops::StepInfo info{step, 0.0f};
  info.first_row = first_row;
  ops::run_blocking(dev.context.compute(), launches, info);
  return y.download();
}

// Nonzero values, so a zero output is a dropped element.
std::vector<float> nonzero_vector(std::size_t n, std::uint32_t seed) {
  auto v = random_vector(n, seed, 0.5f, 1.5f);
  for (std::size_t i = 0; i < n; i += 2) v[i] = -v[i];
  return v;
}

// How many elements two dropout outputs (or an output and the reference's) zero differently: the
// mask bits that differ, the inputs being nonzero.
template <class U, class V>
std::size_t differing_mask_bits(const std::vector<U>& u, const std::vector<V>& v) {
  std::size_t d = 0;
  for (std::size_t i = 0; i < u.size() && i < v.size(); ++i) d += (u[i] == 0) != (v[i] == 0);
  return d;
}

std::size_t kept(const std::vector<float>& y) {
  return std::size_t(std::count_if(y.begin(), y.end(), [](float v) { return v != 0.0f; }));
}

// (elements, p)
class DropoutTest : public ::testing::TestWithParam<std::tuple<std::size_t, float>> {};

TEST_P(DropoutTest, DeviceMatchesReferenceMaskBitForBit) {
  auto [n, p] = GetParam();
  const auto x = nonzero_vector(n, 41), dy = nonzero_vector(n, 42);
  const std::uint32_t seed = 1234;
  for (std::uint64_t step : {std::uint64_t(1), std::uint64_t(7), (std::uint64_t(1) << 32) + 5}) {
    SCOPED_TRACE("step " + std::to_string(step));
    const auto y = run_dropout(x, p, seed, step), dx = run_dropout(dy, p, seed, step, true);
    std::vector<double> y_ref(n), dx_ref(n);
    ops::ref::dropout_forward<double>(to_double(x), y_ref, p, seed, step);
    ops::ref::dropout_backward<double>(to_double(dy), dx_ref, p, seed, step);
    std::size_t mismatched = 0;
    for (std::size_t i = 0; i < n; ++i) {
      mismatched += (y[i] == 0.0f) != (y_ref[i] == 0.0) || (dx[i] == 0.0f) != (y_ref[i] == 0.0);
    }
    EXPECT_EQ(mismatched, 0u) << "mask bits differ between device forward, device backward and the reference";
    expect_near(y, to_float(y_ref), 0.0f, 2e-7f, "y");
    expect_near(dx, to_float(dx_ref), 0.0f, 2e-7f, "dx");
  }
}

// (elements, p): enough elements for the statistics.
class DropoutStatsTest : public ::testing::TestWithParam<std::tuple<std::size_t, float>> {};

TEST_P(DropoutStatsTest, KeptFractionIsOneMinusPAndStepsDrawNewMasks) {
  auto [n, p] = GetParam();
  const auto x = nonzero_vector(n, 43);
  const auto a = run_dropout(x, p, 99, 1), b = run_dropout(x, p, 99, 2), c = run_dropout(x, p, 100, 1);
  const double mean = double(n) * (1.0 - p), sd = std::sqrt(double(n) * p * (1.0 - p));
  for (const auto* y : {&a, &b, &c}) {
    EXPECT_LE(std::abs(double(kept(*y)) - mean), 5 * sd + 1) << "kept " << kept(*y) << " of " << n << ", p = " << p;
  }
  // Masks of two steps (or two seeds) are independent: they differ in about 2 p (1 - p) of the
  // elements; the same step and seed reproduce the mask.
  const double q = 2 * p * (1 - p), sd_q = std::sqrt(double(n) * q * (1 - q));
  EXPECT_LE(std::abs(double(differing_mask_bits(a, b)) - n * q), 5 * sd_q + 1);
  EXPECT_LE(std::abs(double(differing_mask_bits(a, c)) - n * q), 5 * sd_q + 1);
  EXPECT_TRUE(same_bits(a, run_dropout(x, p, 99, 1)));
  // Neighbouring elements are independent too: P(both kept) = (1 - p)^2.
  std::size_t both = 0;
  for (std::size_t i = 0; i + 1 < n; i += 2) both += a[i] != 0.0f && a[i + 1] != 0.0f;
  const double pairs = double(n / 2), pb = (1 - p) * (1 - p);
  EXPECT_LE(std::abs(double(both) - pairs * pb), 5 * std::sqrt(pairs * pb * (1 - pb)) + 1);
}

INSTANTIATE_TEST_SUITE_P(Shapes, DropoutTest,
                         ::testing::Values(std::make_tuple(1, 0.5f), std::make_tuple(1000, 0.1f),
                                           std::make_tuple(100003, 0.3f), std::make_tuple(65537, 0.9f)));
INSTANTIATE_TEST_SUITE_P(Shapes, DropoutStatsTest,
                         ::testing::Values(std::make_tuple(100003, 0.3f), std::make_tuple(65537, 0.9f),
                                           std::make_tuple(50001, 0.5f), std::make_tuple(80000, 0.02f)));

// The micro-batches of an accumulation group and the ranks of a data-parallel step share the step
// count and their element indices: keyed by where their samples start (StepInfo::first_row), they
// draw independent masks, forward and backward alike, as the reference does; at row 0 the layer's
// own seed (one rank, no accumulation: the masks of before).
TEST(Dropout, MicroBatchesAndRanksDrawTheirOwnMasks) {
  const std::size_t n = 50001;
  const float p = 0.3f;
  const auto x = nonzero_vector(n, 44);
  const auto first = run_dropout(x, p, 7, 4), later = run_dropout(x, p, 7, 4, false, 64);
  std::vector<double> want(n);
  ops::ref::dropout_forward<double>(to_double(x), want, p, 7, 4);
  EXPECT_EQ(differing_mask_bits(first, want), 0u) << "row 0 draws with the layer's seed";
  ops::StepInfo at64{4, 0.0f};
  at64.first_row = 64;
  ops::ref::dropout_forward<double>(to_double(x), want, p, ops::dropout_key(7, at64), 4);
  EXPECT_EQ(differing_mask_bits(later, want), 0u) << "row 64 draws with the reference's key";
  EXPECT_TRUE(same_bits(run_dropout(x, p, 7, 4, true, 64), later)) << "the backward recomputes row 64's mask";
  const std::size_t differing = differing_mask_bits(first, later);
  const double q = 2 * p * (1 - p), sd = std::sqrt(double(n) * q * (1 - q));
  EXPECT_LE(std::abs(double(differing) - n * q), 5 * sd + 1) << differing << " of " << n << " mask bits differ";
}

TEST(Dropout, PZeroIsTheIdentity) {
  const auto x = random_vector(777, 51);
  EXPECT_TRUE(same_bits(run_dropout(x, 0.0f, 5, 3), x));
  EXPECT_TRUE(same_bits(run_dropout(x, 0.0f, 5, 3, true), x));
}

TEST(Dropout, RejectsPOutsideZeroToOne) {
  auto& dev = TestDevice::get();
  DeviceTensor x(4), y(4);
  for (float p : {1.0f, 1.5f, -0.1f, std::nanf("")}) {
    EXPECT_THROW(ops::dropout_threshold(p), std::invalid_argument) << p;
    EXPECT_THROW(ops::dropout_forward(dev.env, x.span(), y.span(), 4, p, 0), std::invalid_argument) << p;
    std::vector<double> a(4), b(4);
    EXPECT_THROW(ops::ref::dropout_forward<double>(a, b, p, 0, 1), std::invalid_argument) << p;
  }
}

TEST(Dropout, ReferenceBackwardMatchesFiniteDifferences) {
  const std::size_t n = 50;
  const float p = 0.4f;
  const auto x = to_double(random_vector(n, 61)), r = to_double(random_vector(n, 62));
  auto loss = [&](const std::vector<double>& xv) {
    std::vector<double> y(n);
    ops::ref::dropout_forward<double>(xv, y, p, 17, 3);
    return weighted_sum(y, r);
  };
  std::vector<double> dx(n);
  ops::ref::dropout_backward<double>(r, dx, p, 17, 3);
  std::size_t zeros = 0;
  for (double v : dx) zeros += v == 0.0;
  EXPECT_GT(zeros, 0u);
  EXPECT_LT(zeros, n);
  expect_gradient_matches_finite_differences(loss, x, dx, "dx");
}

// ----- the rows, through the graph -----

// A classifier over `t` character ids per sample: embedding (table [vocab, t], so each sample
// gives a [t, t] "score" matrix), causal mask, ReLU (0 where masked), dropout, then Linear to the
// classes. The input is i32 ids.
struct SequenceModel {
  static constexpr std::uint32_t batch = 6, t = 5, vocab = 11, classes = 4;
  graph::Graph g;
  TensorId table = graph::no_tensor;
};

SequenceModel sequence_model(float p = 0.25f) {
  SequenceModel m;
  graph::Builder b(m.g, SequenceModel::batch);
  const TensorId ids = b.input("input", graph::Shape{SequenceModel::t}, graph::DType::i32);
  const TensorId labels = b.input("labels", graph::Shape{}, graph::DType::i32, graph::Role::label);
  auto& tensors = m.g.tensors;
  m.table = tensors.add("embed.table", graph::Shape{SequenceModel::vocab, SequenceModel::t}, graph::DType::f32,
                        graph::Role::weight);
  tensors.init[m.table] = {graph::WeightInit::Kind::uniform, 1.0f};
  const TensorId e_in[] = {ids, m.table};
  const TensorId e = b.apply(ops::builtin::embedding, e_in)[0];
  const TensorId c_in[] = {e};
  const TensorId masked = b.apply(ops::builtin::causal_mask, c_in)[0];
  const graph::NodeAttrs drop = ops::DropoutAttrs{.p = p, .seed = 7}.pack();
  const TensorId d_in[] = {b.relu(masked)};
  const TensorId dropped = b.apply(ops::builtin::dropout, d_in, drop)[0];
  b.softmax_xent(b.linear(b.flatten(dropped), SequenceModel::classes), labels);
  return m;
}

std::vector<std::int32_t> batch_ids(std::uint32_t seed) {
  return random_ids(SequenceModel::batch * SequenceModel::t, SequenceModel::vocab, seed);
}
std::vector<std::int32_t> batch_labels(const std::vector<std::int32_t>& ids) {
  std::vector<std::int32_t> labels(SequenceModel::batch);
  for (std::size_t b = 0; b < labels.size(); ++b) labels[b] = ids[b * SequenceModel::t] % SequenceModel::classes;
  return labels;
}

TEST(SequenceRows, TinyModelTrainsOnTheDeviceLikeTheReference) {
  Runtime runtime;
  SequenceModel m = sequence_model();
  ops::OptimizerConfig opt;
  opt.kind = ops::OptimizerConfig::Kind::sgd;
  opt.sgd.momentum = 0.9f;
  const graph::Graph g = graph::prepare_step_graph(std::move(m.g), graph::VariantKey{SequenceModel::batch, true}, opt);
  std::map<std::string, int> count;
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) ++count[ops::op_info(g.nodes.op[n]).name];
  for (const char* op : {"embedding", "embedding_grad", "causal_mask", "causal_mask_grad", "dropout", "dropout_grad"}) {
    EXPECT_EQ(count[op], 1) << op;
  }

  graph::CompiledStep step(g, opt, runtime.env(), runtime.context());
  ReferenceExecutor ref(g, opt);
  const auto& t = step.graph().tensors;
  std::uint32_t seed = 3;
  for (TensorId id = 0; id < t.size(); ++id) {
    if (t.role[id] == graph::Role::optimizer_state) {  // momentum starts at zero (the executor's too)
      const std::vector<float> zeros(t.shape[id].elems(), 0.0f);
      step.persistent()->write(t.home[id], t.placement[id], zeros.data(), t.bytes(id));
    }
    if (t.role[id] != graph::Role::weight) continue;
    const auto v = random_vector(t.shape[id].elems(), seed++);
    step.persistent()->write(t.home[id], t.placement[id], v.data(), t.bytes(id));
    ref.value(id) = to_double(v);
  }
  const float lr = 0.1f;
  double first_loss = 0, last_loss = 0;
  for (std::uint32_t s = 1; s <= 6; ++s) {
    const auto ids = batch_ids(s % 2);  // two batches in turn: the loss should fall
    const auto labels = batch_labels(ids);
    std::ranges::copy(ids, step.host_input_as<std::int32_t>("input").begin());
    std::copy(labels.begin(), labels.end(), step.host_input_as<std::int32_t>("labels").begin());
    step.run(ops::StepInfo{s, lr});
    ref.ints(ref.find("input")) = ids;
    ref.ints(ref.find("labels")) = labels;
    ref.run(ops::StepInfo{s, lr});
    EXPECT_NEAR(step.stats_host()[0], ref.loss(), 1e-4 * std::max(1.0, std::abs(ref.loss()))) << "step " << s;
    EXPECT_EQ(step.stats_host()[1], ref.value(g.loss)[1]) << "correct count, step " << s;
    if (s <= 2) first_loss += ref.loss();
    if (s >= 5) last_loss += ref.loss();
  }
  EXPECT_LT(last_loss, first_loss) << "the model did not learn";
  for (TensorId id = 0; id < t.size(); ++id) {
    if (t.role[id] != graph::Role::weight) continue;
    std::vector<float> device(t.shape[id].elems());
    step.persistent()->read(t.home[id], t.placement[id], device.data(), t.bytes(id));
    const auto& host = ref.value(id);
    for (std::size_t i = 0; i < device.size(); ++i)
      ASSERT_NEAR(device[i], host[i], 1e-4) << t.name[id] << "[" << i << "]";
  }
}

TEST(SequenceRows, GradientThroughTheGraphMatchesFiniteDifferences) {
  SequenceModel m = sequence_model(0.3f);
  ops::OptimizerConfig opt;
  opt.kind = ops::OptimizerConfig::Kind::sgd;
  opt.sgd.momentum = 0;
  const TensorId table = m.table;
  const graph::Graph g = graph::prepare_step_graph(std::move(m.g), graph::VariantKey{SequenceModel::batch, true}, opt);
  ReferenceExecutor ref(g, opt);
  std::uint32_t seed = 5;
  for (TensorId id = 0; id < g.tensors.size(); ++id) {
    if (g.tensors.role[id] == graph::Role::weight)
      ref.value(id) = to_double(random_vector(g.tensors.shape[id].elems(), seed++));
  }
  const auto ids = batch_ids(9);
  ref.ints(ref.find("input")) = ids;
  ref.ints(ref.find("labels")) = batch_labels(ids);
  const ops::StepInfo info{4, 0.0f};
  ref.run(info);
  const std::vector<double> grad = ref.value(g.tensors.grad[table]);
  double norm = 0;
  for (double v : grad) norm += v * v;
  EXPECT_GT(norm, 0.0);
  expect_reference_gradient_matches_finite_differences(ref, table, g.tensors.grad[table],
                                                       "embed.table through mask and dropout", 55, info);
}

template <class F>
void expect_build_error(F&& f, const std::string& node, const std::string& words) {
  try {
    f();
    ADD_FAILURE() << "no BuildError for " << node;
  } catch (const graph::BuildError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(node), std::string::npos) << what;
    EXPECT_NE(what.find(words), std::string::npos) << what;
  }
}

TEST(SequenceRows, BadOperandsAreBuildErrorsNamingTheNode) {
  graph::Graph g;
  ClassifierBuilder b(g, 2, graph::Shape{3, 4}, 2);
  const TensorId table = g.tensors.add("table", graph::Shape{10, 4}, graph::DType::f32, graph::Role::weight);
  const TensorId flat = g.tensors.add("flat", graph::Shape{40}, graph::DType::f32, graph::Role::weight);
  const TensorId ids = g.tensors.add("ids", graph::Shape{2, 3}, graph::DType::i32, graph::Role::input);
  const TensorId ids4 = g.tensors.add("ids4", graph::Shape{2, 3, 1, 1}, graph::DType::i32, graph::Role::input);
  const ops::OpId embedding = ops::builtin::embedding, mask = ops::builtin::causal_mask,
                  dropout = ops::builtin::dropout;
  // Float ids, a rank-4 ids tensor, a table that is not [vocab, dim].
  expect_build_error([&] { b.apply(embedding, std::vector<TensorId>{b.input(), table}); }, "embedding", "i32");
  expect_build_error([&] { b.apply(embedding, std::vector<TensorId>{ids4, table}); }, "embedding", "rank 1 to 3");
  expect_build_error([&] { b.apply(embedding, std::vector<TensorId>{ids, flat}); }, "embedding", "[vocab, dim]");
  expect_build_error([&] { b.apply(embedding, std::vector<TensorId>{ids}); }, "embedding", "2 inputs");
  // Scores that are not square in the last two axes, or of rank 1.
  expect_build_error([&] { b.apply(mask, std::vector<TensorId>{b.input()}); }, "causal_mask", "[2, 3, 4]");
  expect_build_error([&] { b.apply(mask, std::vector<TensorId>{flat}); }, "causal_mask", "[..., T, T]");
  for (float p : {1.0f, -0.5f, std::nanf("")}) {
    const graph::NodeAttrs a = ops::DropoutAttrs{.p = p}.pack();
    expect_build_error([&] { b.apply(dropout, std::vector<TensorId>{b.input()}, a); }, "dropout", "[0, 1)");
  }
  // Good operands build, with the shapes the rules promise.
  const TensorId y = b.apply(embedding, std::vector<TensorId>{ids, table})[0];
  EXPECT_EQ(g.tensors.shape[y], (graph::Shape{2, 3, 4}));
  const TensorId sq = g.tensors.add("sq", graph::Shape{2, 3, 3}, graph::DType::f32, graph::Role::activation);
  EXPECT_EQ(g.tensors.shape[b.apply(mask, std::vector<TensorId>{sq})[0]], (graph::Shape{2, 3, 3}));
  const graph::NodeAttrs half = ops::DropoutAttrs{.p = 0.5f}.pack();
  EXPECT_EQ(g.tensors.shape[b.apply(dropout, std::vector<TensorId>{y}, half)[0]], (graph::Shape{2, 3, 4}));
}

TEST(SequenceRows, RowsAreNamedAndComplete) {
  for (const char* name : {"embedding", "causal_mask", "dropout"}) {
    const ops::OpInfo& row = ops::op_info(ops::find_op(name));
    EXPECT_EQ(row.op_class, ops::OpClass::forward) << name;
    EXPECT_TRUE(row.infer && row.bind && row.backward && row.reference) << name;
    const ops::OpInfo& grad = ops::op_info(ops::find_op(std::string(name) + "_grad"));
    EXPECT_EQ(grad.op_class, ops::OpClass::backward) << name;
    EXPECT_TRUE(grad.bind && grad.reference) << name;
  }
}

}  // namespace
}  // namespace ferry::test
