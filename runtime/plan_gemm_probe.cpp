// The GEMM rate at a step's own products (include/ferry/runtime/plan.hpp, measure_step_gemm_gflops).
//
// One 1024^3 product stands badly for a step's: on an H200 it ran at 27.7 TFLOPS where a 1.0B GPT's
// products ran at 35-42, so the planner predicted its resident step at 540 ms against 334 measured;
// on a CPU the backward's products (long-K weight gradients, an activation's derivative in the
// input gradient's epilogue) and attention run 15-40% below the square. So the probe runs the
// step's own product nodes, bound as a compiled step binds them (the same row, attrs, dtypes and
// epilogues), on zeroed operands of their own: the largest first, within a time budget, at a
// smaller batch where the step's products would take too long (or too much memory) to probe.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "ferry/cl/error.hpp"
#include "ferry/runtime/plan.hpp"
#include "graph/node_view.hpp"
#include "runtime/plan_search.hpp"
#include "trainer_variants.hpp"

namespace ferry {
namespace {

using graph::NodeId;
using graph::TensorId;
using Clock = std::chrono::steady_clock;

// A product node's binding onto buffers of its own (zeroed: any value times well, and zeros are
// finite for the guard checks some products carry).
class ProbeBinding final : public graph::NodeView<ops::BindContext> {
 public:
  ProbeBinding(const graph::Graph& g, NodeId n, ops::OpEnv& env, std::vector<ops::DeviceSpan> ins,
               std::vector<ops::DeviceSpan> outs, ops::DeviceSpan scratch)
      : NodeView(g, n), env_(env), ins_(std::move(ins)), outs_(std::move(outs)), scratch_(scratch) {}
  ops::DeviceSpan in(std::size_t i) const override { return ins_.at(i); }
  ops::DeviceSpan out(std::size_t i) const override { return outs_.at(i); }
  ops::DeviceSpan scratch() const override { return scratch_; }
  ops::OpEnv& env() const override { return env_; }
  const graph::OptimizerConfig& optimizer() const override { return optimizer_; }
  ops::HostAddress host_in(std::size_t) const override {
    throw std::logic_error("a product probe has no host operands");
  }
  ops::HostAddress host_out(std::size_t) const override {
    throw std::logic_error("a product probe has no host operands");
  }
  ops::DeviceSpan step_status() const override { return {}; }

