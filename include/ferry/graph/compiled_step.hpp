// A step graph compiled for one device: memory planned, kernels bound, lowered to one
// tbb::flow::graph that is run once per step.
//
// Lowering: nodes on the same lane (compute, copy in, copy out) are chained in the static order,
// which the in-order queues then preserve on the device; a node that touches bytes another lane
// wrote or reads gets a graph edge from that node and waits on its OpenCL event. A device node is
// done once its command is enqueued, so the graph runs ahead of the device. The host learns that
// the step finished through an event callback into an async_node gateway: no TBB thread blocks
// on the device.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ferry/cl/context.hpp"
#include "ferry/graph/autodiff.hpp"
#include "ferry/graph/ir.hpp"
#include "ferry/graph/memory_plan.hpp"
#include "ferry/ops/launch.hpp"

namespace ferry::graph {

// Weights and optimizer state on the device, shared by every variant of one model.
struct PersistentArena {
  std::vector<cl::Mem> buffers;
  std::vector<std::uint64_t> buffer_bytes;
  std::vector<std::pair<std::string, Placement>> placements;  // by tensor name
  std::uint64_t bytes = 0;
  std::optional<Placement> find(const std::string& name) const;
};

// One node's span on the device timeline of the last step (needs a profiling context).
struct TimelineEntry {
  std::string name;
  Lane lane;
  std::uint64_t queued_ns, start_ns, end_ns;  // device clock
};

class CompiledStep {
 public:
  // `graph` must be complete (forward, and for training backward, optimizer and download).
  // With `shared`, persistent tensors are looked up by name there instead of allocated.
  CompiledStep(Graph graph, const OptimizerSpec& optimizer, ops::OpEnv& env, const cl::Context& context,
               std::shared_ptr<PersistentArena> shared = nullptr);
  ~CompiledStep();
  CompiledStep(const CompiledStep&) = delete;
  CompiledStep& operator=(const CompiledStep&) = delete;

  // Host staging the upload node copies from: fill before run().
  float* input_host() const;
  std::int32_t* labels_host() const;
  // Filled by the download node when run() returns: [mean loss, correct count].
  const float* stats_host() const;

  // Runs one step: enqueues every node through the flow graph and returns when the device has
  // finished. A failing node cancels the step; the error is rethrown naming the node, all queues
  // are drained and the step can run again.
  void run(const ops::StepInfo& step);

  const Graph& graph() const noexcept { return graph_; }
  const MemoryPlan& plan() const noexcept { return plan_; }
  std::uint64_t device_bytes() const noexcept { return persistent_->bytes + plan_.transient_bytes; }
  const std::shared_ptr<PersistentArena>& persistent() const noexcept { return persistent_; }
  ops::DeviceSpan span(TensorId t) const;
  std::size_t node_count() const noexcept { return graph_.nodes.size(); }

  // Per-node device times of the last step; empty unless the context has profiling enabled.
  std::vector<TimelineEntry> timeline() const;

  // Test hook: node `n` throws when it next runs (to check cancellation and recovery).
  void inject_failure(NodeId n) { fail_node_ = n; }

 private:
  struct Impl;
  Graph graph_;
  MemoryPlan plan_;
  std::shared_ptr<PersistentArena> persistent_;
  std::unique_ptr<Impl> impl_;
  NodeId fail_node_ = static_cast<NodeId>(-1);
};

}  // namespace ferry::graph
