// Batched matmul of two activations, which is ops::gemm strided-batched: every kernel (packed,
// tiled, naive and the device's choice) against the CPU reference over ranks 2-4, all four transposes and shapes that
// are not multiples of any tile, the backward products on the device and the reference's gradients against finite
// differences, the op table rows (shape rule errors, a model with attention-style matmuls and
// softmax trained on the device against the reference executor, gradients through the graph by
// finite differences), determinism, batches with beta, a bias and narrow storage, and a benchmark
// of the batch beside one gemm per product (disabled by default:
// --gtest_also_run_disabled_tests --gtest_filter='*Bench*').
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <tuple>

#include "classifier.hpp"
#include "ferry/ferry.hpp"
#include "ferry/ops/op_table.hpp"
#include "graph/pipeline.hpp"
#include "ops/attrs.hpp"
#include "ops/gemm.hpp"
#include "ops/matmul.hpp"
#include "reference_executor.hpp"
#include "runtime/trainer_internals.hpp"
#include "test_support.hpp"
#include "train_check.hpp"

namespace ferry::test {
namespace {

const char* const kernels[] = {"",
                               "packed RB=6 NV=4",
                               "packed RB=1 NV=1",
                               "packed RB=5 NV=2",
                               "tiled TSM=32 TSN=32 TSK=8 WPTM=2 WPTN=2 VW=2",
                               "tiled TSM=16 TSN=8 TSK=4 WPTM=4 WPTN=1",
                               "naive"};

ops::GemmShape batched(std::size_t batch, std::size_t M, std::size_t N, std::size_t K, bool ta, bool tb) {
  return {.M = M, .N = N, .K = K, .trans_a = ta, .trans_b = tb, .batch = batch};
}

ops::GemmOptions with_kernel(const char* kernel) {
  return {.kernel = kernel};
}

// c = alpha op(a) op(b) on the device, beta 0 (c starts as NaN: it must not be read).
std::vector<float> run_matmul(const ops::GemmShape& s, float alpha, const std::vector<float>& a,
                              const std::vector<float>& b, const ops::GemmOptions& opt) {
  auto& dev = TestDevice::get();
  DeviceTensor da(a, 3), db(b, 5), dc(std::vector<float>(s.batch * s.M * s.N, std::nanf("")), 9);
  const std::size_t scratch_elems = ops::gemm_scratch_elems(dev.env, s, opt);
  DeviceTensor scratch(std::max<std::size_t>(scratch_elems, 1), 11);
  ops::run_blocking(dev.context.compute(), ops::gemm(dev.env, s, alpha, da.span(), db.span(), 0.0f, dc.span(),
                                                     scratch_elems ? scratch.span() : ops::DeviceSpan{}, opt));
  return dc.download();
}

std::vector<float> reference(const ops::GemmShape& s, float alpha, const std::vector<float>& a,
                             const std::vector<float>& b) {
  std::vector<double> c(s.batch * s.M * s.N);
  ops::ref::gemm<double>(s, alpha, to_double(a), to_double(b), 0.0, c);
  return to_float(c);
}

float tolerance(const ops::GemmShape& s) {
  return 1e-5f * float(s.K + 1);
}

// (batch, M, N, K, trans_a, trans_b)
using Case = std::tuple<std::size_t, std::size_t, std::size_t, std::size_t, bool, bool>;
class MatmulTest : public ::testing::TestWithParam<std::tuple<Case, const char*>> {};

// Multiply-adds, the tiled kernels' counted five times: Oclgrind simulates their local-memory
// tiles that much slower (and an AddressSanitizer build of the tests slows it further).
std::size_t matmul_work(const Case& c, const char* kernel) {
  const auto [batch, M, N, K, ta, tb] = c;
  return batch * M * N * K * (std::string_view(kernel).starts_with("tiled") ? 5 : 1);
}

TEST_P(MatmulTest, MatchesReference) {
  const auto [c, kernel] = GetParam();
  const auto [batch, M, N, K, ta, tb] = c;
  if (too_large_for_this_run(matmul_work(c, kernel))) GTEST_SKIP() << "FERRY_TEST_SMALL: a large shape";
  const ops::GemmShape s = batched(batch, M, N, K, ta, tb);
  const auto a = random_vector(batch * M * K, 1), b = random_vector(batch * K * N, 2);
  const ops::GemmOptions opt = with_kernel(kernel);
  SCOPED_TRACE(ops::gemm_kernel_description(TestDevice::get().env, s, opt));
  expect_near(run_matmul(s, 0.75f, a, b, opt), reference(s, 0.75f, a, b), tolerance(s), 1e-5f, "c");
}

TEST_P(MatmulTest, BackwardProductsMatchReference) {
  const auto [c, kernel] = GetParam();
  const auto [batch, M, N, K, ta, tb] = c;
  if (too_large_for_this_run(matmul_work(c, kernel))) GTEST_SKIP() << "FERRY_TEST_SMALL: a large shape";
  const ops::GemmShape f = batched(batch, M, N, K, ta, tb);
  auto& dev = TestDevice::get();
  const ops::GemmOptions opt = with_kernel(kernel);
  const auto a = random_vector(batch * M * K, 3), b = random_vector(batch * K * N, 4),
             dy = random_vector(batch * M * N, 5);
  DeviceTensor ta_(a, 1), tb_(b, 2), tdy(dy, 3), tda(a.size(), 4), tdb(b.size(), 5);
  const std::size_t sa = ops::matmul_grad_a_scratch_elems(dev.env, f, opt);
  const std::size_t sb = ops::matmul_grad_b_scratch_elems(dev.env, f, opt);
  DeviceTensor scratch(std::max<std::size_t>({sa, sb, 1}), 6);
  ops::run_blocking(dev.context.compute(), ops::matmul_grad_a(dev.env, f, 0.5f, tdy.span(), tb_.span(), tda.span(),
                                                              sa ? scratch.span() : ops::DeviceSpan{}, opt));
  ops::run_blocking(dev.context.compute(), ops::matmul_grad_b(dev.env, f, 0.5f, ta_.span(), tdy.span(), tdb.span(),
                                                              sb ? scratch.span() : ops::DeviceSpan{}, opt));
  std::vector<double> da(a.size()), db(b.size());
  ops::ref::matmul_grad_a<double>(f, 0.5, to_double(dy), to_double(b), da);
  ops::ref::matmul_grad_b<double>(f, 0.5, to_double(a), to_double(dy), db);
  expect_near(tda.download(), to_float(da), 1e-5f * float(N + 1), 1e-5f, "da");
  expect_near(tdb.download(), to_float(db), 1e-5f * float(M + 1), 1e-5f, "db");
}

const Case cases[] = {
    // single matrices, every transpose, ragged sizes
    {1, 1, 1, 1, false, false},
    {1, 7, 13, 5, false, false},
    {1, 7, 13, 5, true, false},
    {1, 7, 13, 5, false, true},
    {1, 7, 13, 5, true, true},
    {1, 65, 33, 70, false, true},
    // batches: attention-like and ragged
    {3, 17, 19, 23, false, false},
    {3, 17, 19, 23, true, false},
    {3, 17, 19, 23, false, true},
    {3, 17, 19, 23, true, true},
    {8, 16, 16, 8, false, true},
    {5, 33, 48, 40, false, false},
    {2, 70, 130, 17, true, true},
    {4, 9, 100, 1, false, false},
    // B large enough to be packed even when not transposed (K N > 64Ki floats)
    {2, 5, 300, 250, false, false},
    {1, 9, 270, 260, true, false},
};

INSTANTIATE_TEST_SUITE_P(Shapes, MatmulTest,
                         ::testing::Combine(::testing::ValuesIn(cases), ::testing::ValuesIn(kernels)));

TEST(Matmul, InnerDimZeroWritesZeros) {
  const ops::GemmShape s = batched(2, 3, 5, 0, false, false);
  for (const char* kernel : kernels) {
    SCOPED_TRACE(kernel);
    const auto c = run_matmul(s, 1.0f, {}, {}, with_kernel(kernel));
    expect_near(c, std::vector<float>(c.size(), 0.0f), 0.0f, 0.0f, "c");
  }
}

TEST(Matmul, IsDeterministic) {
  const ops::GemmShape s =
      small_shapes_only() ? batched(2, 20, 18, 70, false, true) : batched(6, 40, 36, 300, false, true);
  const auto a = random_vector(s.batch * s.M * s.K, 8), b = random_vector(s.batch * s.K * s.N, 9);
  for (const char* kernel : kernels) {
    SCOPED_TRACE(kernel);
    const auto x = run_matmul(s, 1.0f, a, b, with_kernel(kernel)), y = run_matmul(s, 1.0f, a, b, with_kernel(kernel));
    EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)), 0);
  }
}

