// The fusion pass (before mixed precision and autodiff): relu -> maxpool2d becomes one maxpool2d
// with the ReLU fused in (attrs.i[2] = 1).
//
// max over a window of relu(x) = relu(max over the window of x), and the ReLU's gradient mask at
// the window's argmax is whether that maximum is positive, so the fused pool computes the same
// values and routes the same gradients as the pair while reading x once and writing a quarter of
// what the ReLU wrote (a 2x2 pool), and autodiff emits no ReLU backward node at all.
#include <vector>

#include "ferry/graph/autodiff.hpp"
#include "ferry/ops/activation.hpp"
#include "ferry/ops/op_table.hpp"

namespace ferry::graph {
namespace {

bool is_relu(const NodeTable& nodes, NodeId n) {
  return nodes.op[n] == builtin::activation && nodes.attrs[n].i[0] == static_cast<int>(ops::Activation::relu);
}

}  // namespace

void fuse_relu_maxpool(Graph& g) {
  const auto& t = g.tensors;
  const NodeTable old = g.nodes;
  // Readers of each tensor's storage (views count as readers of their base) and the producers.
  std::vector<std::uint32_t> readers(t.size(), 0);
  std::vector<NodeId> producer(t.size(), static_cast<NodeId>(old.size()));
  for (NodeId n = 0; n < old.size(); ++n) {
    for (TensorId x : old.inputs(n)) ++readers[t.storage(x)];
    for (TensorId y : old.outputs(n)) producer[y] = n;
  }
  std::vector<bool> has_view(t.size(), false);
  for (TensorId v = 0; v < t.size(); ++v) {
    if (t.alias_of[v] != no_tensor) has_view[t.storage(v)] = true;
  }
  // The ReLUs to drop and the pools that take them in.
  std::vector<bool> dropped(old.size(), false);
  std::vector<NodeId> fused_relu(old.size(), static_cast<NodeId>(old.size()));
  for (NodeId n = 0; n < old.size(); ++n) {
    if (old.op[n] != builtin::maxpool2d || old.attrs[n].i[2] != 0) continue;
    const TensorId y = old.inputs(n)[0];
    const NodeId r = producer[y];
    if (r == old.size() || !is_relu(old, r)) continue;
    // Only a plain activation that nothing else reads (no other consumer, no view, not the loss).
    if (readers[y] != 1 || has_view[y] || y == g.loss || t.role[y] != Role::activation) continue;
    dropped[r] = true;
    fused_relu[n] = r;
  }
  NodeTable out;
  for (NodeId n = 0; n < old.size(); ++n) {
    if (dropped[n]) continue;
    if (fused_relu[n] == old.size()) {
      out.add_copy(old, n);
      continue;
    }
    const TensorId x = old.inputs(fused_relu[n])[0];
    const std::vector<TensorId> outs(old.outputs(n).begin(), old.outputs(n).end());
    const NodeId m = out.add_copy(old, n, std::span(&x, 1), outs, old.lane[n]);
    out.attrs[m].i[2] = 1;
  }
  g.nodes = std::move(out);
}

}  // namespace ferry::graph
