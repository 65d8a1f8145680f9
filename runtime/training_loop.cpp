// TrainingLoop (ferry/runtime/training_loop.hpp): one step in flight, boundaries drained, stops
// between steps.
#include "ferry/runtime/training_loop.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <numeric>
#include <stdexcept>
#include <utility>

#include "checkpoint_space.hpp"
#include "ferry/runtime/units.hpp"
#include "ops/tune_signals.hpp"
#include "output_file.hpp"
#include "rank_watchdog.hpp"
#include "trainer_internals.hpp"

namespace ferry {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

volatile std::sig_atomic_t received_signal = 0;

// The acknowledgement of each stop signal, composed before the handler is installed: the handler
// may only write() it (async-signal-safe), not format it. Empty: none.
struct Acknowledgement {
  int signal = 0;
  char text[512] = {};
  std::size_t size = 0;
};
std::array<Acknowledgement, 3> acknowledgements;

extern "C" void record_stop_signal(int sig) {
  received_signal = sig;
  for (const Acknowledgement& a : acknowledgements) {
    if (a.signal == sig && a.size > 0) {
      const int saved = errno;  // write() may change it under the interrupted code
      [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, a.text, a.size);
      errno = saved;
    }
  }
}

}  // namespace

StopSignals::StopSignals(std::string_view acknowledgement, std::string_view program) {
  received_signal = 0;
  const std::array<int, 3> signals{SIGINT, SIGTERM, SIGHUP};
  for (std::size_t i = 0; i < signals.size(); ++i) {
    Acknowledgement& a = acknowledgements[i];
    a.signal = signals[i];
    a.size = 0;
    if (acknowledgement.empty()) continue;
    // Starts on a line of its own: the progress line may be half written.
    const std::string text = fmt::format("\n{}: {} received: {}\n", program, name(signals[i]), acknowledgement);
    a.size = std::min(text.size(), sizeof a.text);
    std::copy_n(text.data(), a.size, a.text);
  }
  struct sigaction sa {};
  sa.sa_handler = record_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_RESETHAND;  // a second signal: the default action, at once
  sigaction(SIGINT, &sa, &old_int_);
  sigaction(SIGTERM, &sa, &old_term_);
  sigaction(SIGHUP, &sa, &old_hup_);
}

StopSignals::~StopSignals() {
  sigaction(SIGINT, &old_int_, nullptr);
  sigaction(SIGTERM, &old_term_, nullptr);
  sigaction(SIGHUP, &old_hup_, nullptr);
  for (Acknowledgement& a : acknowledgements) a.size = 0;
}

int StopSignals::received() noexcept {
  return received_signal;
}

std::string StopSignals::name(int signal) {
  // The three stop signals by the names the first-use tuner gives them too; another by number.
  if (signal == SIGINT || signal == SIGTERM || signal == SIGHUP) return ops::TuneStopSignals::name(signal);
  return fmt::format("signal {}", signal);
}

double LoopPosition::recent_loss() const {
  if (recent.empty()) return 0;
  return std::accumulate(recent.begin(), recent.end(), 0.0) / static_cast<double>(recent.size());
}

