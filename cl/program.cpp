// Program building and the on-disk binary cache.
#include "ferry/cl/program.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <utility>

#include "cl/env_switch.hpp"
#include "cl/env_whole_number.hpp"
#include "cl/fnv1a.hpp"

namespace ferry::cl {
namespace {

// FNV-1a over several strings, each followed by a separator so ("ab","c") != ("a","bc").
std::uint64_t hash_parts(std::initializer_list<std::string_view> parts) {
  std::uint64_t h = fnv1a_basis;
  for (std::string_view s : parts) h = fnv1a(std::string_view("\xff", 1), fnv1a(s, h));
  return h;
}

// Larger files are not program binaries we wrote; they are not read into memory.
constexpr std::uintmax_t max_entry_bytes = std::uintmax_t{1} << 30;

std::string errno_text(int e) {
  return std::error_code(e, std::generic_category()).message();
}

// The whole file, nullopt if it does not exist (a cache miss); `problem` says why an existing
// file could not be read. `folder_denied` is set, and nullopt returned, when the path cannot be
// looked up for want of permission on a folder above it: the folder's problem, not the entry's.
std::optional<std::vector<unsigned char>> read_entry(const std::filesystem::path& path, std::string& problem,
                                                     bool& folder_denied) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) {
    if (ec == std::errc::no_such_file_or_directory || ec == std::errc::not_a_directory) return std::nullopt;
    if (ec == std::errc::permission_denied) {
      folder_denied = true;
      problem = ec.message();
      return std::nullopt;
    }
    problem = fmt::format("cannot be read: {}", ec.message());
    return std::vector<unsigned char>{};
  }
  if (size > max_entry_bytes) {
    problem = fmt::format("{} bytes, larger than any program binary", size);
    return std::vector<unsigned char>{};
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (!std::filesystem::exists(path, ec)) return std::nullopt;  // removed meanwhile
    problem = "cannot be opened";
    return std::vector<unsigned char>{};
  }
  std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) problem = "read error";
  return bytes;
}

// Writes `bytes` to a temporary file unique to this process, thread and call, in the entry's
// folder, syncs it and renames it over `entry` (atomic on POSIX file systems). Returns what
// failed, with the errno of the failing call, or an empty string.
std::string write_entry_atomically(const std::filesystem::path& entry, std::span<const unsigned char> bytes) {
  int error = 0;
  static std::atomic<std::uint64_t> counter{0};
  std::filesystem::path tmp = entry;
  tmp += fmt::format(".{}-{:x}-{}.tmp", ::getpid(), std::hash<std::thread::id>{}(std::this_thread::get_id()),
                     counter.fetch_add(1, std::memory_order_relaxed));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    error = errno;
    return fmt::format("cannot create files in it: {}", errno_text(error));
  }
  std::string failed;
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      error = n < 0 ? errno : EIO;
      failed = fmt::format("cannot write {}: {}", entry.filename().string(), errno_text(error));
      break;
    }
    done += static_cast<std::size_t>(n);
  }
  if (failed.empty() && ::fsync(fd) != 0) {
    error = errno;
    failed = fmt::format("cannot sync {}: {}", entry.filename().string(), errno_text(error));
  }
  if (::close(fd) != 0 && failed.empty()) {
    error = errno;
    failed = fmt::format("cannot close {}: {}", entry.filename().string(), errno_text(error));
  }
  if (failed.empty() && ::rename(tmp.c_str(), entry.c_str()) != 0) {
    error = errno;
    failed = fmt::format("cannot rename a temporary file to {}: {}", entry.filename().string(), errno_text(error));
  }
  if (!failed.empty()) {
    ::unlink(tmp.c_str());
    return failed;
  }
  // Make the rename itself durable; best effort (not every file system syncs folders).
  const int dir = ::open(entry.parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
  return {};
}

