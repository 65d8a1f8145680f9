// Checkpoints (ferry/runtime/checkpoint.hpp, docs/checkpoints.md): 2N steps against N steps, a
// save, a load into a new trainer and N more steps give bit-identical losses and state, in every
// home, optimizer, precision and phase mode; a damaged, truncated, foreign, newer or mismatched
// file is refused with a clear error and the trainer keeps its state; writes are atomic.
#include <fmt/format.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>

#include "../runtime/checkpoint_format.hpp"
#include "../runtime/checkpoint_space.hpp"
#include "../runtime/output_file.hpp"
#include "../runtime/trainer_internals.hpp"
#include "ferry/ferry.hpp"
#include "test_models.hpp"
#include "test_support.hpp"
#include "train_check.hpp"
#include "trainer_state.hpp"

namespace ferry::test {
namespace {

namespace fs = std::filesystem;
using Tensors = std::map<std::string, std::vector<std::byte>>;

// A folder of its own per test, removed afterwards.
class Scratch {
 public:
  Scratch() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = fmt::format("ferry-ckpt-{}-{}-{}", getpid(), info->test_suite_name(), info->name());
    for (char& c : name) {
      if (c == '/') c = '_';
    }
    dir_ = fs::temp_directory_path() / name;
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  ~Scratch() { fs::remove_all(dir_); }
  fs::path operator/(const std::string& f) const { return dir_ / f; }
  const fs::path& dir() const { return dir_; }