TrainingLoop::TrainingLoop(Trainer& trainer, BatchSource& batches, TrainingLoopOptions options)
    : trainer_(trainer), batches_(batches), options_(std::move(options)), progress_tty_(isatty(STDERR_FILENO) != 0) {
  if (options_.steps == 0) throw std::invalid_argument("training loop: the run needs at least one step");
  if (options_.steps_per_epoch != 0 && options_.steps % options_.steps_per_epoch != 0) {
    throw std::invalid_argument(fmt::format(
        "training loop: {} steps are not whole epochs of {} steps: give steps as epochs times steps_per_epoch (e.g. "
        "{}), or steps_per_epoch 0 for a run without epochs",
        options_.steps, options_.steps_per_epoch,
        std::max<std::uint64_t>(1, options_.steps / options_.steps_per_epoch) * options_.steps_per_epoch));
  }
  // Each step is one micro-batch: fewer than a group of them would update nothing.
  if (const std::uint32_t group = trainer.options().accumulate; options_.steps < group) {
    throw std::invalid_argument(fmt::format(
        "training loop: {} steps with accumulation over {} micro-batches (TrainerOptions::accumulate) would update "
        "nothing: each step is one micro-batch; run at least {} steps, or accumulate fewer",
        options_.steps, group, group));
  }
  if (!std::isfinite(options_.rank_timeout_seconds) || options_.rank_timeout_seconds < 0) {
    throw std::invalid_argument(fmt::format(
        "training loop: rank_timeout_seconds is {}: give a finite number of seconds > 0, or 0 to wait forever",
        options_.rank_timeout_seconds));
  }
  if (!std::isfinite(options_.max_seconds) || options_.max_seconds < 0) {
    throw std::invalid_argument(
        fmt::format("training loop: max_seconds is {}: give a finite number of seconds > 0, or 0 for no time limit",
                    options_.max_seconds));
  }
  if (options_.schedule) options_.schedule->validate();
  if (options_.units_per_step == 0) options_.units_per_step = trainer.options().batch;
}

void TrainingLoop::resume(const LoopPosition& position) {
  if (position.done > options_.steps) {
    throw std::invalid_argument(
        fmt::format("training loop: cannot resume at step {} of a run of {}", position.done, options_.steps));
  }
  position_ = position;
}

bool TrainingLoop::on_any_rank(bool here) const {
  double any = here ? 1.0 : 0.0;
  if (options_.control) options_.control->allreduce_sum(std::span<double>(&any, 1));
  return any > 0;
}

void TrainingLoop::check_ranks_agree() const {
  if (!options_.control) return;
  const auto bits = [](double d) { return std::bit_cast<std::uint64_t>(d); };
  const LrSchedule schedule = options_.schedule.value_or(LrSchedule{});
  struct Field {
    const char* what;
    std::uint64_t value;
    bool real = false;  // `value` holds a double's bits
  };
  // Every rank gathers every field, in this order, whatever its values: the same collectives.
  const Field fields[] = {
      {"the run's steps (ferry train --steps; --epochs, --train-limit and --batch)", options_.steps},
      {"the steps of an epoch (--train-limit, --batch)", options_.steps_per_epoch},
      {"the steps between boundaries (--eval-every)", options_.boundary_every},
      {"the time limit in seconds (--max-minutes)", bits(options_.max_seconds), true},
      {"whether a learning-rate schedule is set", options_.schedule.has_value()},
      {"the schedule's kind (--schedule; 0 constant, 1 cosine)", static_cast<std::uint64_t>(schedule.kind)},
      {"the schedule's peak learning rate (--lr)", bits(schedule.peak), true},
      {"the schedule's length in steps", schedule.total_steps},
      {"the schedule's warm-up steps", schedule.warmup_steps},
      {"the schedule's floor", bits(schedule.min_lr), true},
      {"whether checkpoints are written (--checkpoint)", !options_.checkpoint.empty()},
      {"the step the run starts from (--resume)", position_.done},
      {"the training data (--data, --text: a hash of what each rank read)", options_.data_fingerprint},
  };
  for (const Field& f : fields) {
    const std::vector<std::uint64_t> all = options_.control->allgather(f.value);
    const auto other = std::find_if(all.begin(), all.end(), [&](std::uint64_t v) { return v != all[0]; });
    if (other == all.end()) continue;
    const auto text = [&](std::uint64_t v) {
      return f.real ? fmt::format("{}", std::bit_cast<double>(v)) : fmt::format("{}", v);
    };
    throw std::invalid_argument(fmt::format(
        "the {} ranks of this data-parallel run disagree on {}: rank {} has {}, rank 0 {}; nothing was trained: start "
        "every rank with the same command and data (the ranks would wait for each other forever, or drift apart)",
        all.size(), f.what, other - all.begin(), text(*other), text(all[0])));
  }
}

