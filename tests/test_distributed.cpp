// Data parallelism's pieces that need no second process: the shares of a batch, the text windows a
// rank draws, and the options a trainer over several ranks refuses before any collective. Ranks
// training together under mpirun are tests/cli/data_parallel.sh (ctest cli_data_parallel).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <stdexcept>
#include <thread>
#include <tuple>

#include "ferry/ferry.hpp"
#include "ferry/runtime/text_corpus.hpp"
#include "idle_ranks.hpp"
#include "runtime/trainer_internals.hpp"
#include "test_models.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

TEST(Shard, SharesCoverTheBatchInOrderAndDifferByAtMostOne) {
  for (std::uint32_t batch : {1u, 2u, 7u, 256u, 1001u}) {
    for (int ranks = 1; ranks <= 5; ++ranks) {
      if (batch < static_cast<std::uint32_t>(ranks)) {
        EXPECT_THROW(shard_of(batch, 0, ranks), std::invalid_argument);
        continue;
      }
      std::uint32_t next = 0, least = batch, most = 0;
      for (int r = 0; r < ranks; ++r) {
        const Shard s = shard_of(batch, r, ranks);
        EXPECT_EQ(s.first, next) << batch << " " << r << "/" << ranks;
        next += s.count;
        least = std::min(least, s.count);
        most = std::max(most, s.count);
      }
      EXPECT_EQ(next, batch);
      EXPECT_LE(most - least, 1u);
      EXPECT_GE(least, 1u);
    }
  }
  EXPECT_THROW(shard_of(8, 2, 2), std::invalid_argument);
  EXPECT_THROW(shard_of(8, -1, 2), std::invalid_argument);
}

TEST(Shard, RandomWindowsOfEachShareAreTheRowsOfTheWholeBatch) {
  const auto dir = std::filesystem::temp_directory_path() / "ferry-test-distributed";
  std::filesystem::create_directories(dir);
  {
    std::ofstream out(dir / "text");
    for (int i = 0; i < 200; ++i) out << "the quick brown fox " << i << " jumps over the lazy dog\n";
  }
  const TextCorpus corpus = load_text_corpus({dir / "text"}, 0.1);
  const std::uint32_t context = 16, batch = 7;
  RandomWindows whole(corpus, context, batch, 5);
  std::vector<RandomWindows> parts;
  for (int r = 0; r < 3; ++r) parts.emplace_back(corpus, context, batch, 5, shard_of(batch, r, 3));
  for (int step = 0; step < 3; ++step) {
    const Batch all = whole.next();
    std::vector<std::int32_t> joined;
    for (auto& p : parts) {
      const Batch mine = p.next();
      const auto& view = mine.at("tokens");
      const auto* ids = reinterpret_cast<const std::int32_t*>(view.bytes.data());
      joined.insert(joined.end(), ids, ids + view.bytes.size() / sizeof(std::int32_t));
    }
    const auto& view = all.at("tokens");
    const auto* ids = reinterpret_cast<const std::int32_t*>(view.bytes.data());
    EXPECT_EQ(joined, std::vector<std::int32_t>(ids, ids + view.bytes.size() / sizeof(std::int32_t))) << step;
  }
  EXPECT_THROW(RandomWindows(corpus, context, batch, 5, Shard{6, 2}), std::invalid_argument);
  std::filesystem::remove_all(dir);
}

TEST(ZeroShard, SharesCoverEachTensorOnGranulesAndSmallTensorsGoWholeByTurns) {
  for (std::size_t elems : {1ul, 100ul, 4095ul, 4096ul, 10240ul, 802816ul, 1048577ul}) {
    for (int ranks = 1; ranks <= 4; ++ranks) {
      for (std::size_t ordinal : {0ul, 5ul}) {
        std::size_t covered = 0, owners = 0, least = elems, most = 0;
        for (int r = 0; r < ranks; ++r) {
          const ops::ShardRange s = ops::zero_shard(elems, ordinal, r, ranks, 2048);
          if (s.count == 0) continue;
          EXPECT_EQ(s.first, covered) << elems << " " << r << "/" << ranks;
          EXPECT_EQ(s.first % 2048, 0u);
          covered += s.count;
          ++owners;
          least = std::min(least, s.count);
          most = std::max(most, s.count);
        }
        EXPECT_EQ(covered, elems);
        if (elems < 2048u * static_cast<std::size_t>(ranks)) {
          EXPECT_EQ(owners, 1u);
          EXPECT_EQ(ops::zero_shard(elems, ordinal, static_cast<int>(ordinal % ranks), ranks, 2048).count, elems);
        } else {
          EXPECT_EQ(owners, static_cast<std::size_t>(ranks));
          EXPECT_LE(most - least, 2048u + static_cast<std::size_t>(ranks));
        }
      }
    }
  }
  EXPECT_THROW(ops::zero_shard(10, 0, 2, 2, 2048), std::invalid_argument);
}

