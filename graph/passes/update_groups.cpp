// Adjacent optimizer updates as one launch (graph/residency_passes.hpp, group_updates).
//
// A resident step ends with one Adam update per parameter, each its own kernel: in the 85M GPT 195
// of them, most over a LayerNorm's gain or a bias of a few hundred floats, where a GPU spends more
// on enqueueing the launch (7.8 us on the H200) than on the update. Runs of adjacent adam_update
// nodes over whole f32 tensors become adam_update_group nodes of up to ops::adam_group_slots
// parameters each: one launch, the same expression per parameter, the same bits.
#include <fmt/format.h>

#include <vector>

#include "ferry/ops/optimizer.hpp"
#include "graph/residency_passes.hpp"
#include "ops/attrs.hpp"

namespace ferry::graph {
namespace {

// Whether node n is an update the group row takes: Adam on the device over whole f32 tensors.
bool groupable(const Graph& g, NodeId n) {
  const NodeTable& nodes = g.nodes;
  if (nodes.op[n] != ops::builtin::adam_update || nodes.lane[n] != Lane::compute) return false;
  if (ops::UpdateAttrs::of(nodes.attrs[n]).share_count != 0) return false;  // a ZeRO share
  const auto ins = nodes.inputs(n);
  if (ins.size() != 4 && ins.size() != 5) return false;
  for (std::size_t i = 0; i < 4; ++i) {
    if (g.tensors.dtype[ins[i]] != DType::f32) return false;
  }
  return true;
}

// The same guard (or none) and weight decay as node a: the group checks one and applies one.
bool same_group(const NodeTable& nodes, NodeId a, NodeId b) {
  const auto x = nodes.inputs(a), y = nodes.inputs(b);
  return x.size() == y.size() && (x.size() == 4 || x.back() == y.back()) &&
         ops::UpdateAttrs::of(nodes.attrs[a]).no_weight_decay == ops::UpdateAttrs::of(nodes.attrs[b]).no_weight_decay;
}

}  // namespace

void group_updates(Graph& g) {
  const NodeTable& old = g.nodes;
  NodeTable out;
  bool changed = false;
  for (NodeId n = 0; n < old.size();) {
    NodeId end = n;
    while (end < old.size() && groupable(g, end) && same_group(old, n, end) && end - n < ops::adam_group_slots) ++end;
    if (end - n < 2) {
      out.add_copy(old, n);
      ++n;
      continue;
    }
    std::vector<TensorId> ins, outs;
    for (NodeId u = n; u < end; ++u) {
      const auto in = old.inputs(u);
      ins.insert(ins.end(), in.begin(), in.begin() + 4);
      const auto o = old.outputs(u);
      outs.insert(outs.end(), o.begin(), o.end());
    }
    if (old.inputs(n).size() == 5) ins.push_back(old.inputs(n).back());
    const ops::UpdateAttrs group{.no_weight_decay = ops::UpdateAttrs::of(old.attrs[n]).no_weight_decay};
    out.add(ops::builtin::adam_update_group, fmt::format("update_group.{}", old.name[n]), ins, outs, group.pack(),
            Lane::compute);
    changed = true;
    n = end;
  }
  if (changed) g.nodes = std::move(out);
}

}  // namespace ferry::graph