 private:
  fs::path dir_;
};

std::vector<std::byte> read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(c.size());
  std::memcpy(out.data(), c.data(), c.size());
  return out;
}

void write_file(const fs::path& p, std::span<const std::byte> bytes) {
  fs::remove(p);  // a new file, not a truncated one (ext4 flushes a truncated file when it is closed)
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// Everything a resume must reproduce: every persistent tensor as stored and the counters.
struct State {
  Tensors tensors;
  std::uint64_t steps = 0, overflows = 0;
  float lr = 0, scale = 0;
  PhaseController::Counts counts;
  Phase next = Phase::full;
};

State state_of(const Trainer& t) {
  State s;
  s.tensors = tensors_of(t);
  s.steps = t.steps_done();
  s.overflows = t.overflow_steps();
  s.lr = t.lr();
  s.scale = t.loss_scale();
  if (t.phases()) {
    s.counts = t.phases()->counts();
    s.next = t.phases()->next();
  }
  return s;
}

void expect_same_state(const State& a, const State& b, const std::string& what) {
  EXPECT_EQ(a.steps, b.steps) << what;
  EXPECT_EQ(a.overflows, b.overflows) << what;
  EXPECT_EQ(a.lr, b.lr) << what;
  EXPECT_EQ(a.scale, b.scale) << what;
  EXPECT_EQ(a.next, b.next) << what;
  for (std::size_t i = 0; i < phase_count; ++i) EXPECT_EQ(a.counts.steps[i], b.counts.steps[i]) << what;
  EXPECT_EQ(a.counts.runs, b.counts.runs) << what;
  EXPECT_EQ(a.counts.restores, b.counts.restores) << what;
  ASSERT_EQ(a.tensors.size(), b.tensors.size()) << what;
  for (const auto& [name, bytes] : a.tensors) {
    EXPECT_TRUE(b.tensors.at(name) == bytes) << what << ": tensor " << name << " differs";
  }
}

// Step s of every run: its own batch, and a learning rate that changes (a schedule).
struct Stepped {
  std::uint32_t loss_bits;
  Phase phase;
  bool updated, overflow;
  bool operator==(const Stepped&) const = default;
};

Stepped do_step(Trainer& t, int s) {
  const auto& o = t.options();
  const auto images = random_vector(o.batch * sample_elems(t.model()), 300 + s);
  const auto labels = labels_for(o.batch, 500 + s);
  t.set_lr(o.lr / (1.0f + 0.05f * static_cast<float>(s)));
  const auto r = t.step(images, labels);
  std::uint32_t bits;
  std::memcpy(&bits, &r.loss, 4);
  return {bits, r.phase, r.updated, r.overflow};
}

struct Case {
  std::string name;
  ModelSpec (*model)();
  TrainerOptions (*options)(Runtime&, const ModelSpec&);
  int total = 8;
  std::vector<int> splits{4};
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

TrainerOptions base() {
  TrainerOptions o;
  o.batch = 8;
  o.lr = 0.01f;
  return o;
}

PhaseConfig hybrid_config() {
  PhaseConfig p;
  p.hybrid = true;
  p.warmup_steps = 2;
  p.min_full_steps = 1;
  p.max_predict_steps = 4;
  p.confidence = 0.01f;  // predict as soon as allowed
  p.max_loss_gap = 1e6f;
  p.sigma_limit = 1e6f;
  return p;
}

const Case cases[] = {
    {"resident", small_mlp, [](Runtime&, const ModelSpec&) { return base(); }},
    {"streamed", small_mlp,
     [](Runtime& rt, const ModelSpec& m) {
       auto o = base();
       o.residency.mode = graph::ResidencyMode::stream;
       o.residency.budget_bytes = stream_budget(rt, m, o);
       return o;
     }},
    {"compressed_state_and_weights", small_cnn,
     [](Runtime&, const ModelSpec&) {
       auto o = base();
       o.residency.state_home = graph::Home::host_compressed;
       o.residency.weights_home = graph::Home::host_compressed;
       o.residency.homes.codec.chunk_bytes = 4096;
       return o;
     }},
    {"adamw8bit", small_mlp,
     [](Runtime&, const ModelSpec&) {
       auto o = base();
       o.optimizer.kind = ops::OptimizerConfig::Kind::adamw8bit;
       o.optimizer.block8bit = 256;
       o.optimizer.adam.weight_decay = 0.01f;
       return o;
     }},
    {"adamw8bit_compressed", small_mlp,
     [](Runtime&, const ModelSpec&) {
       auto o = base();
       o.optimizer.kind = ops::OptimizerConfig::Kind::adamw8bit;
       o.optimizer.block8bit = 256;
       o.residency.state_home = graph::Home::host_compressed;
       return o;
     }},
    {"sgd_mapped", small_cnn,
     [](Runtime&, const ModelSpec&) {
       auto o = base();
       o.optimizer.kind = ops::OptimizerConfig::Kind::sgd;
       o.residency.mode = graph::ResidencyMode::mapped;
       return o;
     }},
    {"bf16", small_residual,
     [](Runtime&, const ModelSpec&) {
       auto o = base();
       o.precision.compute = graph::DType::bf16;
       return o;
     }},
    // A scale far too large: the first steps overflow and halve it, then it grows every 3 clean
    // steps; the splits land in both stretches.
    {"fp16_loss_scaling",
     small_mlp,
     [](Runtime&, const ModelSpec&) {
       auto o = base();
       o.precision.compute = graph::DType::f16;
       o.precision.initial_scale = 16777216.0f;
       o.precision.growth_interval = 3;
       return o;
     },
     14,
     {2, 5, 9, 12}},
    {"hybrid",
     small_mlp,
     [](Runtime&, const ModelSpec&) {
       auto o = base();
       o.phases = hybrid_config();
       return o;
     },
     12,
     {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}},
    // Predict runs that diverge at once: the weights are put back from the restore point, which a
    // checkpoint inside a run must carry.
    {"hybrid_restores_streamed",
     small_mlp,
     [](Runtime& rt, const ModelSpec& m) {
       auto o = base();
       o.phases = hybrid_config();
       o.phases.max_predict_steps = 8;
       o.phases.max_loss_gap = 1e-3f;
       o.residency.mode = graph::ResidencyMode::stream;
       o.residency.budget_bytes = stream_budget(rt, m, o);
       return o;
     },
     12,
     {3, 4, 5, 6, 7, 8, 9}},
    // All three: overflowed micro-batches dropped, the controller unmoved by overflowed updates.
    {"fp16_hybrid_accumulate",
     small_mlp,
     [](Runtime&, const ModelSpec&) {
       auto o = base();
       o.precision.compute = graph::DType::f16;
       o.precision.initial_scale = 16777216.0f;
       o.precision.growth_interval = 2;
       o.phases = hybrid_config();
       o.accumulate = 2;
       return o;
     },
     30,
     {3, 8, 13, 17, 21, 24, 27}},
    // Hybrid phases over accumulated updates: saves inside a group and inside a Predict run.
    {"hybrid_accumulate",
     small_mlp,
     [](Runtime&, const ModelSpec&) {
       auto o = base();
       o.phases = hybrid_config();
       o.accumulate = 2;
       return o;
     },
     16,
     {1, 3, 5, 6, 7, 8, 9, 10, 11, 13}},
    // A save in the middle of an accumulation group carries the gradient sums.
    {"accumulate",
     small_mlp,
     [](Runtime&, const ModelSpec&) {
       auto o = base();
       o.accumulate = 3;
       return o;
     },
     9,
     {1, 3, 4, 5}},
};

class CheckpointResume : public ::testing::TestWithParam<Case> {};

// The uninterrupted run against, for each split k, k steps + save + load into a new trainer
// (built with another seed, so its own weights differ) + the rest.
TEST_P(CheckpointResume, IsBitIdenticalToAnUninterruptedRun) {
  const Case& c = GetParam();
  Runtime rt;
  Scratch dir;
  const ModelSpec m = c.model();
  const TrainerOptions o = c.options(rt, m);
  if (o.residency.mode == graph::ResidencyMode::mapped && !rt.device().host_unified_memory) {
    GTEST_SKIP() << "mapped residency needs a device whose memory is the host's";
  }
  std::vector<Stepped> steps;
  State full;
  {
    Trainer t(rt, m, o);
    for (int s = 0; s < c.total; ++s) steps.push_back(do_step(t, s));
    full = state_of(t);
  }
  if (o.phases.hybrid) {
    int predicted = 0;
    for (const auto& s : steps) predicted += s.phase == Phase::predict;
    EXPECT_GT(predicted, 0) << "the hybrid case should predict some steps";
    if (o.phases.max_loss_gap < 1) {
      EXPECT_GT(full.counts.restores, 0u) << "this case should restore weights";
    }
  }
  if (o.residency.mode == graph::ResidencyMode::stream) {
    Trainer probe(rt, m, o);
    EXPECT_GT(probe.residency().fetches, 0u) << "the streamed case should stream";
  }
  if (o.precision.scaled()) {
    EXPECT_GT(full.overflows, 0u) << "the fp16 case should overflow at first";
  }
  for (const int k : c.splits) {
    const std::string what = fmt::format("{}: split after {} of {} steps", c.name, k, c.total);
    const auto path = dir / fmt::format("split{}.ckpt", k);
    const std::vector<std::byte> caller{std::byte{1}, std::byte{2}, static_cast<std::byte>(k)};
    {
      Trainer first(rt, m, o);
      for (int s = 0; s < k; ++s) ASSERT_EQ(do_step(first, s), steps[s]) << what << ", step " << s;
      first.save_checkpoint(path, caller);
    }
    TrainerOptions other = o;
    other.seed = 99;
    Trainer second(rt, m, other);
    do_step(second, 40);  // its own state, replaced by the load
    EXPECT_EQ(second.load_checkpoint(path), caller) << what;
    for (int s = k; s < c.total; ++s) {
      const Stepped got = do_step(second, s);
      EXPECT_EQ(got.loss_bits, steps[s].loss_bits) << what << ", step " << s;
      EXPECT_EQ(got.phase, steps[s].phase) << what << ", step " << s;
      EXPECT_EQ(got.overflow, steps[s].overflow) << what << ", step " << s;
    }
    expect_same_state(full, state_of(second), what);
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, CheckpointResume, ::testing::ValuesIn(cases),
                         [](const auto& info) { return info.param.name; });

// A trained trainer's checkpoint, and a second trainer whose state differs, to load it into.
struct Fixture {
  Runtime rt;
  Scratch dir;
  TrainerOptions o = [] {
    auto o = base();
    o.phases = hybrid_config();
    o.phases.max_predict_steps = 8;
    return o;
  }();
  fs::path path = dir / "good.ckpt";
  std::vector<std::byte> bytes;
  State saved;

  Fixture() {
    Trainer t(rt, small_mlp(), o);
    // Save inside a Predict run, so every kind of section is there.
    for (int s = 0; s < 30; ++s) {
      const auto r = do_step(t, s);
      if (r.phase == Phase::predict && t.phases()->next() == Phase::predict) break;
    }
    saved = state_of(t);
    t.save_checkpoint(path, std::vector<std::byte>(100, std::byte{7}));
    bytes = read_file(path);
  }
};

// Loading `file` into `t` throws E with every `needles` in its message, and t keeps its state.
template <class E>
void expect_refused(Trainer& t, const fs::path& file, std::initializer_list<std::string> needles,
                    const std::string& what) {
  const State before = state_of(t);
  try {
    t.load_checkpoint(file);
    ADD_FAILURE() << what << ": loaded without an error";
  } catch (const E& e) {
    const std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << what << ": '" << msg << "' lacks " << n;
  } catch (const std::exception& e) {
    ADD_FAILURE() << what << ": the wrong kind of error: " << e.what();
  }
  expect_same_state(before, state_of(t), what + " (the trainer must keep its state)");
}

// Every byte of the file flipped in turn, one at a time: each is detected, and the trainer keeps
// its weights; then the intact file still loads.
TEST(Checkpoint, EveryFlippedByteIsDetected) {
  Fixture f;
  ASSERT_GT(f.bytes.size(), 2000u);
  Trainer t(f.rt, small_mlp(), f.o);
  do_step(t, 77);
  const State before = state_of(t);
  const auto bad = f.dir / "bad.ckpt";
  std::size_t refused = 0;
  for (std::size_t i = 0; i < f.bytes.size(); ++i) {
    for (const auto flip : {std::byte{0xff}, std::byte{0x01}}) {
      auto copy = f.bytes;
      copy[i] ^= flip;
      write_file(bad, copy);
      try {
        t.load_checkpoint(bad);
        ADD_FAILURE() << "byte " << i << " flipped by " << int(flip) << " was not detected";
      } catch (const std::runtime_error& e) {
        ++refused;
        const std::string msg = e.what();
        if (msg.find(bad.string()) == std::string::npos) ADD_FAILURE() << "byte " << i << ": " << msg;
      } catch (const std::exception& e) {
        ADD_FAILURE() << "byte " << i << ": not a runtime_error: " << e.what();
      }
    }
    if (i % 1009 == 0) expect_same_state(before, state_of(t), fmt::format("after byte {}", i));
  }
  EXPECT_EQ(refused, 2 * f.bytes.size());
  expect_same_state(before, state_of(t), "after every flip");
  EXPECT_EQ(t.load_checkpoint(f.path), std::vector<std::byte>(100, std::byte{7}));
  expect_same_state(f.saved, state_of(t), "the intact file");
}

// `bytes` (a checkpoint) with element 1 of tensor `name` (or of its restore point) set to `value`,
// and that section's checksum made to hold again: a file whose every byte checks out.
std::vector<std::byte> with_value(std::vector<std::byte> bytes, const fs::path& scratch, const std::string& name,
                                  float value, bool restore = false) {
  write_file(scratch, bytes);
  const ckpt::Reader r(scratch);
  const ckpt::Contents c = ckpt::read_contents(r);
  const auto& tensors = c.fingerprint.tensors;
  const auto it = std::find_if(tensors.begin(), tensors.end(), [&](const auto& t) { return t.name == name; });
  if (it == tensors.end()) throw std::logic_error("no tensor " + name);
  const std::size_t i = static_cast<std::size_t>(it - tensors.begin());
  const ckpt::Section& sec = restore ? c.restores.at(i) : c.tensors.at(i);
  std::memcpy(bytes.data() + sec.payload() + 4 + name.size() + sizeof value, &value, sizeof value);
  const std::uint64_t sum = checkpoint_checksum(bytes.data() + sec.offset, ckpt::section_head_bytes + sec.length);
  std::memcpy(bytes.data() + sec.payload() + sec.length, &sum, sizeof sum);
  return bytes;
}

// A value that is not a finite number where training cannot have put one is refused naming the
// file, tensor, element and value, and the trainer keeps its state; an infinity in Adam's second
// moment (a finite gradient whose square overflowed: the run trains on with it) loads.
TEST(Checkpoint, NonFiniteValuesWhereTrainingCannotPutThemAreRefused) {
  Fixture f;
  Trainer t(f.rt, small_mlp(), f.o);
  do_step(t, 77);
  const auto bad = f.dir / "bad.ckpt";
  const std::string w = t.parameter_names().at(0);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  write_file(bad, with_value(f.bytes, f.dir / "scratch.ckpt", w, nan));
  expect_refused<std::invalid_argument>(
      t, bad, {"bad.ckpt", "not a finite number", "element 1 of weight '" + w + "'", "is nan", "earlier checkpoint"},
      "a NaN weight");
  write_file(bad, with_value(f.bytes, f.dir / "scratch.ckpt", w, -inf, /*restore=*/true));
  expect_refused<std::invalid_argument>(t, bad, {"restore point", w, "is -inf"}, "an infinite weight to restore");
  write_file(bad, with_value(f.bytes, f.dir / "scratch.ckpt", w + ".adam_m", nan));
  expect_refused<std::invalid_argument>(t, bad, {"optimizer state '" + w + ".adam_m'", "is nan"}, "a NaN moment");

  write_file(bad, with_value(f.bytes, f.dir / "scratch.ckpt", w + ".adam_v", inf));
  t.load_checkpoint(bad);
  State want = f.saved;
  std::memcpy(want.tensors.at(w + ".adam_v").data() + sizeof inf, &inf, sizeof inf);
  expect_same_state(want, state_of(t), "an infinite second moment, loaded");
}

// ferry checkpoint has no trainer: it judges the tensors' roles by their names (ckpt::role_by_name)
// to say whether a resume refuses a value, and must judge as the trainer's roles do, for every
// configuration of the resume cases and a GPT with 8-bit state and hybrid phases.
TEST(Checkpoint, RolesJudgedByNamesAreTheTrainersRoles) {
  Runtime rt;
  const Scratch dir;
  std::vector<std::pair<std::string, std::function<std::unique_ptr<Trainer>()>>> trainers;
  for (const Case& c : cases) {
    trainers.emplace_back(c.name, [&rt, &c] {
      const ModelSpec m = c.model();
      return std::make_unique<Trainer>(rt, m, c.options(rt, m));
    });
  }
  trainers.emplace_back("gpt_adamw8bit_hybrid_accumulate", [&rt] {
    TrainerOptions o = base();
    o.optimizer.kind = ops::OptimizerConfig::Kind::adamw8bit;
    o.phases = hybrid_config();
    o.accumulate = 2;
    return std::make_unique<Trainer>(rt, models::gpt({.vocab = 16, .width = 16, .depth = 1, .heads = 2, .context = 8}),
                                     o);
  });
  for (const auto& [name, make] : trainers) {
    SCOPED_TRACE(name);
    const std::unique_ptr<Trainer> t = make();
    const auto path = dir / (name + ".ckpt");
    t->save_checkpoint(path);
    const ckpt::Reader reader(path);
    const ckpt::Contents c = ckpt::read_contents(reader);
    const graph::TensorTable& tensors = compiled_train_step(*t).graph().tensors;
    for (std::size_t i = 0; i < c.fingerprint.tensors.size(); ++i) {
      const std::string& tensor = c.fingerprint.tensors[i].name;
      const auto at = std::find(tensors.name.begin(), tensors.name.end(), tensor);
      ASSERT_NE(at, tensors.name.end()) << tensor;
      EXPECT_EQ(ckpt::role_by_name(c.fingerprint, i), tensors.role[at - tensors.name.begin()]) << tensor;
    }
  }
}

// What ferry checkpoint says of a file it read whole (ckpt::resume_refusal): the first value a
// resume refuses, judged by names; none for an infinite second moment, which a resume takes.
TEST(Checkpoint, ResumeRefusalIsSaidWithoutATrainer) {
  Fixture f;
  Trainer t(f.rt, small_mlp(), f.o);
  const auto bad = f.dir / "bad.ckpt";
  const std::string w = t.parameter_names().at(0);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const auto refusal = [&](const std::vector<std::byte>& bytes) {
    write_file(bad, bytes);
    const ckpt::Reader reader(bad);
    return ckpt::resume_refusal(ckpt::read_contents(reader));
  };
  EXPECT_EQ(refusal(f.bytes), std::nullopt);
  EXPECT_EQ(refusal(with_value(f.bytes, f.dir / "scratch.ckpt", w, nan)), "element 1 of weight '" + w + "' is nan");
  EXPECT_EQ(refusal(with_value(f.bytes, f.dir / "scratch.ckpt", w, -inf, /*restore=*/true)),
            "element 1 of the restore point (weights before a Predict run) of '" + w + "' is -inf");
  EXPECT_EQ(refusal(with_value(f.bytes, f.dir / "scratch.ckpt", w + ".adam_m", nan)),
            "element 1 of optimizer state '" + w + ".adam_m' is nan");
  EXPECT_EQ(refusal(with_value(f.bytes, f.dir / "scratch.ckpt", w + ".adam_v", inf)), std::nullopt);
}

TEST(Checkpoint, TruncatedOrExtendedFilesAreRefused) {
  Fixture f;
  Trainer t(f.rt, small_mlp(), f.o);
  const auto bad = f.dir / "short.ckpt";
  const std::size_t n = f.bytes.size();
  for (const std::size_t keep : {std::size_t{0}, std::size_t{5}, std::size_t{8}, std::size_t{39}, std::size_t{40},
                                 std::size_t{50}, n / 3, n / 2, n - 25, n - 8, n - 1}) {
    write_file(bad, std::span(f.bytes).first(keep));
    expect_refused<std::runtime_error>(t, bad, {bad.string()}, fmt::format("{} of {} bytes", keep, n));
  }
  auto longer = f.bytes;
  longer.push_back(std::byte{0});
  write_file(bad, longer);
  expect_refused<std::runtime_error>(t, bad, {"corrupt", "follow"}, "a byte appended");
}

TEST(Checkpoint, ForeignMissingAndNewerFilesAreRefused) {
  Fixture f;
  Trainer t(f.rt, small_mlp(), f.o);
  const auto foreign = f.dir / "notes.txt";
  const std::string text = "these are not the weights you are looking for\n";
  write_file(foreign, std::as_bytes(std::span(text)));
  expect_refused<std::runtime_error>(t, foreign, {"not a ferry checkpoint", "notes.txt"}, "a text file");
  expect_refused<std::runtime_error>(t, f.dir / "nowhere.ckpt", {"cannot open", "nowhere.ckpt"}, "a missing file");
  expect_refused<std::runtime_error>(t, f.dir.dir(), {"is a folder, not a regular file"}, "a folder");

  // The next format version with a valid header checksum (64-bit FNV-1a over the first 32 bytes,
  // as 8-byte little-endian words).
  auto newer = f.bytes;
  const std::uint32_t next = checkpoint_format_version + 1;
  std::memcpy(newer.data() + 8, &next, 4);
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (int w = 0; w < 4; ++w) {
    std::uint64_t word;
    std::memcpy(&word, newer.data() + 8 * w, 8);
    h = (h ^ word) * 0x100000001b3ull;
  }
  EXPECT_EQ(h, checkpoint_checksum(newer.data(), 32));
  std::memcpy(newer.data() + 32, &h, 8);
  const auto newer_path = f.dir / "newer.ckpt";
  write_file(newer_path, newer);
  expect_refused<std::runtime_error>(t, newer_path, {fmt::format("format version {}", next), "newer", "newer.ckpt"},
                                     "a newer format");
}

TEST(Checkpoint, AnotherModelOptimizerOrBatchIsRefused) {
  Fixture f;
  {
    Trainer cnn(f.rt, small_cnn(), f.o);
    expect_refused<std::invalid_argument>(cnn, f.path, {"model is 'small-mlp'", "'small-cnn'", "good.ckpt"},
                                          "another model");
  }
  {
    auto o = f.o;
    o.optimizer.kind = ops::OptimizerConfig::Kind::sgd;
    Trainer sgd(f.rt, small_mlp(), o);
    expect_refused<std::invalid_argument>(sgd, f.path, {"optimizer is adam", "sgd", "--optimizer adam"},
                                          "another optimizer");
  }
  {
    auto o = f.o;
    o.batch = 16;
    Trainer b16(f.rt, small_mlp(), o);
    expect_refused<std::invalid_argument>(b16, f.path, {"batch is 8", "--batch 8", "TrainerOptions::batch"},
                                          "another batch");
  }
  {
    // A GPT of the same sizes over another text: its vocabulary, not its sizes, differs.
    const auto gpt = [](std::uint32_t vocab) {
      return models::gpt({.vocab = vocab, .width = 16, .depth = 1, .heads = 2, .context = 8});
    };
    TrainerOptions o;
    o.batch = 2;
    Trainer written(f.rt, gpt(16), o);
    const fs::path path = f.path.parent_path() / "gpt.ckpt";
    written.save_checkpoint(path);
    Trainer other_text(f.rt, gpt(12), o);
    expect_refused<std::invalid_argument>(
        other_text, path, {"its text had 16 distinct characters and this one has 12", "--text"}, "another text");
  }
  {
    auto o = f.o;
    o.phases = PhaseConfig{};
    Trainer full(f.rt, small_mlp(), o);
    expect_refused<std::invalid_argument>(full, f.path, {"phases are hybrid"}, "no hybrid phases");
  }
  {
    // The same model name with another width: the tensors differ.
    const auto wider = [] {
      return models::classifier("small-mlp", graph::Shape{1, 4, 5}, 10, [](graph::Builder& b, TensorId x) {
        x = b.flatten(x);
        x = b.relu(b.linear(x, 14));
        return b.linear(x, 10);
      });
    };
    Trainer w(f.rt, wider(), f.o);
    // Its smaller optimizer state is not taken for one rank's share of a ZeRO checkpoint.
    expect_refused<std::invalid_argument>(w, f.path, {"tensor 'linear0.w'", "load it into the model that wrote it"},
                                          "another width");
  }
}

// `bytes` (a checkpoint of format version 2) as version 1 wrote it: no SETS section after MODL,
// the END! section's count and offset and every checksum made again.
std::vector<std::byte> as_format_1(std::vector<std::byte> bytes) {
  const auto u64_at = [&](std::size_t at) {
    std::uint64_t v;
    std::memcpy(&v, bytes.data() + at, 8);
    return v;
  };
  const auto section_end = [&](std::size_t at) { return at + 16 + u64_at(at + 8) + 8; };
  const std::size_t sets = section_end(40);
  EXPECT_EQ(std::memcmp(bytes.data() + sets, "SETS", 4), 0);
  const std::size_t sets_bytes = section_end(sets) - sets;
  bytes.erase(bytes.begin() + static_cast<std::ptrdiff_t>(sets),
              bytes.begin() + static_cast<std::ptrdiff_t>(sets + sets_bytes));
  const std::uint32_t v1 = 1;
  std::memcpy(bytes.data() + 8, &v1, 4);
  const std::uint64_t head_sum = checkpoint_checksum(bytes.data(), 32);
  std::memcpy(bytes.data() + 32, &head_sum, 8);
  const std::size_t end = bytes.size() - 40;  // END!: 16 bytes of head, 16 of payload, 8 of checksum
  EXPECT_EQ(std::memcmp(bytes.data() + end, "END!", 4), 0);
  const std::uint64_t sections = u64_at(end + 16) - 1, offset = u64_at(end + 24) - sets_bytes;
  std::memcpy(bytes.data() + end + 16, &sections, 8);
  std::memcpy(bytes.data() + end + 24, &offset, 8);
  const std::uint64_t end_sum = checkpoint_checksum(bytes.data() + end, 32);
  std::memcpy(bytes.data() + end + 32, &end_sum, 8);
  return bytes;
}

// The settings a resume keeps (ferry/runtime/training_setting.hpp): another value is refused,
// naming the setting and its flag, unless the load accepts it; what a resume need not keep (the
// learning rate: the checkpoint's is taken) loads. A file of format version 1 has none to compare.
TEST(Checkpoint, OtherTrainingSettingsAreRefusedUnlessAccepted) {
  Fixture f;
  const auto with = [&](auto change) {
    auto o = f.o;
    change(o);
    return o;
  };
  const auto other_decay = with([](TrainerOptions& o) { o.optimizer.adam.weight_decay = 0.01f; });
  {
    Trainer t(f.rt, small_mlp(), other_decay);
    expect_refused<std::invalid_argument>(
        t, f.path,
        {"trained with --weight-decay 0,", "this trainer has --weight-decay 0.01", "use --weight-decay 0",
         "a program may load it with LoadOptions::accept_other_settings", "good.ckpt"},
        "another weight decay");
    t.load_checkpoint(f.path, LoadOptions{.accept_other_settings = true});
    expect_same_state(f.saved, state_of(t), "another weight decay, accepted");
  }
  {
    Trainer t(f.rt, small_mlp(), with([](TrainerOptions& o) { o.optimizer.adam.eps = 1e-6f; }));
    expect_refused<std::invalid_argument>(t, f.path, {"optimizer.adam.eps = 1e-08", "optimizer.adam.eps = 1e-06"},
                                          "another eps (no flag)");
  }
  {
    Trainer t(f.rt, small_mlp(), with([](TrainerOptions& o) { o.phases.predict_int8 = true; }));
    expect_refused<std::invalid_argument>(
        t, f.path, {"trained without --predict-int8", "this trainer has --predict-int8", "leave out --predict-int8"},
        "int8 Predict steps");
  }
  {
    // Dropped optimizer state is zeros at every update: a resume may neither drop the state a run
    // kept nor keep the state it dropped.
    Trainer t(f.rt, small_mlp(), with([](TrainerOptions& o) { o.residency.state_home = graph::Home::dropped; }));
    expect_refused<std::invalid_argument>(t, f.path,
                                          {"trained without --state-home dropped",
                                           "this trainer has --state-home dropped", "leave out --state-home dropped"},
                                          "dropping kept state");
    const fs::path dropped = f.dir / "dropped.ckpt";
    t.save_checkpoint(dropped);
    Trainer kept(f.rt, small_mlp(), f.o);
    expect_refused<std::invalid_argument>(
        kept, dropped,
        {"trained with --state-home dropped", "this trainer runs without --state-home dropped",
         "use --state-home dropped"},
        "keeping dropped state");
  }
  {
    Trainer t(f.rt, small_mlp(), with([](TrainerOptions& o) { o.lr = 0.5f; }));
    t.load_checkpoint(f.path);
    expect_same_state(f.saved, state_of(t), "another first learning rate");
  }
  {
    // The 8-bit state's block is compared even when other settings are accepted: these weights
    // are one block at either size, and the scales would be read as the wrong blocks'.
    auto o = with([](TrainerOptions& o) { o.optimizer.kind = ops::OptimizerConfig::Kind::adamw8bit; });
    const fs::path eight = f.dir / "eight.ckpt";
    Trainer(f.rt, small_mlp(), o).save_checkpoint(eight);
    o.optimizer.block8bit = 256;
    Trainer t(f.rt, small_mlp(), o);
    const State before = state_of(t);
    try {
      t.load_checkpoint(eight, LoadOptions{.accept_other_settings = true});
      ADD_FAILURE() << "another 8-bit block loaded";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("--optimizer-block 2048"), std::string::npos) << e.what();
      // and the message does not offer the option that just failed
      EXPECT_EQ(std::string(e.what()).find("accept_other_settings"), std::string::npos) << e.what();
    }
    expect_same_state(before, state_of(t), "another 8-bit block, refused");
  }
  const fs::path old = f.dir / "format1.ckpt";
  write_file(old, as_format_1(f.bytes));
  {
    Trainer t(f.rt, small_mlp(), f.o);
    t.load_checkpoint(old);
    expect_same_state(f.saved, state_of(t), "a file of format version 1");
  }
  {
    Trainer t(f.rt, small_mlp(), other_decay);
    t.load_checkpoint(old);
    expect_same_state(f.saved, state_of(t), "a file of format version 1, another weight decay");
  }
}

// The settings list names every option that changes what training computes, by the name the
// check reports, and leaves out what is exact either way: a new option missing from the list
// fails here rather than resuming silently with another value.
TEST(TrainingSettings, EveryOptionThatChangesTheUpdateIsListed) {
  const auto kept = [](const ModelSpec& m, const TrainerOptions& o) {
    std::map<std::string, std::string> out;
    for (const TrainingSetting& s : training_settings(m, o)) {
      if (s.resume) out[s.name] = s.value;
    }
    return out;
  };
  // The names whose values differ between a and b (a name on one side only counts too).
  const auto differ = [&](const ModelSpec& m, const TrainerOptions& a, const TrainerOptions& b) {
    const auto x = kept(m, a), y = kept(m, b);
    std::set<std::string> names;
    for (const auto& [k, v] : x) {
      if (!y.contains(k) || y.at(k) != v) names.insert(k);
    }
    for (const auto& [k, v] : y) {
      if (!x.contains(k)) names.insert(k);
    }
    return names;
  };
  using Kind = ops::OptimizerConfig::Kind;
  const ModelSpec mlp = small_mlp();
  struct Case {
    const char* what;
    std::function<void(TrainerOptions&)> base, change;
    std::string name;  // must be among the names that differ
  };
  const auto none = [](TrainerOptions&) {};
  const auto sgd = [](TrainerOptions& o) { o.optimizer.kind = Kind::sgd; };
  const auto decayed = [](TrainerOptions& o) { o.optimizer.adam.weight_decay = 0.1f; };
  const auto hybrid = [](TrainerOptions& o) { o.phases.hybrid = true; };
  const auto fp16 = [](TrainerOptions& o) { o.precision.compute = ops::DType::f16; };
  const std::vector<Case> cases = {
      {"beta1", none, [](TrainerOptions& o) { o.optimizer.adam.beta1 = 0.8f; }, "optimizer.adam.beta1"},
      {"beta2", none, [](TrainerOptions& o) { o.optimizer.adam.beta2 = 0.99f; }, "optimizer.adam.beta2"},
      {"eps", none, [](TrainerOptions& o) { o.optimizer.adam.eps = 1e-6f; }, "optimizer.adam.eps"},
      {"adam decay", none, decayed, "optimizer.adam.weight_decay"},
      {"decay on", decayed, [](TrainerOptions& o) { o.optimizer.decay_on = ops::OptimizerConfig::DecayOn::matrices; },
       "optimizer.decay_on"},
      {"momentum", sgd, [](TrainerOptions& o) { o.optimizer.sgd.momentum = 0.5f; }, "optimizer.sgd.momentum"},
      {"nesterov", sgd, [](TrainerOptions& o) { o.optimizer.sgd.nesterov = true; }, "optimizer.sgd.nesterov"},
      {"sgd decay", sgd, [](TrainerOptions& o) { o.optimizer.sgd.weight_decay = 0.1f; }, "optimizer.sgd.weight_decay"},
      {"8-bit block", [](TrainerOptions& o) { o.optimizer.kind = Kind::adamw8bit; },
       [](TrainerOptions& o) { o.optimizer.block8bit = 256; }, "optimizer.block8bit"},
      {"optimizer", none, sgd, "optimizer.kind"},
      {"accumulate", none, [](TrainerOptions& o) { o.accumulate = 2; }, "accumulate"},
      {"precision", none, [](TrainerOptions& o) { o.precision.compute = ops::DType::bf16; }, "precision.compute"},
      {"loss scaling", [](TrainerOptions& o) { o.precision.compute = ops::DType::bf16; },
       [](TrainerOptions& o) { o.precision.scaling = PrecisionConfig::Scaling::on; }, "precision.scaled"},
      {"growth interval", fp16, [](TrainerOptions& o) { o.precision.growth_interval = 10; },
       "precision.growth_interval"},
      {"phases", none, hybrid, "phases.hybrid"},
      {"predictor", hybrid,
       [](TrainerOptions& o) { o.phases.predictor.kind = ops::PredictorConfig::Kind::least_squares; },
       "phases.predictor.kind"},
      {"predictor beta", hybrid, [](TrainerOptions& o) { o.phases.predictor.beta = 0.9f; }, "phases.predictor.beta"},
      {"max gain", hybrid, [](TrainerOptions& o) { o.phases.predictor.max_gain = 2; }, "phases.predictor.max_gain"},
      {"residual", hybrid, [](TrainerOptions& o) { o.phases.predictor.residual = true; }, "phases.predictor.residual"},
      {"warmup", hybrid, [](TrainerOptions& o) { o.phases.warmup_steps = 3; }, "phases.warmup_steps"},
      {"min full", hybrid, [](TrainerOptions& o) { o.phases.min_full_steps = 3; }, "phases.min_full_steps"},
      {"max predict", hybrid, [](TrainerOptions& o) { o.phases.max_predict_steps = 3; }, "phases.max_predict_steps"},
      {"confidence", hybrid, [](TrainerOptions& o) { o.phases.confidence = 0.5f; }, "phases.confidence"},
      {"loss gap", hybrid, [](TrainerOptions& o) { o.phases.max_loss_gap = 0.5f; }, "phases.max_loss_gap"},
      {"sigma", hybrid, [](TrainerOptions& o) { o.phases.sigma_limit = 3; }, "phases.sigma_limit"},
      {"window", hybrid, [](TrainerOptions& o) { o.phases.loss_window = 8; }, "phases.loss_window"},
      {"decay", hybrid, [](TrainerOptions& o) { o.phases.predict_decay = 0.5f; }, "phases.predict_decay"},
      {"int8", hybrid, [](TrainerOptions& o) { o.phases.predict_int8 = true; }, "phases.predict_int8"},
      {"fit every", hybrid, [](TrainerOptions& o) { o.phases.fit_every = 2; }, "phases.fit_every"},
      {"dropped state", none, [](TrainerOptions& o) { o.residency.state_home = graph::Home::dropped; },
       "residency.state_dropped"},
  };
  for (const Case& c : cases) {
    TrainerOptions a;
    c.base(a);
    TrainerOptions b = a;
    c.change(b);
    EXPECT_TRUE(differ(mlp, a, b).contains(c.name)) << c.what << ": " << c.name << " is not listed as changed";
  }
  // Exact either way, or taken from the checkpoint: nothing a resume keeps changes.
  const std::vector<std::pair<const char*, std::function<void(TrainerOptions&)>>> free = {
      {"residency", [](TrainerOptions& o) { o.residency.mode = graph::ResidencyMode::stream; }},
      {"budget", [](TrainerOptions& o) { o.residency.budget_bytes = 1 << 30; }},
      {"recompute", [](TrainerOptions& o) { o.recompute = 2; }},
      {"fusion", [](TrainerOptions& o) { o.fuse = false; }},
      {"weight checks", [](TrainerOptions& o) { o.check_weights_every = 5; }},
      {"lr", [](TrainerOptions& o) { o.lr = 0.5f; }},
      {"seed", [](TrainerOptions& o) { o.seed = 9; }},
      {"zero stage", [](TrainerOptions& o) { o.data_parallel.zero_stage = 1; }},
      {"host optimizer", [](TrainerOptions& o) { o.residency.host_optimizer = true; }},
      {"compressed state", [](TrainerOptions& o) { o.residency.state_home = graph::Home::host_compressed; }},
      {"decay on, no decay", [](TrainerOptions& o) { o.optimizer.decay_on = ops::OptimizerConfig::DecayOn::matrices; }},
      {"momentum under Adam", [](TrainerOptions& o) { o.optimizer.sgd.momentum = 0.5f; }},
      {"phase settings, no phases", [](TrainerOptions& o) { o.phases.confidence = 0.5f; }},
  };
  for (const auto& [what, change] : free) {
    TrainerOptions b;
    change(b);
    EXPECT_TRUE(differ(mlp, TrainerOptions{}, b).empty()) << what << " changed a setting a resume keeps";
  }
  // The model's own: the GPT's dropout and attention path.
  const auto gpt = [](float dropout, bool fused) {
    return models::gpt(
        {.vocab = 16, .width = 16, .depth = 1, .heads = 2, .context = 8, .dropout = dropout, .fused_attention = fused});
  };
  const TrainerOptions o;
  EXPECT_NE(kept(gpt(0.0f, true), o), kept(gpt(0.1f, true), o));
  EXPECT_EQ(kept(gpt(0.1f, true), o).at("gpt.dropout"), "0.1");
  EXPECT_EQ(kept(gpt(0.0f, false), o).at("gpt.attention"), "unfused");
}

// A save replaces the file whole and leaves nothing else in its folder; a save that cannot be
// written names the path, and the probe refuses bad paths before any training.
TEST(Checkpoint, WritesAreAtomicAndBadPathsAreRefusedEarly) {
  Fixture f;
  Trainer t(f.rt, small_mlp(), f.o);
  t.save_checkpoint(f.path);  // over the fixture's file
  EXPECT_NE(read_file(f.path), f.bytes);
  std::size_t files = 0;
  for (const auto& e : fs::directory_iterator(f.dir.dir())) {
    ++files;
    EXPECT_EQ(e.path().filename(), "good.ckpt") << "a temporary file was left behind";
  }
  EXPECT_EQ(files, 1u);
  EXPECT_TRUE(t.load_checkpoint(f.path).empty());

  for (const bool save : {false, true}) {  // an empty path names no file
    try {
      save ? t.save_checkpoint(fs::path()) : check_checkpoint_path(fs::path());
      ADD_FAILURE() << "an empty path taken as a checkpoint path";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("it names no file"), std::string::npos) << e.what();
    }
  }

  const auto missing = f.dir / "no-such-folder" / "x.ckpt";
  try {
    t.save_checkpoint(missing);
    ADD_FAILURE() << "saved into a missing folder";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("no-such-folder"), std::string::npos) << e.what();
  }
  EXPECT_THROW(check_checkpoint_path(missing), std::runtime_error);
  try {
    check_checkpoint_path(missing);
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("does not exist"), std::string::npos) << e.what();
  }
  try {
    check_checkpoint_path(f.dir.dir());
    ADD_FAILURE() << "a folder as the checkpoint path";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("is a folder"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(check_checkpoint_path(f.dir / "later.ckpt"));
  EXPECT_FALSE(fs::exists(f.dir / "later.ckpt"));
  files = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(f.dir.dir())) ++files;
  EXPECT_EQ(files, 1u) << "the probe left a file behind";

  // A name as long as the file system takes: the temporary file beside it gets a shorter name (it
  // once took the name and a suffix, and the save failed after the training it was to keep); one
  // byte longer is refused before anything is written.
  const long name_max = ::pathconf(f.dir.dir().c_str(), _PC_NAME_MAX);
  ASSERT_GT(name_max, 16);
  const fs::path longest = f.dir / std::string(static_cast<std::size_t>(name_max), 'n');
  EXPECT_NO_THROW(check_checkpoint_path(longest));
  t.save_checkpoint(longest);
  EXPECT_TRUE(t.load_checkpoint(longest).empty());
  fs::remove(longest);
  try {
    check_checkpoint_path(f.dir / std::string(static_cast<std::size_t>(name_max) + 1, 'n'));
    ADD_FAILURE() << "a name longer than the file system takes";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("give a shorter name"), std::string::npos) << e.what();
  }
  files = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(f.dir.dir())) ++files;
  EXPECT_EQ(files, 1u) << "a long name's save or probe left a file behind";
}

