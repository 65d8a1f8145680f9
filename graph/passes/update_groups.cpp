// Adjacent optimizer updates as one launch (graph/residency_passes.hpp, group_updates).
//
// A resident step ends with one Adam update per parameter, each its own kernel: in the 85M GPT 195
// of them, most over a LayerNorm's gain or a bias of a few hundred floats, where a GPU spends more
// on enqueueing the launch (7.8 us on the H200) than on the update. Runs of adjacent adam_update
// nodes over whole f32 tensors become adam_update_group nodes of up to ops::adam_group_slots
// parameters each: one launch, the same expression per parameter, the same bits.
#include <fmt/format.h>

#include <algorithm>
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

// The same guard (or none) as node a: the group checks one.
bool same_guard(const NodeTable& nodes, NodeId a, NodeId b) {
  const auto x = nodes.inputs(a), y = nodes.inputs(b);
  return x.size() == y.size() && (x.size() == 4 || x.back() == y.back());
}

bool no_weight_decay(const NodeTable& nodes, NodeId n) {
  return ops::UpdateAttrs::of(nodes.attrs[n]).no_weight_decay;
}

}  // namespace

void group_updates(Graph& g) {
  const NodeTable& old = g.nodes;
  NodeTable out;
  bool changed = false;
  // Groups of up to adam_group_slots updates of one weight-decay kind, from `run`, in order.
  const auto emit = [&](const std::vector<NodeId>& run) {
    for (std::size_t first = 0; first < run.size(); first += ops::adam_group_slots) {
      const std::size_t count = std::min<std::size_t>(ops::adam_group_slots, run.size() - first);
      if (count == 1) {
        out.add_copy(old, run[first]);
        continue;
      }
      std::vector<TensorId> ins, outs;
      for (std::size_t i = first; i < first + count; ++i) {
        const auto in = old.inputs(run[i]);
        ins.insert(ins.end(), in.begin(), in.begin() + 4);
        const auto o = old.outputs(run[i]);
        outs.insert(outs.end(), o.begin(), o.end());
      }
      if (old.inputs(run[first]).size() == 5) ins.push_back(old.inputs(run[first]).back());
      const ops::UpdateAttrs group{.no_weight_decay = no_weight_decay(old, run[first])};
      out.add(ops::builtin::adam_update_group, fmt::format("update_group.{}", old.name[run[first]]), ins, outs,
              group.pack(), Lane::compute);
      changed = true;
    }
  };
  for (NodeId n = 0; n < old.size();) {
    NodeId end = n;
    while (end < old.size() && groupable(g, end) && same_guard(old, n, end)) ++end;
    if (end - n < 2) {
      out.add_copy(old, n);
      ++n;
      continue;
    }
    // Updates write only their own weight and state, so a run's order among them is free: the
    // weights weight decay leaves out (biases, gains: OptimizerConfig::decay_on) are grouped apart
    // from the rest, where the builder interleaves them (a Linear's w, then its b).
    std::vector<NodeId> decayed, exempt;
    for (NodeId u = n; u < end; ++u) (no_weight_decay(old, u) ? exempt : decayed).push_back(u);
    emit(decayed);
    emit(exempt);
    n = end;
  }
  if (changed) g.nodes = std::move(out);
}

}  // namespace ferry::graph
