// Peers run from benchmarks (see peer.hpp).
#include "peer.hpp"

#include <fmt/format.h>
#include <strings.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "ferry/runtime/trainer.hpp"
#include "runtime/plan_search.hpp"
#include "runtime/trainer_internals.hpp"

namespace ferry::bench {

namespace fs = std::filesystem;

std::string find_on_path(const std::string& name) {
  // An executable file: a directory is "executable" (searchable) too, but runs nothing.
  const auto runnable = [](const fs::path& p) {
    std::error_code ec;
    return ::access(p.c_str(), X_OK) == 0 && !fs::is_directory(p, ec);
  };
  if (name.find('/') != std::string::npos) return runnable(name) ? name : std::string();
  const char* path = std::getenv("PATH");
  if (!path) return {};
  std::istringstream dirs(path);
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const fs::path candidate = fs::path(dir.empty() ? "." : dir) / name;
    if (runnable(candidate)) return candidate.string();
  }
  return {};
}

std::string interpreter_not_found(const std::string& name) {
  constexpr const char* give = "(give one with torch: --python)";
  if (name.find('/') == std::string::npos) return fmt::format("interpreter not found: no {} on PATH {}", name, give);
  std::error_code ec;
  const fs::file_status st = fs::status(name, ec);
  if (!fs::exists(st)) return fmt::format("interpreter not found: no file {} {}", name, give);
  if (fs::is_directory(st)) return fmt::format("interpreter not usable: {} is a directory {}", name, give);
  return fmt::format("interpreter not usable: {} is not executable {}", name, give);
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::vector<nlohmann::json> run_json_command(const std::string& command) {
  fmt::print(stderr, "running peer: {}\n", command);
  std::FILE* pipe = ::popen(command.c_str(), "r");
  if (!pipe) return {{{"error", fmt::format("popen failed: {}", std::strerror(errno))}}};
  std::string out;
  char buf[4096];
  while (std::size_t n = std::fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
  const int status = ::pclose(pipe);
  std::vector<nlohmann::json> results;
  std::string unparsed;  // the first line that looks like an object but is not JSON (NaN, say)
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.is_object()) {
      results.push_back(std::move(j));
    } else if (unparsed.empty() && line.starts_with('{')) {
      unparsed = line.size() > 240 ? line.substr(0, 240) + "..." : line;
    }
  }
  if (results.empty()) {
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (!unparsed.empty()) {
      return {{{"error", fmt::format("peer printed a result that is not valid JSON (a NaN or Infinity is not JSON; "
                                     "exit status {}): {}",
                                     code, unparsed)}}};
    }
    return {{{"error", fmt::format("peer printed no JSON result (exit status {})", code)}}};
  }
  if (!results.back().contains("error") && status != 0) {
    results.back()["error"] = fmt::format("peer exit status {}", status);
  }
  return results;
}

std::string peer_script_path(const std::string& file) {
  // Installed: <prefix>/bin/ferry-bench finds <prefix>/share/ferry/peers/<file>.
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const fs::path installed = exe.parent_path() / ".." / "share" / "ferry" / "peers" / file;
    if (fs::exists(installed, ec)) return fs::weakly_canonical(installed, ec).string();
  }
  // In the build tree: the sources' bench/peers.
  const fs::path here = fs::path(FERRY_BENCH_SOURCE_DIR) / "peers" / file;
  if (fs::exists(here, ec)) return here.string();
  return "bench/peers/" + file;
}

CLI::Option* add_peer_device_option(CLI::App& sub, std::string& device) {
  return sub.add_option("--peer-device", device, "where the PyTorch peer runs: cpu, cuda or cuda:N")
      ->capture_default_str()
      ->check([](const std::string& d) {
        return d == "cpu" || d == "cuda" || d.starts_with("cuda:")
                   ? std::string()
                   : std::string("cpu, cuda or cuda:N, not '" + d + "'");
      });
}

// OPENBLAS_CORETYPE for this CPU: Debian's OpenBLAS (0.3.21) falls back to a slow kernel set on
// CPUs it does not know, so name the closest one it does from the CPU's flags.
std::string openblas_coretype() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::set<std::string> flags;
    for (std::string w; words >> w;) flags.insert(w);
    if (flags.count("avx512_bf16")) return "Cooperlake";
    if (flags.count("avx512f")) return "SkylakeX";
    return "Haswell";
  }
  return "Haswell";
}

bool openblas_core_fits(const char* chosen) {
  const std::string suggested = openblas_coretype();  // (spelled as OpenBLAS names its cores)
  return strcasecmp(chosen, suggested.c_str()) == 0 || (suggested == "Haswell" && strcasecmp(chosen, "Zen") == 0) ||
         (suggested == "Cooperlake" && strcasecmp(chosen, "SkylakeX") == 0);
}

double step_gflop(const Trainer& trainer) {
  return static_cast<double>(detail::gemm_rate_flops(compiled_train_step(trainer).graph())) / 1e9;
}

void add_step_rate(nlohmann::json& line, double step_gflop) {
  const double ms = line.value("step_ms", 0.0);
  if (step_gflop <= 0 || ms <= 0) return;
  line["step_gflop"] = step_gflop;
  line["gflops"] = step_gflop * 1e3 / ms;
}

}  // namespace ferry::bench