// Rank 0 of `n` ranks in one process, the others alike: sums of the trainer's small values are n
// times this rank's, and every rank's value is this rank's.
class SelfRanks : public ops::Communicator {
 public:
  SelfRanks(int n, std::string name) : n_(n), name_(std::move(name)) {}
  int rank() const override { return 0; }
  int size() const override { return n_; }
  std::string name() const override { return name_; }
  using ops::Communicator::allreduce_sum;
  void allreduce_sum(std::span<double> values) override {
    for (double& x : values) x *= n_;
  }
  std::vector<std::uint64_t> allgather(std::uint64_t value) override {
    return std::vector<std::uint64_t>(static_cast<std::size_t>(n_), value);
  }
  [[noreturn]] void abort(int) const override { std::abort(); }

 protected:
  int n_;
  std::string name_;
};

// N ranks that are all this one: every rank has this rank's gradients and loss, so a sum over
// the ranks is N times this rank's. With the shares of a batch N times larger (1/N each, a power
// of two here), the data-parallel step scales by 1/N and sums N copies: exactly the gradient one
// rank gets alone, so training must match a plain trainer bit for bit. This runs the whole
// data-parallel step (send, host-lane all-reduce, receive, guard, loss reduction) in one process.
class Mirror final : public SelfRanks {
 public:
  explicit Mirror(int n) : SelfRanks(n, "mirror") {}
  using SelfRanks::allreduce_sum;
  void allreduce_sum(std::span<const std::span<float>> buffers) override {
    ++reductions;
    for (const auto& b : buffers) {
      for (float& x : b) x *= static_cast<float>(n_);
    }
  }
  void reduce_scatter_sum(std::span<const ops::ScatterBuffer> buffers) override {
    ++reductions;
    for (const auto& b : buffers) {
      for (std::size_t i = 0; i < b.shard.size(); ++i) b.shard[i] = b.data[i] * static_cast<float>(n_);  // rank 0's run
    }
  }
  void allgather(std::span<ops::GatherBuffer>) override { throw std::logic_error("no all-gather at ZeRO stage 0"); }
  using SelfRanks::allgather;
  std::unique_ptr<ops::Communicator> split() const override { return std::make_unique<Mirror>(n_); }
  int reductions = 0;
};

// `alone`'s options on four mirrored ranks: a global batch of four of its batches, and a bucket
// per weight and bias.
TrainerOptions on_four_ranks(TrainerOptions alone, std::shared_ptr<ops::Communicator> ranks) {
  alone.data_parallel.communicator = std::move(ranks);
  alone.data_parallel.global_batch = 4 * alone.batch;
  alone.data_parallel.bucket_bytes = 64;
  return alone;
}

struct MirrorCase {
  const char* name;
  graph::ResidencyMode mode;
  bool host_optimizer;
  std::uint32_t accumulate;
  bool hybrid = false;  // hybrid phases, predicting early (the ranks' controllers must agree)
  bool fp16 = false;    // fp16 with a loss scale that overflows (the ranks' scalers must agree)
  bool bf16 = false;    // bf16 layers: their gradients are sent narrow and widened on the host
};

class MirroredRanks : public ::testing::TestWithParam<MirrorCase> {};