TEST(Matmul, ShapeRuleAndErrors) {
  using ops::Shape;
  const Shape out = ops::matmul_output_shape(Shape{2, 3, 4, 5}, Shape{2, 3, 6, 5}, false, true);
  EXPECT_EQ(out, (Shape{2, 3, 4, 6}));
  const ops::GemmShape s = ops::matmul_shape(Shape{2, 3, 5, 4}, Shape{2, 3, 5, 6}, true, false);
  EXPECT_EQ(s.batch, 6u);
  EXPECT_EQ(s.M, 4u);
  EXPECT_EQ(s.N, 6u);
  EXPECT_EQ(s.K, 5u);
  EXPECT_EQ(ops::matmul_output_shape(Shape{4, 5}, Shape{5, 7}, false, false), (Shape{4, 7}));
  EXPECT_THROW(ops::matmul_shape(Shape{4}, Shape{4, 2}, false, false), std::invalid_argument);
  EXPECT_THROW(ops::matmul_shape(Shape{2, 4, 3}, Shape{3, 2}, false, false), std::invalid_argument);
  EXPECT_THROW(ops::matmul_shape(Shape{2, 4, 3}, Shape{3, 3, 2}, false, false), std::invalid_argument);
  EXPECT_THROW(ops::matmul_shape(Shape{2, 4, 3}, Shape{2, 4, 2}, false, false), std::invalid_argument);
  try {
    ops::matmul_shape(Shape{2, 4, 3}, Shape{2, 5, 2}, false, false);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("inner dims 3 and 5"), std::string::npos) << e.what();
  }
}

