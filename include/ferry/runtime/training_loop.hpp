// The training loop every ferry trainer runs: batches from a source, one step in flight (the host
// stages step k+1 while the device runs step k), the learning rate from a schedule, a progress
// line, evaluation and checkpoints at boundaries (the end of each epoch, every N steps, the last
// step, the time limit), and a stop between steps on SIGINT / SIGTERM with a checkpoint to resume
// from. The `ferry train` commands and the examples use it; what they report is theirs.
//
//   ferry::ShuffledBatches batches(train, trainer.model(), batch);
//   const std::uint64_t per_epoch = batches.steps_per_epoch();
//   ferry::TrainingLoop loop(trainer, batches, {.steps = epochs * per_epoch, .steps_per_epoch = per_epoch});
//   loop.on_boundary = [&](const ferry::LoopPosition& p) {
//     std::printf("epoch %llu: loss %.4f, test accuracy %.4f\n", p.done / per_epoch, p.last_epoch_loss,
//                 trainer.evaluate(test).accuracy);
//   };
//   const ferry::LoopSummary summary = loop.run();
#pragma once

#include <chrono>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "ferry/ops/communicator.hpp"
#include "ferry/runtime/data_source.hpp"
#include "ferry/runtime/lr_schedule.hpp"
#include "ferry/runtime/trainer.hpp"
#include "ferry/runtime/write_options.hpp"

namespace ferry {

class OutputLock;
class RankWatchdog;

// SIGINT / SIGTERM while a StopSignals lives: the handler only records the signal (received()), so
// a loop can stop between steps with the step in flight finished; a second signal ends the process
// at once (the handler resets to the default). The previous handlers come back with the object.
// A step or an evaluation can take minutes: given an `acknowledgement`, the handler writes
// "<program>: SIGINT received: <acknowledgement>" to stderr the moment the signal arrives, so that
// a person does not take the silence for a hang and press again (which would save nothing).
class StopSignals {
 public:
  StopSignals() : StopSignals(std::string_view{}) {}
  explicit StopSignals(std::string_view acknowledgement, std::string_view program = "ferry");
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  // The signal received since the newest StopSignals was made (SIGINT, SIGTERM or SIGHUP: a closed
  // terminal or session), or 0.
  static int received() noexcept;
  // "SIGINT", "SIGTERM" or "SIGHUP" (another signal: "signal N").
  static std::string name(int signal);

 private:
  struct sigaction old_int_ {
  }, old_term_{}, old_hup_{};
};

// How far a loop has come, and the running sums its reports use: with the trainer's state and the
// batch source's, what a checkpoint keeps to go on exactly (TrainingLoop::resume).
struct LoopPosition {
  std::uint64_t done = 0;       // steps whose results were read (the run's steps, from 0)
  double epoch_loss_sum = 0;    // epochs: the sum of the current epoch's losses so far
  double last_epoch_loss = 0;   // epochs: the mean loss of the last whole epoch
  std::vector<float> recent;    // the newest losses, oldest first (at most recent_losses)
  double train_seconds = 0;     // wall time in steps, boundaries and checkpoints left out
  double boundary_seconds = 0;  // wall time in on_boundary (evaluation, reports)

