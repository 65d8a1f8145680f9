// A planned step's order at the plan's rates (graph/schedule_estimate.hpp): each node's duration,
// then the schedule its lanes would run.
#include <span>
#include <vector>

#include "ferry/offload/home.hpp"
#include "graph/node_view.hpp"
#include "graph/schedule_estimate.hpp"
#include "runtime/plan_search.hpp"

namespace ferry::detail {
namespace {

double ms_at(double amount, double per_second) {
  return per_second > 0 ? amount / per_second * 1e3 : 0.0;
}

// The bytes of `xs`; without the step's statistics (the guard flag a host update reads once) where
// `but_stats`, as count_step counts a host update's.
std::uint64_t bytes_of(const graph::Graph& g, std::span<const graph::TensorId> xs, bool but_stats = false) {
  std::uint64_t bytes = 0;
  for (graph::TensorId x : xs) {
    if (!but_stats || g.tensors.role[g.tensors.storage(x)] != graph::Role::stats) bytes += g.tensors.bytes(x);
  }
  return bytes;
}

// Node n's duration at `rates`, as count_step counts the work (0 where its rate is unknown): copies
// over the link at their direction's rate; the codec's unpacks and packs at its rate, a staging
// copy of pageable memory as a read and a write at the host's memory rate; host-lane work
// (updates, sums) at that rate too; the device's GEMM-like nodes at the GEMM rate, the others by
// the bytes they read and write; collectives left to the network's bound (count_step).
double node_duration_ms(const graph::Graph& g, graph::NodeId n, const PlanRates& rates) {
  const ops::OpId op = g.nodes.op[n];
  const ops::OpInfo& row = ops::op_info(op);
  const auto in = g.nodes.inputs(n), out = g.nodes.outputs(n);
  const bool eight_bit = row.update_bound == ops::UpdateBound::quantization;
  if (op == graph::builtin::unpack || op == graph::builtin::pack) {
    const graph::TensorId home = g.tensors.storage(op == graph::builtin::unpack ? in[0] : out[0]);
    const std::uint64_t bytes = bytes_of(g, op == graph::builtin::unpack ? out : in);
    if (offload::home_traits(g.tensors.home[home]).staged)
      return ms_at(static_cast<double>(bytes), rates.codec_gbps * 1e9);
    return ms_at(2.0 * static_cast<double>(bytes), rates.host_gbps * 1e9);
  }
  // A copy at its direction's rate alone: the two copy lanes run at once here, and where the link
  // cannot carry both at full rate, count_step's transfer_ms (link_ms) bounds the step instead.
  const double link_gbps = g.nodes.lane[n] == ops::Lane::d2h ? rates.to_host_gbps() : rates.link_gbps;
  if (row.op_class == ops::OpClass::batch_transfer)
    return ms_at(static_cast<double>(bytes_of(g, out)), link_gbps * 1e9);
  if (row.op_class == ops::OpClass::state_transfer) return ms_at(static_cast<double>(bytes_of(g, in)), link_gbps * 1e9);
  if (row.op_class == ops::OpClass::communication) return 0.0;
  if (graph::is_host_lane(g.nodes.lane[n])) {
    const double gbps = eight_bit && rates.host_8bit_gbps > 0 ? rates.host_8bit_gbps : rates.host_gbps;
    return ms_at(static_cast<double>(bytes_of(g, in, true) + bytes_of(g, out, true)), gbps * 1e9);
  }
  if (at_gemm_rate(g, n)) {
    return ms_at(static_cast<double>(row.flops(graph::NodeView<ops::ShapeView>(g, n))), rates.gemm_gflops * 1e9);
  }
  const double gbps = eight_bit && rates.device_8bit_gbps > 0 ? rates.device_8bit_gbps : rates.device_gbps;
  return ms_at(static_cast<double>(bytes_of(g, in) + bytes_of(g, out)), gbps * 1e9);
}

}  // namespace

void schedule_step(const graph::Graph& g, const graph::MemoryPlan& memory, const PlanRates& rates,
                   std::uint32_t pinned_copies, PhasePlan& p) {
  const auto& t = g.tensors;
  std::vector<double> durations(g.nodes.size());
  bool timed = false;
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    durations[n] = node_duration_ms(g, n, rates);
    timed = timed || durations[n] > 0;
  }
  // Without rates (a Trainer checking its plan's bytes) every node takes no time: no schedule to find.
  if (!timed) return;
  std::vector<char> in_place(g.nodes.size(), 0);
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    if (g.nodes.deferred[n]) continue;  // it applies the step before's update, which committed
    for (graph::TensorId x : g.nodes.outputs(n)) {
      const graph::TensorId s = t.storage(x);
      if (memory.pool[s] == graph::Pool::persistent && offload::changes_in_place(t.home[s], pinned_copies))
        in_place[n] = 1;
    }
  }
  const graph::ScheduleEstimate e =
      graph::estimate_schedule(g, memory.pool, durations, in_place, rates.launch_us * 1e-3);
  p.scheduled_step_ms = e.step_ms;
  p.scheduled_compute_idle_ms = e.compute_idle_ms;
  p.scheduled_longest_wait_ms = e.longest_compute_wait_ms;
  p.scheduled_longest_wait_before = e.resumed_with < g.nodes.size() ? g.nodes.name[e.resumed_with] : std::string{};
}

}  // namespace ferry::detail
