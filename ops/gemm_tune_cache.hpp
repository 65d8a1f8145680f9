// The tuning caches: one small text file per device, driver and kernel source, holding the tuner's
// winner, checksummed like the program cache. The GEMM's (below) holds a row of the tuning data;
// the attention's (ops/attention_tuner.cpp) a kernel. Private to ops/.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include "ferry/cl/device.hpp"
#include "gemm_tuning.hpp"
#include "ops/gemm_tune.hpp"

namespace ferry::ops {

// What a cached winner depends on: the device, its driver and the kernel files being tuned, by file
// stem ("gemm_tiled"), each with the headers it includes inlined (the text that is built). An
// unknown stem throws std::invalid_argument.
std::uint64_t tune_cache_key(const cl::DeviceInfo& device, std::initializer_list<std::string_view> kernel_files);

// Tuning files (caches and FERRY_GEMM_TUNING) are a few lines; anything larger is not one.
inline constexpr std::uintmax_t max_tuning_file_bytes = std::uintmax_t{1} << 20;

// The text of a tuning file, or nullopt: with `problem` empty when there is no such file, else
// saying why it cannot be used ("is a folder, not a file", "is a FIFO (named pipe), not a regular
// file", "is 2097152 bytes, more than ...", "cannot be read: Permission denied"). Anything but a
// regular file is refused without being opened, and at most max_tuning_file_bytes are read.
std::optional<std::string> read_tuning_file(const std::string& path, std::string& problem);

// A tuning cache file's text without its last line, "# checksum <16 hex digits>" (FNV-1a of the
// lines above it), or nullopt when there is no file. A file without that line or failing it, or one
// that is not a regular file of at most max_tuning_file_bytes, prints a warning naming the file and
// `what` ("GEMM tuning cache") and returns nullopt; a folder's warning says to remove it. With
// `warn` false nothing is printed (a tuner checking what it is about to replace).
std::optional<std::string> read_tune_cache_text(const std::string& path, const char* what, bool warn = true);

// What a search covered, as a cache's comment says it: "N of M candidates in S s", then ", budget
// spent" or ", stopped by a signal" where either ended it.
std::string tune_coverage_comment(std::size_t measured, std::size_t planned, double seconds, bool budget_ran_out,
                                  bool stopped);
// What a cache file's text (or body) records of its search ("<mode> search, N of M candidates in
// S s[, stopped by a signal]" in a comment line): nullopt when it records nothing (such a row is
// replaced by any search's). Every cache written since the tuner exists has that line.
std::optional<TuneCoverage> tune_cache_coverage(std::string_view text);
// Whether first use searches again over a cached winner: where a signal stopped the search that
// found it (`coverage`), unless a search of this process has just settled it (`settled`); said on
// stderr where `tell` ("the cached <what> in <cache> are from a search stopped after ...").
bool search_stopped_winner_again(const std::optional<TuneCoverage>& coverage, bool settled, bool tell,
                                 const std::string& cache, std::string_view what);
// Whether a new winner whose search measured `measured` candidates may be saved over what a cache
// holds: nullopt when it may (no cached result, or one from a search that measured no more
// candidates), else what the cached one's search covered. `cached` is the cache's valid body, or
// nullopt when there is none (or it is damaged, foreign or not valid: it is replaced).
std::optional<TuneCoverage> tune_cache_to_keep(const std::optional<std::string>& cached, std::size_t measured);

// Writes `body` and its checksum line to a temporary file beside `path` and renames it into place,
// so a reader (or an interrupted tuner) never sees half a file. Returns "<path>: <what failed and
// why>" (the system's reason) when the file cannot be written, after printing a warning saying
// so; "" when it was written.
std::string write_tune_cache_text(const std::string& path, const std::string& body, const char* what);

// The file for this device under `dir` (the program cache's folder).
std::string gemm_tune_cache_file(const std::string& dir, const cl::DeviceInfo& device);

// The cached row, or nullopt when there is no file. A file that is damaged, foreign (another
// device) or fails its checksum prints a warning naming it and returns nullopt (it is retuned and
// overwritten). `coverage`, when given, receives what its search covered ({} where its comment
// does not say).
std::optional<GemmTuningRow> read_gemm_tune_cache(const std::string& path, const cl::DeviceInfo& device,
                                                  TuneCoverage* coverage = nullptr);
// The cached file's body when it holds a valid row for `device`, read without warnings; else nullopt.
std::optional<std::string> valid_gemm_tune_cache_body(const std::string& path, const cl::DeviceInfo& device);

// Writes the row, with a comment saying what was measured (write_tune_cache_text).
std::string write_gemm_tune_cache(const std::string& path, const std::string& row, const std::string& comment);

}  // namespace ferry::ops
