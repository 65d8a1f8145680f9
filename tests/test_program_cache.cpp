// The on-disk program cache's contract: every entry carries a header (magic, format, size,
// checksum) checked before its bytes reach the driver; a truncated, damaged or refused entry
// warns once, is rebuilt from source and replaced with a valid one; writes are atomic and
// unique per writer; an unwritable cache folder warns once and the run goes on uncached.
#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "ferry/cl/program.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<unsigned char>;

fs::path fresh_dir(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / fmt::format("ferry-test-pcache-{}-{}", name, ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

Bytes read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return Bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const fs::path& p, const Bytes& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// The files in `dir` whose name ends with `suffix`.
std::vector<fs::path> files_ending(const fs::path& dir, std::string_view suffix) {
  std::vector<fs::path> out;
  for (const auto& f : fs::directory_iterator(dir)) {
    const std::string name = f.path().filename().string();
    if (name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      out.push_back(f.path());
  }
  return out;
}

// The single cache entry in `dir`.
fs::path only_entry(const fs::path& dir) {
  const auto entries = files_ending(dir, ".bin");
  EXPECT_EQ(entries.size(), 1u);
  EXPECT_TRUE(files_ending(dir, ".tmp").empty()) << "a temporary file was left behind";
  return entries.empty() ? fs::path() : entries.front();
}

std::size_t count(const std::string& text, std::string_view what) {
  std::size_t n = 0;
  for (auto pos = text.find(what); pos != std::string::npos; pos = text.find(what, pos + 1)) ++n;
  return n;
}

// A folder with one valid entry for activation.cl's relu, and a copy of that entry.
struct Populated {
  cl::ProgramCacheOptions options;
  fs::path entry;
  Bytes valid;
  explicit Populated(const std::string& name) : options{true, fresh_dir(name)} {
    cl::KernelLibrary(TestDevice::get().context, options).kernel("activation", "relu_forward");
    entry = only_entry(options.dir);
    valid = read_bytes(entry);
  }
  ~Populated() { fs::remove_all(options.dir); }
};

// Builds relu with a fresh library over the cache; returns its stats and what it printed on stderr.
std::pair<cl::ProgramCacheStats, std::string> build_relu(const cl::ProgramCacheOptions& options) {
  testing::internal::CaptureStderr();
  cl::KernelLibrary lib(TestDevice::get().context, options);
  lib.kernel("activation", "relu_forward");  // must not throw
  return {lib.stats(), testing::internal::GetCapturedStderr()};
}

TEST(ProgramCache, EntryFormatDetectsEveryFlippedByteAndEveryTruncation) {
  Bytes payload(97);
  for (std::size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<unsigned char>(i * 31 + 7);
  const Bytes entry = cl::encode_cache_entry(0x1234abcd5678ef90ull, payload);
  ASSERT_EQ(entry.size(), cl::program_cache_header_bytes + payload.size());
  EXPECT_EQ(std::string(entry.begin(), entry.begin() + 8), "FERRYPCB");
  const auto ok = cl::decode_cache_entry(entry, 0x1234abcd5678ef90ull);
  EXPECT_EQ(ok.problem, "");
  EXPECT_TRUE(std::equal(ok.binary.begin(), ok.binary.end(), payload.begin(), payload.end()));
  EXPECT_NE(cl::decode_cache_entry(entry, 42).problem, "") << "an entry under another key's name";
  for (std::size_t pos = 0; pos < entry.size(); ++pos) {
    for (unsigned char mask : {0x01, 0x80, 0xff}) {
      Bytes bad = entry;
      bad[pos] ^= mask;
      EXPECT_NE(cl::decode_cache_entry(bad).problem, "") << "byte " << pos << " ^ " << int(mask);
    }
  }
  for (std::size_t len = 0; len < entry.size(); ++len) {
    const auto v = cl::decode_cache_entry(std::span(entry).first(len));
    EXPECT_NE(v.problem, "") << "truncated to " << len;
    EXPECT_NE(v.problem.find("truncated"), std::string::npos) << v.problem;
  }
  Bytes longer = entry;
  longer.push_back(0);
  EXPECT_NE(cl::decode_cache_entry(longer).problem, "");
}

TEST(ProgramCache, WrittenEntriesAreValidAndLoadBack) {
  Populated cache("valid");
  EXPECT_EQ(cl::decode_cache_entry(cache.valid).problem, "");
  const auto [stats, err] = build_relu(cache.options);
  EXPECT_EQ(stats.disk_hits, 1u);
  EXPECT_EQ(stats.source_builds, 0u);
  EXPECT_EQ(stats.corrupt_entries, 0u);
  EXPECT_EQ(err, "");
}

TEST(ProgramCache, TruncatedEntryWarnsIsRebuiltAndRewrittenValid) {
  Populated cache("truncated");
  const std::size_t header = cl::program_cache_header_bytes, size = cache.valid.size();
  for (std::size_t len : {std::size_t{0}, std::size_t{5}, header - 1, header, header + (size - header) / 2, size - 1}) {
    write_bytes(cache.entry, Bytes(cache.valid.begin(), cache.valid.begin() + static_cast<std::ptrdiff_t>(len)));
    const auto [stats, err] = build_relu(cache.options);
    EXPECT_EQ(stats.corrupt_entries, 1u) << len;
    EXPECT_EQ(stats.rejected_by_driver, 0u) << "a truncated entry reached the driver: " << len;
    EXPECT_EQ(stats.source_builds, 1u) << len;
    EXPECT_EQ(count(err, "ferry: program cache entry"), 1u) << err;
    EXPECT_NE(err.find(cache.entry.string()), std::string::npos) << err;
    EXPECT_NE(err.find("rebuilt"), std::string::npos) << err;
    // Replaced by a valid entry that the next run loads without a word.
    EXPECT_EQ(cl::decode_cache_entry(read_bytes(only_entry(cache.options.dir))).problem, "") << len;
    const auto [again, quiet] = build_relu(cache.options);
    EXPECT_EQ(again.disk_hits, 1u) << len;
    EXPECT_EQ(quiet, "");
  }
}

TEST(ProgramCache, FlippedByteIsDetectedBeforeTheDriver) {
  Populated cache("flipped");
  const std::size_t size = cache.valid.size();
  // Magic, format, header size, key, payload size, checksum, then the payload's first, middle and last bytes.
  for (std::size_t pos :
       {std::size_t{0}, std::size_t{7}, std::size_t{8}, std::size_t{12}, std::size_t{16}, std::size_t{24},
        std::size_t{31}, std::size_t{32}, std::size_t{39}, std::size_t{40}, size / 2, size - 1}) {
    Bytes bad = cache.valid;
    bad[pos] ^= 0x10;
    write_bytes(cache.entry, bad);
    const auto [stats, err] = build_relu(cache.options);
    EXPECT_EQ(stats.corrupt_entries, 1u) << "byte " << pos;
    EXPECT_EQ(stats.rejected_by_driver, 0u) << "byte " << pos << " was handed to the driver";
    EXPECT_EQ(stats.disk_hits, 0u) << "byte " << pos;
    EXPECT_EQ(count(err, "ferry: program cache entry"), 1u) << err;
    EXPECT_NE(err.find(cache.entry.string()), std::string::npos) << err;
    EXPECT_EQ(cl::decode_cache_entry(read_bytes(cache.entry)).problem, "") << "not replaced: byte " << pos;
  }
}

TEST(ProgramCache, EntryTheDriverRefusesIsRebuilt) {
  Populated cache("refused");
  // A well-formed entry, under the right key, whose payload is not a program binary.
  const std::string stem = cache.entry.stem().string();
  const std::uint64_t key = std::stoull(stem.substr(stem.rfind('-') + 1), nullptr, 16);
  const std::string junk = "this is no program binary of any OpenCL driver";
  write_bytes(cache.entry, cl::encode_cache_entry(key, Bytes(junk.begin(), junk.end())));
  const auto [stats, err] = build_relu(cache.options);
  EXPECT_EQ(stats.corrupt_entries, 1u);
  EXPECT_EQ(stats.rejected_by_driver, 1u);
  EXPECT_EQ(stats.source_builds, 1u);
  EXPECT_NE(err.find("driver refused"), std::string::npos) << err;
  EXPECT_EQ(cl::decode_cache_entry(read_bytes(cache.entry), key).problem, "");
  EXPECT_EQ(build_relu(cache.options).first.disk_hits, 1u);
}

// A well-formed entry under relu's key around another program's binary loads and builds, and had
// failed every run after at clCreateKernel (CL_INVALID_KERNEL_NAME); it is replaced as a damaged
// entry is.
TEST(ProgramCache, EntryHoldingAnotherProgramIsRebuilt) {
  Populated cache("another");
  const fs::path other_dir = fresh_dir("another-source");
  cl::KernelLibrary(TestDevice::get().context, {true, other_dir}).kernel("loss_sum", "loss_sum");
  const Bytes other_entry = read_bytes(only_entry(other_dir));  // the view below points into it
  const cl::CacheEntryView other_view = cl::decode_cache_entry(other_entry);
  const Bytes other(other_view.binary.begin(), other_view.binary.end());
  ASSERT_FALSE(other.empty());
  const std::string stem = cache.entry.stem().string();
  const std::uint64_t key = std::stoull(stem.substr(stem.rfind('-') + 1), nullptr, 16);
  write_bytes(cache.entry, cl::encode_cache_entry(key, other));
  const auto [stats, err] = build_relu(cache.options);
  EXPECT_EQ(stats.disk_hits, 1u);
  EXPECT_EQ(stats.corrupt_entries, 1u);
  EXPECT_EQ(stats.source_builds, 1u);
  EXPECT_NE(err.find("has no kernel 'relu_forward': a binary of another program"), std::string::npos) << err;
  EXPECT_EQ(count(err, "program cache entry"), 1u) << err;
  EXPECT_EQ(cl::decode_cache_entry(read_bytes(cache.entry), key).problem, "");
  EXPECT_NE(read_bytes(cache.entry), cl::encode_cache_entry(key, other)) << "not replaced";
  EXPECT_EQ(build_relu(cache.options).first.disk_hits, 1u);
  fs::remove_all(other_dir);
}

// Removes a folder made read-only by read_only_dir().
void remove_read_only(const fs::path& dir) {
  std::error_code ec;
  fs::permissions(dir, fs::perms::owner_all, ec);
  fs::remove_all(dir, ec);
}

// A folder this process cannot write to (chmod when not root; root writes anywhere, so a
// sysfs folder then), or an empty path if there is none here.
fs::path read_only_dir() {
  const fs::path dir = fresh_dir("readonly");
  fs::permissions(dir, fs::perms::owner_read | fs::perms::owner_exec);
  for (const fs::path& candidate : {dir, fs::path("/sys/kernel")}) {
    std::error_code ec;
    if (!fs::is_directory(candidate, ec)) continue;
    const fs::path probe = candidate / fmt::format("ferry-probe-{}", ::getpid());
    if (std::ofstream(probe)) {
      fs::remove(probe, ec);
      continue;
    }
    if (candidate != dir) remove_read_only(dir);
    return candidate;
  }
  remove_read_only(dir);
  return {};
}

TEST(ProgramCache, ReadOnlyFolderWarnsOnceAndRunsUncached) {
  const fs::path dir = read_only_dir();
  if (dir.empty()) GTEST_SKIP() << "no read-only folder here";
  testing::internal::CaptureStderr();
  {
    cl::KernelLibrary lib(TestDevice::get().context, cl::ProgramCacheOptions{true, dir});
    lib.kernel("activation", "relu_forward");
    lib.kernel("activation", "relu_forward", "-DFERRY_TEST_OTHER=1");
    lib.kernel("activation", "relu_backward", "-DFERRY_TEST_THIRD=1");
    EXPECT_EQ(lib.stats().source_builds, 3u);
    EXPECT_EQ(lib.stats().entries_written, 0u);
  }
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(count(err, "ferry:"), 1u) << err;
  EXPECT_NE(err.find(fmt::format("program cache folder {} is not usable", dir.string())), std::string::npos) << err;
  if (dir.filename().string().starts_with("ferry-test-")) remove_read_only(dir);
}

TEST(ProgramCache, UncreatableFolderWarnsOnceAndRunsUncached) {
  const fs::path base = fresh_dir("uncreatable");
  std::ofstream(base / "a-file") << "not a folder";
  const fs::path dir = base / "a-file" / "cache";
  testing::internal::CaptureStderr();
  {
    cl::KernelLibrary lib(TestDevice::get().context, cl::ProgramCacheOptions{true, dir});
    lib.kernel("activation", "relu_forward");
    lib.kernel("activation", "relu_forward", "-DFERRY_TEST_OTHER=1");
    EXPECT_EQ(lib.stats().source_builds, 2u);
  }
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(count(err, "ferry:"), 1u) << err;
  EXPECT_NE(err.find("cannot create it"), std::string::npos) << err;
  fs::remove_all(base);
}

// One entry replaced by a folder is that entry's problem: it is named, with how to mend it, its
// program is built from source, and the other programs are cached as usual (the whole cache used
// to be turned off, since the rename over the folder failed).
TEST(ProgramCache, AnEntryThatIsAFolderIsNamedAndTheOthersAreStillCached) {
  Populated cache("entry-folder");
  fs::remove(cache.entry);
  fs::create_directory(cache.entry);
  testing::internal::CaptureStderr();
  {
    cl::KernelLibrary lib(TestDevice::get().context, cache.options);
    lib.kernel("activation", "relu_forward");
    lib.kernel("activation", "relu_forward", "-DFERRY_TEST_OTHER=1");
    EXPECT_EQ(lib.stats().source_builds, 2u);
    EXPECT_EQ(lib.stats().entries_written, 1u) << "the other program was not cached";
  }
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(count(err, "ferry:"), 1u) << err;
  EXPECT_NE(err.find(fmt::format("program cache entry {} is a folder", cache.entry.string())), std::string::npos)
      << err;
  EXPECT_NE(err.find(fmt::format("remove it (rm -r '{}')", cache.entry.string())), std::string::npos) << err;
  EXPECT_EQ(err.find("is not usable"), std::string::npos) << err;
  EXPECT_TRUE(fs::is_directory(cache.entry));
  EXPECT_EQ(files_ending(cache.options.dir, ".bin").size(), 2u);
  EXPECT_TRUE(files_ending(cache.options.dir, ".tmp").empty()) << "a temporary file was left behind";
}

TEST(ProgramCache, ConcurrentWritersLeaveOneValidEntry) {
  const cl::ProgramCacheOptions options{true, fresh_dir("concurrent")};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] { cl::KernelLibrary(TestDevice::get().context, options).program("activation"); });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(cl::decode_cache_entry(read_bytes(only_entry(options.dir))).problem, "");
  fs::remove_all(options.dir);
}

}  // namespace
}  // namespace ferry::test
