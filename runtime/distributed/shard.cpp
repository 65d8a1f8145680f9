// Shares of a global batch, and what the launcher says about this process.
#include <fmt/format.h>

#include <cstdlib>
#include <stdexcept>

#include "ferry/runtime/distributed.hpp"

namespace ferry {

Shard shard_of(std::uint32_t global_batch, int rank, int ranks) {
  if (ranks < 1 || rank < 0 || rank >= ranks) {
    throw std::invalid_argument(fmt::format("shard_of: rank {} of {} ranks", rank, ranks));
  }
  if (global_batch < static_cast<std::uint32_t>(ranks)) {
    throw std::invalid_argument(fmt::format(
        "a global batch of {} samples cannot be shared by {} ranks: each needs at least one; use a batch of at least "
        "{} or fewer ranks",
        global_batch, ranks, ranks));
  }
  const auto at = [&](int r) {
    return static_cast<std::uint32_t>(std::uint64_t(global_batch) * static_cast<std::uint64_t>(r) /
                                      static_cast<std::uint64_t>(ranks));
  };
  return {at(rank), at(rank + 1) - at(rank)};
}

bool launched_by_mpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMIX_RANK") || std::getenv("PMI_RANK");
}

int local_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    if (const char* v = std::getenv(name)) return std::atoi(v);
  }
  return 0;
}

}  // namespace ferry