TEST_P(MirroredRanks, TrainBitIdenticalToOneRank) {
  const MirrorCase& c = GetParam();
  Runtime rt;
  const ModelSpec m = small_mlp();
  TrainerOptions alone;
  alone.batch = 8;
  alone.lr = 0.01f;
  alone.accumulate = c.accumulate;
  alone.residency.mode = c.mode;
  alone.residency.host_optimizer = c.host_optimizer;
  if (c.host_optimizer) alone.optimizer.kind = ops::OptimizerConfig::Kind::adamw;
  if (c.hybrid) {
    alone.phases.hybrid = true;
    alone.phases.warmup_steps = 2;
    alone.phases.min_full_steps = 1;
    alone.phases.confidence = 0.05f;
  }
  if (c.fp16) {
    alone.precision.compute = ops::DType::f16;
    alone.precision.initial_scale = 16777216.0f;  // 2^24: the first steps overflow
    alone.precision.growth_interval = 2;          // and the scale grows back into overflows
  }
  if (c.bf16) alone.precision.compute = ops::DType::bf16;
  auto mirror = std::make_shared<Mirror>(4);
  const TrainerOptions ranked = on_four_ranks(alone, mirror);
  // Each mirrored rank's loss is the mean over a quarter of a global batch of 32, so its gradients
  // are four times those of that batch, and it scales them by a quarter of the loss scale: one
  // rank alone matches it with a quarter of the scale.
  if (c.fp16) alone.precision.initial_scale /= 4;
  Trainer one(rt, m, alone), four(rt, m, ranked);
  EXPECT_EQ(four.world_size(), 4);
  EXPECT_EQ(four.allreduce_bytes_per_step(), four.gradient_bytes());
  // The host lane's widening casts and guard checks are no optimizer updates: the ranks run as
  // many of those on the host as one rank does.
  EXPECT_EQ(four.residency().host_updates, one.residency().host_updates);
  if (c.host_optimizer) {
    EXPECT_EQ(four.residency().host_updates, four.parameter_names().size());
  }
  const std::size_t sample = m.inputs[0].sample.elems();
  int predicted = 0, overflowed = 0;
  for (int s = 0; s < (c.hybrid || c.fp16 ? 16 : 6); ++s) {
    const auto images = random_vector(8 * sample, 300 + s);
    const auto labels = labels_for(8, 400 + s);
    const StepResult a = one.step(images, labels), b = four.step(images, labels);
    ASSERT_EQ(a.loss, b.loss) << "step " << s;
    EXPECT_EQ(a.correct * 4, b.correct) << "step " << s;
    ASSERT_EQ(a.phase, b.phase) << "step " << s;
    ASSERT_EQ(a.overflow, b.overflow) << "step " << s;
    if (a.phase != Phase::predict) {
      ASSERT_EQ(a.loss_scale * (c.fp16 ? 4 : 1), b.loss_scale) << "step " << s;
    }
    predicted += a.phase == Phase::predict;
    overflowed += a.overflow;
  }
  if (c.hybrid) {
    EXPECT_GT(predicted, 0) << "no step was predicted: the case tests nothing of the phases";
  }
  if (c.fp16) {
    EXPECT_GT(overflowed, 0) << "no step overflowed: the case tests nothing of the scaling";
  }
  EXPECT_GT(mirror->reductions, 0);
  if ((c.fp16 || c.bf16) && c.accumulate == 1) {
    // The narrow layers' weight gradients go to the host as they are (then widened there).
    int narrow_sends = 0;
    const graph::Graph& g = compiled_train_step(four).graph();
    for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
      narrow_sends += g.nodes.op[n] == ops::builtin::grad_send &&
                      g.tensors.dtype[g.nodes.inputs(n)[0]] == (c.fp16 ? ops::DType::f16 : ops::DType::bf16);
    }
    EXPECT_GT(narrow_sends, 0);
  }
  if (c.host_optimizer) {
    // The host updates read the sums the reductions left in pinned host memory: no gradient is
    // written back to the host a second time.
    EXPECT_GT(one.residency().write_back_bytes, 0u);
    EXPECT_EQ(four.residency().write_back_bytes, 0u);
  }
  for (const auto& name : one.tensor_names()) {
    EXPECT_EQ(one.read_tensor(name).bytes, four.read_tensor(name).bytes) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Modes, MirroredRanks,
    ::testing::Values(MirrorCase{"resident", graph::ResidencyMode::resident, false, 1},
                      MirrorCase{"accumulate", graph::ResidencyMode::resident, false, 2},
                      MirrorCase{"streamed", graph::ResidencyMode::stream, false, 1},
                      MirrorCase{"mapped", graph::ResidencyMode::mapped, false, 1},
                      MirrorCase{"mapped_accumulate", graph::ResidencyMode::mapped, false, 2},
                      MirrorCase{"host_optimizer", graph::ResidencyMode::stream, true, 1},
                      MirrorCase{"hybrid", graph::ResidencyMode::resident, false, 1, true},
                      MirrorCase{"fp16_accumulate", graph::ResidencyMode::resident, false, 2, false, true},
                      MirrorCase{"fp16_hybrid_streamed", graph::ResidencyMode::stream, false, 2, true, true},
                      MirrorCase{"fp16", graph::ResidencyMode::resident, false, 1, false, true},
                      MirrorCase{"bf16_host_optimizer", graph::ResidencyMode::stream, true, 1, false, false, true}),
    [](const auto& info) { return std::string(info.param.name); });

// The mirror's sums, but non-blocking: a collective started by start_allreduce_sum writes its sum
// only when it completes, on the third test() of its request. So a step that read a bucket before
// its collective completed would train differently from one rank, and a step that waited for a
// request on the worker that started it (the blocking default) is seen by the thread ids.
class LateMirror final : public SelfRanks {
 public:
  explicit LateMirror(int n) : SelfRanks(n, "late mirror") {}
  void allreduce_sum(std::span<const std::span<float>>) override {
    throw std::logic_error("a step must start its gradient sums without blocking");
  }
  using SelfRanks::allreduce_sum;
  void reduce_scatter_sum(std::span<const ops::ScatterBuffer>) override { throw std::logic_error("stage 0 only"); }
  void allgather(std::span<ops::GatherBuffer>) override { throw std::logic_error("stage 0 only"); }
  using SelfRanks::allgather;
  std::unique_ptr<ops::Communicator> split() const override { return std::make_unique<LateMirror>(n_); }

  std::unique_ptr<ops::CommRequest> start_allreduce_sum(std::vector<std::span<float>> buffers) override {
    ++started;
    return std::make_unique<Request>(*this, std::move(buffers));
  }
  std::atomic<int> started{0}, completed{0}, tested_by_starter{0};
  std::atomic<int> in_flight{0}, most_in_flight{0};

 private:
  class Request final : public ops::CommRequest {
   public:
    Request(LateMirror& m, std::vector<std::span<float>> buffers)
        : m_(m), buffers_(std::move(buffers)), starter_(std::this_thread::get_id()) {
      const int now = ++m_.in_flight;
      int most = m_.most_in_flight.load();
      while (now > most && !m_.most_in_flight.compare_exchange_weak(most, now)) {
      }
    }
    bool test() override {
      if (std::this_thread::get_id() == starter_) ++m_.tested_by_starter;
      if (++tests_ < 3) return false;
      if (!done_) {
        for (const auto& b : buffers_) {
          for (float& x : b) x *= static_cast<float>(m_.n_);
        }
        done_ = true;
        --m_.in_flight;
        ++m_.completed;
      }
      return true;
    }

