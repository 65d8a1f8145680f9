// The data-parallel passes: the weight gradients summed over the ranks before the updates (ZeRO
// stage 2: each rank receiving the sum of its shares only), and with ZeRO stages 1 and 2 the
// updated shares of the weights gathered from their ranks after them.
//
// Gradients go into buckets of about `bucket_bytes` in the order backward finishes them (the
// first bucket holds the last layers' gradients). Per bucket: a d2h copy of each gradient into
// pinned host memory as soon as it is final, one host-lane all-reduce over the bucket, and an h2d
// copy back, so the reduction of a bucket overlaps the backward of the layers before it. The
// reductions read and write one order tensor, which chains them: every rank issues them in the
// same order. The overflow guard then checks the reduced gradients, so every rank makes the same
// decision to update or skip. ZeRO stage 1 gathers the weights the same way, in the same chain.
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <stdexcept>

#include "ferry/graph/autodiff.hpp"
#include "ferry/ops/op_table.hpp"

namespace ferry::graph {

namespace {

// The one-element host tensor that chains a step's collectives (see the file comment), and
// whether a collective node already writes it (the next one reads it).
constexpr const char* order_name = "collective.order";
std::pair<TensorId, bool> collective_order(Graph& g) {
  auto& t = g.tensors;
  for (TensorId x = 0; x < t.size(); ++x) {
    if (t.name[x] == order_name) return {x, true};
  }
  const TensorId order = t.add(order_name, Shape{1}, DType::f32, Role::gradient);
  t.home[order] = Residency::host_pinned;
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

// The copies of a collective: d2h before it, h2d after it, and each copy's attrs (the rows'
// element runs) by the tensor's index.
struct CollectiveCopies {
  ops::OpId send, receive;
  std::function<NodeAttrs(std::size_t)> attrs = [](std::size_t) { return NodeAttrs{}; };
};

// Per bucket: each tensor's d2h copy into a new pinned host tensor "<name>@<suffix>", one host node
// `op` over the bucket in the collective chain (attrs from `attrs_of(bucket's first index)`), and
// each h2d copy back; `after(tensor)` appends what follows a tensor's copy back.
template <class AttrsOf, class After>
void append_collective(Graph& g, const std::vector<TensorId>& tensors, std::uint64_t bucket_bytes, ops::OpId op,
                       const char* suffix, AttrsOf attrs_of, After after, const CollectiveCopies& copies) {
  auto& t = g.tensors;
  const ops::OpId send = copies.send;
  const ops::OpId receive = copies.receive;
  auto [order, written] = collective_order(g);
  for (const auto& [first, end] : buckets_of(t, tensors, bucket_bytes)) {
    std::vector<TensorId> ins, outs{order}, host;
    if (written) ins.push_back(order);
    for (std::size_t i = first; i < end; ++i) {
      const TensorId x = tensors[i];
      if (t.dtype[x] != DType::f32) {
        throw std::invalid_argument(
            fmt::format("data-parallel training moves f32 tensors; '{}' is {}", t.name[x], dtype_name(t.dtype[x])));
      }
      const TensorId h = t.add(t.name[x] + "@" + suffix, t.shape[x], DType::f32, Role::gradient);
      t.home[h] = Residency::host_pinned;
      g.nodes.add(send, fmt::format("send.{}@{}", t.name[x], suffix), std::span(&x, 1), std::span(&h, 1),
                  copies.attrs(i), Lane::d2h);
      host.push_back(h);
    }
    ins.insert(ins.end(), host.begin(), host.end());
    outs.insert(outs.end(), host.begin(), host.end());
    NodeAttrs attrs = attrs_of(first);
    attrs.i[0] = written ? 1 : 0;
    g.nodes.add(op, fmt::format("{}.{}", suffix, first), ins, outs, attrs, Lane::comm);
    written = true;
    for (std::size_t i = first; i < end; ++i) {
      const TensorId h = host[i - first], x = tensors[i];
      g.nodes.add(receive, fmt::format("receive.{}@{}", t.name[x], suffix), std::span(&h, 1), std::span(&x, 1),
                  copies.attrs(i), Lane::h2d);
      after(x);
    }
  }
}

// The overflow guard summed over the ranks, after every reduction of the step: a guard that is
// not finite on one rank (a gradient of its shares) is not finite on all, so every rank makes the
// same decision to update or to skip.
void append_guard_agreement(Graph& g) {
  if (g.guard == no_tensor) return;
  auto& t = g.tensors;
  auto [order, written] = collective_order(g);
  const TensorId h = t.add(std::string(overflow_guard_name) + "@agree", Shape{1}, DType::f32, Role::gradient);
  t.home[h] = Residency::host_pinned;
  g.nodes.add(ops::find_op("grad_send"), fmt::format("send.{}@agree", overflow_guard_name), std::span(&g.guard, 1),
              std::span(&h, 1), {}, Lane::d2h);
  std::vector<TensorId> ins, outs{order, h};
  if (written) ins.push_back(order);
  ins.push_back(h);
  NodeAttrs attrs;
  attrs.i[0] = written ? 1 : 0;
  attrs.f[0] = 1.0f;  // the guards themselves, unscaled
  g.nodes.add(ops::find_op("grad_allreduce"), fmt::format("{}@agree", overflow_guard_name), ins, outs, attrs,
              Lane::comm);
  g.nodes.add(ops::find_op("grad_receive"), fmt::format("receive.{}@agree", overflow_guard_name), std::span(&h, 1),
              std::span(&g.guard, 1), {}, Lane::h2d);
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
  const ops::OpId send = ops::find_op("grad_send");
  const ops::OpId reduce = ops::find_op("grad_reduce_scatter");
  const ops::OpId receive = ops::find_op("grad_receive");
  const ops::OpId check = ops::find_op("overflow_guard_check");
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
  auto [order, written] = collective_order(g);
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
    std::vector<TensorId> ins, outs{order}, whole, shard_host, shard_weights;
    if (written) ins.push_back(order);
    for (std::size_t i = first; i < end; ++i) {
      const TensorId w = weights[i], grad = t.grad[w];
      if (t.dtype[grad] != DType::f32) {
        throw std::invalid_argument(fmt::format("data-parallel training moves f32 tensors; '{}' is {}", t.name[grad],
                                                dtype_name(t.dtype[grad])));
      }
      const TensorId h = t.add(t.name[grad] + "@reduce", t.shape[grad], DType::f32, Role::gradient);
      t.home[h] = Residency::host_pinned;
      g.nodes.add(send, fmt::format("send.{}@reduce", t.name[grad]), std::span(&grad, 1), std::span(&h, 1), {},
                  Lane::d2h);
      whole.push_back(h);
      if (mine[w].count == 0) continue;  // another rank's alone
      const TensorId s =
          t.add(t.name[grad] + "@shard", Shape{static_cast<std::uint32_t>(mine[w].count)}, DType::f32, Role::gradient);
      t.home[s] = Residency::host_pinned;
      shard_host.push_back(s);
      shard_weights.push_back(w);
    }
    ins.insert(ins.end(), whole.begin(), whole.end());
    outs.insert(outs.end(), whole.begin(), whole.end());
    outs.insert(outs.end(), shard_host.begin(), shard_host.end());
    NodeAttrs attrs;
    attrs.i[0] = written ? 1 : 0;
    attrs.i[1] = static_cast<std::int32_t>(ordinal[weights[first]]);
    attrs.i[2] = static_cast<std::int32_t>(zero.granule);
    attrs.i[3] = step == 0 ? 1 : step;
    attrs.f[0] = share;
    g.nodes.add(reduce, fmt::format("reduce_scatter.{}", first), ins, outs, attrs, Lane::comm);
    written = true;
    for (std::size_t k = 0; k < shard_host.size(); ++k) {
      const TensorId w = shard_weights[k], h = shard_host[k];
      const TensorId s = t.add(t.name[t.grad[w]] + ".shard", t.shape[h], DType::f32, Role::gradient);
      g.nodes.add(receive, fmt::format("receive.{}@reduce", t.name[t.grad[w]]), std::span(&h, 1), std::span(&s, 1), {},
                  Lane::h2d);
      if (g.guard != no_tensor) {
        const TensorId check_ins[] = {g.guard, s};
        g.nodes.add(check, fmt::format("{}.{}@reduce", overflow_guard_name, t.name[s]), check_ins,
                    std::span(&g.guard, 1));
      }
      t.grad[w] = s;  // what the update reads
    }
    first = end;
  }
  append_guard_agreement(g);
}

void append_gradient_allreduce(Graph& g, float share, std::uint64_t bucket_bytes) {
  if (!(share > 0.0f && share <= 1.0f)) {
    throw std::invalid_argument(fmt::format("gradient all-reduce: a rank's share of the batch is {}", share));
  }
  const ops::OpId check = ops::find_op("overflow_guard_check");
  std::vector<TensorId> grads;
  for (TensorId w : weights_in_gradient_order(g)) grads.push_back(g.tensors.grad[w]);
  append_collective(
      g, grads, bucket_bytes, ops::find_op("grad_allreduce"), "allreduce",
      [share](std::size_t) {
        NodeAttrs a;
        a.f[0] = share;
        return a;
      },
      [&g, check](TensorId grad) {
        if (g.guard == no_tensor) return;
        const TensorId ins[] = {g.guard, grad};
        g.nodes.add(check, fmt::format("{}.{}@allreduce", overflow_guard_name, g.tensors.name[grad]), ins,
                    std::span(&g.guard, 1));
      },
      {ops::find_op("grad_send"), ops::find_op("grad_receive")});
}

void append_weight_allgather(Graph& g, const ZeroSharding& zero, std::uint64_t bucket_bytes) {
  // The trainable weights in tensor order: their place in it is the ordinal of ops::zero_shard,
  // which the gather node recomputes from the first of its bucket. Only this rank's share goes to
  // the host, and only the others' shares come back.
  const std::vector<ZeroShare> shares = zero_shares(g, zero);
  std::vector<TensorId> weights;
  for (const ZeroShare& s : shares) weights.push_back(s.weight);
  CollectiveCopies copies{ops::find_op("share_send"), ops::find_op("others_receive")};
  copies.attrs = [&shares](std::size_t i) {
    NodeAttrs a;
    a.i[0] = static_cast<std::int32_t>(shares[i].range.first);
    a.i[1] = static_cast<std::int32_t>(shares[i].range.count);
    return a;
  };
  append_collective(
      g, weights, bucket_bytes, ops::find_op("weight_allgather"), "allgather",
      [&zero](std::size_t first) {
        NodeAttrs a;
        a.i[1] = static_cast<std::int32_t>(first);
        a.i[2] = static_cast<std::int32_t>(zero.granule);
        return a;
      },
      [](TensorId) {}, copies);
}

}  // namespace ferry::graph
