// The scratch pass: a temporary per node whose row asks for one on this device.
#include <fmt/format.h>

#include <stdexcept>

#include "graph/bind.hpp"
#include "graph/node_view.hpp"

namespace ferry::graph {

void assign_scratch(Graph& g, ops::OpEnv& env) {
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    const ops::OpInfo& row = ops::op_info(g.nodes.op[n]);
    if (!row.scratch_bytes) continue;
    const std::size_t bytes = row.scratch_bytes(NodeView<ops::ShapeView>(g, n), env);
    if (bytes == 0) continue;
    // A shape axis holds at most 2^32 - 1: a larger scratch would be cut to its low bits.
    if (bytes > 0xffffffffu) {
      throw std::invalid_argument(fmt::format(
          "node '{}' ({}) needs {} bytes of scratch for these shapes, more than the 4 GiB - 1 one scratch buffer "
          "holds: lower the batch (--batch, TrainerOptions::batch; --accumulate splits it into micro-batches) or "
          "the layer sizes (an op's author: keep its row's scratch_bytes below that by splitting the work)",
          g.nodes.name[n], row.name, bytes));
    }
    // Stored as bytes: the memory plan only needs the size.
    g.nodes.scratch[n] =
        g.tensors.add(g.nodes.name[n] + ".scratch", Shape{static_cast<std::uint32_t>(bytes)}, DType::u8, Role::scratch);
  }
}

}  // namespace ferry::graph
