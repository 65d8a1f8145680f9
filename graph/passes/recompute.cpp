// The recompute pass (gradient checkpointing): the forward pass is cut into segments of `every`
// layers (nodes that read a weight); backward reads the activations of a segment not from the
// forward pass but from a copy of that segment's nodes run again just before its backward. The
// forward's own activations then die inside the forward pass; only what crosses a segment
// boundary (the checkpoints) lives on. The last segment (next to the loss) is kept. The copies
// run the same kernels on the same inputs, so the gradients are bit-identical.
#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>
#include <unordered_map>

#include "ferry/graph/autodiff.hpp"
#include "ferry/ops/op_table.hpp"

namespace ferry::graph {

void apply_recompute(Graph& g, std::uint32_t every) {
  if (every == 0) throw std::invalid_argument("recompute every 0 layers: use 1 or more (or no recomputation)");
  auto& t = g.tensors;
  const NodeTable old = g.nodes;
  // The forward nodes: up to the loss's producer.
  NodeId loss_node = static_cast<NodeId>(old.size());
  for (NodeId n = 0; n < old.size() && loss_node == old.size(); ++n) {
    for (TensorId x : old.outputs(n)) {
      if (x == g.loss) loss_node = n;
    }
  }
  if (loss_node == old.size()) throw std::invalid_argument("recompute: the step has no loss");
  // Segments: a new one starts at every `every`-th layer.
  std::vector<int> segment(old.size(), -1);
  std::uint32_t layers = 0;
  int current = 0;
  // A layer reads a weight, directly or through casts of it (mixed precision): the casts
  // themselves are not layers.
  std::vector<bool> from_weight(t.size(), false);
  for (TensorId x = 0; x < t.size(); ++x) from_weight[x] = t.role[t.storage(x)] == Role::weight;
  for (NodeId n = 0; n < loss_node; ++n) {
    const ops::OpClass op_class = ops::op_info(old.op[n]).op_class;
    if (op_class == ops::OpClass::batch_transfer) continue;
    bool layer = false;
    for (TensorId x : old.inputs(n)) layer = layer || from_weight[t.storage(x)];
    if (op_class == ops::OpClass::cast) {
      for (TensorId y : old.outputs(n)) from_weight[y] = layer;
      layer = false;
    }
    if (layer) {
      if (layers > 0 && layers % every == 0) ++current;
      ++layers;
    }
    segment[n] = current;
  }
  if (every >= layers) {
    throw std::invalid_argument(fmt::format(
        "recompute every {} layers: the model has {} layers (nodes with weights), so there would be one segment and "
        "nothing to recompute; use at most {}",
        every, layers, layers > 1 ? layers - 1 : 1));
  }
  const int last_segment = current;
  std::vector<NodeId> producer(t.size(), static_cast<NodeId>(old.size()));
  for (NodeId n = 0; n < loss_node; ++n) {
    for (TensorId x : old.outputs(n)) producer[t.storage(x)] = n;
  }
  const auto segment_of = [&](TensorId x) {
    const NodeId p = producer[t.storage(x)];
    return p < old.size() ? segment[p] : -1;
  };
  // Per recomputed segment: which of its nodes backward needs (the producers of what backward
  // reads, and within the segment, what they read), and where its copies go (before the first
  // backward node reading one of its tensors).
  std::vector<std::vector<char>> needed(static_cast<std::size_t>(last_segment));
  std::vector<NodeId> insert_at(static_cast<std::size_t>(last_segment), static_cast<NodeId>(old.size()));
  for (auto& v : needed) v.assign(old.size(), 0);
  for (NodeId n = loss_node + 1; n < old.size(); ++n) {
    for (TensorId x : old.inputs(n)) {
      const int s = segment_of(x);
      if (s < 0 || s >= last_segment) continue;
      needed[s][producer[t.storage(x)]] = 1;
      insert_at[s] = std::min(insert_at[s], n);
    }
  }
  for (int s = 0; s < last_segment; ++s) {
    for (NodeId n = loss_node; n-- > 0;) {
      if (!needed[s][n]) continue;
      for (TensorId x : old.inputs(n)) {
        if (segment_of(x) == s) needed[s][producer[t.storage(x)]] = 1;
      }
    }
  }
  // The copies: new tensors for the segment's outputs (and views of them), rewired backward.
  std::unordered_map<TensorId, TensorId> copy;  // original storage or view -> its recomputed twin
  const auto twin = [&](TensorId x, int s) -> TensorId {
    if (segment_of(x) != s) return x;
    if (auto it = copy.find(x); it != copy.end()) return it->second;
    // A view of a recomputed tensor: the same view of its twin.
    const TensorId base = t.alias_of[x];
    if (base == no_tensor) throw std::logic_error(fmt::format("recompute: '{}' has no copy", t.name[x]));
    const TensorId base_twin = copy.at(t.storage(base));
    const TensorId v = t.add(t.name[x] + ".recomputed", t.shape[x], t.dtype[x], t.role[x], base_twin);
    copy.emplace(x, v);
    return v;
  };
  NodeTable out;
  std::vector<TensorId> ins, outs;
  std::vector<std::vector<NodeId>> starts_at(old.size() + 1);
  for (int s = 0; s < last_segment; ++s) starts_at[insert_at[s]].push_back(static_cast<NodeId>(s));
  for (NodeId n = 0; n < old.size(); ++n) {
    // Segments whose backward starts here are recomputed first (the later segment first: its
    // backward comes first).
    auto& here = starts_at[n];
    std::sort(here.rbegin(), here.rend());
    for (NodeId seg : here) {
      const int s = static_cast<int>(seg);
      for (NodeId m = 0; m < loss_node; ++m) {
        if (!needed[s][m]) continue;
        ins.clear();
        outs.clear();
        for (TensorId x : old.inputs(m)) ins.push_back(twin(x, s));
        for (TensorId x : old.outputs(m)) {
          if (t.alias_of[x] != no_tensor) {
            outs.push_back(twin(x, s));  // writes a view: the same view of the twin
            continue;
          }
          const TensorId c = t.add(t.name[x] + ".recomputed", t.shape[x], t.dtype[x], t.role[x]);
          copy.emplace(x, c);
          outs.push_back(c);
        }
        out.add(old.op[m], old.name[m] + ".recompute", ins, outs, old.attrs[m], old.lane[m]);
      }
    }
    if (n <= loss_node) {
      out.add_copy(old, n);
      continue;
    }
    ins.clear();
    for (TensorId x : old.inputs(n)) {
      const int s = segment_of(x);
      ins.push_back(s >= 0 && s < last_segment ? twin(x, s) : x);
    }
    outs.assign(old.outputs(n).begin(), old.outputs(n).end());
    out.add_copy(old, n, ins, outs, old.lane[n]);
  }
  g.nodes = std::move(out);
}

}  // namespace ferry::graph