   private:
    LateMirror& m_;
    std::vector<std::span<float>> buffers_;
    std::thread::id starter_;
    int tests_ = 0;
    bool done_ = false;
  };
};

TEST(CommLane, CollectivesCompleteOffTheWorkersAndTheStepWaitsForThem) {
  for (const bool streamed : {false, true}) {
    Runtime rt({.profiling = true});
    const ModelSpec m = small_mlp();
    TrainerOptions alone;
    alone.batch = 8;
    alone.lr = 0.01f;
    if (streamed) {
      alone.residency.mode = graph::ResidencyMode::stream;
      alone.residency.host_optimizer = true;
      alone.optimizer.kind = ops::OptimizerConfig::Kind::adamw;
    }
    auto late = std::make_shared<LateMirror>(4);
    const TrainerOptions ranked = on_four_ranks(alone, late);
    Trainer one(rt, m, alone), four(rt, m, ranked);
    const std::size_t sample = m.inputs[0].sample.elems();
    for (int s = 0; s < 4; ++s) {
      const auto images = random_vector(8 * sample, 500 + s);
      const auto labels = labels_for(8, 600 + s);
      ASSERT_EQ(one.step(images, labels).loss, four.step(images, labels).loss) << "step " << s << " " << streamed;
    }
    for (const auto& name : one.tensor_names()) {
      EXPECT_EQ(one.read_tensor(name).bytes, four.read_tensor(name).bytes) << name << " " << streamed;
    }
    EXPECT_EQ(late->started, 4 * 4) << "a bucket per tensor, four steps";
    EXPECT_EQ(late->completed, late->started);
    EXPECT_EQ(late->in_flight, 0);
    EXPECT_EQ(late->tested_by_starter, 0) << "a worker waited for the collective it started";
    // The trace: the collectives on the communication lane, each spanning its start to its
    // completion, beside the compute lane.
    int comm = 0;
    for (const auto& e : compiled_train_step(four).timeline()) {
      if (e.op != "grad_allreduce") continue;
      EXPECT_EQ(e.lane, ops::Lane::comm) << e.name;
      EXPECT_GT(e.end_ns, e.start_ns) << e.name;
      ++comm;
    }
    EXPECT_GT(comm, 2);
  }
}

// Rank 0 of two, the other rank simulated: every sum is twice this rank's (its half of a sum equals
// this rank's; at stage 2 rank 0's run comes first). `Poison` says what the other rank got wrong:
// its overflow guard is NaN (`guard`: a gradient of its shares was not finite; at stage 2 the guard
// sum is the only float all-reduce), or the first element of each gradient bucket's sum, or of this
// rank's share of it, is NaN while the guards stay finite (`sums`: only a check of the sums
// themselves can see it).
class HalfOfTwo final : public ops::Communicator {
 public:
  enum class Poison : std::uint8_t { none, guard, sums };
  explicit HalfOfTwo(Poison poison) : poison_(poison) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string name() const override { return "half of two"; }
  void allreduce_sum(std::span<const std::span<float>> buffers) override {
    ++float_sums;
    for (const auto& b : buffers) {
      for (float& x : b) x = poison_ == Poison::guard ? std::nanf("") : 2 * x;
    }
    if (poison_ == Poison::sums && !buffers.empty() && buffers[0].size() > 1) buffers[0][0] = std::nanf("");
  }
  void allreduce_sum(std::span<double> values) override {
    for (double& x : values) x *= 2;
  }
  void reduce_scatter_sum(std::span<const ops::ScatterBuffer> buffers) override {
    for (const auto& b : buffers) {
      for (std::size_t i = 0; i < b.shard.size(); ++i) b.shard[i] = 2 * b.data[i];
    }
    if (poison_ == Poison::sums && !buffers.empty() && !buffers[0].shard.empty()) buffers[0].shard[0] = std::nanf("");
  }
  void allgather(std::span<ops::GatherBuffer>) override {}  // the other rank's shares are not known here
  std::vector<std::uint64_t> allgather(std::uint64_t value) override { return {value, value}; }
  std::unique_ptr<ops::Communicator> split() const override { return std::make_unique<HalfOfTwo>(poison_); }
  [[noreturn]] void abort(int) const override { std::abort(); }
  int float_sums = 0;

 private:
  Poison poison_;
};

// One step of `t` on a batch of 4 (seeded by `seed`): when `rejected`, the step must stop with the
// trainer's divergence error (a weight gradient not finite, `why`); otherwise it must train.
void step_expecting(Trainer& t, bool rejected, std::uint32_t seed, const char* why) {
  const std::size_t sample = small_mlp().inputs[0].sample.elems();
  const auto images = random_vector(4 * sample, seed);
  const auto labels = labels_for(4, seed + 1);
  if (!rejected) {
    t.step(images, labels);
    return;
  }
  try {
    t.step(images, labels);
    ADD_FAILURE() << "the step went on although " << why;
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("a weight gradient is not"), std::string::npos) << e.what();
  }
}

