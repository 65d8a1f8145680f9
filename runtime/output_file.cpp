// Whole-or-nothing text outputs (see output_file.hpp).
#include "output_file.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "ferry/runtime/checkpoint.hpp"

namespace ferry {

const char* file_type_name(std::filesystem::file_type type) {
  switch (type) {
    case std::filesystem::file_type::regular:
      return "a file";
    case std::filesystem::file_type::directory:
      return "a folder";
    case std::filesystem::file_type::fifo:
      return "a FIFO (named pipe)";
    case std::filesystem::file_type::character:
      return "a character device";
    case std::filesystem::file_type::block:
      return "a block device";
    case std::filesystem::file_type::socket:
      return "a socket";
    default:
      return "a special file";
  }
}

std::optional<std::string> cannot_create_in(const std::filesystem::path& folder) {
  static std::atomic<unsigned> counter{0};
  const std::filesystem::path probe =
      folder / fmt::format(".ferry-probe-{}-{}", ::getpid(), counter.fetch_add(1, std::memory_order_relaxed));
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return std::string(std::strerror(errno));
  ::close(fd);
  std::error_code ec;
  std::filesystem::remove(probe, ec);
  return std::nullopt;
}

void refuse_to_replace(const std::filesystem::path& path, std::string_view what, std::string_view signature,
                       bool replace_foreign_file) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(path, ec);
  if (!fs::exists(st)) return;
  if (fs::is_symlink(st)) {
    throw std::runtime_error(fmt::format(
        "cannot write the {} to '{}': it is a symbolic link (to '{}'), and ferry replaces its outputs whole, which "
        "would replace the link: give the file's own path",
        what, path.string(), fs::read_symlink(path, ec).string()));
  }
  if (!fs::is_regular_file(st)) {
    throw std::runtime_error(fmt::format("cannot write the {} to '{}': it is {}, not a regular file: give a file path",
                                         what, path.string(), file_type_name(st.type())));
  }
  if (const std::optional<std::string> why = content_refusal(path, what, signature, replace_foreign_file)) {
    throw std::runtime_error(fmt::format("cannot write the {} to '{}': {}", what, path.string(), *why));
  }
}

std::optional<std::string> content_refusal(const std::filesystem::path& path, std::string_view what,
                                           std::string_view signature, bool replace_foreign_file) {
  std::error_code ec;
  if (std::filesystem::file_size(path, ec) == 0) return std::nullopt;  // an empty file: a name made for it
  std::ifstream in(path, std::ios::binary);
  const std::string_view checkpoint(checkpoint_magic, 8);
  std::string head(std::max<std::size_t>({signature.size(), checkpoint.size(), 24}), '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<std::size_t>(in.gcount()));
  if (signature != checkpoint && head.starts_with(checkpoint)) {
    return fmt::format(
        "the file holds a ferry checkpoint (a run's training state), which the {} would replace: give "
        "the {} another path (replacing a file on purpose never replaces a checkpoint)",
        what, what);
  }
  if (replace_foreign_file || head.starts_with(signature)) return std::nullopt;  // (unreadable: refused)
  for (char& c : head) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) c = '.';
  }
  return fmt::format(
      "the file exists and is not a {} ferry wrote, so it is left as it is (it begins with '{}'): give another path, "
      "or replace it on purpose (ferry train --force; WriteOptions::replace_foreign_file)",
      what, head.substr(0, 24));
}

void write_output_file(const std::filesystem::path& path, const char* what, std::string_view signature,
                       WriteOptions options, const std::function<void(std::ostream&)>& write) {
  refuse_to_replace(path, what, signature, options.replace_foreign_file);
  remove_stale_temporaries(path, "tmp");
  const std::filesystem::path tmp = temporary_beside(path, "tmp");
  auto fail = [&](const char* doing, int err) {
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    const bool full = err == ENOSPC || err == EDQUOT;
    return std::runtime_error(fmt::format("{} '{}': {} failed: {}{}", what, path.string(), doing,
                                          err ? std::strerror(err) : "unknown error",
                                          full ? " (the previous file, if any, is kept): free space on its file "
                                                 "system, or give a path on another"
                                               : ""));
  };
  {
    errno = 0;
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) throw fail("creating a temporary file beside it", errno);
    write(out);
    out.flush();
    if (!out) throw fail("writing", errno ? errno : EIO);
    out.close();
    if (!out) throw fail("closing", errno ? errno : EIO);
  }
  keep_mode_of(path, tmp);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw fail("renaming the finished file into place", errno);
}

