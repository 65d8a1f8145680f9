// The library's text outputs (ChromeTrace::write, MemoryProfiler::write_csv / write_phase_csv):
// written whole, and never over a link, a folder, a device or a file ferry did not write, unless
// WriteOptions says to replace a foreign file.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "ferry/runtime/memory_profile.hpp"
#include "ferry/runtime/trace.hpp"
#include "runtime/checkpoint_format.hpp"
#include "runtime/output_file.hpp"

namespace ferry::test {
namespace {

namespace fs = std::filesystem;

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class OutputFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("ferry-outputs-" + std::to_string(getpid()) + "-" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    trace_.add("copy", graph::Lane::h2d, 1000, 3000);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path file(const char* name, const char* text) const {
    const fs::path p = dir_ / name;
    std::ofstream(p) << text;
    return p;
  }
  template <class Write>
  void expect_refused(Write&& write, const char* needle) {
    try {
      write();
      ADD_FAILURE() << "expected a refusal mentioning '" << needle << "'";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
  fs::path dir_;
  ChromeTrace trace_;
  MemoryProfiler profiler_;
};

TEST_F(OutputFiles, ReplaceOnlyWhatFerryWrote) {
  // New, then again over its own file.
  const fs::path t = dir_ / "run.json";
  trace_.write(t);
  trace_.write(t);
  EXPECT_EQ(read_text(t).rfind(trace_signature, 0), 0u);
  EXPECT_NE(read_text(t).find("\"copy\""), std::string::npos);
  const fs::path csv = dir_ / "profile.csv";
  profiler_.write_csv(csv);
  profiler_.write_csv(csv);
  EXPECT_EQ(read_text(csv).rfind(profile_signature, 0), 0u);
  const fs::path phases = dir_ / "phases.csv";
  profiler_.write_phase_csv(phases);
  EXPECT_EQ(read_text(phases).rfind(phase_profile_signature, 0), 0u);

  // A foreign file, a trace over a profile, a link and a folder are left as they are.
  const fs::path notes = file("notes.txt", "my notes\n");
  expect_refused([&] { trace_.write(notes); }, "is not a trace file ferry wrote");
  expect_refused([&] { profiler_.write_csv(notes); }, "is not a memory profile ferry wrote");
  expect_refused([&] { profiler_.write_phase_csv(csv); }, "is not a phase memory profile ferry wrote");
  expect_refused([&] { trace_.write(csv); }, "is not a trace file ferry wrote");
  EXPECT_EQ(read_text(notes), "my notes\n");
  EXPECT_EQ(read_text(csv).rfind(profile_signature, 0), 0u);
  const fs::path link = dir_ / "link.json";
  fs::create_symlink(t, link);
  expect_refused([&] { trace_.write(link); }, "it is a symbolic link");
  EXPECT_TRUE(fs::is_symlink(link));
  expect_refused([&] { profiler_.write_csv(dir_); }, "it is a folder");
  for (const auto& e : fs::directory_iterator(dir_)) {
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << "left behind: " << e.path();
  }

  // On purpose; and an empty file is taken (a name made for the output).
  trace_.write(notes, {.replace_foreign_file = true});
  EXPECT_EQ(read_text(notes).rfind(trace_signature, 0), 0u);
  const fs::path empty = file("empty.csv", "");
  profiler_.write_csv(empty);
  EXPECT_EQ(read_text(empty).rfind(profile_signature, 0), 0u);

  // Never over a checkpoint, on purpose or not: it is a file ferry wrote, a run's training state
  // (`ferry train --trace run.ckpt --force` had replaced it with a trace).
  const fs::path ckpt = file("run.ckpt", "FERRYCKP and the rest of a checkpoint");
  for (const bool replace : {false, true}) {
    expect_refused([&] { trace_.write(ckpt, {.replace_foreign_file = replace}); }, "holds a ferry checkpoint");
    expect_refused([&] { profiler_.write_csv(ckpt, {.replace_foreign_file = replace}); }, "holds a ferry checkpoint");
  }
  EXPECT_EQ(read_text(ckpt), "FERRYCKP and the rest of a checkpoint");
}

// A file replaced whole (a new file renamed over it) kept the new file's mode: a checkpoint or
// trace made private (0600) became readable by everyone (0644) at its next write.
TEST_F(OutputFiles, ARewrittenFileKeepsItsMode) {
  const auto mode = [](const fs::path& p) {
    struct stat st {};
    EXPECT_EQ(::stat(p.c_str(), &st), 0) << p;
    return st.st_mode & 07777;
  };
  const fs::path t = dir_ / "run.json";
  trace_.write(t);
  ASSERT_EQ(::chmod(t.c_str(), 0600), 0);
  trace_.write(t);
  EXPECT_EQ(mode(t), 0600u) << "the trace";
  const fs::path c = dir_ / "run.ckpt";
  const auto write_checkpoint_file = [&] {
    ckpt::AtomicFile f(c);
    f.put(std::uint64_t{42});
    f.commit();
  };
  write_checkpoint_file();
  ASSERT_EQ(::chmod(c.c_str(), 0640), 0);
  write_checkpoint_file();
  EXPECT_EQ(mode(c), 0640u) << "the checkpoint";
}

// Whether a file can be created is asked by creating one (ferry train's outputs and ferry-bench
// --trace, before any work): permission bits do not say it for root or on a read-only mount.
TEST_F(OutputFiles, CreatingAFileIsTriedAndTheReasonGiven) {
  EXPECT_EQ(cannot_create_in(dir_), std::nullopt);
  EXPECT_TRUE(fs::is_empty(dir_)) << "the probe file was left behind";
  const auto missing = cannot_create_in(dir_ / "no-such-folder");
  ASSERT_TRUE(missing.has_value());
  EXPECT_NE(missing->find("No such file or directory"), std::string::npos) << *missing;
  const auto not_folder = cannot_create_in(file("plain", "x"));
  ASSERT_TRUE(not_folder.has_value());
  EXPECT_NE(not_folder->find("Not a directory"), std::string::npos) << *not_folder;
  // /proc takes no new files, whoever asks (root included).
  if (fs::is_directory("/proc/self")) {
    EXPECT_TRUE(cannot_create_in("/proc").has_value());
  }
}

}  // namespace
}  // namespace ferry::test
