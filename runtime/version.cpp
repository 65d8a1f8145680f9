// Version, git commit and the OpenCL devices seen (`--version`).
#include "ferry/runtime/version.hpp"

#include <fmt/format.h>

#include <exception>

#include "ferry/cl/device.hpp"
#include "ferry/runtime/units.hpp"

#ifndef FERRY_VERSION
#define FERRY_VERSION "unknown"
#endif
#ifndef FERRY_GIT_COMMIT
#define FERRY_GIT_COMMIT "unknown"
#endif

namespace ferry {

const char* version() noexcept {
  return FERRY_VERSION;
}

const char* git_commit() noexcept {
  return FERRY_GIT_COMMIT;
}

std::string version_text(const std::string& program) {
  std::string out = fmt::format("{} {} (git {})", program, version(), git_commit());
  try {
    const auto devices = cl::list_devices();
    if (devices.empty()) return out + "\nOpenCL devices: none (see docs/troubleshooting.md)";
    out += "\nOpenCL devices:";
    for (const auto& d : devices) {
      out += fmt::format("\n  [{}] {} / {} ({}, {}, {})", d.index, d.platform_name, d.name, d.type_name(),
                         format_bytes(d.global_mem_bytes), d.version);
    }
  } catch (const std::exception& e) {
    out += fmt::format("\nOpenCL devices: cannot list them: {}", e.what());
  }
  return out;
}

}  // namespace ferry
