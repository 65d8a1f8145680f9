// The checkpoint file format alone (runtime/checkpoint_format.hpp), without a trainer: a written
// file reads back as written; any one flipped bit and any truncation is refused with
// std::runtime_error; and the fuzzer's seed corpus (fuzz/corpus/checkpoint/) is still a set of
// valid files of the current format.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <limits>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "../runtime/checkpoint_format.hpp"
#include "../runtime/output_file.hpp"

namespace ferry {
namespace {

namespace fs = std::filesystem;

std::vector<char> slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void spit(const fs::path& p, const std::vector<char>& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

class CheckpointFormat : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / fmt_dir();
    fs::create_directories(dir_);
    fp_.model = "m";
    fp_.optimizer = "adamw";
    fp_.batch = 4;
    fp_.accumulate = 2;
    fp_.hybrid = 1;
    fp_.tensors = {{"w", 0, ops::Shape{}, 40}, {"b", 0, ops::Shape{}, 8}, {"w.m", 0, ops::Shape{}, 40}};
    fp_.tensors[0].shape.rank = 2;
    fp_.tensors[0].shape.dims = {2, 5, 0, 0};
    tr_.steps = 123;
    tr_.micro = 1;
    tr_.lr = 0.5f;
    tr_.phase_ms[2] = 7.25;
    tr_.phase_steps[1] = 99;
    tr_.loss_scale = 1024;
    tr_.clean_steps = 3;
    tr_.overflows = 2;
    tr_.in_predict_run = true;
    tr_.gains = {1, 2, 3, 4};
    ps_.next = Phase::correct;
    ps_.counts.runs = 5;
    ps_.length = 8;
    ps_.cut_short = true;
    ps_.last_quality = 0.75;
    ps_.losses = {3, 2, 1};
    ps_.predict_losses = {0.5};
    restores_ = {std::vector<std::byte>(40, std::byte{1}), std::vector<std::byte>(8, std::byte{2})};
  }
  void TearDown() override { fs::remove_all(dir_); }
  static std::string fmt_dir() {
    return "ferry-ckpt-format-" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "-" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
  }
  static std::byte value(std::size_t tensor, std::size_t k) { return static_cast<std::byte>(tensor * 17 + k * 3); }
  fs::path write(const std::string& name) {
    const fs::path p = dir_ / name;
    const std::byte caller[] = {std::byte{0xca}, std::byte{0xfe}};
    ckpt::write_checkpoint(
        p, fp_, tr_, ps_, caller,
        [](std::size_t i, std::vector<std::byte>& buf) {
          for (std::size_t k = 0; k < buf.size(); ++k) buf[k] = value(i, k);
        },
        restores_);
    return p;
  }