// The reference backward products against central differences of the reference forward, for
// every transpose (the device products are checked against these references above).
TEST(Matmul, ReferenceBackwardMatchesFiniteDifferences) {
  for (int t = 0; t < 4; ++t) {
    const ops::GemmShape f = batched(2, 3, 4, 5, (t & 1) != 0, (t & 2) != 0);
    SCOPED_TRACE(testing::Message() << "trans_a " << f.trans_a << " trans_b " << f.trans_b);
    const auto a = to_double(random_vector(f.batch * f.M * f.K, 20 + t));
    const auto b = to_double(random_vector(f.batch * f.K * f.N, 30 + t));
    const auto r = to_double(random_vector(f.batch * f.M * f.N, 40 + t));
    const double alpha = 0.7;
    auto loss = [&](const std::vector<double>& av, const std::vector<double>& bv) {
      std::vector<double> c(r.size());
      ops::ref::gemm<double>(f, alpha, av, bv, 0.0, c);
      return weighted_sum(c, r);
    };
    std::vector<double> da(a.size()), db(b.size());
    ops::ref::matmul_grad_a<double>(f, alpha, r, b, da);
    ops::ref::matmul_grad_b<double>(f, alpha, a, r, db);
    expect_gradient_matches_finite_differences([&](const std::vector<double>& v) { return loss(v, b); }, a, da, "da");
    expect_gradient_matches_finite_differences([&](const std::vector<double>& v) { return loss(a, v); }, b, db, "db");
  }
}

// --- The op table rows ------------------------------------------------------------------------

ops::NodeAttrs transposes(bool ta, bool tb, float alpha = 0.0f) {
  return ops::MatmulAttrs{.transpose_a = ta, .transpose_b = tb, .alpha = alpha}.pack();
}

TensorId apply1(graph::Builder& b, const char* op, std::initializer_list<TensorId> ins, const ops::NodeAttrs& at = {}) {
  const std::vector<TensorId> v(ins);
  return b.apply(ops::find_op(op), v, at)[0];
}

// Attention over a conv's feature maps: y [B, 2, 6, 6] as 2 heads of 6 tokens by 6 features.
// scores = y yᵀ / 4, p = softmax(scores), o = p y + yᵀ p (the second product transposes a); y is
// used four times, so its gradient is a sum.
ModelSpec attention_model() {
  return models::classifier("tiny-attention", graph::Shape{1, 6, 6}, 5, [](graph::Builder& b, TensorId x) {
    const TensorId y = b.conv2d(x, 2, 3, 1, 1);
    const TensorId scores = apply1(b, "matmul", {y, y}, transposes(false, true, 0.25f));
    const TensorId p = apply1(b, "softmax", {scores});
    const TensorId o1 = apply1(b, "matmul", {p, y});
    const TensorId o2 = apply1(b, "matmul", {y, p}, transposes(true, false));
    const TensorId h = b.linear(b.flatten(b.add(o1, o2)), 12);
    // rank 2: a [batch, 12] matrix times its own transpose, then back to 12 features.
    const TensorId g = apply1(b, "softmax", {apply1(b, "matmul", {h, h}, transposes(false, true))});
    return b.linear(apply1(b, "matmul", {g, h}), 5);
  });
}

