// Fused causal attention: the CPU reference against the unfused ops' references (scores, causal
// softmax, dropout, value product) and against finite differences; the device kernels of both
// families (cpu, tiled, blocked) against the reference, forward and backward, over contexts that are not
// multiples of the tiles, head dimensions past a vector, several heads and batches, dropout, and
// f16 / bf16 storage; determinism; clear errors for shapes the kernels have no tiles for.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>

#include "ferry/ferry.hpp"
#include "ferry/ops/cast.hpp"
#include "ferry/ops/op_table.hpp"
#include "ops/attention.hpp"
#include "ops/attention_config.hpp"
#include "ops/attention_gemm.hpp"
#include "ops/attention_tune.hpp"
#include "ops/gemm.hpp"
#include "ops/gemm_tune_cache.hpp"
#include "ops/softmax.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

using ops::AttentionShape;

struct Inputs {
  std::vector<float> q, k, v, dout;
};

Inputs random_inputs(const AttentionShape& s, std::uint32_t seed) {
  const std::size_t n = s.batch * s.context * s.width();
  return {random_vector(n, seed, -1.5f, 1.5f), random_vector(n, seed + 1, -1.5f, 1.5f),
          random_vector(n, seed + 2, -1.0f, 1.0f), random_vector(n, seed + 3, -1.0f, 1.0f)};
}

struct Result {
  std::vector<float> o, lse, dq, dk, dv;
};

float default_scale(const AttentionShape& s) {
  return 1.0f / std::sqrt(static_cast<float>(s.head_dim));
}

Result reference(const AttentionShape& s, const Inputs& in, const ops::AttentionDropout& dr, std::uint64_t step) {
  const std::size_t n = in.q.size();
  std::vector<double> o(n), lse(s.rows()), dq(n), dk(n), dv(n);
  const double scale = default_scale(s);
  const auto q = to_double(in.q), k = to_double(in.k), v = to_double(in.v), dout = to_double(in.dout);
  ops::ref::attention_forward<double>(s, scale, dr, step, q, k, v, o, lse);
  // The device's backward reads the device's (float) o and lse: give the reference the same.
  const auto of = to_double(to_float(o)), lsef = to_double(to_float(lse));
  ops::ref::attention_backward<double>(s, scale, dr, step, q, k, v, of, lsef, dout, dq, dk, dv);
  return {to_float(o), to_float(lse), to_float(dq), to_float(dk), to_float(dv)};
}

Result run_device(const AttentionShape& s, const Inputs& in, const ops::AttentionDropout& dr, const ops::StepInfo& info,
                  const std::string& kernel) {
  auto& dev = TestDevice::get();
  const ops::AttentionOptions opt{kernel};
  const std::size_t n = in.q.size();
  DeviceTensor q(in.q, 3), k(in.k, 5), v(in.v, 9), dout(in.dout, 11), o(n, 2), lse(s.rows(), 4), dq(n, 6), dk(n, 8),
      dv(n, 10);
  DeviceTensor fs(std::max<std::size_t>(ops::attention_forward_scratch_elems(dev.env, s, opt), 1), 64);
  DeviceTensor bs(std::max<std::size_t>(ops::attention_backward_scratch_elems(dev.env, s, opt), 1), 128);
  const float scale = default_scale(s);
  ops::run_blocking(dev.context.compute(),
                    ops::attention_forward(dev.env, s, graph::DType::f32, scale, dr, q.span(), k.span(), v.span(),
                                           o.span(), lse.span(), fs.span(), opt),
                    info);
  ops::run_blocking(
      dev.context.compute(),
      ops::attention_backward(dev.env, s, graph::DType::f32, scale, dr, q.span(), k.span(), v.span(), o.span(),
                              lse.span(), dout.span(), dq.span(), dk.span(), dv.span(), bs.span(), opt),
      info);
  return {o.download(), lse.download(), dq.download(), dk.download(), dv.download()};
}

void expect_result_near(const Result& got, const Result& want, float tol, const std::string& what) {
  expect_near(got.o, want.o, tol, tol, (what + " o").c_str());
  expect_near(got.lse, want.lse, tol, tol, (what + " lse").c_str());
  expect_near(got.dq, want.dq, 4 * tol, 4 * tol, (what + " dq").c_str());
  expect_near(got.dk, want.dk, 4 * tol, 4 * tol, (what + " dk").c_str());
  expect_near(got.dv, want.dv, 4 * tol, 4 * tol, (what + " dv").c_str());
}

