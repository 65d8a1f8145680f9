// Liveness-based offset assignment, O(n log n) for the steps the models build.
//
// Persistent tensors live through every step: each goes at the end of the first buffer of its
// home with room (a bump allocation per buffer).
//
// Step tensors (each of the transient and host_transient pools) are packed two ways:
//   - heap simulation: a sweep over the node order that allocates the tensors first used at a
//     node (largest first) into the smallest free block that holds them (lowest offset among
//     equals), else at the top of the buffer, and frees each tensor after its last node,
//     coalescing free blocks. O(n log n).
//   - greedy by size: largest tensor first, each at the lowest offset free for its whole
//     lifetime, in the first buffer where it fits. Its lifetime query runs on a segment tree over
//     the node order whose nodes keep merged byte blocks, so it costs O(log^2 n) set lookups
//     rather than a scan of every placed tensor.
// No plan can be smaller than the most bytes live at one node (aligned, and at least the existing
// buffers' sizes). The heap simulation comes within 0.1% of that bound on the chain-like steps of
// deep models (often beating greedy by size there) and is kept; otherwise the greedy plan is
// computed too and the smaller one is kept (the greedy one on a tie). So a plan is never more than
// 0.1% larger than greedy by size alone would make it, and only where both are within 0.1% of the
// bound.
#include "graph/memory_plan.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>

#include "offload/fetch_ring.hpp"
#include "ops/attrs.hpp"

namespace ferry::graph {
namespace {

std::uint64_t align_up(std::uint64_t v, std::uint32_t align) {
  return (v + align - 1) / align * align;
}

// The step tensors of one pool, with their lifetimes and aligned sizes, largest first.
struct PoolTensors {
  std::vector<TensorId> ids;
  std::vector<std::uint32_t> first, last;  // node indices of first and last use
  std::vector<std::uint64_t> size;         // aligned bytes
};

struct PoolResult {
  std::vector<Placement> placement;  // per entry of PoolTensors
  std::vector<std::uint64_t> sizes;  // per buffer: the bytes it needs
};

// Device bytes a pool's buffers occupy: an existing buffer counts with its full size.
std::uint64_t occupied(const std::vector<std::uint64_t>& sizes, const std::vector<std::uint64_t>& existing) {
  std::uint64_t total = 0;
  for (std::size_t b = 0; b < sizes.size(); ++b)
    total += b < existing.size() ? std::max(sizes[b], existing[b]) : sizes[b];
  for (std::size_t b = sizes.size(); b < existing.size(); ++b) total += existing[b];
  return total;
}

// ---- Heap simulation -------------------------------------------------------------------------

class HeapBuffer {
 public:
  explicit HeapBuffer(std::uint64_t cap) : cap_(cap) {}

  // Best fit among the free blocks, else the top; nothing if the cap does not allow it.
  std::optional<std::uint64_t> allocate(std::uint64_t size) {
    if (auto it = by_size_.lower_bound({size, 0}); it != by_size_.end()) {
      const auto [block, off] = *it;
      by_size_.erase(it);
      by_offset_.erase(off);
      if (block > size) insert(off + size, block - size);
      return off;
    }
    if (top_ + size > cap_) return std::nullopt;
    const std::uint64_t off = top_;
    top_ += size;
    high_ = std::max(high_, top_);
    return off;
  }

  void release(std::uint64_t off, std::uint64_t size) {
    auto next = by_offset_.lower_bound(off);
    if (next != by_offset_.end() && next->first == off + size) {
      size += next->second;
      by_size_.erase({next->second, next->first});
      next = by_offset_.erase(next);
    }
    if (next != by_offset_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {
        off = prev->first;
        size += prev->second;
        by_size_.erase({prev->second, prev->first});
        by_offset_.erase(prev);
      }
    }
    if (off + size == top_) {
      top_ = off;  // the free space at the top is not a block: the top comes down
    } else {
      insert(off, size);
    }
  }

  std::uint64_t high() const { return high_; }

