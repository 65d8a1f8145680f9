// Whole-or-nothing text outputs (see output_file.hpp).
#include "output_file.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>

namespace ferry {

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
                                         what, path.string(),
                                         fs::is_directory(st) ? "a folder" : "a device, pipe or socket"));
  }
  if (replace_foreign_file || fs::file_size(path, ec) == 0) return;  // an empty file: a name made for it
  std::ifstream in(path, std::ios::binary);
  std::string head(signature.size(), '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<std::size_t>(in.gcount()));
  if (head == signature) return;  // (an unreadable file reads as nothing, and is refused)
  throw std::runtime_error(fmt::format(
      "cannot write the {} to '{}': the file exists and is not a {} ferry wrote, so it is left as it is: give "
      "another path, or replace it on purpose (WriteOptions::replace_foreign_file; ferry train --force)",
      what, path.string(), what));
}

void write_output_file(const std::filesystem::path& path, const char* what, std::string_view signature,
                       WriteOptions options, const std::function<void(std::ostream&)>& write) {
  refuse_to_replace(path, what, signature, options.replace_foreign_file);
  const std::filesystem::path tmp = temporary_beside(path, "tmp");
  auto fail = [&](const char* doing, int err) {
    std::error_code ec;
    std::filesystem::remove(tmp, ec);
    return std::runtime_error(
        fmt::format("{} '{}': {} failed: {}", what, path.string(), doing, err ? std::strerror(err) : "unknown error"));
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
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw fail("renaming the finished file into place", errno);
}

std::size_t longest_file_name(const std::filesystem::path& path) {
  const std::filesystem::path folder = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  const long limit = ::pathconf(folder.c_str(), _PC_NAME_MAX);
  return limit > 0 ? static_cast<std::size_t>(limit) : 255;
}

std::filesystem::path temporary_beside(const std::filesystem::path& path, std::string_view tag) {
  static std::atomic<unsigned> counter{0};
  const std::string suffix = fmt::format(".{}-{}-{}", tag, ::getpid(), counter++);
  std::string name = path.filename().string();
  // "." + name + suffix within the limit; the name is cut at a byte, which is fine for a name no
  // one reads and which is removed or renamed away.
  const std::size_t longest = longest_file_name(path);
  const std::size_t room = longest - std::min(longest, suffix.size() + 1);
  if (name.size() > room) name.resize(room);
  return path.parent_path() / ("." + name + suffix);
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

}  // namespace ferry
