// The dtype check: every node's float operands against the dtypes its row accepts.
#include <fmt/format.h>

#include <stdexcept>

#include "graph/bind.hpp"

namespace ferry::graph {

void check_dtypes(const Graph& g) {
  const auto& t = g.tensors;
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    const ops::OpInfo& row = ops::op_info(g.nodes.op[n]);
    auto check = [&](TensorId id) {
      if (id == no_tensor || !ops::dtype_is_float(t.dtype[id]) || row.float_dtypes.contains(t.dtype[id])) return;
      throw std::invalid_argument(
          fmt::format("node '{}': op '{}' does not support dtype {} (tensor '{}'); it takes {}: cast the tensor first "
                      "or keep it in "
                      "a dtype the op supports",
                      g.nodes.name[n], row.name, ops::dtype_name(t.dtype[id]), t.name[id], row.float_dtypes.str()));
    };
    for (TensorId id : g.nodes.inputs(n)) check(id);
    for (TensorId id : g.nodes.outputs(n)) check(id);
  }
}

}  // namespace ferry::graph
