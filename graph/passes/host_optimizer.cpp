// The host optimizer's passes (graph/residency_passes.hpp): the updates moved to the host lane,
// the overflow guard's checks of data-parallel sums on the host, and ZeRO's all-gather of the
// weights in their host homes.
//
// Checks on the host: a data-parallel step sums each weight gradient (or this rank's share of it,
// ZeRO stage 2) in pinned host memory, copies the sum back to the device (grad_receive) and checks
// it there (overflow_guard_check). With the updates on the host lane, the update reads the sum where
// the collective left it, and the copy back served the check alone: every gradient crossed the link
// a second time. check_reduced_gradients_on_host runs such a check on the host lane instead, on the
// sum in host memory, into the host copy of the guard that the ranks' agreement sums right after
// (the agreement's send writes that copy from the device's guard, the host checks mark it, the
// all-reduce sums it, and the receive brings it back as the guard every update reads). A check
// marks the guard NaN, and a NaN stays NaN in the sum, so every rank still skips a step whose sums
// are not finite anywhere.
#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <stdexcept>
#include <vector>

#include "graph/autodiff.hpp"
#include "graph/residency_passes.hpp"
#include "ops/attrs.hpp"

namespace ferry::graph {
namespace {

constexpr NodeId never = std::numeric_limits<NodeId>::max();

// Optimizer updates: the rows of class `update`.
bool is_update(OpId op) {
  return ops::op_info(op).op_class == ops::OpClass::update;
}

}  // namespace

// Moves every optimizer update to the host lane: its gradient is written back into pinned host
// memory and it reads and writes the host-resident weight and state directly. The write-back goes
// just before the update, or, with `write_back_early` (one-copy state: the updates wait for the
// commit point), right after the gradient's last use on the device, so it does not stay there
// until the update phase. A gradient a data-parallel reduction summed in pinned host memory is read
// there: no write-back. A gradient the device widened from f16 or bf16 (mixed precision: a narrow
// layer's weight gradient cast back to its f32 master's dtype) crosses the link narrow, right after
// the device's cast (the narrow tensor's last use): half the bytes of the copy. The update reads
// that copy and widens it as it reads (UpdateAttrs::grad_scale: the cast's factor, the same bits),
// so host memory holds no f32 copy of it; an update that writes its gradient (SGD without
// momentum keeps its velocity there) reads an f32 copy a host-lane cast makes.
void move_updates_to_host(Graph& g, bool write_back_early, bool narrow_copies) {
  auto& t = g.tensors;
  const NodeTable old = g.nodes;
  // Per update: the node after which its gradient's write-back goes (none: just before it).
  constexpr NodeId none = never;
  std::vector<NodeId> last_use(t.size(), none), last_writer(t.size(), none), write_back_after(old.size(), none);
  // Per update: the pinned host tensor its gradient was copied from, when a data-parallel
  // reduction left the sum there, or the gradient itself where a host-lane node made it in pinned
  // host memory (the mean of accumulated gradients: move_accumulation_to_host): the update reads
  // it rather than a copy of it written back.
  std::vector<TensorId> grad_host(old.size(), no_tensor);
  // Per update: the device cast that widened its gradient from f16 or bf16, if one did.
  std::vector<NodeId> widened_by(old.size(), none);
  for (NodeId n = 0; n < old.size(); ++n) {
    if (is_update(old.op[n])) {
      const TensorId grad = t.storage(old.inputs(n)[1]);
      const NodeId writer = last_writer[grad];
      if (writer != none && old.op[writer] == builtin::grad_receive &&
          t.home[t.storage(old.inputs(writer)[0])] == Home::host_pinned) {
        grad_host[n] = old.inputs(writer)[0];
        continue;
      }
      if (writer != none && is_host_lane(old.lane[writer]) && t.home[grad] == Home::host_pinned) {
        grad_host[n] = old.inputs(n)[1];
        continue;
      }
      if (narrow_copies && writer != none && widened_narrow_tensor(t, old, writer, grad) != no_tensor) {
        // Right after the cast, the narrow gradient's last use: it is not kept for the write-back.
        widened_by[n] = writer;
        write_back_after[n] = writer;
      } else if (write_back_early) {
        write_back_after[n] = last_use[grad];
      }
      continue;
    }
    for (TensorId x : old.outputs(n)) last_writer[t.storage(x)] = n;
    if (is_host_lane(old.lane[n])) continue;
    for (TensorId x : old.inputs(n)) last_use[t.storage(x)] = n;
    for (TensorId x : old.outputs(n)) last_use[t.storage(x)] = n;
  }
  std::vector<std::vector<NodeId>> after(old.size());  // updates whose write-back follows node n
  for (NodeId u = 0; u < old.size(); ++u) {
    if (write_back_after[u] != none) after[write_back_after[u]].push_back(u);
  }
  NodeTable out;
  // Per update reading its narrow copy: the attrs that tell it how to widen it.
  std::vector<std::optional<ops::NodeAttrs>> narrow_attrs(old.size());
  const auto host_copy = [&](TensorId x) {
    const TensorId h = t.add(t.name[x] + "@host", t.shape[x], t.dtype[x], Role::gradient);
    t.home[h] = Home::host_pinned;
    return h;
  };
  auto write_back = [&](NodeId u) {
    const TensorId grad = old.inputs(u)[1];
    const TensorId from = widened_by[u] == none ? grad : old.inputs(widened_by[u])[0];  // the narrow gradient
    const TensorId copy = host_copy(from);
    out.add(builtin::write_back, "write_back." + t.name[from], std::span(&from, 1), std::span(&copy, 1), {}, Lane::d2h);
    grad_host[u] = copy;
    if (widened_by[u] == none) return;
    const NodeId cast = widened_by[u];
    const auto outs = old.outputs(u);
    if (std::find(outs.begin(), outs.end(), grad) == outs.end()) {
      ops::UpdateAttrs attrs = ops::UpdateAttrs::of(old.attrs[u]);
      attrs.grad_scale = ops::CastAttrs::of(old.attrs[cast]).scale;
      narrow_attrs[u] = attrs.pack();
      return;
    }
    grad_host[u] = host_copy(grad);
    out.add(builtin::cast, old.name[cast] + "@host", std::span(&copy, 1), std::span(&grad_host[u], 1), old.attrs[cast],
            Lane::host);
  };
  for (NodeId n = 0; n < old.size(); ++n) {
    if (!is_update(old.op[n])) {
      out.add_copy(old, n);
      for (NodeId u : after[n]) write_back(u);
      continue;
    }
    if (!ops::op_info(old.op[n]).host) {
      throw std::invalid_argument(
          fmt::format("the host optimizer cannot run '{}' ({}): it has no host version; run "
                      "the updates on the device (leave out --host-optimizer) or use an optimizer that has "
                      "one (adam, adamw, adamw8bit, sgd)",
                      old.name[n], op_name(old.op[n])));
    }
    if (grad_host[n] == no_tensor) write_back(n);
    std::vector<TensorId> ins(old.inputs(n).begin(), old.inputs(n).end());
    const TensorId grad = ins[1];
    std::replace(ins.begin(), ins.end(), grad, grad_host[n]);  // the gradient, and SGD's velocity if it is one
    std::vector<TensorId> outs(old.outputs(n).begin(), old.outputs(n).end());
    std::replace(outs.begin(), outs.end(), grad, grad_host[n]);
    const NodeId moved = out.add_copy(old, n, ins, outs, Lane::host);
    if (narrow_attrs[n]) out.attrs[moved] = *narrow_attrs[n];
  }
  g.nodes = std::move(out);
}

void move_accumulation_to_host(Graph& g, bool narrow_copies) {
  auto& t = g.tensors;
  const NodeTable old = g.nodes;
  for (NodeId n = 0; n < old.size(); ++n) {
    if (ops::op_info(old.op[n]).op_class == ops::OpClass::communication) return;  // data parallel: not here
  }
  const auto moves = [&](NodeId n) {
    if ((old.op[n] != builtin::grad_accumulate && old.op[n] != builtin::grad_mean) || is_host_lane(old.lane[n])) {
      return false;
    }
    const TensorId sum = t.storage(old.inputs(n)[0]);
    return is_persistent(t.role[sum]) && t.home[sum] == Home::host_pinned && t.dtype[old.inputs(n)[1]] == DType::f32;
  };
  // Per moving node, with `narrow_copies`: the device cast that widened its gradient from f16 or
  // bf16 (the narrow gradient crosses instead, widened on the host). Per gradient: its last use on
  // the device but by moving nodes and the updates (which read a mean's copy instead).
  std::vector<char> moving(old.size(), 0);
  std::vector<NodeId> widened_by(old.size(), never), writer(t.size(), never), last_use(t.size(), never);
  for (NodeId n = 0; n < old.size(); ++n) {
    if (moves(n)) {
      moving[n] = 1;
      const NodeId w = writer[t.storage(old.inputs(n)[1])];
      if (narrow_copies && w != never && widened_narrow_tensor(t, old, w, old.inputs(n)[1]) != no_tensor) {
        widened_by[n] = w;
      }
      continue;
    }
    if (is_host_lane(old.lane[n]) || is_update(old.op[n])) continue;
    for (TensorId x : old.inputs(n)) last_use[t.storage(x)] = n;
    for (TensorId x : old.outputs(n)) last_use[t.storage(x)] = writer[t.storage(x)] = n;
  }
  // Per node, the moving nodes whose gradient's write-back follows it: the widening cast, or else
  // the gradient's last use. A node after the moving one that reads its gradient keeps it on the
  // device (not expected: the gradient is made and checked before its sum, and after a mean only
  // the update reads it).
  std::vector<std::vector<NodeId>> after(old.size());
  for (NodeId n = 0; n < old.size(); ++n) {
    if (!moving[n]) continue;
    const NodeId m = last_use[t.storage(old.inputs(n)[1])];
    if (m == never || m > n) {
      moving[n] = 0;
      continue;
    }
    after[widened_by[n] != never ? widened_by[n] : m].push_back(n);
  }
  const auto host_tensor = [&](TensorId like, DType dtype, const std::string& name) {
    const TensorId h = t.add(name, t.shape[like], dtype, Role::gradient);
    t.home[h] = Home::host_pinned;
    return h;
  };
  NodeTable out;
  std::vector<TensorId> host_grad(old.size(), no_tensor);
  std::vector<TensorId> mean_of(t.size(), no_tensor);  // per gradient storage: its mean's host copy
  for (NodeId n = 0; n < old.size(); ++n) {
    if (!moving[n] && is_update(old.op[n]) && mean_of[t.storage(old.inputs(n)[1])] != no_tensor) {
      // The update reads (and SGD without momentum writes) the mean in host memory.
      const TensorId grad = old.inputs(n)[1], mean = mean_of[t.storage(grad)];
      std::vector<TensorId> ins(old.inputs(n).begin(), old.inputs(n).end());
      std::vector<TensorId> outs(old.outputs(n).begin(), old.outputs(n).end());
      std::replace(ins.begin(), ins.end(), grad, mean);
      std::replace(outs.begin(), outs.end(), grad, mean);
      out.add_copy(old, n, ins, outs, old.lane[n]);
    } else if (!moving[n]) {
      out.add_copy(old, n);
    } else if (old.op[n] == builtin::grad_accumulate) {
      // After the commit point, where it was (it changes the sum in place; a step whose guard is not
      // finite skips it, as the kernel skipped its sum).
      const TensorId ins[] = {old.inputs(n)[0], host_grad[n]};
      out.add(old.op[n], old.name[n], ins, std::span(&old.inputs(n)[0], 1), old.attrs[n], Lane::host);
    }
    for (NodeId a : after[n]) {
      const TensorId grad = old.inputs(a)[1];
      const TensorId copy = host_tensor(grad, DType::f32, t.name[grad] + "@host");
      if (widened_by[a] != never) {
        // The narrow gradient, widened on the host as the device's cast widened it (its bits).
        const NodeId cast = widened_by[a];
        const TensorId narrow = old.inputs(cast)[0];
        const TensorId narrow_copy = host_tensor(narrow, t.dtype[narrow], t.name[narrow] + "@host");
        out.add(builtin::write_back, "write_back." + t.name[narrow], std::span(&narrow, 1), std::span(&narrow_copy, 1),
                {}, Lane::d2h);
        out.add(builtin::cast, old.name[cast] + "@host", std::span(&narrow_copy, 1), std::span(&copy, 1),
                old.attrs[cast], Lane::host);
      } else {
        out.add(builtin::write_back, "write_back." + t.name[grad], std::span(&grad, 1), std::span(&copy, 1), {},
                Lane::d2h);
      }
      host_grad[a] = copy;
      if (old.op[a] == builtin::grad_mean) {  // the mean, in the copy the host update reads
        const TensorId ins[] = {old.inputs(a)[0], copy};
        out.add(old.op[a], old.name[a], ins, std::span(&copy, 1), old.attrs[a], Lane::host);
        mean_of[t.storage(grad)] = copy;
      }
    }
  }
  g.nodes = std::move(out);
}

void check_narrow_gradients(Graph& g) {
  const auto& t = g.tensors;
  const NodeTable old = g.nodes;
  std::vector<std::vector<NodeId>> readers(t.size());
  std::vector<std::uint32_t> writers(t.size(), 0);
  for (NodeId n = 0; n < old.size(); ++n) {
    for (TensorId x : old.inputs(n)) readers[t.storage(x)].push_back(n);
    for (TensorId x : old.outputs(n)) ++writers[t.storage(x)];
  }
  // Per check that takes a cast's place: the narrow gradient and the cast's attrs.
  std::vector<NodeId> check_of(old.size(), never), cast_of(old.size(), never);
  for (NodeId n = 0; n < old.size(); ++n) {
    if (old.op[n] != builtin::cast || is_host_lane(old.lane[n]) || old.inputs(n).size() != 1) continue;
    const TensorId narrow = old.inputs(n)[0], wide = old.outputs(n)[0];
    const TensorId s = t.storage(wide);
    if ((t.dtype[narrow] != DType::f16 && t.dtype[narrow] != DType::bf16) || t.dtype[wide] != DType::f32 ||
        t.role[s] != Role::gradient || writers[s] != 1 || readers[s].size() != 1) {
      continue;
    }
    const NodeId check = readers[s][0];
    if (old.op[check] != builtin::overflow_guard_check || is_host_lane(old.lane[check]) ||
        old.inputs(check).size() != 2 || old.inputs(check)[1] != wide) {
      continue;
    }
    check_of[n] = check;
    cast_of[check] = n;
  }
  NodeTable out;
  for (NodeId n = 0; n < old.size(); ++n) {
    if (check_of[n] != never) continue;  // the cast: its check reads what it read
    if (cast_of[n] == never) {
      out.add_copy(old, n);
      continue;
    }
    const NodeId cast = cast_of[n];
    const TensorId ins[] = {old.inputs(n)[0], old.inputs(cast)[0]};
    const ops::CastAttrs widening = ops::CastAttrs::of(old.attrs[cast]);
    out.add(old.op[n], old.name[n], ins, old.outputs(n), ops::CastAttrs{DType::f32, widening.scale}.pack(),
            old.lane[n]);
  }
  g.nodes = std::move(out);
}

// ZeRO stages 1 and 2 with the updates on the host (and one copy of the state, changed in place):
// the weights' all-gather works on their pinned host homes, where this rank's updates left its
// shares, rather than on copies: no fetch of the updated weight for the copy of its share to the
// host, no copy of the other ranks' shares to the device and no write-back of them. The next
// step fetches the gathered weight from its home as it fetches every streamed weight.
void gather_weights_in_host_homes(Graph& g) {
  const auto& t = g.tensors;
  if (std::find(g.nodes.op.begin(), g.nodes.op.end(), builtin::weight_allgather) == g.nodes.op.end()) return;
  const NodeTable old = g.nodes;
  // Per host buffer of the gather: the weight its share comes from (share_send) and goes back to
  // (others_receive), and those copies' nodes.
  std::vector<TensorId> weight_of(t.size(), no_tensor);
  std::vector<NodeId> sent_by(t.size(), never), received_by(t.size(), never);
  for (NodeId n = 0; n < old.size(); ++n) {
    if (old.op[n] == builtin::share_send) {
      weight_of[old.outputs(n)[0]] = old.inputs(n)[0];
      sent_by[old.outputs(n)[0]] = n;
    } else if (old.op[n] == builtin::others_receive) {
      received_by[old.inputs(n)[0]] = n;
    }
  }
  std::vector<char> dropped(old.size(), 0);
  NodeTable out;
  for (NodeId n = 0; n < old.size(); ++n) {
    if (old.op[n] != builtin::weight_allgather) continue;
    for (TensorId h : old.outputs(n)) {
      const TensorId w = weight_of[h];
      if (w == no_tensor || received_by[h] == never || t.home[t.storage(w)] != Home::host_pinned) continue;
      dropped[sent_by[h]] = dropped[received_by[h]] = 1;
    }
  }
  const auto home = [&](TensorId x) {
    const TensorId w = weight_of[x];
    return w != no_tensor && dropped[sent_by[x]] ? w : x;
  };
  for (NodeId n = 0; n < old.size(); ++n) {
    if (dropped[n]) continue;
    if (old.op[n] != builtin::weight_allgather) {
      out.add_copy(old, n);
      continue;
    }
    std::vector<TensorId> ins, outs;
    for (TensorId x : old.inputs(n)) ins.push_back(home(x));
    for (TensorId x : old.outputs(n)) outs.push_back(home(x));
    out.add_copy(old, n, ins, outs, old.lane[n]);
  }
  g.nodes = std::move(out);
}

void check_reduced_gradients_on_host(Graph& g) {
  auto& t = g.tensors;
  const NodeTable old = g.nodes;
  if (std::find(old.op.begin(), old.op.end(), ops::builtin::grad_receive) == old.op.end()) return;
  const bool guarded = g.guard != no_tensor;
  const auto is_guard = [&](TensorId x) { return guarded && t.storage(x) == t.storage(g.guard); };
  // The ranks' agreement on the guard (ZeRO stage 2), whose send writes the guard's host copy, and
  // the guard's last writer (the commit point).
  NodeId agreement_send = never, last_guard_writer = never;
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
    if (agreement_send != never && n > agreement_send) continue;
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
  const NodeId anchor = agreement_send != never ? agreement_send : last_guard_writer;
  NodeTable out;
  for (NodeId n = 0; n < old.size(); ++n) {
    if (!dropped[n]) out.add_copy(old, n);
    if (n != anchor || checked_on_host.empty()) continue;
    TensorId guard_copy = no_tensor;
    if (agreement_send != never) {
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
    if (agreement_send == never) {
      out.add(ops::builtin::grad_receive, fmt::format("receive.{}@host", t.name[g.guard]), std::span(&guard_copy, 1),
              std::span(&g.guard, 1), {}, Lane::h2d);
    }
  }
  g.nodes = std::move(out);
}

}  // namespace ferry::graph
