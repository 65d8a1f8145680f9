// Program building and the on-disk binary cache.
#include "ferry/cl/program.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <iterator>
#include <optional>
#include <set>

namespace ferry::cl {
namespace {

// FNV-1a over several strings, each followed by a separator so ("ab","c") != ("a","bc").
std::uint64_t hash_parts(std::initializer_list<std::string_view> parts) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::string_view s : parts) {
    for (unsigned char c : s) {
      h ^= c;
      h *= 0x100000001b3ull;
    }
    h ^= 0xff;
    h *= 0x100000001b3ull;
  }
  return h;
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
  if (const char* v = std::getenv("FERRY_PROGRAM_CACHE"); v && std::string_view(v) == "0") o.enabled = false;
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

cl_program KernelLibrary::program(std::string_view file, std::string_view options) {
  std::string key = fmt::format("{}|{}", file, options);
  std::lock_guard lock(mutex_);
  if (auto it = programs_.find(key); it != programs_.end()) {
    ++stats_.memory_hits;
    return it->second.get();
  }
  const std::string source = expand_kernel_includes(fmt::format("{}.cl", file), kernel_source(file));
  Program p = build(file, source, std::string(options));
  cl_program raw = p.get();
  programs_.emplace(std::move(key), std::move(p));
  return raw;
}

cl_program KernelLibrary::program_from_source(std::string_view name, std::string_view source,
                                              std::string_view options) {
  std::string key = fmt::format("{}|{}|{:016x}", name, options, std::hash<std::string_view>{}(source));
  std::lock_guard lock(mutex_);
  if (auto it = programs_.find(key); it != programs_.end()) {
    ++stats_.memory_hits;
    return it->second.get();
  }
  const std::string expanded = expand_kernel_includes(name, source);
  Program p = build(name, expanded, std::string(options));
  cl_program raw = p.get();
  programs_.emplace(std::move(key), std::move(p));
  return raw;
}

Kernel KernelLibrary::kernel(std::string_view file, std::string_view kernel_name, std::string_view options) {
  cl_program p = program(file, options);
  cl_int status = CL_SUCCESS;
  std::string name(kernel_name);
  Kernel k(clCreateKernel(p, name.c_str(), &status));
  if (status != CL_SUCCESS) {
    throw Error(fmt::format("clCreateKernel('{}' from {}.cl)", kernel_name, file), status,
                std::string(OpScope::current()));
  }
  return k;
}

// Called with mutex_ held.
Program KernelLibrary::build(std::string_view file, std::string_view source, const std::string& options) {
  const DeviceInfo& dev = context_.device();
  cl_device_id device = dev.id;
  std::filesystem::path cached;
  if (cache_.enabled) {
    std::uint64_t h = hash_parts({dev.name, dev.driver, dev.platform_version, source, options});
    cached = cache_.dir / fmt::format("{}-{:016x}.bin", file, h);
    std::ifstream in(cached, std::ios::binary);
    if (in) {
      std::vector<unsigned char> bin((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      const unsigned char* ptr = bin.data();
      std::size_t size = bin.size();
      cl_int bin_status = CL_SUCCESS, status = CL_SUCCESS;
      Program p(clCreateProgramWithBinary(context_.get(), 1, &device, &size, &ptr, &bin_status, &status));
      if (status == CL_SUCCESS && bin_status == CL_SUCCESS &&
          clBuildProgram(p.get(), 1, &device, options.c_str(), nullptr, nullptr) == CL_SUCCESS) {
        ++stats_.disk_hits;
        return p;
      }
      // A truncated or foreign binary is not fatal: rebuild from source and overwrite it.
      ++stats_.corrupt_entries;
      std::cerr << fmt::format("ferry: ignoring unusable cached program {} (rebuilding from source)\n",
                               cached.string());
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
  ++stats_.source_builds;
  if (cache_.enabled) {
    std::error_code ec;
    std::filesystem::create_directories(cache_.dir, ec);
    auto bin = program_binary(p.get());
    auto tmp = cached;
    tmp += ".tmp";
    std::ofstream out(tmp, std::ios::binary);
    if (out.write(reinterpret_cast<const char*>(bin.data()), static_cast<std::streamsize>(bin.size()))) {
      out.close();
      std::filesystem::rename(tmp, cached, ec);  // atomic publish; concurrent writers are harmless
    }
  }
  return p;
}

}  // namespace ferry::cl
