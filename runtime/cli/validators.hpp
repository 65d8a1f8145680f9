// Checks of option values that CLI11's own do not make, shared by `ferry` and `ferry-bench`:
// finite positive numbers within a float's range, whole numbers, text that is not empty, and the
// message of a value an option cannot hold.
#pragma once

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <string_view>

#include "ferry/runtime/units.hpp"

namespace ferry::cli {

// A budget option's bytes: "--device-budget: size 'x' ..." where the size does not parse, and 0,
// the library's "no limit" (or "not given"), refused rather than read as that: "--device-budget 0:
// a budget must be more than 0 bytes (leave --device-budget out to ...)". `separator` joins the
// option and its value as the user wrote them (' ', or '=' in a --config list).
inline std::uint64_t budget_option(std::string_view option, std::string_view value, char separator,
                                   std::string_view left_out) {
  std::uint64_t bytes = 0;
  try {
    bytes = ferry::parse_bytes(value);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(fmt::format("{}: {}", option, e.what()));
  }
  if (bytes == 0) {
    throw std::invalid_argument(
        fmt::format("{}{}{}: a budget must be more than 0 bytes ({})", option, separator, value, left_out));
  }
  return bytes;
}

// A number option that must be finite and > 0: "--lr: must be a finite number > 0, got 0" (CLI11's
// own range check prints the largest double, 309 digits).
inline CLI::Validator positive_number() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (end == text.c_str() || *end != '\0' || !std::isfinite(v) || v <= 0) {
          return fmt::format("must be a finite number > 0, got {}", text);
        }
        // Most of these options are floats: a value a float cannot hold would become inf or 0.
        if (v > std::numeric_limits<float>::max() || v < std::numeric_limits<float>::min()) {
          return fmt::format("must be between {:g} and {:g}, got {}", std::numeric_limits<float>::min(),
                             std::numeric_limits<float>::max(), text);
        }
        return {};
      },
      "> 0");
}

// A number option that must be finite and >= 0: "--warmup: must be a finite number >= 0, got -1".
inline CLI::Validator non_negative_number() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (end == text.c_str() || *end != '\0' || !std::isfinite(v) || v < 0) {
          return fmt::format("must be a finite number >= 0, got {}", text);
        }
        if (v > std::numeric_limits<float>::max()) {
          return fmt::format("must be at most {:g}, got {}", std::numeric_limits<float>::max(), text);
        }
        return {};
      },
      ">= 0");
}

// A whole number >= 0 (a seed): "-1" would wrap around in an unsigned option.
inline CLI::Validator whole_number() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos) {
          return fmt::format("must be a whole number >= 0, got {}", text);
        }
        return {};
      },
      "UINT");
}

// A path, device or other text option given as "" (an unset shell variable, say) is refused
// rather than read as "not given".
inline CLI::Validator not_empty() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        return text.empty() ? std::string("is empty: give a value, or leave the option out") : std::string();
      },
      "TEXT");
}

// CLI11's failure message, except for a value a whole-number option could not take ("Could not
// convert: --steps = 1.5" said neither what was wrong nor what to give): "--steps: 1.5 is not a
// whole number ..." or "--steps: 99999999999 is more than this option can hold ...". Set with
// app.failure_message(failure_message).
inline std::string failure_message(const CLI::App* app, const CLI::Error& e) {
  const std::string what = e.what(), prefix = "Could not convert: ";
  const std::size_t eq = what.find(" = ");
  if (dynamic_cast<const CLI::ConversionError*>(&e) == nullptr || !what.starts_with(prefix) ||
      eq == std::string::npos) {
    return CLI::FailureMessage::simple(app, e);
  }
  const std::string name = what.substr(prefix.size(), eq - prefix.size()), value = what.substr(eq + 3);
  const auto all_digits = [](std::string_view t) {
    return !t.empty() && t.find_first_not_of("0123456789") == std::string_view::npos;
  };
  std::string why;
  if (all_digits(value)) {
    why = fmt::format("{}: {} is more than this option can hold: give a smaller whole number", name, value);
  } else if (value.starts_with('-') && all_digits(std::string_view(value).substr(1))) {
    why = fmt::format("{}: {} is less than this option can hold: give a larger whole number", name, value);
  } else {
    why = fmt::format("{}: {} is not a whole number: give one in digits (no fraction or exponent)", name, value);
  }
  return CLI::FailureMessage::simple(app, CLI::ConversionError(why));
}

}  // namespace ferry::cli
