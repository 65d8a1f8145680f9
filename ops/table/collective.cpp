// Rows of data-parallel gradient reduction (graph::append_gradient_allreduce), class
// `communication`:
//
//   grad_send       in: g (device)        out: g' (pinned host)   d2h copy
//   grad_allreduce  in: [order] g'...     out: order g'...        comm: g' = sum over ranks of f0 g'
//   grad_receive    in: g' (pinned host)  out: g (device)         h2d copy
//
// f0 is this rank's share of the global batch (its samples / all samples), so the sum is the
// gradient of the global batch's mean loss. `order` is a one-element host tensor each reduction
// writes and the next one reads: it chains the reductions of a step so that every rank issues
// them in the same order (collectives are matched by order). CollectiveAttrs::first_tensor is 1
// when the node reads it (every reduction but the first), so the gradients are inputs
// first_tensor.. and outputs 1...
//
//   weight_allgather  in: [order] w'...  out: order w'...   comm: every rank's ZeRO share of w'
//   share_send        in: w (device)   out: w' (pinned host)   d2h copy of the ShareAttrs elements only
//   others_receive    in: w' (pinned host)   out: w (device)   h2d copy of all elements but those
//
//   grad_reduce_scatter  in: [order] g'...  out: order g'... s'...   comm: s' = this rank's share of the
//                        sum over ranks of f0 g' (ZeRO stage 2), one s' per g' of which this rank
//                        has a share (g' is left scaled). CollectiveAttrs: ordinal, the first g''s
//                        among the trainable weights, ordinal_step from one g' to the next (+1 or
//                        -1), granule the ZeRO granule (ops::zero_shard).
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>

#include "ferry/ops/communicator.hpp"
#include "ops/attrs.hpp"
#include "rows.hpp"