// The reference equals the unfused path's references: softmax(causal, scale q kᵀ), dropout of the
// probabilities with ops::dropout's mask over [B, H, T, T], times v, heads split by hand.
TEST(AttentionReference, EqualsTheUnfusedOps) {
  const AttentionShape s{2, 7, 3, 5};
  const Inputs in = random_inputs(s, 1);
  for (const float p : {0.0f, 0.3f}) {
    const ops::AttentionDropout dr{p, 77};
    const std::uint64_t step = 5;
    const Result fused = reference(s, in, dr, step);
    const std::size_t T = s.context, D = s.head_dim, BH = s.batch * s.heads;
    // [B, T, H, D] -> [B, H, T, D]
    auto split = [&](const std::vector<float>& x) {
      std::vector<double> y(x.size());
      for (std::size_t b = 0; b < s.batch; ++b)
        for (std::size_t t = 0; t < T; ++t)
          for (std::size_t h = 0; h < s.heads; ++h)
            for (std::size_t d = 0; d < D; ++d)
              y[((b * s.heads + h) * T + t) * D + d] = x[((b * T + t) * s.heads + h) * D + d];
      return y;
    };
    const auto q = split(in.q), k = split(in.k), v = split(in.v);
    std::vector<double> scores(BH * T * T), probs(BH * T * T), dropped(BH * T * T), o(BH * T * D);
    ops::ref::gemm<double>({.M = T, .N = T, .K = D, .trans_b = true, .batch = BH}, default_scale(s), q, k, 0.0, scores);
    ops::ref::softmax_forward<double>(scores, probs, BH * T, T, true);
    if (p > 0.0f) {
      ops::ref::dropout_forward<double>(probs, dropped, p, dr.seed, step);
    } else {
      dropped = probs;
    }
    ops::ref::gemm<double>({.M = T, .N = D, .K = T, .batch = BH}, 1.0, dropped, v, 0.0, o);
    for (std::size_t b = 0; b < s.batch; ++b)
      for (std::size_t t = 0; t < T; ++t)
        for (std::size_t h = 0; h < s.heads; ++h)
          for (std::size_t d = 0; d < D; ++d)
            ASSERT_NEAR(fused.o[((b * T + t) * s.heads + h) * D + d], o[((b * s.heads + h) * T + t) * D + d], 1e-6)
                << "p " << p;
  }
}

// d(sum(o * dout))/d(q, k, v) of the reference backward against central differences of its forward.
TEST(AttentionReference, BackwardMatchesFiniteDifferences) {
  const AttentionShape s{1, 5, 2, 3};
  const Inputs in = random_inputs(s, 4);
  for (const float p : {0.0f, 0.25f}) {
    const ops::AttentionDropout dr{p, 9};
    const double scale = default_scale(s);
    auto q = to_double(in.q), k = to_double(in.k), v = to_double(in.v);
    const auto dout = to_double(in.dout);
    const std::size_t n = q.size();
    std::vector<double> o(n), lse(s.rows()), dq(n), dk(n), dv(n);
    ops::ref::attention_forward<double>(s, scale, dr, 1, q, k, v, o, lse);
    ops::ref::attention_backward<double>(s, scale, dr, 1, q, k, v, o, lse, dout, dq, dk, dv);
    auto objective = [&] {
      std::vector<double> oo(n), ll(s.rows());
      ops::ref::attention_forward<double>(s, scale, dr, 1, q, k, v, oo, ll);
      double sum = 0;
      for (std::size_t i = 0; i < n; ++i) sum += oo[i] * dout[i];
      return sum;
    };
    for (auto [x, g, name] : {std::tuple{&q, &dq, "q"}, std::tuple{&k, &dk, "k"}, std::tuple{&v, &dv, "v"}}) {
      for (std::size_t i = 0; i < n; ++i) {
        const double keep = (*x)[i], h = 1e-6;
        (*x)[i] = keep + h;
        const double up = objective();
        (*x)[i] = keep - h;
        const double down = objective();
        (*x)[i] = keep;
        ASSERT_NEAR((*g)[i], (up - down) / (2 * h), 1e-6) << name << "[" << i << "], p " << p;
      }
    }
  }
}

// (shape, kernel, dropout p)
using Case = std::tuple<AttentionShape, std::string, float>;
class AttentionDevice : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionDevice, ForwardAndBackwardMatchTheReference) {
  const auto& [s, kernel, p] = GetParam();
  if (too_large_for_this_run(s.batch * s.heads * s.context * s.context * s.head_dim)) GTEST_SKIP();
  const Inputs in = random_inputs(s, 11);
  const ops::AttentionDropout dr{p, 1234};
  // A step of the third micro-batch of 4 rows (StepInfo::first_row): the kernel's per-step key is
  // the reference's.
  ops::StepInfo info{3, 0.0f};
  info.first_row = 8;
  const Result got = run_device(s, in, dr, info, kernel);
  const Result want = reference(s, in, {dr.p, ops::dropout_key(dr.seed, info)}, 3);
  expect_result_near(got, want, 2e-5f, kernel.empty() ? "default kernel" : kernel);
}

