// add_bias (a bias broadcast over the leading axes) and the mse loss: device launches against the
// CPU references over shapes that are not multiples of the work-group size (and, for the MSE
// reduction, forced work-group sizes), determinism, non-finite losses, the references' gradients
// against finite differences, the shape rules' errors naming the node, the backward rules through
// autodiff on hand-built graphs, and the rows bound on the device against the reference executor.
//
// Graphs are built with TensorTable::add and NodeTable::add (outputs from the rows' shape rules),
// not with graph::Builder, so these tests do not depend on the builder's API.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <ostream>
#include <string>

#include "ferry/ops/op_table.hpp"
#include "graph/autodiff.hpp"
#include "graph/bind.hpp"
#include "ops/add_bias.hpp"
#include "ops/mse.hpp"
#include "reference_executor.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

using graph::Role;
using graph::TensorId;

// ----- add_bias at the op level -----

struct AddBiasCase {
  graph::Shape x, b;
};

void PrintTo(const AddBiasCase& c, std::ostream* os) {
  *os << "x " << c.x.str() << " b " << c.b.str();
}

class AddBiasTest : public ::testing::TestWithParam<AddBiasCase> {};

TEST_P(AddBiasTest, ForwardAndBackwardMatchReference) {
  const auto [xs, bs] = GetParam();
  ASSERT_EQ(ops::add_bias_error(xs, bs), "");
  auto& dev = TestDevice::get();
  const std::size_t cols = bs.elems(), rows = xs.elems() / cols, n = xs.elems();
  const auto x = random_vector(n, 1), b = random_vector(cols, 2), dy = random_vector(n, 3);
  DeviceTensor d_x(x, 3), d_b(b, 5), y(n, 9), d_dy(dy, 2), db(cols, 11);
  ops::run_blocking(dev.context.compute(),
                    ops::add_bias_forward(dev.env, d_x.span(), d_b.span(), y.span(), rows, cols));
  // One rounding per element, as in the float reference: the same bits.
  std::vector<float> y_ref(n);
  ops::ref::add_bias_forward<float>(x, b, y_ref, rows, cols);
  EXPECT_TRUE(same_bits(y.download(), y_ref));
  // In place (y = x) gives the same.
  ops::run_blocking(dev.context.compute(),
                    ops::add_bias_forward(dev.env, d_x.span(), d_b.span(), d_x.span(), rows, cols));
  EXPECT_TRUE(same_bits(d_x.download(), y_ref));

  const ops::LaunchList backward = ops::add_bias_backward(dev.env, d_dy.span(), db.span(), rows, cols);
  ops::run_blocking(dev.context.compute(), backward);
  std::vector<double> db_ref(cols);
  ops::ref::add_bias_backward<double>(to_double(dy), db_ref, rows, cols);
  // Float sums in another order than the double reference: the error grows like sqrt(rows).
  const auto got = db.download();
  expect_near(got, to_float(db_ref), 1e-5f * float(std::sqrt(double(rows)) + 1), 1e-5f, "db");
  ops::run_blocking(dev.context.compute(), backward);
  EXPECT_TRUE(same_bits(db.download(), got)) << "the column sum is deterministic";
}

TEST_P(AddBiasTest, ReferenceGradientsMatchFiniteDifferences) {
  const auto [xs, bs] = GetParam();
  const std::size_t cols = bs.elems(), rows = xs.elems() / cols, n = xs.elems();
  const auto x = to_double(random_vector(n, 4)), b = to_double(random_vector(cols, 5));
  const auto r = to_double(random_vector(n, 6));
  auto loss = [&](const std::vector<double>& xv, const std::vector<double>& bv) {
    std::vector<double> y(n);
    ops::ref::add_bias_forward<double>(xv, bv, y, rows, cols);
    return weighted_sum(y, r);
  };
  std::vector<double> db(cols);
  ops::ref::add_bias_backward<double>(r, db, rows, cols);
  expect_gradient_matches_finite_differences([&](const std::vector<double>& bv) { return loss(x, bv); }, b, db, "db");
  // dx = dy: the row contributes the output's gradient to x unchanged.
  expect_gradient_matches_finite_differences([&](const std::vector<double>& xv) { return loss(xv, b); }, x, r, "dx");
}

