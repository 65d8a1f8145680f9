// Text outputs (traces, CSV profiles) written whole or not at all: into a temporary file beside
// the target, flushed and checked, then renamed over it, so a failure (a full disk, say) leaves the
// previous file as it was. Private to runtime/.
#pragma once

#include <filesystem>
#include <functional>
#include <ostream>

namespace ferry {

// Calls write(stream) on a temporary file beside `path`, then renames it to `path`. Throws
// std::runtime_error("<what> '<path>': <the OS's reason>") when the file cannot be created,
// written or renamed; the temporary file is removed and `path` untouched then.
void write_output_file(const std::filesystem::path& path, const char* what,
                       const std::function<void(std::ostream&)>& write);

}  // namespace ferry