// At ZeRO stage 2 a rank checks only its shares of the gradients: a non-finite gradient in another
// rank's shares reaches it through the sum of the guards, and it skips the step like that rank.
TEST(DataParallel, ZeroStage2SkipsAStepAnotherRanksGuardRejects) {
  for (const bool poisoned : {false, true}) {
    SCOPED_TRACE(poisoned ? "the other rank's guard is NaN" : "every guard finite");
    Runtime rt;
    TrainerOptions o;
    o.batch = 4;
    o.lr = 0.05f;
    auto comm = std::make_shared<HalfOfTwo>(poisoned ? HalfOfTwo::Poison::guard : HalfOfTwo::Poison::none);
    o.data_parallel = {.communicator = comm, .global_batch = 8, .zero_stage = 2};
    Trainer t(rt, small_mlp(), o);
    EXPECT_LT(t.gradient_bytes(), t.allreduce_bytes_per_step());  // rank 0 keeps its shares alone
    std::map<std::string, std::vector<std::byte>> before;
    for (const auto& name : t.parameter_names()) before[name] = t.read_tensor(name).bytes;
    step_expecting(t, poisoned, 31, "another rank's guard was NaN");
    EXPECT_EQ(comm->float_sums, 1);  // the guards'
    // This rank's shares of the weights (the other rank's come from the gather this fake skips).
    const graph::Graph& g = compiled_train_step(t).graph();
    int changed = 0;
    for (const graph::ZeroShare& z : graph::zero_shares(g, {0, 2, 2048})) {
      const std::string& name = g.tensors.name[z.weight];
      const auto now = t.read_tensor(name).bytes;
      const std::size_t first = z.range.first * sizeof(float), end = (z.range.first + z.range.count) * sizeof(float);
      changed += !std::equal(now.begin() + first, now.begin() + end, before[name].begin() + first);
    }
    if (poisoned) {
      EXPECT_EQ(changed, 0) << "a skipped step changed weights";
    } else {
      EXPECT_GT(changed, 0) << "no weight was updated";
    }
  }
}

// With the optimizer on the host the sums stay in host memory, where the updates read them and the
// overflow guard checks them (no copy back to the device): a sum that is not finite still stops
// the step, at every ZeRO stage, and changes no weight.
TEST(DataParallel, TheHostOptimizerChecksTheSumsInHostMemory) {
  for (const int stage : {0, 1, 2}) {
    for (const bool poisoned : {false, true}) {
      SCOPED_TRACE(fmt::format("ZeRO stage {}, {}", stage, poisoned ? "a sum is NaN" : "every sum finite"));
      Runtime rt;
      TrainerOptions o;
      o.batch = 4;
      o.lr = 0.05f;
      o.optimizer.kind = ops::OptimizerConfig::Kind::adamw;
      o.residency.mode = graph::ResidencyMode::stream;
      o.residency.host_optimizer = true;
      o.data_parallel = {
          .communicator = std::make_shared<HalfOfTwo>(poisoned ? HalfOfTwo::Poison::sums : HalfOfTwo::Poison::none),
          .global_batch = 8,
          .zero_stage = stage};
      Trainer t(rt, small_mlp(), o);
      const graph::Graph& g = compiled_train_step(t).graph();
      int host_checks = 0, gradients_received = 0;
      for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
        const bool guard_copy = g.tensors.storage(g.nodes.outputs(n)[0]) == g.tensors.storage(g.guard);
        gradients_received += g.nodes.op[n] == ops::builtin::grad_receive && !guard_copy;
        host_checks += g.nodes.op[n] == ops::builtin::overflow_guard_check && g.nodes.lane[n] == ops::Lane::host;
      }
      EXPECT_EQ(gradients_received, 0) << "a sum went back to the device";
      int sums = 0;  // this rank's: every weight's, or at stage 2 those it holds a share of
      for (const graph::ZeroShare& z : graph::zero_shares(g, {0, 2, 2048})) sums += stage < 2 || z.range.count > 0;
      EXPECT_EQ(host_checks, sums);
      EXPECT_GT(host_checks, 0);
      std::map<std::string, std::vector<std::byte>> before;
      for (const auto& name : t.parameter_names()) before[name] = t.read_tensor(name).bytes;
      step_expecting(t, poisoned, 41, "a gradient sum was NaN");
      int changed = 0;
      for (const auto& name : t.parameter_names()) changed += t.read_tensor(name).bytes != before[name];
      if (poisoned) {
        EXPECT_EQ(changed, 0) << "a skipped step changed weights";
      } else {
        EXPECT_GT(changed, 0) << "no weight was updated";
      }
    }
  }
}

// Rank 0 of two with fp16 loss scaling and accumulation, the other rank simulated: its gradients
// equal this rank's, but its first micro-batch overflowed (its guard is NaN). The ranks sum their
// guards before a micro-batch's gradients go into the sums, so this rank drops that micro-batch
// too, halves its scale, and its group waits for another micro-batch, as the other rank's does.
class OtherRankOverflowsFirst final : public ops::Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string name() const override { return "other rank overflows first"; }
  void allreduce_sum(std::span<const std::span<float>> buffers) override {
    const bool poison = float_sums++ == 0;  // the first micro-batch's guards
    for (const auto& b : buffers) {
      for (float& x : b) x = poison ? std::nanf("") : 2 * x;
    }
  }
  void allreduce_sum(std::span<double> values) override {
    for (double& x : values) x *= 2;
  }
  void reduce_scatter_sum(std::span<const ops::ScatterBuffer>) override { throw std::logic_error("stage 0 only"); }
  void allgather(std::span<ops::GatherBuffer>) override { throw std::logic_error("stage 0 only"); }
  std::vector<std::uint64_t> allgather(std::uint64_t value) override { return {value, value}; }
  std::unique_ptr<ops::Communicator> split() const override { return std::make_unique<OtherRankOverflowsFirst>(); }
  [[noreturn]] void abort(int) const override { std::abort(); }
  int float_sums = 0;
};

