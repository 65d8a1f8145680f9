// Optimizers (SGD with momentum / Nesterov / L2, Adam / AdamW): the device update against the CPU
// reference over several steps with the learning rate changing between steps, per-step arguments
// taken from StepInfo at enqueue time, and Adam converging on a quadratic. The host optimizer's
// updates (ops/optimizer_host.hpp, vectorised per instruction set) against the same reference,
// in place and out of place.
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "classifier.hpp"
#include "ferry/ferry.hpp"
#include "ferry/ops/optimizer.hpp"
#include "ops/optimizer_host.hpp"
#include "ops/quantize_host.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

constexpr float kLrs[] = {0.1f, 0.05f, 0.2f, 0.01f, 0.07f};

class SgdTest : public ::testing::TestWithParam<std::tuple<std::size_t, bool, float, int>> {};

TEST_P(SgdTest, StepsMatchReference) {
  auto [n, nesterov, wd, steps] = GetParam();
  auto& dev = TestDevice::get();
  const ops::SgdConfig c{0.9f, wd, nesterov};
  auto w = random_vector(n, 1), vel = std::vector<float>(n, 0.0f);
  DeviceTensor dw(w, 3), dg(n, 5), dvel(vel, 11);
  // Bound once; only the gradient and StepInfo change between steps.
  const ops::LaunchList update = ops::sgd_update(dev.env, c, dw.span(), dg.span(), dvel.span(), n);
  auto w_ref = to_double(w), vel_ref = to_double(vel);
  for (int s = 0; s < steps; ++s) {
    const auto g = random_vector(n, 100 + s);
    dg.upload(g);
    const ops::StepInfo info{std::uint64_t(s + 1), kLrs[s]};
    ops::run_blocking(dev.context.compute(), update, info);
    ops::ref::sgd_update<double>(c, info, w_ref, to_double(g), vel_ref);
  }
  expect_near(dvel.download(), to_float(vel_ref), 1e-6f, 1e-5f, "velocity");
  expect_near(dw.download(), to_float(w_ref), 1e-6f, 1e-5f, "w");
  // The update must have moved w (guards against a zero learning rate reaching the kernel).
  EXPECT_GT(std::abs(dw.download()[0] - w[0]), 1e-4f);
}

INSTANTIATE_TEST_SUITE_P(Configs, SgdTest,
                         ::testing::Combine(::testing::Values(1, 257, 1000), ::testing::Bool(),
                                            ::testing::Values(0.0f, 0.01f), ::testing::Values(1, 2, 5)));

class AdamTest : public ::testing::TestWithParam<std::tuple<std::size_t, bool, float, int>> {};

TEST_P(AdamTest, StepsMatchReference) {
  auto [n, decoupled, wd, steps] = GetParam();
  auto& dev = TestDevice::get();
  const ops::AdamConfig c{0.9f, 0.999f, 1e-8f, wd, decoupled};
  auto w = random_vector(n, 2);
  std::vector<float> zeros(n, 0.0f);
  DeviceTensor dw(w, 1), dg(n, 2), dm(zeros, 3), dv(zeros, 4);
  const ops::LaunchList update = ops::adam_update(dev.env, c, dw.span(), dg.span(), dm.span(), dv.span(), n);
  auto w_ref = to_double(w), m_ref = to_double(zeros), v_ref = to_double(zeros);
  for (int s = 0; s < steps; ++s) {
    const auto g = random_vector(n, 200 + s);
    dg.upload(g);
    const ops::StepInfo info{std::uint64_t(s + 1), kLrs[s]};
    ops::run_blocking(dev.context.compute(), update, info);
    ops::ref::adam_update<double>(c, info, w_ref, to_double(g), m_ref, v_ref);
  }
  expect_near(dm.download(), to_float(m_ref), 1e-7f, 1e-5f, "m");
  expect_near(dv.download(), to_float(v_ref), 1e-8f, 1e-5f, "v");
  // Adam's step is about lr per element: relative error of the update, not of w, is what counts.
  expect_near(dw.download(), to_float(w_ref), 1e-5f, 1e-5f, "w");
  EXPECT_GT(std::abs(dw.download()[0] - w[0]), 1e-3f);
}

