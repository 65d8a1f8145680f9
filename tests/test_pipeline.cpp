// The compile pipeline: its model passes in order, each on its own, and the device passes a
// compiled step reports.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "classifier.hpp"
#include "ferry/ferry.hpp"
#include "graph/pipeline.hpp"
#include "graph/residency_passes.hpp"
#include "ops/attrs.hpp"
#include "runtime/trainer_internals.hpp"
#include "test_models.hpp"

namespace ferry::test {
namespace {

graph::Graph mlp_forward(std::uint32_t batch) {
  return forward_graph(models::mlp({32}), graph::VariantKey{batch, true});
}

std::size_t count_class(const graph::Graph& g, ops::OpClass c) {
  std::size_t n = 0;
  for (graph::NodeId id = 0; id < g.nodes.size(); ++id) n += ops::op_info(g.nodes.op[id]).op_class == c;
  return n;
}

std::size_t count_op(const graph::Graph& g, graph::OpId op) {
  std::size_t n = 0;
  for (graph::NodeId id = 0; id < g.nodes.size(); ++id) n += g.nodes.op[id] == op;
  return n;
}

TEST(Pipeline, ModelPassesInOrder) {
  const auto& passes = graph::model_passes();
  const char* const names[] = {"fusion",      "mixed precision", "autodiff",     "backward fusion", "narrowing fusion",
                               "recompute",   "overflow guard",  "accumulate",   "data parallel",   "optimizer",
                               "zero gather", "predictor",       "int8 weights", "download",        "guard fusion"};
  ASSERT_EQ(passes.size(), std::size(names));
  for (std::size_t i = 0; i < passes.size(); ++i) EXPECT_STREQ(passes[i].name, names[i]) << "pass " << i;
}

TEST(Pipeline, EachModelPassAlone) {
  const graph::VariantKey train{16, true};
  ops::OptimizerConfig adam;
  graph::Graph g = mlp_forward(16);
  const std::size_t forward_nodes = g.nodes.size();
  ASSERT_EQ(count_class(g, ops::OpClass::backward), 0u);

  const auto pass = [&](const char* name) {
    for (const auto& p : graph::model_passes()) {
      if (std::string_view(p.name) == name) return p.run;
    }
    throw std::logic_error(std::string("no pass ") + name);
  };
  std::size_t before = g.nodes.size();
  pass("fusion")(g, train, adam);  // the hidden layer's ReLU into its Linear's epilogue
  EXPECT_EQ(g.nodes.size(), before - 1);
  EXPECT_EQ(count_op(g, graph::builtin::activation), 0u);
  before = g.nodes.size();
  pass("mixed precision")(g, train, adam);  // nothing without a narrow precision
  EXPECT_EQ(g.nodes.size(), before);

  pass("autodiff")(g, train, adam);
  EXPECT_GT(count_class(g, ops::OpClass::backward), 0u);
  EXPECT_EQ(count_class(g, ops::OpClass::update), 0u);
  for (TensorId w = 0; w < g.tensors.size(); ++w) {
    if (g.tensors.role[w] == graph::Role::weight) {
      EXPECT_NE(g.tensors.grad[w], graph::no_tensor) << g.tensors.name[w];
    }
  }

  before = g.nodes.size();
  pass("backward fusion")(g, train, adam);  // the ReLU's mask into the head's input gradient
  EXPECT_EQ(g.nodes.size(), before - 1);
  EXPECT_EQ(count_op(g, graph::builtin::activation_grad), 0u);

  before = g.nodes.size();
  pass("recompute")(g, train, adam);  // nothing unless asked
  EXPECT_EQ(g.nodes.size(), before);

  // The guard of every training variant: an init after the loss and a check of each weight
  // gradient, in the order the gradients are made.
  pass("overflow guard")(g, train, adam);
  ASSERT_NE(g.guard, graph::no_tensor);
  ASSERT_EQ(g.nodes.size(), before + 5);
  EXPECT_EQ(g.nodes.op[before], ops::builtin::overflow_guard_init);
  std::vector<graph::NodeId> made_at;  // per check, the node that made its gradient
  for (graph::NodeId n = before + 1; n < g.nodes.size(); ++n) {
    EXPECT_EQ(g.nodes.op[n], ops::builtin::overflow_guard_check);
    const TensorId grad = g.nodes.inputs(n)[1];
    EXPECT_EQ(g.tensors.role[grad], graph::Role::gradient);
    for (graph::NodeId m = 0; m < before; ++m) {
      for (TensorId x : g.nodes.outputs(m)) {
        if (x == grad) made_at.push_back(m);
      }
    }
  }
  EXPECT_TRUE(std::is_sorted(made_at.begin(), made_at.end()));
  EXPECT_EQ(g.update_guard(), g.guard);

  before = g.nodes.size();
  pass("accumulate")(g, train, adam);  // nothing without accumulation
  EXPECT_EQ(g.nodes.size(), before);

  pass("optimizer")(g, train, adam);  // one Adam update per weight
  EXPECT_EQ(count_class(g, ops::OpClass::update), 4u);
  std::size_t state = 0;
  for (TensorId t = 0; t < g.tensors.size(); ++t) state += g.tensors.role[t] == graph::Role::optimizer_state;
  EXPECT_EQ(state, 8u);

  before = g.nodes.size();
  pass("predictor")(g, train, adam);  // nothing unless the key asks for it
  EXPECT_EQ(g.nodes.size(), before);

  before = g.nodes.size();
  pass("int8 weights")(g, train, adam);  // nothing in a training variant
  EXPECT_EQ(g.nodes.size(), before);
  pass("download")(g, train, adam);  // one node per statistics tensor (loss, guard), into a host mirror
  ASSERT_EQ(g.nodes.size(), before + 2);
  for (graph::NodeId n = static_cast<graph::NodeId>(before); n < g.nodes.size(); ++n) {
    EXPECT_EQ(g.nodes.op[n], graph::builtin::download);
    EXPECT_NE(g.tensors.home[g.nodes.outputs(n)[0]], graph::Home::device);
  }

  // The checks of the two Linears' weight and bias gradients go into the nodes that make them
  // (their rows check their outputs) through a flag, their last input and output, which an init
  // sets to the loss before the first of them; the guard's init, where it was, copies the flag.
  before = g.nodes.size();
  graph::Graph unfused = g;
  graph::VariantKey no_fuse = train;
  no_fuse.fuse = false;
  pass("guard fusion")(unfused, no_fuse, adam);  // off with the fusions
  EXPECT_EQ(unfused.nodes.size(), before);
  const graph::NodeId guard_init_before = [&] {
    for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
      if (g.nodes.op[n] == ops::builtin::overflow_guard_init) return n;
    }
    return graph::NodeId{0};
  }();
  pass("guard fusion")(g, train, adam);
  EXPECT_EQ(g.nodes.size(), before - 4 + 1);
  EXPECT_EQ(count_op(g, ops::builtin::overflow_guard_check), 0u);
  ASSERT_EQ(count_op(g, ops::builtin::overflow_guard_init), 2u);
  TensorId flag = graph::no_tensor;
  graph::NodeId flag_init = 0, guard_init = 0, first_guarded = static_cast<graph::NodeId>(g.nodes.size());
  std::size_t guarded = 0;
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    if (g.nodes.op[n] == ops::builtin::overflow_guard_init) {
      if (g.nodes.outputs(n)[0] == g.guard) {
        guard_init = n;
      } else {
        flag_init = n;
        flag = g.nodes.outputs(n)[0];
        EXPECT_EQ(g.nodes.inputs(n)[0], g.loss);
      }
    }
    if (g.nodes.op[n] != graph::builtin::linear_grad_param) continue;
    ASSERT_NE(flag, graph::no_tensor) << "a product before the flag's init";
    EXPECT_EQ(g.nodes.inputs(n).back(), flag);
    EXPECT_EQ(g.nodes.outputs(n).back(), flag);
    first_guarded = std::min(first_guarded, n);
    ++guarded;
  }
  EXPECT_EQ(guarded, 2u);
  EXPECT_EQ(g.tensors.name[flag], "overflow_guard.products");
  EXPECT_LT(flag_init, first_guarded);
  EXPECT_EQ(g.nodes.inputs(guard_init)[0], flag);
  EXPECT_EQ(guard_init, guard_init_before + 1);  // in its place (after the flag's init): the guard's last writer

