// Host updates deferred into the next step (ResidencyOptions::overlap_host_updates).
//
// With one host copy of the state, a host update changes it in place, so it has to wait for the
// step's commit point: the overflow guard's verdict on every gradient, known only at the end of the
// backward. On a GPU the device then idles while the host applies the whole model's update (about
// 200 ms for a 1B model on 16 cores). Deferred, the update of step k runs in step k + 1, just
// before the first node that touches its weight (the weight's fetch in the forward), in the order
// the forward needs the weights: the host updates layer i while the device computes layer i - 1.
// Each update reads the gradient step k wrote back and step k's step number and learning rate,
// and runs only if step k succeeded with a finite guard (CompiledStep keeps that verdict), so the
// weights the forward of step k + 1 reads are bit for bit those of the undeferred order.
//
// What that needs of the graph: the update nodes (and a host-lane cast that only feeds one) move
// to their new places, marked NodeTable::deferred, without the loss or guard input they no longer
// check (the verdict is the previous step's); the static order then gives every dependency (the
// fetch waits for the update, this step's write-back of the gradient waits for the update that
// reads the previous one), and the memory plan keeps the step tensors they read live through the
// whole step (graph/memory_plan.cpp), since a step writes them for the next one.
#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <vector>

#include "graph/residency_passes.hpp"

namespace ferry::graph {
namespace {

constexpr NodeId none = std::numeric_limits<NodeId>::max();

bool is_host_update(const NodeTable& n, NodeId id) {
  return n.lane[id] == Lane::host && ops::op_info(n.op[id]).op_class == ops::OpClass::update;
}

}  // namespace

void defer_host_updates(Graph& g) {
  const auto& t = g.tensors;
  const NodeTable old = g.nodes;
  std::vector<NodeId> updates;
  for (NodeId n = 0; n < old.size(); ++n) {
    if (is_host_update(old, n)) updates.push_back(n);
  }
  if (updates.empty()) return;  // (an evaluation variant)
  for (NodeId n = 0; n < old.size(); ++n) {
    if (old.lane[n] != Lane::comm) continue;
    throw std::invalid_argument(fmt::format(
        "host updates overlapped with the next step's forward run on one rank, and step node '{}' is a collective: "
        "train without --overlap-host-updates (ResidencyOptions::overlap_host_updates) over ranks",
        old.name[n]));
  }
  // Per node: the update it moves with (itself for an update, its update for a feeder), or none.
  std::vector<NodeId> moved_with(old.size(), none);
  std::vector<NodeId> last_writer(t.size(), none);
  std::vector<std::vector<NodeId>> feeders(old.size());
  for (NodeId n = 0; n < old.size(); ++n) {
    if (is_host_update(old, n)) {
      moved_with[n] = n;
      // A host-lane node that makes a step tensor only this update reads (the f32 copy a host cast
      // widens from a narrow gradient) runs with it.
      for (TensorId x : old.inputs(n)) {
        const TensorId s = t.storage(x);
        const NodeId w = last_writer[s];
        if (is_persistent(t.role[s]) || w == none || old.lane[w] != Lane::host || moved_with[w] != none) continue;
        moved_with[w] = n;
        feeders[n].push_back(w);
      }
    }
    for (TensorId x : old.outputs(n)) last_writer[t.storage(x)] = n;
  }
  // Each update's place: before the first other node that touches its persistent tensors.
  std::vector<NodeId> owner(t.size(), none);  // persistent storage -> the update that writes it
  for (NodeId u : updates) {
    for (TensorId x : old.outputs(u)) {
      const TensorId s = t.storage(x);
      if (is_persistent(t.role[s])) owner[s] = u;
    }
  }
  std::vector<std::vector<NodeId>> before(old.size() + 1);  // updates placed before node n (size(): at the front)
  std::vector<char> placed(old.size(), 0);
  for (NodeId n = 0; n < old.size(); ++n) {
    if (moved_with[n] != none) continue;
    const auto place = [&](TensorId x) {
      const NodeId u = owner[t.storage(x)];
      if (u == none || placed[u]) return;
      placed[u] = 1;
      before[n].push_back(u);
    };
    for (TensorId x : old.inputs(n)) place(x);
    for (TensorId x : old.outputs(n)) place(x);
  }
  for (NodeId u : updates) {
    if (!placed[u]) before[old.size()].push_back(u);  // nothing else touches its state: first thing
  }
  NodeTable out;
  const TensorId guard = g.update_guard() == no_tensor ? no_tensor : t.storage(g.update_guard());
  const auto emit = [&](NodeId u) {
    for (NodeId f : feeders[u]) out.deferred[out.add_copy(old, f)] = 1;
    std::vector<TensorId> ins(old.inputs(u).begin(), old.inputs(u).end());
    // The loss or guard the update checked: the previous step's verdict stands for it now.
    if (ins.size() > old.outputs(u).size() + 1 &&
        (t.storage(ins.back()) == guard || t.role[t.storage(ins.back())] == Role::stats)) {
      ins.pop_back();
    }
    out.deferred[out.add_copy(old, u, ins, old.outputs(u), old.lane[u])] = 1;
  };
  for (NodeId u : before[old.size()]) emit(u);
  for (NodeId n = 0; n < old.size(); ++n) {
    if (moved_with[n] != none) continue;
    for (NodeId u : before[n]) emit(u);
    out.add_copy(old, n);
  }
  g.nodes = std::move(out);
}

}  // namespace ferry::graph
