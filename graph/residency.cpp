// Residency planning: update placement, the furthest-next-use stream transform, budget search.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <stdexcept>

#include "graph/residency_passes.hpp"
#include "ops/attrs.hpp"

namespace ferry::graph {
namespace {

constexpr std::uint32_t never = std::numeric_limits<std::uint32_t>::max();

// Optimizer updates: the rows of class `update` (they may move early, or to the host lane).
bool is_update(OpId op) {
  return ops::op_info(op).op_class == ops::OpClass::update;
}
// Other updates of persistent state (predictor, gradient accumulation): they move with the
// updates, never to the host.
bool is_state_update(OpId op) {
  return ops::op_info(op).op_class == ops::OpClass::state_update;
}

// A persistent tensor streamed from pinned host memory (fetched and written back, not staged
// through another home): host-lane nodes can read and write it in place.
bool streams_from_pinned(const TensorTable& t, TensorId x) {
  const TensorId s = t.storage(x);
  const auto traits = offload::home_traits(t.home[s]);
  return is_persistent(t.role[s]) && traits.needs_transfers && !traits.staged;
}

// A copy of `old` with nodes in `order` (each old id once).
NodeTable reordered(const NodeTable& old, const std::vector<NodeId>& order) {
  NodeTable out;
  for (NodeId n : order) out.add_copy(old, n);
  return out;
}

// Every node touching each storage tensor, in order, with whether it writes (one flat list,
// tensor by tensor).
struct Use {
  NodeId node;
  bool write;
};

struct Uses {
  std::vector<std::uint32_t> begin, count;  // per tensor: its uses are list[begin, begin + count)
  std::vector<Use> list;
  std::size_t size(TensorId t) const { return count[t]; }
  const Use& at(TensorId t, std::size_t k) const { return list[begin[t] + k]; }
};

Uses uses_by_tensor(const Graph& g) {
  const auto& t = g.tensors;
  const auto& n = g.nodes;
  Uses u;
  u.begin.assign(t.size() + 1, 0);
  u.count.assign(t.size(), 0);
  auto each = [&](auto&& f) {
    for (NodeId node = 0; node < n.size(); ++node) {
      if (is_host_lane(n.lane[node])) continue;  // host nodes use host memory, not device copies
      for (TensorId id : n.inputs(node)) {
        if (id != no_tensor) f(node, t.storage(id), false);
      }
      for (TensorId id : n.outputs(node)) {
        if (id != no_tensor) f(node, t.storage(id), true);
      }
    }
  };
  // Room for one use per operand, then the uses, a node's operands of one tensor merged.
  each([&](NodeId, TensorId s, bool) { ++u.begin[s + 1]; });
  for (std::size_t i = 0; i < t.size(); ++i) u.begin[i + 1] += u.begin[i];
  u.list.resize(u.begin[t.size()]);
  each([&](NodeId node, TensorId s, bool write) {
    if (u.count[s] > 0 && u.at(s, u.count[s] - 1).node == node) {
      u.list[u.begin[s] + u.count[s] - 1].write = u.at(s, u.count[s] - 1).write || write;
    } else {
      u.list[u.begin[s] + u.count[s]++] = {node, write};
    }
  });
  return u;
}

struct Interval {
  TensorId tensor;
  NodeId first, last;
  NodeId last_write = never;
};

// Splits each persistent tensor's uses into device intervals under `cache_limit` bytes of
// persistent copies, evicting the copy whose next use is furthest away (Belady; among equally far
// ones, the copy made first).
std::vector<Interval> device_intervals(const Graph& g, std::uint64_t cache_limit, const std::vector<char>& spilled) {
  const auto& t = g.tensors;
  const auto uses = uses_by_tensor(g);
  std::vector<std::size_t> cursor(t.size(), 0);  // index of the next use not yet reached
  std::vector<int> open(t.size(), -1);           // interval index while resident
  std::vector<Interval> intervals;
  std::vector<std::uint64_t> opened(t.size(), 0);  // order in which resident copies were made
  std::uint64_t copies = 0;
  // Resident copies by eviction preference: furthest next use first, then the earliest copy.
  std::map<std::pair<std::uint32_t, std::uint64_t>, TensorId> by_next_use;
  std::uint64_t resident_bytes = 0;
  auto next_use = [&](TensorId id) -> std::uint32_t {
    return cursor[id] < uses.size(id) ? uses.at(id, cursor[id]).node : never;
  };
  auto key = [&](TensorId id) { return std::make_pair(never - next_use(id), opened[id]); };
  std::vector<TensorId> needed;
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    if (is_host_lane(g.nodes.lane[n])) {
      // A host node that writes a tensor (the host optimizer's update) makes its device copy
      // stale: a later device use fetches it again (stream_graph marks that fetch to read the
      // value written).
      for (TensorId x : g.nodes.outputs(n)) {
        const TensorId s = t.storage(x);
        if (open[s] < 0) continue;
        by_next_use.erase(key(s));
        open[s] = -1;
        resident_bytes -= t.bytes(s);
      }
      continue;
    }
    needed.clear();
    auto need = [&](TensorId id) {
      if (id == no_tensor) return;
      id = t.storage(id);
      // Only tensors whose home is pinned host memory are streamed (and the weight gradients that
      // may spill there); device-home and mapped ones are addressed where they live.
      const bool streamed =
          (is_persistent(t.role[id]) && offload::home_traits(t.home[id]).needs_transfers) || spilled[id];
      if (!streamed || std::find(needed.begin(), needed.end(), id) != needed.end()) {
        return;
      }
      needed.push_back(id);
    };
    for (TensorId id : g.nodes.inputs(n)) need(id);
    for (TensorId id : g.nodes.outputs(n)) need(id);
    for (TensorId id : needed) {
      if (open[id] < 0) {
        open[id] = static_cast<int>(intervals.size());
        intervals.push_back({id, n, n});
        opened[id] = copies++;
        resident_bytes += t.bytes(id);
      } else {
        by_next_use.erase(key(id));  // its next use moves on
      }
      Interval& iv = intervals[static_cast<std::size_t>(open[id])];
      iv.last = n;
      if (uses.at(id, cursor[id]).write) iv.last_write = n;
      ++cursor[id];
    }
    // Copies with no further use in the step are done.
    for (TensorId id : needed) {
      if (next_use(id) == never) {
        open[id] = -1;
        resident_bytes -= t.bytes(id);
      } else {
        by_next_use.emplace(key(id), id);
      }
    }
    while (resident_bytes > cache_limit) {
      auto victim = by_next_use.begin();
      while (victim != by_next_use.end() && std::find(needed.begin(), needed.end(), victim->second) != needed.end()) {
        ++victim;
      }
      if (victim == by_next_use.end()) break;  // only this node's own operands are resident
      const TensorId id = victim->second;
      by_next_use.erase(victim);
      open[id] = -1;
      resident_bytes -= t.bytes(id);
    }
  }
  return intervals;
}

// Weight gradients whose storage the residency pass gave host memory (spill_gradients): step
// tensors that the eviction rule may write back to pinned host memory and fetch again for their
// update, as it does persistent tensors, when the device cannot keep them until the update.
std::vector<char> spilled_gradients(const Graph& g) {
  const auto& t = g.tensors;
  std::vector<char> spilled(t.size(), 0);
  for (TensorId w = 0; w < t.size(); ++w) {
    if (t.role[w] != Role::weight || t.grad[w] == no_tensor) continue;
    const TensorId s = t.storage(t.grad[w]);
    if (!is_persistent(t.role[s]) && t.home[s] == Home::host_pinned) spilled[s] = 1;
  }
  return spilled;
}

// With updates after the commit point (one-copy pinned state), every gradient would otherwise
// stay on the device from its backward node to the update phase: the gradients of streamed
// weights get a home in pinned host memory (the plan's host step pool) to spill to.
// `unless_read_on_host` (the host optimizer, whose updates and gradient sums get their gradients
// written back right after their last use: move_updates_to_host, move_accumulation_to_host): only
// gradients that no host-lane node reads and no write-back copies, those a data-parallel
// micro-batch step sums into their persistent sums on the device after its overflow check (before
// host accumulation, a deep MLP's 1.6 GiB of gradients were all on the device at once there).
void spill_gradients(Graph& g, bool unless_read_on_host) {
  auto& t = g.tensors;
  std::vector<char> read_on_host(t.size(), 0);  // or copied there for the host (a write-back)
  if (unless_read_on_host) {
    for (NodeId n = 0; n < g.nodes.size(); ++n) {
      if (!is_host_lane(g.nodes.lane[n]) && g.nodes.op[n] != builtin::write_back) continue;
      for (TensorId x : g.nodes.inputs(n)) read_on_host[t.storage(x)] = 1;
    }
  }
  for (TensorId w = 0; w < t.size(); ++w) {
    if (t.role[w] != Role::weight || t.grad[w] == no_tensor || t.home[w] != Home::host_pinned) continue;
    const TensorId s = t.storage(t.grad[w]);
    if (!is_persistent(t.role[s]) && !read_on_host[s]) t.home[s] = Home::host_pinned;
  }
}

// Lists per key, flat: `start[k]..start[k + 1]` indexes `items` for key k.
struct KeyedLists {
  std::vector<std::uint32_t> start;
  std::vector<std::size_t> items;
  std::span<const std::size_t> of(std::size_t k) const { return {items.data() + start[k], start[k + 1] - start[k]}; }
};
// Items in increasing order within each key: i goes to keys[i] (a key past key_count: skipped).
KeyedLists group_by_key(const std::vector<std::size_t>& keys, std::size_t key_count) {
  KeyedLists l;
  l.start.assign(key_count + 1, 0);
  for (std::size_t k : keys) {
    if (k < key_count) ++l.start[k + 1];
  }
  for (std::size_t k = 0; k < key_count; ++k) l.start[k + 1] += l.start[k];
  l.items.resize(l.start[key_count]);
  std::vector<std::uint32_t> fill(l.start.begin(), l.start.end() - 1);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (keys[i] < key_count) l.items[fill[keys[i]]++] = i;
  }
  return l;
}

