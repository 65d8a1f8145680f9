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

#include "ferry/ops/op_table.hpp"
#include "graph/autodiff.hpp"

namespace ferry::graph {
namespace {

// The node that writes the step's loss: the forward nodes are it and those before it.
NodeId loss_producer(const Graph& g) {
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    for (TensorId x : g.nodes.outputs(n)) {
      if (x == g.loss) return n;
    }
  }
  throw std::invalid_argument("recompute: the step has no loss");
}

// The forward cut into segments of `every` layers, and which forward nodes each recomputed segment
// (all but the last) must run again for backward.
struct Segments {
  NodeId loss_node = 0;
  std::vector<int> of_node;               // segment of each forward node (-1: a batch transfer, or after the loss)
  int last = 0;                           // the last segment, kept
  std::vector<NodeId> producer;           // forward node writing each storage (nodes.size(): none)
  std::vector<std::vector<char>> needed;  // per recomputed segment: its nodes backward needs
  std::vector<NodeId> insert_at;          // per recomputed segment: its first backward reader
  int of_tensor(TensorId x, const TensorTable& t) const {
    const NodeId p = producer[t.storage(x)];
    return p < of_node.size() ? of_node[p] : -1;
  }
};

// A new segment starts at every `every`-th layer. A layer reads a weight, directly or through casts
// of it (mixed precision): the casts themselves are not layers.
void cut_segments(const Graph& g, std::uint32_t every, Segments& s) {
  const auto& t = g.tensors;
  const NodeTable& nodes = g.nodes;
  s.of_node.assign(nodes.size(), -1);
  std::uint32_t layers = 0;
  int current = 0;
  std::vector<bool> from_weight(t.size(), false);
  for (TensorId x = 0; x < t.size(); ++x) from_weight[x] = t.role[t.storage(x)] == Role::weight;
  for (NodeId n = 0; n < s.loss_node; ++n) {
    const ops::OpClass op_class = ops::op_info(nodes.op[n]).op_class;
    if (op_class == ops::OpClass::batch_transfer) continue;
    bool layer = false;
    for (TensorId x : nodes.inputs(n)) layer = layer || from_weight[t.storage(x)];
    if (op_class == ops::OpClass::cast) {
      for (TensorId y : nodes.outputs(n)) from_weight[y] = layer;
      layer = false;
    }
    if (layer) {
      if (layers > 0 && layers % every == 0) ++current;
      ++layers;
    }
    s.of_node[n] = current;
  }
  if (every >= layers) {
    throw std::invalid_argument(fmt::format(
        "recompute every {} layers: the model has {} layers (nodes with weights), so there would be one segment and "
        "nothing to recompute; use at most {}",
        every, layers, layers > 1 ? layers - 1 : 1));
  }
  s.last = current;
}

// Per recomputed segment: which of its nodes backward needs (the producers of what backward reads,
// and within the segment, what they read), and where its copies go (before the first backward node
// reading one of its tensors).
void find_needed(const Graph& g, Segments& s) {
  const auto& t = g.tensors;
  const NodeTable& nodes = g.nodes;
  s.producer.assign(t.size(), static_cast<NodeId>(nodes.size()));
  for (NodeId n = 0; n < s.loss_node; ++n) {
    for (TensorId x : nodes.outputs(n)) s.producer[t.storage(x)] = n;
  }
  s.needed.assign(static_cast<std::size_t>(s.last), std::vector<char>(nodes.size(), 0));
  s.insert_at.assign(static_cast<std::size_t>(s.last), static_cast<NodeId>(nodes.size()));
  for (NodeId n = s.loss_node + 1; n < nodes.size(); ++n) {
    for (TensorId x : nodes.inputs(n)) {
      const int seg = s.of_tensor(x, t);
      if (seg < 0 || seg >= s.last) continue;
      s.needed[seg][s.producer[t.storage(x)]] = 1;
      s.insert_at[seg] = std::min(s.insert_at[seg], n);
    }
  }
  for (int seg = 0; seg < s.last; ++seg) {
    for (NodeId n = s.loss_node; n-- > 0;) {
      if (!s.needed[seg][n]) continue;
      for (TensorId x : nodes.inputs(n)) {
        if (s.of_tensor(x, t) == seg) s.needed[seg][s.producer[t.storage(x)]] = 1;
      }
    }
  }
}

}  // namespace

void apply_recompute(Graph& g, std::uint32_t every) {
  if (every == 0) throw std::invalid_argument("recompute every 0 layers: use 1 or more (or no recomputation)");
  auto& t = g.tensors;
  const NodeTable old = g.nodes;
  Segments segs;
  segs.loss_node = loss_producer(g);
  cut_segments(g, every, segs);
  find_needed(g, segs);
  const NodeId loss_node = segs.loss_node;
  const int last_segment = segs.last;
  // The copies: new tensors for the segment's outputs (and views of them), rewired backward.
  std::unordered_map<TensorId, TensorId> copy;  // original storage or view -> its recomputed twin
  const auto twin = [&](TensorId x, int s) -> TensorId {
    if (segs.of_tensor(x, t) != s) return x;
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
  // The needed nodes of segment s run again, writing twins of their outputs.
  const auto recompute_segment = [&](int s) {
    for (NodeId m = 0; m < loss_node; ++m) {
      if (!segs.needed[s][m]) continue;
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
  };
  std::vector<std::vector<NodeId>> starts_at(old.size() + 1);
  for (int s = 0; s < last_segment; ++s) starts_at[segs.insert_at[s]].push_back(static_cast<NodeId>(s));
  for (NodeId n = 0; n < old.size(); ++n) {
    // Segments whose backward starts here are recomputed first (the later segment first: its
    // backward comes first).
    auto& here = starts_at[n];
    std::sort(here.rbegin(), here.rend());
    for (NodeId seg : here) recompute_segment(static_cast<int>(seg));
    if (n <= loss_node) {
      out.add_copy(old, n);
      continue;
    }
    ins.clear();
    for (TensorId x : old.inputs(n)) {
      const int s = segs.of_tensor(x, t);
      ins.push_back(s >= 0 && s < last_segment ? twin(x, s) : x);
    }
    outs.assign(old.outputs(n).begin(), old.outputs(n).end());
    out.add_copy(old, n, ins, outs, old.lane[n]);
  }
  g.nodes = std::move(out);
}

}  // namespace ferry::graph