 private:
  ops::OpEnv& env_;
  graph::OptimizerConfig optimizer_;
  std::vector<ops::DeviceSpan> ins_, outs_;
  ops::DeviceSpan scratch_;
};

// Nodes that run the same kernel on the same sizes: op, operands' shapes and dtypes, attrs.
std::string signature(const graph::Graph& g, NodeId n) {
  std::string key = fmt::format("{}", static_cast<int>(g.nodes.op[n]));
  const auto add = [&](TensorId x) {
    key += fmt::format("|{}:{}", g.tensors.shape[x].str(), static_cast<int>(g.tensors.dtype[x]));
  };
  for (TensorId x : g.nodes.inputs(n)) add(x);
  key += ">";
  for (TensorId x : g.nodes.outputs(n)) add(x);
  const ops::NodeAttrs& a = g.nodes.attrs[n];
  key += fmt::format("#{}", fmt::join(a.i, ","));
  for (const float f : a.f) key += fmt::format(",{:a}", f);
  return key;
}

struct ProductGroup {
  NodeId node = 0;  // one of its nodes
  std::uint64_t flops_each = 0, flops = 0;
};

// The bytes a probe of node n allocates (its operands and its scratch), or nothing when the probe
// does not fit the device: an operand over the largest buffer, or all of them over a quarter of its
// memory (the probe must not fail where the step it plans would stream).
std::optional<std::uint64_t> probe_bytes(const graph::Graph& g, NodeId n, Runtime& runtime) {
  const cl::DeviceInfo& device = runtime.device();
  std::uint64_t total = 0;
  for (const auto ids : {g.nodes.inputs(n), g.nodes.outputs(n)}) {
    for (TensorId x : ids) {
      if (g.tensors.bytes(x) > device.max_alloc_bytes) return std::nullopt;
      total += g.tensors.bytes(x);
    }
  }
  const ops::OpInfo& row = ops::op_info(g.nodes.op[n]);
  if (row.scratch_bytes) total += row.scratch_bytes(graph::NodeView<ops::ShapeView>(g, n), runtime.env());
  if (total > device.global_mem_bytes / 4) return std::nullopt;
  return total;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A product node bound onto zeroed buffers of its own, ready to run.
class BoundProduct {
 public:
  BoundProduct(Runtime& runtime, const graph::Graph& g, NodeId n) : ctx_(runtime.context()) {
    const std::string what = fmt::format("the GEMM probe of '{}'", g.nodes.name[n]);
    std::vector<ops::DeviceSpan> ins, outs;
    for (TensorId x : g.nodes.inputs(n)) ins.push_back(zeroed(g.tensors.bytes(x), what));
    for (TensorId x : g.nodes.outputs(n)) outs.push_back(zeroed(g.tensors.bytes(x), what));
    const ops::OpInfo& row = ops::op_info(g.nodes.op[n]);
    ops::DeviceSpan scratch{};
    if (row.scratch_bytes) {
      const std::size_t bytes = row.scratch_bytes(graph::NodeView<ops::ShapeView>(g, n), runtime.env());
      if (bytes) scratch = zeroed(bytes, what);
    }
    FERRY_CL(clFinish(ctx_.compute()));
    const cl::OpScope scope(g.nodes.name[n]);
    launches_ = row.bind(ProbeBinding(g, n, runtime.env(), std::move(ins), std::move(outs), scratch));
  }

  // Seconds a run, over `times` runs back to back, as a step enqueues its nodes: a lone run would
  // count the queue's round trip (tenths of a millisecond on PoCL) into every product, and the plan
  // counts launches apart.
  double run(std::size_t times) const {
    ops::LaunchList repeated;
    for (std::size_t i = 0; i < times; ++i) repeated.insert(repeated.end(), launches_.begin(), launches_.end());
    const auto t0 = Clock::now();
    ops::run_blocking(ctx_.compute(), repeated);
    return seconds_since(t0) / static_cast<double>(times);
  }

 private:
  ops::DeviceSpan zeroed(std::uint64_t bytes, std::string_view what) {
    const std::uint64_t size = std::max<std::uint64_t>(bytes, 4) / 4 * 4;
    buffers_.push_back(ctx_.create_buffer(size, what));
    const cl_uint zero = 0;
    FERRY_CL(
        clEnqueueFillBuffer(ctx_.compute(), buffers_.back().get(), &zero, sizeof zero, 0, size, 0, nullptr, nullptr));
    return {buffers_.back().get(), 0};
  }

  const cl::Context& ctx_;
  std::vector<cl::Mem> buffers_;
  ops::LaunchList launches_;
};

// Groups bound together and timed in turns: three rounds of about 20 ms each (at most 64 runs; a
// longer product runs once a round), every group once a round, so that a burst of other load on
// the device (a shared machine's neighbours) slows one round of each rather than all of one. A
// round after the first starts only while the budget lasts. Returns each group's best seconds a run.
std::vector<double> time_in_turns(Runtime& runtime, const graph::Graph& g, std::span<const ProductGroup> set,
                                  Clock::time_point t0, double budget_seconds) {
  std::vector<BoundProduct> bound;
  std::vector<double> best;
  std::vector<std::size_t> times;
  for (const ProductGroup& group : set) {
    bound.emplace_back(runtime, g, group.node);
    best.push_back(bound.back().run(1));  // warms up, and says how long the product takes
    times.push_back(std::clamp<std::size_t>(static_cast<std::size_t>(0.02 / std::max(best.back(), 1e-6)), 1, 64));
  }
  for (int round = 0; round < 3; ++round) {
    if (round > 0 && seconds_since(t0) >= budget_seconds) break;
    for (std::size_t i = 0; i < bound.size(); ++i) best[i] = std::min(best[i], bound[i].run(times[i]));
  }
  return best;
}

// The step graph `options` configure, and its products grouped, the largest group first.
struct StepProducts {
  graph::Graph graph;
  std::vector<ProductGroup> groups;
  std::uint64_t flops = 0;
};
StepProducts step_products(const ModelSpec& model, const TrainerOptions& options) {
  const graph::VariantKey key = detail::training_key(options);
  StepProducts out{graph::prepare_step_graph(forward_graph(model, key), key, options.optimizer), {}, 0};
  const graph::Graph& g = out.graph;
  std::map<std::string, ProductGroup> by_signature;
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    if (!detail::at_gemm_rate(g, n)) continue;
    const std::uint64_t f = ops::op_info(g.nodes.op[n]).flops(graph::NodeView<ops::ShapeView>(g, n));
    if (f == 0) continue;
    ProductGroup& group = by_signature[signature(g, n)];
    if (group.flops == 0) group = {n, f, 0};
    group.flops += f;
    out.flops += f;
  }
  for (const auto& [_, group] : by_signature) out.groups.push_back(group);
  std::ranges::sort(out.groups, [](const ProductGroup& a, const ProductGroup& b) { return a.flops > b.flops; });
  return out;
}

}  // namespace

StepGemmRate measure_step_gemm_gflops(Runtime& runtime, const ModelSpec& model, const TrainerOptions& given,
                                      const StepGemmProbe& probe) {
  const auto t0 = Clock::now();
  TrainerOptions options = given;
  detail::validate_trainer_options(model, options);
  StepGemmRate out;
  // What a product may take at the square's rate. A step whose largest product takes more (a 7B GPT
  // on a CPU: 275 GFLOP, over a second) is probed at a smaller batch; on a GPU fast enough the step
  // is probed as it is.
  const double square_gflops = measure_gemm_gflops(runtime);
  const double most_flops = square_gflops * 1e9 * probe.product_seconds;
  StepProducts step = step_products(model, options);
  const auto too_large = [&](const StepProducts& p) {
    const ProductGroup& largest = p.groups.front();
    return static_cast<double>(largest.flops_each) > most_flops || !probe_bytes(p.graph, largest.node, runtime);
  };
  while (!step.groups.empty() && options.batch > 1 && too_large(step)) {
    TrainerOptions smaller = options;
    smaller.batch /= 2;
    try {
      detail::validate_trainer_options(model, smaller);
    } catch (const std::invalid_argument&) {
      break;  // a batch this run cannot take (say, a global batch the ranks must share)
    }
    options = smaller;
    step = step_products(model, options);
  }
  out.batch = options.batch;
  out.distinct = step.groups.size();
  if (step.groups.empty()) {  // a step without products: the square stands in
    out.gflops = square_gflops;
    out.seconds = seconds_since(t0);
    return out;
  }
  // Sets of at most 8 groups and 256 MiB of buffers (a larger group alone) are timed in turns.
  const std::uint64_t set_bytes =
      std::min<std::uint64_t>(std::uint64_t{256} << 20, runtime.device().global_mem_bytes / 8);
  double probed = 0, probed_seconds = 0;
  std::size_t next = 0;
  while (next < step.groups.size()) {
    if (!out.probes.empty() && seconds_since(t0) >= probe.budget_seconds) break;  // at least the largest is probed
    std::vector<ProductGroup> set;
    std::uint64_t bytes = 0;
    for (; next < step.groups.size() && set.size() < 8; ++next) {
      const ProductGroup& group = step.groups[next];
      const std::optional<std::uint64_t> b = probe_bytes(step.graph, group.node, runtime);
      if (!b) continue;
      if (!set.empty() && (bytes + *b > set_bytes || seconds_since(t0) >= probe.budget_seconds)) break;
      set.push_back(group);
      bytes += *b;
    }
    const std::vector<double> seconds = time_in_turns(runtime, step.graph, set, t0, probe.budget_seconds);
    for (std::size_t i = 0; i < set.size(); ++i) {
      if (!(seconds[i] > 0)) continue;  // too short to read: it adds nothing to the weighted rate
      const ProductGroup& group = set[i];
      probed += static_cast<double>(group.flops);
      probed_seconds += static_cast<double>(group.flops) / static_cast<double>(group.flops_each) * seconds[i];
      out.probes.push_back({step.graph.nodes.name[group.node], ops::op_info(step.graph.nodes.op[group.node]).name,
                            static_cast<std::size_t>(group.flops / group.flops_each), group.flops_each,
                            static_cast<double>(group.flops_each) / seconds[i] * 1e-9});
    }
  }
  if (out.probes.empty()) {
    throw std::runtime_error(
        fmt::format("measuring the GEMM rate at the step's products: none of its {} kinds of "
                    "product could be probed on {} (operands larger than a quarter of its "
                    "memory, or too short to time); give the rate with --gemm-gflops",
                    step.groups.size(), runtime.device().name));
  }
  out.gflops = probed / probed_seconds * 1e-9;
  out.probed_share = probed / static_cast<double>(step.flops);
  out.seconds = seconds_since(t0);
  return out;
}

}  // namespace ferry
