// The step IR: flat tables of tensors and nodes, indexed by small integers.
//
// A tensor is an index into struct-of-arrays columns (shape, dtype, role, where it lives, where
// the memory plan put it); a node is an index into columns of op kind, operand ranges,
// attributes and queue. Passes (autodiff, residency, memory plan) read and extend these tables;
// lowering turns the ordered node list into a tbb::flow::graph.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "ferry/offload/home.hpp"
#include "ferry/ops/op_table.hpp"
#include "ferry/ops/types.hpp"

namespace ferry::graph {

using TensorId = std::uint32_t;
using NodeId = std::uint32_t;
inline constexpr TensorId no_tensor = std::numeric_limits<TensorId>::max();

// Shared with ops/ (the op table speaks them): see ferry/ops/types.hpp.
using ops::DType;
using ops::dtype_bytes;
using ops::dtype_name;
using ops::is_host_lane;
using ops::Lane;
using ops::lane_count;
using ops::lane_name;
using ops::NodeAttrs;
using ops::Shape;

// What a tensor is for; decides its lifetime in the memory plan and its home under streaming.
enum class Role : std::uint8_t {
  input,            // batch data, written by the upload node each step
  label,            // a loss's targets (class labels, regression targets), uploaded with the batch
  weight,           // trained parameter: persistent
  optimizer_state,  // momentum / Adam moments: persistent
  predictor_state,  // the weight-update predictor's (ops/predictor.hpp): persistent, homed with the weights
  gradient_sum,     // gradient accumulation's sum over micro-batches (ops/accumulate.hpp): persistent, homed with the
                    // weights
  gradient,         // of a weight or an activation: lives within a step
  activation,       // forward intermediate: lives within a step
  scratch,          // an op's temporary (packed GEMM panels, im2col columns)
  stats,            // small results the host reads after the step (loss, correct count)
  staged,           // a device copy of a host-resident weight or optimizer state (streaming)
  output,           // the host mirror of a result the caller reads (Builder::output)
};
const char* role_name(Role r);
bool is_persistent(Role r);

// Where a persistent tensor lives between uses: its home (ferry/offload/home.hpp). Step tensors
// are `device` except host mirrors (batch staging) and gradients kept on the host.
using offload::Home;

// How the runtime fills a weight before the first step.
struct WeightInit {
  enum class Kind : std::uint8_t { none, zeros, ones, uniform } kind = Kind::none;
  float bound = 0.0f;  // uniform(-bound, bound)
};

// A placement from the memory plan: which arena buffer and the byte offset inside it.
struct Placement {
  std::uint32_t buffer = 0;
  std::uint64_t offset_bytes = 0;
};

struct TensorTable {
  std::vector<std::string> name;
  std::vector<Shape> shape;
  std::vector<DType> dtype;
  std::vector<Role> role;
  std::vector<TensorId> alias_of;  // views (reshape) share storage with this tensor
  std::vector<TensorId> grad;      // gradient of this tensor, set by autodiff
  std::vector<Home> home;
  std::vector<Placement> placement;  // set by the memory plan
  std::vector<WeightInit> init;      // weights and optimizer state only

  TensorId add(std::string n, Shape s, DType t, Role r, TensorId alias = no_tensor);
  std::size_t size() const { return name.size(); }
  std::size_t bytes(TensorId t) const { return shape[t].elems() * dtype_bytes(dtype[t]); }
  // The tensor that owns the storage of t (t itself unless t is a view).
  TensorId storage(TensorId t) const;
};

// Op kinds are rows of the op table (ferry/ops/op_table.hpp); built-in ids are ops::builtin.
using ops::OpId;
namespace builtin = ops::builtin;
// The row's name ("linear", "fetch", ...).
const char* op_name(OpId op);

struct NodeTable {
  // The most nodes a step graph may have: far beyond any model a device trains (a 4000-block
  // residual MLP has 72,000), and low enough that a mistyped size is refused in a second rather
  // than building until host memory runs out.
  static constexpr std::size_t max_nodes = std::size_t{1} << 22;
  std::vector<OpId> op;
  std::vector<std::string> name;
  std::vector<std::uint32_t> in_begin, in_count, out_begin, out_count;  // ranges of `operands`
  std::vector<TensorId> operands;
  std::vector<NodeAttrs> attrs;
  std::vector<Lane> lane;
  std::vector<TensorId> scratch;  // the op's temporary, set by the scratch pass (no_tensor if none)
  // Per node, 1: it applies the step before's optimizer update (a host update deferred into the next
  // step, graph::defer_host_updates), reading that step's gradient and step number; add_copy keeps it.
  std::vector<std::uint8_t> deferred;

  // Throws std::length_error past max_nodes.
  NodeId add(OpId k, std::string n, std::span<const TensorId> in, std::span<const TensorId> out, NodeAttrs a = {},
             Lane l = Lane::compute);
  // Appends a copy of node n of `from` (kind, name, attributes, scratch; passes that rebuild the
  // node order use it), optionally with other operands or on another lane.
  NodeId add_copy(const NodeTable& from, NodeId n);
  NodeId add_copy(const NodeTable& from, NodeId n, std::span<const TensorId> in, std::span<const TensorId> out, Lane l);
  std::size_t size() const { return op.size(); }
  std::span<const TensorId> inputs(NodeId n) const { return {operands.data() + in_begin[n], in_count[n]}; }
  std::span<const TensorId> outputs(NodeId n) const { return {operands.data() + out_begin[n], out_count[n]}; }
};

struct Graph {
  TensorTable tensors;
  NodeTable nodes;
  TensorId loss = no_tensor;  // what training minimises (set by the builder's loss layer)
  // What the state updates check (element 0 finite, or they skip): in training variants the
  // overflow guard over the loss and all weight gradients (append_overflow_guard), else the loss.
  TensorId guard = no_tensor;
  TensorId update_guard() const { return guard != no_tensor ? guard : loss; }
};

}  // namespace ferry::graph