constexpr std::size_t no_position = std::numeric_limits<std::size_t>::max();

// Where each interval's copies go: its fetch before node fetch_pos[i] (no_position: none), its
// write-back after node write_back_pos[i] (no_position: none), and whether the fetch reads the
// value this step wrote (reads_next).
struct TransferPlacement {
  std::vector<std::size_t> fetch_pos, write_back_pos;
  std::vector<char> reads_next;
};

// The host-lane nodes that write each tensor, in node order (an update, then ZeRO's gather in the
// weight's host home): `writers[i]` for the items of each tensor's list.
struct HostWrites {
  KeyedLists by_tensor;
  std::vector<NodeId> writers;
};
HostWrites host_writes(const Graph& g) {
  HostWrites w;
  std::vector<std::size_t> tensor_of;
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    if (!is_host_lane(g.nodes.lane[n])) continue;
    for (TensorId x : g.nodes.outputs(n)) {
      w.writers.push_back(n);
      tensor_of.push_back(g.tensors.storage(x));
    }
  }
  w.by_tensor = group_by_key(tensor_of, g.tensors.size());
  return w;
}

// A fetch goes `lookahead` compute nodes before the interval's first use, but after the previous
// interval of the same tensor has ended. A fetch after a write-back of the same tensor in this
// step (a predictor's fit reads a weight its update wrote), or after a host-lane node wrote it
// (the host optimizer's update), reads the value written, the next copy
// (FetchAttrs::after_write_back); it goes after the last such host node before the interval.
TransferPlacement place_transfers(const Graph& base, const std::vector<Interval>& intervals,
                                  const std::vector<char>& spilled, std::uint32_t lookahead) {
  const std::size_t count = base.nodes.size();
  std::vector<NodeId> compute_before(count + 1, 0);  // compute nodes in [0, n)
  std::vector<NodeId> compute_nodes;
  for (NodeId n = 0; n < count; ++n) {
    compute_before[n + 1] = compute_before[n] + (base.nodes.lane[n] == Lane::compute ? 1 : 0);
    if (base.nodes.lane[n] == Lane::compute) compute_nodes.push_back(n);
  }
  const HostWrites host_written = host_writes(base);
  std::vector<char> fetched_again(intervals.size(), 0), seen(base.tensors.size(), 0);
  for (std::size_t i = intervals.size(); i-- > 0;) {
    fetched_again[i] = seen[intervals[i].tensor];
    seen[intervals[i].tensor] = 1;
  }
  TransferPlacement p{std::vector<std::size_t>(intervals.size()),
                      std::vector<std::size_t>(intervals.size(), no_position), std::vector<char>(intervals.size(), 0)};
  std::vector<NodeId> previous_end(base.tensors.size(), never);
  std::vector<char> written(base.tensors.size(), 0);
  for (std::size_t i = 0; i < intervals.size(); ++i) {
    const Interval& iv = intervals[i];
    NodeId pos = iv.first;
    const NodeId ahead = compute_before[iv.first];
    if (lookahead > 0 && ahead > 0) pos = compute_nodes[ahead - std::min<NodeId>(lookahead, ahead)];
    pos = std::max<NodeId>(pos, 1);  // after the batch upload
    if (previous_end[iv.tensor] != never) pos = std::max<NodeId>(pos, previous_end[iv.tensor] + 1);
    // After the last host-lane write before the interval's first use.
    const auto writes = host_written.by_tensor.of(iv.tensor);
    const auto later = std::lower_bound(writes.begin(), writes.end(), iv.first,
                                        [&](std::size_t i, NodeId first) { return host_written.writers[i] < first; });
    const bool after_host_write = later != writes.begin();
    if (after_host_write) pos = std::max<NodeId>(pos, host_written.writers[*std::prev(later)] + 1);
    pos = std::min(pos, iv.first);
    // A spilled gradient has no value before the step writes it: its first copy is not fetched.
    const bool unwritten = spilled[iv.tensor] && previous_end[iv.tensor] == never;
    previous_end[iv.tensor] = iv.last;
    p.fetch_pos[i] = unwritten ? no_position : pos;
    p.reads_next[i] = written[iv.tensor] || after_host_write;
    // A spilled gradient goes to the host only to come back: not after its last interval.
    if (iv.last_write != never && !(spilled[iv.tensor] && !fetched_again[i])) {
      p.write_back_pos[i] = iv.last_write;
      written[iv.tensor] = 1;
    }
  }
  return p;
}