// Cache folders this process found unusable: each is reported once, then no longer written, and
// one it may not even look into (no search permission) no longer read either: every entry would
// fail alike, and each is not to be reported as a bad entry.
struct UnusableFolders {
  std::mutex mutex;
  std::set<std::filesystem::path> folders;
  std::set<std::filesystem::path> unreadable;
  static UnusableFolders& get() {
    static auto* f = new UnusableFolders();  // leaked: used by libraries that outlive statics
    return *f;
  }
  bool contains(const std::filesystem::path& dir) {
    std::lock_guard lock(mutex);
    return folders.count(dir) != 0;
  }
  bool cannot_read(const std::filesystem::path& dir) {
    std::lock_guard lock(mutex);
    return unreadable.count(dir) != 0;
  }
  void report_unreadable(const std::filesystem::path& dir, std::string_view why) {
    {
      std::lock_guard lock(mutex);
      unreadable.insert(dir);
    }
    report(dir, fmt::format("cannot look into it: {}", why));
  }
  void report(const std::filesystem::path& dir, std::string_view why) {
    std::lock_guard lock(mutex);
    if (!folders.insert(dir).second) return;
    std::cerr << fmt::format(
        "ferry: program cache folder {} is not usable ({}); continuing without caching compiled programs "
        "(set FERRY_CACHE_DIR to a writable folder, or FERRY_PROGRAM_CACHE=0 to turn the cache off)\n",
        dir.string(), why);
  }
};

// An entry replaced by a folder (or a link to one) can be neither read nor renamed over. That is
// the entry's problem, not the cache folder's: its program is built from source and not cached,
// said once per process, while the other entries are read and written as usual.
bool entry_is_folder(const std::filesystem::path& entry) {
  std::error_code ec;
  if (!std::filesystem::is_directory(entry, ec)) return false;
  static auto* reported = new std::pair<std::mutex, std::set<std::filesystem::path>>();  // leaked, as above
  std::lock_guard lock(reported->first);
  if (reported->second.insert(entry).second) {
    std::cerr << fmt::format(
        "ferry: program cache entry {} is a folder, not a file, so its program is built from source on every run "
        "and not cached (the other entries are used as usual): remove it (rm -r '{}')\n",
        entry.string(), entry.string());
  }
  return true;
}

void warn_bad_entry(const std::filesystem::path& entry, std::string_view problem) {
  std::cerr << fmt::format(
      "ferry: program cache entry {} is invalid ({}); it will be rebuilt from source and replaced\n", entry.string(),
      problem);
}

std::string build_log(cl_program program, cl_device_id device) {
  std::size_t size = 0;
  clGetProgramBuildInfo(program, device, CL_PROGRAM_BUILD_LOG, 0, nullptr, &size);
  std::string log(size, '\0');
  clGetProgramBuildInfo(program, device, CL_PROGRAM_BUILD_LOG, size, log.data(), nullptr);
  while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
  return log;
}

std::vector<unsigned char> program_binary(cl_program program) {
  std::size_t size = 0;
  FERRY_CL(clGetProgramInfo(program, CL_PROGRAM_BINARY_SIZES, sizeof(size), &size, nullptr));
  std::vector<unsigned char> binary(size);
  unsigned char* ptr = binary.data();
  FERRY_CL(clGetProgramInfo(program, CL_PROGRAM_BINARIES, sizeof(ptr), &ptr, nullptr));
  return binary;
}

bool is_header_name(std::string_view name) {
  return name.size() > 4 && name.substr(name.size() - 4) == ".clh";
}

// The header named by a line `#include "name"` (whitespace allowed around '#' and 'include'),
// or nullopt for any other line (including #include <...>, which is left to the compiler).
std::optional<std::string_view> quoted_include(std::string_view line) {
  auto skip_space = [&] {
    while (!line.empty() && (line.front() == ' ' || line.front() == '\t')) line.remove_prefix(1);
  };
  skip_space();
  if (line.empty() || line.front() != '#') return std::nullopt;
  line.remove_prefix(1);
  skip_space();
  if (line.substr(0, 7) != "include") return std::nullopt;
  line.remove_prefix(7);
  skip_space();
  if (line.empty() || line.front() != '"') return std::nullopt;
  line.remove_prefix(1);
  const std::size_t close = line.find('"');
  if (close == std::string_view::npos) return std::nullopt;
  return line.substr(0, close);
}

