// `mpirun -np N ferry train ...`: which rank does what, the share of each batch a rank trains on,
// and stopping together (docs/distributed.md).
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <iostream>

#include "cli.hpp"

namespace ferry::cli {

namespace {

// A ZeRO stage 1 checkpoint of N ranks is FILE and FILE.rank1 .. FILE.rank<N-1>: from the files
// there, how many ranks wrote it (1: no shard files, a whole-state checkpoint).
int checkpoint_ranks(const std::string& path) {
  int n = 1;
  while (std::filesystem::exists(fmt::format("{}.rank{}", path, n))) ++n;
  return n;
}

// Before any work: --resume FILE is a checkpoint this run can take as to its ranks and ZeRO stage
// (the caller section checks it again once loaded).
void check_resume_shards(const TrainArgs& a) {
  if (a.resume_path.empty()) return;
  const int now = a.world ? a.world->size() : 1;
  const int wrote = checkpoint_ranks(a.resume_path);
  if (wrote > 1 && (!a.sharded_checkpoint || wrote != now)) {
    throw std::invalid_argument(
        fmt::format("cannot resume from '{}': it is one share of a ZeRO stage 1 run over {} ranks (or stage 2: the "
                    "others are in '{}.rank1'{}): resume with mpirun -np {} and --zero 1 or 2",
                    a.resume_path, wrote, a.resume_path,
                    wrote > 2 ? fmt::format(" to '.rank{}'", wrote - 1) : std::string(), wrote));
  }
  if (wrote == 1 && a.sharded_checkpoint) {
    throw std::invalid_argument(fmt::format(
        "cannot resume from '{}' with --zero {} over {} ranks: it holds the whole optimizer state (there is no "
        "'{}.rank1'); resume it with --zero 0",
        a.resume_path, a.zero, now, a.resume_path));
  }
}

}  // namespace

void join_ranks(TrainArgs& a) {
  if (!ferry::launched_by_mpi()) {
    check_resume_shards(a);
    return;
  }
  a.world = ferry::mpi_world();
  if (a.world->size() < 2) {
    a.world.reset();  // one rank: train as without mpirun
    check_resume_shards(a);
    return;
  }
  a.control = a.world->split();
  a.primary = a.world->rank() == 0;
  // ZeRO stages 1 and 2: each rank holds other optimizer state (the same shares at either stage),
  // so each writes (and resumes from) its own file; rank 0's is the path given.
  a.sharded_checkpoint = a.zero >= 1;
  if (a.primary) check_resume_shards(a);
  if (a.sharded_checkpoint && !a.primary) {
    const std::string suffix = fmt::format(".rank{}", a.world->rank());
    if (!a.checkpoint_path.empty()) a.checkpoint_path += suffix;
    if (!a.resume_path.empty()) {
      a.resume_path += suffix;
      if (!std::filesystem::exists(a.resume_path)) {
        throw std::invalid_argument(fmt::format(
            "cannot resume: rank {}'s share of the checkpoint, '{}' does not exist: it was written by fewer ranks or "
            "without --zero 1 or 2; resume with the mpirun -np and --zero it was written with",
            a.world->rank(), a.resume_path));
      }
    }
  }
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

void check_ranks_resumed_together(const TrainArgs& a, std::uint64_t steps_done) {
  if (!a.control) return;
  const std::vector<std::uint64_t> steps = a.control->allgather(steps_done);
  if (std::adjacent_find(steps.begin(), steps.end(), std::not_equal_to<>()) != steps.end()) {
    throw std::invalid_argument(fmt::format(
        "the ranks resumed from checkpoints of different steps ({} optimizer updates on ranks 0..{}): a run stopped "
        "while its ranks were writing their files; resume from an older complete checkpoint",
        fmt::join(steps, ", "), steps.size() - 1));
  }
}

void end_all_ranks_on_error(const TrainArgs& a, const std::exception& e) {
  if (!a.world) return;
  std::cerr << fmt::format("ferry: error on rank {} of {}: {}\nferry: ending all {} ranks\n", a.world->rank(),
                           a.world->size(), e.what(), a.world->size())
            << std::flush;
  a.world->abort(1);
}

}  // namespace ferry::cli
