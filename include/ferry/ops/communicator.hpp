// What a step sees of the other ranks of a data-parallel run: a communicator the trainer hands to
// its steps (ops::StepInfo::communicator) and its host code. ferry's implementation is Open MPI's
// (ferry/runtime/distributed.hpp, mpi_world); a trainer that embeds ferry in its own distributed
// program may implement this over its own transport.
//
// Collectives are matched by order: every rank calls the same collectives in the same order on
// one communicator. A step issues its gradient reductions from one chain of host-lane nodes, and
// the trainer its small reductions (the loss, start-up checks) from the calling thread on a
// second communicator (split()), so that the two never interleave differently on two ranks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace ferry::ops {

// ZeRO sharding: the elements of a trainable tensor whose optimizer state rank `rank` of `ranks`
// keeps and updates. A tensor of `elems` elements is cut at multiples of `granule` (so 8-bit
// optimizer blocks stay whole) into shares that differ by at most a granule; a tensor smaller
// than `granule` * `ranks` belongs whole to rank `ordinal` mod `ranks` (ordinal: its place among
// the trainable tensors), so small tensors spread over the ranks.
struct ShardRange {
  std::size_t first = 0, count = 0;
};
ShardRange zero_shard(std::size_t elems, std::size_t ordinal, int rank, int ranks, std::size_t granule);

// One tensor of an all-gather: rank r's elements are data[displs[r], displs[r] + counts[r]).
struct GatherBuffer {
  std::span<float> data;
  std::vector<int> counts, displs;
};

// One tensor of a reduce-scatter: `data` summed over the ranks, and rank r's run of the sum, the
// counts[r] elements after counts[0] + ... + counts[r - 1], written into that rank's `shard`
// (counts[rank] elements; runs in rank order, covering `data`).
struct ScatterBuffer {
  std::span<const float> data;
  std::span<float> shard;
  std::vector<int> counts;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // What carries the traffic ("Open MPI 4.1.4"), for banners and JSON.
  virtual std::string name() const = 0;
  // Sums each buffer element-wise over the ranks, in place. The buffers' reductions are started
  // together and all complete before the call returns (one bucket of gradients).
  virtual void allreduce_sum(std::span<const std::span<float>> buffers) = 0;
  virtual void allreduce_sum(std::span<double> values) = 0;
  // Each buffer's sum over the ranks, of which this rank receives its run (ZeRO stage 2's
  // gradients). Started together, all complete before the call returns.
  virtual void reduce_scatter_sum(std::span<const ScatterBuffer> buffers) = 0;
  // Each buffer gets every rank's elements from that rank, in place (this rank's are already
  // there). Started together, all complete before the call returns.
  virtual void allgather(std::span<GatherBuffer> buffers) = 0;
  // Every rank's value, in rank order.
  virtual std::vector<std::uint64_t> allgather(std::uint64_t value) = 0;
  // A communicator over the same ranks whose collectives never match this one's.
  virtual std::unique_ptr<Communicator> split() const = 0;
  // Ends every rank of the run after an error on this one (MPI_Abort); does not return.
  [[noreturn]] virtual void abort(int exit_code) const = 0;
};

}  // namespace ferry::ops
