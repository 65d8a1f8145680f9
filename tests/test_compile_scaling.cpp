// Compile-time passes that replaced quadratic scans give the results of those scans:
//   - cross-lane dependencies by byte range against the all-pairs reference;
//   - the memory plan is sound (no two live tensors share bytes, aligned, within its buffers,
//     live bytes recounted) and never meaningfully larger than the greedy-by-size plan it
//     replaced (a copy of that planner is kept here);
//   - the stream transform (device intervals by furthest next use, fetch and write-back nodes,
//     renamed operands) equals the old quadratic implementation, copied here, for the cache limit
//     and lookahead that plan_residency chose.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <map>
#include <random>

#include "classifier.hpp"
#include "ferry/ferry.hpp"
#include "ferry/ops/op_table.hpp"
#include "graph/dependencies.hpp"
#include "graph/memory_plan.hpp"
#include "graph/residency_passes.hpp"
#include "runtime/trainer_internals.hpp"
#include "test_models.hpp"
#include "train_check.hpp"

namespace ferry::test {
namespace {

using graph::ByteAccess;
using graph::Lane;
using graph::NodeId;
using graph::TensorId;

graph::Graph forward_graph(const ModelSpec& m, std::uint32_t batch) {
  graph::Graph g = ferry::forward_graph(m, graph::VariantKey{batch, true});
  graph::append_stats_download(g);
  return g;
}

// ---- Cross-lane dependencies -----------------------------------------------------------------

// The scan the sweep replaced: for every node and every other lane, walk back to the latest node
// of that lane with a conflicting access.
std::vector<std::vector<NodeId>> all_pairs_dependencies(const std::vector<Lane>& lanes,
                                                        const std::vector<std::vector<ByteAccess>>& acc) {
  auto conflict = [](const ByteAccess& a, const ByteAccess& b) {
    return a.space == b.space && a.begin < b.end && b.begin < a.end && (a.write || b.write);
  };
  std::vector<std::vector<NodeId>> deps(lanes.size());
  for (NodeId id = 0; id < lanes.size(); ++id) {
    for (int other = 0; other < ops::lane_count; ++other) {
      if (other == static_cast<int>(lanes[id])) continue;
      for (NodeId m = id; m-- > 0;) {
        if (static_cast<int>(lanes[m]) != other) continue;
        bool found = false;
        for (const auto& a : acc[id]) {
          for (const auto& b : acc[m]) found = found || conflict(a, b);
        }
        if (found) {
          deps[id].push_back(m);
          break;
        }
      }
    }
  }
  return deps;
}

TEST(CrossLaneDependencies, MatchTheAllPairsScanOnRandomAccessPatterns) {
  std::mt19937 rng(20240607);
  auto uniform = [&](std::uint32_t lo, std::uint32_t hi) {
    return std::uniform_int_distribution<std::uint32_t>(lo, hi)(rng);
  };
  for (int trial = 0; trial < 400; ++trial) {
    const std::uint32_t nodes = uniform(1, 160);
    const std::uint32_t lane_kinds = uniform(1, 4);
    const std::uint32_t spaces = uniform(1, 3);
    const std::uint32_t extent = uniform(4, 96);  // bytes per space: small, so ranges collide often
    // Skewed lane mix (mostly compute), as in real steps, or uniform.
    const bool skewed = uniform(0, 1) == 1;
    std::vector<Lane> lanes(nodes);
    std::vector<std::vector<ByteAccess>> acc(nodes);
    for (std::uint32_t n = 0; n < nodes; ++n) {
      std::uint32_t lane = uniform(0, lane_kinds - 1);
      if (skewed && uniform(0, 3) != 0) lane = 0;
      lanes[n] = static_cast<Lane>(lane);
      const std::uint32_t count = uniform(0, 5);
      for (std::uint32_t k = 0; k < count; ++k) {
        ByteAccess a;
        a.space = uniform(0, spaces - 1) * 7919u + (trial % 2 ? 1000000007u : 0u);  // sparse ids too
        a.begin = uniform(0, extent - 1);
        a.end = std::min<std::uint64_t>(extent, a.begin + uniform(0, extent / 2 + 1));  // empty ranges too
        a.write = uniform(0, 2) == 0;
        acc[n].push_back(a);
      }
    }
    const auto fast = graph::cross_lane_dependencies(lanes, acc);
    const auto reference = all_pairs_dependencies(lanes, acc);
    ASSERT_EQ(fast, reference) << "trial " << trial << ": " << nodes << " nodes, " << lane_kinds << " lanes, " << spaces
                               << " spaces over " << extent << " bytes";
  }
}

TEST(CrossLaneDependencies, ReadAfterWriteButNotReadAfterReadOrDisjointBytes) {
  const std::vector<Lane> lanes{Lane::compute, Lane::h2d, Lane::compute, Lane::d2h, Lane::h2d};
  const std::vector<std::vector<ByteAccess>> acc{
      {{0, 0, 8, true}},   // 0: compute writes [0, 8)
      {{0, 4, 6, false}},  // 1: h2d reads [4, 6): after 0's write
      {{0, 4, 6, false}},  // 2: compute reads [4, 6): two reads do not conflict
      {{0, 6, 10, true}},  // 3: d2h writes [6, 10): after 0's write; 1 and 2 read other bytes
      {{1, 0, 8, true}},   // 4: h2d writes another space: nothing to wait for
  };
  const auto deps = graph::cross_lane_dependencies(lanes, acc);
  EXPECT_EQ(deps, all_pairs_dependencies(lanes, acc));
  EXPECT_TRUE(deps[0].empty());
  EXPECT_EQ(deps[1], (std::vector<NodeId>{0}));
  EXPECT_TRUE(deps[2].empty());
  EXPECT_EQ(deps[3], (std::vector<NodeId>{0}));
  EXPECT_TRUE(deps[4].empty());
}

TEST(CrossLaneDependencies, EmptyRangesMeetOnlyRangesHoldingThemStrictlyInside) {
  // As in the scan this replaced: [x, x) meets [b, e) when b < x < e, never another empty range.
  const std::vector<Lane> lanes{Lane::compute, Lane::h2d, Lane::h2d, Lane::d2h, Lane::compute};
  const std::vector<std::vector<ByteAccess>> acc{
      {{0, 0, 8, true}},   // 0: compute writes [0, 8)
      {{0, 8, 8, false}},  // 1: empty at its end: no conflict
      {{0, 3, 3, false}},  // 2: empty inside: after 0
      {{0, 3, 3, true}},   // 3: empty write at the same place as 2: still only after 0
      {{0, 2, 4, false}},  // 4: compute reads around 3's empty write: after 3 (and 2 reads)
  };
  const auto deps = graph::cross_lane_dependencies(lanes, acc);
  EXPECT_EQ(deps, all_pairs_dependencies(lanes, acc));
  EXPECT_TRUE(deps[1].empty());
  EXPECT_EQ(deps[2], (std::vector<NodeId>{0}));
  EXPECT_EQ(deps[3], (std::vector<NodeId>{0}));
  EXPECT_EQ(deps[4], (std::vector<NodeId>{3}));
}

TEST(CrossLaneDependencies, RejectsMismatchedSizes) {
  const std::vector<Lane> lanes{Lane::compute};
  EXPECT_THROW(graph::cross_lane_dependencies(lanes, {}), std::invalid_argument);
}

// ---- Memory plan --------------------------------------------------------------------------------

// The planner the O(n log n) one replaced: largest first, each at the lowest offset free for its
// whole lifetime, in the first buffer where it fits (existing buffers first, never grown).
struct OldPlacement {
  std::vector<graph::Placement> placement;
  std::vector<std::uint64_t> sizes;
};
OldPlacement old_greedy(const std::vector<std::uint64_t>& size, const std::vector<std::uint32_t>& first,
                        const std::vector<std::uint32_t>& last, std::uint64_t cap,
                        const std::vector<std::uint64_t>& existing) {
  struct Placed {
    std::uint32_t first, last;
    std::uint64_t offset, bytes;
  };
  std::vector<std::vector<Placed>> buffers(existing.size());
  std::vector<std::uint64_t> caps = existing, sizes(existing.size(), 0);
  OldPlacement r;
  for (std::size_t i = 0; i < size.size(); ++i) {
    bool placed = false;
    for (std::uint32_t b = 0; b < buffers.size() && !placed; ++b) {
      std::vector<std::pair<std::uint64_t, std::uint64_t>> busy;
      for (const auto& p : buffers[b]) {
        if (p.first <= last[i] && first[i] <= p.last) busy.push_back({p.offset, p.offset + p.bytes});
      }
      std::sort(busy.begin(), busy.end());
      std::uint64_t candidate = 0;
      for (const auto& iv : busy) {
        if (candidate + size[i] <= iv.first) break;
        candidate = std::max(candidate, iv.second);
      }
      if (candidate + size[i] <= caps[b]) {
        buffers[b].push_back({first[i], last[i], candidate, size[i]});
        sizes[b] = std::max(sizes[b], candidate + size[i]);
        r.placement.push_back({b, candidate});
        placed = true;
      }
    }
    if (!placed) {
      buffers.push_back({{first[i], last[i], 0, size[i]}});
      caps.push_back(cap);
      sizes.push_back(size[i]);
      r.placement.push_back({static_cast<std::uint32_t>(buffers.size() - 1), 0});
    }
  }
  r.sizes = sizes;
  return r;
}

std::uint64_t occupied(const std::vector<std::uint64_t>& sizes, const std::vector<std::uint64_t>& existing) {
  std::uint64_t total = 0;
  for (std::size_t b = 0; b < sizes.size(); ++b)
    total += b < existing.size() ? std::max(sizes[b], existing[b]) : sizes[b];
  return total;
}

// Checks a plan of `g` against brute-force recounts and the old planner, pool by pool.
void check_plan(const graph::Graph& g, const graph::MemoryPlan& plan, const graph::MemoryPlanOptions& o) {
  const auto& t = g.tensors;
  const auto& n = g.nodes;
  constexpr auto unused = std::numeric_limits<std::uint32_t>::max();
  std::vector<std::uint32_t> first(t.size(), unused), last(t.size(), 0);
  auto touch = [&](TensorId id, NodeId node) {
    if (id == graph::no_tensor) return;
    const TensorId s = t.storage(id);
    first[s] = std::min(first[s], node);
    last[s] = std::max(last[s], node);
  };
  for (NodeId node = 0; node < n.size(); ++node) {
    for (TensorId id : n.inputs(node)) touch(id, node);
    for (TensorId id : n.outputs(node)) touch(id, node);
    touch(n.scratch[node], node);
  }
  // The batch's host mirrors are the caller's before and after the step: live throughout.
  for (NodeId node = 0; node < n.size(); ++node) {
    if (ops::op_info(n.op[node]).op_class != ops::OpClass::batch_transfer) continue;
    for (TensorId id : n.lane[node] == ops::Lane::h2d ? n.inputs(node) : n.outputs(node)) {
      touch(id, 0);
      touch(id, static_cast<NodeId>(n.size() - 1));
    }
  }
  auto aligned = [&](TensorId id) {
    return (std::max<std::uint64_t>(t.bytes(id), 1) + o.alignment - 1) / o.alignment * o.alignment;
  };
  for (graph::Pool pool : {graph::Pool::persistent, graph::Pool::transient, graph::Pool::host_transient}) {
    // Persistent tensors are packed per home: a placement's buffer counts within its home.
    auto sizes_of = [&](TensorId id) -> const std::vector<std::uint64_t>& {
      return pool == graph::Pool::persistent  ? plan.persistent_buffers[static_cast<int>(t.home[id])]
             : pool == graph::Pool::transient ? plan.transient_buffers
                                              : plan.host_transient_buffers;
    };
    std::vector<TensorId> ids;
    for (TensorId id = 0; id < t.size(); ++id) {
      if (t.alias_of[id] == graph::no_tensor && first[id] != unused && plan.pool[id] == pool) ids.push_back(id);
    }
    if (pool == graph::Pool::persistent && !o.plan_persistent) continue;
    for (TensorId id : ids) {
      const auto& p = t.placement[id];
      const auto& buffer_sizes = sizes_of(id);
      ASSERT_LT(p.buffer, buffer_sizes.size()) << t.name[id];
      EXPECT_EQ(p.offset_bytes % o.alignment, 0u) << t.name[id];
      EXPECT_LE(p.offset_bytes + t.bytes(id), buffer_sizes[p.buffer]) << t.name[id];
      EXPECT_LE(buffer_sizes[p.buffer], std::max(o.max_buffer_bytes, aligned(id))) << t.name[id];
    }
    // No two tensors live at the same node share bytes (persistent ones live at every node).
    for (std::size_t i = 0; i < ids.size(); ++i) {
      for (std::size_t j = i + 1; j < ids.size(); ++j) {
        const TensorId a = ids[i], b = ids[j];
        const bool live_together = pool == graph::Pool::persistent || (first[a] <= last[b] && first[b] <= last[a]);
        const auto &pa = t.placement[a], &pb = t.placement[b];
        if (!live_together || pa.buffer != pb.buffer || t.home[a] != t.home[b]) continue;
        const bool overlap =
            pa.offset_bytes < pb.offset_bytes + t.bytes(b) && pb.offset_bytes < pa.offset_bytes + t.bytes(a);
        ASSERT_FALSE(overlap) << t.name[a] << " and " << t.name[b] << " share bytes while both live";
      }
    }
    if (pool == graph::Pool::persistent) continue;
    // Never meaningfully larger than the old greedy plan (at most 0.1%, where both are within 0.1%
    // of the most bytes live at once).
    std::vector<TensorId> order = ids;
    std::stable_sort(order.begin(), order.end(), [&](TensorId a, TensorId b) { return t.bytes(a) > t.bytes(b); });
    std::vector<std::uint64_t> size;
    std::vector<std::uint32_t> f, l;
    for (TensorId id : order) {
      size.push_back(aligned(id));
      f.push_back(first[id]);
      l.push_back(last[id]);
    }
    const auto& existing = pool == graph::Pool::transient ? o.existing_transient_buffers : std::vector<std::uint64_t>{};
    const OldPlacement old = old_greedy(size, f, l, o.max_buffer_bytes, existing);
    const auto& buffer_sizes = pool == graph::Pool::transient ? plan.transient_buffers : plan.host_transient_buffers;
    const std::uint64_t now = occupied(buffer_sizes, existing), before = occupied(old.sizes, existing);
    EXPECT_LE(now, before + before / 1024) << "pool " << static_cast<int>(pool);
  }
  // Views sit at their base's placement.
  for (TensorId id = 0; id < t.size(); ++id) {
    if (t.alias_of[id] == graph::no_tensor) continue;
    EXPECT_EQ(t.placement[id].buffer, t.placement[t.storage(id)].buffer);
    EXPECT_EQ(t.placement[id].offset_bytes, t.placement[t.storage(id)].offset_bytes);
    EXPECT_EQ(plan.pool[id], plan.pool[t.storage(id)]);
  }
  // Live bytes, recounted node by node.
  ASSERT_EQ(plan.live_bytes.size(), n.size());
  std::uint64_t unshared = 0;
  for (TensorId id = 0; id < t.size(); ++id) {
    if (t.alias_of[id] == graph::no_tensor && first[id] != unused && plan.pool[id] == graph::Pool::transient) {
      unshared += t.bytes(id);
    }
  }
  EXPECT_EQ(plan.transient_unshared_bytes, unshared);
  for (NodeId node = 0; node < n.size(); ++node) {
    std::uint64_t live = 0;
    for (TensorId id = 0; id < t.size(); ++id) {
      if (t.alias_of[id] == graph::no_tensor && first[id] != unused && plan.pool[id] == graph::Pool::transient &&
          first[id] <= node && node <= last[id]) {
        live += t.bytes(id);
      }
    }
    ASSERT_EQ(plan.live_bytes[node], live) << "node " << node;
  }
  // Totals.
  std::uint64_t transient = 0, fresh = 0;
  for (std::size_t b = 0; b < plan.transient_buffers.size(); ++b) {
    transient += plan.transient_buffers[b];
    if (b >= o.existing_transient_buffers.size()) fresh += plan.transient_buffers[b];
    if (b < o.existing_transient_buffers.size()) {
      EXPECT_EQ(plan.transient_buffers[b], o.existing_transient_buffers[b]) << "an existing buffer is never grown";
    }
  }
  EXPECT_EQ(plan.transient_bytes, transient);
  EXPECT_EQ(plan.new_transient_bytes, fresh);
}

struct PlanCase {
  const char* name;
  ModelSpec (*model)();
  std::uint32_t batch;
};

ModelSpec deep_small() {
  return models::deep(16, 40);
}
ModelSpec deep_narrow() {
  return models::deep(8, 120);
}

class MemoryPlanTest : public ::testing::TestWithParam<PlanCase> {};

TEST_P(MemoryPlanTest, IsSoundAndNoLargerThanGreedyBySize) {
  const PlanCase c = GetParam();
  const ModelSpec m = c.model();
  ops::OptimizerConfig opt;
  // Training step, one buffer.
  graph::Graph train = training_graph(m, c.batch, opt);
  graph::MemoryPlanOptions o;
  const graph::MemoryPlan plan = graph::plan_memory(train, o);
  check_plan(train, plan, o);
  // The evaluation variant packed into the training step's buffers first.
  graph::Graph eval = forward_graph(m, c.batch * 2);
  graph::MemoryPlanOptions e;
  e.plan_persistent = false;
  e.existing_transient_buffers = plan.transient_buffers;
  const graph::MemoryPlan eplan = graph::plan_memory(eval, e);
  check_plan(eval, eplan, e);
  // Buffers capped well below the step's needs: several buffers, a larger alignment.
  graph::Graph capped = training_graph(m, c.batch, opt);
  graph::MemoryPlanOptions k;
  k.alignment = 1024;
  std::uint64_t largest = 0;
  for (TensorId id = 0; id < capped.tensors.size(); ++id)
    largest = std::max<std::uint64_t>(largest, capped.tensors.bytes(id));
  k.max_buffer_bytes = std::max<std::uint64_t>((largest + 1023) / 1024 * 1024, plan.transient_bytes / 3);
  const graph::MemoryPlan kplan = graph::plan_memory(capped, k);
  EXPECT_GT(kplan.transient_buffers.size(), 1u);
  check_plan(capped, kplan, k);
}

INSTANTIATE_TEST_SUITE_P(Models, MemoryPlanTest,
                         ::testing::Values(PlanCase{"mlp", &small_mlp, 8}, PlanCase{"cnn", &small_cnn, 4},
                                           PlanCase{"residual", &small_residual, 6},
                                           PlanCase{"deep16x40", &deep_small, 8},
                                           PlanCase{"deep8x120", &deep_narrow, 4}),
                         [](const auto& info) { return std::string(info.param.name); });

// ---- Stream transform --------------------------------------------------------------------------

// The stream transform as it was before it was made O(n log n) (a linear victim scan per
// eviction, and a rename table filled node by node over every interval), kept as the reference.
namespace old {

constexpr std::uint32_t never = std::numeric_limits<std::uint32_t>::max();
using graph::Graph;
using graph::NodeTable;

bool is_update(graph::OpId op) {
  return ops::op_info(op).op_class == ops::OpClass::update;
}

struct Use {
  NodeId node;
  bool write;
};

std::vector<std::vector<Use>> uses_by_tensor(const Graph& g) {
  std::vector<std::vector<Use>> uses(g.tensors.size());
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    if (g.nodes.lane[n] == Lane::host) continue;
    auto note = [&](TensorId t, bool write) {
      if (t == graph::no_tensor) return;
      auto& u = uses[g.tensors.storage(t)];
      if (!u.empty() && u.back().node == n) {
        u.back().write = u.back().write || write;
      } else {
        u.push_back({n, write});
      }
    };
    for (TensorId t : g.nodes.inputs(n)) note(t, false);
    for (TensorId t : g.nodes.outputs(n)) note(t, true);
  }
  return uses;
}

struct Interval {
  TensorId tensor;
  NodeId first, last;
  NodeId last_write = never;
};

std::vector<Interval> device_intervals(const Graph& g, std::uint64_t cache_limit) {
  const auto& t = g.tensors;
  const auto uses = uses_by_tensor(g);
  std::vector<std::size_t> cursor(t.size(), 0);
  std::vector<int> open(t.size(), -1);
  std::vector<Interval> intervals;
  std::vector<TensorId> resident;
  std::uint64_t resident_bytes = 0;
  auto next_use = [&](TensorId id) -> std::uint32_t {
    return cursor[id] < uses[id].size() ? uses[id][cursor[id]].node : never;
  };
  auto close = [&](TensorId id) {
    open[id] = -1;
    resident.erase(std::find(resident.begin(), resident.end(), id));
    resident_bytes -= t.bytes(id);
  };
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    if (g.nodes.lane[n] == Lane::host) continue;
    std::vector<TensorId> needed;
    auto need = [&](TensorId id) {
      if (id == graph::no_tensor) return;
      id = t.storage(id);
      if (!graph::is_persistent(t.role[id]) || std::find(needed.begin(), needed.end(), id) != needed.end()) return;
      needed.push_back(id);
    };
    for (TensorId id : g.nodes.inputs(n)) need(id);
    for (TensorId id : g.nodes.outputs(n)) need(id);
    for (TensorId id : needed) {
      if (open[id] < 0) {
        open[id] = static_cast<int>(intervals.size());
        intervals.push_back({id, n, n});
        resident.push_back(id);
        resident_bytes += t.bytes(id);
      }
      Interval& iv = intervals[static_cast<std::size_t>(open[id])];
      iv.last = n;
      if (uses[id][cursor[id]].write) iv.last_write = n;
      ++cursor[id];
    }
    for (TensorId id : needed) {
      if (next_use(id) == never) close(id);
    }
    while (resident_bytes > cache_limit) {
      TensorId victim = graph::no_tensor;
      std::uint32_t furthest = 0;
      for (TensorId id : resident) {
        if (std::find(needed.begin(), needed.end(), id) != needed.end()) continue;
        if (victim == graph::no_tensor || next_use(id) > furthest) {
          victim = id;
          furthest = next_use(id);
        }
      }
      if (victim == graph::no_tensor) break;
      close(victim);
    }
  }
  return intervals;
}

Graph stream_graph(const Graph& base, std::uint64_t cache_limit, std::uint32_t lookahead) {
  Graph g = base;
  auto& t = g.tensors;
  const auto intervals = device_intervals(base, cache_limit);
  const std::size_t count = base.nodes.size();
  std::vector<NodeId> compute_before(count + 1, 0);
  std::vector<NodeId> compute_nodes;
  for (NodeId n = 0; n < count; ++n) {
    compute_before[n + 1] = compute_before[n] + (base.nodes.lane[n] == Lane::compute ? 1 : 0);
    if (base.nodes.lane[n] == Lane::compute) compute_nodes.push_back(n);
  }
  std::vector<std::vector<std::size_t>> fetch_at(count), write_back_after(count);
  std::vector<TensorId> copy_of(intervals.size());
  std::map<TensorId, NodeId> previous_end;
  for (std::size_t i = 0; i < intervals.size(); ++i) {
    const Interval& iv = intervals[i];
    NodeId pos = iv.first;
    const NodeId ahead = compute_before[iv.first];
    if (lookahead > 0 && ahead > 0) pos = compute_nodes[ahead - std::min<NodeId>(lookahead, ahead)];
    pos = std::max<NodeId>(pos, 1);
    if (auto it = previous_end.find(iv.tensor); it != previous_end.end()) pos = std::max<NodeId>(pos, it->second + 1);
    pos = std::min(pos, iv.first);
    previous_end[iv.tensor] = iv.last;
    fetch_at[pos].push_back(i);
    if (iv.last_write != never) write_back_after[iv.last_write].push_back(i);
    copy_of[i] = t.add(t.name[iv.tensor] + "@dev" + std::to_string(i), t.shape[iv.tensor], t.dtype[iv.tensor],
                       graph::Role::staged);
    t.home[iv.tensor] = graph::Home::host_pinned;
  }
  std::vector<std::map<TensorId, TensorId>> rename(count);
  for (std::size_t i = 0; i < intervals.size(); ++i) {
    for (NodeId n = intervals[i].first; n <= intervals[i].last; ++n) {
      if (base.nodes.lane[n] != Lane::host) rename[n][intervals[i].tensor] = copy_of[i];
    }
  }
  NodeTable out;
  for (NodeId n = 0; n < count; ++n) {
    for (std::size_t i : fetch_at[n]) {
      const TensorId host = intervals[i].tensor, copy = copy_of[i];
      out.add(ops::builtin::fetch, "fetch." + t.name[host], std::span(&host, 1), std::span(&copy, 1), {}, Lane::h2d);
    }
    std::vector<TensorId> ins(base.nodes.inputs(n).begin(), base.nodes.inputs(n).end());
    std::vector<TensorId> outs(base.nodes.outputs(n).begin(), base.nodes.outputs(n).end());
    for (auto* list : {&ins, &outs}) {
      for (TensorId& id : *list) {
        if (id == graph::no_tensor) continue;
        if (auto it = rename[n].find(id); it != rename[n].end()) id = it->second;
      }
    }
    out.add_copy(base.nodes, n, ins, outs, base.nodes.lane[n]);
    for (std::size_t i : write_back_after[n]) {
      const TensorId host = intervals[i].tensor, copy = copy_of[i];
      out.add(ops::builtin::write_back, "write_back." + t.name[host], std::span(&copy, 1), std::span(&host, 1), {},
              Lane::d2h);
    }
  }
  g.nodes = std::move(out);
  return g;
}

void move_updates_to_host(Graph& g) {
  auto& t = g.tensors;
  const NodeTable prev = g.nodes;
  NodeTable out;
  for (NodeId n = 0; n < prev.size(); ++n) {
    if (!is_update(prev.op[n])) {
      out.add_copy(prev, n);
      continue;
    }
    std::vector<TensorId> ins(prev.inputs(n).begin(), prev.inputs(n).end());
    const TensorId grad = ins[1];
    const TensorId grad_host = t.add(t.name[grad] + "@host", t.shape[grad], t.dtype[grad], graph::Role::gradient);
    t.home[grad_host] = graph::Home::host_pinned;
    out.add(ops::builtin::write_back, "write_back." + t.name[grad], std::span(&grad, 1), std::span(&grad_host, 1), {},
            Lane::d2h);
    std::replace(ins.begin(), ins.end(), grad, grad_host);
    std::vector<TensorId> outs(prev.outputs(n).begin(), prev.outputs(n).end());
    std::replace(outs.begin(), outs.end(), grad, grad_host);
    out.add_copy(prev, n, ins, outs, Lane::host);
  }
  g.nodes = std::move(out);
}

}  // namespace old

