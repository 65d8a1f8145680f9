// FERRY_* environment variables that turn something on or off, read by one parser so that each
// takes the same words and refuses the same way. Private to the library (every layer may use it:
// it is below them all), like env_whole_number.hpp.
#pragma once

#include <fmt/format.h>

#include <array>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string_view>

namespace ferry::cl {

// The word a switch variable was given, as on or off: nullopt when it is unset or empty. "1", "on",
// "true" and "yes" are on; "0", "off", "false" and "no" are off. Anything else throws
// std::invalid_argument, e.g. "FERRY_PROGRAM_CACHE='of': expected 0 or 1 (also off/on, false/true,
// no/yes) (<meaning>)": a misspelt "off" must not leave the thing on.
inline std::optional<bool> env_switch(const char* name, std::string_view meaning) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  const std::string_view s(v);
  static constexpr std::array<std::string_view, 4> on{"1", "on", "true", "yes"};
  static constexpr std::array<std::string_view, 4> off{"0", "off", "false", "no"};
  for (std::string_view w : on) {
    if (s == w) return true;
  }
  for (std::string_view w : off) {
    if (s == w) return false;
  }
  throw std::invalid_argument(
      fmt::format("{}='{}': expected 0 or 1 (also off/on, false/true, no/yes) ({})", name, s, meaning));
}

}  // namespace ferry::cl
