// The GEMM tuning cache (see gemm_tune_cache.hpp). Format:
//   # ferry GEMM tuning cache, written by the tuner (`ferry tune`); delete it to tune again.
//   # <comment lines>
//   <one row in ops/tuning/gemm.tsv's format, naming this device>
//   # checksum <16 hex digits: FNV-1a of every line above>
#include "gemm_tune_cache.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <system_error>

#include "cl/fnv1a.hpp"
#include "ferry/cl/program.hpp"

namespace ferry::ops {
namespace {

void warn(const std::string& path, const char* what_cache, const std::string& what) {
  std::fprintf(stderr, "ferry: warning: %s %s %s; it will be tuned again and replaced\n", what_cache, path.c_str(),
               what.c_str());
}

std::string errno_text(int e) {
  return std::error_code(e, std::generic_category()).message();
}

// What a path that is not a regular file is, for a message; "" for a regular file.
std::string not_regular(const std::filesystem::file_status& st) {
  namespace fs = std::filesystem;
  switch (st.type()) {
    case fs::file_type::regular:
      return "";
    case fs::file_type::directory:
      return "is a folder, not a file";
    case fs::file_type::fifo:
      return "is a FIFO (named pipe), not a regular file";
    case fs::file_type::character:
    case fs::file_type::block:
      return "is a device, not a regular file";
    case fs::file_type::socket:
      return "is a socket, not a regular file";
    default:
      return "is not a regular file";
  }
}

}  // namespace

std::optional<std::string> read_tuning_file(const std::string& path, std::string& problem) {
  problem.clear();
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(path, ec);
  if (st.type() == std::filesystem::file_type::not_found) return std::nullopt;
  if (ec) {
    problem = fmt::format("cannot be read: {}", ec.message());
    return std::nullopt;
  }
  // Checked before the open: opening a FIFO waits for a writer, and a device may never end.
  if (problem = not_regular(st); !problem.empty()) return std::nullopt;
  // O_NONBLOCK in case it became a FIFO since the check; read() of a regular file ignores it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    problem = fmt::format("cannot be read: {}", errno_text(errno));
    return std::nullopt;
  }
  struct stat fst {};
  std::string text;
  if (::fstat(fd, &fst) != 0 || !S_ISREG(fst.st_mode)) {
    problem = "is not a regular file";
  } else if (static_cast<std::uintmax_t>(fst.st_size) > max_tuning_file_bytes) {
    problem = fmt::format("is {} bytes, more than the {} bytes (1 MiB) a tuning file may hold", fst.st_size,
                          max_tuning_file_bytes);
  } else {
    // Bounded even if the file grows meanwhile: one byte past the limit is enough to refuse it.
    char buf[4096];
    while (text.size() <= max_tuning_file_bytes) {
      const ssize_t n = ::read(fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) problem = fmt::format("cannot be read: {}", errno_text(errno));
      if (n <= 0) break;
      text.append(buf, static_cast<std::size_t>(n));
    }
    if (problem.empty() && text.size() > max_tuning_file_bytes)
      problem =
          fmt::format("grew past the {} bytes (1 MiB) a tuning file may hold while it was read", max_tuning_file_bytes);
  }
  ::close(fd);
  if (!problem.empty()) return std::nullopt;
  return text;
}

std::uint64_t tune_cache_key(const cl::DeviceInfo& d, std::initializer_list<std::string_view> kernel_files) {
  std::uint64_t h = cl::fnv1a(d.platform_name + '\n' + d.platform_version + '\n' + d.name + '\n' + d.vendor + '\n' +
                              d.version + '\n' + d.driver + '\n');
  for (const std::string_view file : kernel_files) {
    const std::string name = fmt::format("{}.cl", file);
    h = cl::fnv1a(cl::expand_kernel_includes(name, cl::kernel_source(file)), cl::fnv1a(name, h));
  }
  return h;
}

std::string gemm_tune_cache_file(const std::string& dir, const cl::DeviceInfo& device) {
  const std::uint64_t key = tune_cache_key(device, {"gemm_tiled", "gemm_packed"});
  return (std::filesystem::path(dir) / fmt::format("gemm-tuning-{:016x}.tsv", key)).string();
}

std::optional<std::string> read_tune_cache_text(const std::string& path, const char* what, bool loud) {
  const auto complain = [&](const std::string& why) {
    if (loud) warn(path, what, why);
  };
  std::string problem;
  const std::optional<std::string> read = read_tuning_file(path, problem);
  if (!read) {
    std::error_code ec;
    if (loud && std::filesystem::is_directory(path, ec)) {
      // The tuner's file cannot be renamed over a folder either: without this the device would be
      // tuned again on every run, with a warning that does not say why.
      std::fprintf(stderr,
                   "ferry: warning: %s %s is a folder, not a file, so no tuned choice can be read from it or saved "
                   "there and it is tuned again on every run: remove it (rm -r '%s')\n",
                   what, path.c_str(), path.c_str());
    } else if (!problem.empty()) {
      complain(problem);
    }
    return std::nullopt;
  }
  const std::string& text = *read;
  const std::string tag = "# checksum ";
  const std::size_t at = text.rfind(tag);
  if (at == std::string::npos || (at > 0 && text[at - 1] != '\n')) {
    complain("has no checksum line");
    return std::nullopt;
  }
  std::string body = text.substr(0, at);
  // The checksum line is the file's last, exactly as written: a row or text after it is an edit too.
  const std::string digits = text.substr(at + tag.size());
  const bool exact = digits.size() == 17 && digits.back() == '\n' && digits.find_first_not_of("0123456789abcdef") == 16;
  std::uint64_t want = 0;
  if (!exact || std::sscanf(digits.c_str(), "%16llx", reinterpret_cast<unsigned long long*>(&want)) != 1 ||
      want != cl::fnv1a(body)) {
    complain("fails its checksum (damaged or edited)");
    return std::nullopt;
  }
  return body;
}

