// `mpirun -np N ferry train ...`: which rank does what, the share of each batch a rank trains on,
// and stopping together (docs/distributed.md).
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <string_view>
#include <utility>

#include "cli.hpp"
#include "runtime/rank_watchdog.hpp"

namespace ferry::cli {

std::string shard_file(const std::string& path, int rank) {
  return fmt::format("{}.rank{}", path, rank);
}

std::string given_file(const TrainArgs& a, const std::string& path) {
  if (!a.sharded_checkpoint || !a.world || a.primary) return path;
  const std::string suffix = shard_file("", a.world->rank());
  return path.ends_with(suffix) ? path.substr(0, path.size() - suffix.size()) : path;
}

namespace {

// A ZeRO stage 1 or 2 checkpoint of N ranks is FILE and FILE.rank1 .. FILE.rank<N-1>: the files
// there (one: a whole-state checkpoint). A gap in the ranks' files is an error naming it.
std::vector<std::string> checkpoint_files(const std::string& path) {
  std::vector<std::string> files{path};
  while (std::filesystem::exists(shard_file(path, static_cast<int>(files.size())))) {
    files.push_back(shard_file(path, static_cast<int>(files.size())));
  }
  // Another rank's file beyond the first missing one: the checkpoint lost a file.
  const std::filesystem::path p(path);
  const std::string prefix = p.filename().string() + ".rank";
  std::error_code ec;
  const std::filesystem::path folder = p.has_parent_path() ? p.parent_path() : std::filesystem::path(".");
  for (const auto& entry : std::filesystem::directory_iterator(folder, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string digits = name.substr(prefix.size());
    if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 6) continue;
    if (std::stoul(digits) > files.size()) {
      throw std::invalid_argument(fmt::format(
          "cannot resume from '{}': '{}' is there but '{}' is not, so a rank's file of this checkpoint is missing; "
          "restore it, or resume from a checkpoint whose files are all there",
          path, entry.path().string(), shard_file(path, static_cast<int>(files.size()))));
    }
  }
  return files;
}

// Before any work: how --resume FILE is read. A checkpoint cut as this run cuts the optimizer
// state (one whole-state file, alone or at ZeRO stage 0; at stage 1 or 2, as many files as ranks)
// is loaded as it is, each rank its own file; any other is cut anew (resume_files: every rank
// reads every file).
void plan_resume(TrainArgs& a) {
  if (a.resume_path.empty()) return;
  const std::vector<std::string> files = checkpoint_files(a.resume_path);
  const std::size_t now = a.world ? static_cast<std::size_t>(a.world->size()) : 1;
  const bool sharded_then = files.size() > 1;
  if (sharded_then == a.sharded_checkpoint && (!sharded_then || files.size() == now)) return;
  a.resume_files = files;
}

}  // namespace

std::vector<std::byte> load_resume(ferry::Trainer& trainer, const TrainArgs& a) {
  if (a.resume_files.empty()) return trainer.load_checkpoint(a.resume_path);
  const std::vector<std::filesystem::path> files(a.resume_files.begin(), a.resume_files.end());
  return trainer.load_resharded_checkpoint(files);
}

std::string resume_note(const TrainArgs& a) {
  if (a.resume_files.empty()) return {};
  const int now = a.world ? a.world->size() : 1;
  return fmt::format(" (written {}, the optimizer state cut anew for {})",
                     a.resume_files.size() > 1 ? fmt::format("by {} ranks at ZeRO stage 1 or 2", a.resume_files.size())
                                               : std::string("whole"),
                     a.sharded_checkpoint
                         ? fmt::format("{} ranks at ZeRO stage {}", now, a.zero)
                         : (now > 1 ? fmt::format("{} ranks at ZeRO stage 0", now) : std::string("one rank")));
}

void remove_stale_shards(const TrainArgs& a) {
  if (a.checkpoint_path.empty() || !a.primary) return;
  const int first_stale = a.sharded_checkpoint ? a.world->size() : 1;
  for (int k = first_stale;; ++k) {
    const std::string stale = shard_file(a.checkpoint_path, k);
    std::error_code ec;
    if (!std::filesystem::is_regular_file(stale, ec)) return;
    if (head_of(stale, 8) != std::string_view(ferry::checkpoint_magic, 8)) return;  // not ferry's: left alone
    std::filesystem::remove(stale, ec);
    if (ec) {
      std::cerr << fmt::format(
          "ferry: warning: could not remove '{}', a shard of an earlier checkpoint at this "
          "path on more ranks ({}); remove it before resuming from '{}'\n",
          stale, ec.message(), a.checkpoint_path);
      return;
    }
  }
}

namespace {

// FNV-1a of a path as given, in its lexically normal form ("./x.ckpt" and "x.ckpt" hash alike);
// not resolved against the file system: ranks on other hosts may start in other folders.
std::uint64_t path_hash(std::string_view given) {
  const std::string path = std::filesystem::path(given).lexically_normal().string();
  std::uint64_t h = 14695981039346656037ull;
  for (const char c : path) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h | 1;  // 0 stays "not given"
}

// Paths given to every rank must be the same paths: another --checkpoint on rank r > 0 was
// dropped at ZeRO stage 0 and, at stages 1 and 2, put that rank's share beside another file than
// rank 0's, a checkpoint found incomplete only when resumed; another --resume read other state.
// (Given on some ranks only: the checks of what is given say so.)
void check_paths_agree(const TrainArgs& a) {
  const std::pair<const char*, const std::string*> paths[] = {{"--checkpoint", &a.checkpoint_path},
                                                              {"--resume", &a.resume_path},
                                                              {"--trace", &a.trace_path},
                                                              {"--profile", &a.profile_path},
                                                              {"--profile-phases", &a.profile_phases_path}};
  for (const auto& [flag, path] : paths) {
    const std::vector<std::uint64_t> all = a.control->allgather(path->empty() ? 0 : path_hash(*path));
    for (std::size_t r = 1; r < all.size(); ++r) {
      if (all[r] == 0 || all[0] == 0 || all[r] == all[0]) continue;
      throw std::invalid_argument(fmt::format(
          "rank {} of this data-parallel run was given another {} than rank 0 (this is rank {}, given '{}'): every "
          "rank must name the same file (rank 0 writes the outputs, and at --zero 1 or 2 each rank its share of the "
          "checkpoint beside rank 0's file, which it reads back); start every rank with the same command",
          r, flag, a.world->rank(), *path));
    }
  }
}

// Rank 0 writes the run's outputs and the other ranks none: an output flag given to another rank
// alone would be dropped without a word, so every rank must be given the same.
void check_outputs_agree(const TrainArgs& a) {
  const std::pair<const char*, bool> flags[] = {{"--json", a.json},
                                                {"--trace", !a.trace_path.empty()},
                                                {"--profile", !a.profile_path.empty()},
                                                {"--profile-phases", !a.profile_phases_path.empty()}};
  std::uint64_t given = 0;
  for (std::size_t i = 0; i < std::size(flags); ++i) given |= std::uint64_t{flags[i].second} << i;
  const std::vector<std::uint64_t> all = a.control->allgather(given);
  for (std::size_t r = 1; r < all.size(); ++r) {
    for (std::size_t i = 0; i < std::size(flags); ++i) {
      const bool theirs = (all[r] >> i) & 1, rank0 = (all[0] >> i) & 1;
      if (theirs == rank0) continue;
      throw std::invalid_argument(fmt::format(
          "rank {} of this data-parallel run was {} {} and rank 0 was {}: rank 0 writes the run's outputs for every "
          "rank; start every rank with the same command",
          r, theirs ? "given" : "not given", flags[i].first, rank0 ? "given it" : "not"));
    }
  }
  check_paths_agree(a);
}

}  // namespace

namespace {

// The watch over set-up (end_setup_watch), and the communicator it ends the run through once MPI's
// world is made (read on the watchdog's thread).
std::unique_ptr<ferry::RankWatchdog> setup_watchdog;
std::atomic<ferry::ops::Communicator*> setup_world{nullptr};

// Ends every rank: through MPI where its world is made, else by this process's exit, which mpirun
// answers by ending the others.
[[noreturn]] void setup_timed_out(double idle_seconds, double limit_minutes) {
  ferry::ops::Communicator* world = setup_world.load();
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  std::cerr << fmt::format(
      "\nferry: rank {}: set-up (starting MPI, loading the data, compiling the step, a resume) has not finished in "
      "{:.0f} s (--rank-timeout-minutes {}): another rank has likely stopped or hung, leaving this one waiting for it; "
      "ending every rank of the run with status 124, before any step (0 waits forever)\n",
      world  ? std::to_string(world->rank())
      : rank ? rank
             : "?",
      idle_seconds, limit_minutes);
  if (world) world->abort(124);
  std::_Exit(124);
}

}  // namespace

void end_setup_watch() {
  setup_watchdog.reset();
}

void join_ranks(TrainArgs& a) {
  // One rank keeps the whole optimizer state: a ZeRO stage asked for is said not to apply (the
  // run is the one a script scaling its ranks down to one expects), and --json reports stage 0.
  const auto alone = [&] {
    if (a.zero > 0) {
      std::cerr << fmt::format(
          "ferry: warning: --zero {} shards the optimizer state over the ranks of a data-parallel run; this run has "
          "one rank, which keeps all of it (ZeRO stage 0)\n",
          a.zero);
      a.zero = 0;
    }
    if (a.bucket_size_given) {
      std::cerr << fmt::format(
          "ferry: warning: --bucket-size {} sets how many gradient bytes the ranks of a data-parallel run sum "
          "together; this run has one rank, which sums nothing\n",
          a.bucket_size);
    }
    plan_resume(a);
  };
  if (!ferry::launched_by_mpi()) return alone();
  if (a.rank_timeout_minutes > 0) {
    // From before MPI's start: its initialisation waits for every rank too.
    setup_watchdog = std::make_unique<ferry::RankWatchdog>(
        std::chrono::duration<double>(a.rank_timeout_minutes * 60),
        [limit = a.rank_timeout_minutes](double idle, std::uint64_t) { setup_timed_out(idle, limit); });
  }
  a.world = ferry::mpi_world();
  if (a.world->size() < 2) {
    a.world.reset();  // one rank: train as without mpirun
    end_setup_watch();
    return alone();
  }
  setup_world = a.world.get();
  a.control = a.world->split();
  a.primary = a.world->rank() == 0;
  check_outputs_agree(a);
  // ZeRO stages 1 and 2: each rank holds other optimizer state (the same shares at either stage),
  // so each writes (and resumes from) its own file; rank 0's is the path given.
  a.sharded_checkpoint = a.zero >= 1;
  plan_resume(a);
  if (a.sharded_checkpoint && !a.primary) {
    if (!a.checkpoint_path.empty()) a.checkpoint_path = shard_file(a.checkpoint_path, a.world->rank());
    if (!a.resume_path.empty() && a.resume_files.empty()) a.resume_path = shard_file(a.resume_path, a.world->rank());
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
  opt.data_parallel.bucket_bytes = size_option("--bucket-size", a.bucket_size);
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

void check_ranks_resumed_together(const TrainArgs& a, bool resumed, std::uint64_t steps_done) {
  if (!a.control) return;
  const std::vector<std::uint64_t> given = a.control->allgather(resumed ? 1 : 0);
  const std::vector<std::uint64_t> steps = a.control->allgather(steps_done);
  if (std::adjacent_find(given.begin(), given.end(), std::not_equal_to<>()) != given.end()) {
    std::vector<std::size_t> with;
    for (std::size_t r = 0; r < given.size(); ++r) {
      if (given[r] != 0) with.push_back(r);
    }
    throw std::invalid_argument(fmt::format(
        "rank(s) {} of this data-parallel run resume from --resume and the others do not: give every rank the same "
        "--resume, or none",
        fmt::join(with, ", ")));
  }
  if (std::adjacent_find(steps.begin(), steps.end(), std::not_equal_to<>()) != steps.end()) {
    throw std::invalid_argument(fmt::format(
        "the ranks resumed from checkpoints of different steps ({} optimizer updates on ranks 0..{}): they were given "
        "different --resume files, or a run stopped while its ranks were writing their files; give every rank the "
        "same --resume, or resume from an older complete checkpoint",
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
