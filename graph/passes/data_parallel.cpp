// The data-parallel passes: the weight gradients summed over the ranks before the updates, and
// with ZeRO stage 1 the updated shares of the weights gathered from their ranks after them.
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

// Per bucket: each tensor's d2h copy into a new pinned host tensor "<name>@<suffix>", one host node
// `op` over the bucket in the collective chain (attrs from `attrs_of(bucket's first index)`), and
// each h2d copy back; `after(tensor)` appends what follows a tensor's copy back.
template <class AttrsOf, class After>
void append_collective(Graph& g, const std::vector<TensorId>& tensors, std::uint64_t bucket_bytes, ops::OpId op,
                       const char* suffix, AttrsOf attrs_of, After after) {
  auto& t = g.tensors;
  const ops::OpId send = ops::find_op("grad_send");
  const ops::OpId receive = ops::find_op("grad_receive");
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
      g.nodes.add(send, fmt::format("send.{}@{}", t.name[x], suffix), std::span(&x, 1), std::span(&h, 1), {},
                  Lane::d2h);
      host.push_back(h);
    }
    ins.insert(ins.end(), host.begin(), host.end());
    outs.insert(outs.end(), host.begin(), host.end());
    NodeAttrs attrs = attrs_of(first);
    attrs.i[0] = written ? 1 : 0;
    g.nodes.add(op, fmt::format("{}.{}", suffix, first), ins, outs, attrs, Lane::host);
    written = true;
    for (std::size_t i = first; i < end; ++i) {
      const TensorId h = host[i - first], x = tensors[i];
      g.nodes.add(receive, fmt::format("receive.{}@{}", t.name[x], suffix), std::span(&h, 1), std::span(&x, 1), {},
                  Lane::h2d);
      after(x);
    }
  }
}

}  // namespace

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
      });
}

void append_weight_allgather(Graph& g, const ZeroSharding& zero, std::uint64_t bucket_bytes) {
  // The trainable weights in tensor order: their place in it is the ordinal of ops::zero_shard,
  // which the gather node recomputes from the first of its bucket.
  const auto& t = g.tensors;
  std::vector<TensorId> weights;
  for (TensorId w = 0; w < t.size(); ++w) {
    if (t.role[w] == Role::weight && t.grad[w] != no_tensor) weights.push_back(w);
  }
  append_collective(
      g, weights, bucket_bytes, ops::find_op("weight_allgather"), "allgather",
      [&zero](std::size_t first) {
        NodeAttrs a;
        a.i[1] = static_cast<std::int32_t>(first);
        a.i[2] = static_cast<std::int32_t>(zero.granule);
        return a;
      },
      [](TensorId) {});
}

}  // namespace ferry::graph