TEST(DataParallel, AMicroBatchAnotherRankOverflowedIsDroppedOnEveryRank) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 4;
  o.lr = 0.05f;
  o.accumulate = 2;
  o.precision.compute = ops::DType::f16;
  auto comm = std::make_shared<OtherRankOverflowsFirst>();
  o.data_parallel = {.communicator = comm, .global_batch = 8};
  Trainer t(rt, small_mlp(), o);
  const std::size_t sample = small_mlp().inputs[0].sample.elems();
  const auto sum_before = t.read_tensor("linear0.w.grad_sum").bytes;
  const std::map<std::string, std::vector<std::byte>> weights_before = [&] {
    std::map<std::string, std::vector<std::byte>> w;
    for (const auto& name : t.parameter_names()) w[name] = t.read_tensor(name).bytes;
    return w;
  }();
  const StepResult first = t.step(random_vector(4 * sample, 41), labels_for(4, 42));
  EXPECT_TRUE(first.overflow) << "this rank's micro-batch was finite, but the other rank's overflowed";
  EXPECT_FALSE(first.updated);
  EXPECT_EQ(comm->float_sums, 1) << "a micro-batch sums the ranks' guards once";
  EXPECT_EQ(t.read_tensor("linear0.w.grad_sum").bytes, sum_before) << "the dropped micro-batch was added";
  const StepResult second = t.step(random_vector(4 * sample, 43), labels_for(4, 44));
  EXPECT_FALSE(second.overflow);
  EXPECT_FALSE(second.updated) << "the group of two waited for another micro-batch";
  EXPECT_EQ(second.loss_scale, first.loss_scale / 2);
  EXPECT_NE(t.read_tensor("linear0.w.grad_sum").bytes, sum_before);
  const StepResult third = t.step(random_vector(4 * sample, 45), labels_for(4, 46));
  EXPECT_TRUE(third.updated);
  int changed = 0;
  for (const auto& [name, bytes] : weights_before) changed += t.read_tensor(name).bytes != bytes;
  EXPECT_GT(changed, 0) << "the group's update changed no weight";
}

// A first weight of 1600 x 16 elements, which ZeRO cuts into runs of 2048 over two or three ranks;
// the others small enough to belong whole to one rank each.
ModelSpec wide_mlp() {
  return models::classifier("wide-mlp", graph::Shape{1, 40, 40}, 10, [](graph::Builder& b, TensorId x) {
    return b.linear(b.relu(b.linear(b.flatten(x), 16)), 10);
  });
}

// A trainer of wide_mlp with AdamW as rank `rank` of `ranks` at ZeRO `stage` (alone: ranks 1).
std::unique_ptr<Trainer> zero_trainer(Runtime& rt, int rank, int ranks, int stage) {
  TrainerOptions o;
  o.batch = 12 / static_cast<std::uint32_t>(ranks);  // of a global batch of 12
  o.optimizer.kind = ops::OptimizerConfig::Kind::adamw;
  if (ranks > 1) {
    o.data_parallel = {
        .communicator = std::make_shared<IdleRanks>(rank, ranks), .global_batch = 12, .zero_stage = stage};
  }
  return std::make_unique<Trainer>(rt, wide_mlp(), o);
}

// Every trainable weight's share in `t` (whole alone or at stage 0), with its state tensors' names:
// element e of the weight's state k (0: adam_m, 1: adam_v) is marked (2 ordinal + k) * 10^5 + e.
struct MarkedShare {
  std::string state;
  float mark_base;
  ops::ShardRange range;
};
std::vector<MarkedShare> marked_shares(const Trainer& t, int rank, int ranks, int stage) {
  const graph::Graph& g = compiled_train_step(t).graph();
  const graph::ZeroSharding zero =
      stage > 0 && ranks > 1 ? graph::ZeroSharding{rank, ranks, 2048} : graph::ZeroSharding{};
  std::vector<MarkedShare> out;
  const auto shares = graph::zero_shares(g, zero);
  for (std::size_t k = 0; k < shares.size(); ++k) {
    if (shares[k].range.count == 0) continue;
    const std::string& w = g.tensors.name[shares[k].weight];
    out.push_back({w + ".adam_m", static_cast<float>(2 * k) * 1e5f, shares[k].range});
    out.push_back({w + ".adam_v", static_cast<float>(2 * k + 1) * 1e5f, shares[k].range});
  }
  return out;
}

void mark_state(Trainer& t, int rank, int ranks, int stage) {
  for (const MarkedShare& m : marked_shares(t, rank, ranks, stage)) {
    Trainer::HostTensor v = t.read_tensor(m.state);
    auto* f = reinterpret_cast<float*>(v.bytes.data());
    for (std::size_t i = 0; i < m.range.count; ++i) f[i] = m.mark_base + static_cast<float>(m.range.first + i);
    t.write_tensor(m.state, v);
  }
}