TEST(MatmulRows, ShapeRuleErrorsNameTheNode) {
  graph::Graph g;
  ClassifierBuilder b(g, 2, graph::Shape{3, 4}, 2);
  const TensorId x = b.input();  // [2, 3, 4]
  EXPECT_EQ(g.tensors.shape[apply1(b, "matmul", {x, x}, transposes(false, true))], (graph::Shape{2, 3, 3}));
  EXPECT_EQ(g.tensors.shape[apply1(b, "matmul", {x, x}, transposes(true, false))], (graph::Shape{2, 4, 4}));
  EXPECT_EQ(g.tensors.shape[apply1(b, "softmax", {x})], (graph::Shape{2, 3, 4}));
  try {
    apply1(b, "matmul", {x, x});
    FAIL();
  } catch (const graph::BuildError& e) {
    EXPECT_NE(std::string(e.what()).find("matmul"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("inner dims"), std::string::npos) << e.what();
  }
  ops::NodeAttrs bad;
  bad.i[1] = 2;
  EXPECT_THROW(apply1(b, "matmul", {x, x}, bad), graph::BuildError);
  EXPECT_THROW(apply1(b, "matmul", {x}), graph::BuildError);
}

TEST(MatmulRows, AttentionModelTrainsOnTheDeviceLikeItsReference) {
  Runtime runtime;
  TrainerOptions topt;
  topt.batch = 4;
  topt.lr = 0.05f;
  topt.optimizer.kind = ops::OptimizerConfig::Kind::sgd;
  topt.optimizer.sgd.momentum = 0.9f;
  Trainer trainer(runtime, attention_model(), topt);
  const auto& g = compiled_train_step(trainer).graph();
  std::map<std::string, int> kinds;
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) ++kinds[ops::op_info(g.nodes.op[n]).name];
  EXPECT_EQ(kinds["matmul"], 5);
  EXPECT_EQ(kinds["matmul_grad_a"], 5);
  EXPECT_EQ(kinds["matmul_grad_b"], 5);
  EXPECT_EQ(kinds["softmax"], 2);
  EXPECT_EQ(kinds["softmax_grad"], 2);

  expect_training_matches_reference(trainer, 4, 50, 3);
}

TEST(MatmulRows, GradientsThroughTheGraphMatchFiniteDifferences) {
  graph::Graph g = forward_graph(attention_model(), graph::VariantKey{3, true});
  ops::OptimizerConfig opt;
  opt.kind = ops::OptimizerConfig::Kind::sgd;
  opt.sgd.momentum = 0;
  g = graph::prepare_step_graph(std::move(g), graph::VariantKey{3, true}, opt);
  ReferenceExecutor ref(g, opt);
  const auto& t = g.tensors;
  randomize_weights(ref, g, 5);
  ref.value(ref.find("input")) = to_double(random_vector(3 * 36, 77, -1.0f, 1.0f));
  ref.ints(ref.find("labels")) = {0, 3, 1};
  ref.run(ops::StepInfo{1, 0.0f});
  std::size_t checked = 0;
  for (TensorId w = 0; w < t.size(); ++w) {
    if (t.role[w] != graph::Role::weight) continue;
    const char* name = t.name[w].c_str();
    const std::vector<double> grad = ref.value(t.grad[w]);
    EXPECT_TRUE(std::any_of(grad.begin(), grad.end(), [](double v) { return std::abs(v) > 1e-6; })) << name;
    ++checked;
    expect_reference_gradient_matches_finite_differences(ref, w, t.grad[w], name, 24);
  }
  EXPECT_EQ(checked, 6u) << "conv w, b and two linears' w, b";
}

// --- Benchmark --------------------------------------------------------------------------------

double seconds_per_run(const ops::LaunchList& list, int reps) {
  auto& dev = TestDevice::get();
  ops::run_blocking(dev.context.compute(), list);  // warm-up (program build, first touch)
  double best = 1e30;
  for (int round = 0; round < 5; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) ops::enqueue(dev.context.compute(), list, {});
    clFinish(dev.context.compute());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
    best = std::min(best, s);
  }
  return best;
}