bool TrainingLoop::stop_requested() const {
  return on_any_rank(options_.catch_signals && StopSignals::received() != 0);
}

std::string TrainingLoop::stop_acknowledgement() const {
  std::string then = "no checkpoint is written";
  if (!options_.checkpoint.empty()) {
    then = options_.write_checkpoints ? fmt::format("then checkpoint {} is written", options_.checkpoint.string())
                                      : std::string("then the checkpoint is written");
  }
  return fmt::format(
      "stopping once the step (or evaluation) in flight ends, {}; a second signal stops at once, saving nothing", then);
}

bool TrainingLoop::time_up() const {
  return on_any_rank(seconds_since(run_start_) > options_.max_seconds);
}

bool TrainingLoop::scheduled_boundary(std::uint64_t done) const {
  return done == options_.steps || (options_.steps_per_epoch != 0 && done % options_.steps_per_epoch == 0) ||
         (options_.boundary_every != 0 && done % options_.boundary_every == 0);
}

bool TrainingLoop::boundary_after(std::uint64_t done) {
  bool due = scheduled_boundary(done);
  // Asked at the same steps on every rank (one agreement each), whatever else is due.
  if (options_.max_seconds > 0 && time_up()) out_of_time_ = due = true;
  return due;
}

std::unique_ptr<OutputLock> TrainingLoop::check_checkpoint_path() const {
  if (options_.checkpoint.empty()) return nullptr;  // (the ranks agree on that; on which write, not)
  std::unique_ptr<OutputLock> lock;
  std::string problem;
  try {
    if (options_.write_checkpoints) {
      ferry::check_checkpoint_path(options_.checkpoint);  // a folder that exists, a name it takes, a file it can hold
      refuse_to_replace(options_.checkpoint, "checkpoint", std::string_view(checkpoint_magic, 8),
                        options_.checkpoint_options.replace_foreign_file);
      lock = std::make_unique<OutputLock>(options_.checkpoint, "checkpoint");  // held while this run writes it
    }
  } catch (const std::exception& e) {
    problem = e.what();
  }
  if (options_.control && options_.control->size() > 1) {
    // On every rank alike: a rank that refused alone would leave the others waiting in a collective.
    const std::vector<std::uint64_t> refused = options_.control->allgather(std::uint64_t{!problem.empty()});
    const auto first = std::find(refused.begin(), refused.end(), 1u);
    if (problem.empty() && first != refused.end()) {
      problem = fmt::format("rank {} cannot write its checkpoint (its error says why)", first - refused.begin());
    }
  }
  if (!problem.empty()) throw std::runtime_error(problem + " (checked before the first step: nothing was trained)");
  return lock;
}

void TrainingLoop::check_checkpoint_space() const {
  if (options_.checkpoint.empty()) return;  // (the ranks agree on that)
  std::uint64_t need = 0;
  if (options_.write_checkpoints) {
    need = trainer_.checkpoint_bytes();
    if (options_.caller_section) need += options_.caller_section(position_).size();
    // A boundary before the run's last: more than one checkpoint is written (checkpoints_need).
    const auto boundary_before_end = [&](std::uint64_t every) {
      return every != 0 && (position_.done / every + 1) * every < options_.steps;
    };
    if (boundary_before_end(options_.steps_per_epoch) || boundary_before_end(options_.boundary_every)) {
      std::error_code ec;
      const std::uint64_t there = std::filesystem::is_regular_file(options_.checkpoint, ec)
                                      ? std::filesystem::file_size(options_.checkpoint, ec)
                                      : 0;
      need = checkpoints_need(need, ec ? 0 : there);
    }
  }
  ferry::check_checkpoint_space(options_.checkpoint, need, options_.control.get());
}

