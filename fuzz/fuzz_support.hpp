// What the fuzz harnesses share: a check that aborts (libFuzzer's finding), and an in-memory file
// for readers that take a path.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace ferry::fuzz {

inline void check(bool ok) {
  if (!ok) std::abort();
}

// One in-memory file, rewritten for every input, read through its /proc path.
class MemoryFile {
 public:
  explicit MemoryFile(const char* name) : fd_(::memfd_create(name, 0)) { check(fd_ >= 0); }
  MemoryFile(const MemoryFile&) = delete;
  MemoryFile& operator=(const MemoryFile&) = delete;
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }
  void set(const void* data, std::size_t size) {
    check(::ftruncate(fd_, 0) == 0);
    const auto* bytes = static_cast<const std::uint8_t*>(data);
    std::size_t done = 0;
    while (done < size) {
      const ssize_t w = ::pwrite(fd_, bytes + done, size - done, static_cast<off_t>(done));
      check(w > 0);
      done += static_cast<std::size_t>(w);
    }
  }

 private:
  int fd_;
};

}  // namespace ferry::fuzz
