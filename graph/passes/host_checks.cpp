// The overflow guard's checks of reduced gradients on the host (graph/residency_passes.hpp,
// check_reduced_gradients_on_host).
//
// A data-parallel step sums each weight gradient (or this rank's share of it, ZeRO stage 2) in
// pinned host memory, copies the sum back to the device (grad_receive) and checks it there
// (overflow_guard_check). With the updates on the host lane, the update reads the sum where the
// collective left it, and the copy back served the check alone: every gradient crossed the link a
// second time. Here such a check runs on the host lane instead, on the sum in host memory, into the
// host copy of the guard that the ranks' agreement sums right after (the agreement's send writes
// that copy from the device's guard, the host checks mark it, the all-reduce sums it, and the
// receive brings it back as the guard every update reads). A check marks the guard NaN, and a NaN
// stays NaN in the sum, so every rank still skips a step whose sums are not finite anywhere.
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "graph/autodiff.hpp"
#include "graph/residency_passes.hpp"

namespace ferry::graph {
namespace {
constexpr NodeId never_node = ~NodeId{0};
}  // namespace

void check_reduced_gradients_on_host(Graph& g) {
  auto& t = g.tensors;
  const NodeTable old = g.nodes;
  if (std::find(old.op.begin(), old.op.end(), ops::builtin::grad_receive) == old.op.end()) return;
  const bool guarded = g.guard != no_tensor;
  const auto is_guard = [&](TensorId x) { return guarded && t.storage(x) == t.storage(g.guard); };
  // The ranks' agreement on the guard (ZeRO stage 2), whose send writes the guard's host copy, and
  // the guard's last writer (the commit point).
  NodeId agreement_send = never_node, last_guard_writer = never_node;
  for (NodeId n = 0; n < old.size(); ++n) {
    if (old.op[n] == ops::builtin::grad_send && is_guard(old.inputs(n)[0])) agreement_send = n;
    for (TensorId x : old.outputs(n)) {
      if (is_guard(x)) last_guard_writer = n;
    }
  }
  // Readers of every tensor, by storage.
  std::vector<std::vector<NodeId>> readers(t.size());
  for (NodeId n = 0; n < old.size(); ++n) {
    for (TensorId x : old.inputs(n)) readers[t.storage(x)].push_back(n);
  }
  // A receive of a sum in pinned host memory whose device copy only the guard's checks read (or
  // nothing): the receive and those checks go, and a host check of the sum takes their place.
  // (The weight's gradient, t.grad, still names the device copy, which no node uses now: passes
  // after this one take a weight gradient in host memory for one the device spills there.)
  std::vector<char> dropped(old.size(), 0);
  std::vector<TensorId> checked_on_host;  // the sums in host memory
  for (NodeId n = 0; n < old.size(); ++n) {
    if (old.op[n] != ops::builtin::grad_receive) continue;
    const TensorId host = old.inputs(n)[0], device = old.outputs(n)[0];
    if (t.home[t.storage(host)] != Home::host_pinned || is_guard(device)) continue;
    if (agreement_send != never_node && n > agreement_send) continue;
    const auto& rs = readers[t.storage(device)];
    const bool only_checks = std::all_of(rs.begin(), rs.end(), [&](NodeId r) {
      return old.op[r] == ops::builtin::overflow_guard_check && !is_host_lane(old.lane[r]);
    });
    if (!only_checks) continue;
    dropped[n] = 1;
    for (NodeId r : rs) dropped[r] = 1;
    if (!rs.empty()) checked_on_host.push_back(host);
  }
  if (std::find(dropped.begin(), dropped.end(), 1) == dropped.end()) return;
  // Where the host checks go: after the agreement's send, into the copy it sums; without an
  // agreement (the sums are alike on every rank) after the guard's last writer, into a copy of
  // the guard made there and copied back after them, which becomes the commit point.
  const NodeId anchor = agreement_send != never_node ? agreement_send : last_guard_writer;
  NodeTable out;
  for (NodeId n = 0; n < old.size(); ++n) {
    if (!dropped[n]) out.add_copy(old, n);
    if (n != anchor || checked_on_host.empty()) continue;
    TensorId guard_copy = no_tensor;
    if (agreement_send != never_node) {
      guard_copy = old.outputs(n)[0];
    } else {
      guard_copy = t.add(t.name[g.guard] + "@host", t.shape[g.guard], t.dtype[g.guard], Role::gradient);
      t.home[guard_copy] = Home::host_pinned;
      out.add(ops::builtin::grad_send, fmt::format("send.{}@host", t.name[g.guard]), std::span(&g.guard, 1),
              std::span(&guard_copy, 1), {}, Lane::d2h);
    }
    for (TensorId host : checked_on_host) {
      const TensorId ins[] = {guard_copy, host};
      out.add(ops::builtin::overflow_guard_check, fmt::format("{}.{}@host", overflow_guard_name, t.name[host]), ins,
              std::span(&guard_copy, 1), {}, Lane::host);
    }
    if (agreement_send == never_node) {
      out.add(ops::builtin::grad_receive, fmt::format("receive.{}@host", t.name[g.guard]), std::span(&guard_copy, 1),
              std::span(&g.guard, 1), {}, Lane::h2d);
    }
  }
  g.nodes = std::move(out);
}

}  // namespace ferry::graph