void expect_marked(const Trainer& t, int rank, int ranks, int stage, const std::string& what) {
  int checked = 0;
  for (const MarkedShare& m : marked_shares(t, rank, ranks, stage)) {
    const Trainer::HostTensor v = t.read_tensor(m.state);
    ASSERT_EQ(v.bytes.size(), m.range.count * sizeof(float)) << what << ": " << m.state;
    const auto* f = reinterpret_cast<const float*>(v.bytes.data());
    for (std::size_t i = 0; i < m.range.count; ++i) {
      ASSERT_EQ(f[i], m.mark_base + static_cast<float>(m.range.first + i))
          << what << ": " << m.state << "[" << i << "]";
    }
    ++checked;
  }
  EXPECT_GT(checked, 0) << what;
}

std::string read_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// At ZeRO stage 1 the ranks' files of a checkpoint replace their earlier ones only when every rank
// wrote its own: when another rank's write failed, this rank's earlier file stays as it was, and no
// temporary file is left beside it.
TEST(ZeroCheckpoints, NoRankReplacesItsFileWhenAnotherRanksWriteFailed) {
  Runtime rt;
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("ferry-test-zero-commit-{}", getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto ranks = std::make_shared<IdleRanks>(0, 2);
  TrainerOptions o;
  o.batch = 6;
  o.optimizer.kind = ops::OptimizerConfig::Kind::adamw;
  o.data_parallel = {.communicator = ranks, .global_batch = 12, .zero_stage = 1};
  Trainer t(rt, wide_mlp(), o);
  const auto path = dir / "z.ckpt";
  t.save_checkpoint(path, std::vector<std::byte>(3, std::byte{1}));  // every rank wrote its own
  const auto before = read_bytes(path);
  ranks->fail_rank(1);
  try {
    t.save_checkpoint(path, std::vector<std::byte>(3, std::byte{2}));
    ADD_FAILURE() << "the save went on although rank 1's write failed";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("another rank could not write its file"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_bytes(path), before) << "rank 0 replaced its file of the earlier checkpoint";
  int files = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir)) ++files;
  EXPECT_EQ(files, 1) << "a temporary file was left beside the checkpoint";
  std::filesystem::remove_all(dir);
}

TEST(ZeroCheckpoints, AreCutAnewForOtherRanksStagesOrOneRank) {
  Runtime rt;
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("ferry-test-reshard-{}", getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  // Three ranks at stage 1 save their shares, marked; the first weight is cut over all three.
  std::vector<std::filesystem::path> files;
  for (int r = 0; r < 3; ++r) {
    auto t = zero_trainer(rt, r, 3, 1);
    mark_state(*t, r, 3, 1);
    files.push_back(dir / (r == 0 ? std::string("z.ckpt") : fmt::format("z.ckpt.rank{}", r)));
    t->save_checkpoint(files.back(), std::vector<std::byte>(3, std::byte{9}));
  }
  ASSERT_GT(marked_shares(*zero_trainer(rt, 0, 3, 1), 0, 3, 1).size(), 0u);
  // Rank 0's file alone is known for what it is: the other ranks' files are named.
  try {
    zero_trainer(rt, 0, 2, 1)->load_resharded_checkpoint(std::vector<std::filesystem::path>{files[0]});
    ADD_FAILURE() << "rank 0's file of three loaded as a whole-state checkpoint";
  } catch (const std::invalid_argument& e) {
    const std::string want = fmt::format(
        "rank 0's share of a checkpoint 3 ranks wrote at ZeRO stage 1 or 2, whose "
        "other files '{0}.rank1' to '{0}.rank2' are missing",
        files[0].string());
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
  for (const auto& [rank, ranks, stage] : {std::tuple{1, 2, 2}, {0, 2, 1}, {0, 1, 0}, {1, 4, 1}, {1, 2, 0}}) {
    const std::string what = fmt::format("rank {} of {} at stage {}", rank, ranks, stage);
    auto t = zero_trainer(rt, rank, ranks, stage);
    EXPECT_EQ(t->load_resharded_checkpoint(files), std::vector<std::byte>(3, std::byte{9})) << what;
    expect_marked(*t, rank, ranks, stage, what);
  }
  // A whole-state checkpoint cut into shares.
  {
    auto alone = zero_trainer(rt, 0, 1, 0);
    mark_state(*alone, 0, 1, 0);
    alone->save_checkpoint(dir / "whole.ckpt");
    auto t = zero_trainer(rt, 2, 3, 1);
    t->load_resharded_checkpoint(std::vector<std::filesystem::path>{dir / "whole.ckpt"});
    expect_marked(*t, 2, 3, 1, "rank 2 of 3 from a whole-state checkpoint");
  }
  // Two of the three files: the shares are not those of two ranks, and the trainer is unchanged.
  {
    auto t = zero_trainer(rt, 0, 1, 0);
    const auto before = t->read_tensor(marked_shares(*t, 0, 1, 0)[0].state).bytes;
    try {
      t->load_resharded_checkpoint(std::span(files).first(2));
      ADD_FAILURE() << "two files of a three-rank checkpoint were loaded";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("are not the 2 shares of one checkpoint"), std::string::npos) << e.what();
    }
    EXPECT_EQ(t->read_tensor(marked_shares(*t, 0, 1, 0)[0].state).bytes, before);
  }
  // One rank's file loaded alone as a whole checkpoint: named as a share, with what to do.
  {
    auto t = zero_trainer(rt, 0, 1, 0);
    try {
      t->load_checkpoint(files[0]);
      ADD_FAILURE() << "one rank's file of a ZeRO checkpoint loaded as a whole one";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("as one rank's file of a checkpoint written by several ranks"),
                std::string::npos)
          << e.what();
    }
  }
  // One file given twice, by its name or through a link: refused before anything is read as
  // another rank's share.
  {
    auto t = zero_trainer(rt, 0, 1, 0);
    const auto before = t->read_tensor(marked_shares(*t, 0, 1, 0)[0].state).bytes;
    std::filesystem::create_symlink(files[1], dir / "link");
    for (const auto& twice :
         {std::vector{files[0], files[1], files[1]}, std::vector{files[0], files[1], dir / "link"}}) {
      try {
        t->load_resharded_checkpoint(twice);
        ADD_FAILURE() << "one file given twice was loaded";
      } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find("files 1 and 2"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("are one file"), std::string::npos) << e.what();
      }
    }
    EXPECT_EQ(t->read_tensor(marked_shares(*t, 0, 1, 0)[0].state).bytes, before);
  }
  std::filesystem::remove_all(dir);
}