LoopSummary TrainingLoop::run() {
  // First: the agreements below are collectives a stopped rank would hold up too.
  std::optional<RankWatchdog> watchdog;
  if (options_.control && options_.control->size() > 1 && options_.rank_timeout_seconds > 0) {
    watchdog.emplace(std::chrono::duration<double>(options_.rank_timeout_seconds),
                     [this](double idle, std::uint64_t done) { ranks_timed_out(idle, done); });
    watchdog->beat(position_.done);
  }
  watchdog_ = watchdog ? &*watchdog : nullptr;
  const struct Unwatch {
    RankWatchdog*& watchdog;
    ~Unwatch() { watchdog = nullptr; }
  } unwatch{watchdog_};
  check_ranks_agree();
  const std::unique_ptr<OutputLock> checkpoint_lock = check_checkpoint_path();
  check_checkpoint_space();
  std::optional<StopSignals> signals;
  if (options_.catch_signals) signals.emplace(options_.acknowledge_stop ? stop_acknowledgement() : std::string());
  summary_ = LoopSummary{};
  step_ms_sum_ = 0;
  out_of_time_ = false;
  progress_decile_ = -1;
  run_start_ = mark_ = Clock::now();
  std::optional<InFlight> in_flight;
  std::uint64_t submitted = position_.done;
  const std::uint64_t first = submitted;
  const auto take = [&] { return *std::exchange(in_flight, std::nullopt); };
  try {
    while (true) {
      if (stop_requested()) {
        // The step in flight finishes; when it ends an epoch (or another scheduled boundary), that
        // boundary's report and checkpoint come first, and the checkpoint is not written twice.
        const bool boundary = in_flight && scheduled_boundary(submitted);
        // No step in flight after this run's first: the loop has just read one at a boundary,
        // which wrote its checkpoint (a stop during evaluation or that write lands here).
        const bool boundary_just_written = !in_flight && submitted != first;
        if (in_flight) read(take(), boundary);
        summary_.end = LoopSummary::End::stopped;
        summary_.signal = StopSignals::received() != 0 ? StopSignals::received() : SIGTERM;  // else another rank's
        if (!options_.checkpoint.empty()) {
          if (!boundary && !boundary_just_written) checkpoint_here();
          summary_.checkpoint_written = options_.write_checkpoints;
        }
        break;
      }
      if (submitted == options_.steps) {
        if (in_flight) read(take(), true);
        // A signal during the last boundary (its evaluation, its checkpoint) ends the run as
        // stopped all the same: the caller exits as a signal asks, with nothing left to resume.
        if (stop_requested()) {
          summary_.end = LoopSummary::End::stopped;
          summary_.signal = StopSignals::received() != 0 ? StopSignals::received() : SIGTERM;
          summary_.checkpoint_written = !options_.checkpoint.empty() && options_.write_checkpoints;
          summary_.every_step_done = true;
        }
        break;
      }
      // Never a step in flight across a boundary: it sees the state of exactly `done` steps.
      if (in_flight && boundary_after(submitted)) {
        read(take(), true);
        if (out_of_time_) {
          summary_.end = LoopSummary::End::out_of_time;
          break;
        }
        continue;
      }
      // The schedule counts optimizer updates: a group of `accumulate` micro-batches is one, so
      // k micro-batches of B train with the rates one batch of k * B would.
      if (options_.schedule) trainer_.set_lr(options_.schedule->at(submitted / trainer_.options().accumulate));
      const StepHandle handle = trainer_.submit(batches_.next());  // staged: the source's views are free again
      const std::optional<InFlight> previous = std::exchange(in_flight, InFlight{handle, submitted++});
      if (previous) read(*previous, false);
    }
  } catch (...) {
    // Settle the step in flight, so that the trainer has none pending. After a failed step it fails
    // too; after a callback that threw (on_step, on_boundary, caller_section) it trained, and the
    // position counts it (no callback sees it): a run() after this goes on from the trainer's steps,
    // where it had trained one more than it counted.
    if (in_flight) {
      try {
        count_step(trainer_.result(in_flight->handle));
        close_epoch();
      } catch (const std::exception&) {
      }
    }
    end_progress_line();
    throw;
  }
  end_progress_line();  // the caller's reports come next
  summary_.position = position_;
  const std::uint64_t run = summary_.steps_run;
  summary_.mean_step_ms = run > 1 ? step_ms_sum_ / static_cast<double>(run - 1) : summary_.first_step_ms;
  if (summary_.run_train_seconds > 0) {
    summary_.units_per_second = static_cast<double>(run * options_.units_per_step) / summary_.run_train_seconds;
  }
  return summary_;
}

