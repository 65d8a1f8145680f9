// The command-line reading the examples share: "--flag value" or "--flag=value", numbers read whole
// (no trailing text, no sign where unsigned), -h / --help prints the example's usage. Kept apart
// from ferry: a trainer that links ferry brings its own option parser (the `ferry` program uses
// CLI11); this is the least each example needs.
#pragma once

#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>

namespace example {

// Calls on(name, value) for each option in argv; an option with no value, or one `on` rejects,
// throws std::invalid_argument naming it (main prints it and the usage).
template <class OnOption>
void for_each_option(int argc, char** argv, void (*usage)(), OnOption&& on) {
  for (int i = 1; i < argc; ++i) {
    std::string_view name = argv[i], value;
    bool has_value = false;
    if (const auto eq = name.find('='); eq != std::string_view::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    if (name == "-h" || name == "--help") {
      usage();
      std::exit(0);
    }
    if (!has_value) {
      if (i + 1 >= argc) throw std::invalid_argument(std::string(name) + " needs a value");
      value = argv[++i];
    }
    if (!on(name, value)) throw std::invalid_argument("unknown option '" + std::string(name) + "'");
  }
}

template <class T>
T parse_number(std::string_view flag, std::string_view text) {
  T value{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc{} || end != text.data() + text.size()) {
    throw std::invalid_argument(std::string(flag) + " expects a number, got '" + std::string(text) + "'");
  }
  return value;
}

inline std::uint32_t parse_count(std::string_view flag, std::string_view text) {
  const auto value = parse_number<std::uint32_t>(flag, text);
  if (value == 0) throw std::invalid_argument(std::string(flag) + " must be at least 1");
  return value;
}

// An example's main: the command line read by `parse` (a bad one: the error and the usage, exit
// status 2), then `run` (an error: exit status 1).
template <class Args>
int main_of(const char* name, int argc, char** argv, void (*usage)(), Args (*parse)(int, char**),
            int (*run)(const Args&)) {
  Args args;
  try {
    args = parse(argc, argv);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    usage();
    return 2;
  }
  try {
    return run(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", name, e.what());
    return 1;
  }
}

}  // namespace example