  // A forward-only key skips autodiff and the optimizer (and fuses the ReLU).
  graph::Graph eval = graph::prepare_step_graph(mlp_forward(16), graph::VariantKey{16, false}, adam);
  EXPECT_EQ(eval.nodes.size(), forward_nodes - 1 + 1);
  EXPECT_EQ(count_class(eval, ops::OpClass::backward), 0u);
}

// A resident step's updates come last, one per parameter: group_updates makes each run of up to 8
// adjacent Adam updates one adam_update_group node (their weights, gradients and moments in order,
// then the guard); a run of one stays as it was, and an update over a ZeRO share is not grouped.
TEST(Pipeline, AdjacentAdamUpdatesBecomeGroups) {
  ops::OptimizerConfig adam;
  const ModelSpec deep = models::deep(32, 5);
  graph::Graph g = graph::prepare_step_graph(forward_graph(deep, graph::VariantKey{4, true}), {4, true}, adam);
  const std::size_t updates = count_op(g, graph::builtin::adam_update);
  ASSERT_GT(updates, 8u);
  std::vector<TensorId> weights;  // in update order
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    if (g.nodes.op[n] == graph::builtin::adam_update) weights.push_back(g.nodes.inputs(n)[0]);
  }
  const std::size_t before = g.nodes.size();
  graph::group_updates(g);
  const std::size_t groups = (updates + 7) / 8;
  EXPECT_EQ(count_op(g, graph::builtin::adam_update_group) + count_op(g, graph::builtin::adam_update), groups);
  EXPECT_EQ(g.nodes.size(), before - updates + groups);
  std::vector<TensorId> grouped;
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    if (g.nodes.op[n] != graph::builtin::adam_update_group) continue;
    const auto ins = g.nodes.inputs(n);
    ASSERT_EQ(ins.size() % 4, 1u);  // the guard last
    EXPECT_EQ(ins.back(), g.guard);
    EXPECT_LE(ins.size() / 4, 8u);
    EXPECT_EQ(g.nodes.outputs(n).size(), 3 * (ins.size() / 4));
    for (std::size_t i = 0; i + 1 < ins.size(); i += 4) {
      grouped.push_back(ins[i]);
      EXPECT_EQ(g.tensors.grad[ins[i]], ins[i + 1]);
    }
  }
  if (updates % 8 == 1) weights.pop_back();  // the last, alone, stays an adam_update
  EXPECT_EQ(grouped, weights);
  // A share of a weight (ZeRO) is not a whole tensor: never grouped.
  graph::Graph shared = graph::prepare_step_graph(forward_graph(deep, graph::VariantKey{4, true}), {4, true}, adam);
  for (graph::NodeId n = 0; n < shared.nodes.size(); ++n) {
    if (shared.nodes.op[n] == graph::builtin::adam_update) shared.nodes.attrs[n] = ops::UpdateAttrs{0, 0, 8}.pack();
  }
  graph::group_updates(shared);
  EXPECT_EQ(count_op(shared, graph::builtin::adam_update_group), 0u);

  // Weight decay on matrices only: the builder interleaves a Linear's w and b, so each kind is
  // grouped apart within the run, matrices first, as few launches as with one kind.
  ops::OptimizerConfig matrices = adam;
  matrices.decay_on = ops::OptimizerConfig::DecayOn::matrices;
  graph::Graph two = graph::prepare_step_graph(forward_graph(deep, graph::VariantKey{4, true}), {4, true}, matrices);
  std::size_t exempt = 0;
  for (graph::NodeId n = 0; n < two.nodes.size(); ++n) {
    if (two.nodes.op[n] == graph::builtin::adam_update)
      exempt += ops::UpdateAttrs::of(two.nodes.attrs[n]).no_weight_decay;
  }
  ASSERT_GT(exempt, 8u);
  graph::group_updates(two);
  const std::size_t kinds = (updates - exempt + 7) / 8 + (exempt + 7) / 8;
  EXPECT_EQ(count_op(two, graph::builtin::adam_update_group) + count_op(two, graph::builtin::adam_update), kinds);
  for (graph::NodeId n = 0; n < two.nodes.size(); ++n) {
    if (two.nodes.op[n] != graph::builtin::adam_update_group) continue;
    const bool no_decay = ops::UpdateAttrs::of(two.nodes.attrs[n]).no_weight_decay;
    const auto ins = two.nodes.inputs(n);
    for (std::size_t i = 0; i + 1 < ins.size(); i += 4) {
      EXPECT_EQ(two.tensors.shape[ins[i]].rank < 2, no_decay)
          << two.tensors.name[ins[i]] << " in " << two.nodes.name[n];
    }
  }
}