// GFLOPS of the batched kernel, of one ops::gemm launch per batch, and of ops::gemm on one single
// GEMM with the same flops (the batches stacked along M: [batch M, K] x [K, N]) for the products
// of attention with 32 sequences x 4 heads, context 128, head dim 48.
TEST(MatmulBench, DISABLED_AttentionShapes) {
  auto& dev = TestDevice::get();
  const int reps = std::getenv("FERRY_BENCH_REPS") ? std::atoi(std::getenv("FERRY_BENCH_REPS")) : 10;
  struct Named {
    const char* what;
    ops::GemmShape s;
  };
  const std::size_t B = 128, T = 128, D = 48;
  const Named shapes[] = {
      {"q kT      [128,128,48]x[128,128,48]^T", batched(B, T, T, D, false, true)},
      {"p v       [128,128,128]x[128,128,48]", batched(B, T, D, T, false, false)},
      {"[128,128,48]x[128,48,128] (NN)", batched(B, T, T, D, false, false)},
      {"dS^T q    (TN, grad_b of q kT)", batched(B, T, D, T, true, false)},
  };
  std::printf("device: %s\n", dev.context.device().name.c_str());
  for (const Named& n : shapes) {
    const ops::GemmShape& s = n.s;
    DeviceTensor a(random_vector(s.batch * s.M * s.K, 1), 0), b(random_vector(s.batch * s.K * s.N, 2), 0),
        c(s.batch * s.M * s.N, 0);
    const std::size_t mscratch = ops::gemm_scratch_elems(dev.env, s);
    DeviceTensor ms(std::max<std::size_t>(mscratch, 1), 0);
    const ops::LaunchList batch =
        ops::gemm(dev.env, s, 1.0f, a.span(), b.span(), 0.0f, c.span(), mscratch ? ms.span() : ops::DeviceSpan{});
    const double t_batched = seconds_per_run(batch, reps);
    // The share of packing B, where the kernel packs.
    const double t_pack =
        batch.size() > 1 ? seconds_per_run(ops::LaunchList(batch.begin(), batch.end() - 1), reps) : 0.0;

    // One gemm launch per batch.
    const ops::GemmShape one{s.M, s.N, s.K, s.trans_a, s.trans_b};
    const std::size_t gscratch = ops::gemm_scratch_elems(dev.env, one);
    DeviceTensor gs(std::max<std::size_t>(gscratch, 1), 0);
    ops::LaunchList per_batch;
    for (std::size_t i = 0; i < s.batch; ++i) {
      auto l = ops::gemm(dev.env, one, 1.0f, a.span().advanced(i * s.M * s.K * 4), b.span().advanced(i * s.K * s.N * 4),
                         0.0f, c.span().advanced(i * s.M * s.N * 4), gscratch ? gs.span() : ops::DeviceSpan{});
      std::move(l.begin(), l.end(), std::back_inserter(per_batch));
    }
    const double t_loop = seconds_per_run(per_batch, reps);

    // One GEMM with the same flops: the batches stacked along M (not transposed: a stacked
    // transposed A is not one matrix).
    const ops::GemmShape big{s.batch * s.M, s.N, s.K, false, s.trans_b};
    const std::size_t bscratch = ops::gemm_scratch_elems(dev.env, big);
    DeviceTensor bs(std::max<std::size_t>(bscratch, 1), 0), bb(random_vector(s.K * s.N, 3), 0);
    const double t_single = seconds_per_run(
        ops::gemm(dev.env, big, 1.0f, a.span(), bb.span(), 0.0f, c.span(), bscratch ? bs.span() : ops::DeviceSpan{}),
        reps);
    const double gf = double(s.flops()) * 1e-9;
    std::printf(
        "%s\n  batched %6.1f GFLOPS (%.3f ms, packing B %.3f ms; %s)\n  gemm per batch %6.1f GFLOPS (%.3f ms)\n"
        "  one gemm [%zu,%zu,%zu] %6.1f GFLOPS (%.3f ms)\n",
        n.what, gf / t_batched, t_batched * 1e3, t_pack * 1e3, ops::gemm_kernel_description(dev.env, s).c_str(),
        gf / t_loop, t_loop * 1e3, big.M, big.N, big.K, gf / t_single, t_single * 1e3);
  }
}

}  // namespace
}  // namespace ferry::test