// Rewrites `base` so persistent tensors live on the host and are fetched for each interval.
Graph stream_graph(const Graph& base, std::uint64_t cache_limit, std::uint32_t lookahead) {
  Graph g = base;
  auto& t = g.tensors;
  const auto spilled = spilled_gradients(base);
  const auto intervals = device_intervals(base, cache_limit, spilled);
  const TransferPlacement placed = place_transfers(base, intervals, spilled, lookahead);
  const std::size_t count = base.nodes.size();
  std::vector<std::size_t> tensor_of(intervals.size());
  std::vector<TensorId> copy_of(intervals.size());
  for (std::size_t i = 0; i < intervals.size(); ++i) {
    const TensorId x = intervals[i].tensor;
    tensor_of[i] = x;
    copy_of[i] = t.add(fmt::format("{}@dev{}", t.name[x], i), t.shape[x], t.dtype[x], Role::staged);
  }
  const KeyedLists fetch_at = group_by_key(placed.fetch_pos, count);
  const KeyedLists write_back_after = group_by_key(placed.write_back_pos, count);

  // Which copy each node uses for each persistent tensor: the interval of that tensor that covers
  // the node (a tensor's intervals are disjoint and in node order; host nodes keep the host tensor).
  const KeyedLists intervals_of = group_by_key(tensor_of, base.tensors.size());
  auto renamed = [&](TensorId id, NodeId n) -> TensorId {
    if (id == no_tensor || id >= base.tensors.size() || is_host_lane(base.nodes.lane[n])) return id;
    const auto list = intervals_of.of(id);
    // The last interval that starts at or before n.
    auto it = std::upper_bound(list.begin(), list.end(), n,
                               [&](NodeId node, std::size_t i) { return node < intervals[i].first; });
    if (it == list.begin()) return id;
    const std::size_t i = *std::prev(it);
    return n <= intervals[i].last ? copy_of[i] : id;
  };

  NodeTable out;
  std::vector<TensorId> ins, outs;
  for (NodeId n = 0; n < count; ++n) {
    for (std::size_t i : fetch_at.of(n)) {
      const TensorId host = intervals[i].tensor, copy = copy_of[i];
      const NodeAttrs attrs = ops::FetchAttrs{placed.reads_next[i] != 0}.pack();
      out.add(builtin::fetch, "fetch." + t.name[host], std::span(&host, 1), std::span(&copy, 1), attrs, Lane::h2d);
    }
    ins.assign(base.nodes.inputs(n).begin(), base.nodes.inputs(n).end());
    outs.assign(base.nodes.outputs(n).begin(), base.nodes.outputs(n).end());
    for (auto* list : {&ins, &outs}) {
      for (TensorId& id : *list) id = renamed(id, n);
    }
    out.add_copy(base.nodes, n, ins, outs, base.nodes.lane[n]);
    for (std::size_t i : write_back_after.of(n)) {
      const TensorId host = intervals[i].tensor, copy = copy_of[i];
      out.add(builtin::write_back, "write_back." + t.name[host], std::span(&copy, 1), std::span(&host, 1), {},
              Lane::d2h);
    }
  }
  g.nodes = std::move(out);
  return g;
}