void expect_same_graph(const graph::Graph& a, const graph::Graph& b) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (TensorId id = 0; id < a.tensors.size(); ++id) {
    ASSERT_EQ(a.tensors.name[id], b.tensors.name[id]) << "tensor " << id;
    EXPECT_EQ(a.tensors.role[id], b.tensors.role[id]) << a.tensors.name[id];
    EXPECT_EQ(a.tensors.home[id], b.tensors.home[id]) << a.tensors.name[id];
    EXPECT_EQ(a.tensors.shape[id], b.tensors.shape[id]) << a.tensors.name[id];
    EXPECT_EQ(a.tensors.alias_of[id], b.tensors.alias_of[id]) << a.tensors.name[id];
  }
  ASSERT_EQ(a.nodes.size(), b.nodes.size());
  for (NodeId n = 0; n < a.nodes.size(); ++n) {
    ASSERT_EQ(a.nodes.name[n], b.nodes.name[n]) << "node " << n;
    EXPECT_EQ(a.nodes.op[n], b.nodes.op[n]) << a.nodes.name[n];
    EXPECT_EQ(a.nodes.lane[n], b.nodes.lane[n]) << a.nodes.name[n];
    EXPECT_EQ(a.nodes.scratch[n], b.nodes.scratch[n]) << a.nodes.name[n];
    const auto ai = a.nodes.inputs(n), bi = b.nodes.inputs(n), ao = a.nodes.outputs(n), bo = b.nodes.outputs(n);
    EXPECT_EQ(std::vector<TensorId>(ai.begin(), ai.end()), std::vector<TensorId>(bi.begin(), bi.end()))
        << a.nodes.name[n];
    EXPECT_EQ(std::vector<TensorId>(ao.begin(), ao.end()), std::vector<TensorId>(bo.begin(), bo.end()))
        << a.nodes.name[n];
  }
}