TEST_P(AttentionDevice, IsDeterministic) {
  const auto& [s, kernel, p] = GetParam();
  if (too_large_for_this_run(s.batch * s.heads * s.context * s.context * s.head_dim)) GTEST_SKIP();
  const Inputs in = random_inputs(s, 12);
  const ops::AttentionDropout dr{p, 99};
  const Result a = run_device(s, in, dr, {2, 0.0f}, kernel), b = run_device(s, in, dr, {2, 0.0f}, kernel);
  for (auto [x, y] : {std::pair{&a.o, &b.o}, std::pair{&a.dq, &b.dq}, std::pair{&a.dk, &b.dk}, std::pair{&a.dv, &b.dv}})
    EXPECT_EQ(std::memcmp(x->data(), y->data(), x->size() * sizeof(float)), 0);
}

// The CPU kernels that stage each head in the work-item's local memory run the same arithmetic as
// the ones reading the staging kernels' global scratch: the same bits, forward and backward, with
// contexts past a block of 16, head dimensions past a vector (24, 40), dropout; they take no
// scratch and one launch per pass. Where a head's staged rows (kᵀ, vᵀ, rows of k, q, do and dq,
// delta) outgrow the device's local memory (Oclgrind's is small), or past LT, the staging
// kernels run.
TEST(AttentionDevice, HeadsStagedInLocalMemoryGiveTheBitsOfTheStagingKernels) {
  auto& dev = TestDevice::get();
  auto fits = [&](const AttentionShape& s) {
    const std::size_t tp = (s.context + 15) / 16 * 16, dp = (s.head_dim + 15) / 16 * 16;
    return tp * (2 * s.head_dim + 4 * dp + 1) * sizeof(float) <= dev.env.device().local_mem_bytes;
  };
  const std::string local = "cpu RB=3 QB=6 KB=32 PASS=1", global = local + " LT=0";
  for (const AttentionShape s : {AttentionShape{2, 17, 3, 8}, AttentionShape{1, 13, 2, 40},
                                 AttentionShape{1, 30, 2, 24}, AttentionShape{2, 64, 2, 64}})
    for (const float p : {0.0f, 0.2f}) {
      SCOPED_TRACE(fmt::format("b{} t{} h{} d{} p{}", s.batch, s.context, s.heads, s.head_dim, p));
      const ops::AttentionOptions lo{local};
      const std::size_t staged = fits(s) ? 1 : 0;
      EXPECT_EQ(ops::attention_forward_scratch_elems(dev.env, s, lo) == 0, staged == 1);
      EXPECT_EQ(ops::attention_backward_scratch_elems(dev.env, s, lo) == 0, staged == 1);
      EXPECT_GT(ops::attention_backward_scratch_elems(dev.env, s, {global}), 0u);
      if (staged) {
        DeviceTensor x(s.batch * s.context * s.width()), lse(s.rows()), none(1);
        const float scale = default_scale(s);
        EXPECT_EQ(ops::attention_forward(dev.env, s, graph::DType::f32, scale, {p, 5}, x.span(), x.span(), x.span(),
                                         x.span(), lse.span(), none.span(), lo)
                      .size(),
                  1u);
        EXPECT_EQ(ops::attention_backward(dev.env, s, graph::DType::f32, scale, {p, 5}, x.span(), x.span(), x.span(),
                                          x.span(), lse.span(), x.span(), x.span(), x.span(), x.span(), none.span(), lo)
                      .size(),
                  1u);
      }
      const Inputs in = random_inputs(s, 31);
      const Result a = run_device(s, in, {p, 5}, {3, 0.0f}, local), b = run_device(s, in, {p, 5}, {3, 0.0f}, global);
      for (auto [x, y, name] :
           {std::tuple{&a.o, &b.o, "o"}, std::tuple{&a.lse, &b.lse, "lse"}, std::tuple{&a.dq, &b.dq, "dq"},
            std::tuple{&a.dk, &b.dk, "dk"}, std::tuple{&a.dv, &b.dv, "dv"}})
        EXPECT_EQ(std::memcmp(x->data(), y->data(), x->size() * sizeof(float)), 0) << name;
    }
  // Past LT the staging kernels' scratch is asked for again; and at any LT for a head whose staged
  // rows need more than any device's local memory (12 MiB at context 4096, head dimension 128).
  EXPECT_GT(ops::attention_backward_scratch_elems(dev.env, {1, 20, 4, 16}, {"cpu PASS=1 LT=16"}), 0u);
  EXPECT_GT(ops::attention_backward_scratch_elems(dev.env, {1, 4096, 4, 128}, {"cpu PASS=1 LT=4096"}), 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionDevice,
    ::testing::Combine(::testing::Values(AttentionShape{1, 1, 1, 16}, AttentionShape{2, 17, 3, 8},
                                         AttentionShape{1, 33, 2, 40}, AttentionShape{2, 64, 2, 64},
                                         AttentionShape{1, 50, 1, 128}, AttentionShape{1, 100, 1, 16}),
                       // KB=16 and 32: several softmax blocks per row at these contexts; RB=6 and 3
                       // leave rows of a register tile before a block's first key. Context 100 (and
                       // 50 at head dimension 128) gives the one-pass backward two groups of key
                       // blocks, the last one short.
                       // The one-pass CPU kernels stage each head in local memory at these
                       // contexts by default (LT); LT=0 keeps them on the staging kernels.
                       ::testing::Values(std::string{}, std::string{"cpu RB=6 QB=12 KB=16 PASS=2"},
                                         std::string{"cpu RB=3 QB=6 KB=32 PASS=1"},
                                         std::string{"cpu RB=3 QB=6 KB=32 PASS=1 LT=0"},
                                         std::string{"tiled BQ=16 BK=8"},
                                         // the GPU family with its default tiles (fitted per kernel) and
                                         // with tiles smaller than these contexts, keys wider than queries;
                                         // then more work-items across a tile than the head dimension has
                                         // float4s (keys in the forward and dq, queries in dk dv)
                                         std::string{"blocked"}, std::string{"blocked TQ=8 TK=16"},
                                         std::string{"blocked TQ=4 TK=64"}, std::string{"blocked TQ=64 TK=4"},
                                         // the scores through the GEMM, all heads in one chunk
                                         std::string{"gemm"}),
                       ::testing::Values(0.0f, 0.2f)),
    // Names that say the case, e.g. b2_t17_h3_d8_blocked_TQ_8_TK_16_p20, so that a run can pick a
    // family (--gtest_filter='*blocked*', as bench/gpu_session.sh does on a GPU).
    [](const ::testing::TestParamInfo<Case>& info) {
      const AttentionShape& s = std::get<0>(info.param);
      const std::string& kernel = std::get<1>(info.param);
      const float p = std::get<2>(info.param);
      std::string name = "b" + std::to_string(s.batch) + "_t" + std::to_string(s.context) + "_h" +
                         std::to_string(s.heads) + "_d" + std::to_string(s.head_dim) + "_" +
                         (kernel.empty() ? std::string{"default"} : kernel) + "_p" +
                         std::to_string(static_cast<int>(p * 100 + 0.5f));
      for (char& c : name) {
        if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
      }
      return name;
    });

// f16 and bf16 storage, f32 arithmetic: the device against the reference on the rounded inputs.
// Head dimension 40 too: the CPU kernels read and write narrow rows 16 at a time, then the rest.
TEST(AttentionDevice, NarrowStorageMatchesTheReferenceOfTheRoundedInputs) {
  auto& dev = TestDevice::get();
  for (const AttentionShape s : {AttentionShape{2, 21, 2, 16}, AttentionShape{1, 19, 2, 40}})
    for (const graph::DType t : {graph::DType::f16, graph::DType::bf16}) {
      const Inputs in = random_inputs(s, 21);
      const std::size_t n = in.q.size();
      for (const std::string kernel : {"cpu RB=4 QB=8 PASS=1", "cpu RB=4 QB=8 PASS=1 LT=0", "cpu RB=2 QB=4 PASS=2",
                                       "tiled BQ=16 BK=8", "blocked TQ=16 TK=8", "gemm"}) {
        SCOPED_TRACE(std::string(ops::dtype_name(t)) + " " + kernel + " head_dim " + std::to_string(s.head_dim));
        auto narrow = [&](const std::vector<float>& x) {
          std::vector<std::uint16_t> y(x.size());
          for (std::size_t i = 0; i < x.size(); ++i)
            y[i] = t == graph::DType::f16 ? ops::ref::float_to_half(x[i]) : ops::ref::float_to_bf16(x[i]);
          return y;
        };
        auto widen = [&](const std::vector<std::uint16_t>& x) {
          std::vector<float> y(x.size());
          for (std::size_t i = 0; i < x.size(); ++i)
            y[i] = t == graph::DType::f16 ? ops::ref::half_to_float(x[i]) : ops::ref::bf16_to_float(x[i]);
          return y;
        };
        const auto q16 = narrow(in.q), k16 = narrow(in.k), v16 = narrow(in.v), d16 = narrow(in.dout);
        const Inputs rounded{widen(q16), widen(k16), widen(v16), widen(d16)};
        const ops::AttentionOptions opt{kernel};
        auto q = DeviceBytes::from(q16), k = DeviceBytes::from(k16), v = DeviceBytes::from(v16),
             dout = DeviceBytes::from(d16);
        DeviceBytes o(n, 2), dq(n, 2), dk(n, 2), dv(n, 2);
        DeviceTensor lse(s.rows(), 4);
        DeviceTensor fs(std::max<std::size_t>(ops::attention_forward_scratch_elems(dev.env, s, opt), 1), 64);
        DeviceTensor bs(std::max<std::size_t>(ops::attention_backward_scratch_elems(dev.env, s, opt), 1), 128);
        const float scale = default_scale(s);
        ops::run_blocking(dev.context.compute(),
                          ops::attention_forward(dev.env, s, t, scale, {}, q.span(), k.span(), v.span(), o.span(),
                                                 lse.span(), fs.span(), opt));
        // The backward reads the stored (rounded) o, as a training step would.
        ops::run_blocking(
            dev.context.compute(),
            ops::attention_backward(dev.env, s, t, scale, {}, q.span(), k.span(), v.span(), o.span(), lse.span(),
                                    dout.span(), dq.span(), dk.span(), dv.span(), bs.span(), opt));
        const Result want = reference(s, rounded, {}, 1);
        const float tol = t == graph::DType::f16 ? 2e-3f : 1.6e-2f;  // one rounding of the outputs
        expect_near(widen(o.download<std::uint16_t>()), want.o, tol, tol, "o");
        expect_near(lse.download(), want.lse, 1e-4f, 1e-4f, "lse");
        expect_near(widen(dq.download<std::uint16_t>()), want.dq, 2 * tol, 2 * tol, "dq");
        expect_near(widen(dk.download<std::uint16_t>()), want.dk, 2 * tol, 2 * tol, "dk");
        expect_near(widen(dv.download<std::uint16_t>()), want.dv, 2 * tol, 2 * tol, "dv");
        for (const auto* d : {&o, &dq, &dk, &dv}) {
          for (const unsigned char byte : d->tail()) ASSERT_EQ(byte, 0xA5) << "written past the end";
        }
      }
    }
}

TEST(AttentionErrors, ShapesWithoutTilesAndBadOperandsAreClearErrors) {
  auto& dev = TestDevice::get();
  try {
    ops::attention_forward_scratch_elems(dev.env, AttentionShape{1, 8, 1, 256});
    FAIL() << "a head dimension of 256 should be refused";
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("256"), std::string::npos) << m;
    EXPECT_NE(m.find("128"), std::string::npos) << m;
    EXPECT_NE(m.find("unfused"), std::string::npos) << m;
  }
  EXPECT_THROW(ops::attention_forward_scratch_elems(dev.env, AttentionShape{1, 0, 1, 16}), std::invalid_argument);
  EXPECT_THROW(ops::attention_forward_scratch_elems(dev.env, AttentionShape{1, 8, 1, 16}, {"tiled BQ=0"}),
               std::invalid_argument);
  EXPECT_THROW(ops::attention_forward_scratch_elems(dev.env, AttentionShape{1, 8, 1, 16}, {"flash"}),
               std::invalid_argument);
  for (const char* bad : {"cpu RB=9 QB=18", "cpu RB=4 QB=8 KB=24", "cpu RB=4 QB=6", "blocked TQ=12", "blocked TK=128",
                          "blocked BQ=16", "tiled TQ=16", "tiled BQ=16 BK=12", "tiled BQ=3 BK=5", "tiled BK=4"}) {
    EXPECT_THROW(ops::attention_forward_scratch_elems(dev.env, AttentionShape{1, 8, 1, 16}, {bad}),
                 std::invalid_argument)
        << bad;
  }

  try {
    ops::parse_attention_config("tiled BQ=64 BK=12");
    ADD_FAILURE() << "a tiled BK that is not a multiple of 8 computed a wrong attention and must be refused";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("BK (keys per tile) is a multiple of 8"), std::string::npos) << e.what();
  }

  // The op's shape rule, through the builder: mismatched operands, heads that do not divide the width.
  graph::Graph g;
  graph::Builder b(g, 2);
  const TensorId q = b.input("q", graph::Shape{8, 32});
  const TensorId k = b.input("k", graph::Shape{8, 32});
  const TensorId short_v = b.input("v", graph::Shape{7, 32});
  EXPECT_THROW(b.attention(q, k, short_v, 2), graph::BuildError);
  EXPECT_THROW(b.attention(q, k, k, 3), graph::BuildError);
  const TensorId wide = b.input("wide", graph::Shape{8, 512});
  try {
    b.attention(wide, wide, wide, 2);
    FAIL() << "head dimension 256 should be refused at build time";
  } catch (const graph::BuildError& e) {
    EXPECT_NE(std::string(e.what()).find("attention"), std::string::npos) << e.what();
  }
  const TensorId y = b.attention(q, k, k, 4);
  EXPECT_EQ(g.tensors.shape[y], (graph::Shape{2, 8, 32}));
}

