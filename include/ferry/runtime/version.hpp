// Which ferry this is: the release (CMake project version) and the git commit it was configured
// from, and the text `ferry --version` and `ferry-bench --version` print.
#pragma once

#include <string>

namespace ferry {

// "0.1.0".
const char* version() noexcept;
// The git commit of the source tree at configure time (12 hex digits), or "unknown" when the
// sources were not a git checkout.
const char* git_commit() noexcept;
// "<program> <version> (git <commit>)" and a line per OpenCL device the ICD loader reports
// ("OpenCL devices: none" when there are none), without a final newline.
std::string version_text(const std::string& program);

}  // namespace ferry
