// Staged transfers. A tensor living compressed (or dropped) has no host copy a fetch can read or a
// write-back can fill, so its transfers go through pinned staging, unpacked and packed on host
// lanes (TBB workers):
//
//   unpack (lane unpack) -> staging -> fetch (h2d) -> device copy ... write_back (d2h) -> staging -> pack (lane host)
//
// On a device whose memory is the host's, the device copy itself lives in pinned host memory
// that kernels address, so unpack fills it and pack reads it: no copies at all. A dropped
// tensor's last value is discarded: its write-back and pack are left out.
//
// Pageable host memory stages the fetches of what the step itself wrote to host memory (a tensor
// written back and fetched again, a spilled gradient): NVIDIA's driver read pageable memory when
// such a copy was enqueued rather than when the write it waited for had finished. Staged host
// memory (offload::HostMemory::staged) routes every other fetch and write-back the same way: the
// pinned-home tensors and the step's host tensors stay in pageable memory, and unpack and pack are
// parallel copies into and out of staging, where the link runs at its pinned rate. So that a copy on the host overlaps
// the link's copy of the tensor before it, two staging tensors are live at once: the next fetch's unpack goes before
// this fetch (when only device work and fetches lie between them), and a write-back's pack after the next write-back.
// The memory plan keeps staging in pinned buffers of its own (graph/memory_plan.cpp), so it stays as small as the two
// largest transfers in flight. Small transfers (ResidencyOptions::staging_min_bytes) copy straight from pageable
// memory.
//
// Chunked fetches (ResidencyOptions::staging_chunk_bytes > 0, staged host memory): a fetch that would go through an
// unpack node, but reads nothing this step wrote, stays one fetch node marked with the chunk size
// (ops::FetchAttrs::chunk_kib); when it is enqueued it copies its source through the step's ring of pinned chunks
// itself (offload::FetchRing: the host copy of one chunk beside the link's copy of the one before), so no host-lane
// node and no hand-off between host and device stands between the tensor and the link. The memory plan keeps the
// ring in a pinned buffer of its own (graph/memory_plan.cpp).
#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "graph/residency_passes.hpp"
#include "ops/attrs.hpp"

namespace ferry::graph {
namespace {

enum class Staging : std::uint8_t { none, home, host_copy, chunked };

class Stager {
 public:
  Stager(Graph& g, bool host_unified, HostCopies policy, std::uint64_t host_copy_min_bytes, std::uint64_t chunk_bytes)
      : g_(g),
        t_(g.tensors),
        old_(g.nodes),
        host_unified_(host_unified),
        policy_(policy),
        host_copy_min_bytes_(host_copy_min_bytes),
        chunk_bytes_(chunk_bytes) {}

  // The host side of node n's transfer, if it is one that goes through staging.
  Staging staging_of(NodeId n) const {
    const OpId op = old_.op[n];
    if (op != builtin::fetch && op != builtin::write_back) return Staging::none;
    const TensorId host = t_.storage(op == builtin::fetch ? old_.inputs(n)[0] : old_.outputs(n)[0]);
    const offload::HomeTraits traits = offload::home_traits(t_.home[host]);
    if (traits.staged) return Staging::home;
    // Pageable host memory: a pinned-home tensor, or a step tensor in host memory (a gradient the
    // host optimizer reads, one spilled to be fetched back), but not staging itself.
    if (policy_ == HostCopies::none || t_.role[host] == Role::staged || t_.home[host] == Home::device) {
      return Staging::none;
    }
    if (is_persistent(t_.role[host]) && t_.home[host] != Home::host_pinned) return Staging::none;
    // A fetch of what this step wrote (a tensor written back and fetched again, a spilled
    // gradient) always: NVIDIA's driver read pageable memory when such a copy was enqueued, not
    // when the write it waits for had finished (test_residency failed there with direct copies).
    const bool written_this_step =
        op == builtin::fetch && (!is_persistent(t_.role[host]) || ops::FetchAttrs::of(old_.attrs[n]).after_write_back);
    if (written_this_step) return Staging::host_copy;
    if (policy_ != HostCopies::staged || t_.bytes(host) < host_copy_min_bytes_) return Staging::none;
    return op == builtin::fetch && chunk_bytes_ > 0 ? Staging::chunked : Staging::host_copy;
  }

  void run() {
    for (NodeId n = 0; n < old_.size(); ++n) {
      const Staging kind = staging_of(n);
      const OpId op = old_.op[n];
      if (!(op == builtin::write_back && kind != Staging::none) && old_.lane[n] != Lane::compute) flush_pack();
      if (kind == Staging::none) {
        out_.add_copy(old_, n);
        continue;
      }
      if (kind == Staging::chunked) {
        ops::FetchAttrs a = ops::FetchAttrs::of(old_.attrs[n]);
        // No larger than the tensor: the ring's slots are the step's largest chunk, and a chunk
        // beyond every fetch (a 256 MiB chunk for 4 MiB layers) only held pinned memory.
        const std::uint64_t chunk = std::min<std::uint64_t>(chunk_bytes_, t_.bytes(t_.storage(old_.inputs(n)[0])));
        a.chunk_kib = static_cast<std::int32_t>((chunk + 1023) / 1024);
        out_.add(builtin::fetch, old_.name[n], old_.inputs(n), old_.outputs(n), a.pack(), Lane::h2d);
        continue;
      }
      if (op == builtin::fetch) {
        fetch(n, kind);
      } else {
        write_back(n, kind);
      }
    }
    flush_pack();
    g_.nodes = std::move(out_);
  }