// The kernel choice as text: what a configuration writes parses back to it (the tuner caches and
// prints that text, and a user copies it into FERRY_ATTENTION_KERNEL); a value with anything after
// its number, or a parameter given twice, is refused rather than half read.
TEST(AttentionErrors, KernelTextParsesBackAndTyposAreRefused) {
  for (const char* spec : {"cpu", "cpu RB=4 QB=8 KB=32 PASS=0", "cpu PASS=2", "cpu LT=0", "cpu LT=4096",
                           "tiled BQ=32 BK=16", "blocked", "blocked TQ=16 TK=64 RR=168", "gemm", "gemm MIB=1"}) {
    const ops::AttentionConfig c = ops::parse_attention_config(spec);
    EXPECT_EQ(ops::parse_attention_config(c.text()), c) << spec << " -> " << c.text();
  }
  EXPECT_EQ(ops::parse_attention_config("blocked TK=16 TQ=32").text(), "blocked TQ=32 TK=16");
  EXPECT_EQ(ops::parse_attention_config("cpu PASS=0").pass, 0u);
  for (const char* bad :
       {"blocked TQ=16x", "blocked TQ=16 TQ=32", "cpu RB=6=7", "gemm MIB=", "gemm MIB", "tiled BQ=-5", "tiled BQ=+5",
        "cpu PASS=3", "blocked RR=8", "blocked TQ=0", "gemm MIB=257", "tiled BQ= 8", "cpu LT=65537", "tiled LT=16"}) {
    try {
      ops::parse_attention_config(bad);
      ADD_FAILURE() << "'" << bad << "' should be refused";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
}

// FERRY_ATTENTION_KERNEL is read where a model's step is compiled, far from where it was set: a
// value that does not parse names the variable, not only the kernel text.
TEST(AttentionErrors, ABadKernelFromTheEnvironmentNamesTheVariable) {
  auto& dev = TestDevice::get();
  ops::OpEnv env{dev.kernels};
  const ops::AttentionShape s{1, 16, 2, 8};
  for (const char* bad : {"bogus", "blocked TQ=16x"}) {
    ScopedEnv kernel("FERRY_ATTENTION_KERNEL", bad);
    try {
      ops::attention_kernel_description(env, s, {});
      ADD_FAILURE() << "FERRY_ATTENTION_KERNEL='" << bad << "' was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(fmt::format("FERRY_ATTENTION_KERNEL='{}': attention: ", bad)),
                std::string::npos)
          << e.what();
    }
  }
  ScopedEnv kernel("FERRY_ATTENTION_KERNEL", "bogus");
  ops::AttentionOptions given;
  given.kernel = "blocked";  // given in the options: the variable is not read
  EXPECT_NO_THROW(ops::attention_kernel_description(env, s, given));
}

// The gemm family in chunks of heads (MIB=1: at context 300 the backward holds one head's two
// score matrices at a time, the forward two heads' one), with dropout, against the reference; and
// a context whose one head does not fit the bound asked for is an error naming MIB, while the
// tuned choice of the family would run the blocked kernels there.
TEST(AttentionGemm, InChunksOfHeadsMatchesTheReference) {
  auto& dev = TestDevice::get();
  const AttentionShape s{1, 300, 5, 16};
  if (too_large_for_this_run(s.batch * s.heads * s.context * s.context * s.head_dim)) GTEST_SKIP();
  EXPECT_EQ(ops::attention_gemm_chunk_heads(s, 1, 2), 1u);
  EXPECT_EQ(ops::attention_gemm_chunk_heads(s, 1, 1), 2u);
  const Inputs in = random_inputs(s, 21);
  const ops::AttentionDropout dr{0.1f, 77};
  expect_result_near(run_device(s, in, dr, {3, 0.0f}, "gemm MIB=1"), reference(s, in, dr, 3), 2e-5f, "gemm MIB=1");
  const AttentionShape too_long{1, 400, 1, 16};
  EXPECT_EQ(ops::attention_gemm_chunk_heads(too_long, 1, 2), 0u);
  try {
    ops::attention_forward_scratch_elems(dev.env, too_long, {"gemm MIB=1"});
    FAIL() << "one head's scores past MIB should be refused";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("MIB"), std::string::npos) << e.what();
  }
  EXPECT_EQ(ops::attention_kernel_description(dev.env, s, {"gemm"}), "gemm");
  EXPECT_EQ(ops::attention_kernel_description(dev.env, s, {"gemm MIB=1"}), "gemm MIB=1");
}