INSTANTIATE_TEST_SUITE_P(Configs, AdamTest,
                         ::testing::Combine(::testing::Values(1, 257, 1000), ::testing::Bool(),
                                            ::testing::Values(0.0f, 0.1f), ::testing::Values(1, 3, 5)));

// Adam over a group of parameters in one launch (adam_update_group, what graph::group_updates makes
// of adjacent updates): bit for bit what one adam_update per parameter gives, over steps with the
// learning rate changing, for 1 to 8 parameters of sizes that end inside a vector of 16 and sit at
// odd offsets in one buffer or in their own; with a guard that is not finite nothing changes; more
// than 8 parameters, or none, are refused.
TEST(Optimizer, AdamGroupMatchesOneUpdatePerParameterBitForBit) {
  auto& dev = TestDevice::get();
  const ops::AdamConfig c{0.9f, 0.999f, 1e-8f, 0.1f, true};
  const std::size_t sizes[] = {1, 37, 16, 300, 5, 1000, 17, 64};
  for (const std::size_t k : {std::size_t{1}, std::size_t{3}, std::size_t{8}}) {
    std::vector<std::unique_ptr<DeviceTensor>> group, single;  // per parameter: w g m v
    std::vector<ops::AdamSlot> slots;
    ops::LaunchList singles;
    for (std::size_t i = 0; i < k; ++i) {
      const std::size_t n = sizes[i];
      for (int t = 0; t < 4; ++t) {
        const auto init = t == 0 ? random_vector(n, 10 + i) : std::vector<float>(n, 0.0f);
        group.push_back(std::make_unique<DeviceTensor>(init, 1 + 2 * i + t));
        single.push_back(std::make_unique<DeviceTensor>(init, 3 + i));
      }
      auto at = [&](auto& v, int t) { return v[4 * i + t]->span(); };
      slots.push_back({at(group, 0), at(group, 1), at(group, 2), at(group, 3), n});
      for (auto& l : ops::adam_update(dev.env, c, at(single, 0), at(single, 1), at(single, 2), at(single, 3), n))
        singles.push_back(std::move(l));
    }
    const ops::LaunchList grouped = ops::adam_update_group(dev.env, c, slots);
    for (int s = 0; s < 3; ++s) {
      for (std::size_t i = 0; i < k; ++i) {
        const auto g = random_vector(sizes[i], 300 + 10 * s + i);
        group[4 * i + 1]->upload(g);
        single[4 * i + 1]->upload(g);
      }
      const ops::StepInfo info{std::uint64_t(s + 1), kLrs[s]};
      ops::run_blocking(dev.context.compute(), grouped, info);
      ops::run_blocking(dev.context.compute(), singles, info);
    }
    for (std::size_t x = 0; x < group.size(); ++x) {
      if (x % 4 == 1) continue;  // the gradients
      const auto a = group[x]->download(), b = single[x]->download();
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
          << k << " parameters: parameter " << x / 4 << ", tensor "
          << "wgmv"[x % 4];
    }
    // A guard that is not finite: the group changes nothing.
    DeviceTensor guard(std::vector<float>{std::nanf("")});
    const auto before = group[0]->download();
    ops::run_blocking(dev.context.compute(), ops::adam_update_group(dev.env, c, slots, guard.span()),
                      ops::StepInfo{4, 0.1f});
    const auto after = group[0]->download();
    EXPECT_EQ(std::memcmp(before.data(), after.data(), before.size() * sizeof(float)), 0) << "guarded";
  }
  std::vector<ops::AdamSlot> nine(9), none;
  EXPECT_THROW(ops::adam_update_group(dev.env, c, nine), std::invalid_argument);
  EXPECT_THROW(ops::adam_update_group(dev.env, c, none), std::invalid_argument);
}

