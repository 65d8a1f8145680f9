// The GEMM tuning cache: one small text file per device, driver and GEMM kernel source, holding
// the tuner's winning row, checksummed like the program cache. Private to ops/gemm*.cpp.
#pragma once

#include <optional>
#include <string>

#include "ferry/cl/device.hpp"
#include "gemm_tuning.hpp"

namespace ferry::ops {

// The file for this device under `dir` (the program cache's folder).
std::string gemm_tune_cache_file(const std::string& dir, const cl::DeviceInfo& device);

// The cached row, or nullopt when there is no file. A file that is damaged, foreign (another
// device) or fails its checksum prints a warning naming it and returns nullopt (it is retuned and
// overwritten).
std::optional<GemmTuningRow> read_gemm_tune_cache(const std::string& path, const cl::DeviceInfo& device);

// Writes the row (with a comment saying what was measured) to a temporary file beside `path` and
// renames it into place, so a reader (or an interrupted tuner) never sees half a file. Returns
// false after printing a warning when the folder cannot be written.
bool write_gemm_tune_cache(const std::string& path, const std::string& row, const std::string& comment);

}  // namespace ferry::ops
