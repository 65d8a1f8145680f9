// A planned step's schedule from per-node durations (graph/schedule_estimate.hpp).
#include "graph/schedule_estimate.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

#include "graph/dependencies.hpp"

namespace ferry::graph {

ScheduleEstimate estimate_schedule(const Graph& g, const std::vector<Pool>& pools, std::span<const double> node_ms,
                                   std::span<const char> in_place, double enqueue_ms) {
  const auto& n = g.nodes;
  if (node_ms.size() != n.size() || in_place.size() != n.size()) {
    throw std::invalid_argument(fmt::format("estimate_schedule: {} nodes but {} durations and {} in-place flags",
                                            n.size(), node_ms.size(), in_place.size()));
  }
  const auto waits = cross_lane_dependencies(n.lane, node_byte_accesses(g, pools));
  const NodeId commit = commit_point(g);
  ScheduleEstimate out;
  std::vector<double> end(n.size(), 0.0);
  std::array<double, lane_count> lane_end{};
  double issued = 0, committed = 0, last_compute_end = 0;
  bool compute_started = false;
  for (NodeId id = 0; id < n.size(); ++id) {
    const auto lane = static_cast<std::size_t>(n.lane[id]);
    double start = lane_end[lane];
    for (NodeId m : waits[id]) start = std::max(start, end[m]);
    if (in_place[id] && commit != static_cast<NodeId>(-1) && id > commit) start = std::max(start, committed);
    if (!is_host_lane(n.lane[id])) {
      issued += enqueue_ms;
      start = std::max(start, issued);
    }
    end[id] = start + node_ms[id];
    lane_end[lane] = end[id];
    out.busy_ms[lane] += node_ms[id];
    out.step_ms = std::max(out.step_ms, end[id]);
    if (id <= commit || commit == static_cast<NodeId>(-1)) committed = std::max(committed, end[id]);
    if (n.lane[id] == Lane::compute) {
      if (compute_started && start - last_compute_end > out.longest_compute_wait_ms) {
        out.longest_compute_wait_ms = start - last_compute_end;
        out.resumed_with = id;
      }
      compute_started = true;
      last_compute_end = end[id];
    }
  }
  out.compute_idle_ms = out.step_ms - out.busy_ms[static_cast<std::size_t>(Lane::compute)];
  return out;
}

}  // namespace ferry::graph
