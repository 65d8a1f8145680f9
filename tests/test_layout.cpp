// Layout rows (permute, mul, scale): device forward and backward against the CPU references over
// shapes that are not multiples of the work-group size, the references' gradients against
// finite differences, bad operands rejected as build errors naming the node, and a small model
// with views, permutes of rank 2 to 4, a product and a scaling trained on the device against the
// reference executor and differentiated by finite differences through the graph.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <ostream>
#include <string>

#include "classifier.hpp"
#include "ferry/ferry.hpp"
#include "ops/attrs.hpp"
#include "ops/layout.hpp"
#include "reference_executor.hpp"
#include "runtime/trainer_internals.hpp"
#include "test_support.hpp"
#include "train_check.hpp"

namespace ferry::test {
namespace {

using Perm = std::array<std::int32_t, 4>;

std::vector<float> permute_ref(const std::vector<float>& x, const graph::Shape& s, const Perm& p) {
  std::vector<float> y(x.size());
  ops::ref::permute<float>(x, y, s, p);
  return y;
}

// ---- permute on the device -------------------------------------------------------------------

struct PermuteCase {
  graph::Shape shape;
  Perm perm;
};

void PrintTo(const PermuteCase& c, std::ostream* os) {
  *os << c.shape.str() << " perm";
  for (std::size_t k = 0; k < c.shape.rank; ++k) *os << ' ' << c.perm[k];
}

class PermuteTest : public ::testing::TestWithParam<PermuteCase> {};

TEST_P(PermuteTest, ForwardAndBackwardMatchReference) {
  const auto [shape, perm] = GetParam();
  auto& dev = TestDevice::get();
  const std::size_t n = shape.elems();
  const graph::Shape ys = ops::permuted_shape(shape, perm);
  const Perm inv = ops::inverse_permutation(perm, shape.rank);
  const auto xv = random_vector(n, 3), dyv = random_vector(n, 4);
  DeviceTensor x(xv, 5), y(n, 9), dy(dyv, 3), dx(n, 11), back(n, 1);
  ops::run_blocking(dev.context.compute(), ops::permute(dev.env, x.span(), y.span(), shape, perm));
  // The backward rule: dy (shaped like y) permuted by the inverse.
  ops::run_blocking(dev.context.compute(), ops::permute(dev.env, dy.span(), dx.span(), ys, inv));
  ops::run_blocking(dev.context.compute(), ops::permute(dev.env, y.span(), back.span(), ys, inv));
  // A copy: bit-exact.
  EXPECT_EQ(y.download(), permute_ref(xv, shape, perm));
  EXPECT_EQ(dx.download(), permute_ref(dyv, ys, inv));
  EXPECT_EQ(back.download(), xv) << "permuting back by the inverse restores x";
  // Spot-check the reference itself on one element: y[last index] = x[...] by the definition.
  std::vector<float> yr = permute_ref(xv, shape, perm);
  std::array<std::size_t, 4> idx{};  // y's multi-index of element `at`
  const std::size_t at = n / 2 + 1 < n ? n / 2 + 1 : 0;
  for (std::size_t k = ys.rank, rest = at; k-- > 0;) {
    idx[k] = rest % ys[k];
    rest /= ys[k];
  }
  std::array<std::size_t, 4> xi{};
  for (std::size_t k = 0; k < ys.rank; ++k) xi[static_cast<std::size_t>(perm[k])] = idx[k];
  std::size_t flat = 0;
  for (std::size_t k = 0; k < shape.rank; ++k) flat = flat * shape[k] + xi[k];
  EXPECT_EQ(yr[at], xv[flat]);
}

TEST_P(PermuteTest, ReferenceBackwardMatchesFiniteDifferences) {
  const auto [shape, perm] = GetParam();
  const std::size_t n = shape.elems();
  const auto x = to_double(random_vector(n, 21)), r = to_double(random_vector(n, 22));
  const graph::Shape ys = ops::permuted_shape(shape, perm);
  auto loss = [&, shape = shape, perm = perm](const std::vector<double>& v) {
    std::vector<double> y(n);
    ops::ref::permute<double>(v, y, shape, perm);
    return weighted_sum(y, r);
  };
  std::vector<double> dx(n);
  ops::ref::permute<double>(r, dx, ys, ops::inverse_permutation(perm, shape.rank));
  expect_gradient_matches_finite_differences(loss, x, dx, "permute dx");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, PermuteTest,
    ::testing::Values(PermuteCase{{37, 65}, {1, 0}}, PermuteCase{{1, 70}, {1, 0}}, PermuteCase{{65, 37}, {0, 1}},
                      PermuteCase{{5, 7, 11}, {0, 2, 1}}, PermuteCase{{5, 7, 11}, {1, 0, 2}},
                      PermuteCase{{5, 7, 11}, {1, 2, 0}}, PermuteCase{{5, 7, 11}, {2, 0, 1}},
                      PermuteCase{{5, 7, 11}, {2, 1, 0}}, PermuteCase{{3, 5, 7, 9}, {0, 2, 1, 3}},
                      PermuteCase{{3, 5, 7, 9}, {0, 2, 3, 1}}, PermuteCase{{3, 5, 7, 9}, {3, 2, 1, 0}},
                      PermuteCase{{3, 5, 7, 9}, {1, 3, 0, 2}}, PermuteCase{{2, 1, 13, 3}, {2, 0, 3, 1}},
                      // Matrices of whole 16 x 16 blocks: transposed block by block on CPU devices.
                      PermuteCase{{48, 32}, {1, 0}}, PermuteCase{{16, 80}, {1, 0}}));

// f16 and bf16 are copied bit for bit (NaN payloads included).
TEST(Permute, SixteenBitTypesAreCopiedBitForBit) {
  auto& dev = TestDevice::get();
  const graph::Shape s{3, 17, 5};
  const Perm p{2, 0, 1, 0};
  const std::size_t n = s.elems();  // odd: the packed float buffer has a spare half
  std::mt19937 rng(9);
  std::vector<std::uint16_t> bits(n);
  for (auto& b : bits) b = static_cast<std::uint16_t>(rng());
  bits[0] = 0x7e01;  // a NaN with payload
  for (ops::DType t : {ops::DType::f16, ops::DType::bf16}) {
    SCOPED_TRACE(ops::dtype_name(t));
    std::vector<float> packed((n + 1) / 2, 0.0f);
    std::memcpy(packed.data(), bits.data(), n * 2);
    DeviceTensor x(packed, 3), y(packed.size(), 5);
    ops::run_blocking(dev.context.compute(), ops::permute(dev.env, x.span(), y.span(), s, p, t));
    const auto got_packed = y.download();
    std::vector<std::uint16_t> got(n);
    std::memcpy(got.data(), got_packed.data(), n * 2);
    std::vector<std::uint16_t> want(n);
    ops::ref::permute<std::uint16_t>(bits, want, s, p);
    EXPECT_EQ(got, want);
  }
  DeviceTensor x(4), y(4);
  EXPECT_THROW(ops::permute(dev.env, x.span(), y.span(), graph::Shape{2, 2}, Perm{1, 0, 0, 0}, ops::DType::i8),
               std::invalid_argument);
}

TEST(Permute, RejectsWhatIsNotAPermutation) {
  EXPECT_EQ(ops::permutation_error(graph::Shape{2, 3}, Perm{1, 0, 7, 7}), "") << "entries past the rank are ignored";
  EXPECT_EQ(ops::permutation_error(graph::Shape{2, 3, 4, 5}, Perm{3, 1, 2, 0}), "");
  const std::string repeat = ops::permutation_error(graph::Shape{2, 3, 4}, Perm{0, 1, 1, 0});
  EXPECT_NE(repeat.find("repeats axis 1"), std::string::npos) << repeat;
  EXPECT_NE(repeat.find("[0, 1, 1]"), std::string::npos) << repeat;
  const std::string range = ops::permutation_error(graph::Shape{2, 3}, Perm{0, 2, 0, 0});
  EXPECT_NE(range.find("axis 2 is out of range [0, 2)"), std::string::npos) << range;
  const std::string negative = ops::permutation_error(graph::Shape{2, 3}, Perm{-1, 0, 0, 0});
  EXPECT_NE(negative.find("out of range"), std::string::npos) << negative;
  const std::string rank = ops::permutation_error(graph::Shape{6}, Perm{0, 0, 0, 0});
  EXPECT_NE(rank.find("rank 2 to 4"), std::string::npos) << rank;
  EXPECT_THROW(ops::permuted_shape(graph::Shape{2, 3}, Perm{0, 0, 0, 0}), std::invalid_argument);
  EXPECT_EQ(ops::permuted_shape(graph::Shape{2, 3, 4, 5}, Perm{3, 1, 0, 2}), (graph::Shape{5, 3, 2, 4}));
  EXPECT_EQ(ops::inverse_permutation(Perm{3, 1, 0, 2}, 4), (Perm{2, 1, 3, 0}));
  EXPECT_EQ(ops::inverse_permutation(Perm{1, 2, 0, 9}, 3), (Perm{2, 0, 1, 0}));
}

// ---- mul and scale on the device -------------------------------------------------------------

class ElementwiseTest : public ::testing::TestWithParam<std::size_t> {};

TEST_P(ElementwiseTest, MulForwardAndBackwardMatchReference) {
  const std::size_t n = GetParam();
  auto& dev = TestDevice::get();
  const auto av = random_vector(n, 1, -2.0f, 2.0f), bv = random_vector(n, 2, -2.0f, 2.0f), dyv = random_vector(n, 3);
  DeviceTensor a(av, 3), b(bv, 6), dy(dyv, 2), y(n, 1), da(n, 4), db(n, 8);
  ops::run_blocking(dev.context.compute(), ops::mul(dev.env, a.span(), b.span(), y.span(), n));
  ops::run_blocking(dev.context.compute(), ops::mul(dev.env, dy.span(), b.span(), da.span(), n));
  ops::run_blocking(dev.context.compute(), ops::mul(dev.env, dy.span(), a.span(), db.span(), n));
  std::vector<double> y_ref(n), da_ref(n), db_ref(n);
  ops::ref::mul<double>(to_double(av), to_double(bv), y_ref);
  ops::ref::mul<double>(to_double(dyv), to_double(bv), da_ref);
  ops::ref::mul<double>(to_double(dyv), to_double(av), db_ref);
  // One fp32 product is correctly rounded: the double product (exact) rounded to float.
  EXPECT_EQ(y.download(), to_float(y_ref));
  EXPECT_EQ(da.download(), to_float(da_ref));
  EXPECT_EQ(db.download(), to_float(db_ref));
}

TEST_P(ElementwiseTest, ScaleForwardAndBackwardMatchReference) {
  const std::size_t n = GetParam();
  auto& dev = TestDevice::get();
  const float f = -0.37f;
  const auto xv = random_vector(n, 5, -3.0f, 3.0f), dyv = random_vector(n, 6);
  DeviceTensor x(xv, 3), dy(dyv, 4), y(n, 2), dx(n, 9);
  ops::run_blocking(dev.context.compute(), ops::scale(dev.env, x.span(), y.span(), f, n));
  ops::run_blocking(dev.context.compute(), ops::scale(dev.env, dy.span(), dx.span(), f, n));
  std::vector<double> y_ref(n), dx_ref(n);
  ops::ref::scale<double>(to_double(xv), double(f), y_ref);
  ops::ref::scale<double>(to_double(dyv), double(f), dx_ref);
  EXPECT_EQ(y.download(), to_float(y_ref));
  EXPECT_EQ(dx.download(), to_float(dx_ref));
}

INSTANTIATE_TEST_SUITE_P(Sizes, ElementwiseTest, ::testing::Values(1, 63, 65, 1000, 4099));

TEST(LayoutReference, MulAndScaleBackwardMatchFiniteDifferences) {
  const std::size_t n = 37;
  const auto a = to_double(random_vector(n, 11, -2.0f, 2.0f)), b = to_double(random_vector(n, 12, -2.0f, 2.0f));
  const auto r = to_double(random_vector(n, 13));
  auto mul_loss = [&](const std::vector<double>& av, const std::vector<double>& bv) {
    std::vector<double> y(n);
    ops::ref::mul<double>(av, bv, y);
    return weighted_sum(y, r);
  };
  // The rows' backward: da = dy * b, db = dy * a (dy = r for the weighted sum).
  std::vector<double> da(n), db(n);
  ops::ref::mul<double>(r, b, da);
  ops::ref::mul<double>(r, a, db);
  expect_gradient_matches_finite_differences([&](const std::vector<double>& v) { return mul_loss(v, b); }, a, da,
                                             "mul da");
  expect_gradient_matches_finite_differences([&](const std::vector<double>& v) { return mul_loss(a, v); }, b, db,
                                             "mul db");
  // x * x: both contributions summed, as autodiff does for an input used twice.
  std::vector<double> dsq(n);
  for (std::size_t i = 0; i < n; ++i) dsq[i] = 2 * r[i] * a[i];
  expect_gradient_matches_finite_differences([&](const std::vector<double>& v) { return mul_loss(v, v); }, a, dsq,
                                             "mul x*x");
  const double f = -1.75;
  auto scale_loss = [&](const std::vector<double>& v) {
    std::vector<double> y(n);
    ops::ref::scale<double>(v, f, y);
    return weighted_sum(y, r);
  };
  std::vector<double> dx(n);
  ops::ref::scale<double>(r, f, dx);
  expect_gradient_matches_finite_differences(scale_loss, a, dx, "scale dx");
}

// ---- rows through the builder ----------------------------------------------------------------

ops::OpId op(const char* name) {
  return ops::find_op(name);
}

graph::NodeAttrs perm_attrs(Perm p) {
  graph::NodeAttrs a;
  a.i = p;
  return a;
}

graph::NodeAttrs scale_attrs(float f) {
  return ops::FactorAttrs{f}.pack();
}

// Applies `op` and expects a BuildError naming `node` and containing `what`.
void expect_build_error(graph::Builder& b, ops::OpId id, std::span<const TensorId> in, const graph::NodeAttrs& attrs,
                        const std::string& node, const std::string& what) {
  try {
    b.apply(id, in, attrs);
    ADD_FAILURE() << node << ": expected a BuildError about '" << what << "'";
  } catch (const graph::BuildError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(node + ":"), std::string::npos) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
  }
}

TEST(LayoutRows, ShapeRulesMakeOutputsAndRejectBadOperandsNamingTheNode) {
  graph::Graph g;
  ClassifierBuilder b(g, 4, graph::Shape{3, 5}, 2);  // input [4, 3, 5]
  const TensorId x = b.input();
  const TensorId xs[] = {x};
  const TensorId y = b.apply(op("permute"), xs, perm_attrs({2, 0, 1, 0}))[0];  // permute0
  EXPECT_EQ(g.tensors.shape[y], (graph::Shape{5, 4, 3}));
  EXPECT_EQ(g.tensors.name[y], "permute0.y");
  const TensorId xx[] = {x, x};
  EXPECT_EQ(g.tensors.shape[b.apply(op("mul"), xx)[0]], (graph::Shape{4, 3, 5}));               // mul1
  EXPECT_EQ(g.tensors.shape[b.apply(op("scale"), xs, scale_attrs(2))[0]], g.tensors.shape[x]);  // scale2

  expect_build_error(b, op("permute"), xs, perm_attrs({0, 1, 1, 0}), "permute3", "repeats axis 1");
  expect_build_error(b, op("permute"), xs, perm_attrs({0, 3, 1, 0}), "permute4", "out of range");
  expect_build_error(b, op("permute"), xs, {}, "permute5", "repeats axis 0");  // attrs forgotten
  const TensorId flat = g.tensors.add("v", graph::Shape{60}, graph::DType::f32, graph::Role::activation);
  const TensorId fl[] = {flat};
  expect_build_error(b, op("permute"), fl, perm_attrs({0, 0, 0, 0}), "permute6", "rank 2 to 4");
  expect_build_error(b, op("permute"), xx, perm_attrs({2, 0, 1, 0}), "permute7", "takes 1 input");
  const TensorId xy[] = {x, y};
  expect_build_error(b, op("mul"), xy, {}, "mul8", "same shape, got [4, 3, 5] and [5, 4, 3]");
  expect_build_error(b, op("mul"), xs, {}, "mul9", "takes 2 input");
  expect_build_error(b, op("scale"), xs, scale_attrs(std::numeric_limits<float>::quiet_NaN()), "scale10",
                     "must be finite");
  expect_build_error(b, op("scale"), xx, scale_attrs(1), "scale11", "takes 1 input");
}

// ---- a model through the graph ---------------------------------------------------------------

// x [B, 12] -> h = linear(x, 24), viewed as [B, 2, 3, 4] and as [B, 4, 6] (views, like a reshape
// would make), permuted (0 3 1 2) and (0 2 1), flattened, multiplied, scaled, permuted [24, B] and
// back, -> linear(., 4) -> loss. h feeds both views, so its gradient is a sum.
graph::Graph layout_model(std::uint32_t batch) {
  graph::Graph g;
  ClassifierBuilder b(g, batch, graph::Shape{12}, 4);
  const TensorId h = b.linear(b.input(), 24);
  auto view = [&](TensorId t, graph::Shape s) {
    return g.tensors.add(g.tensors.name[t] + ".view", s, g.tensors.dtype[t], g.tensors.role[t], t);
  };
  auto permute = [&](TensorId t, Perm p) {
    const TensorId in[] = {t};
    return b.apply(op("permute"), in, perm_attrs(p))[0];
  };
  const TensorId p4 = b.flatten(permute(view(h, {batch, 2, 3, 4}), {0, 3, 1, 2}));
  // (Viewed as [B, 6, 4] and transposed, h would give the same order as p4: [B, 4, 6] does not.)
  const TensorId p3 = b.flatten(permute(view(h, {batch, 4, 6}), {0, 2, 1, 0}));
  const TensorId mi[] = {p4, p3};
  const TensorId m = b.apply(op("mul"), mi)[0];
  const TensorId si[] = {m};
  const TensorId s = b.apply(op("scale"), si, scale_attrs(0.5f))[0];
  const TensorId t = permute(permute(s, {1, 0, 0, 0}), {1, 0, 0, 0});
  b.softmax_xent(b.linear(t, 4));
  return g;
}

ops::OptimizerConfig plain_sgd() {
  ops::OptimizerConfig opt;
  opt.kind = ops::OptimizerConfig::Kind::sgd;
  opt.sgd.momentum = 0;
  return opt;
}

TEST(LayoutRows, BackwardNodesReuseTheRows) {
  graph::Graph g = graph::prepare_step_graph(layout_model(3), graph::VariantKey{3, true}, plain_sgd());
  std::map<std::string, int> count;
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    const std::string& name = g.nodes.name[n];
    const std::string op_name = ops::op_info(g.nodes.op[n]).name;
    if (op_name == "permute" || op_name == "mul" || op_name == "scale") {
      ++count[op_name + (name.find(".grad") != std::string::npos ? " grad" : "")];
    }
  }
  EXPECT_EQ(count["permute"], 4);
  EXPECT_EQ(count["permute grad"], 4);
  EXPECT_EQ(count["mul"], 1);
  EXPECT_EQ(count["mul grad"], 2) << "da and db";
  EXPECT_EQ(count["scale"], 1);
  EXPECT_EQ(count["scale grad"], 1);
}