// Fetch / write-back counts and bytes of a graph, and its optimizer updates on the host.
void count_transfers(const Graph& g, ResidencyReport& r) {
  r.fetches = r.write_backs = r.host_updates = r.unpacks = r.packs = 0;
  r.fetch_bytes = r.write_back_bytes = 0;
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    if (g.nodes.op[n] == builtin::fetch) {
      ++r.fetches;
      r.fetch_bytes += g.tensors.bytes(g.nodes.inputs(n)[0]);
    } else if (g.nodes.op[n] == builtin::write_back) {
      ++r.write_backs;
      r.write_back_bytes += g.tensors.bytes(g.nodes.inputs(n)[0]);
    } else if (g.nodes.op[n] == builtin::unpack) {
      ++r.unpacks;
    } else if (g.nodes.op[n] == builtin::pack) {
      ++r.packs;
    } else if (g.nodes.lane[n] == Lane::host && is_update(g.nodes.op[n])) {
      ++r.host_updates;  // (not the host lane's casts, narrowings and guard checks)
    }
  }
}

// Moves state updates that can run on the host (a row with a host version) and whose persistent
// operands all stream from pinned host memory to the host lane, without their loss guard: a
// Predict step advances streamed weights in host memory, so they are fetched for the forward and
// never written back. (A step whose loss is not finite does not commit their new values.)
void move_state_updates_to_host(Graph& g) {
  const auto& t = g.tensors;
  const auto streamed = [&](TensorId x) { return streams_from_pinned(t, x); };
  NodeTable out;
  std::vector<TensorId> ins, outs;
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    bool host = is_state_update(g.nodes.op[n]) && ops::op_info(g.nodes.op[n]).host;
    ins.clear();
    for (TensorId x : g.nodes.inputs(n)) {
      if (t.role[t.storage(x)] == Role::stats) continue;
      host = host && streamed(x);
      ins.push_back(x);
    }
    outs.assign(g.nodes.outputs(n).begin(), g.nodes.outputs(n).end());
    for (TensorId x : outs) host = host && streamed(x);
    if (host) {
      out.add_copy(g.nodes, n, ins, outs, Lane::host);
    } else {
      out.add_copy(g.nodes, n);
    }
  }
  g.nodes = std::move(out);
}

// Narrows streamed weights in host memory: a quantize_i8 node (int8 Predict) or a cast (mixed
// precision) whose input streams from pinned host memory runs on the host lane into pinned host
// staging, and fetch nodes bring the narrow values (and int8's scales) to the device, so the
// weight crosses the link at a quarter (int8) or half (f16, bf16) of its bytes instead of whole.
// Only where nothing else on the device reads the fp32 weight (a forward-only step, or updates on
// the host): a device update fetches it anyway, and the narrowing then stays on the device.
void move_weight_narrowing_to_host(Graph& g) {
  auto& t = g.tensors;
  std::vector<std::uint32_t> device_readers(t.size(), 0);
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    if (is_host_lane(g.nodes.lane[n])) continue;
    for (TensorId x : g.nodes.inputs(n)) ++device_readers[t.storage(x)];
  }
  NodeTable out;
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    const auto in = g.nodes.inputs(n);
    const OpId op = g.nodes.op[n];
    const bool host = ops::op_info(op).narrows_on_host && ops::op_info(op).host && streams_from_pinned(t, in[0]) &&
                      device_readers[t.storage(in[0])] == 1;
    if (!host) {
      out.add_copy(g.nodes, n);
      continue;
    }
    const std::vector<TensorId> device_outs(g.nodes.outputs(n).begin(), g.nodes.outputs(n).end());
    std::vector<TensorId> host_outs;
    for (TensorId x : device_outs) {
      const TensorId h = t.add(t.name[x] + "@host", t.shape[x], t.dtype[x], t.role[x]);
      t.home[h] = Home::host_pinned;
      host_outs.push_back(h);
    }
    out.add_copy(g.nodes, n, in, host_outs, Lane::host);
    for (std::size_t i = 0; i < device_outs.size(); ++i) {
      out.add(builtin::fetch, "fetch." + t.name[device_outs[i]], std::span(&host_outs[i], 1),
              std::span(&device_outs[i], 1), {}, Lane::h2d);
    }
  }
  g.nodes = std::move(out);
}