// The library, not only the CLI, leaves alone what a checkpoint must not replace: a foreign file
// (unless asked), a symbolic link, a folder. An empty file is taken (a name made for it).
TEST(Checkpoint, SaveNeverReplacesWhatIsNotACheckpoint) {
  Fixture f;
  Trainer t(f.rt, small_mlp(), f.o);
  const auto notes = f.dir / "notes.txt";
  { std::ofstream(notes) << "my notes\n"; }
  const auto expect_refused = [&](const fs::path& p, const char* needle) {
    try {
      t.save_checkpoint(p);
      ADD_FAILURE() << "saved over " << p;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_refused(notes, "is not a checkpoint ferry wrote, so it is left as it is");
  EXPECT_EQ(read_file(notes).size(), 9u);
  const auto link = f.dir / "link.ckpt";
  fs::create_symlink(f.path, link);
  expect_refused(link, "it is a symbolic link");
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(read_file(f.path), f.bytes);
  fs::create_directory(f.dir / "folder.ckpt");
  expect_refused(f.dir / "folder.ckpt", "it is a folder");

  t.save_checkpoint(notes, {}, {.replace_foreign_file = true});  // on purpose
  EXPECT_TRUE(t.load_checkpoint(notes).empty());
  const auto empty = f.dir / "empty.ckpt";
  { std::ofstream{empty}; }
  t.save_checkpoint(empty);
  EXPECT_TRUE(t.load_checkpoint(empty).empty());
}

// A run writing its checkpoints at a path holds the path's lock while it runs (TrainingLoop,
// `ferry train --checkpoint`); save_checkpoint called alone had not asked for it and replaced that
// run's checkpoint. It takes the lock for its write now, and is refused while another holds it.
TEST(Checkpoint, SaveLeavesTheCheckpointOfARunWritingThereAlone) {
  Fixture f;
  Trainer t(f.rt, small_mlp(), f.o);
  {
    const OutputLock other_run(f.path, "checkpoint");
    try {
      t.save_checkpoint(f.path);
      ADD_FAILURE() << "saved over the checkpoint of a run that holds its lock";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("is being written by another run (process " + std::to_string(::getpid())),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(read_file(f.path), f.bytes);
  }
  // A folder that is not there is named as such (not as the lock file that could not be made).
  try {
    t.save_checkpoint(f.dir / "nope" / "x.ckpt");
    ADD_FAILURE() << "saved into a folder that does not exist";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("does not exist: create it first"), std::string::npos) << e.what();
  }
  t.save_checkpoint(f.path);  // the lock released
  EXPECT_NE(read_file(f.path), f.bytes);
  for (const auto& e : fs::directory_iterator(f.dir.dir())) {
    EXPECT_EQ(e.path().filename().string().find(".lock"), std::string::npos) << "left behind: " << e.path();
  }
}

// The header names the format and the ferry version; the checksum is the documented one.
TEST(Checkpoint, HeaderLayout) {
  Fixture f;
  ASSERT_GE(f.bytes.size(), 40u);
  EXPECT_EQ(std::memcmp(f.bytes.data(), "FERRYCKP", 8), 0);
  std::uint32_t version = 0;
  std::memcpy(&version, f.bytes.data() + 8, 4);
  EXPECT_EQ(version, checkpoint_format_version);
  EXPECT_STREQ(reinterpret_cast<const char*>(f.bytes.data() + 16), ferry_version());
  std::uint64_t sum = 0;
  std::memcpy(&sum, f.bytes.data() + 32, 8);
  EXPECT_EQ(sum, checkpoint_checksum(f.bytes.data(), 32));
  EXPECT_EQ(std::memcmp(f.bytes.data() + 40, "MODL", 4), 0);
}

// checkpoint_bytes() is the file's size, known before it is written (the training loop checks
// the folder's free space with it): exactly, the caller's section added, for a plain trainer and
// inside a Predict run; outside one, a hybrid trainer's figure counts the weights a Predict run adds.
TEST(Checkpoint, ItsSizeIsKnownBeforeItIsWritten) {
  Runtime rt;
  Scratch dir;
  const std::vector<std::byte> caller(100, std::byte{7});
  {
    Trainer t(rt, small_mlp(), base());
    do_step(t, 0);
    const std::uint64_t before = t.checkpoint_bytes();
    t.save_checkpoint(dir / "plain.ckpt", caller);
    EXPECT_EQ(fs::file_size(dir / "plain.ckpt"), before + caller.size());
  }
  TrainerOptions o = base();
  o.phases = hybrid_config();
  o.phases.max_predict_steps = 8;
  Trainer t(rt, small_mlp(), o);
  const std::uint64_t at_start = t.checkpoint_bytes();
  t.save_checkpoint(dir / "full.ckpt", caller);
  std::uint64_t weights = 0;
  for (const auto& name : t.parameter_names()) weights += t.read_tensor(name).bytes.size();
  EXPECT_GT(at_start + caller.size(), fs::file_size(dir / "full.ckpt") + weights)
      << "outside a Predict run the figure counts the weights one would add";
  bool inside = false;
  for (int s = 0; s < 30 && !inside; ++s) {
    const auto r = do_step(t, s);
    inside = r.phase == Phase::predict && t.phases()->next() == Phase::predict;
  }
  ASSERT_TRUE(inside) << "the hybrid trainer should reach a Predict run";
  const std::uint64_t in_run = t.checkpoint_bytes();
  t.save_checkpoint(dir / "predict.ckpt", caller);
  EXPECT_EQ(fs::file_size(dir / "predict.ckpt"), in_run + caller.size());
}

// A run that writes more than one checkpoint needs room for two (the second is written beside the
// first), less what a checkpoint at the path now takes, which the first write replaces.
TEST(CheckpointSpace, ARunThatWritesTwiceNeedsRoomForTwoLessTheFileItReplaces) {
  EXPECT_EQ(checkpoints_need(100, 0), 200u) << "nothing there yet";
  EXPECT_EQ(checkpoints_need(100, 40), 160u) << "a smaller file there";
  EXPECT_EQ(checkpoints_need(100, 100), 100u) << "a resumed run's checkpoint of the same size";
  EXPECT_EQ(checkpoints_need(100, 500), 100u) << "a larger file there frees more than one needs";
}

// Ranks that write to one file system share its free space; ranks that write nothing need none.
TEST(CheckpointSpace, RanksOnOneFileSystemShareItsFreeSpace) {
  constexpr std::uint64_t MiB = 1 << 20;
  const CheckpointSpace alone_fits[] = {{5 * MiB, 5 * MiB, 1}};
  EXPECT_EQ(checkpoint_space_shortage(alone_fits), std::nullopt);
  const CheckpointSpace alone_short[] = {{5 * MiB, 5 * MiB - 1, 1}};
  const auto a = checkpoint_space_shortage(alone_short);
  ASSERT_TRUE(a.has_value());
  EXPECT_NE(a->find("checkpoints need 5.0 MiB"), std::string::npos) << *a;
  EXPECT_NE(a->find("has 5.0 MiB free"), std::string::npos) << *a;
  // Each fits alone, not the two together on file system 7; rank 1 writes elsewhere.
  const CheckpointSpace shared[] = {{3 * MiB, 5 * MiB, 7}, {4 * MiB, 100 * MiB, 8}, {3 * MiB, 5 * MiB, 7}};
  const auto s = checkpoint_space_shortage(shared);
  ASSERT_TRUE(s.has_value());
  EXPECT_NE(s->find("ranks 0 and 2 need 6.0 MiB"), std::string::npos) << *s;
  const CheckpointSpace apart[] = {{3 * MiB, 5 * MiB, 7}, {3 * MiB, 5 * MiB, 9}, {0, 0, 7}};
  EXPECT_EQ(checkpoint_space_shortage(apart), std::nullopt);
  const CheckpointSpace second_short[] = {{1 * MiB, 5 * MiB, 7}, {3 * MiB, 2 * MiB, 9}};
  const auto r = checkpoint_space_shortage(second_short);
  ASSERT_TRUE(r.has_value());
  EXPECT_NE(r->find("checkpoints of rank 1 need 3.0 MiB on a file system with 2.0 MiB free"), std::string::npos) << *r;
}

// The folder's own figures: the space the file system reports free, and a folder that cannot be
// asked gives nothing (the write reports it); a run into a folder with room trains.
TEST(CheckpointSpace, TheFolderIsAskedAndAFolderWithRoomPasses) {
  Scratch dir;
  const auto here = checkpoint_space_at(dir / "x.ckpt", 123);
  ASSERT_TRUE(here.has_value());
  EXPECT_EQ(here->need, 123u);
  EXPECT_GT(here->free, 0u);
  EXPECT_NE(here->file_system, 0u);
  EXPECT_EQ(checkpoint_space_at(dir / "missing" / "x.ckpt", 1), std::nullopt);
  EXPECT_NO_THROW(check_checkpoint_space(dir / "x.ckpt", 123, nullptr));
  EXPECT_NO_THROW(check_checkpoint_space(dir / "missing" / "x.ckpt", 123, nullptr));
  try {
    check_checkpoint_space(dir / "x.ckpt", here->free + (std::uint64_t{1} << 40), nullptr);
    ADD_FAILURE() << "a checkpoint larger than the free space should be refused";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find((dir / "x.ckpt").string()), std::string::npos) << msg;
    EXPECT_NE(msg.find("Nothing was trained"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace ferry::test
