// PoCL keeps the kernels it compiles in a cache folder ($POCL_CACHE_DIR, else
// $XDG_CACHE_HOME/pocl, else $HOME/.cache/pocl). When that folder cannot be created (HOME unset,
// missing or not a folder, as for some service users), PoCL loads no device at all and ferry would
// say "no OpenCL device found". Before the first OpenCL call, ferry points PoCL at a folder of its
// own instead, and says so.
#include "pocl_cache.hpp"

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "ferry/cl/device.hpp"

namespace ferry::cl {
namespace {

namespace fs = std::filesystem;

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

// Whether `dir` exists as a writable folder or could be created: its nearest existing ancestor is
// a folder this process may write into. Creates nothing.
bool could_hold(const fs::path& dir) {
  std::error_code ec;
  for (fs::path p = dir; !p.empty(); p = p.parent_path()) {
    const fs::file_status st = fs::status(p, ec);
    if (fs::exists(st)) return fs::is_directory(st) && access(p.c_str(), W_OK | X_OK) == 0;
    if (p == p.parent_path()) break;
  }
  return false;
}

// A folder only this user can write (PoCL loads the shared objects it finds there, so a folder
// someone else made or may write is not used): created 0700, or taken when it already is so.
bool private_folder(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir.parent_path(), ec);
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return false;
  struct stat st {};
  if (lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return false;
  return st.st_uid == geteuid() && (st.st_mode & (S_IWGRP | S_IWOTH)) == 0;
}

std::optional<fs::path> pocl_default_folder() {
  if (auto x = env("XDG_CACHE_HOME")) return fs::path(*x) / "pocl";
  if (auto h = env("HOME")) return fs::path(*h) / ".cache" / "pocl";
  return std::nullopt;
}

// Whether PoCL is among the drivers the ICD loader will load (a note about its folder would be
// noise on a machine without it).
bool pocl_registered() {
  for (const IcdRegistration& r : registered_icds()) {
    std::string lib = r.library + " " + r.source;
    std::transform(lib.begin(), lib.end(), lib.begin(), [](unsigned char c) { return std::tolower(c); });
    if (lib.find("pocl") != std::string::npos) return true;
  }
  return false;
}

// A POCL_CACHE_DIR the user set that this process cannot create or write: PoCL then loads no
// device (or fails every kernel build), and the only message would be "no OpenCL device found".
// The user's folder is not replaced; ferry says what is wrong with it.
void check_users_folder(const std::string& dir) {
  if (could_hold(dir) || !pocl_registered()) return;
  std::cerr << fmt::format(
      "ferry: warning: POCL_CACHE_DIR='{}' cannot be created or written by this user; without its kernel cache "
      "folder PoCL loads no device or fails to build kernels (point POCL_CACHE_DIR at a writable folder, or unset "
      "it)\n",
      dir);
}

void prepare() {
  if (auto users = env("POCL_CACHE_DIR")) {  // the user's choice
    check_users_folder(*users);
    return;
  }
  const std::optional<fs::path> usual = pocl_default_folder();
  if (usual && could_hold(*usual)) return;
  if (!pocl_registered()) return;
  std::error_code ec;
  std::vector<fs::path> candidates;
  if (auto f = env("FERRY_CACHE_DIR")) candidates.push_back(fs::path(*f) / "pocl");
  const fs::path tmp = fs::temp_directory_path(ec);
  if (!ec) candidates.push_back(tmp / fmt::format("ferry-{}", geteuid()) / "pocl");
  // The note's subject and what is wrong with it, as one clause either way.
  const std::string why = usual
                              ? fmt::format("PoCL's kernel cache folder '{}' cannot be created", usual->string())
                              : std::string("PoCL has no kernel cache folder (neither HOME nor XDG_CACHE_HOME is set)");
  for (const fs::path& dir : candidates) {
    if (!private_folder(dir)) continue;
    setenv("POCL_CACHE_DIR", dir.c_str(), 1);  // unset or empty, as checked above
    std::cerr << fmt::format(
        "ferry: note: {}; using POCL_CACHE_DIR={} (set POCL_CACHE_DIR or HOME to choose another)\n", why, dir.string());
    return;
  }
  // Nothing usable: PoCL will fail to load, and the device list's message says what to check.
}

}  // namespace

void prepare_pocl_cache_folder() {
  static std::once_flag once;
  std::call_once(once, prepare);
}

}  // namespace ferry::cl
