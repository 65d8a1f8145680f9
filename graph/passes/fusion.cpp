// The fusion pass (before mixed precision and autodiff). Which ops fuse is said by their rows
// (OpInfo::relu_fusion, is_relu, merge_with_producer); the rewrites today's rows allow:
//   relu -> maxpool2d becomes one maxpool2d with the ReLU fused in (MaxPool2dAttrs::relu). max over a
//     window of relu(x) = relu(max over the window of x), and the ReLU's gradient mask at the
//     window's argmax is whether that maximum is positive, so the fused pool computes the same
//     values and routes the same gradients as the pair while reading x once and writing a quarter
//     of what the ReLU wrote (a 2x2 pool), and autodiff emits no ReLU backward node at all.
//   conv2d -> relu (a ReLU no pool took) becomes one conv2d with the ReLU in its epilogue
//     (Conv2dAttrs::relu): no pass over the activations to apply it; backward masks dy with y > 0, which is where
//     conv + bias > 0, so the gradients are those of the pair.
//   add -> layernorm (the sum a residual stream keeps, normalised for the next layer) becomes one
//     add_layernorm node at the add's place: it writes the sum and normalises it in one pass, and
//     its backward adds the gradient the sum gets from its other readers into LayerNorm's dx in
//     the same kernel, where the pair needed a gradient-sum node.
//   linear -> relu becomes one linear with the ReLU in its GEMM's epilogue, as for conv2d.
// All are exact: values and gradients are bit-identical to the unfused graph (a sum of two
// gradients is the same whichever kernel adds them).
//
// After mixed precision and autodiff, fuse_narrowing_casts: a LayerNorm (or add_layernorm) whose
// f32 output only a cast to f16 or bf16 reads writes that narrow copy itself (LayerNormAttrs::y),
// rounded as the cast rounds; and an add_layernorm whose operand is an f32 cast of a narrow layer
// output that nothing else reads (a residual branch's last Linear) reads the narrow tensor and
// widens it as it adds. One pass and one [rows, features] f32 tensor fewer per cast, the same bits.
// The casts' gradients (the narrow gradient widened with the loss scale removed, and back) stay:
// LayerNorm's backward reads x and its statistics, never y, and the sum's backward no operand.
//
// After autodiff, fuse_activation_grads: an activation's backward (activation_grad, dx = dy act'(z))
// whose dy a Linear's input gradient alone makes (dy = dY w^T of the next layer) joins that GEMM's
// epilogue (LinearGradInputAttrs): dx is written once, where the pair wrote dy, read it back with
// z and wrote dx. Exact too: the GEMM's epilogue gives the activation kernel's bits, or leaves the
// derivative to that kernel where it would not (ops::GemmOptions::dact).
#include <vector>

#include "ferry/ops/op_table.hpp"
#include "graph/autodiff.hpp"
#include "ops/attrs.hpp"

