// Whole-or-nothing text outputs (see output_file.hpp).
#include "output_file.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
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
  const std::filesystem::path tmp = path.string() + fmt::format(".tmp{}", ::getpid());
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

}  // namespace ferry