 private:
  void insert(std::uint64_t off, std::uint64_t size) {
    by_offset_.emplace(off, size);
    by_size_.insert({size, off});
  }

  std::uint64_t cap_;
  std::uint64_t top_ = 0;                                      // everything from here up is free
  std::uint64_t high_ = 0;                                     // the highest top: the buffer's size
  std::map<std::uint64_t, std::uint64_t> by_offset_;           // free blocks below the top: offset -> size
  std::set<std::pair<std::uint64_t, std::uint64_t>> by_size_;  // the same blocks as (size, offset)
};

PoolResult heap_plan(const PoolTensors& p, std::size_t nodes, std::uint64_t cap,
                     const std::vector<std::uint64_t>& existing) {
  std::vector<HeapBuffer> buffers;
  for (std::uint64_t e : existing) buffers.emplace_back(e);
  // Entries are largest first, so each node's list of starting tensors is too.
  std::vector<std::vector<std::uint32_t>> starts(nodes), ends(nodes);
  for (std::uint32_t i = 0; i < p.ids.size(); ++i) {
    starts[p.first[i]].push_back(i);
    ends[p.last[i]].push_back(i);
  }
  PoolResult r;
  r.placement.resize(p.ids.size());
  for (std::size_t node = 0; node < nodes; ++node) {
    for (std::uint32_t i : starts[node]) {
      bool placed = false;
      for (std::uint32_t b = 0; b < buffers.size() && !placed; ++b) {
        if (auto off = buffers[b].allocate(p.size[i])) {
          r.placement[i] = {b, *off};
          placed = true;
        }
      }
      if (!placed) {
        buffers.emplace_back(std::max(cap, p.size[i]));
        buffers.back().allocate(p.size[i]);
        r.placement[i] = {static_cast<std::uint32_t>(buffers.size() - 1), 0};
      }
    }
    for (std::uint32_t i : ends[node]) buffers[r.placement[i].buffer].release(r.placement[i].offset_bytes, p.size[i]);
  }
  for (const auto& b : buffers) r.sizes.push_back(b.high());
  return r;
}

// ---- Greedy by size --------------------------------------------------------------------------

// Disjoint byte blocks [begin, end), sorted and merged (touching blocks merge too).
class BlockSet {
 public:
  bool empty() const { return blocks_.empty(); }

  // The end of the block with the largest begin below `limit`, or 0. Blocks are disjoint, so it
  // is the furthest end among the blocks that start below `limit`.
  std::uint64_t end_before(std::uint64_t limit) const {
    auto it = std::lower_bound(blocks_.begin(), blocks_.end(), limit,
                               [](const Block& b, std::uint64_t x) { return b.first < x; });
    return it == blocks_.begin() ? 0 : std::prev(it)->second;
  }

  void add(std::uint64_t begin, std::uint64_t end) {
    auto it = std::lower_bound(blocks_.begin(), blocks_.end(), begin,
                               [](const Block& b, std::uint64_t x) { return b.first < x; });
    if (it != blocks_.begin() && std::prev(it)->second >= begin) {
      --it;
      begin = it->first;
      end = std::max(end, it->second);
    }
    auto stop = it;
    while (stop != blocks_.end() && stop->first <= end) {
      end = std::max(end, stop->second);
      ++stop;
    }
    if (stop == it) {
      blocks_.insert(it, {begin, end});
    } else {
      *it = {begin, end};
      blocks_.erase(std::next(it), stop);
    }
  }

 private:
  using Block = std::pair<std::uint64_t, std::uint64_t>;
  std::vector<Block> blocks_;
};

// The bytes of one buffer that placed tensors occupy, by node range. A segment tree over the node
// indices: a tensor's lifetime splits into O(log n) canonical tree nodes; `cover` of a tree node
// holds the tensors stored there (their lifetimes cover its whole range), `below` the union of
// `cover` over its subtree. The bytes busy somewhere in [first, last] are then `below` of the
// range's canonical nodes plus `cover` of their ancestors (two tree nodes' ranges meet only if one
// is an ancestor of the other).
class LifetimeTree {
 public:
  explicit LifetimeTree(std::size_t nodes) {
    while (leaves_ < nodes) leaves_ *= 2;
    cover_.resize(2 * leaves_);
    below_.resize(2 * leaves_);
    seen_.assign(2 * leaves_, 0);
  }