// Bytes in MiB to a tenth; sizes below a tenth of a MiB (a budget of 1KiB, say) in bytes, which
// "0.0 MiB" would hide.
std::string mib(std::uint64_t b) {
  if (b < 1048576 / 10) return fmt::format("{} B", b);
  return fmt::format("{:.1f} MiB", b / 1048576.0);
}
// Rounded up at the digit shown: a minimum that, given back as the budget, is enough.
std::string mib_up(std::uint64_t b) {
  if (b < 1048576 / 10) return fmt::format("{} B", b);
  return fmt::format("{:.1f} MiB", std::ceil(b / 1048576.0 * 10 - 1e-9) / 10);
}

}  // namespace

const char* residency_mode_name(ResidencyMode m) {
  switch (m) {
    case ResidencyMode::automatic:
      return "auto";
    case ResidencyMode::resident:
      return "resident";
    case ResidencyMode::stream:
      return "stream";
    case ResidencyMode::mapped:
      return "mapped";
  }
  return "?";
}

ResidencyMode parse_residency_mode(const std::string& s) {
  for (auto m : {ResidencyMode::automatic, ResidencyMode::resident, ResidencyMode::stream, ResidencyMode::mapped}) {
    if (s == residency_mode_name(m)) return m;
  }
  throw std::invalid_argument(fmt::format("unknown residency mode '{}': use auto, resident, stream or mapped", s));
}

void check_updates_against_the_loss(Graph& g, bool pinned_in_place) {
  if (g.guard == no_tensor || g.loss == no_tensor) return;
  auto& n = g.nodes;
  const auto& t = g.tensors;
  for (NodeId id = 0; id < n.size(); ++id) {
    if (!is_update(n.op[id]) && !is_state_update(n.op[id])) continue;
    bool keep = false;  // writes state in place, or is the guard's own node
    for (TensorId x : n.outputs(id)) {
      const TensorId s = t.storage(x);
      keep = keep || s == t.storage(g.guard) ||
             (is_persistent(t.role[s]) && offload::changes_in_place(t.home[s], pinned_in_place ? 1 : 2));
    }
    if (keep) continue;
    for (std::uint32_t i = 0; i < n.in_count[id]; ++i) {
      TensorId& x = n.operands[n.in_begin[id] + i];
      if (x == g.guard) x = g.loss;
    }
  }
}

void place_updates_early(Graph& g, bool pinned_in_place) {
  check_updates_against_the_loss(g, pinned_in_place);
  const auto& n = g.nodes;
  const auto& t = g.tensors;
  // Updates and state updates (predictor, gradient accumulation) move; each goes right after the last other node that
  // touches one of its tensors, and after any earlier moving node that writes one (a predictor's snapshot, the update,
  // then its fit keep their order). A moving node that reads what a later one writes (the snapshot, the weight) anchors
  // no later than it, and equal anchors keep the node order.
  // Only nodes before a moving node anchor it: nodes after it that use what it writes (ZeRO's
  // all-gather of an updated weight) stay after it.
  const auto moves = [&](NodeId id) { return is_update(n.op[id]) || is_state_update(n.op[id]); };
  std::vector<std::vector<NodeId>> after(n.size());
  std::vector<NodeId> last_touch(t.size(), 0), last_write(t.size(), 0);
  std::vector<NodeId> written_at(t.size(), 0);  // by storage: the anchor of the last moving node writing it
  for (NodeId id = 0; id < n.size(); ++id) {
    if (!moves(id)) {
      for (TensorId x : n.inputs(id)) last_touch[t.storage(x)] = id;
      for (TensorId x : n.outputs(id)) last_touch[t.storage(x)] = last_write[t.storage(x)] = id;
      continue;
    }
    NodeId anchor = 0;
    if (is_update(n.op[id])) {
      // An update waits for its weight's last use and its gradient (inputs 0 and 1), and for the
      // last node that is not moved to write the guard it reads (ZeRO stage 2's sum of the ranks'
      // guards; the checks move and anchor it below).
      const auto in = n.inputs(id);
      anchor = std::max(last_touch[t.storage(in[0])], last_touch[t.storage(in[1])]);
      for (TensorId x : in) {
        if (t.role[t.storage(x)] == Role::stats) anchor = std::max(anchor, last_write[t.storage(x)]);
      }
    } else {
      // After the last use of what it reads, except the loss statistics (their guard), which the
      // step downloads at its very end: after their producer there.
      for (TensorId x : n.inputs(id)) {
        const TensorId s = t.storage(x);
        anchor = std::max(anchor, t.role[s] == Role::stats ? last_write[s] : last_touch[s]);
      }
      // After the other nodes' uses of what it writes, except its statistics (the overflow
      // guard), which only the step's final download reads: that read comes after it.
      for (TensorId x : n.outputs(id)) {
        const TensorId s = t.storage(x);
        if (t.role[s] != Role::stats) anchor = std::max(anchor, last_touch[s]);
      }
    }
    for (TensorId x : n.inputs(id)) anchor = std::max(anchor, written_at[t.storage(x)]);
    for (TensorId x : n.outputs(id)) anchor = std::max(anchor, written_at[t.storage(x)]);
    for (TensorId x : n.outputs(id)) written_at[t.storage(x)] = anchor;
    after[anchor].push_back(id);
  }
  std::vector<NodeId> order;
  for (NodeId id = 0; id < n.size(); ++id) {
    if (moves(id)) continue;
    order.push_back(id);
    for (NodeId u : after[id]) order.push_back(u);
  }
  g.nodes = reordered(n, order);
}