// Each ReLU that only a max-pool reads joins that pool (MaxPool2dAttrs::relu, reading the ReLU's input);
// then each remaining ReLU of a convolution's output that nothing else reads joins the
// convolution's epilogue (Conv2dAttrs::relu, writing the ReLU's output); any other ReLU stays.
// Autodiff emits no ReLU backward for a pool's ReLU and a mask (".relu_grad") for a convolution's.
TEST(Pipeline, FusionTakesReluIntoPoolsThenIntoConvolutions) {
  const ModelSpec cnn = models::classifier("fusion-cnn", graph::Shape{1, 8, 8}, 10, [](graph::Builder& b, TensorId x) {
    x = b.maxpool2d(b.relu(b.conv2d(x, 3, 3, 1, 1)));    // into the pool
    const TensorId r = b.relu(b.conv2d(x, 4, 3, 1, 1));  // two pools read it: into the convolution
    x = b.add(b.maxpool2d(r, 2, 1), b.maxpool2d(r, 2, 1));
    return b.linear(b.relu(b.flatten(x)), 10);  // neither: stays
  });
  const graph::Graph g = forward_graph(cnn, graph::VariantKey{4, true});
  graph::Graph pools = g, both = g;
  graph::fuse_relu_maxpool(pools);
  graph::fuse_layers(both);
  EXPECT_EQ(count_op(g, graph::builtin::activation), 3u);
  EXPECT_EQ(count_op(pools, graph::builtin::activation), 2u);
  EXPECT_EQ(count_op(both, graph::builtin::activation), 1u);
  EXPECT_EQ(both.nodes.size(), g.nodes.size() - 2);
  const auto producer_op = [&](const graph::Graph& h, TensorId x) {
    for (graph::NodeId m = 0; m < h.nodes.size(); ++m) {
      for (TensorId y : h.nodes.outputs(m)) {
        if (y == x) return h.nodes.op[m];
      }
    }
    return graph::OpId{};
  };
  std::size_t relu_pools = 0, relu_convs = 0;
  for (graph::NodeId n = 0; n < both.nodes.size(); ++n) {
    if (!ops::relu_fused(both.nodes.attrs[n])) continue;
    if (both.nodes.op[n] == graph::builtin::maxpool2d) {
      ++relu_pools;
      EXPECT_EQ(producer_op(both, both.nodes.inputs(n)[0]), graph::builtin::conv2d);  // reads the convolution
    }
    if (both.nodes.op[n] == graph::builtin::conv2d) {
      ++relu_convs;
      // Writes what the ReLU wrote: the tensor both pools read.
      std::size_t pool_readers = 0;
      for (graph::NodeId m = 0; m < both.nodes.size(); ++m) {
        pool_readers +=
            both.nodes.op[m] == graph::builtin::maxpool2d && both.nodes.inputs(m)[0] == both.nodes.outputs(n)[0];
      }
      EXPECT_EQ(pool_readers, 2u);
    }
  }
  EXPECT_EQ(relu_pools, 1u);
  EXPECT_EQ(relu_convs, 1u);
  ops::OptimizerConfig adam;
  graph::VariantKey off{4, true};
  off.fuse = false;
  const graph::Graph with = graph::prepare_step_graph(forward_graph(cnn, graph::VariantKey{4, true}), {4, true}, adam);
  const graph::Graph without = graph::prepare_step_graph(forward_graph(cnn, off), off, adam);
  // The convolution's mask (its dy comes from the pools' backward); the last ReLU's joins the head's
  // input gradient (fuse_activation_grads).
  EXPECT_EQ(count_op(with, graph::builtin::activation_grad), 1u);
  EXPECT_EQ(count_op(without, graph::builtin::activation_grad), 3u);
}