INSTANTIATE_TEST_SUITE_P(Shapes, AddBiasTest,
                         ::testing::Values(AddBiasCase{{1}, {1}}, AddBiasCase{{37, 13}, {13}},
                                           AddBiasCase{{3, 5, 7}, {5, 7}}, AddBiasCase{{2, 3, 5, 7}, {7}},
                                           AddBiasCase{{2, 3, 5, 7}, {3, 5, 7}}, AddBiasCase{{5, 1, 65}, {1, 65}},
                                           AddBiasCase{{4, 33, 65}, {4, 33, 65}}, AddBiasCase{{1000, 3}, {3}},
                                           AddBiasCase{{257, 70}, {70}}));

TEST(AddBias, ErrorsNameBothShapes) {
  EXPECT_EQ(ops::add_bias_error(graph::Shape{2, 3, 4}, graph::Shape{3, 4}), "");
  EXPECT_EQ(ops::add_bias_error(graph::Shape{2, 3, 4}, graph::Shape{2, 3, 4}), "");
  const std::string trailing = ops::add_bias_error(graph::Shape{2, 3, 4}, graph::Shape{2, 3});
  EXPECT_NE(trailing.find("[2, 3]"), std::string::npos) << trailing;
  EXPECT_NE(trailing.find("[2, 3, 4]"), std::string::npos) << trailing;
  EXPECT_NE(trailing.find("trailing dims"), std::string::npos) << trailing;
  const std::string rank = ops::add_bias_error(graph::Shape{3, 4}, graph::Shape{1, 3, 4});
  EXPECT_NE(rank.find("rank 1 to 2"), std::string::npos) << rank;
  EXPECT_NE(ops::add_bias_error(graph::Shape{3, 4}, graph::Shape{}).find("rank 1 to 2"), std::string::npos);
}

// ----- mse at the op level -----

struct MseRun {
  float loss;
  std::vector<float> dp;
};

MseRun run_mse(const std::vector<float>& p, const std::vector<float>& t) {
  auto& dev = TestDevice::get();
  const std::size_t n = p.size();
  DeviceTensor d_p(p, 3), d_t(t, 6), stats(1, 1), dp(n, 9);
  ops::run_blocking(dev.context.compute(), ops::mse_forward(dev.env, d_p.span(), d_t.span(), stats.span(), n));
  ops::run_blocking(dev.context.compute(), ops::mse_backward(dev.env, d_p.span(), d_t.span(), dp.span(), n));
  return {stats.download()[0], dp.download()};
}

// (elements, forced work-group size of the reduction; 0: the device's choice)
class MseTest : public ::testing::TestWithParam<std::tuple<std::size_t, std::size_t>> {};

