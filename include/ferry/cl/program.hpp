// Programs built from kernels embedded at build time, with an on-disk binary cache.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
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
  // FERRY_PROGRAM_CACHE=0 (or off, false, no) disables the cache (for drivers that cache themselves);
  // FERRY_CACHE_DIR sets the folder, else $XDG_CACHE_HOME/ferry, else ~/.cache/ferry.
  static ProgramCacheOptions from_env();
};

struct ProgramCacheStats {
  std::uint64_t memory_hits = 0, disk_hits = 0, source_builds = 0;
  std::uint64_t corrupt_entries = 0;     // entries found unusable, each rebuilt and replaced
  std::uint64_t rejected_by_driver = 0;  // of those, entries that passed the header check but the driver refused
  std::uint64_t entries_written = 0;
};

// One program cache entry on disk: a header, then the program binary (the payload).
// Header, 40 bytes, integers little-endian:
//   0  magic "FERRYPCB"      8  format version (u32)   12  header size (u32, 40)
//   16 cache key (u64)       24 payload size (u64)     32  checksum (u64)
// The checksum is 64-bit FNV-1a over header bytes 0..31 and the payload, so a change to any
// single byte of the file is detected before the payload reaches the OpenCL driver.
inline constexpr std::uint32_t program_cache_format = 1;
inline constexpr std::size_t program_cache_header_bytes = 40;
std::vector<unsigned char> encode_cache_entry(std::uint64_t key, std::span<const unsigned char> binary);
struct CacheEntryView {
  std::span<const unsigned char> binary;  // the payload, inside the decoded bytes
  std::string problem;                    // why the entry is unusable; empty when it is valid
};
// Checks magic, format version, sizes, checksum and (if given) the key.
CacheEntryView decode_cache_entry(std::span<const unsigned char> entry,
                                  std::optional<std::uint64_t> key = std::nullopt);

// Builds and memoises programs per (file, options). A program binary is cached on disk under a
// key of device name, driver version, platform version, source (with its headers inlined) and
// options, so a new driver, an edited kernel or an edited header never loads a stale binary.
// An entry that is truncated, damaged, from another format or refused by the driver, or whose
// program lacks a kernel asked of it (another program's binary in a well-formed entry), prints one
// warning naming its file and is rebuilt from source and replaced. Entries are written to a
// unique temporary file, synced and renamed into place, so concurrent writers (threads or
// processes) never see each other's partial files. A cache folder that cannot be created or
// written prints one warning per process and the run goes on without writing the cache.
// Thread-safe, and builds in parallel: programs of different (file, options) build concurrently on
// the threads that ask for them (the library's lock is not held while the driver compiles); a
// second thread asking for a program being built waits for that build and shares its program, or
// its error (a failed build is forgotten, so a later request builds it again).
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
  struct Entry;
  // The program of `key`, built by `make_source` and build() on this thread unless another thread
  // has built it or is building it.
  template <class MakeSource>
  cl_program get_or_build(std::string key, std::string_view file, const std::string& options, MakeSource make_source);
  // `loaded_from`: set to the cache entry's path when the program came from the disk cache.
  Program build(std::string_view file, std::string_view source, const std::string& options,
                std::filesystem::path& loaded_from);
  // Where the program `used` of `key` came from the disk cache and lacks a kernel asked of it:
  // warns, removes its entry (memory and disk; the program itself lives on for whoever holds it)
  // and returns true, so that the caller builds it again from source; true too where another
  // thread has done so already. False where it was built from source here.
  bool drop_cached_program(const std::string& key, cl_program used, std::string_view kernel_name);
  void store(const std::filesystem::path& entry, std::uint64_t key, cl_program program);
  void count(std::uint64_t ProgramCacheStats::*field);
  const Context& context_;
  ProgramCacheOptions cache_;
  mutable std::mutex mutex_;  // programs_ and stats_; never held while a program builds
  std::map<std::string, std::shared_ptr<Entry>, std::less<>> programs_;
  std::vector<std::shared_ptr<Entry>> dropped_;  // programs others may still use (drop_cached_program)
  ProgramCacheStats stats_;
};

// Threads that build programs at once where ferry has many to build (a compiled step's kernels):
// FERRY_BUILD_THREADS when set (1: one at a time), else the machine's cores, at most 8. Throws
// std::invalid_argument naming the variable when it is not a whole number from 1 to 1024.
std::size_t build_threads();
// The same for programs built for `device`, except that a simulator builds one at a time: Oclgrind
// (21.10) reads every program into one LLVM context it shares, and two builds at once corrupt its
// heap (double frees in the bitcode reader, refused kernel arguments). A FERRY_BUILD_THREADS above
// 1 there is said once on stderr.
std::size_t build_threads(const DeviceInfo& device);

// A __local pointer argument: the bytes of local memory each work-group gets there.
struct LocalBytes {
  std::size_t bytes = 0;
};

// Sets kernel arguments in order: cl_mem handles, Mem handles, LocalBytes and trivially copyable
// scalars.
namespace detail {
inline void set_arg(cl_kernel k, cl_uint i, const LocalBytes& l) {
  FERRY_CL(clSetKernelArg(k, i, l.bytes, nullptr));
}
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
