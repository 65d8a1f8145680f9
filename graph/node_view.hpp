// A node of a step graph seen through one of the op table's context interfaces: the shape part
// (name, attributes, operand descriptors) shared by every context graph/ implements for rows.
#pragma once

#include <span>
#include <string_view>

#include "ferry/graph/ir.hpp"
#include "ferry/ops/op_table.hpp"

namespace ferry::graph {

// Base: ops::ShapeView or one of the contexts derived from it.
template <class Base>
class NodeView : public Base {
 public:
  NodeView(const Graph& g, NodeId n) : graph_(g), node_(n) {}
  std::string_view name() const override { return graph_.nodes.name[node_]; }
  const NodeAttrs& attrs() const override { return graph_.nodes.attrs[node_]; }
  std::size_t input_count() const override { return graph_.nodes.in_count[node_]; }
  std::size_t output_count() const override { return graph_.nodes.out_count[node_]; }
  ops::TensorDesc input(std::size_t i) const override { return desc(in_ids()[i]); }
  ops::TensorDesc output(std::size_t i) const override { return desc(out_ids()[i]); }

 protected:
  std::span<const TensorId> in_ids() const { return graph_.nodes.inputs(node_); }
  std::span<const TensorId> out_ids() const { return graph_.nodes.outputs(node_); }
  ops::TensorDesc desc(TensorId t) const { return {graph_.tensors.shape[t], graph_.tensors.dtype[t]}; }
  const Graph& graph_;
  NodeId node_;
};

}  // namespace ferry::graph