// Sizes: a single element, vector tails, and more than one TBB chunk (16384 elements) with a tail.
constexpr std::size_t kHostSizes[] = {1, 7, 257, 1000, 16384 * 2 + 37};

class HostAdamTest : public ::testing::TestWithParam<std::tuple<std::size_t, bool, float>> {};

TEST_P(HostAdamTest, StepsMatchReferenceInPlaceAndOutOfPlace) {
  auto [n, decoupled, wd] = GetParam();
  const ops::AdamConfig c{0.9f, 0.999f, 1e-8f, wd, decoupled};
  const auto w0 = random_vector(n, 2);
  std::vector<float> w = w0, m(n, 0.0f), v(n, 0.0f);                          // in place
  std::vector<float> wa = w0, ma(n, 0.0f), va(n, 0.0f), wb(n), mb(n), vb(n);  // out of place, a -> b -> a
  auto w_ref = to_double(w0), m_ref = to_double(m), v_ref = to_double(v);
  for (int s = 0; s < 4; ++s) {
    const auto g = random_vector(n, 200 + s);
    const ops::StepInfo info{std::uint64_t(s + 1), kLrs[s]};
    EXPECT_TRUE(
        ops::host_adam_update(c, info, g.data(), {w.data(), m.data(), v.data(), w.data(), m.data(), v.data()}, n));
    if (s % 2 == 0) {
      EXPECT_TRUE(ops::host_adam_update(c, info, g.data(),
                                        {wa.data(), ma.data(), va.data(), wb.data(), mb.data(), vb.data()}, n));
    } else {
      EXPECT_TRUE(ops::host_adam_update(c, info, g.data(),
                                        {wb.data(), mb.data(), vb.data(), wa.data(), ma.data(), va.data()}, n));
    }
    ops::ref::adam_update<double>(c, info, w_ref, to_double(g), m_ref, v_ref);
  }
  expect_near(m, to_float(m_ref), 1e-7f, 1e-5f, "m");
  expect_near(v, to_float(v_ref), 1e-8f, 1e-5f, "v");
  expect_near(w, to_float(w_ref), 1e-5f, 1e-5f, "w");
  EXPECT_GT(std::abs(w[0] - w0[0]), 1e-3f);
  // Reading and writing the same memory changes nothing: the same arithmetic, bit for bit.
  EXPECT_EQ(w, wa);
  EXPECT_EQ(m, ma);
  EXPECT_EQ(v, va);
}

INSTANTIATE_TEST_SUITE_P(Configs, HostAdamTest,
                         ::testing::Combine(::testing::ValuesIn(kHostSizes), ::testing::Bool(),
                                            ::testing::Values(0.0f, 0.1f)));

class HostSgdTest : public ::testing::TestWithParam<std::tuple<std::size_t, bool, float>> {};

TEST_P(HostSgdTest, StepsMatchReference) {
  auto [n, nesterov, wd] = GetParam();
  const ops::SgdConfig c{0.9f, wd, nesterov};
  const auto w0 = random_vector(n, 1);
  std::vector<float> w = w0, vel(n, 0.0f);
  auto w_ref = to_double(w0), vel_ref = to_double(vel);
  for (int s = 0; s < 4; ++s) {
    const auto g = random_vector(n, 100 + s);
    const ops::StepInfo info{std::uint64_t(s + 1), kLrs[s]};
    EXPECT_TRUE(ops::host_sgd_update(c, info, g.data(), {w.data(), vel.data(), w.data(), vel.data()}, n));
    ops::ref::sgd_update<double>(c, info, w_ref, to_double(g), vel_ref);
  }
  expect_near(vel, to_float(vel_ref), 1e-6f, 1e-5f, "velocity");
  expect_near(w, to_float(w_ref), 1e-6f, 1e-5f, "w");
  EXPECT_GT(std::abs(w[0] - w0[0]), 1e-4f);
}