// A file name as it may appear inside the quotes of a #line directive.
std::string line_directive_name(std::string_view name) {
  std::string s(name);
  for (char& c : s) {
    if (c == '"' || c == '\\' || c == '\n') c = '_';
  }
  return s;
}

std::string embedded_header_list() {
  std::string list;
  for (const auto& [name, text] : embedded_kernel_sources()) {
    if (is_header_name(name)) list += fmt::format("{}{}", list.empty() ? "" : ", ", name);
  }
  return list.empty() ? "none" : list;
}

void expand_into(std::string_view display, std::string_view source, std::set<std::string, std::less<>>& seen,
                 std::string& out) {
  std::size_t line_no = 0;
  while (!source.empty()) {
    const std::size_t eol = source.find('\n');
    const std::string_view line = source.substr(0, eol);
    source.remove_prefix(eol == std::string_view::npos ? source.size() : eol + 1);
    ++line_no;
    const auto header = quoted_include(line);
    if (!header) {
      out.append(line);
      out.push_back('\n');
      continue;
    }
    if (!is_header_name(*header) || !std::any_of(embedded_kernel_sources().begin(), embedded_kernel_sources().end(),
                                                 [&](const auto& e) { return e.first == *header; })) {
      throw std::invalid_argument(fmt::format(
          "OpenCL kernel file '{}' includes \"{}\", which is not an embedded kernel header (ops/kernels/*.clh: {})",
          display, *header, embedded_header_list()));
    }
    if (seen.emplace(*header).second) {  // each header once per program, as if it had #pragma once
      out += fmt::format("#line 1 \"{}\"\n", line_directive_name(*header));
      expand_into(*header, kernel_header(*header), seen, out);
    }
    out += fmt::format("#line {} \"{}\"\n", line_no + 1, line_directive_name(display));
  }
}

}  // namespace

std::string_view kernel_source(std::string_view file) {
  if (!is_header_name(file)) {
    for (const auto& [name, source] : embedded_kernel_sources()) {
      if (name == file) return source;
    }
  }
  throw std::invalid_argument(fmt::format("no embedded OpenCL kernel file '{}.cl' (is it in ops/kernels/?)", file));
}

std::string_view kernel_header(std::string_view header) {
  if (is_header_name(header)) {
    for (const auto& [name, source] : embedded_kernel_sources()) {
      if (name == header) return source;
    }
  }
  throw std::invalid_argument(
      fmt::format("no embedded OpenCL kernel header '{}' (ops/kernels/*.clh: {})", header, embedded_header_list()));
}

std::string expand_kernel_includes(std::string_view file, std::string_view source) {
  std::set<std::string, std::less<>> seen;
  std::string out;
  out.reserve(source.size());
  expand_into(file, source, seen, out);
  // A source without includes is returned unchanged (same bytes, same cache key as before).
  if (seen.empty()) return std::string(source);
  return out;
}

ProgramCacheOptions ProgramCacheOptions::from_env() {
  ProgramCacheOptions o;
  if (!env_switch("FERRY_PROGRAM_CACHE", "0 turns the on-disk program cache off").value_or(true)) o.enabled = false;
  if (const char* d = std::getenv("FERRY_CACHE_DIR"); d && *d) {
    o.dir = d;
  } else if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) {
    o.dir = std::filesystem::path(x) / "ferry";
  } else if (const char* home = std::getenv("HOME"); home && *home) {
    o.dir = std::filesystem::path(home) / ".cache" / "ferry";
  } else {
    o.enabled = false;
  }
  return o;
}

KernelLibrary::KernelLibrary(const Context& context, ProgramCacheOptions cache)
    : context_(context), cache_(std::move(cache)) {}

ProgramCacheStats KernelLibrary::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

// A program being built, or built: the thread that built it fills it in once, others wait for it.
struct KernelLibrary::Entry {
  std::mutex mutex;
  std::condition_variable ready;
  bool done = false;
  Program program;
  std::exception_ptr error;           // the build's failure, rethrown to every thread that waited for it
  std::filesystem::path loaded_from;  // the disk cache's entry it came from; empty: built from source
};

void KernelLibrary::count(std::uint64_t ProgramCacheStats::*field) {
  std::lock_guard lock(mutex_);
  ++(stats_.*field);
}

