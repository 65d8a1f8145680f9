// The data-parallel pass: the weight gradients summed over the ranks before the updates.
//
// Gradients go into buckets of about `bucket_bytes` in the order backward finishes them (the
// first bucket holds the last layers' gradients). Per bucket: a d2h copy of each gradient into
// pinned host memory as soon as it is final, one host-lane all-reduce over the bucket, and an h2d
// copy back, so the reduction of a bucket overlaps the backward of the layers before it. The
// reductions read and write one order tensor, which chains them: every rank issues them in the
// same order. The overflow guard then checks the reduced gradients, so every rank makes the same
// decision to update or skip.
#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

#include "ferry/graph/autodiff.hpp"
#include "ferry/ops/op_table.hpp"

namespace ferry::graph {

namespace {

// Weight gradients in the order their last writer comes.
std::vector<TensorId> gradients_in_finishing_order(const Graph& g) {
  const auto& t = g.tensors;
  std::vector<NodeId> last_write(t.size(), 0);
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    for (TensorId x : g.nodes.outputs(n)) last_write[t.storage(x)] = n;
  }
  std::vector<std::pair<NodeId, TensorId>> grads;
  for (TensorId w = 0; w < t.size(); ++w) {
    if (t.role[w] == Role::weight && t.grad[w] != no_tensor) grads.emplace_back(last_write[t.storage(t.grad[w])], w);
  }
  std::stable_sort(grads.begin(), grads.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<TensorId> out;
  for (const auto& [writer, w] : grads) out.push_back(t.grad[w]);
  return out;
}

}  // namespace

void append_gradient_allreduce(Graph& g, float share, std::uint64_t bucket_bytes) {
  if (!(share > 0.0f && share <= 1.0f)) {
    throw std::invalid_argument(fmt::format("gradient all-reduce: a rank's share of the batch is {}", share));
  }
  auto& t = g.tensors;
  const ops::OpId send = ops::find_op("grad_send");
  const ops::OpId reduce = ops::find_op("grad_allreduce");
  const ops::OpId receive = ops::find_op("grad_receive");
  const ops::OpId check = ops::find_op("overflow_guard_check");
  const std::vector<TensorId> grads = gradients_in_finishing_order(g);
  const TensorId order = t.add("allreduce.order", Shape{1}, DType::f32, Role::gradient);
  t.home[order] = Residency::host_pinned;
  std::size_t bucket = 0;
  for (std::size_t first = 0; first < grads.size(); ++bucket) {
    std::size_t end = first;
    std::uint64_t bytes = 0;
    while (end < grads.size() && (end == first || bytes + t.bytes(grads[end]) <= bucket_bytes)) {
      bytes += t.bytes(grads[end++]);
    }
    std::vector<TensorId> ins, outs{order};
    if (bucket > 0) ins.push_back(order);
    std::vector<TensorId> host;
    for (std::size_t i = first; i < end; ++i) {
      const TensorId grad = grads[i];
      if (t.dtype[grad] != DType::f32) {
        throw std::invalid_argument(
            fmt::format("data-parallel training sums f32 gradients; '{}' is {}", t.name[grad], dtype_name(t.dtype[grad])));
      }
      const TensorId h = t.add(t.name[grad] + "@allreduce", t.shape[grad], DType::f32, Role::gradient);
      t.home[h] = Residency::host_pinned;
      g.nodes.add(send, "grad_send." + t.name[grad], std::span(&grad, 1), std::span(&h, 1), {}, Lane::d2h);
      host.push_back(h);
    }
    ins.insert(ins.end(), host.begin(), host.end());
    outs.insert(outs.end(), host.begin(), host.end());
    NodeAttrs attrs;
    attrs.i[0] = bucket > 0 ? 1 : 0;
    attrs.f[0] = share;
    g.nodes.add(reduce, fmt::format("grad_allreduce.{}", bucket), ins, outs, attrs, Lane::host);
    for (std::size_t i = first; i < end; ++i) {
      const TensorId h = host[i - first], grad = grads[i];
      g.nodes.add(receive, "grad_receive." + t.name[grad], std::span(&h, 1), std::span(&grad, 1), {}, Lane::h2d);
      if (g.guard != no_tensor) {
        const TensorId guard_ins[] = {g.guard, grad};
        g.nodes.add(check, fmt::format("{}.{}@allreduce", overflow_guard_name, t.name[grad]), guard_ins,
                    std::span(&g.guard, 1));
      }
    }
    first = end;
  }
}

}  // namespace ferry::graph
