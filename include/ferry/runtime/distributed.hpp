// Data-parallel training (docs/distributed.md): each rank trains a copy of the model on its share
// of every global batch, and the steps sum the gradients over the ranks before the update, so
// every rank makes the same update and the weights stay the same on all of them.
//
//   auto world = ferry::mpi_world();                       // MPI_Init on first use
//   const ferry::Shard mine = ferry::shard_of(256, world->rank(), world->size());
//   ferry::TrainerOptions opt;
//   opt.batch = mine.count;                                // this rank's samples of each batch
//   opt.data_parallel = {world, 256};
//   ferry::Trainer trainer(runtime, model, opt);           // then rows [mine.first, +count) of each batch
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "ferry/ops/communicator.hpp"

namespace ferry {

struct DataParallelOptions {
  // The ranks; null (or one rank) trains alone.
  std::shared_ptr<ops::Communicator> communicator;
  // Samples of one global batch over all ranks; each rank's TrainerOptions::batch is its share
  // (shard_of). 0: batch times the number of ranks. Alone, 0 or the batch (another is refused).
  std::uint32_t global_batch = 0;
  // Gradient bytes reduced together: a bucket's reduction starts when backward has finished all
  // of its gradients, and overlaps the backward of the layers before them.
  std::uint64_t bucket_bytes = 25ull << 20;
  // ZeRO stage: 0 every rank keeps all optimizer state and gradients; 1 each rank the optimizer
  // state of its share of every weight; 2 also the reduced gradients of its share alone
  // (docs/distributed.md).
  int zero_stage = 0;
};

// Rows [first, first + count) of a global batch: rank r of n gets batch * r / n up to
// batch * (r + 1) / n, so the shares differ by at most one sample and cover the batch in order.
struct Shard {
  std::uint32_t first = 0, count = 0;
};
Shard shard_of(std::uint32_t global_batch, int rank, int ranks);

// Whether this process was started by mpirun / mpiexec (Open MPI's or PMIx's environment).
bool launched_by_mpi();
// This process's rank on its node as the launcher set it (0 when not launched by one).
int local_rank();
// Whether this ferry was built with MPI (libopenmpi-dev found at configure time).
bool built_with_mpi();
// MPI_COMM_WORLD as a communicator; initialises MPI (thread level multiple) on the first call and
// finalises it at exit. Throws std::runtime_error in a ferry built without MPI.
std::shared_ptr<ops::Communicator> mpi_world();

}  // namespace ferry