INSTANTIATE_TEST_SUITE_P(Configs, HostSgdTest,
                         ::testing::Combine(::testing::ValuesIn(kHostSizes), ::testing::Bool(),
                                            ::testing::Values(0.0f, 0.01f)));

// A gradient that is not finite anywhere, the last element of a vector tail or of a later chunk
// included, makes the update report non-finite weights.
TEST(Optimizer, HostUpdatesReportNonFiniteWeights) {
  const std::size_t n = 16384 * 2 + 37;
  for (const std::size_t bad : {std::size_t{0}, n / 2, n - 1}) {
    auto g = random_vector(n, 7);
    g[bad] = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> w = random_vector(n, 8), m(n, 0.0f), v(n, 0.0f), vel(n, 0.0f);
    EXPECT_FALSE(ops::host_adam_update({}, {1, 0.01f}, g.data(),
                                       {w.data(), m.data(), v.data(), w.data(), m.data(), v.data()}, n))
        << bad;
    EXPECT_TRUE(std::isnan(w[bad]));
    w = random_vector(n, 8);
    EXPECT_FALSE(ops::host_sgd_update({}, {1, 0.01f}, g.data(), {w.data(), vel.data(), w.data(), vel.data()}, n))
        << bad;
  }
}

// A finite gradient whose square overflows (the trainer's overflow guard stops such gradients
// before the updates; an L2 term can still make one inside the update): Adam's second moment turns
// inf with the weight finite, and the update reports it, on the device (its status word) and on
// the host, in a vector's middle and in a tail element.
TEST(Optimizer, AdamReportsASecondMomentItMadeInfinite) {
  auto& dev = TestDevice::get();
  const std::size_t n = 16384 * 2 + 37;
  for (const std::size_t bad : {n / 2, n - 1}) {
    SCOPED_TRACE(testing::Message() << "element " << bad);
    auto g = random_vector(n, 9);
    g[bad] = 1e25f;
    const auto w0 = random_vector(n, 10);
    DeviceTensor dw(w0, 1), dg(g, 2), dm(std::vector<float>(n, 0.0f), 3), dv(std::vector<float>(n, 0.0f), 4),
        status(std::vector<float>{0.0f}, 5);  // a u32 word: its bits read as a float, 0 until set
    ops::run_blocking(dev.context.compute(),
                      ops::adam_update(dev.env, {}, dw.span(), dg.span(), dm.span(), dv.span(), n, {}, status.span()),
                      {1, 0.01f});
    EXPECT_TRUE(std::isinf(dv.download()[bad]));
    EXPECT_TRUE(std::isfinite(dw.download()[bad]));
    EXPECT_NE(status.download()[0], 0.0f) << "the device update should report the infinite moment";
    std::vector<float> w = w0, m(n, 0.0f), v(n, 0.0f);
    EXPECT_FALSE(ops::host_adam_update({}, {1, 0.01f}, g.data(),
                                       {w.data(), m.data(), v.data(), w.data(), m.data(), v.data()}, n));
    EXPECT_TRUE(std::isinf(v[bad]));
  }
}

// A gradient of a dtype the host updates cannot read is refused before any element changes.
TEST(Optimizer, HostUpdatesRefuseAGradientTheyCannotReadBeforeChangingAnything) {
  const std::size_t n = 16384 * 2 + 37;
  const std::vector<std::int8_t> codes(n, 3);
  const ops::HostGradient bad{codes.data(), ops::DType::i8, 1.0f};
  std::vector<float> w = random_vector(n, 8), m(n, 0.0f), v(n, 0.0f), vel(n, 0.0f);
  const std::vector<float> before = w;
  std::vector<float> scales(2 * ops::adam8bit_blocks(n, 256), 0.0f);
  std::vector<std::uint8_t> m8(n, 128), v8(n, 0);
  const auto names_the_dtype = [](auto&& run) {
    try {
      run();
      ADD_FAILURE() << "no error";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("i8"), std::string::npos) << e.what();
    }
  };
  names_the_dtype([&] {
    ops::host_adam_update({}, {1, 0.01f}, bad, {w.data(), m.data(), v.data(), w.data(), m.data(), v.data()}, n);
  });
  names_the_dtype([&] { ops::host_sgd_update({}, {1, 0.01f}, bad, {w.data(), vel.data(), w.data(), vel.data()}, n); });
  names_the_dtype([&] {
    ops::host_adam8bit_update(
        {}, 256, {1, 0.01f}, bad,
        {w.data(), m8.data(), v8.data(), scales.data(), w.data(), m8.data(), v8.data(), scales.data()}, n);
  });
  EXPECT_EQ(w, before);
}