  fs::path dir_;
  ckpt::Fingerprint fp_;
  ckpt::TrainerRecord tr_;
  PhaseController::State ps_;
  std::vector<std::vector<std::byte>> restores_;
};

TEST_F(CheckpointFormat, ReadsBackWhatWasWritten) {
  const fs::path p = write("a.ckpt");
  const ckpt::Reader r(p);
  const ckpt::Contents c = ckpt::read_contents(r);
  EXPECT_EQ(c.fingerprint.model, "m");
  EXPECT_EQ(c.fingerprint.optimizer, "adamw");
  EXPECT_EQ(c.fingerprint.batch, 4u);
  EXPECT_EQ(c.fingerprint.accumulate, 2u);
  ASSERT_EQ(c.fingerprint.tensors.size(), 3u);
  EXPECT_EQ(c.fingerprint.tensors[0].shape, fp_.tensors[0].shape);
  EXPECT_EQ(c.fingerprint.tensors[2].name, "w.m");
  EXPECT_EQ(c.trainer.steps, 123u);
  EXPECT_EQ(c.trainer.micro, 1u);
  EXPECT_EQ(c.trainer.lr, 0.5f);
  EXPECT_EQ(c.trainer.phase_ms[2], 7.25);
  EXPECT_EQ(c.trainer.phase_steps[1], 99u);
  EXPECT_EQ(c.trainer.loss_scale, 1024.0f);
  EXPECT_EQ(c.trainer.clean_steps, 3u);
  EXPECT_EQ(c.trainer.overflows, 2u);
  EXPECT_TRUE(c.trainer.in_predict_run);
  EXPECT_EQ(c.trainer.gains, tr_.gains);
  ASSERT_TRUE(c.phases.has_value());
  EXPECT_EQ(c.phases->next, Phase::correct);
  EXPECT_EQ(c.phases->counts.runs, 5u);
  EXPECT_EQ(c.phases->length, 8u);
  EXPECT_TRUE(c.phases->cut_short);
  EXPECT_EQ(c.phases->last_quality, 0.75);
  EXPECT_EQ(c.phases->losses, ps_.losses);
  EXPECT_EQ(c.phases->predict_losses, ps_.predict_losses);
  EXPECT_EQ(c.caller, (std::vector<std::byte>{std::byte{0xca}, std::byte{0xfe}}));
  ASSERT_EQ(c.tensors.size(), 3u);
  ASSERT_EQ(c.restores.size(), 2u);
  std::vector<std::byte> buf;
  for (std::size_t i = 0; i < 3; ++i) {
    const auto v = ckpt::read_tensor(r, c.tensors[i], fp_.tensors[i].name.size(), buf);
    ASSERT_TRUE(v.has_value());
    ASSERT_EQ(v->size(), fp_.tensors[i].bytes);
    for (std::size_t k = 0; k < v->size(); ++k) ASSERT_EQ((*v)[k], value(i, k)) << i << " " << k;
  }
  for (std::size_t i = 0; i < 2; ++i) {
    const auto v = ckpt::read_tensor(r, c.restores[i], fp_.tensors[i].name.size(), buf);
    ASSERT_TRUE(v.has_value());
    EXPECT_TRUE(std::equal(v->begin(), v->end(), restores_[i].begin(), restores_[i].end()));
  }
  EXPECT_TRUE(c.non_finite.empty());
}

// The first value that is not a finite number in each f32, f16 and bf16 tensor is found while the
// checksums are read, wherever it lies against the 1 MiB chunks they are read in; 8-bit codes are
// not numbers to check.
TEST_F(CheckpointFormat, NonFiniteValuesAreFoundWhereTheyAre) {
  // "abc": its payload starts with 4 + 3 bytes of name, so element 262142 spans the first chunk's
  // end (payload bytes 1048575 to 1048578).
  const std::size_t big = 300000, straddling = 262142;
  const auto tensor = [](std::string name, ops::DType dtype, std::uint32_t elems) {
    ckpt::Fingerprint::Tensor t{std::move(name), static_cast<std::uint8_t>(dtype), ops::Shape{}, 0};
    t.shape.rank = 1;
    t.shape.dims = {elems, 0, 0, 0};
    t.bytes = std::uint64_t{elems} * ops::dtype_bytes(dtype);
    return t;
  };
  fp_.tensors = {tensor("abc", ops::DType::f32, big),   tensor("half", ops::DType::f16, 64),
                 tensor("brain", ops::DType::bf16, 64), tensor("codes", ops::DType::u8, 64),
                 tensor("fine", ops::DType::f32, 64),   tensor("late", ops::DType::f32, big)};
  tr_.gains = {1, 2};  // one restore: of "abc"
  restores_ = {std::vector<std::byte>(big * 4)};
  const auto put = [](std::vector<std::byte>& buf, std::size_t at, auto value) {
    std::memcpy(buf.data() + at * sizeof value, &value, sizeof value);
  };
  {
    std::vector<float> ones(big, 1.0f);
    ones[3] = -std::numeric_limits<float>::infinity();
    std::memcpy(restores_[0].data(), ones.data(), restores_[0].size());
  }
  const fs::path p = dir_ / "nf.ckpt";
  const std::byte caller[] = {std::byte{1}};
  ckpt::write_checkpoint(
      p, fp_, tr_, ps_, caller,
      [&](std::size_t i, std::vector<std::byte>& buf) {
        std::fill(buf.begin(), buf.end(), std::byte{0});  // zeros: finite in every dtype
        switch (i) {
          case 0:
            put(buf, straddling, std::numeric_limits<float>::quiet_NaN());
            put(buf, straddling + 1, std::numeric_limits<float>::infinity());  // not the first
            break;
          case 1:
            put(buf, 5, std::uint16_t{0x7C00});
            break;  // f16 +inf
          case 2:
            put(buf, 0, std::uint16_t{0xFF80});
            break;  // bf16 -inf
          case 3:
            std::fill(buf.begin(), buf.end(), std::byte{0xff});
            break;
          case 5:
            put(buf, big - 1, -std::numeric_limits<float>::quiet_NaN());
            break;  // the very last
          default:
            break;
        }
      },
      restores_);
  const ckpt::Reader r(p);
  const ckpt::Contents c = ckpt::read_contents(r);
  struct Want {
    std::size_t tensor;
    bool restore;
    std::uint64_t element;
    std::string value;
  };
  const std::vector<Want> want = {{0, false, straddling, "nan"},
                                  {1, false, 5, "inf"},
                                  {2, false, 0, "-inf"},
                                  {5, false, big - 1, "nan"},
                                  {0, true, 3, "-inf"}};
  ASSERT_EQ(c.non_finite.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    const auto& got = c.non_finite[i];
    EXPECT_EQ(got.tensor, want[i].tensor) << i;
    EXPECT_EQ(got.restore, want[i].restore) << i;
    EXPECT_EQ(got.element, want[i].element) << i;
    EXPECT_EQ(got.value_text(), want[i].value) << i;
  }
}

TEST_F(CheckpointFormat, EveryFlippedBitIsRefused) {
  const fs::path p = write("a.ckpt");
  const std::vector<char> good = slurp(p);
  ASSERT_GT(good.size(), 400u);
  const fs::path bad = dir_ / "bad.ckpt";
  for (std::size_t i = 0; i < good.size(); ++i) {
    std::vector<char> b = good;
    b[i] = static_cast<char>(b[i] ^ (1 << (i % 8)));
    spit(bad, b);
    const ckpt::Reader r(bad);
    EXPECT_THROW(ckpt::read_contents(r), std::runtime_error) << "bit " << i % 8 << " of byte " << i;
  }
}

TEST_F(CheckpointFormat, EveryTruncationIsRefused) {
  const fs::path p = write("a.ckpt");
  const std::vector<char> good = slurp(p);
  const fs::path bad = dir_ / "short.ckpt";
  for (std::size_t n = 0; n < good.size(); ++n) {
    spit(bad, std::vector<char>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n)));
    const ckpt::Reader r(bad);
    EXPECT_THROW(ckpt::read_contents(r), std::runtime_error) << n << " bytes";
  }
}