TEST_P(MseTest, ForwardAndBackwardMatchReference) {
  auto [n, group] = GetParam();
  const ScopedRowGroupSize forced(group);
  const auto p = random_vector(n, 11), t = random_vector(n, 12);
  const MseRun got = run_mse(p, t);
  std::vector<double> stats(1), dp(n);
  ops::ref::mse_forward<double>(to_double(p), to_double(t), stats);
  ops::ref::mse_backward<double>(to_double(p), to_double(t), dp);
  EXPECT_GT(stats[0], 0.0);
  // A float sum of n positive terms: the relative error grows like sqrt(n).
  expect_near({got.loss}, {float(stats[0])}, 0.0f, 2e-7f * float(std::sqrt(double(n)) + 1), "loss");
  expect_near(got.dp, to_float(dp), 1e-12f, 1e-6f, "dp");
  // Deterministic: the same bits again.
  for (int run = 0; run < 2; ++run) {
    const MseRun again = run_mse(p, t);
    EXPECT_TRUE(same_bits({got.loss}, {again.loss})) << "run " << run;
    EXPECT_TRUE(same_bits(got.dp, again.dp)) << "run " << run;
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, MseTest,
                         ::testing::Values(std::make_tuple(1, 0), std::make_tuple(7, 0), std::make_tuple(63, 1),
                                           std::make_tuple(65, 64), std::make_tuple(1000, 0), std::make_tuple(4099, 16),
                                           std::make_tuple(100003, 0), std::make_tuple(100003, 256),
                                           std::make_tuple(3, 256)));

TEST(Mse, ZeroWhenPredictionIsTheTarget) {
  const auto p = random_vector(517, 13);
  const MseRun got = run_mse(p, p);
  EXPECT_EQ(got.loss, 0.0f);
  EXPECT_TRUE(same_bits(got.dp, std::vector<float>(p.size(), 0.0f)));
}

TEST(Mse, NonFiniteValuesMakeTheLossNonFinite) {
  const float inf = std::numeric_limits<float>::infinity();
  for (std::size_t group : {0, 64}) {
    SCOPED_TRACE("group " + std::to_string(group));
    const ScopedRowGroupSize forced(group);
    auto p = random_vector(301, 14), t = random_vector(301, 15);
    p[200] = inf;
    EXPECT_EQ(run_mse(p, t).loss, inf);
    p[200] = 0.5f;
    t[7] = -inf;
    EXPECT_EQ(run_mse(p, t).loss, inf);
    t[7] = 0.5f;
    p[300] = std::nanf("");
    EXPECT_TRUE(std::isnan(run_mse(p, t).loss));
    // Finite but large values overflow the float sum: inf too, as the trainer's check wants.
    std::vector<float> big(10, 3e19f), zero(10, 0.0f);
    EXPECT_EQ(run_mse(big, zero).loss, inf);
  }
}

TEST(Mse, RejectsNoElements) {
  auto& dev = TestDevice::get();
  DeviceTensor a(1), b(1), c(1);
  EXPECT_THROW(ops::mse_forward(dev.env, a.span(), b.span(), c.span(), 0), std::invalid_argument);
  EXPECT_THROW(ops::mse_backward(dev.env, a.span(), b.span(), c.span(), 0), std::invalid_argument);
}

TEST(Mse, ReferenceGradientMatchesFiniteDifferences) {
  for (std::size_t n : {1, 7, 130}) {
    SCOPED_TRACE("n " + std::to_string(n));
    const auto p = to_double(random_vector(n, 16)), t = to_double(random_vector(n, 17));
    auto loss = [&](const std::vector<double>& pv) {
      std::vector<double> stats(1);
      ops::ref::mse_forward<double>(pv, t, stats);
      return stats[0];
    };
    std::vector<double> dp(n);
    ops::ref::mse_backward<double>(p, t, dp);
    expect_gradient_matches_finite_differences(loss, p, dp, "dp", 1e-6, 1e-7, 200);
    // The target's gradient, which the row does not compute, would be -dp.
    auto loss_t = [&](const std::vector<double>& tv) {
      std::vector<double> stats(1);
      ops::ref::mse_forward<double>(p, tv, stats);
      return stats[0];
    };
    std::vector<double> minus_dp(n);
    for (std::size_t i = 0; i < n; ++i) minus_dp[i] = -dp[i];
    expect_gradient_matches_finite_differences(loss_t, t, minus_dp, "dt", 1e-6, 1e-7, 200);
  }
}

// ----- the rows, on hand-built graphs -----

// A node's operands before it has outputs: what a shape rule sees.
class PendingNode final : public ops::ShapeView {
 public:
  PendingNode(const graph::Graph& g, const std::string& name, std::span<const TensorId> in)
      : g_(g), name_(name), in_(in) {}
  std::string_view name() const override { return name_; }
  const graph::NodeAttrs& attrs() const override { return attrs_; }
  std::size_t input_count() const override { return in_.size(); }
  std::size_t output_count() const override { return 0; }
  ops::TensorDesc input(std::size_t i) const override { return {g_.tensors.shape[in_[i]], g_.tensors.dtype[in_[i]]}; }
  ops::TensorDesc output(std::size_t) const override { throw std::logic_error("a pending node has no outputs"); }

 private:
  const graph::Graph& g_;
  const std::string& name_;
  std::span<const TensorId> in_;
  graph::NodeAttrs attrs_;
};

// Adds a node of row `op` named `name`, its outputs (of role `role`) made by the row's shape rule.
std::vector<TensorId> apply(graph::Graph& g, const char* op, const std::string& name, std::vector<TensorId> in,
                            Role role = Role::activation) {
  const ops::OpId id = ops::find_op(op);
  const auto descs = ops::op_info(id).infer(PendingNode(g, name, in));
  std::vector<TensorId> out;
  for (std::size_t k = 0; k < descs.size(); ++k)
    out.push_back(g.tensors.add(name + ".out" + std::to_string(k), descs[k].shape, descs[k].dtype, role));
  g.nodes.add(id, name, in, out);
  return out;
}

void expect_shape_error(graph::Graph& g, const char* op, const std::string& node, std::vector<TensorId> in,
                        std::vector<std::string> words) {
  try {
    apply(g, op, node, std::move(in));
    ADD_FAILURE() << "no ShapeError for " << node;
  } catch (const ops::ShapeError& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind(node + ": ", 0), 0u) << what;
    for (const auto& w : words) EXPECT_NE(what.find(w), std::string::npos) << "missing '" << w << "' in: " << what;
  }
}

