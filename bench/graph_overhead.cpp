// ferry-bench graph: what does the compiled step's scheduling cost per node?
//
// A forward-only step graph of N trivial ops: upload, a chain of N ReLU layers on a tiny input
// ([4, 16] floats), the softmax cross-entropy loss and the stats download, built through
// graph::Builder and compiled with graph::CompiledStep (memory plan, bound kernels; no host-lane
// node, so it runs in the one-pass form: enqueued in static order with event wait lists, one wait
// for its end through a completion callback). Against it, a plain loop that enqueues the same
// work on one queue (writes, the same ReLU and loss kernels bound through the ops functions, the
// read) with one clFinish. Both are divided by the graph's node count (N + 3); the difference is
// what the step's wait lists, flushes, cross-queue copies and completion wait add per node.
// Medians over --repeat, each the mean of --runs steps, the two interleaved.
#include <fmt/format.h>

#include <cstdio>
#include <random>

#include "bench.hpp"
#include "ferry/cl/error.hpp"
#include "ferry/ferry.hpp"
#include "ferry/ops/activation.hpp"
#include "ops/softmax_xent.hpp"
#include "runtime/cli/validators.hpp"
#include "runtime/trainer_internals.hpp"

namespace ferry::bench {
namespace {

struct GraphBenchOptions {
  std::vector<std::uint32_t> sizes{100, 1000};
  std::uint32_t batch = 4, classes = 16;
  int runs = 10;
};

graph::Graph relu_chain(std::uint32_t n, std::uint32_t batch, std::uint32_t classes) {
  graph::Graph g;
  graph::Builder b(g, batch);
  TensorId x = b.input("input", graph::Shape{classes});
  const TensorId labels = b.input("labels", graph::Shape{}, graph::DType::i32, graph::Role::label);
  for (std::uint32_t i = 0; i < n; ++i) x = b.relu(x);
  b.softmax_xent(x, labels);
  graph::append_stats_download(g);
  return g;
}

int run_graph(const BenchCommon& common, const GraphBenchOptions& o) {
  Runtime runtime({.device = common.device});
  const cl::Context& ctx = runtime.context();
  const cl_command_queue q = ctx.compute();
  const std::size_t elems = std::size_t(o.batch) * o.classes;

  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> input(elems);
  for (float& v : input) v = normal(rng);
  std::vector<std::int32_t> labels(o.batch);
  for (std::uint32_t i = 0; i < o.batch; ++i) labels[i] = static_cast<std::int32_t>((i * 5) % o.classes);

  for (const std::uint32_t n : o.sizes) {
    if (n == 0) throw std::invalid_argument("--sizes: a chain needs at least one ReLU");
    // The compiled step.
    graph::CompiledStep step(relu_chain(n, o.batch, o.classes), ops::OptimizerConfig{}, runtime.env(), ctx);
    std::ranges::copy(input, step.host_input_as<float>("input").begin());
    std::ranges::copy(labels, step.host_input_as<std::int32_t>("labels").begin());
    const std::size_t nodes = step.node_count();

    // The plain loop: the same commands on the compute queue, one clFinish.
    cl::Mem x = ctx.create_buffer(elems * 4, "graph bench x");
    cl::Mem y = ctx.create_buffer(elems * 4, "graph bench y");
    cl::Mem in = ctx.create_buffer(elems * 4, "graph bench input");
    cl::Mem lab = ctx.create_buffer(o.batch * 4, "graph bench labels");
    cl::Mem probs = ctx.create_buffer(elems * 4, "graph bench probs");
    cl::Mem stats = ctx.create_buffer(2 * 4, "graph bench stats");
    std::vector<ops::LaunchList> chain;
    chain.push_back(ops::activation_forward(runtime.env(), ops::Activation::relu, {in.get(), 0}, {x.get(), 0}, elems));
    chain.push_back(ops::activation_forward(runtime.env(), ops::Activation::relu, {x.get(), 0}, {y.get(), 0}, elems));
    chain.push_back(ops::activation_forward(runtime.env(), ops::Activation::relu, {y.get(), 0}, {x.get(), 0}, elems));
    const cl_mem last = n % 2 ? x.get() : y.get();  // relu i writes x for even i, y for odd i
    const ops::LaunchList loss = ops::softmax_xent_forward(runtime.env(), {last, 0}, {lab.get(), 0}, {probs.get(), 0},
                                                           {stats.get(), 0}, o.batch, o.classes);
    float loop_stats[2] = {0, 0};
    auto loop = [&] {
      FERRY_CL(clEnqueueWriteBuffer(q, in.get(), CL_FALSE, 0, elems * 4, input.data(), 0, nullptr, nullptr));
      FERRY_CL(clEnqueueWriteBuffer(q, lab.get(), CL_FALSE, 0, o.batch * 4, labels.data(), 0, nullptr, nullptr));
      for (std::uint32_t i = 0; i < n; ++i) ops::enqueue(q, chain[i == 0 ? 0 : (i % 2 ? 1 : 2)], {});
      ops::enqueue(q, loss, {});
      FERRY_CL(clEnqueueReadBuffer(q, stats.get(), CL_FALSE, 0, 2 * 4, loop_stats, 0, nullptr, nullptr));
      FERRY_CL(clFinish(q));
    };
    auto compiled = [&] { step.run(ops::StepInfo{}); };

    compiled();
    loop();
    if (std::abs(step.stats_host()[0] - loop_stats[0]) > 1e-5f * (1 + std::abs(loop_stats[0])) ||
        step.stats_host()[1] != loop_stats[1]) {
      throw std::runtime_error(fmt::format("graph and loop disagree: loss {} vs {}, correct {} vs {}",
                                           step.stats_host()[0], loop_stats[0], step.stats_host()[1], loop_stats[1]));
    }
    std::vector<double> t_graph, t_loop;
    for (int r = 0; r < common.repeat; ++r) {
      t_graph.push_back(time_ms([&] {
                          for (int k = 0; k < o.runs; ++k) compiled();
                        }) *
                        1e3 / o.runs / double(nodes));
      t_loop.push_back(time_ms([&] {
                         for (int k = 0; k < o.runs; ++k) loop();
                       }) *
                       1e3 / o.runs / double(nodes));
    }
    const double g = median(t_graph), l = median(t_loop);
    emit_json({{"bench", "graph"},
               {"relu_nodes", n},
               {"nodes", nodes},
               {"elems", elems},
               {"runs", o.runs},
               {"repeat", common.repeat},
               {"device", runtime.device().name},
               {"graph_us_per_node", g},
               {"loop_us_per_node", l},
               {"overhead_us_per_node", g - l},
               {"ratio_graph_over_loop", g / l},
               {"graph_step_ms", g * double(nodes) * 1e-3},
               {"loop_step_ms", l * double(nodes) * 1e-3},
               {"runs_graph_us_per_node", t_graph},
               {"runs_loop_us_per_node", t_loop}});
  }
  return 0;
}

BenchRun setup(CLI::App& sub, const BenchCommon& common) {
  auto o = std::make_shared<GraphBenchOptions>();
  sub.add_option("--sizes", o->sizes, "ReLU nodes in the chain")
      ->delimiter(',')
      ->capture_default_str()
      ->check(ferry::cli::whole_number())
      ->check(CLI::Range(1, 1 << 20));
  sub.add_option("--runs", o->runs, "steps per timed repetition")
      ->capture_default_str()
      ->check(ferry::cli::positive_number());
  return [o, &common] { return run_graph(common, *o); };
}

FERRY_BENCH("graph", "compiled-step scheduling overhead: N-node ReLU chain through the flow graph vs a plain loop",
            setup);

}  // namespace
}  // namespace ferry::bench