// A residual add whose sum a LayerNorm reads joins it as one add_layernorm node (at the add's
// place, writing the sum its other readers use); autodiff then needs no gradient-sum node for the
// sum, since the fused backward adds the sum's other gradient into dx itself.
TEST(Pipeline, FusionTakesResidualAddsIntoLayerNorms) {
  const ModelSpec deep = models::deep(32, 3);  // x = x + f(LN(x)) per block, then LN, head
  const graph::Graph g = forward_graph(deep, graph::VariantKey{4, true});
  graph::Graph fused = g;
  graph::fuse_layers(fused);
  const graph::OpId add_layernorm = ops::builtin::add_layernorm;
  EXPECT_EQ(count_op(g, graph::builtin::add), 3u);
  EXPECT_EQ(count_op(g, graph::builtin::layernorm), 4u);
  EXPECT_EQ(count_op(fused, graph::builtin::add), 0u);
  EXPECT_EQ(count_op(fused, add_layernorm), 3u);
  EXPECT_EQ(count_op(fused, graph::builtin::layernorm), 1u);  // the first block's reads no add
  EXPECT_EQ(fused.nodes.size(), g.nodes.size() - 3);
  ops::OptimizerConfig adam;
  graph::VariantKey off{4, true};
  off.fuse = false;
  const graph::Graph with = graph::prepare_step_graph(forward_graph(deep, graph::VariantKey{4, true}), {4, true}, adam);
  const graph::Graph without = graph::prepare_step_graph(forward_graph(deep, off), off, adam);
  EXPECT_LT(count_op(with, graph::builtin::add), count_op(without, graph::builtin::add));
  // Three adds fewer, the gradient sums of the two sums another block reads (the last sum only
  // the final LayerNorm reads: no sum in either graph), and the three GELU backwards, now in the
  // epilogues of the input gradients that make their dy (fuse_activation_grads); the checks of
  // the Linears' weight and bias gradients and the LayerNorms' gain and shift gradients, now in
  // the nodes that make them, for one init of their flag (fuse_guard_checks).
  const std::size_t folded_checks =
      count_op(without, ops::builtin::overflow_guard_check) - count_op(with, ops::builtin::overflow_guard_check);
  EXPECT_EQ(folded_checks, 2 * (count_op(without, graph::builtin::linear_grad_param) +
                                count_op(without, graph::builtin::layernorm_grad)));
  EXPECT_EQ(count_op(with, ops::builtin::overflow_guard_check), 0u);
  EXPECT_EQ(with.nodes.size() + 3 + 2 + 3 + folded_checks - 1, without.nodes.size());
}