// A host update reading the f16 or bf16 copy of a gradient widens it as it reads it: the same
// bits as the update of its widened f32 copy (ops::cast_host, the host-lane cast it replaces), for
// SGD, Adam and 8-bit AdamW, over several chunks and a tail, with the loss scale's inverse as the
// factor and a value that is not finite in the copy.
TEST(Optimizer, HostUpdatesReadNarrowGradientsAsTheirWidenedCopies) {
  const std::size_t n = 16384 * 3 + 77;
  const float factor = 1.0f / 1024.0f;
  for (const ops::DType narrow : {ops::DType::f16, ops::DType::bf16}) {
    SCOPED_TRACE(ops::dtype_name(narrow));
    auto g = random_vector(n, 31, -900.0f, 900.0f);
    g[n - 5] = std::numeric_limits<float>::infinity();
    std::vector<std::uint16_t> copy(n);
    std::vector<float> widened(n);
    ops::cast_host(ops::DType::f32, narrow, g.data(), copy.data(), n);
    ops::cast_host(narrow, ops::DType::f32, copy.data(), widened.data(), n, factor);
    const ops::HostGradient read{copy.data(), narrow, factor};
    const ops::StepInfo info{3, 0.01f};

    std::vector<float> w1 = random_vector(n, 32), m1 = random_vector(n, 33, 0.0f, 0.1f),
                       v1 = random_vector(n, 34, 0.0f, 0.1f);
    auto w2 = w1, m2 = m1, v2 = v1;
    ops::host_adam_update({}, info, widened.data(), {w1.data(), m1.data(), v1.data(), w1.data(), m1.data(), v1.data()},
                          n);
    ops::host_adam_update({}, info, read, {w2.data(), m2.data(), v2.data(), w2.data(), m2.data(), v2.data()}, n);
    EXPECT_TRUE(same_bits(w1, w2) && same_bits(m1, m2) && same_bits(v1, v2)) << "adam";

    std::vector<float> vel1 = random_vector(n, 35), vel2 = vel1;
    w2 = w1;
    ops::SgdConfig sgd;
    sgd.momentum = 0.9f;
    ops::host_sgd_update(sgd, info, widened.data(), {w1.data(), vel1.data(), w1.data(), vel1.data()}, n);
    ops::host_sgd_update(sgd, info, read, {w2.data(), vel2.data(), w2.data(), vel2.data()}, n);
    EXPECT_TRUE(same_bits(w1, w2) && same_bits(vel1, vel2)) << "sgd";

    const std::uint32_t block = 256;
    const std::size_t blocks = ops::adam8bit_blocks(n, block);
    std::vector<std::uint8_t> q1(n, 128), r1(n, 0);
    std::vector<float> scales1(2 * blocks, 0.0f);
    auto q2 = q1, r2 = r1;
    auto scales2 = scales1;
    w2 = w1;
    ops::host_adam8bit_update(
        {}, block, info, widened.data(),
        {w1.data(), q1.data(), r1.data(), scales1.data(), w1.data(), q1.data(), r1.data(), scales1.data()}, n);
    ops::host_adam8bit_update(
        {}, block, info, read,
        {w2.data(), q2.data(), r2.data(), scales2.data(), w2.data(), q2.data(), r2.data(), scales2.data()}, n);
    EXPECT_TRUE(same_bits(w1, w2) && q1 == q2 && r1 == r2 && same_bits(scales1, scales2)) << "adam8bit";
  }
}