// What is wrong is said as what it is: an empty file as empty, a damaged reserved word of a
// section head as that (not as another section where one belongs).
TEST_F(CheckpointFormat, AnEmptyFileAndADamagedReservedWordAreNamed) {
  const auto message = [](const fs::path& path) {
    try {
      const ckpt::Reader r(path);
      ckpt::read_contents(r);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("(read without an error)");
  };
  const fs::path empty = dir_ / "empty.ckpt";
  spit(empty, {});
  EXPECT_NE(message(empty).find("is empty (0 bytes)"), std::string::npos) << message(empty);

  std::vector<char> b = slurp(write("a.ckpt"));
  ASSERT_GT(b.size(), 48u);
  b[45] = static_cast<char>(b[45] ^ 0x10);  // the first section's head starts after the 40-byte header
  const fs::path bad = dir_ / "reserved.ckpt";
  spit(bad, b);
  const std::string m = message(bad);
  EXPECT_NE(m.find("at byte 40 has 0x1000 in its reserved word (bytes 44 to 47)"), std::string::npos) << m;
}

TEST_F(CheckpointFormat, ATensorChangedAfterTheFirstPassIsNoticed) {
  const fs::path p = write("a.ckpt");
  const ckpt::Reader r(p);
  const ckpt::Contents c = ckpt::read_contents(r);
  std::vector<char> b = slurp(p);
  b[c.tensors[1].payload() + 4 + 1 + 3] ^= 1;  // after the 4-byte name length and the name "b"
  spit(p, b);                                  // the same inode: the open reader sees the change
  std::vector<std::byte> buf;
  EXPECT_TRUE(ckpt::read_tensor(r, c.tensors[0], 1, buf).has_value());
  EXPECT_FALSE(ckpt::read_tensor(r, c.tensors[1], 1, buf).has_value());
}

// Where the fuzzer's seed corpus is, relative to a root: the source tree, or the copy the build
// puts beside this test binary (tests/CMakeLists.txt).
const fs::path kSeedsUnderRoot = fs::path("fuzz") / "corpus" / "checkpoint";

// The seed directory, and every directory looked in, for the message when none holds it:
// $FERRY_SOURCE_DIR alone when it is set (an explicit answer is not second-guessed); otherwise
// the source tree this binary was built from, then this binary's directory (the build's copy) and
// each directory above it (a build tree inside a checkout that was moved or copied elsewhere: the
// compiled-in path is then another machine's).
std::pair<fs::path, std::vector<fs::path>> find_seeds() {
  std::vector<fs::path> roots;
  if (const char* env = std::getenv("FERRY_SOURCE_DIR"); env != nullptr && *env != '\0') {
    roots.emplace_back(env);
  } else {
#ifdef FERRY_SOURCE_DIR
    roots.emplace_back(FERRY_SOURCE_DIR);
#endif
    std::error_code ec;
    const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
    if (!ec) {
      for (fs::path dir = exe.parent_path(); !dir.empty(); dir = dir.parent_path()) {
        roots.push_back(dir);
        if (dir == dir.root_path()) break;
      }
    }
  }
  std::vector<fs::path> looked;
  for (const fs::path& root : roots) {
    looked.push_back(root / kSeedsUnderRoot);
    std::error_code ec;
    if (fs::is_directory(looked.back(), ec)) return {looked.back(), looked};
  }
  return {fs::path{}, looked};
}

// A FIFO is refused as not a regular file at once: opening one for reading waits for a writer,
// which none will ever be (ferry train --resume FIFO hung). If the open does wait, the test opens
// the FIFO for writing to free it, so it fails instead of hanging.
TEST_F(CheckpointFormat, AFifoIsRefusedWithoutWaitingForAWriter) {
  const fs::path fifo = dir_ / "pipe.ckpt";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  auto opened = std::async(std::launch::async, [&]() -> std::string {
    try {
      const ckpt::Reader r(fifo);
    } catch (const std::runtime_error& e) {
      return e.what();
    }
    return "";
  });
  if (opened.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << "ckpt::Reader waited for a writer of the FIFO " << fifo;
    const int writer = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (writer >= 0) ::close(writer);
  }
  const std::string message = opened.get();
  EXPECT_NE(message.find("is a FIFO (named pipe), not a regular file"), std::string::npos) << message;
  EXPECT_NE(message.find(fifo.string()), std::string::npos) << message;
}

// A write killed before its rename leaves its temporary file, as large as the checkpoint. The next
// write of the same checkpoint removes it when its process has ended on this host and the file is
// not recent; a live writer's, a recent one's and another file's temporaries are kept.
TEST_F(CheckpointFormat, AKilledWritesTemporaryIsRemovedByTheNextWrite) {
  const fs::path p = dir_ / "run.ckpt";
  // A process that has ended: a child's, waited for.
  const pid_t ended = ::fork();
  if (ended == 0) ::_exit(0);
  int status = 0;
  ASSERT_EQ(::waitpid(ended, &status, 0), ended);
  // `of`'s temporary as the process `pid` would name it on this host (temporary_beside's name,
  // this process's id replaced).
  const auto temporary_of = [](const fs::path& of, pid_t pid) {
    std::string name = temporary_beside(of, "tmp").filename().string();
    const std::string mine = "-" + std::to_string(::getpid()) + "-";
    name.replace(name.rfind(mine), mine.size(), "-" + std::to_string(pid) + "-");
    return of.parent_path() / name;
  };
  const auto leave = [](const fs::path& t, bool old) {
    std::ofstream(t) << "half a checkpoint";
    if (old) fs::last_write_time(t, fs::file_time_type::clock::now() - std::chrono::minutes(5));
    return t;
  };
  const fs::path stale = leave(temporary_of(p, ended), true);
  const fs::path recent = leave(temporary_of(p, ended), false);
  const fs::path other = leave(temporary_of(dir_ / "other.ckpt", ended), true);
  const fs::path live = leave(temporary_of(p, ::getpid()), true);  // as a concurrent write's
  const fs::path foreign = leave(dir_ / (".run.ckpt.tmp-elsewhere-" + std::to_string(ended) + "-0"), true);
  write("run.ckpt");
  EXPECT_FALSE(fs::exists(stale)) << stale << ": its process ended minutes ago";
  EXPECT_TRUE(fs::exists(recent)) << recent << ": written within the last minute";
  EXPECT_TRUE(fs::exists(other)) << other << ": another checkpoint's";
  EXPECT_TRUE(fs::exists(live)) << live << ": a running process's";
  EXPECT_TRUE(fs::exists(foreign)) << foreign << ": another host's";
  EXPECT_EQ(ckpt::read_contents(ckpt::Reader(p)).fingerprint.tensors.size(), 3u);  // and the checkpoint was written
}

TEST(CheckpointFormatSeeds, TheFuzzerSeedsAreValidFiles) {
  const auto [seeds, looked] = find_seeds();
  if (seeds.empty()) {
    std::string where;
    for (const fs::path& p : looked) where += "\n  " + p.string();
    FAIL() << "the fuzzer's checkpoint seeds (" << kSeedsUnderRoot.string() << ") are in none of:" << where
           << "\nset FERRY_SOURCE_DIR to a ferry source tree, or run the test binary from its build tree";
  }
  RecordProperty("seeds", seeds.string());
  int n = 0;
  for (const auto& e : fs::directory_iterator(seeds)) {
    const ckpt::Reader r(e.path());
    EXPECT_NO_THROW(ckpt::read_contents(r))
        << e.path() << ": rewrite the seeds with FERRY_FUZZ_WRITE_SEEDS (fuzz/checkpoint.cpp)";
    ++n;
  }
  EXPECT_GE(n, 3);
}

}  // namespace
}  // namespace ferry
