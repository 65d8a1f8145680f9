// TrainingLoop: the same steps as a hand-written loop bit for bit, boundaries with no step in
// flight, a stop on a signal that writes a checkpoint the run resumes from exactly, the time limit,
// a failing step that leaves the trainer usable, and bad settings refused.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ferry/ferry.hpp"
#include "runtime/rank_watchdog.hpp"
#include "test_models.hpp"
#include "test_support.hpp"
#include "trainer_state.hpp"

namespace ferry::test {
namespace {

// 100 random 28 x 28 samples: 12 batches of 8 an epoch.
Dataset random_data() {
  Dataset d;
  d.rows = d.cols = 28;
  d.count = 100;
  d.images = random_vector(d.count * 784, 11, 0.0f, 1.0f);
  d.labels = labels_for(d.count, 12);
  return d;
}

TrainerOptions options() {
  TrainerOptions o;
  o.batch = 8;
  o.lr = 0.01f;
  return o;
}

LrSchedule cosine(std::uint64_t steps) {
  return LrSchedule{.kind = LrSchedule::Kind::cosine, .peak = 0.01f, .total_steps = steps};
}

// A batch source that raises `signal` at its `at`-th batch (from 0), like a user's Ctrl-C.
class SignalAt final : public BatchSource {
 public:
  SignalAt(BatchSource& inner, int at, int signal) : inner_(inner), at_(at), signal_(signal) {}
  const Batch& next() override {
    if (calls_++ == at_) std::raise(signal_);
    return inner_.next();
  }