namespace {

Home preset_home(ResidencyMode mode) {
  switch (mode) {
    case ResidencyMode::stream:
      return Home::host_pinned;
    case ResidencyMode::mapped:
      return Home::host_mapped;
    default:
      return Home::device;
  }
}

// Gives every persistent tensor its home: the preset's, unless its role's home is set.
void assign_homes(Graph& g, ResidencyMode preset, const ResidencyOptions& options) {
  auto& t = g.tensors;
  for (TensorId id = 0; id < t.size(); ++id) {
    if (!is_persistent(t.role[id])) continue;
    // The predictor's state and gradient sums go where the weights go: they are used with them.
    const auto& role_home = t.role[id] == Role::optimizer_state ? options.state_home : options.weights_home;
    t.home[id] = role_home.value_or(preset_home(preset));
  }
}

void check_role_home(const char* role, const std::optional<Home>& home, bool host_unified) {
  if (!home) return;
  if (!offload::home_available(*home)) {
    throw std::invalid_argument(
        fmt::format("{} home '{}' has no storage strategy in this version: use device, "
                    "host_pinned (streamed), host_mapped, host_compressed or dropped (optimizer state only)",
                    role, offload::home_name(*home)));
  }
  if (!offload::home_traits(*home).keeps_value && std::string_view(role) == "weights") {
    throw std::invalid_argument(
        fmt::format("weights cannot live in home '{}': they would be lost; only optimizer state can be dropped",
                    offload::home_name(*home)));
  }
  if (offload::home_traits(*home).needs_unified_memory && !host_unified) {
    throw std::invalid_argument(
        fmt::format("{} home 'host_mapped' needs a device whose memory is the host's "
                    "(CL_DEVICE_HOST_UNIFIED_MEMORY); use host_pinned (streamed) on this device",
                    role));
  }
}

// The mode the options ask for, after checking them against each other and the device: the host
// optimizer streams. Throws std::invalid_argument for a combination that cannot run.
ResidencyMode checked_mode(const ResidencyOptions& options, bool host_unified) {
  ResidencyMode mode = options.mode;
  if (mode == ResidencyMode::mapped && !host_unified) {
    throw std::invalid_argument(
        "residency mode 'mapped' needs a device whose memory is the host's (CL_DEVICE_HOST_UNIFIED_MEMORY); use "
        "'stream' on this device");
  }
  check_role_home("weights", options.weights_home, host_unified);
  check_role_home("optimizer state", options.state_home, host_unified);
  if (const std::uint64_t chunk = options.staging_chunk_bytes; chunk != 0) {
    if (options.homes.host_memory != offload::HostMemory::staged) {
      throw std::invalid_argument(fmt::format(
          "chunked fetches (a staging chunk of {} bytes) are a way of staged host memory, not of '{}' host memory: "
          "use HostMemory::staged, or leave staging_chunk_bytes at 0",
          chunk, offload::host_memory_name(options.homes.host_memory)));
    }
    if (chunk < ResidencyOptions::min_staging_chunk_bytes || chunk > ResidencyOptions::max_staging_chunk_bytes) {
      throw std::invalid_argument(fmt::format("a staging chunk of {} bytes: use {} to {} bytes (the ring holds four)",
                                              chunk, ResidencyOptions::min_staging_chunk_bytes,
                                              ResidencyOptions::max_staging_chunk_bytes));
    }
  }
  if (options.host_optimizer) {
    // Updates on the host need the state in host memory and copies to and from the device. The
    // errors name the flag the user gave: --overlap-host-updates implies the host optimizer.
    const bool overlap = options.overlap_host_updates;
    const char* implied_by = overlap ? " (which --overlap-host-updates implies)" : "";
    const char* without = overlap ? "no --host-optimizer or --overlap-host-updates" : "no --host-optimizer";
    if (mode == ResidencyMode::resident || mode == ResidencyMode::mapped) {
      throw std::invalid_argument(
          fmt::format("the host optimizer{} runs with residency 'stream' (or 'auto'), not '{}': stream the state "
                      "(--residency stream; ResidencyOptions::mode) or run the optimizer on the device ({}; "
                      "ResidencyOptions::host_optimizer)",
                      implied_by, residency_mode_name(mode), without));
    }
    for (const auto* h : {&options.weights_home, &options.state_home}) {
      if (h->has_value() && **h != Home::host_pinned) {
        const bool weights = h == &options.weights_home;
        throw std::invalid_argument(
            fmt::format("the host optimizer{} needs weights and optimizer state in host_pinned, not '{}': leave the "
                        "{} home to the residency mode (no --{}-home; ResidencyOptions::{}_home) or run the "
                        "optimizer on the device ({})",
                        implied_by, offload::home_name(**h), weights ? "weights'" : "state's",
                        weights ? "weights" : "state", weights ? "weights" : "state", without));
      }
    }
    mode = ResidencyMode::stream;
  }
  if (options.overlap_host_updates && (!options.host_optimizer || options.homes.pinned_copies != 1)) {
    throw std::invalid_argument(
        options.host_optimizer
            ? "host updates overlapped with the next step's forward change the one host copy of the state in place: "
              "they need one pinned copy (HomeStoreOptions::pinned_copies 1), not two"
            : "host updates overlapped with the next step's forward (--overlap-host-updates; "
              "ResidencyOptions::overlap_host_updates) are the host optimizer's: add --host-optimizer "
              "(ResidencyOptions::host_optimizer), or leave --overlap-host-updates out");
  }
  return mode;
}

// Settings that an explicitly chosen mode and the roles' homes leave nothing to act on are
// refused rather than ignored: the user asked for something the step would not do. (Under
// 'auto' they apply only if the step ends up streamed, so they are kept for that case.)
void refuse_unused_settings(const ResidencyOptions& options, bool any_streamed, bool any_mapped) {
  if ((options.mode == ResidencyMode::stream || options.mode == ResidencyMode::mapped) && !any_streamed &&
      !any_mapped) {
    throw std::invalid_argument(fmt::format(
        "residency '{}' with the weights and the optimizer state both homed on the device moves nothing: use "
        "residency 'resident' (--residency resident; ResidencyOptions::mode), or leave a role's home to the mode "
        "(no --weights-home / --state-home device)",
        residency_mode_name(options.mode)));
  }
  if (options.staging_chunk_bytes != 0 && !any_streamed && options.mode != ResidencyMode::automatic) {
    throw std::invalid_argument(fmt::format(
        "a staging chunk of {} bytes with residency '{}' and no role homed in host memory: nothing is fetched, so "
        "no chunk would be used; leave staging_chunk_bytes at 0 (no --staging-chunk), or stream a role "
        "(--residency stream, or --weights-home / --state-home host)",
        options.staging_chunk_bytes, residency_mode_name(options.mode)));
  }
}

// Mapped homes without streaming: the mapped weights' gradients live on the host too (kernels
// write them in place), so the device holds only activations and device-home tensors; updates
// stay at the end of the step. A gradient a copy writes (data parallel: the ranks' sum, received
// from pinned host memory) stays on the device: copied into the step's host pool, which also holds
// the pinned buffer it is copied from, the sums were wrong on PoCL (the updates then differed from
// one rank's: MirroredRanks/mapped in test_distributed).
MemoryPlan plan_mapped(Graph& g, const MemoryPlanOptions& mopt, std::uint64_t budget, ResidencyReport& report) {
  std::vector<char> copied(g.tensors.size(), 0);
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    if (g.nodes.op[n] != builtin::grad_receive) continue;
    for (const TensorId x : g.nodes.outputs(n)) copied[g.tensors.storage(x)] = 1;
  }
  for (TensorId w = 0; w < g.tensors.size(); ++w) {
    if (g.tensors.role[w] == Role::weight && g.tensors.grad[w] != no_tensor && g.tensors.home[w] == Home::host_mapped) {
      const TensorId grad = g.tensors.storage(g.tensors.grad[w]);
      if (!copied[grad]) g.tensors.home[grad] = Home::host_mapped;
    }
  }
  MemoryPlan plan = plan_memory(g, mopt);
  report.min_budget_bytes = plan.peak_bytes();
  if (report.min_budget_bytes > budget) {
    throw BudgetError(fmt::format("the step's activations and gradients (and device-home tensors) need {} on the "
                                  "device, over the budget of {}: raise the budget to at least {} or use a smaller "
                                  "batch",
                                  mib_up(report.min_budget_bytes), mib(budget), mib_up(report.min_budget_bytes)),
                      report.min_budget_bytes);
  }
  return plan;
}