void TrainingLoop::ranks_timed_out(double idle_seconds, std::uint64_t steps_done) const {
  std::cerr << fmt::format(
      "\nferry: rank {}: no step has finished for {:.0f} s ({} of the run's {} steps done): another rank has likely "
      "stopped or hung (a stopped process, a lost host), leaving this one waiting in a collective; ending every rank "
      "of the run with status 124. The last checkpoint written is intact. (The limit: "
      "TrainingLoopOptions::rank_timeout_seconds, ferry train --rank-timeout-minutes; 0 waits forever.)\n",
      options_.control->rank(), idle_seconds, steps_done, options_.steps);
  options_.control->abort(124);
  std::abort();  // (abort does not return)
}

void TrainingLoop::read(InFlight f, bool boundary) {
  const StepResult r = trainer_.result(f.handle);
  const std::uint64_t run_index = count_step(r);
  if (on_step) on_step(f.step, run_index, r);
  show_progress();  // (before close_epoch: its line shows the epoch's mean loss so far)
  close_epoch();
  if (boundary) at_boundary();
}

void TrainingLoop::close_epoch() {
  if (const std::uint64_t per_epoch = options_.steps_per_epoch; per_epoch != 0 && position_.done % per_epoch == 0) {
    position_.last_epoch_loss = position_.epoch_loss_sum / static_cast<double>(per_epoch);
    position_.epoch_loss_sum = 0;
  }
}

std::uint64_t TrainingLoop::count_step(const StepResult& r) {
  if (watchdog_) watchdog_->beat(position_.done + 1);
  const auto now = Clock::now();
  const double seconds = std::chrono::duration<double>(now - mark_).count();
  mark_ = now;
  position_.train_seconds += seconds;
  summary_.run_train_seconds += seconds;
  ++position_.done;
  const std::uint64_t run_index = summary_.steps_run++;
  if (run_index == 0) {
    summary_.first_step_ms = r.step_ms;  // one-off costs: left out of the mean and the progress line's pace
    paced_from_ = now;
    paced_train_seconds_ = summary_.run_train_seconds;
  } else {
    step_ms_sum_ += r.step_ms;
  }
  position_.epoch_loss_sum += r.loss;
  position_.recent.push_back(r.loss);
  if (position_.recent.size() > LoopPosition::recent_losses) position_.recent.erase(position_.recent.begin());
  return run_index;
}

void TrainingLoop::end_progress_line() {
  if (!progress_line_open_) return;
  std::cerr << "\n";  // what follows (a report, a checkpoint's line) starts a line of its own
  progress_line_open_ = false;
}

void TrainingLoop::at_boundary() {
  const auto start = Clock::now();
  end_progress_line();
  if (on_boundary) on_boundary(position_);
  position_.boundary_seconds += seconds_since(start);
  if (watchdog_) watchdog_->beat(position_.done);  // each part of a boundary has the whole limit
  if (!options_.checkpoint.empty()) checkpoint_here();
  if (watchdog_) watchdog_->beat(position_.done);
  mark_ = Clock::now();  // evaluation and checkpoints are not training time
}

void TrainingLoop::checkpoint_here() {
  if (options_.write_checkpoints) {
    save_checkpoint();
  } else {
    trainer_.contribute_to_checkpoint();  // rank 0's file may need this rank's gradient sums
  }
}

