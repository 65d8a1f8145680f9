// The op table as a contract: every built-in row is complete, a user's op is a row added from
// outside (kernels from source, shape rule, backward, CPU reference) that trains like a built-in
// one, and the rows' dtype sets are enforced at compile time.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <utility>

#include "../examples/silu_op.hpp"
#include "classifier.hpp"
#include "ferry/ferry.hpp"
#include "ferry/ops/op_table.hpp"
#include "graph/bind.hpp"
#include "graph/pipeline.hpp"
#include "ops/attrs.hpp"
#include "reference_executor.hpp"
#include "runtime/trainer_internals.hpp"
#include "test_support.hpp"
#include "train_check.hpp"

namespace ferry::test {
namespace {

// The backward rule of an op whose output is its input: dy passes through as dx.
void pass_gradient_through(ops::GradContext& c) {
  c.contribute(c.inputs()[0], c.grad(c.outputs()[0]));
}

TEST(OpTable, EveryShippedRowCanRunAndHasAReference) {
  ASSERT_GE(ops::op_count(), static_cast<std::size_t>(ops::builtin::builtin_count));
  // Before any test registers a user row, every row is one ferry ships (built-in or named).
  for (ops::OpId id = 0; id < ops::op_count(); ++id) {
    const ops::OpInfo& row = ops::op_info(id);
    SCOPED_TRACE(row.name);
    EXPECT_EQ(ops::find_op(row.name), id);
    EXPECT_TRUE(row.reference) << "no CPU reference";
    if (ops::is_host_lane(row.lane)) {
      EXPECT_TRUE(row.host) << "a host-lane row without a host function";
    } else {
      EXPECT_TRUE(row.bind) << "a device-lane row without a binding";
    }
    // Forward rows that users apply have a shape rule; their gradients come from a backward rule.
    if (row.op_class == ops::OpClass::forward || row.op_class == ops::OpClass::loss) {
      EXPECT_TRUE(row.infer);
      EXPECT_TRUE(row.backward);
    }
  }
}

// Every ops::builtin id names the row it says (the registry fills each id's slot; a row filed
// under another's id would pass every other test that looks rows up by id).
TEST(OpTable, BuiltinIdsNameTheirRows) {
  namespace b = ops::builtin;
  const std::pair<ops::OpId, const char*> ids[] = {{b::upload, "upload"},
                                                   {b::fetch, "fetch"},
                                                   {b::pack, "pack"},
                                                   {b::linear, "linear"},
                                                   {b::linear_grad_param, "linear_grad_param"},
                                                   {b::add, "add"},
                                                   {b::conv2d_grad_input, "conv2d_grad_input"},
                                                   {b::softmax_xent, "softmax_xent"},
                                                   {b::adam_update, "adam_update"},
                                                   {b::dequantize_i8, "dequantize_i8"},
                                                   {b::matmul, "matmul"},
                                                   {b::matmul_grad_b, "matmul_grad_b"},
                                                   {b::softmax_grad, "softmax_grad"},
                                                   {b::permute, "permute"},
                                                   {b::scale, "scale"},
                                                   {b::embedding_grad, "embedding_grad"},
                                                   {b::dropout, "dropout"},
                                                   {b::add_bias_grad, "add_bias_grad"},
                                                   {b::mse, "mse"},
                                                   {b::loss_sum, "loss_sum"},
                                                   {b::adam8bit_update, "adam8bit_update"},
                                                   {b::predictor_apply, "predictor_apply"},
                                                   {b::grad_mean, "grad_mean"},
                                                   {b::overflow_guard_check, "overflow_guard_check"},
                                                   {b::attention_grad, "attention_grad"},
                                                   {b::add_layernorm, "add_layernorm"},
                                                   {b::grad_send, "grad_send"},
                                                   {b::weight_allgather, "weight_allgather"},
                                                   {b::others_receive, "others_receive"},
                                                   {b::adam_update_group, "adam_update_group"}};
  for (const auto& [id, name] : ids) EXPECT_EQ(ops::op_info(id).name, name) << "builtin id " << id;
  // Every built-in id has a row of its own name, and no two share one.
  std::set<std::string> names;
  for (ops::OpId id = 0; id < b::builtin_count; ++id) EXPECT_TRUE(names.insert(ops::op_info(id).name).second);
  EXPECT_EQ(ops::update_row(ops::OptimizerConfig::Kind::adamw), b::adam_update);
  EXPECT_EQ(ops::update_row(ops::OptimizerConfig::Kind::adamw8bit), b::adam8bit_update);
}

TEST(OpTable, RejectsDuplicateAndInertRowsAndUnknownNames) {
  ops::OpInfo dup;
  dup.name = "linear";
  dup.bind = [](const ops::BindContext&) { return ops::LaunchList{}; };
  EXPECT_THROW(ops::register_op(dup), std::invalid_argument);
  ops::OpInfo inert;
  inert.name = "does_nothing";
  EXPECT_THROW(ops::register_op(inert), std::invalid_argument);
  try {
    ops::find_op("no_such_op");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("softmax_xent"), std::string::npos) << "should list known ops: " << e.what();
  }
}

// SiLU, y = x * sigmoid(x), as a user adds it: the op examples/custom_op.cpp trains, with its own
// OpenCL source and rows (examples/silu_op.hpp), registered once per test binary.
ops::OpId user_silu() {
  static const ops::OpId id = silu_op::register_silu("user_silu");
  return id;
}

ModelSpec silu_model() {
  return models::classifier("silu-mlp", graph::Shape{12}, 4, [](graph::Builder& b, TensorId x) {
    const TensorId h = b.linear(x, 16);
    const TensorId in[] = {h};
    return b.linear(b.apply(user_silu(), in)[0], 4);
  });
}

TEST(OpTable, UserOpTrainsOnTheDeviceLikeItsReference) {
  Runtime runtime;
  TrainerOptions topt;
  topt.batch = 8;
  topt.lr = 0.05f;
  topt.optimizer.kind = ops::OptimizerConfig::Kind::sgd;
  topt.optimizer.sgd.momentum = 0.9f;
  Trainer trainer(runtime, silu_model(), topt);
  const auto& g = compiled_train_step(trainer).graph();
  std::size_t user_nodes = 0;
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    const std::string& name = ops::op_info(g.nodes.op[n]).name;
    user_nodes += name == "user_silu" || name == "user_silu_grad";
  }
  EXPECT_EQ(user_nodes, 2u) << "the user op and its backward rule's node";

