// Whole-or-nothing text outputs (see output_file.hpp).
#include "output_file.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>

namespace ferry {

void write_output_file(const std::filesystem::path& path, const char* what,
                       const std::function<void(std::ostream&)>& write) {
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
