// The precision pass, int8 part: in a forward-only variant (Predict, or an int8 evaluation) every
// Linear and Conv2d layer but the head reads its weight through quantize_i8 -> dequantize_i8
// (symmetric absmax per output channel, fp32 scales) instead of the fp32 weight. Biases,
// LayerNorm, the head and the loss stay fp32. The weight itself is untouched (a Predict step's
// apply still updates the fp32 weight). When weights stream from host memory the residency pass
// moves the quantization to the host, so the weight crosses the link as int8.
#include <fmt/format.h>

#include <optional>
#include <stdexcept>
#include <unordered_map>

#include "ferry/ops/cast.hpp"
#include "ferry/ops/op_table.hpp"
#include "graph/autodiff.hpp"
#include "ops/attrs.hpp"

namespace ferry::graph {
namespace {

// The per-output-channel layout of a layer's weight, if its row quantizes it.
std::optional<ops::QuantLayout> layout_of(OpId op, const Shape& w) {
  const ops::OpInfo& row = ops::op_info(op);
  return row.int8_weight_layout ? row.int8_weight_layout(w) : std::nullopt;
}

}  // namespace

void apply_int8_weights(Graph& g) {
  auto& t = g.tensors;
  const NodeTable old = g.nodes;
  const NodeId head = head_layer(g);
  std::unordered_map<TensorId, TensorId> int8_of;  // weight -> its dequantized copy
  NodeTable out;
  std::vector<TensorId> ins;
  for (NodeId n = 0; n < old.size(); ++n) {
    const auto in = old.inputs(n);
    const bool layer = n != head && ops::op_info(old.op[n]).op_class == ops::OpClass::forward && in.size() >= 2 &&
                       t.role[in[1]] == Role::weight && t.alias_of[in[1]] == no_tensor &&
                       t.dtype[in[1]] == DType::f32 && layout_of(old.op[n], t.shape[in[1]]);
    if (!layer) {
      out.add_copy(old, n);
      continue;
    }
    const TensorId w = in[1];
    auto it = int8_of.find(w);
    if (it == int8_of.end()) {
      const ops::QuantLayout l = *layout_of(old.op[n], t.shape[w]);
      const NodeAttrs attrs = ops::QuantAttrs{l}.pack();
      const TensorId q = t.add(t.name[w] + ".q", t.shape[w], DType::i8, Role::activation);
      const TensorId scales =
          t.add(t.name[w] + ".scales", Shape{static_cast<std::uint32_t>(l.channels)}, DType::f32, Role::activation);
      const TensorId deq = t.add(t.name[w] + ".int8", t.shape[w], DType::f32, Role::activation);
      const TensorId qs[] = {q, scales};
      out.add(builtin::quantize_i8, t.name[w] + ".quantize", std::span(&w, 1), qs, attrs);
      out.add(builtin::dequantize_i8, t.name[w] + ".dequantize", qs, std::span(&deq, 1), attrs);
      it = int8_of.emplace(w, deq).first;
    }
    ins.assign(in.begin(), in.end());
    ins[1] = it->second;
    const std::vector<TensorId> outs(old.outputs(n).begin(), old.outputs(n).end());
    out.add_copy(old, n, ins, outs, old.lane[n]);
  }
  g.nodes = std::move(out);
}

}  // namespace ferry::graph