template <class MakeSource>
cl_program KernelLibrary::get_or_build(std::string key, std::string_view file, const std::string& options,
                                       MakeSource make_source) {
  std::shared_ptr<Entry> entry;
  bool mine = false;
  {
    std::lock_guard lock(mutex_);
    if (auto it = programs_.find(key); it != programs_.end()) {
      entry = it->second;
      ++stats_.memory_hits;
    } else {
      entry = std::make_shared<Entry>();
      programs_.emplace(key, entry);
      mine = true;
    }
  }
  if (!mine) {
    std::unique_lock lock(entry->mutex);
    entry->ready.wait(lock, [&] { return entry->done; });
    if (entry->error) std::rethrow_exception(entry->error);
    return entry->program.get();
  }
  try {
    std::filesystem::path loaded_from;
    Program built = build(file, make_source(), options, loaded_from);
    std::lock_guard lock(entry->mutex);
    entry->program = std::move(built);
    entry->loaded_from = std::move(loaded_from);
    entry->done = true;
  } catch (...) {
    {
      std::lock_guard lock(mutex_);
      programs_.erase(key);  // a later request builds it again
    }
    {
      std::lock_guard lock(entry->mutex);
      entry->error = std::current_exception();
      entry->done = true;
    }
    entry->ready.notify_all();
    throw;
  }
  entry->ready.notify_all();
  return entry->program.get();
}

cl_program KernelLibrary::program(std::string_view file, std::string_view options) {
  return get_or_build(fmt::format("{}|{}", file, options), file, std::string(options),
                      [file] { return expand_kernel_includes(fmt::format("{}.cl", file), kernel_source(file)); });
}

cl_program KernelLibrary::program_from_source(std::string_view name, std::string_view source,
                                              std::string_view options) {
  return get_or_build(fmt::format("{}|{}|{:016x}", name, options, std::hash<std::string_view>{}(source)), name,
                      std::string(options), [name, source] { return expand_kernel_includes(name, source); });
}

Kernel KernelLibrary::kernel(std::string_view file, std::string_view kernel_name, std::string_view options) {
  cl_program p = program(file, options);
  cl_int status = CL_SUCCESS;
  std::string name(kernel_name);
  Kernel k(clCreateKernel(p, name.c_str(), &status));
  // A cached binary of another program (a well-formed entry under this key) loads and builds, and
  // fails here, in every run, where it should have been replaced as a damaged entry is.
  if (status == CL_INVALID_KERNEL_NAME && drop_cached_program(fmt::format("{}|{}", file, options), p, kernel_name)) {
    p = program(file, options);
    k = Kernel(clCreateKernel(p, name.c_str(), &status));
  }
  if (status != CL_SUCCESS) {
    throw Error(fmt::format("clCreateKernel('{}' from {}.cl)", kernel_name, file), status,
                std::string(OpScope::current()));
  }
  return k;
}

bool KernelLibrary::drop_cached_program(const std::string& key, cl_program used, std::string_view kernel_name) {
  std::filesystem::path entry_file;
  {
    std::lock_guard lock(mutex_);
    const auto it = programs_.find(key);
    if (it == programs_.end()) return true;  // dropped by another thread, not yet asked again
    std::lock_guard entry_lock(it->second->mutex);
    if (!it->second->done || it->second->program.get() != used) return true;  // replaced meanwhile
    if (it->second->loaded_from.empty()) return false;
    entry_file = it->second->loaded_from;
    dropped_.push_back(it->second);
    programs_.erase(it);
    ++stats_.corrupt_entries;
  }
  warn_bad_entry(entry_file, fmt::format("its program has no kernel '{}': a binary of another program", kernel_name));
  std::error_code ec;
  std::filesystem::remove(entry_file, ec);  // the next build stores a good one in its place
  return true;
}

