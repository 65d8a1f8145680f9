// Device bytes of a compiled variant by purpose (include/ferry/runtime/plan.hpp).
#include "ferry/runtime/plan.hpp"

#include <algorithm>
#include <vector>

namespace ferry {

using graph::TensorId;

DeviceBreakdown device_breakdown(const graph::CompiledStep& step, const graph::CompiledStep& training) {
  DeviceBreakdown b;
  {
    const auto& t = training.graph().tensors;
    for (TensorId id = 0; id < t.size(); ++id) {
      if (!graph::is_persistent(t.role[id]) || t.alias_of[id] != graph::no_tensor) continue;
      if (t.home[id] != graph::Residency::device) continue;
      switch (t.role[id]) {
        case graph::Role::weight:
          b.weights += t.bytes(id);
          break;
        case graph::Role::optimizer_state:
          b.optimizer_state += t.bytes(id);
          break;
        default:
          b.other_state += t.bytes(id);
      }
    }
  }
  const graph::Graph& g = step.graph();
  const auto& t = g.tensors;
  const auto& plan = step.plan();
  // Each device step tensor's span of nodes, then the node where most bytes are live.
  constexpr graph::NodeId none = ~graph::NodeId{0};
  std::vector<graph::NodeId> first(t.size(), none), last(t.size(), 0);
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    const auto touch = [&](TensorId x) {
      const TensorId s = t.storage(x);
      if (s >= plan.pool.size() || plan.pool[s] != graph::Pool::transient) return;
      first[s] = std::min(first[s], n);
      last[s] = std::max(last[s], n);
    };
    for (TensorId x : g.nodes.inputs(n)) touch(x);
    for (TensorId x : g.nodes.outputs(n)) touch(x);
    if (g.nodes.scratch[n] != graph::no_tensor) touch(g.nodes.scratch[n]);
  }
  std::vector<std::int64_t> delta(g.nodes.size() + 1, 0);
  for (TensorId s = 0; s < t.size(); ++s) {
    if (first[s] == none) continue;
    delta[first[s]] += static_cast<std::int64_t>(t.bytes(s));
    delta[last[s] + 1] -= static_cast<std::int64_t>(t.bytes(s));
  }
  std::int64_t live = 0, best = -1;
  graph::NodeId peak = 0;
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    live += delta[n];
    if (live > best) {
      best = live;
      peak = n;
    }
  }
  for (TensorId s = 0; s < t.size(); ++s) {
    if (first[s] == none || first[s] > peak || last[s] < peak) continue;
    switch (t.role[s]) {
      case graph::Role::gradient:
        b.gradients += t.bytes(s);
        break;
      case graph::Role::staged:
        b.streamed_copies += t.bytes(s);
        break;
      case graph::Role::scratch:
        b.scratch += t.bytes(s);
        break;
      default:
        b.activations += t.bytes(s);
    }
  }
  b.step_arena = plan.transient_bytes;
  b.total = step.device_bytes();
  return b;
}

}  // namespace ferry