std::optional<std::string> missing_folder(const std::filesystem::path& path) {
  const std::filesystem::path folder = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(folder, ec);
  if (std::filesystem::is_directory(st)) return std::nullopt;
  if (std::filesystem::exists(st)) {
    return fmt::format("'{}' is {}, not a folder: give a path in a folder", folder.string(), file_type_name(st.type()));
  }
  return fmt::format("the folder '{}' does not exist: create it first (mkdir -p {})", folder.string(), folder.string());
}

void keep_mode_of(const std::filesystem::path& replaced, const std::filesystem::path& temporary) {
  struct stat st {};
  if (::lstat(replaced.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
  [[maybe_unused]] const int owner = ::chown(temporary.c_str(), st.st_uid, st.st_gid);  // root alone, mostly
  [[maybe_unused]] const int mode = ::chmod(temporary.c_str(), st.st_mode & 07777);
}

std::size_t longest_file_name(const std::filesystem::path& path) {
  const std::filesystem::path folder = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  const long limit = ::pathconf(folder.c_str(), _PC_NAME_MAX);
  return limit > 0 ? static_cast<std::size_t>(limit) : 255;
}

namespace {

// This machine's name as a temporary file's name carries it: letters, digits, '.' and '_' only
// (a '-' would be read as the next field's start), at most 32 characters.
const std::string& host_tag() {
  static const std::string tag = [] {
    char buf[256] = {};
    std::string t = ::gethostname(buf, sizeof buf - 1) == 0 ? std::string(buf) : std::string("host");
    for (char& c : t) {
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_') c = '_';
    }
    t.resize(std::min<std::size_t>(t.size(), 32));
    return t.empty() ? std::string("host") : t;
  }();
  return tag;
}

// The hidden prefix of `path`'s temporaries: "." + its file name, cut so that the whole name with
// a suffix of `suffix_size` characters fits the folder's limit (the name is cut at a byte, which
// is fine for a name no one reads and which is removed or renamed away).
std::string hidden_prefix(const std::filesystem::path& path, std::size_t suffix_size) {
  std::string name = path.filename().string();
  const std::size_t longest = longest_file_name(path);
  const std::size_t room = longest - std::min(longest, suffix_size + 1);
  if (name.size() > room) name.resize(room);
  return name.insert(0, 1, '.');
}

// The process id in a temporary's name "<prefix>.<tag>-<host>-<pid>-<n>" written on this host, or
// nothing if `file` is not one of `path`'s.
std::optional<long> temporary_writer(const std::string& file, const std::filesystem::path& path, std::string_view tag) {
  const std::string marker = fmt::format(".{}-{}-", tag, host_tag());
  const std::size_t at = file.rfind(marker);
  if (at == std::string::npos) return std::nullopt;
  const std::string whole = path.filename().string().insert(0, 1, '.');
  // The part before the marker is "." + the file name, or that name cut so the whole fills the
  // folder's longest name (hidden_prefix); anything else is another file's temporary.
  const bool cut = at < whole.size() && file.size() == longest_file_name(path);
  if (at == 0 || (at != whole.size() && !cut) || whole.compare(0, at, file, 0, at) != 0) return std::nullopt;
  const std::string rest = file.substr(at + marker.size());  // "<pid>-<n>"
  const std::size_t dash = rest.find('-');
  if (dash == 0 || dash == std::string::npos) return std::nullopt;
  const auto digits = [](std::string_view s) {
    return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  if (!digits(rest.substr(0, dash)) || !digits(rest.substr(dash + 1)) || dash > 9) return std::nullopt;
  return std::stol(rest.substr(0, dash));
}

}  // namespace

std::filesystem::path temporary_beside(const std::filesystem::path& path, std::string_view tag) {
  static std::atomic<unsigned> counter{0};
  const std::string suffix = fmt::format(".{}-{}-{}-{}", tag, host_tag(), ::getpid(), counter++);
  return path.parent_path() / (hidden_prefix(path, suffix.size()) + suffix);
}

std::vector<std::filesystem::path> remove_stale_temporaries(const std::filesystem::path& path, std::string_view tag,
                                                            std::chrono::seconds min_age) {
  namespace fs = std::filesystem;
  std::vector<fs::path> removed;
  std::error_code ec;
  const fs::path folder = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  fs::directory_iterator it(folder, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const std::optional<long> pid = temporary_writer(it->path().filename().string(), path, tag);
    // Only a writer on this host can be asked whether it still runs; one that does (or that we
    // may not signal: EPERM) keeps its file.
    if (!pid || *pid == ::getpid() || ::kill(static_cast<pid_t>(*pid), 0) == 0 || errno != ESRCH) continue;
    std::error_code fe;
    if (!it->is_regular_file(fe) || it->is_symlink(fe)) continue;
    const auto age = fs::file_time_type::clock::now() - fs::last_write_time(it->path(), fe);
    if (fe || age < min_age) continue;  // written lately: perhaps a pid reused here, or a shared clock's skew
    if (fs::remove(it->path(), fe)) {
      std::cerr << fmt::format("ferry: removed '{}', left by an interrupted write of '{}' (process {} has ended)\n",
                               it->path().string(), path.string(), *pid);
      removed.push_back(it->path());
    }
  }
  return removed;
}

namespace {

bool stdout_was_closed = false;

}  // namespace

void reserve_standard_streams() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
    const int opened = ::open(fd == 1 ? "/dev/full" : "/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
    if (opened >= 0 && opened != fd) {
      ::dup2(opened, fd);
      ::close(opened);
    }
    if (fd == 1) stdout_was_closed = true;
  }
}

std::optional<std::string> standard_output_failure() {
  std::cout.flush();
  // The write that failed may be long past (std::endl flushed it), and with it its errno.
  const bool failed = !std::cout || std::fflush(stdout) != 0 || std::ferror(stdout);
  if (!failed) return std::nullopt;
  if (stdout_was_closed)
    return "standard output is closed, so the results printed there were lost: run it with stdout open";
  return "writing the results to standard output failed (a full disk, a closed pipe or another I/O error), so they "
         "were lost: check where stdout goes";
}

OutputLock::OutputLock(const std::filesystem::path& path, std::string_view what) {
  lock_path_ = path.parent_path() / (hidden_prefix(path, 5) + ".lock");
  // The file a holder unlinks on release may be opened by another before it goes: a lock taken on
  // a file no longer at the path is dropped and taken again on the one there now.
  for (int attempt = 0; attempt < 100; ++attempt) {
    fd_ = ::open(lock_path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) {
      const int err = errno;
      if (const std::optional<std::string> folder = missing_folder(path)) {  // what to do, not the lock's name
        throw std::runtime_error(fmt::format("cannot write the {} '{}': {}", what, path.string(), *folder));
      }
      // The lock file is ferry's own (a run's, removed when it ends): a folder or unwritable file
      // in its place is in the way of every run writing this path.
      throw std::runtime_error(fmt::format(
          "cannot lock the {} '{}': creating its lock file '{}' failed ({}): {}", what, path.string(),
          lock_path_.string(), std::strerror(err),
          err == EISDIR ? "a folder has its name: remove it (ferry makes the lock file itself)"
                        : "make the folder writable, remove what has the lock file's name, or give another path"));
    }
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      char holder[256] = {};
      [[maybe_unused]] const ssize_t n = ::pread(fd_, holder, sizeof holder - 1, 0);
      ::close(fd_);
      fd_ = -1;
      if (err != EWOULDBLOCK) {
        throw std::runtime_error(fmt::format("cannot lock the {} '{}': flock on '{}' failed ({})", what, path.string(),
                                             lock_path_.string(), std::strerror(err)));
      }
      std::string who(holder);
      while (!who.empty() && (who.back() == '\n' || who.back() == '\0')) who.pop_back();
      throw std::runtime_error(fmt::format(
          "the {} '{}' is being written by another run ({}): give this run another path, or wait for that one to end",
          what, path.string(), who.empty() ? "a process that holds its lock" : who));
    }
    struct stat held {
    }, there{};
    if (::fstat(fd_, &held) == 0 && ::stat(lock_path_.c_str(), &there) == 0 && held.st_ino == there.st_ino &&
        held.st_dev == there.st_dev) {
      const std::string me = fmt::format("process {} on host {}", ::getpid(), host_tag());
      [[maybe_unused]] const int cut = ::ftruncate(fd_, 0);
      [[maybe_unused]] const ssize_t wrote = ::pwrite(fd_, me.data(), me.size(), 0);
      return;
    }
    ::close(fd_);
    fd_ = -1;
  }
  throw std::runtime_error(
      fmt::format("cannot lock the {} '{}': '{}' kept being replaced", what, path.string(), lock_path_.string()));
}

OutputLock::~OutputLock() {
  if (fd_ < 0) return;
  ::unlink(lock_path_.c_str());  // while still held: a process that opened it meanwhile takes it again
  ::close(fd_);
}

}  // namespace ferry