// A register cap (RR, blocked family) is NVIDIA's compiler option: refused by name on a device
// without it, out of range or on another family at parse time, and offered to the tuner only where
// the driver takes it.
TEST(AttentionErrors, RegisterCapsOnlyWhereTheDriverTakesThem) {
  auto& dev = TestDevice::get();
  const AttentionShape s{1, 16, 2, 16};
  for (const char* bad : {"blocked TQ=8 RR=8", "blocked TQ=8 RR=256", "tiled BQ=16 RR=168"}) {
    EXPECT_THROW(ops::attention_forward_scratch_elems(dev.env, s, {bad}), std::invalid_argument) << bad;
  }
  try {
    ops::attention_forward_scratch_elems(dev.env, s, {"blocked TQ=8 RR=12"});
    FAIL() << "RR=12 should be refused";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("16..255"), std::string::npos) << e.what();
  }
  if (!dev.context.device().has_extension("cl_nv_compiler_options")) {
    const Inputs in = random_inputs(s, 7);
    try {
      run_device(s, in, {}, {}, "blocked TQ=8 TK=8 RR=168");
      FAIL() << "a register cap should be refused without cl_nv_compiler_options";
    } catch (const std::runtime_error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("blocked TQ=8 TK=8 RR=168"), std::string::npos) << m;
      EXPECT_NE(m.find("cl_nv_compiler_options"), std::string::npos) << m;
    }
  }
  cl::DeviceInfo plain = dev.context.device(), nvidia = dev.context.device();
  plain.type = nvidia.type = CL_DEVICE_TYPE_GPU;
  plain.extensions = "cl_khr_fp64";
  nvidia.extensions = "cl_khr_fp64 cl_nv_compiler_options";
  plain.max_work_group_size = nvidia.max_work_group_size = 1024;
  const auto capped = [](const std::vector<std::string>& list) {
    return std::count_if(list.begin(), list.end(), [](const std::string& k) { return k.ends_with(" RR=168"); });
  };
  const auto without = ops::attention_tune_candidates(plain, ops::TuneMode::quick);
  const auto with = ops::attention_tune_candidates(nvidia, ops::TuneMode::quick);
  EXPECT_EQ(capped(without), 0);
  EXPECT_EQ(with.size(), without.size() + 4) << "the quick search's four blocked tiles, capped";
  EXPECT_EQ(capped(with), 4);
  EXPECT_NE(std::find(with.begin(), with.end(), "blocked TQ=64 TK=32 RR=168"), with.end());
}