namespace {

// FERRY_BUILD_REPORT: what each build gave, on stderr: the driver's log (with NVIDIA's compiler
// options, ptxas's registers, spills and shared memory per kernel: -cl-nv-verbose is added) and,
// for every kernel of the program, the resources the driver reports for it. A register-blocked
// kernel that spills or leaves one work-group per compute unit shows it here.
void report_build(cl_program program, const DeviceInfo& dev, std::string_view file, std::string_view options,
                  bool from_cache) {
  std::string text = fmt::format("ferry: built {}.cl{} on {}, options '{}'\n", file,
                                 from_cache ? " (from the program cache)" : "", dev.name, options);
  const std::string log = build_log(program, dev.id);
  if (!log.empty()) text += log + "\n";
  cl_uint count = 0;
  if (clCreateKernelsInProgram(program, 0, nullptr, &count) == CL_SUCCESS && count > 0) {
    std::vector<cl_kernel> kernels(count);
    if (clCreateKernelsInProgram(program, count, kernels.data(), nullptr) == CL_SUCCESS) {
      for (cl_kernel k : kernels) {
        char name[256] = {};
        clGetKernelInfo(k, CL_KERNEL_FUNCTION_NAME, sizeof(name) - 1, name, nullptr);
        cl_ulong private_bytes = 0, local_bytes = 0;
        std::size_t group = 0;
        clGetKernelWorkGroupInfo(k, dev.id, CL_KERNEL_PRIVATE_MEM_SIZE, sizeof(private_bytes), &private_bytes, nullptr);
        clGetKernelWorkGroupInfo(k, dev.id, CL_KERNEL_LOCAL_MEM_SIZE, sizeof(local_bytes), &local_bytes, nullptr);
        clGetKernelWorkGroupInfo(k, dev.id, CL_KERNEL_WORK_GROUP_SIZE, sizeof(group), &group, nullptr);
        text += fmt::format(
            "ferry:   kernel {}: private memory {} bytes a work-item, local memory {} bytes, "
            "work-groups up to {}\n",
            name, private_bytes, local_bytes, group);
        clReleaseKernel(k);
      }
    }
  }
  std::cerr << text;
}

}  // namespace

// Runs on the thread that asked for the program, without mutex_ (other programs build at the same
// time). The compiler's warnings are turned off (-w) unless FERRY_VERBOSE is set:
// some drivers (PoCL) print "N warnings generated." on stderr for every build, also under --quiet.
// A failed build still throws with the whole log, errors included.
Program KernelLibrary::build(std::string_view file, std::string_view source, const std::string& given_options,
                             std::filesystem::path& loaded_from) {
  const DeviceInfo& dev = context_.device();
  const bool report =
      env_switch("FERRY_BUILD_REPORT", "1 prints each program build's options, log and kernel resources")
          .value_or(false);
  const bool verbose = env_switch("FERRY_VERBOSE", "1 builds kernels with the compiler's warnings on").value_or(false);
  std::string options = verbose ? given_options : given_options + " -w";
  if (report && dev.has_extension("cl_nv_compiler_options")) options += " -cl-nv-verbose";
  cl_device_id device = dev.id;
  std::filesystem::path cached;
  std::uint64_t key = 0;
  if (cache_.enabled) {
    key = hash_parts({dev.name, dev.driver, dev.platform_version, source, options});
    cached = cache_.dir / fmt::format("{}-{:016x}.bin", file, key);
    std::string problem;
    bool folder_denied = false;
    auto& unusable = UnusableFolders::get();
    if (unusable.cannot_read(cache_.dir) || entry_is_folder(cached)) {
      cached.clear();  // neither read nor stored
    } else if (auto bytes = read_entry(cached, problem, folder_denied)) {
      // Only an entry whose header, size and checksum are right reaches the driver.
      CacheEntryView entry;
      if (problem.empty()) {
        entry = decode_cache_entry(*bytes, key);
        problem = entry.problem;
      }
      if (problem.empty()) {
        const unsigned char* ptr = entry.binary.data();
        std::size_t size = entry.binary.size();
        cl_int bin_status = CL_SUCCESS, status = CL_SUCCESS;
        Program p(clCreateProgramWithBinary(context_.get(), 1, &device, &size, &ptr, &bin_status, &status));
        if (status == CL_SUCCESS && bin_status != CL_SUCCESS) status = bin_status;
        if (status == CL_SUCCESS) {
          status = clBuildProgram(p.get(), 1, &device, options.c_str(), nullptr, nullptr);
          if (status == CL_SUCCESS) {
            count(&ProgramCacheStats::disk_hits);
            if (report) report_build(p.get(), dev, file, options, true);
            loaded_from = cached;
            return p;
          }
          problem = fmt::format("the OpenCL driver refused it: clBuildProgram returned {}", error_name(status));
        } else {
          problem =
              fmt::format("the OpenCL driver refused it: clCreateProgramWithBinary returned {}", error_name(status));
        }
        count(&ProgramCacheStats::rejected_by_driver);
      }
      count(&ProgramCacheStats::corrupt_entries);
      warn_bad_entry(cached, problem);
    } else if (folder_denied) {
      unusable.report_unreadable(cache_.dir, problem);
      cached.clear();
    }
  }
  cl_int status = CL_SUCCESS;
  const char* src = source.data();
  std::size_t len = source.size();
  Program p(clCreateProgramWithSource(context_.get(), 1, &src, &len, &status));
  check(status, "clCreateProgramWithSource");
  status = clBuildProgram(p.get(), 1, &device, options.c_str(), nullptr, nullptr);
  if (status != CL_SUCCESS) {
    throw Error(fmt::format("clBuildProgram({}.cl, options '{}') on {}; build log:\n{}\n", file, options, dev.name,
                            build_log(p.get(), device)),
                status, std::string(OpScope::current()));
  }
  count(&ProgramCacheStats::source_builds);
  if (report) report_build(p.get(), dev, file, options, false);
  if (cache_.enabled && !cached.empty()) store(cached, key, p.get());
  return p;
}