  // The lowest offset where `size` bytes are free during [first, last].
  std::uint64_t lowest_fit(std::uint32_t first, std::uint32_t last, std::uint64_t size) {
    ++visit_;
    sets_.clear();
    canonical(first, last, [&](std::size_t c) {
      if (!below_[c].empty()) sets_.push_back(&below_[c]);
      for (std::size_t a = c >> 1; a >= 1 && seen_[a] != visit_; a >>= 1) {
        seen_[a] = visit_;
        if (!cover_[a].empty()) sets_.push_back(&cover_[a]);
      }
    });
    // Move past every busy block that [y, y + size) meets until none does: a block met at y is
    // met from every offset up to its end, so no lower offset is skipped.
    std::uint64_t y = 0;
    for (bool moved = true; moved;) {
      moved = false;
      for (const BlockSet* s : sets_) {
        if (const std::uint64_t e = s->end_before(y + size); e > y) {
          y = e;
          moved = true;
        }
      }
    }
    return y;
  }

  void insert(std::uint32_t first, std::uint32_t last, std::uint64_t begin, std::uint64_t end) {
    ++visit_;
    canonical(first, last, [&](std::size_t c) {
      cover_[c].add(begin, end);
      for (std::size_t a = c; a >= 1 && seen_[a] != visit_; a >>= 1) {
        seen_[a] = visit_;
        below_[a].add(begin, end);
      }
    });
  }

 private:
  template <class F>
  void canonical(std::uint32_t first, std::uint32_t last, F&& f) {
    for (std::size_t lo = first + leaves_, hi = last + leaves_ + 1; lo < hi; lo >>= 1, hi >>= 1) {
      if (lo & 1) f(lo++);
      if (hi & 1) f(--hi);
    }
  }

  std::size_t leaves_ = 1;
  std::vector<BlockSet> cover_, below_;
  std::vector<std::uint64_t> seen_;  // visit_ stamp: ancestors already taken in this walk
  std::uint64_t visit_ = 0;
  std::vector<const BlockSet*> sets_;
};

PoolResult greedy_plan(const PoolTensors& p, std::size_t nodes, std::uint64_t cap,
                       const std::vector<std::uint64_t>& existing) {
  struct Buffer {
    std::uint64_t cap, size;
    LifetimeTree busy;
  };
  std::vector<Buffer> buffers;
  for (std::uint64_t e : existing) buffers.push_back({e, 0, LifetimeTree(nodes)});
  PoolResult r;
  r.placement.resize(p.ids.size());
  for (std::uint32_t i = 0; i < p.ids.size(); ++i) {
    const std::uint64_t size = p.size[i];
    std::uint32_t b = 0;
    std::uint64_t off = 0;
    for (; b < buffers.size(); ++b) {
      off = buffers[b].busy.lowest_fit(p.first[i], p.last[i], size);
      if (off + size <= buffers[b].cap) break;
    }
    if (b == buffers.size()) {
      buffers.push_back({cap, 0, LifetimeTree(nodes)});
      off = 0;
    }
    buffers[b].size = std::max(buffers[b].size, off + size);
    buffers[b].busy.insert(p.first[i], p.last[i], off, off + size);
    r.placement[i] = {b, off};
  }
  for (const auto& buf : buffers) r.sizes.push_back(buf.size);
  return r;
}

// ---- One pool ----------------------------------------------------------------------------------

PoolResult plan_pool(const PoolTensors& p, std::size_t nodes, std::uint64_t cap,
                     const std::vector<std::uint64_t>& existing) {
  PoolResult heap = heap_plan(p, nodes, cap, existing);
  // Lower bound: the aligned bytes live at the busiest node, and the existing buffers in full.
  std::vector<std::int64_t> delta(nodes + 1, 0);
  for (std::size_t i = 0; i < p.ids.size(); ++i) {
    delta[p.first[i]] += static_cast<std::int64_t>(p.size[i]);
    delta[p.last[i] + 1] -= static_cast<std::int64_t>(p.size[i]);
  }
  std::int64_t live = 0, peak = 0;
  for (std::size_t node = 0; node < nodes; ++node) peak = std::max(peak, live += delta[node]);
  std::uint64_t bound = static_cast<std::uint64_t>(peak), existing_bytes = 0;
  for (std::uint64_t e : existing) existing_bytes += e;
  bound = std::max(bound, existing_bytes);
  const std::uint64_t heap_bytes = occupied(heap.sizes, existing);
  if (heap_bytes <= bound + bound / 1024) return heap;  // within 0.1% of the bound, so of any plan
  PoolResult greedy = greedy_plan(p, nodes, cap, existing);
  return occupied(greedy.sizes, existing) <= heap_bytes ? greedy : heap;
}

// Persistent tensors: the end of the first buffer with room, else a new buffer.
class BumpPacker {
 public:
  BumpPacker(std::uint64_t cap, std::uint32_t align) : cap_(cap), align_(align) {}
  Placement place(std::uint64_t bytes) {
    const std::uint64_t size = align_up(std::max<std::uint64_t>(bytes, 1), align_);
    for (std::uint32_t b = 0; b < sizes_.size(); ++b) {
      if (sizes_[b] + size <= cap_) {
        const std::uint64_t off = sizes_[b];
        sizes_[b] += size;
        return {b, off};
      }
    }
    sizes_.push_back(size);
    return {static_cast<std::uint32_t>(sizes_.size() - 1), 0};
  }
  const std::vector<std::uint64_t>& sizes() const { return sizes_; }