 private:
  BatchSource& inner_;
  int at_, signal_, calls_ = 0;
};

class TrainingLoopTest : public ::testing::Test {
 protected:
  Runtime rt;
  const Dataset data = random_data();
  const ModelSpec model = models::mlp({16});
};

// Two epochs through the loop give the losses and the state of Trainer::step over the same
// batches with the same learning rates; each epoch ends at a boundary with no step in flight.
TEST_F(TrainingLoopTest, GivesWhatAHandWrittenLoopGivesBitForBit) {
  Trainer by_hand(rt, model, options());
  ShuffledBatches hand_batches(data, by_hand.model(), 8, 5);
  const std::uint64_t per_epoch = hand_batches.steps_per_epoch();
  const std::uint64_t steps = 2 * per_epoch;
  std::vector<float> expected;
  for (std::uint64_t s = 0; s < steps; ++s) {
    by_hand.set_lr(cosine(steps).at(s));
    expected.push_back(by_hand.step(hand_batches.next()).loss);
  }

  Trainer looped(rt, model, options());
  ShuffledBatches batches(data, looped.model(), 8, 5);
  TrainingLoop loop(looped, batches,
                    {.steps = steps, .steps_per_epoch = per_epoch, .schedule = cosine(steps), .progress = false});
  std::vector<float> got;
  std::vector<std::uint64_t> boundaries;
  std::vector<double> epoch_losses;
  loop.on_step = [&](std::uint64_t step, std::uint64_t run_index, const StepResult& r) {
    EXPECT_EQ(step, got.size());
    EXPECT_EQ(run_index, got.size());
    got.push_back(r.loss);
  };
  loop.on_boundary = [&](const LoopPosition& p) {
    EXPECT_EQ(looped.pending(), 0u) << "a step in flight across a boundary";
    EXPECT_EQ(looped.steps_done(), p.done);
    boundaries.push_back(p.done);
    epoch_losses.push_back(p.last_epoch_loss);
  };
  const LoopSummary summary = loop.run();
  EXPECT_EQ(summary.end, LoopSummary::End::finished);
  EXPECT_EQ(summary.steps_run, steps);
  EXPECT_EQ(summary.position.done, steps);
  EXPECT_EQ(got, expected);
  EXPECT_EQ(boundaries, (std::vector<std::uint64_t>{per_epoch, steps}));
  ASSERT_EQ(epoch_losses.size(), 2u);
  double first_epoch = 0;
  for (std::uint64_t s = 0; s < per_epoch; ++s) first_epoch += expected[s];
  EXPECT_DOUBLE_EQ(epoch_losses[0], first_epoch / static_cast<double>(per_epoch));
  EXPECT_GT(summary.run_train_seconds, 0);
  EXPECT_GT(summary.units_per_second, 0);
  EXPECT_TRUE(tensors_of(looped) == tensors_of(by_hand)) << "the training state differs";
}

// A schedule counts optimizer updates: k micro-batches of b through the loop train what a loop of
// batches of k * b trains over the same samples, with the same rate for each update (to float
// rounding: the sums are taken in another order). It counted micro-batches, so the cosine ran
// about an update ahead and the weights differed by far more than rounding.
TEST_F(TrainingLoopTest, ItsScheduleCountsUpdatesUnderAccumulation) {
  TrainerOptions micro_options = options();
  micro_options.accumulate = 2;
  Trainer micro(rt, model, micro_options);
  TrainerOptions large_options = options();
  large_options.batch = 16;
  Trainer large(rt, model, large_options);
  // One epoch: 6 batches of 16 read the shuffled order's first 96 samples, as 12 batches of 8 do.
  ShuffledBatches micro_batches(data, micro.model(), 8, 5), large_batches(data, large.model(), 16, 5);
  const std::uint64_t updates = large_batches.steps_per_epoch();
  ASSERT_EQ(micro_batches.steps_per_epoch(), 2 * updates);
  EXPECT_EQ(updates_in(2 * updates, 2), updates);
  const auto run = [&](Trainer& t, BatchSource& b, std::uint64_t steps) {
    TrainingLoop(t, b, {.steps = steps, .schedule = cosine(updates), .progress = false}).run();
  };
  run(micro, micro_batches, 2 * updates);
  run(large, large_batches, updates);
  EXPECT_EQ(micro.steps_done(), large.steps_done());
  for (const auto& name : large.parameter_names()) {
    const auto a = micro.read_parameter(name), b = large.read_parameter(name);
    for (std::size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-5) << name << "[" << i << "]";
  }
}

// SIGINT mid-epoch: the loop finishes the step in flight, writes a checkpoint, and says so; a new
// trainer that loads it and resumes from the position ends where an uninterrupted run ends.
TEST_F(TrainingLoopTest, StopsOnASignalWithACheckpointTheRunResumesFromExactly) {
  const auto path = std::filesystem::temp_directory_path() / ("ferry_loop_" + std::to_string(::getpid()) + ".ckpt");
  const std::uint64_t steps = 24;

  Trainer whole(rt, model, options());
  ShuffledBatches whole_batches(data, whole.model(), 8, 3);
  TrainingLoop whole_loop(whole, whole_batches,
                          {.steps = steps, .steps_per_epoch = 12, .schedule = cosine(steps), .progress = false});
  const LoopSummary uninterrupted = whole_loop.run();

  struct sigaction before {};
  sigaction(SIGINT, nullptr, &before);
  LoopPosition stopped_at;
  std::vector<std::size_t> order;
  std::ostringstream engine;
  {
    Trainer first(rt, model, options());
    ShuffledBatches batches(data, first.model(), 8, 3);
    SignalAt interrupt(batches, 7, SIGINT);  // while step 7's batch is drawn: steps 0..7 run
    TrainingLoop loop(
        first, interrupt,
        {.steps = steps, .steps_per_epoch = 12, .schedule = cosine(steps), .progress = false, .checkpoint = path});
    const LoopSummary s = loop.run();
    EXPECT_EQ(s.end, LoopSummary::End::stopped);
    EXPECT_EQ(s.signal, SIGINT);
    EXPECT_TRUE(s.checkpoint_written);
    EXPECT_EQ(s.position.done, 8u);
    EXPECT_EQ(first.pending(), 0u);
    stopped_at = s.position;
    order.assign(batches.order().begin(), batches.order().end());
    engine << batches.engine();
  }
  struct sigaction after {};
  sigaction(SIGINT, nullptr, &after);
  EXPECT_EQ(after.sa_handler, before.sa_handler) << "the loop left its handler installed";

  Trainer resumed(rt, model, options());
  resumed.load_checkpoint(path);
  std::filesystem::remove(path);
  EXPECT_EQ(resumed.steps_done(), 8u);
  ShuffledBatches batches(data, resumed.model(), 8, 3);
  batches.set_order(order);
  std::istringstream(engine.str()) >> batches.engine();
  batches.seek(8);
  TrainingLoop loop(resumed, batches,
                    {.steps = steps, .steps_per_epoch = 12, .schedule = cosine(steps), .progress = false});
  loop.resume(stopped_at);
  const LoopSummary rest = loop.run();
  EXPECT_EQ(rest.end, LoopSummary::End::finished);
  EXPECT_EQ(rest.steps_run, steps - 8);
  EXPECT_EQ(rest.position.last_epoch_loss, uninterrupted.position.last_epoch_loss);
  EXPECT_EQ(rest.position.recent, uninterrupted.position.recent);
  EXPECT_TRUE(tensors_of(resumed) == tensors_of(whole)) << "the resumed run's state differs";
}

// A signal while the last step of an epoch is in flight: that epoch's boundary (its report and
// checkpoint) comes first, and the stop writes no second checkpoint.
TEST_F(TrainingLoopTest, AStopAtAnEpochsEndKeepsThatBoundary) {
  const auto path = std::filesystem::temp_directory_path() / ("ferry_loop_end_" + std::to_string(::getpid()) + ".ckpt");
  Trainer trainer(rt, model, options());
  ShuffledBatches batches(data, trainer.model(), 8, 3);
  SignalAt interrupt(batches, 11, SIGTERM);  // while the epoch's last batch (11 of 0..11) is drawn
  TrainingLoop loop(trainer, interrupt, {.steps = 24, .steps_per_epoch = 12, .progress = false, .checkpoint = path});
  std::vector<std::uint64_t> boundaries;
  loop.on_boundary = [&](const LoopPosition& p) { boundaries.push_back(p.done); };
  const LoopSummary s = loop.run();
  EXPECT_EQ(s.end, LoopSummary::End::stopped);
  EXPECT_EQ(s.signal, SIGTERM);
  EXPECT_EQ(s.position.done, 12u);
  EXPECT_EQ(boundaries, (std::vector<std::uint64_t>{12}));
  EXPECT_TRUE(s.checkpoint_written);
  EXPECT_TRUE(std::filesystem::exists(path));
  EXPECT_GT(s.position.last_epoch_loss, 0.0);
  EXPECT_EQ(s.position.epoch_loss_sum, 0.0);
  std::filesystem::remove(path);
}

// A stop that arrives during a boundary's evaluation (or its checkpoint's write) ends the run there
// with that boundary's checkpoint, written once: it was written a second time.
TEST_F(TrainingLoopTest, AStopDuringABoundaryWritesItsCheckpointOnce) {
  const auto path =
      std::filesystem::temp_directory_path() / ("ferry_loop_eval_" + std::to_string(::getpid()) + ".ckpt");
  Trainer trainer(rt, model, options());
  ShuffledBatches batches(data, trainer.model(), 8, 3);
  int written = 0;
  TrainingLoop loop(
      trainer, batches,
      {.steps = 24, .steps_per_epoch = 12, .progress = false, .checkpoint = path, .after_checkpoint = [&] {
         ++written;
       }});
  // As a user's Ctrl-C mid-evaluation. The handler acknowledges it at once: an evaluation can take
  // minutes, and silence until it ends invited a second Ctrl-C, which saves nothing.
  std::string said_during_evaluation;
  loop.on_boundary = [&](const LoopPosition&) {
    testing::internal::CaptureStderr();
    std::raise(SIGINT);
    said_during_evaluation = testing::internal::GetCapturedStderr();
  };
  const LoopSummary s = loop.run();
  EXPECT_EQ(s.end, LoopSummary::End::stopped);
  EXPECT_EQ(s.position.done, 12u);
  EXPECT_TRUE(s.checkpoint_written);
  EXPECT_EQ(written, 1) << "the boundary's checkpoint was written again at the stop";
  EXPECT_EQ(said_during_evaluation,
            fmt::format("\nferry: SIGINT received: stopping once the step (or evaluation) in flight ends, then "
                        "checkpoint {} is written; a second signal stops at once, saving nothing\n",
                        path.string()));
  std::filesystem::remove(path);

  // Unasked (acknowledge_stop false) the handler writes nothing; with no checkpoint it says none.
  for (const bool acknowledge : {false, true}) {
    TrainingLoop quiet(trainer, batches,
                       {.steps = 4, .boundary_every = 2, .progress = false, .acknowledge_stop = acknowledge});
    std::string said;
    quiet.on_boundary = [&](const LoopPosition&) {
      testing::internal::CaptureStderr();
      std::raise(SIGTERM);
      said = testing::internal::GetCapturedStderr();
    };
    EXPECT_EQ(quiet.run().end, LoopSummary::End::stopped);
    EXPECT_EQ(said, acknowledge ? "\nferry: SIGTERM received: stopping once the step (or evaluation) in flight ends, "
                                  "no checkpoint is written; a second signal stops at once, saving nothing\n"
                                : "");
  }
}

// A signal during the last step's boundary (the final evaluation, the last checkpoint): every step is
// done and the checkpoint holds them, and the run still ends as stopped, so that the caller exits as
// the signal asks (it had finished as though no signal came: exit status 0).
TEST_F(TrainingLoopTest, ASignalDuringTheLastBoundaryEndsTheRunStoppedWithEveryStepDone) {
  const auto path =
      std::filesystem::temp_directory_path() / ("ferry_loop_last_" + std::to_string(::getpid()) + ".ckpt");
  Trainer trainer(rt, model, options());
  ShuffledBatches batches(data, trainer.model(), 8, 3);
  int written = 0;
  TrainingLoop loop(trainer, batches,
                    {.steps = 8, .steps_per_epoch = 4, .progress = false, .checkpoint = path, .after_checkpoint = [&] {
                       ++written;
                     }});
  loop.on_boundary = [&](const LoopPosition& p) {
    if (p.done != 8) return;
    testing::internal::CaptureStderr();
    std::raise(SIGINT);
    testing::internal::GetCapturedStderr();
  };
  const LoopSummary s = loop.run();
  EXPECT_EQ(s.end, LoopSummary::End::stopped);
  EXPECT_EQ(s.signal, SIGINT);
  EXPECT_TRUE(s.every_step_done);
  EXPECT_EQ(s.position.done, 8u);
  EXPECT_TRUE(s.checkpoint_written);
  EXPECT_EQ(written, 2) << "each epoch's checkpoint once, the last not again at the stop";
  EXPECT_EQ(trainer.steps_done(), 8u);
  std::filesystem::remove(path);
}

// A checkpoint that cannot be written (a file size limit: EFBIG, as on a full disk) ends the run with
// CheckpointWriteError, and the file at the path is still the last one this loop wrote, whose
// steps the error gives (the CLI's resume command goes on from it).
TEST_F(TrainingLoopTest, ACheckpointThatCannotBeWrittenLeavesTheLastOneAndSaysWhichItIs) {
  const auto path =
      std::filesystem::temp_directory_path() / ("ferry_loop_full_" + std::to_string(::getpid()) + ".ckpt");
  Trainer trainer(rt, model, options());
  ShuffledBatches batches(data, trainer.model(), 8, 3);
  TrainingLoop loop(trainer, batches, {.steps = 36, .steps_per_epoch = 12, .progress = false, .checkpoint = path});
  struct rlimit before {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &before), 0);
  const auto ignored_before = std::signal(SIGXFSZ, SIG_IGN);  // the write fails with EFBIG instead
  std::string first_bytes;
  loop.on_boundary = [&](const LoopPosition& p) {
    if (p.done != 24) return;
    // The first checkpoint (after 12 steps) was written: the second cannot be.
    std::ifstream in(path, std::ios::binary);
    first_bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    struct rlimit small = before;
    small.rlim_cur = first_bytes.size() / 2;
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  };
  std::optional<std::uint64_t> intact;
  std::string what;
  try {
    loop.run();
  } catch (const CheckpointWriteError& e) {
    intact = e.intact_done;
    what = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &before);
  std::signal(SIGXFSZ, ignored_before);
  ASSERT_TRUE(intact.has_value()) << "the second checkpoint's failure was not a CheckpointWriteError: " << what;
  EXPECT_EQ(*intact, 12u);
  EXPECT_NE(what.find("any earlier checkpoint at that path is unchanged"), std::string::npos) << what;
  std::ifstream in(path, std::ios::binary);
  const std::string now((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_FALSE(first_bytes.empty());
  EXPECT_TRUE(now == first_bytes) << "the checkpoint at the path changed";
  EXPECT_EQ(trainer.pending(), 0u);
  std::filesystem::remove(path);
}

// A checkpoint path the loop cannot write was found only when the first checkpoint was written,
// after an epoch of training; now before the first step, and a file ferry did not write is left
// as it is unless WriteOptions::replace_foreign_file.
TEST_F(TrainingLoopTest, ACheckpointPathThatCannotBeWrittenIsRefusedBeforeTheFirstStep) {
  const auto folder = std::filesystem::temp_directory_path() / ("ferry_loop_path_" + std::to_string(::getpid()));
  std::filesystem::remove_all(folder);
  Trainer trainer(rt, model, options());
  ShuffledBatches batches(data, trainer.model(), 8, 3);
  const auto refusal = [&](const std::filesystem::path& path) {
    TrainingLoop loop(trainer, batches, {.steps = 12, .progress = false, .checkpoint = path});
    try {
      loop.run();
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("(not refused)");
  };
  std::string what = refusal(folder / "run.ckpt");
  EXPECT_NE(what.find("does not exist: create it first"), std::string::npos) << what;
  EXPECT_NE(what.find("checked before the first step: nothing was trained"), std::string::npos) << what;
  EXPECT_EQ(trainer.steps_done(), 0u);
  std::filesystem::create_directories(folder);
  const auto notes = folder / "notes.txt";
  std::ofstream(notes) << "a user's notes";
  what = refusal(notes);
  EXPECT_NE(what.find("is not a checkpoint ferry wrote"), std::string::npos) << what;
  EXPECT_EQ(trainer.steps_done(), 0u);
  std::ifstream in(notes);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()), "a user's notes");
  TrainingLoopOptions replace{.steps = 12, .progress = false, .checkpoint = notes};
  replace.checkpoint_options.replace_foreign_file = true;
  TrainingLoop(trainer, batches, replace).run();
  EXPECT_EQ(trainer.steps_done(), 12u);
  std::filesystem::remove_all(folder);
}

// Two runs given one checkpoint path at once both wrote it, each replacing the other's; the
// second is now refused before its first step, naming the first, and the lock goes with the run.
TEST_F(TrainingLoopTest, ACheckpointAnotherRunIsWritingIsRefused) {
  const auto path =
      std::filesystem::temp_directory_path() / ("ferry_loop_lock_" + std::to_string(::getpid()) + ".ckpt");
  std::filesystem::remove(path);
  Trainer trainer(rt, model, options());
  ShuffledBatches batches(data, trainer.model(), 8, 3);
  TrainingLoop first(trainer, batches, {.steps = 24, .steps_per_epoch = 12, .progress = false, .checkpoint = path});
  std::string refused;
  first.on_boundary = [&](const LoopPosition& p) {
    if (p.done != 12) return;
    Trainer other(rt, model, options());
    ShuffledBatches other_batches(data, other.model(), 8, 3);
    TrainingLoop second(other, other_batches, {.steps = 12, .progress = false, .checkpoint = path});
    try {
      second.run();
    } catch (const std::runtime_error& e) {
      refused = e.what();
    }
    EXPECT_EQ(other.steps_done(), 0u);
  };
  first.run();
  EXPECT_NE(refused.find("is being written by another run (process " + std::to_string(::getpid()) + " on host"),
            std::string::npos)
      << refused;
  EXPECT_EQ(trainer.steps_done(), 24u);
  // Released: another run takes the path (its checkpoint, the first's, goes on).
  TrainingLoop later(trainer, batches, {.steps = 36, .steps_per_epoch = 12, .progress = false, .checkpoint = path});
  later.resume(LoopPosition{.done = 24});
  later.run();
  EXPECT_EQ(trainer.steps_done(), 36u);
  for (const auto& e : std::filesystem::directory_iterator(path.parent_path())) {
    EXPECT_EQ(e.path().filename().string().find(path.filename().string() + ".lock"), std::string::npos)
        << "left behind: " << e.path();
  }
  std::filesystem::remove(path);
}

// An epoch's last progress line (100%) shows the epoch's mean loss, which the epoch's summary
// gives too: counted before its line was drawn, the epoch had been closed and its line said 0.0000.
TEST_F(TrainingLoopTest, AnEpochsLastProgressLineShowsItsMeanLoss) {
  Trainer trainer(rt, model, options());
  ShuffledBatches batches(data, trainer.model(), 8, 3);
  TrainingLoop loop(trainer, batches, {.steps = 8, .steps_per_epoch = 4, .progress = true});
  std::vector<double> epoch_losses;
  loop.on_boundary = [&](const LoopPosition& p) { epoch_losses.push_back(p.last_epoch_loss); };
  testing::internal::CaptureStderr();
  loop.run();
  const std::string err = testing::internal::GetCapturedStderr();
  ASSERT_EQ(epoch_losses.size(), 2u);
  for (int epoch = 1; epoch <= 2; ++epoch) {
    const std::string head = fmt::format("epoch {}/2 [########################] 100%  loss ", epoch);
    const auto at = err.find(head);
    ASSERT_NE(at, std::string::npos) << err;
    EXPECT_EQ(err.substr(at + head.size(), 6), fmt::format("{:.4f}", epoch_losses[epoch - 1])) << err;
  }
}

// A callback that throws ends run() with its exception; the step in flight then has trained, and the
// loop counts it: a run() after that goes on from the trainer's steps (it had counted one fewer,
// trained one step more than asked and reported one fewer than it trained).
TEST_F(TrainingLoopTest, AStepInFlightWhenACallbackThrowsIsCounted) {
  Trainer trainer(rt, model, options());
  ShuffledBatches batches(data, trainer.model(), 8, 3);
  TrainingLoop loop(trainer, batches, {.steps = 8, .progress = false});
  std::vector<std::uint64_t> seen;
  bool thrown = false;
  loop.on_step = [&](std::uint64_t step, std::uint64_t, const StepResult&) {
    seen.push_back(step);
    if (step == 2 && !thrown) {
      thrown = true;
      throw std::runtime_error("the caller's own failure");
    }
  };
  EXPECT_THROW(loop.run(), std::runtime_error);
  EXPECT_EQ(trainer.pending(), 0u);
  EXPECT_EQ(trainer.steps_done(), 4u);  // steps 0-2 read, step 3 in flight
  const LoopSummary rest = loop.run();
  EXPECT_EQ(rest.position.done, 8u);
  EXPECT_EQ(rest.steps_run, 4u);
  EXPECT_EQ(trainer.steps_done(), 8u);
  EXPECT_EQ(seen, (std::vector<std::uint64_t>{0, 1, 2, 4, 5, 6, 7}));  // step 3's result was not read
}

// A time limit already spent ends the run at the first boundary it can take, after one step, with
// that boundary's evaluation; boundary_every adds boundaries between epochs.
TEST_F(TrainingLoopTest, EndsAtABoundaryWhenTheTimeIsUp) {
  Trainer trainer(rt, model, options());
  ShuffledBatches batches(data, trainer.model(), 8, 1);
  TrainingLoop out_of_time(trainer, batches, {.steps = 12, .max_seconds = 1e-9, .progress = false});
  int boundaries = 0;
  out_of_time.on_boundary = [&](const LoopPosition&) { ++boundaries; };
  const LoopSummary s = out_of_time.run();
  EXPECT_EQ(s.end, LoopSummary::End::out_of_time);
  EXPECT_EQ(s.steps_run, 1u);
  EXPECT_EQ(boundaries, 1);

  std::vector<std::uint64_t> at;
  TrainingLoop every(trainer, batches, {.steps = 10, .boundary_every = 4, .progress = false});
  every.on_boundary = [&](const LoopPosition& p) { at.push_back(p.done); };
  EXPECT_EQ(every.run().end, LoopSummary::End::finished);
  EXPECT_EQ(at, (std::vector<std::uint64_t>{4, 8, 10}));
}

// The progress line (one per tenth off a terminal) gives no pace after the run's first step, whose
// kernel builds and first touches once made it promise hours for a run of minutes, and the pace of
// the steps after it from then on.
TEST_F(TrainingLoopTest, TheProgressLinesPaceLeavesOutTheFirstStep) {
  Trainer trainer(rt, model, options());
  ShuffledBatches batches(data, trainer.model(), 8, 1);
  std::ostringstream err;
  std::streambuf* const was = std::cerr.rdbuf(err.rdbuf());
  try {
    TrainingLoop(trainer, batches, {.steps = 10, .progress = true}).run();
  } catch (...) {
    std::cerr.rdbuf(was);
    throw;
  }
  std::cerr.rdbuf(was);
  std::vector<std::string> lines;
  std::istringstream in(err.str());
  for (std::string line; std::getline(in, line);)
    if (line.starts_with("step ")) lines.push_back(line);
  ASSERT_GE(lines.size(), 2u) << err.str();
  EXPECT_TRUE(lines.front().starts_with("step 1/10 ")) << lines.front();
  EXPECT_TRUE(lines.front().ends_with("-- samples/s  ETA -:--:--")) << lines.front();
  EXPECT_TRUE(lines.back().starts_with("step 10/10 ")) << lines.back();
  EXPECT_EQ(lines.back().find("--"), std::string::npos) << lines.back();
  EXPECT_NE(lines.back().find(" samples/s  ETA 0:00:00"), std::string::npos) << lines.back();
}

// A batch the trainer refuses ends the loop with its error; the step in flight is settled, so the
// trainer has nothing pending and trains on.
TEST_F(TrainingLoopTest, AFailingStepLeavesTheTrainerUsable) {
  class NanAt final : public BatchSource {
   public:
    NanAt(BatchSource& inner, int at) : inner_(inner), at_(at) {}
    const Batch& next() override {
      const Batch& b = inner_.next();
      if (calls_++ != at_) return b;
      bad_ = b;
      images_.assign(8 * 784, 0.0f);
      images_[5] = std::nanf("");
      bad_.insert_or_assign("input", HostView(std::span<const float>(images_)));
      return bad_;
    }

   private:
    BatchSource& inner_;
    int at_, calls_ = 0;
    Batch bad_;
    std::vector<float> images_;
  };
  Trainer trainer(rt, model, options());
  ShuffledBatches batches(data, trainer.model(), 8, 1);
  NanAt nan_at(batches, 3);
  TrainingLoop loop(trainer, nan_at, {.steps = 12, .progress = false});
  EXPECT_THROW(loop.run(), std::invalid_argument);
  EXPECT_EQ(trainer.pending(), 0u);
  EXPECT_EQ(trainer.steps_done(), 3u);
  EXPECT_NO_THROW(trainer.step(batches.next()));
}

TEST_F(TrainingLoopTest, RefusesBadSettings) {
  Trainer trainer(rt, model, options());
  ShuffledBatches batches(data, trainer.model(), 8, 1);
  EXPECT_THROW((void)TrainingLoop(trainer, batches, {.steps = 0}), std::invalid_argument);
  EXPECT_THROW((void)TrainingLoop(trainer, batches, {.steps = 13, .steps_per_epoch = 12}), std::invalid_argument);
  EXPECT_THROW((void)TrainingLoop(trainer, batches, {.steps = 12, .max_seconds = std::nan("")}), std::invalid_argument)
      << "a NaN time limit had read as no limit";
  EXPECT_THROW((void)TrainingLoop(trainer, batches, {.steps = 12, .max_seconds = -1}), std::invalid_argument);
  EXPECT_THROW((void)TrainingLoop(trainer, batches, {.steps = 12, .schedule = LrSchedule{.total_steps = 0}}),
               std::invalid_argument);
  TrainingLoop loop(trainer, batches, {.steps = 12});
  EXPECT_THROW(loop.resume(LoopPosition{.done = 13}), std::invalid_argument);
  // Fewer steps than a group of micro-batches would update nothing; a whole group is a run.
  TrainerOptions o = options();
  o.accumulate = 4;
  Trainer accumulating(rt, model, o);
  try {
    (void)TrainingLoop(accumulating, batches, {.steps = 3});
    ADD_FAILURE() << "3 steps of a group of 4 micro-batches were accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("would update nothing"), std::string::npos) << e.what();
  }
  TrainingLoop whole(accumulating, batches, {.steps = 4, .progress = false});
  whole.run();
  EXPECT_EQ(accumulating.steps_done(), 1u);
}

// The loop's control for two ranks whose loops differ in the `field`-th thing run() compares (rank
// 1's value one more); the stop and time agreements are answered as every rank agreeing.
class OneFieldDiffers final : public ops::Communicator {
 public:
  explicit OneFieldDiffers(int field) : field_(field) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string name() const override { return "one field differs"; }
  void allreduce_sum(std::span<const std::span<float>>) override { refuse(); }
  void allreduce_sum(std::span<double> values) override {
    for (double& v : values) v *= 2;
  }
  void reduce_scatter_sum(std::span<const ops::ScatterBuffer>) override { refuse(); }
  void allgather(std::span<ops::GatherBuffer>) override { refuse(); }
  std::vector<std::uint64_t> allgather(std::uint64_t value) override {
    return {value, value + (calls_++ == field_ ? 1 : 0)};
  }
  std::unique_ptr<ops::Communicator> split() const override { return std::make_unique<OneFieldDiffers>(field_); }
  [[noreturn]] void abort(int) const override { std::abort(); }