 private:
  // A step tensor in pinned host memory (the memory plan's staging) shaped like `like`.
  TensorId staging(TensorId like) {
    const TensorId s =
        t_.add(fmt::format("{}@staging{}", t_.name[like], count_++), t_.shape[like], t_.dtype[like], Role::staged);
    t_.home[s] = Home::host_pinned;
    return s;
  }

  TensorId unpack(NodeId n) {
    const TensorId host = old_.inputs(n)[0];
    const TensorId s = staging(host);
    out_.add(builtin::unpack, "unpack." + t_.name[host], std::span(&host, 1), std::span(&s, 1), {}, Lane::unpack);
    return s;
  }

  void fetch(NodeId n, Staging kind) {
    const TensorId host = old_.inputs(n)[0], copy = old_.outputs(n)[0];
    if (kind == Staging::home && host_unified_) {
      t_.home[copy] = Home::host_pinned;  // kernels read the unpacked bytes where they are
      out_.add(builtin::unpack, "unpack." + t_.name[host], std::span(&host, 1), std::span(&copy, 1), {}, Lane::unpack);
      return;
    }
    TensorId s = no_tensor;
    if (hoisted_ && hoisted_->first == n) {
      s = hoisted_->second;
    } else {
      s = unpack(n);
    }
    hoisted_.reset();
    if (kind == Staging::host_copy) hoist_next_unpack(n);
    out_.add(builtin::fetch, old_.name[n], std::span(&s, 1), std::span(&copy, 1), {}, Lane::h2d);
  }

  // The next host-copy fetch's unpack, before fetch n, when nothing between them but device work
  // and other fetches (no node that could write what it reads).
  void hoist_next_unpack(NodeId n) {
    for (NodeId m = n + 1; m < old_.size(); ++m) {
      if (old_.lane[m] != Lane::compute && old_.op[m] != builtin::fetch) return;
      if (old_.op[m] != builtin::fetch) continue;
      if (staging_of(m) != Staging::host_copy || ops::FetchAttrs::of(old_.attrs[m]).after_write_back) return;
      hoisted_.emplace(m, unpack(m));
      return;
    }
  }

  void write_back(NodeId n, Staging kind) {
    const TensorId copy = old_.inputs(n)[0], host = old_.outputs(n)[0];
    if (kind == Staging::home && !offload::home_traits(t_.home[t_.storage(host)]).keeps_value) return;  // dropped
    if (kind == Staging::home && host_unified_) {
      out_.add(builtin::pack, "pack." + t_.name[host], std::span(&copy, 1), std::span(&host, 1), {}, Lane::host);
      return;
    }
    const TensorId s = staging(host);
    out_.add(builtin::write_back, old_.name[n], std::span(&copy, 1), std::span(&s, 1), {}, Lane::d2h);
    flush_pack();  // the previous one, which this write-back's copy overlaps
    pending_pack_.emplace(s, host);
    if (kind == Staging::home) flush_pack();  // compressing: no second staging tensor to hold
  }

  void flush_pack() {
    if (!pending_pack_) return;
    const auto [s, host] = *pending_pack_;
    out_.add(builtin::pack, "pack." + t_.name[host], std::span(&s, 1), std::span(&host, 1), {}, Lane::host);
    pending_pack_.reset();
  }

  Graph& g_;
  TensorTable& t_;
  const NodeTable old_;
  NodeTable out_;
  bool host_unified_;
  HostCopies policy_;
  std::uint64_t host_copy_min_bytes_;
  std::uint64_t chunk_bytes_;
  std::uint32_t count_ = 0;
  std::optional<std::pair<NodeId, TensorId>> hoisted_;         // (fetch node, its staging) unpacked early
  std::optional<std::pair<TensorId, TensorId>> pending_pack_;  // (staging, host tensor)
};

}  // namespace

HostCopies host_copies_for(offload::HostMemory resolved) {
  switch (resolved) {
    case offload::HostMemory::pageable:
      return HostCopies::written;
    case offload::HostMemory::staged:
      return HostCopies::staged;
    default:
      return HostCopies::none;
  }
}

void stage_home_transfers(Graph& g, bool host_unified, HostCopies host_copies, std::uint64_t host_copy_min_bytes,
                          std::uint64_t chunk_bytes) {
  Stager stager(g, host_unified, host_copies, host_copy_min_bytes, chunk_bytes);
  bool any = false;
  for (NodeId n = 0; n < g.nodes.size() && !any; ++n) any = stager.staging_of(n) != Staging::none;
  if (any) stager.run();
}

}  // namespace ferry::graph
