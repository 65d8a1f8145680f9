// Step IR tables.
#include "ferry/graph/ir.hpp"

#include <fmt/format.h>

#include <stdexcept>

namespace ferry::graph {

const char* role_name(Role r) {
  switch (r) {
    case Role::input:
      return "input";
    case Role::label:
      return "label";
    case Role::weight:
      return "weight";
    case Role::optimizer_state:
      return "optimizer state";
    case Role::predictor_state:
      return "predictor state";
    case Role::gradient_sum:
      return "gradient sum";
    case Role::gradient:
      return "gradient";
    case Role::activation:
      return "activation";
    case Role::scratch:
      return "scratch";
    case Role::stats:
      return "stats";
    case Role::staged:
      return "staged copy";
    case Role::output:
      return "output";
  }
  return "?";
}

bool is_persistent(Role r) {
  return r == Role::weight || r == Role::optimizer_state || r == Role::predictor_state || r == Role::gradient_sum;
}

TensorId TensorTable::add(std::string n, Shape s, DType t, Role r, TensorId alias) {
  const auto id = static_cast<TensorId>(name.size());
  name.push_back(std::move(n));
  shape.push_back(s);
  dtype.push_back(t);
  role.push_back(r);
  alias_of.push_back(alias);
  grad.push_back(no_tensor);
  home.push_back(Home::device);
  placement.push_back({});
  init.push_back({});
  return id;
}

TensorId TensorTable::storage(TensorId t) const {
  while (alias_of[t] != no_tensor) t = alias_of[t];
  return t;
}

const char* op_name(OpId op) {
  return ops::op_info(op).name.c_str();
}

NodeId NodeTable::add(OpId k, std::string n, std::span<const TensorId> in, std::span<const TensorId> out, NodeAttrs a,
                      Lane l) {
  if (op.size() >= max_nodes) {
    throw std::length_error(fmt::format(
        "the step graph would have more than {} nodes (at '{}'): the model is too large to build; use fewer layers",
        max_nodes, n));
  }
  const auto id = static_cast<NodeId>(op.size());
  op.push_back(k);
  name.push_back(std::move(n));
  in_begin.push_back(static_cast<std::uint32_t>(operands.size()));
  in_count.push_back(static_cast<std::uint32_t>(in.size()));
  operands.insert(operands.end(), in.begin(), in.end());
  out_begin.push_back(static_cast<std::uint32_t>(operands.size()));
  out_count.push_back(static_cast<std::uint32_t>(out.size()));
  operands.insert(operands.end(), out.begin(), out.end());
  attrs.push_back(a);
  lane.push_back(l);
  scratch.push_back(no_tensor);
  deferred.push_back(0);
  return id;
}

NodeId NodeTable::add_copy(const NodeTable& from, NodeId n) {
  return add_copy(from, n, from.inputs(n), from.outputs(n), from.lane[n]);
}

NodeId NodeTable::add_copy(const NodeTable& from, NodeId n, std::span<const TensorId> in, std::span<const TensorId> out,
                           Lane l) {
  const NodeId id = add(from.op[n], from.name[n], in, out, from.attrs[n], l);
  scratch[id] = from.scratch[n];
  deferred[id] = from.deferred[n];
  return id;
}

}  // namespace ferry::graph