  static constexpr std::size_t recent_losses = 20;
  // The mean of `recent` (0 before the first step).
  double recent_loss() const;
};

struct TrainingLoopOptions {
  std::uint64_t steps = 0;            // the run's steps, counted from 0 (a resumed run's include those done)
  std::uint64_t steps_per_epoch = 0;  // > 0: the run is in epochs, each ending at a boundary
  std::uint64_t boundary_every = 0;   // > 0: a boundary every this many steps as well
  double max_seconds = 0;             // > 0: end at a boundary once this much wall time has passed
  // The learning rate of each optimizer update (none: the trainer's, unchanged). Its steps are
  // updates: with TrainerOptions::accumulate k, micro-batch s runs at schedule->at(s / k), so its
  // total_steps is the run's steps / k.
  std::optional<LrSchedule> schedule{};
  // What a step trains on, for rates: `units_per_step` `unit`s (0: the trainer's batch of samples).
  std::uint64_t units_per_step = 0;
  std::string unit = "samples";
  bool progress = true;       // a progress line on stderr, and a line per checkpoint written
  bool catch_signals = true;  // SIGINT / SIGTERM stop the loop between steps (StopSignals)
  // A stop signal is acknowledged on stderr when it arrives (what the loop will do, and that a
  // second signal stops at once), not only once the step or evaluation in flight has ended.
  bool acknowledge_stop = true;
  // A checkpoint at every boundary and when stopped by a signal (none: no path). `caller_section`
  // gives the caller's bytes of it (Trainer::save_checkpoint's `caller`); `write_checkpoints` false
  // on ranks that leave the writing to another (they contribute to it where it is written:
  // Trainer::contribute_to_checkpoint).
  std::filesystem::path checkpoint{};
  std::function<std::vector<std::byte>(const LoopPosition&)> caller_section{};
  WriteOptions checkpoint_options{};
  bool write_checkpoints = true;
  // Called after each checkpoint this loop wrote (the CLI removes shard files a run on more ranks
  // left at the same path).
  std::function<void()> after_checkpoint{};
  // Data parallel: the ranks agree, through it, on stops and on the time limit, so that every rank
  // stops after the same step (null: one rank). Before the first step run() checks that every
  // rank's loop takes the same steps, boundaries, time limit, schedule, checkpoints, start and
  // data (a rank that differed would wait for the others forever, or drift apart), and throws
  // std::invalid_argument naming the first difference on every rank.
  std::shared_ptr<ops::Communicator> control{};
  // Data parallel (control over more than one rank): the longest a step, or a boundary's work, may
  // go without finishing before the run is ended on every rank (Communicator::abort, exit status
  // 124), saying so: a rank stopped, hung or lost leaves the others waiting in a collective, which
  // has no time limit of its own. The last checkpoint written is intact. 0: wait forever.
  double rank_timeout_seconds = 30 * 60;
  // A hash of the training data (e.g. ferry::checkpoint_checksum of it): data parallel, the ranks
  // must agree on it. 0: not compared.
  std::uint64_t data_fingerprint = 0;
};

// A checkpoint TrainingLoop::run could not write (a full disk, a folder gone). The file at the
// path is unchanged (checkpoints are written whole or not at all): `intact_done` is the steps done
// (LoopPosition::done) when this loop last wrote it, nullopt when this loop had not written it yet.
struct CheckpointWriteError : std::runtime_error {
  CheckpointWriteError(const std::string& what, std::optional<std::uint64_t> intact)
      : std::runtime_error(what), intact_done(intact) {}
  std::optional<std::uint64_t> intact_done;
};

struct LoopSummary {
  enum class End : std::uint8_t { finished, out_of_time, stopped } end = End::finished;
  int signal = 0;                   // stopped: SIGINT, SIGTERM or SIGHUP (another rank's: SIGTERM)
  bool checkpoint_written = false;  // stopped: a checkpoint of the position was written
  // stopped: the signal came during the last step's boundary (its evaluation, its checkpoint), with
  // every step done: nothing is left to resume.
  bool every_step_done = false;
  LoopPosition position;
  std::uint64_t steps_run = 0;    // steps of this run (a resumed run's steps before it left out)
  double run_train_seconds = 0;   // this run's share of position.train_seconds
  double checkpoint_seconds = 0;  // this run's time writing checkpoints
  double first_step_ms = 0;       // the first step of this run (one-off costs included)
  double mean_step_ms = 0;        // StepResult::step_ms over this run's steps but the first (the first alone if one)
  // This run's units (TrainingLoopOptions::units_per_step) per second of training.
  double units_per_second = 0;
};

class TrainingLoop {
 public:
  // Throws std::invalid_argument for steps 0, steps that are not whole epochs (a multiple of
  // steps_per_epoch where that is not 0), a time limit that is no finite number >= 0 or an
  // invalid schedule. `trainer` and `batches` must outlive the loop; it is not copied (a copy
  // would share them and their position).
  TrainingLoop(Trainer& trainer, BatchSource& batches, TrainingLoopOptions options);
  TrainingLoop(const TrainingLoop&) = delete;
  TrainingLoop& operator=(const TrainingLoop&) = delete;