struct StreamCase {
  const char* name;
  ModelSpec (*model)();
  bool host_optimizer;
  ops::OptimizerConfig::Kind optimizer;
};

ModelSpec deep_tiny() {
  return models::deep(8, 6);
}

class StreamTransformTest : public ::testing::TestWithParam<StreamCase> {};

TEST_P(StreamTransformTest, EqualsTheQuadraticTransformAtEveryBudget) {
  const StreamCase c = GetParam();
  ops::OptimizerConfig opt;
  opt.kind = c.optimizer;
  opt.sgd.momentum = 0.9f;
  const graph::Graph g = training_graph(c.model(), 4, opt);
  const graph::MemoryPlanOptions mopt;
  auto options = [&](std::uint64_t budget, std::uint32_t lookahead) {
    graph::ResidencyOptions r;
    r.mode = graph::ResidencyMode::stream;
    r.budget_bytes = budget;
    r.lookahead = lookahead;
    r.host_optimizer = c.host_optimizer;
    r.homes.pinned_copies = 2;  // the reference streams as before one-copy state (no spilled gradients)
    return r;
  };
  // The smallest budget the step runs in, and the most it could use.
  std::uint64_t min_budget = 0;
  try {
    graph::Graph s = g;
    graph::ResidencyReport r;
    graph::plan_residency(s, options(1, 2), false, mopt, r);
    FAIL() << "a one-byte budget fits";
  } catch (const graph::BudgetError& e) {
    min_budget = e.min_budget();
  }
  graph::Graph all = g;
  graph::ResidencyReport all_report;
  const std::uint64_t most = graph::plan_residency(all, options(0, 2), false, mopt, all_report).transient_bytes;
  ASSERT_GE(most, min_budget);
  int checked = 0;
  for (std::uint32_t lookahead : {0u, 2u, 3u}) {
    for (std::uint64_t budget : {min_budget, min_budget + (most - min_budget) / 4, min_budget + (most - min_budget) / 2,
                                 most, std::uint64_t{0}}) {
      graph::Graph s = g;
      graph::ResidencyReport report;
      graph::plan_residency(s, options(budget, lookahead), false, mopt, report);
      ASSERT_EQ(report.mode, graph::ResidencyMode::stream);
      // The reference, for the cache limit and lookahead the search settled on.
      graph::Graph base = g;
      for (TensorId id = 0; id < base.tensors.size(); ++id) {
        if (graph::is_persistent(base.tensors.role[id])) base.tensors.home[id] = graph::Home::host_pinned;
      }
      graph::place_updates_early(base, false);
      if (c.host_optimizer) old::move_updates_to_host(base);
      const graph::Graph reference = old::stream_graph(base, report.cache_limit_bytes, report.lookahead);
      SCOPED_TRACE(::testing::Message() << "budget " << budget << " lookahead " << lookahead << " cache limit "
                                        << report.cache_limit_bytes << " fetches " << report.fetches);
      expect_same_graph(s, reference);
      if (::testing::Test::HasFatalFailure()) return;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 15);
}

INSTANTIATE_TEST_SUITE_P(
    Models, StreamTransformTest,
    ::testing::Values(StreamCase{"mlp_adam", &small_mlp, false, ops::OptimizerConfig::Kind::adam},
                      StreamCase{"cnn_sgd", &small_cnn, false, ops::OptimizerConfig::Kind::sgd},
                      StreamCase{"residual_adam", &small_residual, false, ops::OptimizerConfig::Kind::adam},
                      StreamCase{"residual_host_adam", &small_residual, true, ops::OptimizerConfig::Kind::adam},
                      StreamCase{"deep_adam", &deep_tiny, false, ops::OptimizerConfig::Kind::adam},
                      StreamCase{"deep_host_sgd", &deep_tiny, true, ops::OptimizerConfig::Kind::sgd}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace ferry::test
