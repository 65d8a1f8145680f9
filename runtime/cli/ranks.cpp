// `mpirun -np N ferry train ...`: which rank does what, the share of each batch a rank trains on,
// and stopping together (docs/distributed.md).
#include <iostream>

#include "cli.hpp"

namespace ferry::cli {

void join_ranks(TrainArgs& a) {
  if (!ferry::launched_by_mpi()) return;
  a.world = ferry::mpi_world();
  if (a.world->size() < 2) {
    a.world.reset();  // one rank: train as without mpirun
    return;
  }
  a.control = a.world->split();
  a.primary = a.world->rank() == 0;
  if (a.primary) return;
  a.quiet = true;
  a.json = false;
  a.sample = 0;
  a.trace_path.clear();
  a.profile_path.clear();
  a.profile_phases_path.clear();
}

ferry::Shard configure_ranks(const TrainArgs& a, std::uint32_t global_batch, ferry::TrainerOptions& opt) {
  opt.data_parallel.zero_stage = a.zero;
  opt.data_parallel.bucket_bytes = ferry::parse_bytes(a.bucket_size);
  if (opt.data_parallel.bucket_bytes == 0) {
    throw std::invalid_argument("--bucket-size 0: gradient buckets need at least one byte (default 25MiB)");
  }
  if (!a.world) {
    opt.batch = global_batch;
    return {0, global_batch};
  }
  if (a.zero >= 1 && (!a.checkpoint_path.empty() || !a.resume_path.empty())) {
    throw std::invalid_argument(
        "--checkpoint and --resume with --zero 1 over several ranks: each rank holds its own share of the optimizer "
        "state, and sharded checkpoints are not built yet; use --zero 0 to checkpoint a data-parallel run");
  }
  const ferry::Shard shard = ferry::shard_of(global_batch, a.world->rank(), a.world->size());
  opt.batch = shard.count;
  opt.data_parallel.communicator = a.world;
  opt.data_parallel.global_batch = global_batch;
  return shard;
}

void announce_ranks(const TrainArgs& a, const ferry::Trainer& trainer, std::uint32_t global_batch) {
  if (!a.world) return;
  const int n = a.world->size();
  const ferry::Shard least = ferry::shard_of(global_batch, 0, n), most = ferry::shard_of(global_batch, n - 1, n);
  std::cerr << fmt::format(
      "ferry: data parallel over {} ranks ({}), ZeRO stage {}: {} samples a step, {} per rank; {} of gradients summed "
      "over the ranks each step in buckets of {}\n",
      n, a.world->name(), a.zero, global_batch,
      least.count == most.count ? fmt::format("{}", least.count) : fmt::format("{}-{}", most.count, least.count),
      ferry::format_bytes(trainer.allreduce_bytes_per_step()), a.bucket_size);
}

bool stop_requested(const TrainArgs& a) {
  double any = stop_signal != 0 ? 1.0 : 0.0;
  if (a.control) a.control->allreduce_sum(std::span<double>(&any, 1));
  return any > 0;
}

void end_all_ranks_on_error(const TrainArgs& a, const std::exception& e) {
  if (!a.world) return;
  std::cerr << fmt::format("ferry: error on rank {} of {}: {}\nferry: ending all {} ranks\n", a.world->rank(),
                           a.world->size(), e.what(), a.world->size())
            << std::flush;
  a.world->abort(1);
}

}  // namespace ferry::cli
