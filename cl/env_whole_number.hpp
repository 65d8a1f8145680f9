// FERRY_* environment variables that hold a whole number, read by one parser so that each is
// refused alike: named, with its value, its range and what it sets. Private to the library (every
// layer may use it: it is below them all).
#pragma once

#include <fmt/format.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string_view>

namespace ferry::cl {

// The value of the variable `name`, or nullopt when it is unset or empty. Anything but a whole
// number from `lo` to `hi` throws std::invalid_argument, e.g. "FERRY_BUILD_THREADS='0': expected a
// whole number from 1 to 1024 (<meaning>)".
inline std::optional<std::uint64_t> env_whole_number(const char* name, std::uint64_t lo, std::uint64_t hi,
                                                     std::string_view meaning) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const unsigned long long n = std::strtoull(v, &end, 10);
  // strtoull also takes leading blanks, a sign (a minus wraps around) and stops at the first
  // non-digit: a value must be digits alone.
  if (*v < '0' || *v > '9' || *end != '\0' || errno != 0 || n < lo || n > hi) {
    throw std::invalid_argument(
        fmt::format("{}='{}': expected a whole number from {} to {} ({})", name, v, lo, hi, meaning));
  }
  return n;
}

}  // namespace ferry::cl