// OptimizerConfig::decay_on = matrices: after a step, each weight of rank 2 or more equals the
// run's that decays every weight, and each bias, LayerNorm gain and shift the run's without weight
// decay, bit for bit: on the device (Adam grouped into one launch, and not), on the host (the host
// optimizer), with L2 (SGD) and decoupled decay (AdamW, 8-bit AdamW).
TEST(Optimizer, WeightDecayOnMatricesLeavesRankOneWeightsOut) {
  Runtime rt;
  const ModelSpec m = models::deep(32, 2);
  const std::size_t sample = sample_elems(m);
  const auto images = random_vector(8 * sample, 3);
  std::vector<std::int32_t> labels(8);
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>(i % 10);
  using Kind = ops::OptimizerConfig::Kind;
  for (const Kind kind : {Kind::adamw, Kind::sgd, Kind::adamw8bit, Kind::adam}) {
    for (const int where : {0, 1, 2}) {  // device, device unfused (no update groups), host optimizer
      SCOPED_TRACE(fmt::format("{}, {}", ops::optimizer_name(kind),
                               where == 0   ? "device"
                               : where == 1 ? "unfused"
                                            : "host"));
      const auto one_step = [&](float wd, ops::OptimizerConfig::DecayOn on) {
        TrainerOptions o;
        o.batch = 8;
        o.lr = 0.01f;
        o.optimizer.kind = kind;
        o.optimizer.block8bit = 256;
        o.optimizer.adam.weight_decay = o.optimizer.sgd.weight_decay = wd;
        o.optimizer.decay_on = on;
        o.fuse = where != 1;
        if (where == 2) {
          o.residency.mode = graph::ResidencyMode::stream;
          o.residency.host_optimizer = true;
        }
        auto t = std::make_unique<Trainer>(rt, m, o);
        int seed = 40;
        for (const auto& name : t->parameter_names()) {  // biases and shifts start at 0: no decay to see
          Trainer::HostTensor v = t->read_tensor(name);
          const auto values = random_vector(v.shape.elems(), ++seed);
          std::memcpy(v.bytes.data(), values.data(), v.bytes.size());
          t->write_tensor(name, v);
        }
        t->step(images, labels);
        return t;
      };
      const auto all = one_step(0.1f, ops::OptimizerConfig::DecayOn::all);
      const auto matrices = one_step(0.1f, ops::OptimizerConfig::DecayOn::matrices);
      const auto none = one_step(0.0f, ops::OptimizerConfig::DecayOn::all);
      std::size_t rank_one = 0;
      for (const auto& name : matrices->parameter_names()) {
        const bool matrix = matrices->read_tensor(name).shape.rank >= 2;
        rank_one += !matrix;
        const auto got = matrices->read_parameter(name);
        EXPECT_EQ(got, (matrix ? all : none)->read_parameter(name)) << name;
        EXPECT_NE(all->read_parameter(name), none->read_parameter(name)) << name << ": no decay to tell apart";
      }
      EXPECT_GT(rank_one, 3u) << "biases and LayerNorm gains and shifts";
    }
  }
}

TEST(Optimizer, AdamWAndL2Differ) {
  // With the same weight decay, decoupled decay and L2 give different weights: the flag is used.
  auto& dev = TestDevice::get();
  const std::size_t n = 100;
  const auto w0 = random_vector(n, 5), g = random_vector(n, 6);
  std::vector<float> zeros(n, 0.0f);
  std::vector<std::vector<float>> results;
  for (bool decoupled : {false, true}) {
    DeviceTensor dw(w0), dg(g), dm(zeros), dv(zeros);
    const ops::AdamConfig c{0.9f, 0.999f, 1e-8f, 0.5f, decoupled};
    ops::run_blocking(dev.context.compute(),
                      ops::adam_update(dev.env, c, dw.span(), dg.span(), dm.span(), dv.span(), n), {1, 0.1f});
    results.push_back(dw.download());
  }
  double diff = 0;
  for (std::size_t i = 0; i < n; ++i) diff += std::abs(results[0][i] - results[1][i]);
  EXPECT_GT(diff / n, 1e-3);
}