  expect_training_matches_reference(trainer, 4, 40);
}

TEST(OpTable, UserOpBackwardMatchesFiniteDifferences) {
  graph::Graph g = forward_graph(silu_model(), graph::VariantKey{3, true});
  ops::OptimizerConfig opt;
  opt.kind = ops::OptimizerConfig::Kind::sgd;
  opt.sgd.momentum = 0;
  g = graph::prepare_step_graph(std::move(g), graph::VariantKey{3, true}, opt);
  ReferenceExecutor ref(g, opt);
  const auto& t = g.tensors;
  randomize_weights(ref, g, 5);
  ref.value(ref.find("input")) = to_double(random_vector(36, 77, -2.0f, 2.0f));
  ref.ints(ref.find("labels")) = {0, 3, 1};
  ref.run(ops::StepInfo{1, 0.0f});
  const TensorId w = ref.find("linear0.w");
  expect_reference_gradient_matches_finite_differences(ref, w, t.grad[w], "linear0.w through user_silu", 24);
}

TEST(OpTable, UserOpShapeRuleErrorNamesTheNode) {
  graph::Graph g;
  ClassifierBuilder b(g, 2, graph::Shape{4}, 2);
  const TensorId two[] = {b.input(), b.input()};
  try {
    b.apply(user_silu(), two);
    FAIL();
  } catch (const graph::BuildError& e) {
    EXPECT_NE(std::string(e.what()).find("user_silu"), std::string::npos) << e.what();
  }
}