TEST(LossBroadcastRows, ShapeRulesMakeOutputsAndRejectBadOperandsNamingTheNode) {
  graph::Graph g;
  auto& t = g.tensors;
  const TensorId x = t.add("x", graph::Shape{2, 3, 4}, graph::DType::f32, Role::activation);
  const TensorId pos = t.add("pos", graph::Shape{3, 4}, graph::DType::f32, Role::weight);
  const TensorId row = t.add("row", graph::Shape{4}, graph::DType::f32, Role::weight);
  const TensorId lead = t.add("lead", graph::Shape{2, 3}, graph::DType::f32, Role::weight);
  const TensorId big = t.add("big", graph::Shape{1, 2, 3, 4}, graph::DType::f32, Role::weight);
  const TensorId half = t.add("half", graph::Shape{3, 4}, graph::DType::f16, Role::weight);
  const TensorId target = t.add("target", graph::Shape{2, 3, 4}, graph::DType::f32, Role::input);
  const TensorId flat = t.add("flat", graph::Shape{24}, graph::DType::f32, Role::input);
  const TensorId ids = t.add("ids", graph::Shape{2, 3, 4}, graph::DType::i32, Role::input);

  EXPECT_EQ(t.shape[apply(g, "add_bias", "pos_embed", {x, pos})[0]], (graph::Shape{2, 3, 4}));
  EXPECT_EQ(t.shape[apply(g, "add_bias", "bias", {x, row})[0]], (graph::Shape{2, 3, 4}));
  const auto stats = apply(g, "mse", "loss", {x, target});
  ASSERT_EQ(stats.size(), 1u);
  EXPECT_EQ(t.shape[stats[0]], (graph::Shape{1}));
  EXPECT_EQ(t.dtype[stats[0]], graph::DType::f32);

  expect_shape_error(g, "add_bias", "bias_lead", {x, lead}, {"[2, 3]", "[2, 3, 4]", "trailing dims"});
  expect_shape_error(g, "add_bias", "bias_rank", {x, big}, {"[1, 2, 3, 4]", "[2, 3, 4]", "rank 1 to 3"});
  expect_shape_error(g, "add_bias", "bias_f16", {x, half}, {"f32", "f16"});
  expect_shape_error(g, "add_bias", "bias_one", {x}, {"2 inputs", "got 1"});
  expect_shape_error(g, "mse", "mse_flat", {x, flat}, {"[2, 3, 4]", "[24]", "same shape"});
  expect_shape_error(g, "mse", "mse_ids", {x, ids}, {"f32", "i32"});
  expect_shape_error(g, "mse", "mse_three", {x, target, target}, {"2 inputs", "got 3"});
}