  // Every step's result, in order: `step` is the run's step index (from 0), `run_index` its index
  // in this run. Time spent here counts as training time.
  std::function<void(std::uint64_t step, std::uint64_t run_index, const StepResult& result)> on_step;
  // At each boundary, with no step in flight (the state is that of exactly position.done steps),
  // before the checkpoint: evaluation and reports.
  std::function<void(const LoopPosition& position)> on_boundary;

  // Goes on from `position` (read back from a checkpoint's caller section): the steps done, the
  // running sums and times. The batch source must be where it was then. Throws
  // std::invalid_argument for a position past the run's steps.
  void resume(const LoopPosition& position);
  // Trains up to the run's steps, the time limit or a signal. A step's error, or one a callback
  // throws, propagates; the step in flight then is settled first: after a failed step its error is
  // dropped, after a callback's it trained and counts among the steps done (a later run() goes on
  // after it), though no callback sees its result.
  LoopSummary run();

 private:
  struct InFlight {
    StepHandle handle;
    std::uint64_t step;
  };
  // Whether `here` holds on this rank or any other (one agreement over `control`; alone: `here`).
  bool on_any_rank(bool here) const;
  // Data parallel: throws when the ranks' loops differ (TrainingLoopOptions::control).
  void check_ranks_agree() const;
  // Throw, before any step, on every rank alike: when a checkpoint cannot be written at its path
  // (no folder, a folder in its place, a file ferry did not write unless
  // WriteOptions::replace_foreign_file, a path another run holds the lock of), and when the run's
  // checkpoints would not fit in their folder's free space (every rank's, on file systems they
  // share). check_checkpoint_path returns the path's lock, taken for this run where it writes.
  std::unique_ptr<OutputLock> check_checkpoint_path() const;
  void check_checkpoint_space() const;
  bool stop_requested() const;
  // What a stop signal makes this loop do, said when it arrives (TrainingLoopOptions::acknowledge_stop).
  std::string stop_acknowledgement() const;
  bool time_up() const;
  // Whether `done` steps end at a boundary: the last step, an epoch's end, every boundary_every.
  bool scheduled_boundary(std::uint64_t done) const;
  // The same, or the time limit (out_of_time_), agreed over the ranks.
  bool boundary_after(std::uint64_t done);
  void read(InFlight f, bool boundary);
  // A step's result into the position and the run's figures (read's part that no callback runs
  // in); returns its index in this run.
  std::uint64_t count_step(const StepResult& r);
  // At an epoch's end (done a multiple of steps_per_epoch): its mean loss into the position, and
  // the next epoch's sum from 0.
  void close_epoch();
  void at_boundary();
  void save_checkpoint();
  // At a checkpoint: save_checkpoint, or contribute to another rank's.
  void checkpoint_here();
  void show_progress();
  void end_progress_line();  // ends an open progress line, so other output starts a line of its own
  // The rank watchdog's end of the run (rank_timeout_seconds): says why, then ends every rank.
  [[noreturn]] void ranks_timed_out(double idle_seconds, std::uint64_t steps_done) const;

  Trainer& trainer_;
  BatchSource& batches_;
  TrainingLoopOptions options_;
  LoopPosition position_;
  LoopSummary summary_;
  double step_ms_sum_ = 0;
  bool out_of_time_ = false;
  std::optional<std::uint64_t> checkpoint_done_;            // position_.done when this loop last wrote its checkpoint
  std::chrono::steady_clock::time_point run_start_, mark_;  // mark_: where training time was last counted to
  bool progress_tty_ = false;
  bool progress_line_open_ = false;  // on a terminal: a progress line drawn without its newline yet
  int progress_decile_ = -1;         // a progress line not on a terminal: one per tenth of the epoch or run
  // The progress line's pace counts from the end of this run's first step (which builds kernels
  // and first touches memory): when it ended, and its training seconds.
  std::chrono::steady_clock::time_point paced_from_;
  double paced_train_seconds_ = 0;
  RankWatchdog* watchdog_ = nullptr;  // while run() runs a data-parallel loop with a time limit
};

}  // namespace ferry