// A user's shape rule that throws something other than ShapeError, and a user's kernel that does
// not compile: errors naming the node (and, for the kernel, carrying the compiler's log).
TEST(OpTable, BrokenUserOpsAreErrorsNamingTheNode) {
  ops::OpInfo throwing;
  throwing.name = "user_throwing_rule";
  throwing.infer = [](const ops::ShapeView&) -> std::vector<ops::TensorDesc> {
    throw std::runtime_error("no shapes today");
  };
  throwing.bind = [](const ops::BindContext&) { return ops::LaunchList{}; };
  throwing.reference = [](ops::RefContext&) {};
  const ops::OpId throwing_id = ops::register_op(throwing);
  {
    graph::Graph g;
    ClassifierBuilder b(g, 2, graph::Shape{4}, 2);
    const TensorId in[] = {b.input()};
    try {
      b.apply(throwing_id, in);
      FAIL();
    } catch (const graph::BuildError& e) {
      EXPECT_NE(std::string(e.what()).find("user_throwing_rule0"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("no shapes today"), std::string::npos) << e.what();
    }
  }

  ops::OpInfo broken;
  broken.name = "user_broken_kernel";
  broken.infer = [](const ops::ShapeView& v) { return std::vector<ops::TensorDesc>{v.input(0)}; };
  broken.bind = [](const ops::BindContext& c) {
    c.env().kernels.program_from_source("user_broken", "__kernel void k(__global float* x) { x[0] = undeclared; }");
    return ops::LaunchList{};
  };
  broken.backward = pass_gradient_through;
  broken.reference = [](ops::RefContext&) {};
  const ops::OpId broken_id = ops::register_op(broken);
  const ModelSpec m = models::classifier("broken", graph::Shape{4}, 2, [broken_id](graph::Builder& b, TensorId x) {
    const TensorId in[] = {b.linear(x, 2)};
    return b.apply(broken_id, in)[0];
  });
  Runtime rt;
  try {
    Trainer t(rt, m, TrainerOptions{});
    FAIL() << "a kernel that does not compile must fail the compile";
  } catch (const cl::Error& e) {
    EXPECT_NE(std::string(e.what()).find("user_broken_kernel1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("undeclared"), std::string::npos) << "the build log: " << e.what();
  }

  // A user's bind that throws a plain error of its own: passed on with the node named.
  ops::OpInfo refusing = broken;
  refusing.name = "user_refusing_bind";
  refusing.bind = [](const ops::BindContext&) -> ops::LaunchList { throw std::runtime_error("my bind failed"); };
  const ops::OpId refusing_id = ops::register_op(refusing);
  const ModelSpec r = models::classifier("refusing", graph::Shape{4}, 2, [refusing_id](graph::Builder& b, TensorId x) {
    const TensorId in[] = {b.linear(x, 2)};
    return b.apply(refusing_id, in)[0];
  });
  try {
    Trainer t(rt, r, TrainerOptions{});
    FAIL() << "a bind that throws must fail the compile";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("node 'user_refusing_bind1' (user_refusing_bind): my bind failed"),
              std::string::npos)
        << e.what();
  }
}

// A user's row whose rules misbehave is an error naming the node, never a crash or a model that
// trains less than it says: a backward rule that leaves out an input the loss depends on (its
// weights would stay untrained), one that names a tensor that does not exist, a shape rule that
// makes an empty tensor; and a Builder layer given a tensor id that does not exist.
TEST(OpTable, UserRulesThatMisbehaveAreRefusedAtBuildTime) {
  const auto identity_row = [](const char* name, std::function<void(ops::GradContext&)> backward) {
    ops::OpInfo row;
    row.name = name;
    row.infer = [](const ops::ShapeView& v) { return std::vector<ops::TensorDesc>{v.input(0)}; };
    row.bind = [](const ops::BindContext&) { return ops::LaunchList{}; };
    row.backward = std::move(backward);
    row.reference = [](ops::RefContext&) {};
    return ops::register_op(row);
  };
  const auto model_with = [](ops::OpId op) {
    return models::classifier("misbehaving", graph::Shape{4}, 2, [op](graph::Builder& b, TensorId x) {
      const TensorId in[] = {b.linear(x, 2)};
      return b.apply(op, in)[0];
    });
  };
  const auto expect_refused = [](const ModelSpec& m, std::initializer_list<const char*> needles) {
    Runtime rt;
    try {
      Trainer t(rt, m, TrainerOptions{});
      ADD_FAILURE() << "trained a model whose op misbehaves";
    } catch (const std::exception& e) {
      for (const char* n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
    }
  };
  expect_refused(model_with(identity_row("user_forgets_dx", [](ops::GradContext&) {})),
                 {"user_forgets_dx1", "gave no gradient for its input 0 ('linear0.y')"});
  expect_refused(
      model_with(identity_row("user_bogus_dx", [](ops::GradContext& c) { c.contribute(c.inputs()[0], 999999); })),
      {"user_bogus_dx1", "tensor id 999999", "does not exist"});

  ops::OpInfo empty;
  empty.name = "user_empty_output";
  empty.infer = [](const ops::ShapeView& v) {
    return std::vector<ops::TensorDesc>{{graph::Shape{v.input(0).shape[0], 0}, graph::DType::f32}};
  };
  empty.bind = [](const ops::BindContext&) { return ops::LaunchList{}; };
  empty.reference = [](ops::RefContext&) {};
  const ops::OpId empty_id = ops::register_op(empty);
  graph::Graph g;
  ClassifierBuilder b(g, 2, graph::Shape{4}, 2);
  const TensorId in[] = {b.input()};
  try {
    b.apply(empty_id, in);
    ADD_FAILURE() << "an output without elements";
  } catch (const graph::BuildError& e) {
    EXPECT_NE(std::string(e.what()).find("which has no elements"), std::string::npos) << e.what();
  }
  // A shape filled by hand past its four dimensions (it had gone on, and messages printed what lay
  // past the array), or a dtype that is none.
  ops::OpInfo deep = empty;
  deep.name = "user_rank5_output";
  deep.infer = [](const ops::ShapeView& v) {
    graph::Shape s = v.input(0).shape;
    s.rank = 7;
    return std::vector<ops::TensorDesc>{{s, graph::DType::f32}};
  };
  ops::OpInfo odd = empty;
  odd.name = "user_odd_dtype_output";
  odd.infer = [](const ops::ShapeView& v) {
    return std::vector<ops::TensorDesc>{{v.input(0).shape, static_cast<graph::DType>(42)}};
  };
  for (const auto& [row, needle] : {std::pair{deep, "of rank 7; shapes have at most 4 dimensions"},
                                    std::pair{odd, "of dtype 42, which is none of f32"}}) {
    const ops::OpId id = ops::register_op(row);
    try {
      b.apply(id, in);
      ADD_FAILURE() << row.name;
    } catch (const graph::BuildError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
  // A row on a host lane (OpInfo::lane) in the forward: every step failed with "tensor '...' has
  // no host memory"; it is refused where it is applied.
  ops::OpInfo on_host = empty;
  on_host.name = "user_host_lane_forward";
  on_host.lane = ops::Lane::host;
  on_host.infer = [](const ops::ShapeView& v) {
    return std::vector<ops::TensorDesc>{{v.input(0).shape, graph::DType::f32}};
  };
  on_host.bind = nullptr;
  on_host.host = [](const ops::HostContext&) {};
  try {
    b.apply(ops::register_op(on_host), in);
    ADD_FAILURE() << "applied a host-lane op in the forward";
  } catch (const graph::BuildError& e) {
    EXPECT_NE(std::string(e.what()).find("runs on the host lane (OpInfo::lane); the ops a model applies run on the "
                                         "device"),
              std::string::npos)
        << e.what();
  }
  graph::Shape past;
  past.rank = 5;
  EXPECT_EQ(past.elems(), 0u);
  EXPECT_EQ(past.str(), "[rank 5: more than 4 dimensions]");
  for (const TensorId bogus : {TensorId(9999), TensorId(~0u)}) {
    EXPECT_THROW(b.linear(bogus, 3), graph::BuildError);
    EXPECT_THROW(b.layernorm(bogus), graph::BuildError);
    EXPECT_THROW(b.flatten(bogus), graph::BuildError);
    EXPECT_THROW(b.reshape(bogus, graph::Shape{4, 2}), graph::BuildError);
  }
  expect_refused(
      models::classifier("bogus logits", graph::Shape{4}, 2, [](graph::Builder&, TensorId) { return TensorId(9999); }),
      {"tensor id 9999"});

  // A forward that makes other weights at another batch size: the evaluation variants (the batch
  // halved for a data set's tail) would read past the training step's weights. The plan made at
  // construction counts their host buffers, so the Trainer refuses the model there, before any
  // step or evaluation.
  Runtime rt;
  TrainerOptions o;
  o.batch = 4;
  try {
    Trainer t(rt,
              models::classifier("batch-dependent", graph::Shape{4}, 2,
                                 [](graph::Builder& b, TensorId x) {
                                   return b.linear(b.relu(b.linear(x, b.batch() == 4 ? 16 : 32)), 2);
                                 }),
              o);
    ADD_FAILURE() << "built a trainer whose evaluation variants have weights of another shape";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("must make the same weights at every batch size"), std::string::npos)
        << e.what();
  }
}

// Nodes bind in parallel (their programs build at once): the launches they make are the same as
// when bound one at a time, so training gives the same bits.
TEST(OpTable, NodesBoundInParallelTrainTheSameBits) {
  auto train = [](const char* threads) {
    ScopedEnv set("FERRY_BUILD_THREADS", threads);
    Runtime runtime;
    TrainerOptions o;
    o.batch = 8;
    o.lr = 0.01f;
    Trainer trainer(runtime, models::mlp({32, 32}), o);
    const auto images = random_vector(8 * 784, 11, 0.0f, 1.0f);
    const auto labels = labels_for(8, 12);
    for (int i = 0; i < 3; ++i) trainer.step(images, labels);
    std::vector<std::vector<float>> weights;
    for (const auto& name : trainer.parameter_names()) weights.push_back(trainer.read_parameter(name));
    return weights;
  };
  const auto serial = train("1");
  const auto parallel = train("4");
  ASSERT_EQ(serial.size(), parallel.size());
  for (std::size_t i = 0; i < serial.size(); ++i) {
    ASSERT_EQ(serial[i].size(), parallel[i].size());
    EXPECT_EQ(std::memcmp(serial[i].data(), parallel[i].data(), serial[i].size() * sizeof(float)), 0)
        << "parameter " << i;
  }
}

// When several nodes fail to bind, the error is the first failing node's in node order, whichever
// thread got to which node first, and although the first node of each op kind binds before the
// others: here a later op kind that never binds does not hide the second node of the first.
TEST(OpTable, ParallelBindReportsTheFirstFailingNode) {
  static std::atomic<int> binds{0};
  ops::OpInfo picky;
  picky.name = "user_binds_once";
  picky.infer = [](const ops::ShapeView& v) { return std::vector<ops::TensorDesc>{v.input(0)}; };
  picky.bind = [](const ops::BindContext& c) -> ops::LaunchList {
    if (binds++ == 0) return {};  // the first node of the kind binds alone, before the others
    throw std::runtime_error(fmt::format("cannot bind {}", c.name()));
  };
  picky.backward = pass_gradient_through;
  picky.reference = [](ops::RefContext&) {};
  const ops::OpId picky_id = ops::register_op(picky);
  ops::OpInfo never = picky;
  never.name = "user_never_binds";
  never.bind = [](const ops::BindContext& c) -> ops::LaunchList {
    throw std::runtime_error(fmt::format("cannot bind {}", c.name()));
  };
  const ops::OpId never_id = ops::register_op(never);
  const ModelSpec m =
      models::classifier("picky", graph::Shape{4}, 2, [picky_id, never_id](graph::Builder& b, TensorId x) {
        TensorId h = b.linear(x, 2);
        for (int i = 0; i < 24; ++i) {
          const TensorId in[] = {h};
          h = b.apply(picky_id, in)[0];
        }
        const TensorId in[] = {h};
        return b.apply(never_id, in)[0];
      });
  std::string first;  // bound one node at a time: the second node's error
  for (const char* threads : {"1", "4", "4", "4"}) {
    ScopedEnv set("FERRY_BUILD_THREADS", threads);
    binds = 0;
    Runtime rt;
    try {
      Trainer t(rt, m, TrainerOptions{});
      ADD_FAILURE() << "no node but the first binds";
    } catch (const std::runtime_error& e) {
      if (first.empty()) first = e.what();
      EXPECT_EQ(std::string(e.what()), first) << "FERRY_BUILD_THREADS=" << threads;
    }
  }
  // The picky op's nodes are the graph's second to 25th: the first failure is its second node's.
  EXPECT_NE(first.find("cannot bind user_binds_once2"), std::string::npos) << first;
}

TEST(OpTable, DtypeTheOpDoesNotTakeIsACompileTimeErrorNamingOpAndTensor) {
  Runtime runtime;
  graph::Graph g;
  ClassifierBuilder b(g, 4, graph::Shape{8}, 3);
  // A bf16 activation fed to the loss, whose kernels are f32 only.
  const TensorId half = g.tensors.add("x.bf16", graph::Shape{4, 3}, graph::DType::bf16, graph::Role::activation);
  b.softmax_xent(half);
  g = graph::prepare_step_graph(std::move(g), graph::VariantKey{4, false}, {});
  try {
    graph::CompiledStep step(std::move(g), {}, runtime.env(), runtime.context());
    FAIL() << "compiled a bf16 operand into an f32-only op";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'softmax_xent'"), std::string::npos) << what;
    EXPECT_NE(what.find("bf16"), std::string::npos) << what;
    EXPECT_NE(what.find("x.bf16"), std::string::npos) << what;
  }
}

// A forward pass through cast and int8 nodes: activations in bf16 between casts, and a weight
// quantized to int8 per output channel and dequantized before its Linear (what the Predict
// phase will do), on the device and through the rows' references.
TEST(OpTable, CastAndInt8NodesRunOnTheDeviceLikeTheirReferences) {
  Runtime runtime;
  graph::Graph g;
  ClassifierBuilder b(g, 8, graph::Shape{12}, 4);
  const graph::NodeAttrs to_bf16 = ops::CastAttrs{.to = graph::DType::bf16}.pack();
  const graph::NodeAttrs to_f32 = ops::CastAttrs{.to = graph::DType::f32}.pack();
  const graph::NodeAttrs layout = ops::QuantAttrs{{16, 4, 1}}.pack();  // a Linear weight [in, out]: 4 output channels
  TensorId h = b.linear(b.input(), 16);
  const TensorId h_in[] = {h};
  h = b.apply(graph::builtin::cast, h_in, to_bf16)[0];
  EXPECT_EQ(g.tensors.dtype[h], graph::DType::bf16);
  h = b.relu(h);  // in bf16
  const TensorId r_in[] = {h};
  h = b.apply(graph::builtin::cast, r_in, to_f32)[0];
  const TensorId w = g.tensors.add("head.w", graph::Shape{16, 4}, graph::DType::f32, graph::Role::weight);
  g.tensors.init[w] = {graph::WeightInit::Kind::uniform, 0.5f};
  const TensorId w_in[] = {w};
  const auto q = b.apply(graph::builtin::quantize_i8, w_in, layout);
  EXPECT_EQ(g.tensors.dtype[q[0]], graph::DType::i8);
  const TensorId dq_in[] = {q[0], q[1]};
  const TensorId w8 = b.apply(graph::builtin::dequantize_i8, dq_in, layout)[0];
  const TensorId lin_in[] = {h, w8};
  b.softmax_xent(b.apply(graph::builtin::linear, lin_in)[0]);
  g = graph::prepare_step_graph(std::move(g), graph::VariantKey{8, false}, {});

  graph::CompiledStep step(g, {}, runtime.env(), runtime.context());
  ReferenceExecutor ref(g, {});
  const auto& t = step.graph().tensors;
  std::uint32_t seed = 11;
  for (TensorId id = 0; id < t.size(); ++id) {
    if (t.role[id] != graph::Role::weight) continue;
    const auto v = random_vector(t.shape[id].elems(), seed++);
    step.persistent()->write(t.home[id], t.placement[id], v.data(), t.bytes(id));
    ref.value(id) = to_double(v);
  }
  const auto images = random_vector(8 * 12, 5, -2.0f, 2.0f);
  const std::vector<std::int32_t> labels = {0, 1, 2, 3, 3, 2, 1, 0};
  std::copy(images.begin(), images.end(), step.host_input_as<float>("input").begin());
  std::copy(labels.begin(), labels.end(), step.host_input_as<std::int32_t>("labels").begin());
  step.run(ops::StepInfo{1, 0.0f});
  ref.value(ref.find("input")) = to_double(images);
  ref.ints(ref.find("labels")) = labels;
  ref.run(ops::StepInfo{1, 0.0f}, true);
  EXPECT_NEAR(step.stats_host()[0], ref.loss(), 1e-5 * std::max(1.0, std::abs(ref.loss())));
  EXPECT_EQ(step.stats_host()[1], ref.value(g.loss)[1]) << "correct count";
  // The int8 path changed the weight (quantization is lossy) and the reference saw the same.
  const auto& wd = ref.value(w8);
  const auto& wf = ref.value(w);
  double max_err = 0, max_abs = 0;
  for (std::size_t i = 0; i < wd.size(); ++i) {
    max_err = std::max(max_err, std::abs(wd[i] - wf[i]));
    max_abs = std::max(max_abs, std::abs(wf[i]));
  }
  EXPECT_GT(max_err, 0.0);
  EXPECT_LE(max_err, max_abs / 127 / 2 * 1.0001) << "int8 error beyond half a quantization step";
}

// Linear and LayerNorm over the last axis of rank-3 tensors, between reshapes (views), trained on
// the device against the reference executor and checked by finite differences.
ModelSpec rank3_model() {
  return models::classifier("rank3", graph::Shape{12}, 4, [](graph::Builder& b, TensorId x) {
    const std::uint32_t batch = b.batch();
    x = b.reshape(x, graph::Shape{batch, 3, 4});
    x = b.gelu(b.linear(b.layernorm(x), 5));  // [batch, 3, 5]
    return b.linear(b.reshape(x, graph::Shape{batch, 15}), 4);
  });
}

TEST(OpTable, LinearAndLayerNormTakeAnyRank) {
  Runtime runtime;
  TrainerOptions topt;
  topt.batch = 6;
  topt.lr = 0.05f;
  topt.optimizer.kind = ops::OptimizerConfig::Kind::sgd;
  Trainer trainer(runtime, rank3_model(), topt);
  const auto& g = compiled_train_step(trainer).graph();
  ReferenceExecutor ref(g, topt.optimizer);
  for (const auto& name : trainer.parameter_names())
    ref.value(ref.find(name)) = to_double(trainer.read_parameter(name));
  for (std::uint32_t s = 0; s < 3; ++s) {
    const auto images = random_vector(topt.batch * 12, 60 + s);
    const std::vector<std::int32_t> labels = {0, 1, 2, 3, 2, 1};
    const auto r = trainer.step(images, labels);
    ref.value(ref.find("input")) = to_double(images);
    ref.ints(ref.find("labels")) = labels;
    ref.run(ops::StepInfo{s + 1, topt.lr});
    EXPECT_NEAR(r.loss, ref.loss(), 1e-4 * std::max(1.0, std::abs(ref.loss()))) << "step " << s;
  }
  const auto w = trainer.read_parameter("linear1.w");
  EXPECT_EQ(w.size(), 4u * 5u);

  // Gradients of the rank-3 path by finite differences on the reference.
  graph::Graph fd = graph::prepare_step_graph(forward_graph(rank3_model(), graph::VariantKey{2, true}),
                                              graph::VariantKey{2, true}, topt.optimizer);
  ReferenceExecutor x(fd, topt.optimizer);
  std::uint32_t seed = 90;
  for (TensorId id = 0; id < fd.tensors.size(); ++id) {
    if (fd.tensors.role[id] == graph::Role::weight)
      x.value(id) = to_double(random_vector(fd.tensors.shape[id].elems(), seed++));
  }
  x.value(x.find("input")) = to_double(random_vector(24, 7));
  x.ints(x.find("labels")) = {1, 3};
  x.run(ops::StepInfo{1, 0.0f});
  for (const char* name : {"layernorm0.gamma", "linear1.w", "linear3.w"}) {
    const TensorId t = x.find(name);
    expect_reference_gradient_matches_finite_differences(x, t, fd.tensors.grad[t], name, 20);
  }
}

TEST(OpTable, BuilderLayoutMethodsUseTheirRows) {
  graph::Graph g;
  ClassifierBuilder b(g, 2, graph::Shape{12}, 4);
  const TensorId x = b.reshape(b.input(), graph::Shape{2, 3, 4});
  const TensorId p = b.permute(x, {0, 2, 1});
  EXPECT_EQ(g.tensors.shape[p], (graph::Shape{2, 4, 3}));
  EXPECT_EQ(g.tensors.shape[b.mul(p, p)], (graph::Shape{2, 4, 3}));
  const TensorId s = b.scale(x, 0.25f);
  EXPECT_EQ(ops::op_info(g.nodes.op.back()).name, "scale");
  EXPECT_EQ(ops::FactorAttrs::of(g.nodes.attrs.back()).factor, 0.25f);
  EXPECT_EQ(g.tensors.shape[s], g.tensors.shape[x]);
  EXPECT_THROW(b.permute(x, {0, 1, 1}), graph::BuildError);
  EXPECT_THROW(b.mul(x, p), graph::BuildError);
}

TEST(OpTable, BuilderSequenceMethodsAndDropoutOnlyWhenTraining) {
  for (bool training : {true, false}) {
    graph::Graph g;
    ClassifierBuilder b(g, 2, graph::Shape{5}, 4);
    b.set_training(training);
    g.tensors.dtype[b.input()] = graph::DType::i32;  // token ids
    const TensorId e = b.embedding(b.input(), 11, 6);
    EXPECT_EQ(g.tensors.shape[e], (graph::Shape{2, 5, 6}));
    EXPECT_EQ(g.tensors.shape[g.tensors.size() - 2], (graph::Shape{11, 6})) << "the table";
    const TensorId d = b.dropout(e, 0.25f, 7);
    EXPECT_EQ(d == e, !training) << "dropout is the identity when not training";
    const TensorId w = b.linear(d, 3);
    EXPECT_EQ(g.tensors.name[w], "linear2.y") << "layer names do not depend on training";
    const TensorId sq = b.reshape(b.linear(w, 5), graph::Shape{2, 5, 5});
    const TensorId masked = b.causal_mask(sq);
    EXPECT_EQ(g.tensors.shape[masked], (graph::Shape{2, 5, 5}));
    // Attention's shape: softmax(q kᵀ / sqrt(d)) v.
    const TensorId q = b.linear(w, 4), k = b.linear(w, 4), v = b.linear(w, 4);
    const TensorId scores = b.matmul(q, k, false, true, 0.5f);
    EXPECT_EQ(g.tensors.shape[scores], (graph::Shape{2, 5, 5}));
    EXPECT_EQ(ops::MatmulAttrs::of(g.nodes.attrs.back()).alpha, 0.5f);
    EXPECT_EQ(g.tensors.shape[b.matmul(b.softmax(b.causal_mask(scores)), v)], (graph::Shape{2, 5, 4}));
    EXPECT_THROW(b.matmul(q, v), graph::BuildError) << "[2,5,4] x [2,5,4] does not multiply";
  }
}

TEST(OpTable, ReshapeToAnotherElementCountIsABuildError) {
  graph::Graph g;
  ClassifierBuilder b(g, 2, graph::Shape{12}, 4);
  EXPECT_THROW(b.reshape(b.input(), graph::Shape{2, 5}), graph::BuildError);
}

TEST(OpTable, CastToAnIntegerTypeIsABuildError) {
  graph::Graph g;
  ClassifierBuilder b(g, 2, graph::Shape{4}, 2);
  const graph::NodeAttrs to_i32 = ops::CastAttrs{.to = graph::DType::i32}.pack();
  const TensorId in[] = {b.input()};
  EXPECT_THROW(b.apply(graph::builtin::cast, in, to_i32), graph::BuildError);
}

}  // namespace
}  // namespace ferry::test
