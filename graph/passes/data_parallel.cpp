// The data-parallel passes: the weight gradients summed over the ranks before the updates (ZeRO
// stage 2: each rank receiving the sum of its shares only), and with ZeRO stages 1 and 2 the
// updated shares of the weights gathered from their ranks after them.
//
// Gradients go into buckets of about `bucket_bytes` in the order backward finishes them (the
// first bucket holds the last layers' gradients). Per bucket: a d2h copy of each gradient into
// pinned host memory as soon as it is final, one all-reduce over the bucket on the comm lane, and an h2d
// copy back, so the reduction of a bucket overlaps the backward of the layers before it. The
// reductions read and write one order tensor, which chains them: every rank issues them in the
// same order. The overflow guard then checks the reduced gradients, so every rank makes the same
// decision to update or skip. ZeRO stage 1 gathers the weights the same way, in the same chain.
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <stdexcept>

#include "ferry/ops/op_table.hpp"
#include "graph/autodiff.hpp"
#include "ops/attrs.hpp"

namespace ferry::graph {

namespace {

// The one-element host tensor that chains a step's collectives (see the file comment), and
// whether a collective node already writes it (the next one reads it).
std::pair<TensorId, bool> collective_order(Graph& g) {
  auto& t = g.tensors;
  for (TensorId x = 0; x < t.size(); ++x) {
    if (t.name[x] == collective_order_name) return {x, true};
  }
  const TensorId order = t.add(std::string(collective_order_name), Shape{1}, DType::f32, Role::gradient);
  t.home[order] = Home::host_pinned;
  return {order, false};
}

// Consecutive runs of `tensors` of about `bucket_bytes` (at least one tensor each).
std::vector<std::pair<std::size_t, std::size_t>> buckets_of(const TensorTable& t, const std::vector<TensorId>& tensors,
                                                            std::uint64_t bucket_bytes) {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  for (std::size_t first = 0; first < tensors.size();) {
    std::size_t end = first;
    std::uint64_t bytes = 0;
    while (end < tensors.size() && (end == first || bytes + t.bytes(tensors[end]) <= bucket_bytes)) {
      bytes += t.bytes(tensors[end++]);
    }
    out.emplace_back(first, end);
    first = end;
  }
  return out;
}

// A collective over buckets of tensors: per bucket, each tensor's d2h copy (`send`, attrs
// `send_attrs(i)` by the tensor's index) into a new pinned host tensor "<name>@<suffix>", then one
// node "<suffix>.<first index>", `op`, on the comm lane in the collective chain, whose inputs are the host copies and
// whose outputs are the host copies and then `extra_output(i)` of each tensor that has one (ZeRO stage 2's shards);
// then `after(i, host copy, extra)` per tensor (the copies back to the device).
struct Collective {
  ops::OpId op;
  const char* suffix;
  ops::OpId send;
  std::function<ops::CollectiveAttrs(std::size_t bucket)> node_attrs;  // by the bucket's index
  std::function<void(std::size_t i, TensorId host, TensorId extra)> after;
  std::function<NodeAttrs(std::size_t i)> send_attrs = [](std::size_t) { return NodeAttrs{}; };
  std::function<TensorId(std::size_t i)> extra_output = [](std::size_t) { return no_tensor; };
};

void append_collective(Graph& g, const std::vector<TensorId>& tensors,
                       const std::vector<std::pair<std::size_t, std::size_t>>& buckets, const Collective& c) {
  auto& t = g.tensors;
  auto [order, written] = collective_order(g);
  for (std::size_t k = 0; k < buckets.size(); ++k) {
    const auto [first, end] = buckets[k];
    std::vector<TensorId> host, extra;
    for (std::size_t i = first; i < end; ++i) {
      const TensorId x = tensors[i];
      if (t.dtype[x] != DType::f32) {
        throw std::invalid_argument(
            fmt::format("data-parallel training moves f32 tensors; '{}' is {}", t.name[x], dtype_name(t.dtype[x])));
      }
      const TensorId h = t.add(t.name[x] + "@" + c.suffix, t.shape[x], DType::f32, Role::gradient);
      t.home[h] = Home::host_pinned;
      g.nodes.add(c.send, fmt::format("send.{}@{}", t.name[x], c.suffix), std::span(&x, 1), std::span(&h, 1),
                  c.send_attrs(i), Lane::d2h);
      host.push_back(h);
      extra.push_back(c.extra_output(i));
    }
    std::vector<TensorId> ins, outs{order};
    if (written) ins.push_back(order);
    ins.insert(ins.end(), host.begin(), host.end());
    outs.insert(outs.end(), host.begin(), host.end());
    for (TensorId e : extra) {
      if (e != no_tensor) outs.push_back(e);
    }
    ops::CollectiveAttrs attrs = c.node_attrs(k);
    attrs.first_tensor = written ? 1 : 0;
    g.nodes.add(c.op, fmt::format("{}.{}", c.suffix, first), ins, outs, attrs.pack(), Lane::comm);
    written = true;
    for (std::size_t i = first; i < end; ++i) c.after(i, host[i - first], extra[i - first]);
  }
}

// A copy back to the device of `host` into `x`, after a collective.
void receive(Graph& g, ops::OpId op, const char* suffix, TensorId host, TensorId x, NodeAttrs attrs = {}) {
  g.nodes.add(op, fmt::format("receive.{}@{}", g.tensors.name[x], suffix), std::span(&host, 1), std::span(&x, 1), attrs,
              Lane::h2d);
}

void check_received(Graph& g, TensorId x, const char* suffix);

// Weight w's reduced gradient back on the device from `host`, into a tensor "<gradient><ending>"
// shaped like `host` that becomes the weight's gradient (the local one dies once it is sent), and
// the overflow guard's check of it.
void receive_gradient(Graph& g, TensorId w, TensorId host, const char* ending, const char* suffix) {
  auto& t = g.tensors;
  const TensorId local = t.grad[w];
  const TensorId back = t.add(t.name[local] + ending, t.shape[host], DType::f32, Role::gradient);
  g.nodes.add(ops::builtin::grad_receive, fmt::format("receive.{}@{}", t.name[local], suffix), std::span(&host, 1),
              std::span(&back, 1), {}, Lane::h2d);
  check_received(g, back, suffix);
  t.grad[w] = back;
}

// The overflow guard's check of a tensor the collective brought back.
void check_received(Graph& g, TensorId x, const char* suffix) {
  if (g.guard == no_tensor) return;
  const TensorId ins[] = {g.guard, x};
  g.nodes.add(ops::builtin::overflow_guard_check,
              fmt::format("{}.{}@{}", overflow_guard_name, g.tensors.name[x], suffix), ins, std::span(&g.guard, 1));
}

// The reductions appended after the whole backward (nodes from `appended_from` on) started where
// backward makes their gradients final: each gradient's copy to the host right after the node that
// makes it final, its bucket's collective after the bucket's last copy out (in the block's order,
// so every rank issues the collectives alike). The copies back and the guard's checks of the sums
// stay after the whole backward: a compute or copy node that waited there for a collective would
// hold back every node after it on its in-order queue (the next layers' backward, the next
// fetches). The memory plan follows the node order, so a local gradient is freed once sent (ZeRO
// stage 2 keeps only its share) and a streamed step does not spill it to host memory only to fetch
// it again for its copy; the host buffers of the sums are held from their sends to the end of
// backward (the step's pinned host pool counts them). The overflow guard's checks of the local
// gradients go: the sums are checked, and a sum is not finite when one of its terms is not.
void place_reductions_after_their_gradients(Graph& g, NodeId appended_from) {
  const auto& t = g.tensors;
  constexpr NodeId none = ~NodeId{0};
  const NodeTable old = std::move(g.nodes);
  g.nodes = {};
  std::vector<char> reduced(t.size(), 0);
  for (NodeId n = appended_from; n < old.size(); ++n) {
    if (old.op[n] == ops::builtin::grad_send) reduced[t.storage(old.inputs(n)[0])] = 1;
  }
  const auto local_check = [&](NodeId n) {
    return n < appended_from && old.op[n] == ops::builtin::overflow_guard_check && reduced[t.storage(old.inputs(n)[1])];
  };
  std::vector<NodeId> last_writer(t.size(), none);
  for (NodeId n = 0; n < appended_from; ++n) {
    if (local_check(n)) continue;
    for (TensorId x : old.outputs(n)) last_writer[t.storage(x)] = n;
  }
  // Each send and collective goes after prefix node `anchor`, never before one it followed (a
  // gradient no prefix node writes, which backward always does, would keep its place at the end).
  if (appended_from == 0) throw std::logic_error("data-parallel reductions with no backward before them");
  std::vector<std::vector<NodeId>> after(appended_from);
  NodeId anchor = 0;
  std::vector<NodeId> last;  // after the whole backward
  for (NodeId n = appended_from; n < old.size(); ++n) {
    const bool send = old.op[n] == ops::builtin::grad_send;
    if (send) {
      const NodeId w = last_writer[t.storage(old.inputs(n)[0])];
      anchor = std::max(anchor, w == none ? appended_from - 1 : w);
    }
    (send || old.lane[n] == Lane::comm ? after[anchor] : last).push_back(n);
  }
  for (NodeId n = 0; n < appended_from; ++n) {
    if (local_check(n)) continue;
    g.nodes.add_copy(old, n);
    for (NodeId m : after[n]) g.nodes.add_copy(old, m);
  }
  for (NodeId n : last) g.nodes.add_copy(old, n);
}

// Under mixed precision a narrow layer's weight gradient is widened to f32 on the device only for
// its send (the reductions check the sums, not the local gradients): the send copies the narrow
// gradient instead, and a cast on the host lane (the same row and factor: the same bits) widens
// it into the f32 host buffer the collective reads. Half the bytes of the copy, one device pass
// fewer, and the f32 gradient never exists on the device.
void send_narrow_gradients(Graph& g) {
  auto& t = g.tensors;
  constexpr NodeId none = ~NodeId{0};
  const NodeTable old = std::move(g.nodes);
  g.nodes = {};
  std::vector<NodeId> writer(t.size(), none);
  std::vector<std::uint32_t> readers(t.size(), 0);
  std::vector<NodeId> widened_by(old.size(), none);  // per send: the cast whose output it sends
  std::vector<char> dropped(old.size(), 0);
  for (NodeId n = 0; n < old.size(); ++n) {
    for (TensorId x : old.inputs(n)) ++readers[t.storage(x)];
  }
  for (NodeId n = 0; n < old.size(); ++n) {
    if (old.op[n] == ops::builtin::grad_send) {
      const TensorId x = old.inputs(n)[0];
      const NodeId w = writer[t.storage(x)];
      if (w != none && readers[t.storage(x)] == 1 && widened_narrow_tensor(t, old, w, x) != no_tensor) {
        widened_by[n] = w;
        dropped[w] = 1;
      }
    }
    for (TensorId x : old.outputs(n)) writer[t.storage(x)] = n;
  }
  for (NodeId n = 0; n < old.size(); ++n) {
    if (dropped[n]) continue;
    if (widened_by[n] == none) {
      g.nodes.add_copy(old, n);
      continue;
    }
    const NodeId cast = widened_by[n];
    const TensorId narrow = old.inputs(cast)[0], host = old.outputs(n)[0];
    const TensorId narrow_host = t.add(t.name[host] + "." + std::string(dtype_name(t.dtype[narrow])), t.shape[narrow],
                                       t.dtype[narrow], Role::gradient);
    t.home[narrow_host] = Home::host_pinned;
    g.nodes.add(old.op[n], old.name[n], std::span(&narrow, 1), std::span(&narrow_host, 1), old.attrs[n], old.lane[n]);
    g.nodes.add(ops::builtin::cast, old.name[cast] + "@host", std::span(&narrow_host, 1), std::span(&host, 1),
                old.attrs[cast], Lane::host);
  }
}

// The overflow guard summed over the ranks, after every reduction of the step: a guard that is
// not finite on one rank (a gradient of its shares) is not finite on all, so every rank makes the
// same decision to update or to skip.
void append_guard_agreement(Graph& g) {
  if (g.guard == no_tensor) return;
  append_collective(
      g, {g.guard}, {{0, 1}},
      {ops::builtin::grad_allreduce, "agree", ops::builtin::grad_send,
       [](std::size_t) {
         return ops::CollectiveAttrs{.share = 1.0f};  // the guards themselves, unscaled
       },
       [&g](std::size_t, TensorId host, TensorId) { receive(g, ops::builtin::grad_receive, "agree", host, g.guard); }});
}

}  // namespace

std::vector<ZeroShare> zero_shares(const Graph& g, const ZeroSharding& zero) {
  const auto& t = g.tensors;
  std::vector<ZeroShare> out;
  for (TensorId w = 0; w < t.size(); ++w) {
    if (t.role[w] != Role::weight || t.grad[w] == no_tensor) continue;
    out.push_back({w, ops::zero_shard(t.shape[w].elems(), out.size(), zero.rank, zero.ranks, zero.granule)});
  }
  return out;
}

void append_gradient_reduce_scatter(Graph& g, float share, std::uint64_t bucket_bytes, const ZeroSharding& zero) {
  if (!(share > 0.0f && share <= 1.0f)) {
    throw std::invalid_argument(fmt::format("gradient reduce-scatter: a rank's share of the batch is {}", share));
  }
  auto& t = g.tensors;
  // Each weight's ordinal (its place among the trainable weights) and this rank's share of it.
  std::vector<std::size_t> ordinal(t.size());
  std::vector<ops::ShardRange> mine(t.size());
  const std::vector<ZeroShare> shares = zero_shares(g, zero);
  for (std::size_t k = 0; k < shares.size(); ++k) {
    ordinal[shares[k].weight] = k;
    mine[shares[k].weight] = shares[k].range;
  }
  // Buckets in the order backward finishes the gradients, of about bucket_bytes, whose weights'
  // ordinals run in steps of +1 or -1 (backward finishes layers in reverse), so that a node's
  // attrs give every ordinal of its bucket (the reduction needs each tensor's shares on all ranks).
  const std::vector<TensorId> weights = weights_in_gradient_order(g);
  std::vector<std::pair<std::size_t, std::size_t>> buckets;
  std::vector<int> steps;  // per bucket: +1 or -1
  for (std::size_t first = 0; first < weights.size();) {
    std::size_t end = first + 1;
    std::uint64_t bytes = t.bytes(t.grad[weights[first]]);
    int step = 0;
    while (end < weights.size()) {
      const auto d = static_cast<long long>(ordinal[weights[end]]) - static_cast<long long>(ordinal[weights[end - 1]]);
      if ((d != 1 && d != -1) || (step != 0 && d != step)) break;
      if (bytes + t.bytes(t.grad[weights[end]]) > bucket_bytes) break;
      step = static_cast<int>(d);
      bytes += t.bytes(t.grad[weights[end++]]);
    }
    buckets.emplace_back(first, end);
    steps.push_back(step == 0 ? 1 : step);
    first = end;
  }
  std::vector<TensorId> grads;
  for (TensorId w : weights) grads.push_back(t.grad[w]);
  const NodeId appended_from = static_cast<NodeId>(g.nodes.size());
  Collective c{ops::builtin::grad_reduce_scatter, "reduce", ops::builtin::grad_send,
               [&](std::size_t k) {
                 return ops::CollectiveAttrs{.share = share,
                                             .ordinal = static_cast<std::int32_t>(ordinal[weights[buckets[k].first]]),
                                             .granule = static_cast<std::int32_t>(zero.granule),
                                             .ordinal_step = steps[k]};
               },
               // This rank's share of the sum comes back into a device tensor "<g>.shard" the update reads.
               [&](std::size_t i, TensorId, TensorId host_shard) {
                 if (host_shard != no_tensor) receive_gradient(g, weights[i], host_shard, ".shard", "reduce");
               }};
  c.extra_output = [&](std::size_t i) {
    const TensorId w = weights[i];
    if (mine[w].count == 0) return no_tensor;
    const TensorId s = t.add(t.name[t.grad[w]] + "@shard", Shape{static_cast<std::uint32_t>(mine[w].count)}, DType::f32,
                             Role::gradient);
    t.home[s] = Home::host_pinned;
    return s;
  };
  append_collective(g, grads, buckets, c);
  place_reductions_after_their_gradients(g, appended_from);
  send_narrow_gradients(g);
  append_guard_agreement(g);
}

void append_gradient_allreduce(Graph& g, float share, std::uint64_t bucket_bytes) {
  if (!(share > 0.0f && share <= 1.0f)) {
    throw std::invalid_argument(fmt::format("gradient all-reduce: a rank's share of the batch is {}", share));
  }
  auto& t = g.tensors;
  const std::vector<TensorId> weights = weights_in_gradient_order(g);
  std::vector<TensorId> grads;
  for (TensorId w : weights) grads.push_back(t.grad[w]);
  const NodeId appended_from = static_cast<NodeId>(g.nodes.size());
  // The sum comes back into a tensor "<g>.sum" of its own, the weight's gradient from then on, so
  // the local gradient dies once it is sent.
  append_collective(
      g, grads, buckets_of(t, grads, bucket_bytes),
      {ops::builtin::grad_allreduce, "allreduce", ops::builtin::grad_send,
       [share](std::size_t) { return ops::CollectiveAttrs{.share = share}; },
       [&](std::size_t i, TensorId host, TensorId) { receive_gradient(g, weights[i], host, ".sum", "allreduce"); }});
  place_reductions_after_their_gradients(g, appended_from);
  send_narrow_gradients(g);
}

void append_micro_batch_guard_agreement(Graph& g) {
  if (g.guard == no_tensor) return;
  const NodeTable old = std::move(g.nodes);
  g.nodes = {};
  NodeId n = 0;
  for (; n < old.size() && old.op[n] != ops::builtin::grad_accumulate; ++n) g.nodes.add_copy(old, n);
  if (n == old.size()) throw std::logic_error("a micro-batch's guard agreement needs the accumulation pass first");
  append_guard_agreement(g);
  for (; n < old.size(); ++n) g.nodes.add_copy(old, n);
}

void append_weight_allgather(Graph& g, const ZeroSharding& zero, std::uint64_t bucket_bytes) {
  // The trainable weights in tensor order: their place in it is the ordinal of ops::zero_shard,
  // which the gather node recomputes from the first of its bucket. Only this rank's share goes to
  // the host, and only the others' shares come back.
  const std::vector<ZeroShare> shares = zero_shares(g, zero);
  std::vector<TensorId> weights;
  for (const ZeroShare& s : shares) weights.push_back(s.weight);
  const auto share_attrs = [&shares](std::size_t i) {
    return ops::ShareAttrs{static_cast<std::int32_t>(shares[i].range.first),
                           static_cast<std::int32_t>(shares[i].range.count)}
        .pack();
  };
  const ops::OpId back = ops::builtin::others_receive;
  const auto buckets = buckets_of(g.tensors, weights, bucket_bytes);
  Collective c{
      ops::builtin::weight_allgather, "allgather", ops::builtin::share_send,
      [&](std::size_t k) {
        return ops::CollectiveAttrs{.ordinal = static_cast<std::int32_t>(buckets[k].first),
                                    .granule = static_cast<std::int32_t>(zero.granule)};
      },
      [&](std::size_t i, TensorId host, TensorId) { receive(g, back, "allgather", host, weights[i], share_attrs(i)); }};
  c.send_attrs = share_attrs;
  append_collective(g, weights, buckets, c);
}

}  // namespace ferry::graph