TEST(Optimizer, AdamStepZeroThrows) {
  auto& dev = TestDevice::get();
  DeviceTensor dw(4), dg(4), dm(4), dv(4);
  const auto update = ops::adam_update(dev.env, {}, dw.span(), dg.span(), dm.span(), dv.span(), 4);
  EXPECT_THROW(ops::run_blocking(dev.context.compute(), update, {0, 0.1f}), std::invalid_argument);
}

TEST(Optimizer, AdamConvergesOnQuadratic) {
  // f(w) = 0.5 sum a_i (w_i - t_i)^2 with curvatures a_i spread over two orders of magnitude.
  auto& dev = TestDevice::get();
  const std::size_t n = 300;
  const auto t = random_vector(n, 7, -2.0f, 2.0f), a = random_vector(n, 8, 0.05f, 5.0f);
  std::vector<float> w(n, 0.0f), zeros(n, 0.0f);
  DeviceTensor dw(w), dg(n), dm(zeros), dv(zeros);
  const ops::AdamConfig c{};
  const auto update = ops::adam_update(dev.env, c, dw.span(), dg.span(), dm.span(), dv.span(), n);
  auto objective = [&](const std::vector<float>& x) {
    double f = 0;
    for (std::size_t i = 0; i < n; ++i) f += 0.5 * a[i] * (x[i] - t[i]) * (x[i] - t[i]);
    return f;
  };
  const double f0 = objective(w);
  std::vector<float> g(n);
  for (std::uint64_t step = 1; step <= 400; ++step) {
    w = dw.download();
    for (std::size_t i = 0; i < n; ++i) g[i] = a[i] * (w[i] - t[i]);
    dg.upload(g);
    // Step decay: 0.1 for the first half, 0.01 after.
    ops::run_blocking(dev.context.compute(), update, {step, step <= 200 ? 0.1f : 0.01f});
  }
  w = dw.download();
  EXPECT_LT(objective(w), 1e-4 * f0);
  double max_err = 0;
  for (std::size_t i = 0; i < n; ++i) max_err = std::max(max_err, double(std::abs(w[i] - t[i])));
  EXPECT_LT(max_err, 0.02);
}

// Settings that would turn every weight into NaN (or grow without bound) are refused up front.
TEST(Optimizer, ValidateRefusesBadSettings) {
  const float nan = std::nanf("");
  auto refused = [](ops::OptimizerConfig c) {
    try {
      ops::validate(c);
      return false;
    } catch (const std::invalid_argument&) {
      return true;
    }
  };
  ops::OptimizerConfig ok;
  EXPECT_FALSE(refused(ok));
  for (float bad : {nan, -0.1f, 1.0f}) {
    ops::OptimizerConfig c;
    c.adam.beta1 = bad;
    EXPECT_TRUE(refused(c)) << "beta1 " << bad;
    c = {};
    c.adam.beta2 = bad;
    EXPECT_TRUE(refused(c)) << "beta2 " << bad;
    c = {};
    c.kind = ops::OptimizerConfig::Kind::sgd;
    c.sgd.momentum = bad;
    EXPECT_TRUE(refused(c)) << "momentum " << bad;
  }
  for (float bad : {nan, -1.0f, INFINITY}) {
    ops::OptimizerConfig c;
    c.adam.weight_decay = bad;
    EXPECT_TRUE(refused(c)) << "weight decay " << bad;
    c = {};
    c.adam.eps = bad;
    EXPECT_TRUE(refused(c)) << "eps " << bad;
  }
  ops::OptimizerConfig zero_eps;
  zero_eps.adam.eps = 0.0f;
  EXPECT_TRUE(refused(zero_eps));
}

}  // namespace
}  // namespace ferry::test