TEST(LossBroadcastRows, RowsAreNamedAndComplete) {
  const ops::OpInfo& add_bias = ops::op_info(ops::builtin::add_bias);
  EXPECT_EQ(add_bias.op_class, ops::OpClass::forward);
  const ops::OpInfo& mse = ops::op_info(ops::builtin::mse);
  EXPECT_EQ(mse.op_class, ops::OpClass::loss);
  for (const ops::OpInfo* row : {&add_bias, &mse}) {
    EXPECT_TRUE(row->infer && row->bind && row->backward && row->reference) << row->name;
    const ops::OpInfo& grad = ops::op_info(ops::find_op(row->name + "_grad"));
    EXPECT_EQ(grad.op_class, ops::OpClass::backward) << row->name;
    EXPECT_TRUE(grad.bind && grad.reference) << row->name;
  }
}

// h [B, T, W] (a weight, so its gradient is visible) + pos [T, W], then the MSE against a target.
struct PosModel {
  static constexpr std::uint32_t batch = 3, t = 5, w = 7;
  graph::Graph g;
  TensorId h = graph::no_tensor, pos = graph::no_tensor, y = graph::no_tensor, target = graph::no_tensor;
};

PosModel pos_model(Role pos_role = Role::weight, Role target_role = Role::input) {
  PosModel m;
  auto& t = m.g.tensors;
  m.h = t.add("h", graph::Shape{PosModel::batch, PosModel::t, PosModel::w}, graph::DType::f32, Role::weight);
  m.pos = t.add("pos", graph::Shape{PosModel::t, PosModel::w}, graph::DType::f32, pos_role);
  m.target = t.add("target", graph::Shape{PosModel::batch, PosModel::t, PosModel::w}, graph::DType::f32, target_role);
  m.y = apply(m.g, "add_bias", "pos_embed", {m.h, m.pos})[0];
  m.g.loss = apply(m.g, "mse", "loss", {m.y, m.target}, Role::stats)[0];
  return m;
}

std::map<std::string, std::string> node_ops(const graph::Graph& g) {
  std::map<std::string, std::string> ops;
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) ops[g.nodes.name[n]] = ops::op_info(g.nodes.op[n]).name;
  return ops;
}

TEST(LossBroadcastRows, BackwardEmitsOneNodePerGradientAndPassesDyToX) {
  PosModel m = pos_model();
  graph::append_backward(m.g);
  const auto& t = m.g.tensors;
  EXPECT_EQ(node_ops(m.g), (std::map<std::string, std::string>{{"pos_embed", "add_bias"},
                                                               {"loss", "mse"},
                                                               {"loss.grad", "mse_grad"},
                                                               {"pos_embed.grad_bias", "add_bias_grad"}}));
  ASSERT_NE(t.grad[m.y], graph::no_tensor);
  EXPECT_EQ(t.grad[m.h], t.grad[m.y]) << "dx is dy itself, no copy";
  ASSERT_NE(t.grad[m.pos], graph::no_tensor);
  EXPECT_EQ(t.shape[t.grad[m.pos]], t.shape[m.pos]);
  EXPECT_EQ(t.grad[m.target], graph::no_tensor);

  // A bias that needs no gradient gets no node.
  PosModel fixed = pos_model(Role::input);
  graph::append_backward(fixed.g);
  EXPECT_EQ(node_ops(fixed.g).count("pos_embed.grad_bias"), 0u);
  EXPECT_EQ(fixed.g.tensors.grad[fixed.h], fixed.g.tensors.grad[fixed.y]);
}

