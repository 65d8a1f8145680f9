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
//
// --model gpt compiles the decoder (models::gpt with a 256-token vocabulary, --width, --heads,
// --context; each --depth a number of blocks) without allocating it, so models far larger than
// this machine's memory can be timed: the model passes, then the planning passes of the compile
// (check dtypes, scratch, residency and memory plan: graph::plan_step); no arena, no binding
// (without kernels binding only resolves buffers, which a plan-only compile has none of) and no
// lowering. Its lines say "plan_only": true.
#include <fmt/format.h>

#include <cstdio>
#include <map>

#include "bench.hpp"
#include "ferry/ferry.hpp"
#include "graph/pipeline.hpp"
#include "graph/step_plan.hpp"
#include "runtime/cli/validators.hpp"
#include "runtime/trainer_internals.hpp"

namespace ferry::bench {
namespace {

struct CompileBenchOptions {
  std::string model = "deep";
  std::vector<std::uint32_t> depths{100, 250, 500, 1000, 2000, 4000};
  std::uint32_t width = 64, batch = 64;
  std::uint32_t heads = 4, context = 128;  // gpt
  std::string residency = "resident";
  std::string budget;         // device budget, e.g. 64MiB; empty: no limit beyond the device's
  bool bind_kernels = false;  // also build and bind every kernel (what the trainer's compile does)
};

ModelSpec make_model(const CompileBenchOptions& o, std::uint32_t depth) {
  if (o.model == "deep") return models::deep(o.width, depth);
  models::GptConfig c;
  c.vocab = 256;
  c.width = o.width;
  c.depth = depth;
  c.heads = o.heads;
  c.context = o.context;
  return models::gpt(c);
}

graph::Graph build_deep(const ModelSpec& model, std::uint32_t batch, const ops::OptimizerConfig& optimizer) {
  const graph::VariantKey key{batch, true};
  return graph::prepare_step_graph(forward_graph(model, key), key, optimizer);
}

int run_compile(const BenchCommon& common, const CompileBenchOptions& o) {
  if (o.depths.empty()) throw std::invalid_argument("--depth: give at least one depth");
  graph::ResidencyOptions residency;
  if (!o.budget.empty()) {
    residency.budget_bytes =
        cli::budget_option("--device-budget", o.budget, ' ', "leave --device-budget out for no limit");
  }
  Runtime runtime({.device = common.device});
  residency.mode = graph::parse_residency_mode(o.residency);
  ops::OptimizerConfig optimizer;
  optimizer.kind = ops::OptimizerConfig::Kind::adam;
  const graph::StepOptions step_options{residency, false, o.bind_kernels};
  const bool plan_only = o.model == "gpt";
  // One compile of `g`: a CompiledStep, or for plan-only models the planning passes alone.
  struct Compiled {
    std::size_t nodes = 0, tensors = 0;
    std::vector<graph::PassTiming> passes;
    nlohmann::json plan;
  };
  const auto compile = [&](graph::Graph g, Compiled* out) {
    if (plan_only) {
      const graph::StepPlan p = graph::plan_step(g, runtime.env(), runtime.device(), nullptr, residency);
      if (!out) return;
      *out = Compiled{g.nodes.size(), g.tensors.size(), p.pass_timings,
                      nlohmann::json{{"residency_chosen", graph::residency_mode_name(p.residency.mode)},
                                     {"transient_bytes", p.memory.transient_bytes},
                                     {"persistent_bytes", p.memory.persistent_bytes},
                                     {"device_bytes", p.memory.peak_bytes()},
                                     {"fetches", p.residency.fetches},
                                     {"fetch_bytes", p.residency.fetch_bytes},
                                     {"write_backs", p.residency.write_backs}}};
      return;
    }
    graph::CompiledStep step(std::move(g), optimizer, runtime.env(), runtime.context(), nullptr, step_options);
    if (!out) return;
    *out = Compiled{step.node_count(), step.graph().tensors.size(), step.pass_timings(),
                    nlohmann::json{{"residency_chosen", graph::residency_mode_name(step.residency().mode)},
                                   {"transient_bytes", step.plan().transient_bytes},
                                   {"persistent_bytes", step.plan().persistent_bytes},
                                   {"device_bytes", step.device_bytes()},
                                   {"fetches", step.residency().fetches},
                                   {"fetch_bytes", step.residency().fetch_bytes},
                                   {"write_backs", step.residency().write_backs}}};
  };

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
      compile(build_deep(make_model(o, o.depths.front()), o.batch, optimizer), nullptr);
    } catch (const graph::BudgetError&) {
      // reported below, for that depth
    }
  }
  for (const std::uint32_t depth : o.depths) {
    if (depth == 0) throw std::invalid_argument("--depth: a model needs at least one block");
    const ModelSpec model = make_model(o, depth);
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
        Compiled step;
        compile_ms.push_back(time_ms([&] { compile(std::move(g), &step); }));
        nodes = step.nodes;
        for (const auto& pass : step.passes) pass_ms[pass.name].push_back(pass.ms);
        tensors = step.tensors;
        plan = step.plan;
      }
      const double b = median(build_ms), c = median(compile_ms);
      const double per_node = c * 1e3 / double(nodes);
      results.push_back({depth, nodes, per_node});
      nlohmann::json j = {{"bench", "compile"},
                          {"model", o.model},
                          {"plan_only", plan_only},
                          {"depth", depth},
                          {"width", o.width},
                          {"heads", o.model == "gpt" ? nlohmann::json(o.heads) : nlohmann::json(nullptr)},
                          {"context", o.model == "gpt" ? nlohmann::json(o.context) : nlohmann::json(nullptr)},
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
                 {"model", o.model},
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
  sub.add_option("--model", o->model,
                 "deep (the residual MLP, compiled) or gpt (the decoder, planned only: nothing allocated)")
      ->capture_default_str()
      ->check(CLI::IsMember({"deep", "gpt"}));
  sub.add_option("--depth", o->depths,
                 "residual blocks of the deep model (decoder blocks of gpt), repeatable (default 100 ... 4000)")
      ->check(ferry::cli::positive_number());
  sub.add_option("--width", o->width, "model width")->capture_default_str()->check(ferry::cli::positive_number());
  sub.add_option("--heads", o->heads, "gpt: attention heads")
      ->capture_default_str()
      ->check(ferry::cli::positive_number());
  sub.add_option("--context", o->context, "gpt: tokens per window")
      ->capture_default_str()
      ->check(ferry::cli::positive_number());
  sub.add_option("--batch", o->batch, "samples per step")->capture_default_str()->check(ferry::cli::positive_number());
  sub.add_option("--residency", o->residency, "where weights and optimizer state live")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "resident", "stream", "mapped"}));
  sub.add_option("--device-budget", o->budget, "device bytes a step may use, e.g. 64MiB (default: no limit)");
  sub.add_flag("--bind-kernels", o->bind_kernels,
               "also create and bind every node's kernels, as the trainer does (default: plan and lower only)");
  return [o, &common] { return run_compile(common, *o); };
}

FERRY_BENCH("compile",
            "compile time of a model's training step against its depth (deep: plan and lower; gpt: plan only)", setup);

}  // namespace
}  // namespace ferry::bench
