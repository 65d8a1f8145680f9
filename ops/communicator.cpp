// ZeRO shares of a trainable tensor over the ranks, and the blocking defaults of a communicator's
// non-blocking collectives (ferry/ops/communicator.hpp).
#include "ferry/ops/communicator.hpp"

#include <fmt/format.h>

#include <stdexcept>
#include <thread>

namespace ferry::ops {

ShardRange zero_shard(std::size_t elems, std::size_t ordinal, int rank, int ranks, std::size_t granule) {
  if (ranks < 1 || rank < 0 || rank >= ranks || granule == 0) {
    throw std::invalid_argument(fmt::format("zero_shard: rank {} of {}, granule {}", rank, ranks, granule));
  }
  if (ranks == 1) return {0, elems};
  const auto n = static_cast<std::size_t>(ranks);
  if (elems < granule * n) return ordinal % n == static_cast<std::size_t>(rank) ? ShardRange{0, elems} : ShardRange{};
  const auto cut = [&](std::size_t r) { return r == n ? elems : elems / n * r / granule * granule; };
  const auto r = static_cast<std::size_t>(rank);
  return {cut(r), cut(r + 1) - cut(r)};
}

namespace {

class Completed final : public CommRequest {
 public:
  bool test() override { return true; }
};

}  // namespace

void wait(CommRequest& r) {
  while (!r.test()) std::this_thread::yield();
}

std::unique_ptr<CommRequest> completed_request() {
  return std::make_unique<Completed>();
}

std::unique_ptr<CommRequest> Communicator::start_allreduce_sum(std::vector<std::span<float>> buffers) {
  allreduce_sum(buffers);
  return completed_request();
}

std::unique_ptr<CommRequest> Communicator::start_reduce_scatter_sum(std::vector<ScatterBuffer> buffers) {
  reduce_scatter_sum(buffers);
  return completed_request();
}

std::unique_ptr<CommRequest> Communicator::start_allgather(std::vector<GatherBuffer> buffers) {
  allgather(buffers);
  return completed_request();
}

}  // namespace ferry::ops