// Streams the tensors whose home is pinned host memory: the largest cache limit (then transfer
// slack, then lookahead) whose plan, with the device-home tensors (plan.peak_bytes() counts them),
// fits the budget; with none, every layer fetched just in time, or a BudgetError naming the minimum.
MemoryPlan plan_streamed(Graph& g, const ResidencyOptions& options, bool host_unified, const MemoryPlanOptions& mopt,
                         std::uint64_t budget, ResidencyReport& report) {
  const ResidencyMode mode = report.mode;
  Graph base = g;
  const bool pinned_in_place = options.homes.pinned_copies == 1;
  place_updates_early(base, pinned_in_place);
  if (options.host_optimizer) {
    if (pinned_in_place) move_accumulation_to_host(base, options.narrow_gradient_copies);
    move_updates_to_host(base, pinned_in_place, options.narrow_gradient_copies);
    if (options.narrow_gradient_copies) check_narrow_gradients(base);
    check_reduced_gradients_on_host(base);
    if (pinned_in_place) {
      gather_weights_in_host_homes(base);
      spill_gradients(base, true);
    }
  } else if (pinned_in_place) {
    spill_gradients(base, false);
  }
  move_state_updates_to_host(base);
  move_weight_narrowing_to_host(base);
  auto attempt = [&](std::uint64_t cache, std::uint32_t lookahead, std::uint32_t slack, ResidencyReport& r) {
    Graph s = stream_graph(base, cache, lookahead);
    stage_home_transfers(s, host_unified && options.zero_copy_staging, host_copies_for(options.homes.host_memory),
                         options.staging_min_bytes, options.staging_chunk_bytes);
    if (options.overlap_host_updates) defer_host_updates(s);
    count_transfers(s, r);
    MemoryPlanOptions with_slack = mopt;
    with_slack.transfer_slack = slack;
    // Staged copies in flight overlap the link's only on a device with engines of its own: where the
    // device's memory is the host's (a CPU device) its lanes share the cores, and the ring would only
    // take memory. Where the driver backs pinned staging with device memory, it follows the search.
    with_slack.staging_slack = host_unified ? 0 : mopt.staging_on_device ? slack : options.transfer_slack;
    MemoryPlan p = plan_memory(s, with_slack);
    r.cache_limit_bytes = cache;
    r.lookahead = lookahead;
    r.transfer_slack = slack;
    return std::make_pair(std::move(s), std::move(p));
  };
  ResidencyReport minimal_report;
  auto minimal = attempt(0, 0, 0, minimal_report);
  const std::uint64_t min_budget = minimal.second.peak_bytes();
  if (min_budget > budget) {
    throw BudgetError(
        fmt::format("a device budget of {} is too small for this step: even with every layer fetched "
                    "just in time it needs {} (its largest layer's weights, gradients and optimizer "
                    "state with the activations they meet, and {} of device-home tensors); raise the "
                    "budget to at least {}",
                    mib(budget), mib_up(min_budget), mib(minimal.second.persistent_device_bytes), mib_up(min_budget)),
        min_budget);
  }
  const auto take = [&](std::pair<Graph, MemoryPlan>& chosen, const ResidencyReport& r) {
    g = std::move(chosen.first);
    report = r;
    report.mode = mode;
    report.min_budget_bytes = min_budget;
    return std::move(chosen.second);
  };
  std::uint64_t cache = budget - min_budget;
  std::uint32_t lookahead = options.lookahead, slack = options.transfer_slack;
  for (int tries = 0; tries < 32; ++tries) {
    ResidencyReport r;
    auto candidate = attempt(cache, lookahead, slack, r);
    if (candidate.second.peak_bytes() <= budget) return take(candidate, r);
    const std::uint64_t excess = candidate.second.peak_bytes() - budget;
    if (cache == 0 && slack > 0) {
      slack /= 2;  // copies nearer the compute around them
    } else if (cache == 0) {
      if (lookahead == 0) break;
      // Prefetching further ahead costs memory: give some back (halving a long lookahead, so that
      // one far past what fits is brought down within the tries, not left for the plan of none).
      lookahead = lookahead > 4 ? lookahead / 2 : lookahead - 1;
    } else {
      cache = cache > excess ? cache - excess : 0;
    }
  }
  return take(minimal, minimal_report);
}

