// Cross-lane dependencies of a lowered step, found by byte range.
//
// Each node's operands are byte ranges in some address space (one space per arena buffer of a
// pool), read or written. Nodes of one lane run in order on one in-order queue, so only other
// lanes need explicit ordering: a node must wait for the latest earlier node of each other lane
// whose accesses conflict with its own (overlapping bytes in the same space, at least one side
// writing). Because the memory plan reuses bytes, this covers read-after-write, write-after-read
// and write-after-write, not only data dependencies.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "ferry/graph/ir.hpp"
#include "graph/memory_plan.hpp"

namespace ferry::graph {

// One operand of a node as bytes: [begin, end) in `space` (one id per (pool, buffer) pair).
struct ByteAccess {
  std::uint32_t space = 0;
  std::uint64_t begin = 0, end = 0;
  bool write = false;
};

// For each node (in the static order given by `lanes`, one entry per node), and for every lane
// other than its own in increasing lane order: the latest earlier node of that lane whose
// accesses conflict with this node's. Same-lane order is not included (lanes are in-order
// queues). Ranges [b, e) and [c, f) meet when b < f and c < e, so an empty range [x, x) meets the
// ranges that hold x strictly inside and never another empty range. Needs begin <= end (else
// std::invalid_argument). O((nodes + accesses) log segments) for the access patterns of a step
// (a sweep over the nodes keeping, per space, an ordered map of byte segments with each lane's
// latest writer and latest accessor).
std::vector<std::vector<NodeId>> cross_lane_dependencies(std::span<const Lane> lanes,
                                                         const std::vector<std::vector<ByteAccess>>& accesses);

// The step's commit point: the last node that writes the overflow guard's storage (g.guard), after
// which updates of state kept in place may run; NodeId(-1) where the step has no guard or no node
// writes it.
NodeId commit_point(const Graph& g);

// Each node's operands (inputs, outputs, scratch) as byte ranges of a planned step: its tensors'
// placements, one space per (pool, home, buffer) as `pools` (MemoryPlan::pool) and the homes say.
std::vector<std::vector<ByteAccess>> node_byte_accesses(const Graph& g, const std::vector<Pool>& pools);

}  // namespace ferry::graph