TEST(LossBroadcastRows, MseRefusesToDifferentiateItsTargetOrAsAnInnerOp) {
  PosModel m = pos_model(Role::weight, Role::weight);
  try {
    graph::append_backward(m.g);
    ADD_FAILURE() << "a target that needs a gradient was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("loss: "), std::string::npos) << what;
    EXPECT_NE(what.find("does not differentiate its target"), std::string::npos) << what;
  }
  // The MSE's stats fed to another loss: the inner one is not the step's loss but gets a gradient.
  PosModel inner = pos_model();
  auto& t = inner.g.tensors;
  const TensorId zero = t.add("zero", graph::Shape{1}, graph::DType::f32, Role::input);
  inner.g.loss = apply(inner.g, "mse", "outer", {inner.g.loss, zero}, Role::stats)[0];
  try {
    graph::append_backward(inner.g);
    ADD_FAILURE() << "an mse that is not the loss was differentiated";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("loss: "), std::string::npos) << what;
    EXPECT_NE(what.find("only as the step's loss"), std::string::npos) << what;
  }
}

void randomize(ReferenceExecutor& ref, const graph::Graph& g, std::initializer_list<TensorId> ids) {
  std::uint32_t seed = 40;
  for (TensorId id : ids) ref.value(id) = to_double(random_vector(g.tensors.shape[id].elems(), seed++));
}

TEST(LossBroadcastRows, GradientsThroughTheGraphMatchFiniteDifferences) {
  PosModel m = pos_model();
  graph::append_backward(m.g);
  ReferenceExecutor ref(m.g, ops::OptimizerConfig{});
  randomize(ref, m.g, {m.h, m.pos, m.target});
  ref.run({1, 0.0f});
  for (TensorId id : {m.h, m.pos}) {
    const TensorId grad = m.g.tensors.grad[id];
    const std::vector<double> g = ref.value(grad), x = ref.value(id);
    auto loss = [&](const std::vector<double>& v) {
      ref.value(id) = v;
      ref.run({1, 0.0f}, /*forward_only=*/true);
      return ref.loss();
    };
    expect_gradient_matches_finite_differences(loss, x, g, m.g.tensors.name[id].c_str(), 1e-6, 1e-6, 200);
    ref.value(id) = x;
  }
}

TEST(LossBroadcastRows, BoundOnTheDeviceLikeTheReferenceExecutor) {
  PosModel m = pos_model();
  graph::append_backward(m.g);
  const graph::Graph& g = m.g;
  ReferenceExecutor ref(g, ops::OptimizerConfig{});
  randomize(ref, g, {m.h, m.pos, m.target});
  ref.run({1, 0.0f});

  // Every tensor in its own buffer (at an odd offset), the inputs as the reference has them.
  auto& dev = TestDevice::get();
  std::vector<std::unique_ptr<DeviceTensor>> at(g.tensors.size());
  for (TensorId id = 0; id < g.tensors.size(); ++id) {
    at[id] = std::make_unique<DeviceTensor>(g.tensors.shape[id].elems(), 3 + id % 5);
    if (id == m.h || id == m.pos || id == m.target) at[id]->upload(to_float(ref.value(id)));
  }
  graph::TensorLocator locate;
  locate.device = [&](TensorId id) { return at[id]->span(); };
  locate.host = [](TensorId, bool) -> ops::HostAddress { throw std::logic_error("no host tensors here"); };
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    ops::run_blocking(dev.context.compute(), graph::bind_node(g, n, locate, dev.env, ops::OptimizerConfig{}));
  }
  for (TensorId id : {m.y, g.loss, g.tensors.grad[m.y], g.tensors.grad[m.pos]}) {
    SCOPED_TRACE(g.tensors.name[id]);
    expect_near(at[id]->download(), to_float(ref.value(id)), 1e-6f, 1e-5f, g.tensors.name[id].c_str());
  }
}

}  // namespace
}  // namespace ferry::test
