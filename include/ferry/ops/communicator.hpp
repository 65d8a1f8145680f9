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

// A collective in progress (Communicator::start_*). test() drives the transport's progress and
// says whether the collective has completed; it throws when the collective failed. The buffers
// the collective was started on belong to it until then. Destroying an unfinished request waits
// for it: a collective cannot be abandoned by one rank alone.
class CommRequest {
 public:
  virtual ~CommRequest() = default;
  virtual bool test() = 0;
};

// Tests `r` until it completes, yielding the thread in between: the blocking form of a request.
void wait(CommRequest& r);

// A request that completed when it was made (what the default start_* return).
std::unique_ptr<CommRequest> completed_request();

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
  // The same three collectives started without waiting, for the step's communication lane: each
  // returns at once, and the collective completes while the caller goes on (the step hands the
  // request to a thread that tests it). The request owns `buffers` (MPI reads the counts until the
  // end); the memory they view must stay valid until the request completes. By default these run
  // the blocking form and return a completed request, so a communicator without non-blocking
  // collectives still works, with its calls blocking a worker.
  virtual std::unique_ptr<CommRequest> start_allreduce_sum(std::vector<std::span<float>> buffers);
  virtual std::unique_ptr<CommRequest> start_reduce_scatter_sum(std::vector<ScatterBuffer> buffers);
  virtual std::unique_ptr<CommRequest> start_allgather(std::vector<GatherBuffer> buffers);
  // Every rank's value, in rank order.
  virtual std::vector<std::uint64_t> allgather(std::uint64_t value) = 0;
  // A communicator over the same ranks whose collectives never match this one's.
  virtual std::unique_ptr<Communicator> split() const = 0;
  // Ends every rank of the run after an error on this one (MPI_Abort); does not return.
  [[noreturn]] virtual void abort(int exit_code) const = 0;
};

}  // namespace ferry::ops