std::string tune_coverage_comment(std::size_t measured, std::size_t planned, double seconds, bool budget_ran_out,
                                  bool stopped) {
  return fmt::format("{} of {} candidates in {:.1f} s{}", measured, planned, seconds,
                     stopped          ? ", stopped by a signal"
                     : budget_ran_out ? ", budget spent"
                                      : "");
}

std::optional<TuneCoverage> tune_cache_coverage(std::string_view text) {
  // In a comment line: "... <mode> search, N of M candidates in S s[, budget spent | , stopped by a signal]".
  static const std::regex line(R"(^# .* search, ([0-9]{1,9}) of ([0-9]{1,9}) candidates in [0-9.]+ s(, [a-z ]+)?$)");
  std::istringstream lines{std::string(text)};
  for (std::string l; std::getline(lines, l);) {
    std::smatch m;
    if (!l.starts_with("# ") || !std::regex_match(l, m, line)) continue;
    TuneCoverage c;
    c.measured = std::stoul(m[1].str());
    c.planned = std::stoul(m[2].str());
    c.stopped = m[3].str() == ", stopped by a signal";
    return c;
  }
  return std::nullopt;
}

std::optional<TuneCoverage> tune_cache_to_keep(const std::optional<std::string>& cached, std::size_t measured) {
  if (!cached) return std::nullopt;
  const std::optional<TuneCoverage> c = tune_cache_coverage(*cached);
  if (!c || c->measured <= measured) return std::nullopt;
  return c;
}

std::string tune_cache_folder_problem(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return fmt::format("cannot create it: {}", ec.message());
  if (!fs::is_directory(dir, ec)) return "it is not a folder";
  const std::string probe = (fs::path(dir) / fmt::format(".ferry-tune-probe-{}", ::getpid())).string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return fmt::format("cannot write a file there: {}", errno_text(errno));
  const ssize_t n = ::write(fd, "\n", 1);
  const int write_errno = errno;
  const int closed = ::close(fd);
  const int close_errno = errno;
  ::unlink(probe.c_str());
  if (n != 1) return fmt::format("cannot write a file there: {}", errno_text(n < 0 ? write_errno : ENOSPC));
  if (closed != 0) return fmt::format("cannot write a file there: {}", errno_text(close_errno));
  return {};
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
  if (std::filesystem::is_directory(path, ec)) return fail(fmt::format("it is a folder: remove it (rm -r '{}')", path));
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

namespace {

// The one row of a GEMM cache's body for `device`, or why it is not one.
std::optional<GemmTuningRow> gemm_cache_row(const std::string& body, const std::string& path,
                                            const cl::DeviceInfo& device, std::string& problem) {
  try {
    std::vector<GemmTuningRow> rows = parse_gemm_tuning(body, path);
    if (rows.size() != 1 || !rows[0].matches(device)) {
      problem = fmt::format("holds {} row(s), not one for device '{}'", rows.size(), device.name);
      return std::nullopt;
    }
    return rows[0];
  } catch (const std::exception& e) {
    problem = fmt::format("is not valid tuning data ({})", e.what());
    return std::nullopt;
  }
}

}  // namespace

std::optional<GemmTuningRow> read_gemm_tune_cache(const std::string& path, const cl::DeviceInfo& device,
                                                  TuneCoverage* coverage) {
  constexpr const char* what = "GEMM tuning cache";
  const std::optional<std::string> body = read_tune_cache_text(path, what);
  if (!body) return std::nullopt;
  std::string problem;
  std::optional<GemmTuningRow> row = gemm_cache_row(*body, path, device, problem);
  if (!row) {
    warn(path, what, problem);
    return std::nullopt;
  }
  if (coverage) *coverage = tune_cache_coverage(*body).value_or(TuneCoverage{});
  return row;
}

std::optional<std::string> valid_gemm_tune_cache_body(const std::string& path, const cl::DeviceInfo& device) {
  std::optional<std::string> body = read_tune_cache_text(path, "GEMM tuning cache", false);
  std::string problem;
  if (!body || !gemm_cache_row(*body, path, device, problem)) return std::nullopt;
  return body;
}

std::string write_gemm_tune_cache(const std::string& path, const std::string& row, const std::string& comment) {
  std::string body = "# ferry GEMM tuning cache, written by the tuner (`ferry tune`); delete it to tune again.\n";
  std::istringstream lines(comment);
  for (std::string line; std::getline(lines, line);) body += "# " + line + "\n";
  body += row + "\n";
  return write_tune_cache_text(path, body, "GEMM tuning cache");
}

bool search_stopped_winner_again(const std::optional<TuneCoverage>& coverage, bool settled, bool tell,
                                 const std::string& cache, std::string_view what) {
  const bool again = coverage && coverage->stopped && !settled;
  if (again && tell) {
    std::fprintf(stderr,
                 "ferry: the cached %.*s in %s %s from a search stopped after %zu of %zu candidates; "
                 "searching again\n",
                 static_cast<int>(what.size()), what.data(), cache.c_str(), what.ends_with('s') ? "are" : "is",
                 coverage->measured, coverage->planned);
  }
  return again;
}

}  // namespace ferry::ops