namespace ferry::ops::table {
namespace {

// A collective node's tensors in host memory: outputs 1.. hold inputs first_tensor.. (copied when the two
// are not one place), as floats; output 0, the order tensor, is set. `more` outputs may follow.
std::vector<std::span<float>> collective_operands(const HostContext& c, std::size_t more = 0) {
  const auto first = static_cast<std::size_t>(CollectiveAttrs::of(c.attrs()).first_tensor);
  if (c.output_count() != c.input_count() - first + 1 + more) {
    shape_error(c, "a collective node needs the order tensor and one output per tensor input");
  }
  std::vector<std::span<float>> out;
  for (std::size_t i = first; i < c.input_count(); ++i) {
    const std::size_t elems = c.input(i).shape.elems();
    auto* dst = reinterpret_cast<float*>(c.out(i - first + 1));
    const auto* src = reinterpret_cast<const float*>(c.in(i));
    if (src != dst) std::memcpy(dst, src, elems * sizeof(float));
    out.emplace_back(dst, elems);
  }
  *reinterpret_cast<float*>(c.out(0)) = 0.0f;
  return out;
}

// The CPU reference of a collective on one rank: each tensor times `scale`, the order tensor 0.
void one_rank_reference(RefContext& c, double scale) {
  const auto first = static_cast<std::size_t>(CollectiveAttrs::of(c.attrs()).first_tensor);
  const auto in = c.inputs();
  const auto out = c.outputs();
  for (std::size_t i = first; i < in.size(); ++i) {
    auto src = c.real(in[i]);
    auto dst = c.real(out[i - first + 1]);
    for (std::size_t k = 0; k < src.size(); ++k) dst[k] = src[k] * scale;
  }
  c.real(out[0])[0] = 0.0;
}

OpInfo copy_row(const char* name, bool to_device) {
  OpInfo r;
  r.name = name;
  // A narrow layer's gradient is sent as it is and widened on the host (graph/passes/data_parallel.cpp).
  r.float_dtypes = {DType::f32, DType::f16, DType::bf16};
  r.lane = to_device ? Lane::h2d : Lane::d2h;
  r.op_class = OpClass::communication;
  r.bind = [to_device](const BindContext& c) { return transfer_copies(c, to_device); };
  r.reference = copy_reference;
  return r;
}

// This rank's share of a weight (ShareAttrs), and the runs before and after it.
ElementRun share_of(const NodeAttrs& a) {
  const ShareAttrs s = ShareAttrs::of(a);
  return {static_cast<std::size_t>(s.first), static_cast<std::size_t>(s.count)};
}
std::array<ElementRun, 2> others_of(const NodeAttrs& a, std::size_t elems) {
  const ElementRun s = share_of(a);
  return {ElementRun{0, s.first}, ElementRun{s.first + s.count, elems - std::min(elems, s.first + s.count)}};
}

// A copy of some runs of each tensor: `share` the rank's share, else the others'.
OpInfo run_copy_row(const char* name, bool share) {
  OpInfo r;
  r.name = name;
  r.lane = share ? Lane::d2h : Lane::h2d;
  r.op_class = OpClass::communication;
  r.bind = [share](const BindContext& c) {
    const std::size_t elems = c.input(0).shape.elems();
    const ElementRun mine = share_of(c.attrs());
    if (mine.first + mine.count > elems) shape_error(c, "a share past the tensor's end");
    if (share) return transfer_copies(c, false, std::span(&mine, 1));
    const auto others = others_of(c.attrs(), elems);
    return transfer_copies(c, true, others);
  };
  r.reference = [share](RefContext& c) {
    auto src = c.real(c.inputs()[0]);
    auto dst = c.real(c.outputs()[0]);
    const ElementRun mine = share_of(c.attrs());
    for (std::size_t k = 0; k < src.size(); ++k) {
      const bool in_share = k >= mine.first && k < mine.first + mine.count;
      if (in_share == share) dst[k] = src[k];
    }
  };
  return r;
}

// A collective's row: a node of the communication lane, class communication. Its host function
// starts the collective and hands the request to the step (HostContext::complete_when): the node
// completes when the collective does, without a worker waiting for it.
OpInfo collective_row(const char* name, std::function<void(const HostContext&)> host,
                      std::function<void(RefContext&)> reference) {
  OpInfo r;
  r.name = name;
  r.lane = Lane::comm;
  r.op_class = OpClass::communication;
  r.host = std::move(host);
  r.reference = std::move(reference);
  return r;
}

OpInfo allreduce_row() {
  const auto host = [](const HostContext& c) {
    const float share = CollectiveAttrs::of(c.attrs()).share;
    const std::vector<std::span<float>> buffers = collective_operands(c);
    for (const std::span<float>& b : buffers) {
      for (float& x : b) x *= share;
    }
    if (Communicator* comm = c.step().communicator) c.complete_when(comm->start_allreduce_sum(buffers));
  };
  // One rank: its share of the batch is all of it, so the reduction is the identity.
  return collective_row("grad_allreduce", host,
                        [](RefContext& c) { one_rank_reference(c, CollectiveAttrs::of(c.attrs()).share); });
}

// in: [order] w'...  out: order w'...; CollectiveAttrs: ordinal, the first tensor's among the
// trainable weights, granule the ZeRO granule: each w' gets every rank's share of it
// (ops::zero_shard).
OpInfo allgather_row() {
  const auto host = [](const HostContext& c) {
    const std::vector<std::span<float>> tensors = collective_operands(c);
    Communicator* comm = c.step().communicator;
    if (!comm) return;
    const CollectiveAttrs at = CollectiveAttrs::of(c.attrs());
    const auto ordinal = static_cast<std::size_t>(at.ordinal);
    const auto granule = static_cast<std::size_t>(at.granule);
    std::vector<GatherBuffer> buffers;
    for (std::size_t k = 0; k < tensors.size(); ++k) {
      GatherBuffer b{tensors[k], {}, {}};
      for (int rank = 0; rank < comm->size(); ++rank) {
        const ShardRange s = zero_shard(tensors[k].size(), ordinal + k, rank, comm->size(), granule);
        b.counts.push_back(static_cast<int>(s.count));
        b.displs.push_back(static_cast<int>(s.first));
      }
      buffers.push_back(std::move(b));
    }
    c.complete_when(comm->start_allgather(std::move(buffers)));
  };
  // One rank holds every share: the gather is the identity.
  return collective_row("weight_allgather", host, [](RefContext& c) { one_rank_reference(c, 1.0); });
}

// in: [order] g'...  out: order g'... s'...  (see the file comment)
OpInfo reduce_scatter_row() {
  const auto host = [](const HostContext& c) {
    const CollectiveAttrs at = CollectiveAttrs::of(c.attrs());
    const std::size_t tensors = c.input_count() - static_cast<std::size_t>(at.first_tensor);
    const std::size_t shards = c.output_count() - 1 - tensors;
    const std::vector<std::span<float>> whole = collective_operands(c, shards);
    for (const std::span<float>& b : whole) {
      for (float& x : b) x *= at.share;
    }
    Communicator* comm = c.step().communicator;
    const int ranks = comm ? comm->size() : 1, rank = comm ? comm->rank() : 0;
    std::vector<ScatterBuffer> buffers;
    std::size_t next = 1 + tensors;  // the next shard output
    for (std::size_t k = 0; k < tensors; ++k) {
      const auto ordinal = static_cast<std::size_t>(at.ordinal + static_cast<long long>(k) * at.ordinal_step);
      ScatterBuffer b{whole[k], {}, {}};
      for (int r = 0; r < ranks; ++r) {
        const ShardRange s = zero_shard(whole[k].size(), ordinal, r, ranks, static_cast<std::size_t>(at.granule));
        b.counts.push_back(static_cast<int>(s.count));
      }
      const auto mine = static_cast<std::size_t>(b.counts[static_cast<std::size_t>(rank)]);
      if (mine > 0) {
        if (next >= c.output_count() || c.output(next).shape.elems() != mine) {
          shape_error(c, fmt::format("rank {} of {} has {} elements of tensor {} of the bucket, but the node's shard "
                                     "outputs do not say so",
                                     rank, ranks, mine, k));
        }
        b.shard = {reinterpret_cast<float*>(c.out(next++)), mine};
      }
      buffers.push_back(std::move(b));
    }
    if (next != c.output_count()) shape_error(c, "more shard outputs than shares of this rank");
    if (comm) {
      c.complete_when(comm->start_reduce_scatter_sum(std::move(buffers)));
    } else {
      for (const ScatterBuffer& b : buffers) std::copy(b.data.begin(), b.data.end(), b.shard.begin());
    }
  };
  // One rank: the share is all of it and so is the shard.
  const auto reference = [](RefContext& c) {
    const CollectiveAttrs at = CollectiveAttrs::of(c.attrs());
    one_rank_reference(c, at.share);
    const auto first = static_cast<std::size_t>(at.first_tensor);
    const auto in = c.inputs();
    const auto out = c.outputs();
    const std::size_t tensors = in.size() - first;
    for (std::size_t k = 0; k < tensors && 1 + tensors + k < out.size(); ++k) {
      const auto scaled = c.real(out[1 + k]);
      auto shard = c.real(out[1 + tensors + k]);
      std::copy(scaled.begin(), scaled.end(), shard.begin());
    }
  };
  return collective_row("grad_reduce_scatter", host, reference);
}

}  // namespace

void register_collective_rows(const AddRow& add) {
  add(copy_row("grad_send", false), builtin::grad_send);
  add(allreduce_row(), builtin::grad_allreduce);
  add(copy_row("grad_receive", true), builtin::grad_receive);
  add(allgather_row(), builtin::weight_allgather);
  add(reduce_scatter_row(), builtin::grad_reduce_scatter);
  add(run_copy_row("share_send", true), builtin::share_send);
  add(run_copy_row("others_receive", false), builtin::others_receive);
}

}  // namespace ferry::ops::table
