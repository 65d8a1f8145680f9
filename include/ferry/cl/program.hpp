// Programs built from kernels embedded at build time, with an on-disk binary cache.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "ferry/cl/context.hpp"
#include "ferry/cl/error.hpp"
#include "ferry/cl/handle.hpp"

namespace ferry::cl {

// The embedded kernel files (ops/kernels/*.cl), keyed by file stem, and headers
// (ops/kernels/*.clh), keyed by file name ("dtype.clh").
const std::vector<std::pair<std::string_view, std::string_view>>& embedded_kernel_sources();
// The kernel file `file` ("elementwise") as embedded, before its includes are inlined.
std::string_view kernel_source(std::string_view file);
// The embedded header `name` ("dtype.clh"); throws std::invalid_argument if there is none.
std::string_view kernel_header(std::string_view name);
// `source` with every line `#include "<name>.clh"` replaced by that embedded header's text
// (recursively; each header at most once per program), framed by #line directives so build
// logs name the right file and line. This is the text that is built and hashed for the program
// cache. An include of a header that is not embedded throws std::invalid_argument naming `file`
// (the including kernel file or program name) and the header.
std::string expand_kernel_includes(std::string_view file, std::string_view source);

struct ProgramCacheOptions {
  bool enabled = true;
  std::filesystem::path dir;
  // FERRY_PROGRAM_CACHE=0 disables the cache (for drivers that cache themselves);
  // FERRY_CACHE_DIR sets the folder, else $XDG_CACHE_HOME/ferry, else ~/.cache/ferry.
  static ProgramCacheOptions from_env();
};

struct ProgramCacheStats {
  std::uint64_t memory_hits = 0, disk_hits = 0, source_builds = 0, corrupt_entries = 0;
};

// Builds and memoises programs per (file, options). A program binary is cached on disk under a
// key of device name, driver version, platform version, source (with its headers inlined) and
// options, so a new driver, an edited kernel or an edited header never loads a stale binary.
// Thread-safe.
class KernelLibrary {
 public:
  explicit KernelLibrary(const Context& context, ProgramCacheOptions cache = ProgramCacheOptions::from_env());

  cl_program program(std::string_view file, std::string_view options = {});
  // A program from source the caller provides (a user's own kernels), cached the same way;
  // `name` identifies it in errors and cache file names. It may include the embedded headers
  // (#include "dtype.clh"). A build failure throws cl::Error whose message carries the
  // compiler's build log.
  cl_program program_from_source(std::string_view name, std::string_view source, std::string_view options = {});
  Kernel kernel(std::string_view file, std::string_view kernel_name, std::string_view options = {});
  const Context& context() const noexcept { return context_; }
  ProgramCacheStats stats() const;
  const ProgramCacheOptions& cache_options() const noexcept { return cache_; }

 private:
  Program build(std::string_view file, std::string_view source, const std::string& options);
  const Context& context_;
  ProgramCacheOptions cache_;
  mutable std::mutex mutex_;
  std::map<std::string, Program, std::less<>> programs_;
  ProgramCacheStats stats_;
};

// Sets kernel arguments in order: cl_mem handles, Mem handles and trivially copyable scalars.
namespace detail {
inline void set_arg(cl_kernel k, cl_uint i, const Mem& m) {
  cl_mem raw = m.get();
  FERRY_CL(clSetKernelArg(k, i, sizeof(cl_mem), &raw));
}
template <class T>
void set_arg(cl_kernel k, cl_uint i, const T& v) {
  static_assert(std::is_trivially_copyable_v<T>, "kernel arguments are scalars or buffers");
  FERRY_CL(clSetKernelArg(k, i, sizeof(T), &v));
}
}  // namespace detail

template <class... Args>
void set_args(cl_kernel k, const Args&... args) {
  cl_uint i = 0;
  (detail::set_arg(k, i++, args), ...);
}

}  // namespace ferry::cl
