// A planned step's schedule, estimated from a duration per node: what the compiled step's lanes
// would do if every node took the time given. ferry plan predicts a step from it where the order
// of the nodes, not the sum of one kind of work, sets the step's length (a fetch that waits for
// the bytes it overwrites, a chain of staging copies before each update).
#pragma once

#include <array>
#include <span>
#include <vector>

#include "ferry/graph/ir.hpp"
#include "graph/memory_plan.hpp"

namespace ferry::graph {

struct ScheduleEstimate {
  double step_ms = 0;                        // from the first node's start to the last one's end
  std::array<double, lane_count> busy_ms{};  // per lane: its nodes' durations summed
  double compute_idle_ms = 0;                // step_ms less the compute lane's busy time
  // The compute lane's longest idle stretch between two of its nodes, and the node that ended it
  // (NodeId(-1): none; the wait before its first node is in compute_idle_ms alone).
  double longest_compute_wait_ms = 0;
  NodeId resumed_with = static_cast<NodeId>(-1);
};

// Lanes run their nodes in the static order, as the compiled step's queues and host lanes do: a
// node starts once the node before it on its lane has ended, the latest conflicting node of each
// other lane has ended (cross_lane_dependencies over the planned byte ranges), and, where it
// changes state in place (`in_place`) after the step's commit point (the last node writing the
// guard, `g.guard`), every node up to the commit point has ended; a device node (not a host lane's)
// also not before the host has issued it, device nodes one after another `enqueue_ms` apart in
// the static order. `node_ms` has one duration per node. Every lane is taken to run apart from the
// others: on a CPU device, whose lanes share its cores, the step is their sum instead.
ScheduleEstimate estimate_schedule(const Graph& g, const std::vector<Pool>& pools, std::span<const double> node_ms,
                                   std::span<const char> in_place, double enqueue_ms);

}  // namespace ferry::graph
