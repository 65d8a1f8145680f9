// Byte size parsing and formatting.
#include "ferry/runtime/units.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <stdexcept>

namespace ferry {

std::uint64_t parse_bytes(std::string_view text) {
  std::string s(text);
  s.erase(std::remove_if(s.begin(), s.end(), [](unsigned char c) { return std::isspace(c); }), s.end());
  std::size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(s, &pos);
  } catch (const std::exception&) {
    throw std::invalid_argument(
        fmt::format("'{}' is not a size: write a number with an optional unit, e.g. 64MiB", text));
  }
  std::string unit = s.substr(pos);
  std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char c) { return std::tolower(c); });
  struct Unit {
    const char* name;
    double factor;
  };
  static constexpr Unit units[] = {{"", 1},
                                   {"b", 1},
                                   {"k", 1024.0},
                                   {"kib", 1024.0},
                                   {"kb", 1e3},
                                   {"m", 1048576.0},
                                   {"mib", 1048576.0},
                                   {"mb", 1e6},
                                   {"g", 1073741824.0},
                                   {"gib", 1073741824.0},
                                   {"gb", 1e9},
                                   {"tib", 1099511627776.0},
                                   {"tb", 1e12}};
  for (const auto& u : units) {
    if (unit == u.name) {
      // Rounded first, then compared with 2^64 (exact in a double): std::llround stops at 2^63
      // and converting a double at or above 2^64 to uint64_t is undefined (found by fuzz/units.cpp: "14444444444.5 G").
      const double bytes = std::round(value * u.factor);
      if (!(bytes >= 0) || !(bytes < 18446744073709551616.0)) {
        throw std::invalid_argument(
            fmt::format("size '{}' is out of range: a size is not negative and is below 2^64 bytes (about 16.8 million "
                        "TiB), e.g. 64MiB",
                        text));
      }
      return static_cast<std::uint64_t>(bytes);
    }
  }
  throw std::invalid_argument(
      fmt::format("unknown unit '{}' in '{}': use B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB)", unit, text));
}

namespace {

// `b` in the largest binary unit under which it is at least 1, to one decimal; `up`: rounded up.
std::string format_scaled(std::uint64_t b, bool up) {
  const char* names[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return fmt::format("{:.1f} {}", up ? std::ceil(v * 10 - 1e-9) / 10 : v, names[u]);
}

}  // namespace

std::string format_bytes(std::uint64_t b) {
  return format_scaled(b, false);
}

std::string format_bytes_up(std::uint64_t b) {
  return format_scaled(b, true);
}

std::string format_duration(double seconds) {
  const auto s = static_cast<long>(std::max(0.0, seconds));
  return fmt::format("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60);
}

}  // namespace ferry