 private:
  std::uint64_t cap_;
  std::uint32_t align_;
  std::vector<std::uint64_t> sizes_;
};

constexpr auto unused = std::numeric_limits<std::uint32_t>::max();

// The first and last node that touches each storage tensor (first: `unused` for none).
struct Lifetimes {
  std::vector<std::uint32_t> first, last;
};
// MemoryPlanOptions::transfer_slack: a device copy a fetch writes is live from `slack` compute
// nodes before the fetch, a device tensor a write-back reads last until `slack` after it.
void add_transfer_slack(const Graph& g, std::uint32_t slack, Lifetimes& l) {
  const auto& t = g.tensors;
  const auto& n = g.nodes;
  std::vector<NodeId> compute;
  for (NodeId node = 0; node < n.size(); ++node) {
    if (n.lane[node] == Lane::compute) compute.push_back(node);
  }
  const auto on_device = [&](TensorId s) { return t.home[s] == Home::device && !is_persistent(t.role[s]); };
  for (NodeId node = 0; node < n.size(); ++node) {
    if (n.op[node] == builtin::fetch) {
      const auto before =
          static_cast<std::size_t>(std::lower_bound(compute.begin(), compute.end(), node) - compute.begin());
      const std::size_t back = std::min<std::size_t>(slack, before);
      for (TensorId id : n.outputs(node)) {
        const TensorId s = t.storage(id);
        if (on_device(s) && l.first[s] == node && back > 0) l.first[s] = compute[before - back];
      }
    } else if (n.op[node] == builtin::write_back) {
      const auto after =
          static_cast<std::size_t>(std::upper_bound(compute.begin(), compute.end(), node) - compute.begin());
      const std::size_t ahead = std::min<std::size_t>(slack, compute.size() - after);
      for (TensorId id : n.inputs(node)) {
        const TensorId s = t.storage(id);
        if (on_device(s) && l.last[s] == node && ahead > 0) l.last[s] = compute[after + ahead - 1];
      }
    }
  }
}

// Pinned staging: a staged tensor outside device memory (the memory plan's staging pool).
bool is_pinned_staging(const TensorTable& t, TensorId id) {
  return t.role[id] == Role::staged && t.home[id] != Home::device;
}

// MemoryPlanOptions::staging_slack: a staging tensor (the bytes a staged
// fetch's unpack fills, or a staged write-back's copy lands in) lives until the `slack`-th staging
// tensor after it (in order of first use) is first touched. Packed by liveness alone, each staging
// tensor takes the bytes the one before it has just freed, so the host's copy into it waits for
// the link's copy out of the one before, and the two take turns where they could overlap: the
// device-update tail of a staged step was a chain of such hand-offs, a tensor at a time.
void add_staging_slack(const Graph& g, std::uint32_t slack, Lifetimes& l) {
  const auto& t = g.tensors;
  std::vector<TensorId> staging;
  for (TensorId id = 0; id < t.size(); ++id) {
    if (t.alias_of[id] == no_tensor && is_pinned_staging(t, id) && l.first[id] != unused) {
      staging.push_back(id);
    }
  }
  std::sort(staging.begin(), staging.end(),
            [&](TensorId a, TensorId b) { return l.first[a] != l.first[b] ? l.first[a] < l.first[b] : a < b; });
  for (std::size_t i = 0; i + 1 < staging.size(); ++i) {
    const TensorId later = staging[std::min<std::size_t>(i + slack, staging.size() - 1)];
    l.last[staging[i]] = std::max(l.last[staging[i]], l.first[later]);
  }
}

Lifetimes lifetimes(const Graph& g, std::uint32_t transfer_slack, std::uint32_t staging_slack) {
  const auto& t = g.tensors;
  const auto& n = g.nodes;
  Lifetimes l{std::vector<std::uint32_t>(t.size(), unused), std::vector<std::uint32_t>(t.size(), 0)};
  auto touch = [&](TensorId id, NodeId node) {
    if (id == no_tensor) return;
    const TensorId s = t.storage(id);
    l.first[s] = std::min(l.first[s], node);
    l.last[s] = std::max(l.last[s], node);
  };
  for (NodeId node = 0; node < n.size(); ++node) {
    for (TensorId id : n.inputs(node)) touch(id, node);
    for (TensorId id : n.outputs(node)) touch(id, node);
    touch(n.scratch[node], node);
  }
  // The caller fills the batch's host mirrors before the step and reads the results' after it:
  // they are live for the whole step, wherever their upload or download node sits. A deferred
  // update reads, early in a step, what the step before wrote late in it (its gradient): the step
  // tensors it touches are live for the whole step too.
  const auto whole_step = [&](TensorId id) {
    touch(id, 0);
    touch(id, static_cast<NodeId>(n.size() - 1));
  };
  for (NodeId node = 0; node < n.size(); ++node) {
    if (!n.deferred[node]) continue;
    for (TensorId id : n.inputs(node)) whole_step(id);
    for (TensorId id : n.outputs(node)) whole_step(id);
  }
  for (NodeId node = 0; node < n.size(); ++node) {
    if (ops::op_info(n.op[node]).op_class != ops::OpClass::batch_transfer) continue;
    for (TensorId id : n.lane[node] == Lane::h2d ? n.inputs(node) : n.outputs(node)) whole_step(id);
  }
  if (transfer_slack > 0) add_transfer_slack(g, transfer_slack, l);
  if (staging_slack > 0) add_staging_slack(g, staging_slack, l);
  return l;
}

// Live transient bytes per node: a difference array over the transient lifetimes.
std::vector<std::uint64_t> live_bytes(const Lifetimes& l, const std::vector<TensorId>& transient,
                                      const std::vector<std::uint64_t>& bytes, std::size_t nodes) {
  std::vector<std::int64_t> delta(nodes + 1, 0);
  for (TensorId id : transient) {
    delta[l.first[id]] += static_cast<std::int64_t>(bytes[id]);
    delta[l.last[id] + 1] -= static_cast<std::int64_t>(bytes[id]);
  }
  std::vector<std::uint64_t> live(nodes, 0);
  std::int64_t sum = 0;
  for (std::size_t node = 0; node < nodes; ++node) live[node] = static_cast<std::uint64_t>(sum += delta[node]);
  return live;
}

// The plan's buffers and byte totals from the pools' packing.
void add_buffer_totals(MemoryPlan& plan, const std::vector<BumpPacker>& persistent, const PoolResult& transient,
                       const PoolResult& host, const PoolResult& staging, const MemoryPlanOptions& options) {
  for (int h = 0; h < offload::home_count; ++h) {
    plan.persistent_buffers[h] = persistent[h].sizes();
    for (auto b : plan.persistent_buffers[h]) {
      plan.persistent_bytes += b;
      if (static_cast<Home>(h) == Home::device) plan.persistent_device_bytes += b;
    }
  }
  plan.transient_buffers = transient.sizes;
  plan.host_transient_buffers = host.sizes;
  plan.host_staging_from = host.sizes.size();
  plan.host_transient_buffers.insert(plan.host_transient_buffers.end(), staging.sizes.begin(), staging.sizes.end());
  plan.shared_host_buffers = std::min(options.existing_host_buffers.size(), host.sizes.size());
  const std::size_t staging_count = staging.sizes.size() - (plan.fetch_ring_chunk_bytes > 0 ? 1 : 0);
  plan.shared_staging_buffers = std::min(options.existing_staging_buffers.size(), staging_count);
  for (std::size_t b = 0; b < plan.host_transient_buffers.size(); ++b) {
    std::uint64_t& size = plan.host_transient_buffers[b];
    const bool in_staging = b >= plan.host_staging_from;
    const std::size_t s = b - plan.host_staging_from;  // index among the staging buffers
    bool shared = false;
    if (!in_staging && b < plan.shared_host_buffers) {
      size = std::max(size, options.existing_host_buffers[b]);
      shared = true;
    } else if (in_staging && s < plan.shared_staging_buffers) {
      size = std::max(size, options.existing_staging_buffers[s]);
      shared = true;
    } else if (in_staging && s == staging_count) {
      shared = plan.shared_fetch_ring;  // the ring, sized above
    }
    plan.host_transient_bytes += size;
    if (in_staging) plan.host_staging_bytes += size;
    if (shared) continue;
    plan.new_host_transient_bytes += size;
    if (in_staging) plan.new_host_staging_bytes += size;
  }
  plan.staging_on_device = options.staging_on_device;
  for (std::size_t b = 0; b < plan.transient_buffers.size(); ++b) {
    const bool existing = b < options.existing_transient_buffers.size();
    // A reused buffer occupies its full size on the device whatever part of it this plan uses.
    if (existing)
      plan.transient_buffers[b] = std::max(plan.transient_buffers[b], options.existing_transient_buffers[b]);
    plan.transient_bytes += plan.transient_buffers[b];
    if (!existing) plan.new_transient_bytes += plan.transient_buffers[b];
  }
}

}  // namespace

MemoryPlan plan_memory(Graph& g, const MemoryPlanOptions& options) {
  auto& t = g.tensors;
  const auto& n = g.nodes;
  const Lifetimes life = lifetimes(g, options.transfer_slack, options.staging_slack);
  const std::vector<std::uint32_t>& first = life.first;
  const std::vector<std::uint32_t>& last = life.last;

  MemoryPlan plan;
  plan.pool.assign(t.size(), Pool::transient);
  std::vector<TensorId> order;
  std::vector<std::uint64_t> bytes(t.size(), 0);
  for (TensorId id = 0; id < t.size(); ++id) {
    if (t.alias_of[id] != no_tensor || first[id] == unused) continue;
    bytes[id] = t.bytes(id);
    if (bytes[id] > options.max_buffer_bytes) {
      throw std::runtime_error(
          fmt::format("tensor '{}' ({} bytes, shape {}) is larger than the device's largest buffer ({} bytes): "
                      "use a smaller batch or layer",
                      t.name[id], t.bytes(id), t.shape[id].str(), options.max_buffer_bytes));
    }
    if (is_persistent(t.role[id])) plan.pool[id] = Pool::persistent;
    order.push_back(id);
  }
  for (TensorId id : order) {
    if (plan.pool[id] == Pool::transient && t.home[id] != Home::device) plan.pool[id] = Pool::host_transient;
  }
  // Largest first; ties by id keep it deterministic.
  std::sort(order.begin(), order.end(),
            [&](TensorId a, TensorId b) { return bytes[a] != bytes[b] ? bytes[a] > bytes[b] : a < b; });

  std::vector<BumpPacker> persistent(offload::home_count, BumpPacker(options.max_buffer_bytes, options.alignment));
  PoolTensors transient, host_transient, staging;
  for (TensorId id : order) {
    if (plan.pool[id] == Pool::persistent) {
      if (options.plan_persistent) t.placement[id] = persistent[static_cast<int>(t.home[id])].place(bytes[id]);
      continue;
    }
    PoolTensors& p = plan.pool[id] == Pool::transient ? transient : is_pinned_staging(t, id) ? staging : host_transient;
    p.ids.push_back(id);
    p.first.push_back(first[id]);
    p.last.push_back(last[id]);
    p.size.push_back(align_up(std::max<std::uint64_t>(bytes[id], 1), options.alignment));
    if (plan.pool[id] == Pool::transient) plan.transient_unshared_bytes += bytes[id];
  }
  const PoolResult transient_plan =
      plan_pool(transient, n.size(), options.max_buffer_bytes, options.existing_transient_buffers);
  const PoolResult host_plan =
      plan_pool(host_transient, n.size(), options.max_buffer_bytes, options.existing_host_buffers);
  PoolResult staging_plan = plan_pool(staging, n.size(), options.max_buffer_bytes, options.existing_staging_buffers);
  // The chunked fetches' ring: a pinned buffer of its own after the staging tensors' (one fetch at
  // a time uses it, whatever the node order, so it is not packed by liveness).
  for (NodeId id = 0; id < n.size(); ++id) {
    if (n.op[id] != builtin::fetch) continue;
    const std::uint64_t chunk = std::uint64_t(ops::FetchAttrs::of(n.attrs[id]).chunk_kib) * 1024;
    plan.fetch_ring_chunk_bytes = std::max(plan.fetch_ring_chunk_bytes, chunk);
  }
  if (plan.fetch_ring_chunk_bytes > 0) {
    // Another variant's ring serves this one too where it is as large (chunked fetches fill a
    // ring within one step, and variants never run at the same time).
    const std::uint64_t ring =
        align_up(offload::FetchRing::default_slots * plan.fetch_ring_chunk_bytes, options.alignment);
    plan.shared_fetch_ring = options.existing_fetch_ring_bytes > 0;
    staging_plan.sizes.push_back(std::max(ring, options.existing_fetch_ring_bytes));
  }
  for (std::size_t i = 0; i < transient.ids.size(); ++i) t.placement[transient.ids[i]] = transient_plan.placement[i];
  for (std::size_t i = 0; i < host_transient.ids.size(); ++i) {
    t.placement[host_transient.ids[i]] = host_plan.placement[i];
  }
  const auto staging_from = static_cast<std::uint32_t>(host_plan.sizes.size());
  for (std::size_t i = 0; i < staging.ids.size(); ++i) {
    t.placement[staging.ids[i]] = staging_plan.placement[i];
    t.placement[staging.ids[i]].buffer += staging_from;
  }
  // Views sit at their base's placement.
  for (TensorId id = 0; id < t.size(); ++id) {
    if (t.alias_of[id] == no_tensor) continue;
    const TensorId s = t.storage(id);
    t.placement[id] = t.placement[s];
    plan.pool[id] = plan.pool[s];
  }
  plan.live_bytes = live_bytes(life, transient.ids, bytes, n.size());
  add_buffer_totals(plan, persistent, transient_plan, host_plan, staging_plan, options);
  return plan;
}

}  // namespace ferry::graph