// With builds ahead (on other threads while candidates are timed) the search measures the same
// candidates with the same outcome: every runnable one scored in every class (the gemm family's
// GEMMs built ahead too), the one that cannot build refused with its reason, and every program it
// ran built from source once, in one library.
TEST(AttentionTune, BuildingAheadMeasuresTheSameCandidates) {
  auto& dev = TestDevice::get();
  auto run = [&](bool ahead, ops::AttentionTuneResult& r) {
    const auto dir = std::filesystem::temp_directory_path() /
                     fmt::format("ferry_attention_{}_{}", ahead ? "ahead" : "in_turn", ::getpid());
    std::filesystem::remove_all(dir);
    cl::KernelLibrary kernels(dev.context, cl::ProgramCacheOptions{true, dir});
    ops::OpEnv env{kernels};
    ops::AttentionTuneOptions o;
    o.candidates = {"blocked TQ=8 TK=8", "tiled BQ=16 BK=8", "blocked TQ=9", "blocked TQ=16 TK=8", "gemm"};
    o.shapes = {{1, 40, 2, 16}, {1, 24, 1, 80}};
    o.build_ahead_on_cpus = ahead;
    // No time limit to speak of: with cold kernel caches (a fresh machine, PoCL compiling every
    // program) the default 60 s stopped the first search after 4 of the 5 candidates.
    o.budget_seconds = 3600;
    r = ops::tune_attention(env, o);
    const cl::ProgramCacheStats stats = kernels.stats();
    std::filesystem::remove_all(dir);
    return stats;
  };
  ops::AttentionTuneResult in_turn, ahead;
  const cl::ProgramCacheStats in_turn_stats = run(false, in_turn);
  const cl::ProgramCacheStats ahead_stats = run(true, ahead);
  ASSERT_EQ(ahead.candidates.size(), 5u);
  ASSERT_EQ(in_turn.candidates.size(), 5u);
  for (std::size_t i = 0; i < 5; ++i) {
    const ops::AttentionTuneCandidate &a = ahead.candidates[i], &b = in_turn.candidates[i];
    EXPECT_EQ(a.kernel, b.kernel);
    EXPECT_EQ(a.error.empty(), i != 2) << a.kernel << ": " << a.error;
    EXPECT_EQ(a.error, b.error) << a.kernel;
    ASSERT_EQ(a.score_ms.size(), 2u);
    for (double ms : a.score_ms) EXPECT_EQ(ms > 0.0, i != 2) << a.kernel;
  }
  EXPECT_EQ(ahead_stats.source_builds, in_turn_stats.source_builds);
  EXPECT_EQ(ahead_stats.disk_hits, 0u);
}

