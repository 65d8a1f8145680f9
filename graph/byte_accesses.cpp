// The byte ranges each node of a planned step reads and writes, and its commit point
// (graph/dependencies.hpp).
#include "graph/dependencies.hpp"

namespace ferry::graph {

std::vector<std::vector<ByteAccess>> node_byte_accesses(const Graph& g, const std::vector<Pool>& pools) {
  const auto& t = g.tensors;
  const auto& n = g.nodes;
  std::vector<std::vector<ByteAccess>> accesses(n.size());
  for (NodeId id = 0; id < n.size(); ++id) {
    auto add = [&](TensorId tid, bool write) {
      if (tid == no_tensor) return;
      const TensorId s = t.storage(tid);
      const Placement& p = t.placement[s];
      // One space per (pool, home, buffer): persistent tensors of different homes never share bytes.
      const std::uint32_t home = pools[s] == Pool::persistent ? static_cast<std::uint32_t>(t.home[s]) : 0;
      const std::uint32_t space = (p.buffer * 4u + static_cast<std::uint32_t>(pools[s])) * offload::home_count + home;
      accesses[id].push_back({space, p.offset_bytes, p.offset_bytes + t.bytes(tid), write});
    };
    for (TensorId tid : n.inputs(id)) add(tid, false);
    for (TensorId tid : n.outputs(id)) add(tid, true);
    add(n.scratch[id], true);
  }
  return accesses;
}

NodeId commit_point(const Graph& g) {
  NodeId commit = static_cast<NodeId>(-1);
  if (g.guard == no_tensor) return commit;
  const TensorId guard = g.tensors.storage(g.guard);
  for (NodeId id = 0; id < g.nodes.size(); ++id) {
    for (TensorId x : g.nodes.outputs(id)) {
      if (g.tensors.storage(x) == guard) commit = id;
    }
  }
  return commit;
}

}  // namespace ferry::graph