// Under mixed precision each LayerNorm whose f32 output only a cast to the narrow type read stores
// that narrow output itself: in models::deep, the four LayerNorms but the last (which the f32 head
// reads); and each add_layernorm reads the narrow output of its residual branch's last Linear
// where an f32 cast of it was read: all three. In training and evaluation variants; the f32 graph
// keeps its nodes.
TEST(Pipeline, LayerNormsStoreTheNarrowCopyTheNextLayerReads) {
  const ModelSpec deep = models::deep(32, 3);
  ops::OptimizerConfig adam;
  for (const ops::DType narrow : {ops::DType::bf16, ops::DType::f16}) {
    for (const bool training : {true, false}) {
      SCOPED_TRACE(fmt::format("{} {}", ops::dtype_name(narrow), training ? "training" : "evaluation"));
      graph::VariantKey on{4, training}, off{4, training};
      on.precision = off.precision = narrow;
      off.fuse = false;
      const graph::Graph with = graph::prepare_step_graph(forward_graph(deep, on), on, adam);
      const graph::Graph without = graph::prepare_step_graph(forward_graph(deep, off), off, adam);
      std::size_t narrow_norms = 0, f32_norms = 0, narrow_sums = 0;
      for (graph::NodeId n = 0; n < with.nodes.size(); ++n) {
        const graph::OpId op = with.nodes.op[n];
        if (op != graph::builtin::layernorm && op != ops::builtin::add_layernorm) continue;
        const ops::DType y = ops::LayerNormAttrs::of(with.nodes.attrs[n]).y;
        const graph::TensorId out = with.nodes.outputs(n)[op == graph::builtin::layernorm ? 0 : 1];
        EXPECT_EQ(with.tensors.dtype[out], y) << with.nodes.name[n];
        ++(y == narrow ? narrow_norms : f32_norms);
        if (op == ops::builtin::add_layernorm) {
          EXPECT_EQ(with.tensors.dtype[with.nodes.inputs(n)[0]], ops::DType::f32) << with.nodes.name[n];
          narrow_sums += with.tensors.dtype[with.nodes.inputs(n)[1]] == narrow;
        }
      }
      EXPECT_EQ(narrow_norms, 3u);
      EXPECT_EQ(f32_norms, 1u);
      EXPECT_EQ(narrow_sums, 3u);
      // No cast reads a LayerNorm's output, nor makes an operand of a sum: six forward casts fewer.
      const auto forward_casts = [](const graph::Graph& g) {
        std::size_t n = 0;
        for (graph::NodeId i = 0; i < g.nodes.size(); ++i) {
          n += g.nodes.op[i] == graph::builtin::cast &&
               ops::CastAttrs::of(g.nodes.attrs[i]).scale == ops::CastScale::none;
        }
        return n;
      };
      EXPECT_EQ(forward_casts(with) + 6, forward_casts(without));
    }
  }
  graph::VariantKey f32{4, true};
  const graph::Graph plain = graph::prepare_step_graph(forward_graph(deep, f32), f32, adam);
  for (graph::NodeId n = 0; n < plain.nodes.size(); ++n) {
    if (plain.nodes.op[n] == graph::builtin::layernorm || plain.nodes.op[n] == ops::builtin::add_layernorm) {
      EXPECT_EQ(ops::LayerNormAttrs::of(plain.nodes.attrs[n]).y, ops::DType::f32);
    }
  }
}

