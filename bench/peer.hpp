// Running a peer (a PyTorch script) from a benchmark: finding the interpreter, quoting, and
// reading the JSON lines the peer prints.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace ferry {
class Trainer;
}

namespace ferry::bench {

// `name` as the shell would find it on PATH (names with a slash are returned as they are if
// executable); empty if not found.
std::string find_on_path(const std::string& name);

// Why find_on_path(name) found no interpreter, as a peer line's error: "interpreter not found: no
// file /x (give one with torch: --python)", or "interpreter not usable: /etc/passwd is not
// executable (...)" for a file that exists but cannot be run.
std::string interpreter_not_found(const std::string& name);

// `s` quoted for /bin/sh.
std::string shell_quote(const std::string& s);

// Runs `command` through the shell and returns every stdout line that parses as a JSON object,
// in order. If there is none, one object with "error" (and the exit status); if the command
// failed, the last object gets an "error" unless it has one.
std::vector<nlohmann::json> run_json_command(const std::string& command);

// The peer script `file`: installed, <bin>/../share/ferry/peers/<file> next to the running
// ferry-bench; in the build tree, bench/peers of the sources it was built from; else relative to
// the working directory.
std::string peer_script_path(const std::string& file);

// --peer-device into `device`: where the PyTorch peer runs (cpu, cuda or cuda:N), passed on as
// the peer script's --device.
CLI::Option* add_peer_device_option(CLI::App& sub, std::string& device);

// OPENBLAS_CORETYPE for this CPU, from its flags: Debian's OpenBLAS (0.3.21) misdetects CPUs it
// does not know and falls back to a slow kernel set (PyTorch's CPU peers and ferry-bench gemm's
// OpenBLAS baseline).
std::string openblas_coretype();
// Whether OpenBLAS's own choice of core (openblas_get_corename()) runs the single-precision kernels
// openblas_coretype() names: the same core, or one that shares its SGEMM kernels (Zen runs
// Haswell's, SkylakeX Cooperlake's), so that no warning is printed on a CPU OpenBLAS knows.
bool openblas_core_fits(const char* chosen);

// `step_gflop`, the work of the step a peer is set beside (GFLOP: 2 M N K for every GEMM-like
// product of ferry's trained step, as its plan counts them: detail::gemm_rate_flops), and `gflops`,
// that work over the line's `step_ms`, on a step or gpt line: a step and its peer run the same
// model, so each side's rate can be read against `ferry-bench peak`.
void add_step_rate(nlohmann::json& line, double step_gflop);
// That work for `trainer`'s compiled training step, in GFLOP.
double step_gflop(const Trainer& trainer);

}  // namespace ferry::bench
