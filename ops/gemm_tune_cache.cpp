// The GEMM tuning cache (see gemm_tune_cache.hpp). Format:
//   # ferry GEMM tuning cache, written by the tuner (`ferry tune`); delete it to tune again.
//   # <comment lines>
//   <one row in ops/tuning/gemm.tsv's format, naming this device>
//   # checksum <16 hex digits: FNV-1a of every line above>
#include "gemm_tune_cache.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cl/fnv1a.hpp"
#include "ferry/cl/program.hpp"

namespace ferry::ops {
namespace {

void warn(const std::string& path, const char* what_cache, const std::string& what) {
  std::fprintf(stderr, "ferry: warning: %s %s %s; it will be tuned again and replaced\n", what_cache, path.c_str(),
               what.c_str());
}

}  // namespace

std::uint64_t tune_cache_key(const cl::DeviceInfo& d, std::initializer_list<std::string_view> kernel_files) {
  std::uint64_t h = cl::fnv1a(d.platform_name + '\n' + d.platform_version + '\n' + d.name + '\n' + d.vendor + '\n' +
                              d.version + '\n' + d.driver + '\n');
  for (const auto& [name, text] : cl::embedded_kernel_sources()) {
    if (std::find(kernel_files.begin(), kernel_files.end(), name) != kernel_files.end())
      h = cl::fnv1a(text, cl::fnv1a(name, h));
  }
  return h;
}

std::string gemm_tune_cache_file(const std::string& dir, const cl::DeviceInfo& device) {
  const std::uint64_t key = tune_cache_key(device, {"gemm_tiled.cl", "gemm_packed.cl", "dtype.clh"});
  return (std::filesystem::path(dir) / fmt::format("gemm-tuning-{:016x}.tsv", key)).string();
}

std::optional<std::string> read_tune_cache_text(const std::string& path, const char* what) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const std::string tag = "# checksum ";
  const std::size_t at = text.rfind(tag);
  if (at == std::string::npos || (at > 0 && text[at - 1] != '\n')) {
    warn(path, what, "has no checksum line");
    return std::nullopt;
  }
  std::string body = text.substr(0, at);
  std::uint64_t want = 0;
  if (std::sscanf(text.c_str() + at + tag.size(), "%16llx", reinterpret_cast<unsigned long long*>(&want)) != 1 ||
      want != cl::fnv1a(body)) {
    warn(path, what, "fails its checksum (damaged or edited)");
    return std::nullopt;
  }
  return body;
}

std::string write_tune_cache_text(const std::string& path, const std::string& body, const char* what) {
  const std::string text = body + fmt::format("# checksum {:016x}\n", cl::fnv1a(body));
  const std::string tmp = fmt::format("{}.tmp{}", path, ::getpid());
  const auto fail = [&](const std::string& why) {
    std::fprintf(stderr, "ferry: warning: cannot write the %s %s (%s); the tuned choice is used for this run only\n",
                 what, path.c_str(), why.c_str());
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    return fmt::format("{}: {}", path, why);
  };
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  if (ec) return fail(fmt::format("creating its folder: {}", ec.message()));
  {
    errno = 0;
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return fail(fmt::format("creating a file there: {}", errno ? std::strerror(errno) : "refused"));
    out << text;
    out.flush();
    if (!out) return fail(fmt::format("writing: {}", errno ? std::strerror(errno) : "an I/O error"));
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) return fail(fmt::format("renaming it into place: {}", ec.message()));
  return {};
}

std::optional<GemmTuningRow> read_gemm_tune_cache(const std::string& path, const cl::DeviceInfo& device) {
  constexpr const char* what = "GEMM tuning cache";
  const std::optional<std::string> body = read_tune_cache_text(path, what);
  if (!body) return std::nullopt;
  try {
    std::vector<GemmTuningRow> rows = parse_gemm_tuning(*body, path);
    if (rows.size() != 1 || !rows[0].matches(device)) {
      warn(path, what, fmt::format("holds {} row(s), not one for device '{}'", rows.size(), device.name));
      return std::nullopt;
    }
    return rows[0];
  } catch (const std::exception& e) {
    warn(path, what, fmt::format("is not valid tuning data ({})", e.what()));
    return std::nullopt;
  }
}

std::string write_gemm_tune_cache(const std::string& path, const std::string& row, const std::string& comment) {
  std::string body = "# ferry GEMM tuning cache, written by the tuner (`ferry tune`); delete it to tune again.\n";
  std::istringstream lines(comment);
  for (std::string line; std::getline(lines, line);) body += "# " + line + "\n";
  body += row + "\n";
  return write_tune_cache_text(path, body, "GEMM tuning cache");
}

}  // namespace ferry::ops