// A ReLU a Linear makes joins its epilogue, as a convolution's does; after autodiff, each
// activation's backward whose dy only the next Linear's input gradient makes joins that GEMM's
// epilogue: the input gradient reads z (the activation's input, or the fused ReLU's output) and
// writes dx. The MLP keeps no activation node at all, forward or backward.
TEST(Pipeline, FusionTakesActivationsIntoLinearEpilogues) {
  ops::OptimizerConfig adam;
  graph::VariantKey on{4, true}, off{4, true};
  off.fuse = false;
  struct Model {
    ModelSpec spec;
    ops::Activation act;
    std::size_t activations;  // activation nodes of the unfused graph
  };
  for (const Model& m :
       {Model{models::mlp({32, 16}), ops::Activation::relu, 2}, Model{models::deep(32, 3), ops::Activation::gelu, 3}}) {
    SCOPED_TRACE(m.spec.name);
    const graph::Graph with = graph::prepare_step_graph(forward_graph(m.spec, on), on, adam);
    const graph::Graph without = graph::prepare_step_graph(forward_graph(m.spec, off), off, adam);
    EXPECT_EQ(count_op(without, graph::builtin::activation_grad), m.activations);
    EXPECT_EQ(count_op(with, graph::builtin::activation_grad), 0u);
    EXPECT_EQ(count_op(with, graph::builtin::activation), m.act == ops::Activation::relu ? 0u : m.activations);
    std::size_t fused = 0;
    for (graph::NodeId n = 0; n < with.nodes.size(); ++n) {
      if (with.nodes.op[n] != graph::builtin::linear_grad_input) continue;
      const ops::LinearGradInputAttrs at = ops::LinearGradInputAttrs::of(with.nodes.attrs[n]);
      if (!at.fused) {
        EXPECT_EQ(with.nodes.inputs(n).size(), 2u);
        continue;
      }
      ++fused;
      EXPECT_EQ(at.act, m.act);
      ASSERT_EQ(with.nodes.inputs(n).size(), 3u);
      const TensorId z = with.nodes.inputs(n)[2];
      EXPECT_EQ(with.tensors.role[z], graph::Role::activation);
      EXPECT_TRUE(with.tensors.shape[z] == with.tensors.shape[with.nodes.outputs(n)[0]]);
    }
    EXPECT_EQ(fused, m.activations);
  }
}

std::size_t count_role(const graph::Graph& g, graph::Role r) {
  std::size_t n = 0;
  for (TensorId t = 0; t < g.tensors.size(); ++t) n += g.tensors.role[t] == r;
  return n;
}

