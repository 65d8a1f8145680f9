// Liveness-based offset assignment (greedy, largest first, lowest free offset).
#include "ferry/graph/memory_plan.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <stdexcept>

namespace ferry::graph {
namespace {

struct Interval {
  std::uint64_t begin, end;  // byte range [begin, end)
};

struct PlacedTensor {
  std::uint32_t first, last;  // node indices of first and last use
  std::uint64_t offset, bytes;
};

// Packs tensors into buffers of at most `cap` bytes. A tensor may share bytes with another only
// if their node-index lifetimes [first, last] do not overlap.
class Packer {
 public:
  // `existing`: buffers that already exist, packed first and never grown (their sizes are caps).
  Packer(std::uint64_t cap, std::uint32_t align, const std::vector<std::uint64_t>& existing = {})
      : cap_(cap), align_(align), buffers_(existing.size()), sizes_(existing.size(), 0), caps_(existing) {}

  Placement place(std::uint64_t bytes, std::uint32_t first, std::uint32_t last) {
    const std::uint64_t size = align_up(std::max<std::uint64_t>(bytes, 1));
    for (std::uint32_t b = 0; b < buffers_.size(); ++b) {
      if (auto off = fit(b, size, first, last); off + size <= caps_[b]) {
        commit(b, {first, last, off, size});
        return {b, off};
      }
    }
    buffers_.emplace_back();
    sizes_.push_back(0);
    caps_.push_back(cap_);
    const auto b = static_cast<std::uint32_t>(buffers_.size() - 1);
    commit(b, {first, last, 0, size});
    return {b, 0};
  }

  const std::vector<std::uint64_t>& sizes() const { return sizes_; }

 private:
  std::uint64_t align_up(std::uint64_t v) const { return (v + align_ - 1) / align_ * align_; }

  // Lowest offset in buffer b where `size` bytes are free during [first, last].
  std::uint64_t fit(std::uint32_t b, std::uint64_t size, std::uint32_t first, std::uint32_t last) const {
    std::vector<Interval> busy;
    for (const auto& p : buffers_[b]) {
      if (p.first <= last && first <= p.last) busy.push_back({p.offset, p.offset + p.bytes});
    }
    std::sort(busy.begin(), busy.end(), [](const Interval& a, const Interval& c) { return a.begin < c.begin; });
    std::uint64_t candidate = 0;
    for (const auto& iv : busy) {
      if (candidate + size <= iv.begin) break;
      candidate = std::max(candidate, iv.end);
    }
    return candidate;
  }

  void commit(std::uint32_t b, PlacedTensor p) {
    sizes_[b] = std::max(sizes_[b], p.offset + p.bytes);
    buffers_[b].push_back(p);
  }

  std::uint64_t cap_;
  std::uint32_t align_;
  std::vector<std::vector<PlacedTensor>> buffers_;
  std::vector<std::uint64_t> sizes_, caps_;
};

}  // namespace

MemoryPlan plan_memory(Graph& g, const MemoryPlanOptions& options) {
  auto& t = g.tensors;
  const auto& n = g.nodes;
  constexpr auto unused = std::numeric_limits<std::uint32_t>::max();
  std::vector<std::uint32_t> first(t.size(), unused), last(t.size(), 0);
  auto touch = [&](TensorId id, NodeId node) {
    if (id == no_tensor) return;
    const TensorId s = t.storage(id);
    first[s] = std::min(first[s], node);
    last[s] = std::max(last[s], node);
  };
  for (NodeId node = 0; node < n.size(); ++node) {
    for (TensorId id : n.inputs(node)) touch(id, node);
    for (TensorId id : n.outputs(node)) touch(id, node);
    touch(n.scratch[node], node);
  }

  MemoryPlan plan;
  plan.pool.assign(t.size(), Pool::transient);
  std::vector<TensorId> order;
  for (TensorId id = 0; id < t.size(); ++id) {
    if (t.alias_of[id] != no_tensor || first[id] == unused) continue;
    if (t.bytes(id) > options.max_buffer_bytes) {
      throw std::runtime_error(
          fmt::format("tensor '{}' ({} bytes, shape {}) is larger than the device's largest buffer ({} bytes): "
                      "use a smaller batch or layer",
                      t.name[id], t.bytes(id), t.shape[id].str(), options.max_buffer_bytes));
    }
    if (is_persistent(t.role[id])) plan.pool[id] = Pool::persistent;
    order.push_back(id);
  }
  for (TensorId id : order) {
    if (plan.pool[id] == Pool::transient && t.home[id] != Residency::device) plan.pool[id] = Pool::host_transient;
  }
  // Largest first packs tightest with a greedy lowest-offset fit; ties by id keep it deterministic.
  std::stable_sort(order.begin(), order.end(), [&](TensorId a, TensorId b) { return t.bytes(a) > t.bytes(b); });

  Packer persistent(options.max_buffer_bytes, options.alignment);
  Packer transient(options.max_buffer_bytes, options.alignment, options.existing_transient_buffers);
  Packer host_transient(options.max_buffer_bytes, options.alignment);
  for (TensorId id : order) {
    if (plan.pool[id] == Pool::persistent) {
      // Persistent tensors live through every step: their lifetime is the whole node range.
      if (options.plan_persistent) t.placement[id] = persistent.place(t.bytes(id), 0, unused - 1);
    } else if (plan.pool[id] == Pool::host_transient) {
      t.placement[id] = host_transient.place(t.bytes(id), first[id], last[id]);
    } else {
      t.placement[id] = transient.place(t.bytes(id), first[id], last[id]);
      plan.transient_unshared_bytes += t.bytes(id);
    }
  }
  // Views sit at their base's placement.
  for (TensorId id = 0; id < t.size(); ++id) {
    if (t.alias_of[id] == no_tensor) continue;
    const TensorId s = t.storage(id);
    t.placement[id] = t.placement[s];
    plan.pool[id] = plan.pool[s];
  }
  plan.live_bytes.assign(n.size(), 0);
  for (TensorId id : order) {
    if (plan.pool[id] != Pool::transient) continue;
    for (std::uint32_t node = first[id]; node <= last[id]; ++node) plan.live_bytes[node] += t.bytes(id);
  }
  plan.persistent_buffers = persistent.sizes();
  plan.transient_buffers = transient.sizes();
  plan.host_transient_buffers = host_transient.sizes();
  for (auto b : plan.host_transient_buffers) plan.host_transient_bytes += b;
  for (auto b : plan.persistent_buffers) plan.persistent_bytes += b;
  for (std::size_t b = 0; b < plan.transient_buffers.size(); ++b) {
    const bool existing = b < options.existing_transient_buffers.size();
    // A reused buffer occupies its full size on the device whatever part of it this plan uses.
    if (existing)
      plan.transient_buffers[b] = std::max(plan.transient_buffers[b], options.existing_transient_buffers[b]);
    plan.transient_bytes += plan.transient_buffers[b];
    if (!existing) plan.new_transient_bytes += plan.transient_buffers[b];
  }
  return plan;
}

}  // namespace ferry::graph