// The memory plan of a step whose tensors all live on the device, its adjacent updates grouped
// first where asked (group_updates).
MemoryPlan plan_resident(Graph& g, const ResidencyOptions& options, const MemoryPlanOptions& mopt) {
  if (options.group_updates) group_updates(g);
  return plan_memory(g, mopt);
}

}  // namespace

MemoryPlan plan_residency(Graph& g, const ResidencyOptions& options, bool host_unified, MemoryPlanOptions mopt,
                          ResidencyReport& report) {
  const std::uint64_t budget = options.budget_bytes ? options.budget_bytes : std::numeric_limits<std::uint64_t>::max();
  ResidencyMode mode = checked_mode(options, host_unified);
  report = {};
  if (mode == ResidencyMode::automatic) {
    Graph resident = g;
    assign_homes(resident, ResidencyMode::resident, {});
    MemoryPlan plan = plan_resident(resident, options, mopt);
    if (plan.peak_bytes() > budget) {
      mode = host_unified ? ResidencyMode::mapped : ResidencyMode::stream;
    } else if (options.weights_home || options.state_home) {
      mode = ResidencyMode::resident;  // the roles' own homes apply below
    } else {
      g = std::move(resident);  // everything fits on the device: this plan is the answer
      report.mode = ResidencyMode::resident;
      report.min_budget_bytes = plan.peak_bytes();
      return plan;
    }
  }
  // Homes per role: the preset's, or the role's own.
  assign_homes(g, mode, options);
  bool any_streamed = false, any_mapped = false;
  for (TensorId id = 0; id < g.tensors.size(); ++id) {
    if (!is_persistent(g.tensors.role[id])) continue;
    const offload::HomeTraits traits = offload::home_traits(g.tensors.home[id]);
    any_streamed = any_streamed || traits.needs_transfers;
    any_mapped = any_mapped || (traits.addressed_in_place && g.tensors.home[id] != Home::device);
  }
  // Judged on the step that places the persistent tensors: a variant planned against its arena
  // (evaluation: no optimizer state) may move nothing where the training step moves its state.
  if (options.mode != ResidencyMode::automatic && mopt.plan_persistent) {
    refuse_unused_settings(options, any_streamed, any_mapped);
  }
  report.mode = mode;
  if (any_streamed) return plan_streamed(g, options, host_unified, mopt, budget, report);
  if (any_mapped) return plan_mapped(g, mopt, budget, report);
  MemoryPlan plan = plan_resident(g, options, mopt);
  if (plan.peak_bytes() > budget) {
    throw BudgetError(fmt::format("the step needs {} on the device with every weight resident, over the budget "
                                  "of {}: raise the budget or use residency 'stream'",
                                  mib(plan.peak_bytes()), mib(budget)),
                      plan.peak_bytes());
  }
  report.min_budget_bytes = plan.peak_bytes();
  return plan;
}

}  // namespace ferry::graph
