// ferry-bench entry point: `ferry-bench <name> [options]`; with no name, lists the benchmarks.
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <filesystem>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>

#include "bench.hpp"
#include "ferry/runtime/plan.hpp"
#include "ferry/runtime/trace.hpp"
#include "ferry/runtime/units.hpp"
#include "ferry/runtime/version.hpp"
#include "runtime/cli/validators.hpp"
#include "runtime/output_file.hpp"

namespace ferry::bench {

std::vector<BenchInfo>& registry() {
  static std::vector<BenchInfo> benches;
  return benches;
}

void emit_json(const nlohmann::json& result) {
  nlohmann::json line = result;
  line["schema"] = bench_json_schema;
  std::cout << line.dump() << std::endl;
}

void check_host_memory(const std::string& what, double bytes, const std::string& remedy) {
  const std::uint64_t memory = ferry::physical_memory_bytes();
  if (bytes > static_cast<double>(memory) / 2) {
    const auto needed = static_cast<std::uint64_t>(std::min(bytes, 0x1p63));
    throw std::invalid_argument(fmt::format("{} needs {} of host memory, more than half of this machine's {}; {}", what,
                                            ferry::format_bytes_up(needed), ferry::format_bytes(memory), remedy));
  }
}

}  // namespace ferry::bench

namespace {

// --trace is checked before the benchmark runs: a benchmark that writes no trace, or a path the
// trace could not be written to, is an error now rather than after minutes of measuring.
void check_trace_output(const std::string& bench, const std::string& path) {
  if (bench != "overlap" && bench != "step") {
    throw std::invalid_argument(
        fmt::format("--trace: ferry-bench {} writes no trace (overlap and step do): leave --trace out", bench));
  }
  ferry::refuse_to_replace(path, "trace file", ferry::trace_signature, false);
  const std::filesystem::path p(path);
  const std::filesystem::path folder = p.parent_path().empty() ? std::filesystem::path(".") : p.parent_path();
  if (const auto why = ferry::missing_folder(p)) throw std::invalid_argument(fmt::format("--trace {}: {}", path, *why));
  if (const auto why = ferry::cannot_create_in(folder)) {
    throw std::invalid_argument(
        fmt::format("--trace {}: cannot create a file in '{}': {}: give a path in a writable "
                    "folder (checked before the benchmark runs)",
                    path, folder.string(), *why));
  }
}

int run_bench(int argc, char** argv) {
  using namespace ferry::bench;
  CLI::App app{"ferry-bench: ferry beside its baselines, one JSON line per result"};
  app.failure_message(ferry::cli::failure_message);
  app.fallthrough();  // common options may follow the benchmark name
  app.set_version_flag(
      "--version", [] { return ferry::version_text("ferry-bench"); },
      "Print the version, git commit and the OpenCL devices seen, and exit");
  BenchCommon common;
  using ferry::cli::not_empty;  // "" (an unset shell variable, say) is refused, not read as "not given"
  app.add_option("--device", common.device, "OpenCL device: index or name substring (default: FERRY_DEVICE, a GPU)")
      ->check(not_empty());
  app.add_option("--trace", common.trace, "write a Chrome trace to this file (benchmarks that trace)")
      ->check(not_empty());
  app.add_option("--repeat", common.repeat, "timed repetitions; results report the median")
      ->check(ferry::cli::positive_number());
  auto& benches = registry();
  std::sort(benches.begin(), benches.end(), [](const BenchInfo& a, const BenchInfo& b) { return a.name < b.name; });
  std::vector<BenchRun> runs(benches.size());
  std::vector<CLI::App*> subs;
  for (std::size_t i = 0; i < benches.size(); ++i) {
    CLI::App* sub = app.add_subcommand(benches[i].name, benches[i].help);
    runs[i] = benches[i].setup(*sub, common);
    subs.push_back(sub);
  }
  app.require_subcommand(0, 1);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  for (std::size_t i = 0; i < subs.size(); ++i) {
    if (!subs[i]->parsed()) continue;
    try {
      if (!common.trace.empty()) check_trace_output(benches[i].name, common.trace);
      return runs[i]();
    } catch (const std::exception& e) {
      fmt::print(stderr, "ferry-bench {}: {}\n", benches[i].name, e.what());
      return 1;
    }
  }
  fmt::print("benchmarks (ferry-bench <name> --help for options):\n");
  for (const BenchInfo& b : benches) fmt::print("  {:<12} {}\n", b.name, b.help);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ferry::reserve_standard_streams();
  const int status = run_bench(argc, argv);
  if (const auto lost = ferry::standard_output_failure()) {
    fmt::print(stderr, "ferry-bench: error: {}\n", *lost);
    return status != 0 ? status : 1;
  }
  return status;
}
