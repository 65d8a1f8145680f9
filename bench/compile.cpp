// ferry-bench compile: how does compile time grow with the model's depth?
//
// For each depth, the deep residual MLP (models::deep(width, depth)) is built the way the
// trainer builds its training step (Builder, forward, softmax_xent, then the model passes:
// autodiff, the optimizer with Adam, download), then compiled with graph::CompiledStep
// without building any kernel (StepOptions::bind_kernels = false, unless --bind-kernels): scratch,
// residency plan, memory plan, arena allocation and lowering to the flow graph. Build and compile are timed
// separately, --repeat times each; each line reports the medians, the compile time per node of
// the compiled step and the median time of each device pass of the compile ("pass_ms"). A last
// line compares the per-node time at the largest depth with the smallest: about 1 when compile
// time grows linearly (or n log n) with the node count. One untimed compile first warms the
// process up. A depth whose step does not fit --device-budget gets an "error" line with the
// minimum budget.
#include <fmt/format.h>

#include <cstdio>
#include <map>

#include "bench.hpp"
#include "ferry/ferry.hpp"
#include "ferry/graph/pipeline.hpp"

namespace ferry::bench {
namespace {

struct CompileBenchOptions {
  std::vector<std::uint32_t> depths{100, 250, 500, 1000, 2000, 4000};
  std::uint32_t width = 64, batch = 64;
  std::string residency = "resident";
  std::string budget;         // device budget, e.g. 64MiB; empty: no limit beyond the device's
  bool bind_kernels = false;  // also build and bind every kernel (what the trainer's compile does)
};

graph::Graph build_deep(const ModelSpec& model, std::uint32_t batch, const graph::OptimizerSpec& optimizer) {
  const graph::VariantKey key{batch, true};
  return graph::prepare_step_graph(forward_graph(model, key), key, optimizer);
}

int run_compile(const BenchCommon& common, const CompileBenchOptions& o) {
  if (o.depths.empty()) throw std::invalid_argument("--depth: give at least one depth");
  Runtime runtime({.device = common.device});
  graph::ResidencyOptions residency;
  residency.mode = graph::parse_residency_mode(o.residency);
  if (!o.budget.empty()) residency.budget_bytes = parse_bytes(o.budget);
  graph::OptimizerSpec optimizer;
  optimizer.kind = graph::OptimizerSpec::Kind::adam;
  const graph::StepOptions step_options{residency, false, o.bind_kernels};

  struct PerDepth {
    std::uint32_t depth;
    std::size_t nodes;
    double us_per_node;
  };
  std::vector<PerDepth> results;
  int status = 0;
  // Warm-up (untimed): the first compile of a process pays for first-use set-up (kernel tuning
  // tables, allocator growth) that later compiles do not.
  {
    fmt::print(stderr, "compile: warm-up (depth {})\n", o.depths.front());
    try {
      graph::CompiledStep warm(build_deep(models::deep(o.width, o.depths.front()), o.batch, optimizer), optimizer,
                               runtime.env(), runtime.context(), nullptr, step_options);
    } catch (const graph::BudgetError&) {
      // reported below, for that depth
    }
  }
  for (const std::uint32_t depth : o.depths) {
    if (depth == 0) throw std::invalid_argument("--depth: a deep model needs at least one block");
    const ModelSpec model = models::deep(o.width, depth);
    try {
      std::vector<double> build_ms, compile_ms;
      std::size_t nodes = 0, tensors = 0;
      nlohmann::json plan;
      std::map<std::string, std::vector<double>> pass_ms;  // per device pass of the compile
      for (int r = 0; r < common.repeat; ++r) {
        fmt::print(stderr, "compile: depth {} width {} batch {}: repetition {}/{}\n", depth, o.width, o.batch, r + 1,
                   common.repeat);
        graph::Graph g;
        build_ms.push_back(time_ms([&] { g = build_deep(model, o.batch, optimizer); }));
        std::unique_ptr<graph::CompiledStep> step;
        compile_ms.push_back(time_ms([&] {
          step = std::make_unique<graph::CompiledStep>(std::move(g), optimizer, runtime.env(), runtime.context(),
                                                       nullptr, step_options);
        }));
        nodes = step->node_count();
        for (const auto& pass : step->pass_timings()) pass_ms[pass.name].push_back(pass.ms);
        tensors = step->graph().tensors.size();
        const graph::MemoryPlan& p = step->plan();
        plan = {{"residency_chosen", graph::residency_mode_name(step->residency().mode)},
                {"transient_bytes", p.transient_bytes},
                {"persistent_bytes", p.persistent_bytes},
                {"device_bytes", step->device_bytes()},
                {"fetches", step->residency().fetches},
                {"fetch_bytes", step->residency().fetch_bytes},
                {"write_backs", step->residency().write_backs}};
      }
      const double b = median(build_ms), c = median(compile_ms);
      const double per_node = c * 1e3 / double(nodes);
      results.push_back({depth, nodes, per_node});
      nlohmann::json j = {{"bench", "compile"},
                          {"depth", depth},
                          {"width", o.width},
                          {"batch", o.batch},
                          {"residency", o.residency},
                          {"device_budget", o.budget.empty() ? "none" : o.budget},
                          {"nodes", nodes},
                          {"tensors", tensors},
                          {"build_ms", b},
                          {"compile_ms", c},
                          {"total_ms", b + c},
                          {"us_per_node", per_node},
                          {"repeat", common.repeat},
                          {"runs_build_ms", build_ms},
                          {"runs_compile_ms", compile_ms},
                          {"device", runtime.device().name}};
      j.update(plan);
      nlohmann::json passes = nlohmann::json::object();
      for (const auto& [name, ms] : pass_ms) passes[name] = median(ms);
      j["pass_ms"] = passes;
      emit_json(j);
    } catch (const graph::BudgetError& e) {
      emit_json({{"bench", "compile"},
                 {"depth", depth},
                 {"width", o.width},
                 {"batch", o.batch},
                 {"residency", o.residency},
                 {"device_budget", o.budget.empty() ? "none" : o.budget},
                 {"error", e.what()},
                 {"min_budget_bytes", e.min_budget()}});
      status = 1;
    }
  }
  if (results.empty()) return 1;
  const auto [lo, hi] = std::minmax_element(results.begin(), results.end(),
                                            [](const PerDepth& a, const PerDepth& b) { return a.nodes < b.nodes; });
  emit_json({{"bench", "compile"},
             {"result", "scaling"},
             {"smallest_depth", lo->depth},
             {"largest_depth", hi->depth},
             {"us_per_node_smallest", lo->us_per_node},
             {"us_per_node_largest", hi->us_per_node},
             {"per_node_ratio_max_over_min", hi->us_per_node / lo->us_per_node}});
  return status;
}

BenchRun setup(CLI::App& sub, const BenchCommon& common) {
  auto o = std::make_shared<CompileBenchOptions>();
  sub.add_option("--depth", o->depths, "residual blocks of the deep model, repeatable (default 100 ... 4000)")
      ->check(CLI::PositiveNumber);
  sub.add_option("--width", o->width, "deep model: width")->capture_default_str()->check(CLI::PositiveNumber);
  sub.add_option("--batch", o->batch, "samples per step")->capture_default_str()->check(CLI::PositiveNumber);
  sub.add_option("--residency", o->residency, "where weights and optimizer state live")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "resident", "stream", "mapped"}));
  sub.add_option("--device-budget", o->budget, "device bytes a step may use, e.g. 64MiB (default: no limit)");
  sub.add_flag("--bind-kernels", o->bind_kernels,
               "also create and bind every node's kernels, as the trainer does (default: plan and lower only)");
  return [o, &common] { return run_compile(common, *o); };
}

FERRY_BENCH("compile", "compile time of the deep residual model's training step against its depth (plan and lower)",
            setup);

}  // namespace
}  // namespace ferry::bench