// Without mutex_, like build(). A failure to write is never fatal: the program is already built.
void KernelLibrary::store(const std::filesystem::path& entry, std::uint64_t key, cl_program program) {
  auto& unusable = UnusableFolders::get();
  if (unusable.contains(cache_.dir)) return;
  std::error_code ec;
  std::filesystem::create_directories(cache_.dir, ec);
  if (ec || !std::filesystem::is_directory(cache_.dir, ec)) {
    unusable.report(cache_.dir, fmt::format("cannot create it: {}", ec ? ec.message() : "not a folder"));
    return;
  }
  std::vector<unsigned char> binary;
  try {
    binary = program_binary(program);
  } catch (const Error& e) {
    std::cerr << fmt::format("ferry: not caching {}: the driver gave no program binary ({})\n", entry.string(),
                             e.what());
    return;
  }
  if (binary.empty()) return;  // nothing the driver could load back
  const std::string failed = write_entry_atomically(entry, encode_cache_entry(key, binary));
  if (failed.empty()) {
    count(&ProgramCacheStats::entries_written);
    return;
  }
  if (entry_is_folder(entry)) return;  // made a folder meanwhile: this entry's problem alone
  // A folder-wide condition (read-only, no space, no permission) stops writing for the run.
  unusable.report(cache_.dir, failed);
}

std::size_t build_threads() {
  const char* v = std::getenv("FERRY_BUILD_THREADS");
  // A compiler instance can hold hundreds of MB while it runs; eight at once give most of the gain
  // over a step's few dozen programs.
  if (v == nullptr || *v == '\0') return std::clamp(std::thread::hardware_concurrency(), 1u, 8u);
  return static_cast<std::size_t>(
      *env_whole_number("FERRY_BUILD_THREADS", 1, 1024, "threads that build kernels at once; 1 builds one at a time"));
}

std::size_t build_threads(const DeviceInfo& device) {
  const std::size_t asked = build_threads();
  if (!device.is_simulator()) return asked;
  const char* v = std::getenv("FERRY_BUILD_THREADS");
  static std::atomic<bool> said{false};
  if (asked > 1 && v != nullptr && *v != '\0' && !said.exchange(true)) {
    std::cerr << fmt::format(
        "ferry: FERRY_BUILD_THREADS={}: '{}' is a simulator, whose program builds are not thread-safe; building "
        "its programs one at a time\n",
        v, device.name);
  }
  return 1;
}

}  // namespace ferry::cl
