// Staged homes: a tensor living compressed (or dropped) has no host copy a fetch can read or a
// write-back can fill, so its transfers go through pinned staging, unpacked and packed on host
// lanes (TBB workers):
//
//   unpack (lane unpack) -> staging -> fetch (h2d) -> device copy ... write_back (d2h) -> staging -> pack (lane host)
//
// On a device whose memory is the host's, the device copy itself lives in pinned host memory
// that kernels address, so unpack fills it and pack reads it: no copies at all. A dropped
// tensor's last value is discarded: its write-back and pack are left out.
#include <fmt/format.h>

#include "graph/residency_passes.hpp"

namespace ferry::graph {

void stage_home_transfers(Graph& g, bool host_unified) {
  auto& t = g.tensors;
  auto staged = [&](TensorId host) { return offload::home_traits(t.home[t.storage(host)]).staged; };
  bool any = false;
  for (NodeId n = 0; n < g.nodes.size() && !any; ++n) {
    const OpId op = g.nodes.op[n];
    if (op == builtin::fetch) any = staged(g.nodes.inputs(n)[0]);
    if (op == builtin::write_back) any = staged(g.nodes.outputs(n)[0]);
  }
  if (!any) return;
  const NodeTable old = g.nodes;
  NodeTable out;
  std::uint32_t count = 0;
  // A step tensor in pinned host memory (the memory plan's host pool) shaped like `like`.
  auto staging = [&](TensorId like) {
    const TensorId s =
        t.add(fmt::format("{}@staging{}", t.name[like], count++), t.shape[like], t.dtype[like], Role::staged);
    t.home[s] = Home::host_pinned;
    return s;
  };
  for (NodeId n = 0; n < old.size(); ++n) {
    const OpId op = old.op[n];
    if (op == builtin::fetch && staged(old.inputs(n)[0])) {
      const TensorId host = old.inputs(n)[0], copy = old.outputs(n)[0];
      if (host_unified) {
        t.home[copy] = Home::host_pinned;  // kernels read the unpacked bytes where they are
        out.add(builtin::unpack, "unpack." + t.name[host], std::span(&host, 1), std::span(&copy, 1), {}, Lane::unpack);
      } else {
        const TensorId s = staging(host);
        out.add(builtin::unpack, "unpack." + t.name[host], std::span(&host, 1), std::span(&s, 1), {}, Lane::unpack);
        out.add(builtin::fetch, old.name[n], std::span(&s, 1), std::span(&copy, 1), {}, Lane::h2d);
      }
      continue;
    }
    if (op == builtin::write_back && staged(old.outputs(n)[0])) {
      const TensorId copy = old.inputs(n)[0], host = old.outputs(n)[0];
      if (!offload::home_traits(t.home[t.storage(host)]).keeps_value) continue;  // dropped
      if (host_unified) {
        out.add(builtin::pack, "pack." + t.name[host], std::span(&copy, 1), std::span(&host, 1), {}, Lane::host);
      } else {
        const TensorId s = staging(host);
        out.add(builtin::write_back, old.name[n], std::span(&copy, 1), std::span(&s, 1), {}, Lane::d2h);
        out.add(builtin::pack, "pack." + t.name[host], std::span(&s, 1), std::span(&host, 1), {}, Lane::host);
      }
      continue;
    }
    out.add_copy(old, n);
  }
  g.nodes = std::move(out);
}

}  // namespace ferry::graph
