// The download pass: the step's results (the loss statistics) into host mirrors the caller reads.
#include "graph/autodiff.hpp"

namespace ferry::graph {

void append_stats_download(Graph& g) {
  auto& t = g.tensors;
  const std::size_t count = t.size();
  for (TensorId s = 0; s < count; ++s) {
    if (t.role[s] != Role::stats) continue;
    // The host mirror the caller reads after the step.
    const TensorId host = t.add(t.name[s] + "@host", t.shape[s], t.dtype[s], Role::stats);
    t.home[host] = Home::host_pinned;
    const TensorId ins[] = {s};
    const TensorId outs[] = {host};
    g.nodes.add(builtin::download, "download." + t.name[s], ins, outs, {}, Lane::d2h);
  }
}

}  // namespace ferry::graph