TEST(Pipeline, PredictorPassFitsAroundEveryUpdateOrAppliesInstead) {
  ops::OptimizerConfig adam;
  graph::VariantKey fit{16, true};
  fit.fit_predictor = true;
  const graph::Graph g = graph::prepare_step_graph(mlp_forward(16), fit, adam);
  // A snapshot and a fit per weight, and the inits of the guard and of the flag the products
  // check into (the 4 checks are in the products: fuse_guard_checks).
  EXPECT_EQ(count_class(g, ops::OpClass::state_update), 10u);
  EXPECT_EQ(count_role(g, graph::Role::predictor_state), 8u);
  // Each weight's snapshot comes before its update, and its fit after.
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    if (g.nodes.op[n] != graph::builtin::adam_update) continue;
    EXPECT_EQ(g.nodes.op[n - 1], ops::builtin::predictor_snapshot);
    EXPECT_EQ(g.nodes.op[n + 1], ops::builtin::predictor_fit);
  }

  graph::VariantKey predict{16, false};
  predict.apply_predictor = true;
  const graph::Graph p = graph::prepare_step_graph(mlp_forward(16), predict, adam);
  EXPECT_EQ(count_class(p, ops::OpClass::backward), 0u);
  EXPECT_EQ(count_class(p, ops::OpClass::update), 0u);
  EXPECT_EQ(count_class(p, ops::OpClass::state_update), 4u);  // one apply per weight
  EXPECT_EQ(count_role(p, graph::Role::optimizer_state), 0u);

  // int8 weights: every layer but the head reads its weight through quantize -> dequantize.
  predict.int8_weights = true;
  const graph::Graph p8 = graph::prepare_step_graph(mlp_forward(16), predict, adam);
  std::size_t quantized = 0;
  std::vector<graph::NodeId> layers;
  for (graph::NodeId n = 0; n < p8.nodes.size(); ++n) {
    quantized += p8.nodes.op[n] == graph::builtin::quantize_i8;
    if (p8.nodes.op[n] == graph::builtin::linear) layers.push_back(n);
  }
  ASSERT_EQ(layers.size(), 2u);
  EXPECT_EQ(quantized, 1u) << "all layers but the head";
  EXPECT_EQ(p8.tensors.dtype[p8.nodes.inputs(layers[0])[1]], graph::DType::f32);
  EXPECT_NE(p8.tensors.role[p8.nodes.inputs(layers[0])[1]], graph::Role::weight) << "reads the dequantized copy";
  EXPECT_EQ(p8.tensors.role[p8.nodes.inputs(layers[1])[1]], graph::Role::weight) << "the head reads its fp32 weight";

  // Accumulation: a micro variant sums gradients and has no optimizer or predictor; the last one
  // takes the mean before the updates.
  graph::VariantKey micro{16, true};
  micro.accumulate = 4;
  micro.micro = true;
  micro.fit_predictor = true;
  const graph::Graph mg = graph::prepare_step_graph(mlp_forward(16), micro, adam);
  EXPECT_EQ(count_class(mg, ops::OpClass::update), 0u);
  // grad_accumulate per weight, the guard's and its flag's inits: the checks, of each micro-batch's
  // gradient before it is summed, are in the products that make them.
  EXPECT_EQ(count_class(mg, ops::OpClass::state_update), 6u);
  EXPECT_EQ(count_role(mg, graph::Role::gradient_sum), 4u);
  micro.micro = false;
  micro.fit_predictor = false;
  const graph::Graph last = graph::prepare_step_graph(mlp_forward(16), micro, adam);
  EXPECT_EQ(count_class(last, ops::OpClass::update), 4u);
  EXPECT_EQ(count_class(last, ops::OpClass::state_update), 6u);  // grad_mean per weight, the two inits

  ops::OptimizerConfig bad = adam;
  bad.predictor.beta = 1.0f;
  EXPECT_THROW(graph::prepare_step_graph(mlp_forward(16), fit, bad), std::invalid_argument);
}

TEST(Pipeline, AutodiffWithoutALossIsAClearError) {
  graph::Graph g;
  ClassifierBuilder b(g, 2, graph::Shape{4}, 2);
  b.linear(b.input(), 2);
  try {
    graph::append_backward(g);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("no loss"), std::string::npos) << e.what();
  }
}

TEST(Pipeline, CompiledStepReportsItsDevicePassesInOrder) {
  Runtime runtime;
  ops::OptimizerConfig adam;
  graph::CompiledStep step(graph::prepare_step_graph(mlp_forward(8), graph::VariantKey{8, true}, adam), adam,
                           runtime.env(), runtime.context(), nullptr, graph::StepOptions{{}, false, false});
  std::string order;
  for (const auto& p : step.pass_timings()) {
    order += p.name + ";";
    EXPECT_GE(p.ms, 0.0);
  }
  EXPECT_EQ(order, "check dtypes;scratch;residency and memory plan;arena;bind;lower;");
  // Compiled without kernels: it cannot run, and says so.
  EXPECT_THROW(step.run(ops::StepInfo{1, 0.1f}), std::logic_error);
}

}  // namespace
}  // namespace ferry::test
