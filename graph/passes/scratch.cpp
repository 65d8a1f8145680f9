// The scratch pass: a temporary per node whose row asks for one on this device.
#include "graph/bind.hpp"
#include "graph/node_view.hpp"

namespace ferry::graph {

void assign_scratch(Graph& g, ops::OpEnv& env) {
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    const ops::OpInfo& row = ops::op_info(g.nodes.op[n]);
    if (!row.scratch_bytes) continue;
    const std::size_t bytes = row.scratch_bytes(NodeView<ops::ShapeView>(g, n), env);
    if (bytes == 0) continue;
    // Stored as bytes: the memory plan only needs the size.
    g.nodes.scratch[n] =
        g.tensors.add(g.nodes.name[n] + ".scratch", Shape{static_cast<std::uint32_t>(bytes)}, DType::u8, Role::scratch);
  }
}

}  // namespace ferry::graph