TEST(LayoutRows, BackwardThroughTheGraphMatchesFiniteDifferences) {
  const ops::OptimizerConfig opt = plain_sgd();
  graph::Graph g = graph::prepare_step_graph(layout_model(3), graph::VariantKey{3, true}, opt);
  ReferenceExecutor ref(g, opt);
  const auto& t = g.tensors;
  randomize_weights(ref, g, 5);
  ref.value(ref.find("input")) = to_double(random_vector(36, 77, -2.0f, 2.0f));
  ref.ints(ref.find("labels")) = {0, 3, 1};
  ref.run(ops::StepInfo{1, 0.0f});
  std::size_t checked = 0;
  for (TensorId w = 0; w < t.size(); ++w) {
    if (t.role[w] != graph::Role::weight) continue;
    ASSERT_NE(t.grad[w], graph::no_tensor) << t.name[w];
    expect_reference_gradient_matches_finite_differences(ref, w, t.grad[w], t.name[w], 24);
    ++checked;
  }
  EXPECT_EQ(checked, 4u);
}

TEST(LayoutRows, ModelTrainsOnTheDeviceLikeTheReference) {
  auto& dev = TestDevice::get();
  const ops::OptimizerConfig opt = plain_sgd();
  const std::uint32_t batch = 7;
  graph::Graph g = graph::prepare_step_graph(layout_model(batch), graph::VariantKey{batch, true}, opt);
  graph::CompiledStep step(g, opt, dev.env, dev.context);
  ReferenceExecutor ref(g, opt);
  const auto& t = step.graph().tensors;
  std::vector<TensorId> weights;
  std::uint32_t seed = 31;
  for (TensorId id = 0; id < g.tensors.size(); ++id) {
    if (g.tensors.role[id] != graph::Role::weight) continue;
    weights.push_back(id);
    const auto v = random_vector(t.shape[id].elems(), seed++, -0.5f, 0.5f);
    step.persistent()->write(t.home[id], t.placement[id], v.data(), t.bytes(id));
    ref.value(id) = to_double(v);
  }
  ASSERT_EQ(weights.size(), 4u);
  const float lr = 0.1f;
  for (std::uint32_t s = 0; s < 4; ++s) {
    const auto images = random_vector(batch * 12, 40 + s, -2.0f, 2.0f);
    std::vector<std::int32_t> labels(batch);
    for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>((i * 3 + s) % 4);
    std::copy(images.begin(), images.end(), step.host_input_as<float>("input").begin());
    std::copy(labels.begin(), labels.end(), step.host_input_as<std::int32_t>("labels").begin());
    step.run(ops::StepInfo{s + 1, lr});
    ref.value(ref.find("input")) = to_double(images);
    ref.ints(ref.find("labels")) = labels;
    ref.run(ops::StepInfo{s + 1, lr});
    EXPECT_NEAR(step.stats_host()[0], ref.loss(), 1e-5 * std::max(1.0, std::abs(ref.loss()))) << "step " << s;
  }
  double moved = 0;
  for (std::size_t k = 0; k < weights.size(); ++k) {
    const TensorId id = weights[k];
    std::vector<float> w(t.shape[id].elems());
    step.persistent()->read(t.home[id], t.placement[id], w.data(), t.bytes(id));
    const auto& host = ref.value(id);
    for (std::size_t i = 0; i < w.size(); ++i) {
      ASSERT_NEAR(w[i], host[i], 1e-5) << t.name[id] << "[" << i << "]";
    }
    const auto v0 = random_vector(t.shape[id].elems(), 31 + static_cast<std::uint32_t>(k), -0.5f, 0.5f);
    for (std::size_t i = 0; i < w.size(); ++i) moved = std::max(moved, double(std::abs(w[i] - v0[i])));
  }
  EXPECT_GT(moved, 1e-4) << "training changed the weights";
}

}  // namespace
}  // namespace ferry::test
