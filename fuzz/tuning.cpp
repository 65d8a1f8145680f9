// Fuzzes the GEMM tuning data's reader (ops/gemm_tuning_format.cpp: rows of ops/tuning/gemm.tsv,
// FERRY_GEMM_TUNING's file, a kernel's parameters) and the tuning caches' checksummed text
// (ops/gemm_tune_cache.cpp). The bytes are a tuning file. What must hold:
//  - parse_gemm_tuning returns rows or throws std::runtime_error, nothing else;
//  - every row it returns names a line of the text, and its kernel configuration written out as
//    text parses back to the same kernel and parameters (what `ferry tune` writes, gemm() reads);
//  - as a cache file with its checksum made right, read_gemm_tune_cache returns a row exactly when
//    the text parses to one row matching the device, and then that row; with one byte of it
//    changed after the checksum, it returns nothing (and warns).
// The reader warns on stderr for nearly every input; with FERRY_FUZZ_QUIET=1 (fuzz/run.sh sets it)
// those calls run with stderr on /dev/null. A finding inside them then has its report cut: run the
// artifact again without the variable.
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cl/fnv1a.hpp"
#include "ferry/cl/program.hpp"
#include "fuzz_support.hpp"
#include "ops/gemm_tune_cache.hpp"
#include "ops/gemm_tuning.hpp"

// The cache key's kernel texts come from the embedded kernels (cl/program.cpp), which this target
// does not build: the key is not fuzzed here, and every kernel file reads as empty.
std::string_view ferry::cl::kernel_source(std::string_view) {
  return {};
}
std::string ferry::cl::expand_kernel_includes(std::string_view, std::string_view source) {
  return std::string(source);
}

namespace {

using namespace ferry;

using ferry::fuzz::check;

cl::DeviceInfo device(cl_device_type type, std::string vendor, std::string name, std::string platform) {
  cl::DeviceInfo d;
  d.type = type;
  d.vendor = std::move(vendor);
  d.name = std::move(name);
  d.platform_name = std::move(platform);
  return d;
}

std::optional<std::vector<ops::GemmTuningRow>> parse(std::string_view text) {
  try {
    return ops::parse_gemm_tuning(text, "fuzzed.tsv");
  } catch (const std::runtime_error&) {
    return std::nullopt;
  }
}

// stderr on /dev/null for the life of the object, when FERRY_FUZZ_QUIET=1.
class QuietStderr {
 public:
  QuietStderr() {
    static const bool quiet = [] {
      const char* q = std::getenv("FERRY_FUZZ_QUIET");
      return q && std::string_view(q) == "1";
    }();
    if (!quiet) return;
    static const int null = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
    std::fflush(stderr);
    saved_ = ::dup(2);
    check(null >= 0 && saved_ >= 0 && ::dup2(null, 2) == 2);
  }
  ~QuietStderr() {
    if (saved_ < 0) return;
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
  }
  QuietStderr(const QuietStderr&) = delete;
  QuietStderr& operator=(const QuietStderr&) = delete;

 private:
  int saved_ = -1;
};

std::size_t lines(std::string_view text) {
  std::size_t n = 1;
  for (char ch : text) n += ch == '\n';
  return n;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  static const cl::DeviceInfo devices[] = {
      device(CL_DEVICE_TYPE_CPU, "AuthenticAMD", "pthread-haswell-AMD EPYC", "Portable Computing Language"),
      device(CL_DEVICE_TYPE_GPU, "NVIDIA Corporation", "NVIDIA H200", "NVIDIA CUDA")};

  const std::optional<std::vector<ops::GemmTuningRow>> rows = parse(text);
  if (rows) {
    for (const ops::GemmTuningRow& row : *rows) {
      check(row.line >= 1 && row.line <= lines(text) && row.source == "fuzzed.tsv");
      const ops::GemmKernelConfig again = ops::parse_gemm_kernel_spec(row.config.text(), "round trip");
      check(again.kernel == row.config.kernel && again.params == row.config.params);
      check(again.defines() == row.config.defines());
      for (const cl::DeviceInfo& d : devices) (void)row.matches(d);
    }
  }

  static fuzz::MemoryFile file("ferry-fuzz-tuning");
  // The cache's body ends with a newline, so that the checksum line starts a line of its own.
  std::string body(text);
  if (!body.empty() && body.back() != '\n') body += '\n';
  const std::string cache = body + fmt::format("# checksum {:016x}\n", cl::fnv1a(body));
  file.set(cache.data(), cache.size());
  for (const cl::DeviceInfo& d : devices) {
    const std::optional<ops::GemmTuningRow> cached = [&] {
      const QuietStderr quiet;
      return ops::read_gemm_tune_cache(file.path(), d);
    }();
    const bool one_match = rows && rows->size() == 1 && (*rows)[0].matches(d);
    check(cached.has_value() == one_match);
    if (cached) check(cached->config.text() == (*rows)[0].config.text() && cached->line == (*rows)[0].line);
  }
  if (!body.empty()) {
    std::string damaged = cache;
    damaged[cl::fnv1a(body) % body.size()] ^= 0x20;
    file.set(damaged.data(), damaged.size());
    for (const cl::DeviceInfo& d : devices) {
      const QuietStderr quiet;
      check(!ops::read_gemm_tune_cache(file.path(), d));
    }
  }
  return 0;
}
