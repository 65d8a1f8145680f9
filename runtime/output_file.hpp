// Outputs written whole or not at all, and never over what they must not replace. Private to
// runtime/.
#pragma once

#include <filesystem>
#include <functional>
#include <ostream>
#include <string_view>

#include "ferry/runtime/write_options.hpp"

namespace ferry {

// Throws std::runtime_error, before anything is written, when `path` names what an output (`what`:
// "checkpoint", "trace file"...) must not replace: a symbolic link, anything but a regular file,
// or, unless `replace_foreign_file`, a non-empty file that does not begin with `signature` (how
// such a file ferry wrote begins).
void refuse_to_replace(const std::filesystem::path& path, std::string_view what, std::string_view signature,
                       bool replace_foreign_file);

// Text outputs (traces, CSV profiles): refuse_to_replace, then write(stream) into a temporary file
// beside `path`, flushed and checked, then renamed over it, so a failure (a full disk, say) leaves
// the previous file as it was. Throws std::runtime_error("<what> '<path>': <the OS's reason>")
// when the file cannot be created, written or renamed; the temporary file is removed and `path`
// untouched then. The text `write` produces must begin with `signature`.
void write_output_file(const std::filesystem::path& path, const char* what, std::string_view signature,
                       WriteOptions options, const std::function<void(std::ostream&)>& write);

}  // namespace ferry