 private:
  [[noreturn]] static void refuse() { throw std::logic_error("not a collective of the loop"); }
  int field_, calls_ = 0;
};

// Data-parallel ranks whose loops would take other collectives at other steps (and wait for each
// other forever) or set other learning rates are refused before any step, on every rank alike,
// naming what differs; loops that agree run.
TEST_F(TrainingLoopTest, DataParallelRanksMustRunTheSameLoop) {
  const char* named[] = {"the run's steps",
                         "the steps of an epoch",
                         "the steps between boundaries",
                         "the time limit",
                         "whether a learning-rate schedule is set",
                         "the schedule's kind",
                         "the schedule's peak",
                         "the schedule's length",
                         "the schedule's warm-up",
                         "the schedule's floor",
                         "whether checkpoints are written",
                         "the step the run starts from",
                         "the training data"};
  const auto loop_options = [](int field) {
    return TrainingLoopOptions{
        .steps = 4, .schedule = cosine(4), .progress = false, .control = std::make_shared<OneFieldDiffers>(field)};
  };
  for (int k = 0; k < static_cast<int>(std::size(named)); ++k) {
    Trainer trainer(rt, model, options());
    ShuffledBatches batches(data, trainer.model(), 8, 1);
    TrainingLoop loop(trainer, batches, loop_options(k));
    try {
      loop.run();
      ADD_FAILURE() << "ranks differing in " << named[k] << " ran";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("disagree on ") + named[k]), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("rank 1 has"), std::string::npos) << e.what();
    }
    EXPECT_EQ(trainer.steps_done(), 0u) << named[k];
  }
  Trainer trainer(rt, model, options());
  ShuffledBatches batches(data, trainer.model(), 8, 1);
  TrainingLoop agreeing(trainer, batches, loop_options(-1));
  EXPECT_EQ(agreeing.run().end, LoopSummary::End::finished);
  EXPECT_EQ(trainer.steps_done(), 4u);
}

// A data-parallel rank waiting on a stopped one waited forever; the watchdog ends the run once no
// beat came for its limit, once, naming the steps done, and never while beats come.
TEST(RankWatchdog, ExpiresOnceWhenBeatsStopAndNeverWhileTheyCome) {
  std::atomic<int> expired{0};
  std::atomic<std::uint64_t> reported{0};
  std::atomic<double> idle_reported{0};
  {
    RankWatchdog watchdog(std::chrono::milliseconds(300), [&](double idle, std::uint64_t done) {
      idle_reported = idle;
      reported = done;
      ++expired;
    });
    for (std::uint64_t step = 1; step <= 12; ++step) {  // 600 ms of beats, each well within the limit
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      watchdog.beat(step);
    }
    EXPECT_EQ(expired, 0) << "expired while beats came";
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (expired == 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(400));  // a second expiry would come by now
  }
  EXPECT_EQ(expired, 1);
  EXPECT_EQ(reported, 12u);
  EXPECT_GE(idle_reported, 0.3);
}

}  // namespace
}  // namespace ferry::test