std::vector<float> as_floats(const std::vector<std::byte>& bytes) {
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
  return out;
}

// Inside a group of micro-batches a checkpoint's gradient sums are the group's (one rank's alone):
// loaded on two ranks at stage 0, rank 0 takes them divided by its share of the batch (here exactly
// twice them) and rank 1 starts from zeros; a rank contributes nothing outside data parallelism.
TEST(ZeroCheckpoints, AGroupsSumsGoToRankZeroByItsShare) {
  Runtime rt;
  const auto path = std::filesystem::temp_directory_path() / fmt::format("ferry-test-group-sums-{}.ckpt", getpid());
  TrainerOptions o;
  o.batch = 8;
  o.accumulate = 2;
  Trainer alone(rt, small_mlp(), o);
  const std::size_t sample = small_mlp().inputs[0].sample.elems();
  alone.step(random_vector(8 * sample, 51), labels_for(8, 52));  // the group's first micro-batch
  alone.contribute_to_checkpoint();                              // alone: nothing to add
  alone.save_checkpoint(path);
  const std::string sum_name = alone.parameter_names().front() + ".grad_sum";
  const std::vector<float> sums = as_floats(alone.read_tensor(sum_name).bytes);
  ASSERT_TRUE(std::any_of(sums.begin(), sums.end(), [](float v) { return v != 0.0f; }));
  for (const int rank : {0, 1}) {
    TrainerOptions two = o;
    two.batch = 4;
    two.data_parallel = {.communicator = std::make_shared<IdleRanks>(rank, 2), .global_batch = 8};
    Trainer t(rt, small_mlp(), two);
    t.load_checkpoint(path);
    const std::vector<float> got = as_floats(t.read_tensor(sum_name).bytes);
    ASSERT_EQ(got.size(), sums.size());
    for (std::size_t i = 0; i < sums.size(); ++i) {
      ASSERT_EQ(got[i], rank == 0 ? 2 * sums[i] : 0.0f) << "rank " << rank << ", element " << i;
    }
  }
  std::filesystem::remove(path);
}

// Two ranks that never meet: every option checked here is refused before a collective.
class Unreachable final : public ops::Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string name() const override { return "none"; }
  void allreduce_sum(std::span<const std::span<float>>) override { throw std::logic_error("no collective expected"); }
  void allreduce_sum(std::span<double>) override { throw std::logic_error("no collective expected"); }
  void reduce_scatter_sum(std::span<const ops::ScatterBuffer>) override {
    throw std::logic_error("no collective expected");
  }
  void allgather(std::span<ops::GatherBuffer>) override { throw std::logic_error("no collective expected"); }
  std::vector<std::uint64_t> allgather(std::uint64_t) override { throw std::logic_error("no collective expected"); }
  std::unique_ptr<ops::Communicator> split() const override { throw std::logic_error("no collective expected"); }
  [[noreturn]] void abort(int) const override { std::abort(); }
};

void expect_refused(const TrainerOptions& o, const std::string& says) {
  Runtime rt;
  try {
    Trainer t(rt, small_mlp(), o);
    ADD_FAILURE() << "trained; expected: " << says;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
  }
}

TEST(DataParallel, RefusesWhatItCannotDoBeforeAnyCollective) {
  TrainerOptions o;
  o.batch = 4;
  o.data_parallel.communicator = std::make_shared<Unreachable>();
  o.data_parallel.global_batch = 8;
  TrainerOptions bad_stage = o;
  bad_stage.data_parallel.zero_stage = 3;
  expect_refused(bad_stage, "ZeRO stage 3: the stages are 0, 1 and 2");
  TrainerOptions too_big = o;
  too_big.batch = 9;
  expect_refused(too_big, "a batch of 9 cannot be its share of a global batch of 8");
  TrainerOptions no_bucket = o;
  no_bucket.data_parallel.bucket_bytes = 0;
  expect_refused(no_bucket, "bucket size must be > 0");
}

}  // namespace
}  // namespace ferry::test