namespace ferry::graph {
namespace {

bool is_relu(const NodeTable& nodes, NodeId n) {
  const ops::OpInfo& row = ops::op_info(nodes.op[n]);
  return row.is_relu && row.is_relu(nodes.attrs[n]);
}

// A node of a row that takes in a ReLU `how`, and has not yet.
bool takes_relu(const NodeTable& nodes, NodeId n, ops::ReluFusion how) {
  return ops::op_info(nodes.op[n]).relu_fusion == how && !ops::relu_fused(nodes.attrs[n]);
}

}  // namespace

namespace {

// Readers of each tensor's storage (views count as readers of their base), producers, and which
// tensors have views.
struct Uses {
  std::vector<std::uint32_t> readers;
  std::vector<NodeId> producer;
  std::vector<bool> has_view;
  Uses(const Graph& g)
      : readers(g.tensors.size(), 0), producer(g.tensors.size(), no_node(g)), has_view(g.tensors.size()) {
    const auto& t = g.tensors;
    for (NodeId n = 0; n < g.nodes.size(); ++n) {
      for (TensorId x : g.nodes.inputs(n)) ++readers[t.storage(x)];
      for (TensorId y : g.nodes.outputs(n)) producer[y] = n;
    }
    for (TensorId v = 0; v < t.size(); ++v) {
      if (t.alias_of[v] != no_tensor) has_view[t.storage(v)] = true;
    }
  }
  static NodeId no_node(const Graph& g) { return static_cast<NodeId>(g.nodes.size()); }
  // y is a plain activation that one node alone reads (no view of it, not the loss).
  bool read_once(const Graph& g, TensorId y) const {
    return readers[y] == 1 && !has_view[y] && y != g.loss && g.tensors.role[y] == Role::activation;
  }
};

// Rebuilds g's node table in order without the nodes `dropped` marks: `rewrite(out, n)` adds node
// n's fused form to `out` and returns true, or returns false for a node it leaves as it is, which
// is copied. The fusion passes mark what they fold, then rebuild once.
template <class Rewrite>
void rebuild_nodes(Graph& g, const std::vector<bool>& dropped, Rewrite rewrite) {
  const NodeTable& old = g.nodes;
  NodeTable out;
  for (NodeId n = 0; n < old.size(); ++n) {
    if (dropped[n]) continue;
    if (!rewrite(out, n)) out.add_copy(old, n);
  }
  g.nodes = std::move(out);
}

// Rebuilds the node table with each host node n that takes in the ReLU absorbed[n] marked fused
// (ops::set_relu_fused) and given operands by `rewire(ins, outs, relu)`, and those ReLUs left out.
template <class Rewire>
void absorb_relus(Graph& g, const std::vector<NodeId>& absorbed, Rewire rewire) {
  const NodeTable& old = g.nodes;
  const NodeId none = Uses::no_node(g);
  std::vector<bool> dropped(old.size(), false);
  for (NodeId r : absorbed) {
    if (r != none) dropped[r] = true;
  }
  rebuild_nodes(g, dropped, [&](NodeTable& out, NodeId n) {
    if (absorbed[n] == none) return false;
    std::vector<TensorId> ins(old.inputs(n).begin(), old.inputs(n).end());
    std::vector<TensorId> outs(old.outputs(n).begin(), old.outputs(n).end());
    rewire(ins, outs, absorbed[n]);
    const NodeId m = out.add_copy(old, n, ins, outs, old.lane[n]);
    ops::set_relu_fused(out.attrs[m]);
    return true;
  });
}

// relu -> maxpool2d: the pool reads the ReLU's input and applies it.
void fuse_into_pools(Graph& g) {
  const NodeTable& old = g.nodes;
  const Uses uses(g);
  std::vector<NodeId> relu_of(old.size(), Uses::no_node(g));  // pool node -> the ReLU it takes in
  for (NodeId n = 0; n < old.size(); ++n) {
    if (!takes_relu(old, n, ops::ReluFusion::reads_its_input)) continue;
    const TensorId y = old.inputs(n)[0];
    const NodeId r = uses.producer[y];
    if (r == old.size() || !is_relu(old, r) || !uses.read_once(g, y)) continue;
    relu_of[n] = r;
  }
  absorb_relus(g, relu_of, [&](std::vector<TensorId>& ins, std::vector<TensorId>&, NodeId relu) {
    ins.assign(1, old.inputs(relu)[0]);
  });
}

// conv2d -> relu: the convolution writes the ReLU's output with the ReLU applied.
void fuse_into_convolutions(Graph& g) {
  const NodeTable& old = g.nodes;
  const Uses uses(g);
  std::vector<NodeId> relu_of(old.size(), Uses::no_node(g));  // conv node -> the ReLU it takes in
  for (NodeId n = 0; n < old.size(); ++n) {
    if (!is_relu(old, n)) continue;
    const TensorId y = old.inputs(n)[0];
    const NodeId c = uses.producer[y];
    if (c == old.size() || !takes_relu(old, c, ops::ReluFusion::writes_its_output) || !uses.read_once(g, y)) continue;
    relu_of[c] = n;
  }
  absorb_relus(g, relu_of, [&](std::vector<TensorId>&, std::vector<TensorId>& outs, NodeId relu) {
    outs.assign(1, old.outputs(relu)[0]);
  });
}

// A node merged into its producer's place (OpInfo::merge_with_producer; add -> layernorm): the
// LayerNorm's node moves to the add's place as an add_layernorm that also writes the sum (whose
// other readers, all later than the add, still find it there).
void merge_with_producers(Graph& g) {
  const NodeTable& old = g.nodes;
  const Uses uses(g);
  const NodeId none = Uses::no_node(g);
  std::vector<NodeId> norm_of(old.size(), none);  // producer node -> the node it becomes one with
  std::vector<bool> dropped(old.size(), false);
  for (NodeId n = 0; n < old.size(); ++n) {
    const auto& merge = ops::op_info(old.op[n]).merge_with_producer;
    if (merge.producer.empty()) continue;
    const TensorId x = old.inputs(n)[0];
    const NodeId a = uses.producer[x];
    if (a == none || ops::op_info(old.op[a]).name != merge.producer || norm_of[a] != none) continue;
    if (old.inputs(a).size() != 2) continue;
    const auto& t = g.tensors;
    const TensorId l = old.inputs(a)[0], r = old.inputs(a)[1];
    if (t.role[x] != Role::activation || x == g.loss || t.alias_of[x] != no_tensor || !(t.shape[l] == t.shape[x]) ||
        !(t.shape[r] == t.shape[x])) {
      continue;
    }
    norm_of[a] = n;
    dropped[n] = true;
  }
  rebuild_nodes(g, dropped, [&](NodeTable& out, NodeId n) {
    const NodeId norm = norm_of[n];
    if (norm == none) return false;
    std::vector<TensorId> ins(old.inputs(n).begin(), old.inputs(n).end());
    ins.insert(ins.end(), old.inputs(norm).begin() + 1, old.inputs(norm).end());
    std::vector<TensorId> outs(old.outputs(n).begin(), old.outputs(n).end());
    outs.insert(outs.end(), old.outputs(norm).begin(), old.outputs(norm).end());
    const ops::OpId fused = ops::find_op(ops::op_info(old.op[norm]).merge_with_producer.fused);
    out.add(fused, old.name[norm], ins, outs, old.attrs[norm], old.lane[norm]);
    return true;
  });
}

}  // namespace

// activation_grad (z, dy) -> dx with dy made by a linear_grad_input alone: that node reads z too
// and writes dx.
void fuse_into_input_gradients(Graph& g) {
  const NodeTable& old = g.nodes;
  const Uses uses(g);
  const NodeId none = Uses::no_node(g);
  std::vector<NodeId> grad_of(old.size(), none);  // linear_grad_input node -> the activation_grad it takes in
  std::vector<bool> dropped(old.size(), false);
  const auto& t = g.tensors;
  for (NodeId n = 0; n < old.size(); ++n) {
    if (old.op[n] != builtin::activation_grad || old.inputs(n).size() != 2) continue;
    const TensorId z = old.inputs(n)[0], dy = old.inputs(n)[1];
    const NodeId p = uses.producer[dy];
    if (p == none || old.op[p] != builtin::linear_grad_input || old.inputs(p).size() != 2 || grad_of[p] != none) {
      continue;
    }
    if (uses.readers[dy] != 1 || uses.has_view[dy] || t.role[dy] != Role::gradient || t.alias_of[dy] != no_tensor) {
      continue;
    }
    if (t.dtype[z] != t.dtype[dy] || !(t.shape[z] == t.shape[dy])) continue;
    grad_of[p] = n;
    dropped[n] = true;
  }
  rebuild_nodes(g, dropped, [&](NodeTable& out, NodeId n) {
    const NodeId a = grad_of[n];
    if (a == none) return false;
    std::vector<TensorId> ins(old.inputs(n).begin(), old.inputs(n).end());
    ins.push_back(old.inputs(a)[0]);
    const TensorId outs[] = {old.outputs(a)[0]};
    NodeAttrs attrs = old.attrs[n];
    ops::LinearGradInputAttrs::set(attrs, ops::ActivationAttrs::of(old.attrs[a]).kind);
    out.add(old.op[n], old.name[n], ins, outs, attrs, old.lane[n]);
    return true;
  });
}

void fuse_relu_maxpool(Graph& g) {
  fuse_into_pools(g);
}

namespace {

// A cast with no loss scale (a forward one) between f32 and a narrow type, `to` narrow or f32.
bool plain_cast(const NodeTable& nodes, NodeId c, bool to_narrow) {
  if (nodes.op[c] != builtin::cast || nodes.inputs(c).size() != 1) return false;
  const ops::CastAttrs cast = ops::CastAttrs::of(nodes.attrs[c]);
  const bool narrow = cast.to == DType::f16 || cast.to == DType::bf16;
  return cast.scale == ops::CastScale::none && (to_narrow ? narrow : cast.to == DType::f32);
}

// Which output of a LayerNorm node is y: layernorm's first, add_layernorm's second (after the
// sum); none (-1) for other ops.
int normalised_output(OpId op) {
  return op == builtin::layernorm ? 0 : op == builtin::add_layernorm ? 1 : -1;
}

}  // namespace

void fuse_narrowing_casts(Graph& g) {
  const NodeTable& old = g.nodes;
  const Uses uses(g);
  const NodeId none = Uses::no_node(g);
  const auto& t = g.tensors;
  std::vector<NodeId> narrowed(old.size(), none);  // LayerNorm node -> the cast of its y it takes in
  std::vector<NodeId> widened(old.size(), none);   // add_layernorm node -> the cast of an operand it takes in
  std::vector<bool> dropped(old.size(), false);
  for (NodeId c = 0; c < old.size(); ++c) {
    if (!plain_cast(old, c, true)) continue;
    const TensorId y = old.inputs(c)[0], narrow = old.outputs(c)[0];
    const NodeId n = uses.producer[y];
    if (n == none || narrowed[n] != none || !uses.read_once(g, y) || t.dtype[y] != DType::f32) continue;
    const int y_out = normalised_output(old.op[n]);
    if (y_out < 0 || old.outputs(n)[y_out] != y || t.alias_of[narrow] != no_tensor) continue;
    narrowed[n] = c;
    dropped[c] = true;
  }
  for (NodeId n = 0; n < old.size(); ++n) {
    if (old.op[n] != builtin::add_layernorm) continue;
    for (std::size_t i = 0; i < 2 && widened[n] == none; ++i) {
      const TensorId wide = old.inputs(n)[i], other = old.inputs(n)[1 - i];
      const NodeId c = uses.producer[wide];
      if (c == none || !plain_cast(old, c, false) || !uses.read_once(g, wide) || t.dtype[other] != DType::f32) continue;
      const TensorId narrow = old.inputs(c)[0];
      if (t.alias_of[narrow] != no_tensor || (t.dtype[narrow] != DType::f16 && t.dtype[narrow] != DType::bf16))
        continue;
      widened[n] = c;
      dropped[c] = true;
    }
  }
  rebuild_nodes(g, dropped, [&](NodeTable& out, NodeId n) {
    if (narrowed[n] == none && widened[n] == none) return false;
    std::vector<TensorId> ins(old.inputs(n).begin(), old.inputs(n).end());
    std::vector<TensorId> outs(old.outputs(n).begin(), old.outputs(n).end());
    ops::LayerNormAttrs attrs = ops::LayerNormAttrs::of(old.attrs[n]);
    if (const NodeId c = narrowed[n]; c != none) {
      outs[normalised_output(old.op[n])] = old.outputs(c)[0];
      attrs.y = ops::CastAttrs::of(old.attrs[c]).to;
    }
    if (const NodeId c = widened[n]; c != none) {
      // The narrow operand goes second, where the kernels read it (a + b = b + a, bit for bit);
      // the backward gives both operands the same gradient, so the order is free.
      const TensorId other = ins[0] == old.outputs(c)[0] ? ins[1] : ins[0];
      ins[0] = other;
      ins[1] = old.inputs(c)[0];
    }
    out.add(old.op[n], old.name[n], ins, outs, attrs.pack(), old.lane[n]);
    return true;
  });
}

void fuse_layers(Graph& g) {
  fuse_into_pools(g);  // first: a ReLU a pool reads is cheaper there than in the convolution
  fuse_into_convolutions(g);
  merge_with_producers(g);
}

void fuse_activation_grads(Graph& g) {
  fuse_into_input_gradients(g);
}

}  // namespace ferry::graph