// The attention tuner: GPU candidate lists (both families, quick a subset of full), a search over
// given candidates on this device, its cache written, read back, and refused once damaged.
TEST(AttentionTune, SearchesCachesAndRefusesADamagedCache) {
  auto& dev = TestDevice::get();
  cl::DeviceInfo as_gpu = dev.context.device(), as_cpu = dev.context.device();
  as_gpu.type = CL_DEVICE_TYPE_GPU;
  as_cpu.type = CL_DEVICE_TYPE_CPU;
  const auto quick = ops::attention_tune_candidates(as_gpu, ops::TuneMode::quick);
  const auto full = ops::attention_tune_candidates(as_gpu, ops::TuneMode::full);
  ASSERT_FALSE(quick.empty());
  EXPECT_LT(quick.size(), full.size());
  EXPECT_EQ(quick.front(), "blocked TQ=64 TK=32");
  bool tiled = false;
  for (const std::string& k : quick) {
    EXPECT_NE(std::find(full.begin(), full.end(), k), full.end()) << k;
    tiled |= k.starts_with("tiled ");
  }
  EXPECT_TRUE(tiled) << "the search must measure the tiled family against the blocked one";
  EXPECT_TRUE(ops::attention_tune_candidates(as_cpu, ops::TuneMode::full).empty());
  EXPECT_THROW(ops::tune_attention(dev.env), std::invalid_argument);  // a CPU without candidates
  EXPECT_TRUE(ops::attention_tuning_for(dev.env).kernels.empty() || !dev.context.device().is_cpu());

  const auto dir = std::filesystem::temp_directory_path() / fmt::format("ferry_attention_tune_{}", ::getpid());
  std::filesystem::remove_all(dir);
  cl::KernelLibrary kernels(dev.context, cl::ProgramCacheOptions{true, dir});
  ops::OpEnv env{kernels};
  ops::AttentionTuneOptions o;
  o.candidates = {"blocked TQ=8 TK=8", "tiled BQ=16 BK=8", "blocked TQ=9"};  // the last one cannot run
  o.shapes = {{1, 40, 2, 16}, {2, 24, 1, 32}, {1, 24, 1, 80}};               // two in the class up to 64, one up to 128
  o.budget_seconds = 3600;  // every candidate measured, however cold the kernel caches
  std::size_t reports = 0;
  o.progress = [&](const ops::AttentionTuneProgress& p) {
    ++reports;
    EXPECT_EQ(p.total, 3u);
  };
  const ops::AttentionTuneResult r = ops::tune_attention(env, o);
  EXPECT_EQ(reports, 3u);
  ASSERT_EQ(r.classes.size(), 2u);
  EXPECT_EQ(r.classes[0].max_head_dim, 64u);
  EXPECT_EQ(r.classes[0].shapes.size(), 2u);
  EXPECT_EQ(r.classes[1].max_head_dim, 128u);
  EXPECT_EQ(r.classes[1].shapes.size(), 1u);
  ASSERT_EQ(r.candidates.size(), 3u);
  for (std::size_t k = 0; k < 2; ++k) {
    ASSERT_EQ(r.candidates[k].score_ms.size(), 2u);
    for (double ms : r.candidates[k].score_ms) EXPECT_GT(ms, 0.0) << r.candidates[k].error;
  }
  EXPECT_NE(r.candidates[2].error.find("TQ"), std::string::npos) << r.candidates[2].error;
  std::map<std::size_t, std::string> winners;
  for (std::size_t c = 0; c < 2; ++c) {
    const ops::AttentionTuneClass& cls = r.classes[c];
    const double a = r.candidates[0].score_ms[c], b = r.candidates[1].score_ms[c];
    EXPECT_EQ(cls.best, a <= b ? o.candidates[0] : o.candidates[1]) << "class " << cls.max_head_dim;
    EXPECT_EQ(cls.best_ms, std::min(a, b));
    EXPECT_EQ(cls.best_shape_ms.size(), cls.shapes.size());
    winners[cls.max_head_dim] = cls.best;
  }
  EXPECT_EQ(r.best, "64: " + winners[64] + "; 128: " + winners[128]);
  ASSERT_EQ(r.cache_path, ops::attention_tune_cache_path(env));
  ASSERT_FALSE(r.cache_path.empty());
  EXPECT_EQ(ops::read_attention_tune_cache(env, r.cache_path), std::optional(winners));
  // Each head dimension runs its class's winner; one above every class, the defaults.
  const ops::AttentionTuning tuning{winners, r.cache_path};
  EXPECT_EQ(tuning.kernel_for(16), winners[64]);
  EXPECT_EQ(tuning.kernel_for(64), winners[64]);
  EXPECT_EQ(tuning.kernel_for(80), winners[128]);
  EXPECT_EQ(tuning.kernel_for(256), "");
  EXPECT_EQ(tuning.summary(), r.best);

  // A cache of one winner for every head dimension (written before the classes): retuned.
  const std::string one_kernel = (dir / "one-kernel.txt").string();
  ASSERT_EQ(ops::write_tune_cache_text(one_kernel, "kernel blocked TQ=8 TK=8\n", "attention tuning cache"), "");
  testing::internal::CaptureStderr();
  EXPECT_EQ(ops::read_attention_tune_cache(env, one_kernel), std::nullopt);
  const std::string old = testing::internal::GetCapturedStderr();
  EXPECT_NE(old.find("names no head-dimension class"), std::string::npos) << old;

  // A damaged cache: a warning naming the file, and no kernel from it.
  std::string text;
  {
    std::ifstream in(r.cache_path);
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  }
  const std::size_t at = text.find("kernel ");
  ASSERT_NE(at, std::string::npos) << text;
  text[at + 7] = text[at + 7] == 'b' ? 't' : 'b';
  std::ofstream(r.cache_path, std::ios::trunc) << text;
  testing::internal::CaptureStderr();
  EXPECT_EQ(ops::read_attention_tune_cache(env, r.cache_path), std::nullopt);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find(r.cache_path + " fails its checksum"), std::string::npos) << err;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace ferry::test