void TrainingLoop::save_checkpoint() {
  const auto start = Clock::now();
  const std::vector<std::byte> caller =
      options_.caller_section ? options_.caller_section(position_) : std::vector<std::byte>{};
  try {
    // This run holds the path's lock (check_checkpoint_path) for as long as it runs.
    TrainerInternals::save_checkpoint_locked_by_caller(trainer_, options_.checkpoint, caller,
                                                       options_.checkpoint_options);
  } catch (const std::exception& e) {
    // What the file at the path holds now, for the caller's way back (the CLI's resume command).
    throw CheckpointWriteError(e.what(), checkpoint_done_);
  }
  checkpoint_done_ = position_.done;
  if (options_.after_checkpoint) options_.after_checkpoint();
  const double seconds = seconds_since(start);
  summary_.checkpoint_seconds += seconds;
  if (options_.progress) {
    end_progress_line();
    std::cerr << fmt::format("ferry: checkpoint {} ({}, {:.0f} ms)\n", options_.checkpoint.string(),
                             format_bytes(std::filesystem::file_size(options_.checkpoint)), seconds * 1e3);
  }
}

// "epoch 2/10 [#########...............]  38%  loss 0.4120  5301 samples/s  ETA 0:00:41", redrawn
// in place on a terminal, one line per tenth otherwise; "-- samples/s  ETA -:--:--" after the
// run's first step.
void TrainingLoop::show_progress() {
  if (!options_.progress) return;
  const std::uint64_t done = position_.done;
  const std::uint64_t per_epoch = options_.steps_per_epoch;
  std::string what;
  std::uint64_t part_done = done, part_total = options_.steps;
  double loss = position_.recent_loss();
  if (per_epoch != 0) {
    what = fmt::format("epoch {}/{}", (done - 1) / per_epoch + 1, options_.steps / per_epoch);
    part_done = (done - 1) % per_epoch + 1;
    part_total = per_epoch;
    loss = position_.epoch_loss_sum / static_cast<double>(part_done);
  } else {
    what = fmt::format("step {}/{}", done, options_.steps);
  }
  const double frac = static_cast<double>(part_done) / static_cast<double>(part_total);
  const int decile = static_cast<int>(frac * 10);
  if (!progress_tty_ && decile == progress_decile_ && part_done != part_total) return;
  progress_decile_ = decile;
  // The pace of the steps after this run's first (whose kernel builds and first touches made the
  // quick start's first line say 6 samples/s and 2:37:05 left of a 4-minute run), and the time
  // left at it, evaluation and checkpoints included (training time alone promised 0:00:00 for
  // most of a run that spends its time on reports). Unknown after one step.
  std::string pace = fmt::format("-- {}/s  ETA -:--:--", options_.unit);
  if (const std::uint64_t paced = summary_.steps_run - 1; paced > 0) {
    const double train_s = summary_.run_train_seconds - paced_train_seconds_;
    const double rate = train_s > 0 ? static_cast<double>(paced * options_.units_per_step) / train_s : 0;
    const double eta =
        seconds_since(paced_from_) / static_cast<double>(paced) * static_cast<double>(options_.steps - done);
    pace = fmt::format("{:.0f} {}/s  ETA {}", rate, options_.unit, format_duration(eta));
  }
  constexpr int width = 24;
  const int filled = static_cast<int>(frac * width);
  const std::string bar = std::string(filled, '#') + std::string(width - filled, '.');
  std::cerr << fmt::format("{}{} [{}] {:3.0f}%  loss {:.4f}  {}{}", progress_tty_ ? "\r" : "", what, bar, frac * 100,
                           loss, pace, progress_tty_ ? "\033[K" : "\n");
  progress_line_open_ = progress_tty_;
  if (part_done == part_total) end_progress_line();
}

}  // namespace ferry
