// Fuzzes parse_bytes (runtime/units.cpp) against a small independent model: the text without
// blanks is a number std::strtod reads in full up to a unit from the table; the result is that
// number times the unit, rounded, if it fits in 64 bits. Everything else must throw
// std::invalid_argument (and nothing else).
#include "ferry/runtime/units.hpp"

#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace {

std::optional<double> model(std::string_view text) {
  std::string s;
  for (char c : text) {
    if (!std::isspace(static_cast<unsigned char>(c))) s += c;
  }
  if (s.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || errno == ERANGE) return std::nullopt;
  std::string unit(end);
  if (unit.find('\0') != std::string::npos) return std::nullopt;
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  double factor = 0;
  const double k = 1024.0;
  if (unit.empty() || unit == "b")
    factor = 1;
  else if (unit == "k" || unit == "kib")
    factor = k;
  else if (unit == "kb")
    factor = 1e3;
  else if (unit == "m" || unit == "mib")
    factor = k * k;
  else if (unit == "mb")
    factor = 1e6;
  else if (unit == "g" || unit == "gib")
    factor = k * k * k;
  else if (unit == "gb")
    factor = 1e9;
  else if (unit == "tib")
    factor = k * k * k * k;
  else if (unit == "tb")
    factor = 1e12;
  else
    return std::nullopt;
  const double bytes = std::round(value * factor);
  if (!(bytes >= 0) || !(bytes < 0x1p64)) return std::nullopt;
  return bytes;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size > 256) return -1;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (text.find('\0') != std::string_view::npos) return -1;  // sizes come from C strings
  const auto expected = model(text);
  try {
    const std::uint64_t got = ferry::parse_bytes(text);
    if (!expected || static_cast<double>(got) != *expected) std::abort();
  } catch (const std::invalid_argument&) {
    if (expected) std::abort();
  }
  return 0;
}
