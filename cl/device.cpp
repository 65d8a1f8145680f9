// Device enumeration and selection, and the diagnosis when the ICD loader finds no device.
#include "ferry/cl/device.hpp"

#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "ferry/cl/error.hpp"
#include "pocl_cache.hpp"

namespace ferry::cl {
namespace {

std::string device_string(cl_device_id id, cl_device_info what) {
  std::size_t size = 0;
  FERRY_CL(clGetDeviceInfo(id, what, 0, nullptr, &size));
  std::string s(size, '\0');
  FERRY_CL(clGetDeviceInfo(id, what, size, s.data(), nullptr));
  while (!s.empty() && (s.back() == '\0' || s.back() == ' ')) s.pop_back();
  return s;
}

std::string platform_string(cl_platform_id id, cl_platform_info what) {
  std::size_t size = 0;
  FERRY_CL(clGetPlatformInfo(id, what, 0, nullptr, &size));
  std::string s(size, '\0');
  FERRY_CL(clGetPlatformInfo(id, what, size, s.data(), nullptr));
  while (!s.empty() && s.back() == '\0') s.pop_back();
  return s;
}

template <class T>
T device_value(cl_device_id id, cl_device_info what) {
  T v{};
  FERRY_CL(clGetDeviceInfo(id, what, sizeof(T), &v, nullptr));
  return v;
}

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

std::string trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return std::string(s);
}

// Well-known short names and the words their platforms and vendors use.
struct Alias {
  std::string_view name;
  std::array<std::string_view, 2> words;
};
constexpr std::array<Alias, 5> aliases{{
    {"pocl", {"portable computing language", "pocl"}},
    {"nvidia", {"nvidia", "nvidia"}},
    {"intel", {"intel", "intel"}},
    {"amd", {"advanced micro devices", "amd"}},
    {"oclgrind", {"oclgrind", "oclgrind"}},
}};

std::string describe_all(const std::vector<DeviceInfo>& devices) {
  std::string out;
  for (const auto& d : devices) {
    out += fmt::format("\n  [{}] {} / {} ({}{})", d.index, d.platform_name, d.name, d.type_name(),
                       d.is_simulator() ? ", simulator" : "");
  }
  return out;
}

// Every device of every platform that lists its devices; `notes` gets one line per platform
// that loaded but gave none (or failed to say).
std::vector<DeviceInfo> enumerate(std::vector<std::string>* notes) {
  prepare_pocl_cache_folder();  // before PoCL, if it is the driver, first looks for its cache
  cl_uint n_platforms = 0;
  cl_int status = clGetPlatformIDs(0, nullptr, &n_platforms);
  if (status == -1001 /*CL_PLATFORM_NOT_FOUND_KHR*/ || n_platforms == 0) return {};
  FERRY_CL(status);
  std::vector<cl_platform_id> platforms(n_platforms);
  FERRY_CL(clGetPlatformIDs(n_platforms, platforms.data(), nullptr));

  std::vector<DeviceInfo> devices;
  for (cl_platform_id p : platforms) {
    std::string platform_name = "(unnamed platform)";
    try {
      platform_name = platform_string(p, CL_PLATFORM_NAME);
      cl_uint n = 0;
      status = clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, 0, nullptr, &n);
      if (status == CL_DEVICE_NOT_FOUND || (status == CL_SUCCESS && n == 0)) {
        if (notes) notes->push_back(fmt::format("platform '{}' loaded but reports no device", platform_name));
        continue;
      }
      FERRY_CL(status);
      std::vector<cl_device_id> ids(n);
      FERRY_CL(clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, n, ids.data(), nullptr));
      std::vector<DeviceInfo> found;
      for (cl_device_id id : ids) {
        DeviceInfo d;
        d.platform = p;
        d.id = id;
        d.platform_name = platform_name;
        d.platform_vendor = platform_string(p, CL_PLATFORM_VENDOR);
        d.platform_version = platform_string(p, CL_PLATFORM_VERSION);
        d.name = device_string(id, CL_DEVICE_NAME);
        d.vendor = device_string(id, CL_DEVICE_VENDOR);
        d.version = device_string(id, CL_DEVICE_VERSION);
        d.driver = device_string(id, CL_DRIVER_VERSION);
        d.c_version = device_string(id, CL_DEVICE_OPENCL_C_VERSION);
        d.extensions = device_string(id, CL_DEVICE_EXTENSIONS);
        d.type = device_value<cl_device_type>(id, CL_DEVICE_TYPE);
        d.global_mem_bytes = device_value<cl_ulong>(id, CL_DEVICE_GLOBAL_MEM_SIZE);
        d.max_alloc_bytes = device_value<cl_ulong>(id, CL_DEVICE_MAX_MEM_ALLOC_SIZE);
        d.local_mem_bytes = device_value<cl_ulong>(id, CL_DEVICE_LOCAL_MEM_SIZE);
        d.global_mem_cache_bytes = device_value<cl_ulong>(id, CL_DEVICE_GLOBAL_MEM_CACHE_SIZE);
        d.compute_units = device_value<cl_uint>(id, CL_DEVICE_MAX_COMPUTE_UNITS);
        d.native_float_width = device_value<cl_uint>(id, CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT);
        d.max_work_group_size = device_value<std::size_t>(id, CL_DEVICE_MAX_WORK_GROUP_SIZE);
        d.base_align_bytes = device_value<cl_uint>(id, CL_DEVICE_MEM_BASE_ADDR_ALIGN) / 8;
        d.host_unified_memory = device_value<cl_bool>(id, CL_DEVICE_HOST_UNIFIED_MEMORY) == CL_TRUE;
        found.push_back(std::move(d));
      }
      for (auto& d : found) {
        d.index = devices.size();
        devices.push_back(std::move(d));
      }
    } catch (const Error& e) {
      // A broken platform must not hide the working ones.
      if (notes) notes->push_back(fmt::format("platform '{}' failed to list its devices: {}", platform_name, e.what()));
    }
  }
  return devices;
}

void add_icd_file(const std::filesystem::path& file, std::vector<IcdRegistration>& out) {
  std::ifstream in(file);
  std::string line;
  std::getline(in, line);
  out.push_back({file.string(), trim(line), in ? "" : "the .icd file cannot be read"});
}

}  // namespace

std::string DeviceInfo::type_name() const {
  if (is_gpu()) return "GPU";
  if (is_cpu()) return "CPU";
  if (type & CL_DEVICE_TYPE_ACCELERATOR) return "accelerator";
  return "other";
}

bool DeviceInfo::is_simulator() const {
  return cl::is_simulator(facts());
}

std::string register_cap_option(const DeviceInfo& device, int registers, std::string_view what) {
  if (registers == 0) return "";
  if (!device.has_extension("cl_nv_compiler_options")) {
    throw std::runtime_error(
        fmt::format("{}: RR={} caps registers through NVIDIA's compiler options, which '{}' "
                    "does not have (cl_nv_compiler_options); leave RR out",
                    what, registers, device.name));
  }
  return fmt::format(" -cl-nv-maxrregcount={}", registers);
}

bool DeviceInfo::has_extension(std::string_view wanted) const {
  std::string_view rest = extensions;
  while (!rest.empty()) {
    const std::size_t space = rest.find(' ');
    if (rest.substr(0, space) == wanted) return true;
    if (space == std::string_view::npos) break;
    rest.remove_prefix(space + 1);
  }
  return false;
}

std::vector<DeviceInfo> list_devices() {
  return enumerate(nullptr);
}

bool is_simulator(const DeviceFacts& d) {
  constexpr cl_device_type all_three = CL_DEVICE_TYPE_CPU | CL_DEVICE_TYPE_GPU | CL_DEVICE_TYPE_ACCELERATOR;
  for (const std::string* s : {&d.platform_name, &d.platform_vendor, &d.name, &d.vendor}) {
    if (lower(*s).find("oclgrind") != std::string::npos) return true;
  }
  return (d.type & all_three) == all_three;  // no real device is all three at once
}

int default_rank(const DeviceFacts& d) {
  if (is_simulator(d)) return 0;
  if (d.type & CL_DEVICE_TYPE_GPU) return 3;
  if (d.type & (CL_DEVICE_TYPE_CPU | CL_DEVICE_TYPE_ACCELERATOR)) return 2;
  return 1;
}

std::optional<std::size_t> default_device_index(std::span<const DeviceFacts> devices) {
  std::optional<std::size_t> best;
  int best_rank = 0;
  for (std::size_t i = 0; i < devices.size(); ++i) {
    const int rank = default_rank(devices[i]);
    if (rank > best_rank) {
      best = i;
      best_rank = rank;
    }
  }
  return best;
}

bool matches_selector(const DeviceFacts& d, std::string_view selector) {
  const std::string needle = lower(trim(selector));
  if (needle.empty()) return false;
  std::vector<std::string_view> words{needle};
  for (const Alias& a : aliases) {
    if (a.name == needle) words.insert(words.end(), a.words.begin(), a.words.end());
  }
  for (const std::string& hay :
       {d.platform_name, d.platform_vendor, d.name, d.vendor, d.platform_name + " " + d.name}) {
    const std::string h = lower(hay);
    for (std::string_view w : words) {
      if (h.find(w) != std::string::npos) return true;
    }
  }
  return false;
}

DeviceInfo select_device(std::string_view selector, int local_rank) {
  std::string from = "selector";
  if (selector.empty()) {
    if (const char* env = std::getenv("FERRY_DEVICE"); env && *env) {
      selector = env;
      from = "FERRY_DEVICE";
    }
  }
  std::vector<std::string> notes;
  auto devices = enumerate(&notes);
  if (devices.empty()) {
    auto icds = registered_icds();
    diagnose_icds(icds);
    throw std::runtime_error(no_device_message(icds, notes));
  }
  std::vector<DeviceFacts> facts;
  for (const auto& d : devices) facts.push_back(d.facts());
  if (selector.empty()) {
    if (auto i = default_device_index(facts)) {
      // Ranks of one node share its best devices (all of the default's kind), one each in turn.
      std::vector<std::size_t> peers;
      for (std::size_t k = 0; k < facts.size(); ++k) {
        if (default_rank(facts[k]) == default_rank(facts[*i])) peers.push_back(k);
      }
      return devices[peers[static_cast<std::size_t>(std::max(local_rank, 0)) % peers.size()]];
    }
    throw std::runtime_error(
        fmt::format("only simulated OpenCL devices were found, and a simulator is used only when named "
                    "(FERRY_DEVICE=oclgrind, or an index):{}",
                    describe_all(devices)));
  }
  std::size_t index = 0;
  auto [ptr, ec] = std::from_chars(selector.data(), selector.data() + selector.size(), index);
  if (ec == std::errc() && ptr == selector.data() + selector.size()) {
    if (index < devices.size()) return devices[index];
    throw std::runtime_error(
        fmt::format("device index {} (from {}) is out of range; devices:{}", index, from, describe_all(devices)));
  }
  std::optional<std::size_t> best;
  for (std::size_t i = 0; i < devices.size(); ++i) {
    if (!matches_selector(facts[i], selector)) continue;
    if (!best || default_rank(facts[i]) > default_rank(facts[*best])) best = i;
  }
  if (best) return devices[*best];
  throw std::runtime_error(fmt::format(
      "no OpenCL device matches '{}' (from {}); pick an index, a part of a platform, vendor or device name, or "
      "one of pocl, nvidia, intel, amd, oclgrind. Devices:{}",
      selector, from, describe_all(devices)));
}

std::vector<IcdRegistration> registered_icds() {
  namespace fs = std::filesystem;
  std::vector<IcdRegistration> out;
  auto add_folder = [&](const fs::path& dir) {
    std::error_code ec;
    std::vector<fs::path> files;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      if (it->path().extension() == ".icd") files.push_back(it->path());
    }
    std::sort(files.begin(), files.end());
    for (const auto& f : files) add_icd_file(f, out);
  };
  const char* vendors = std::getenv("OCL_ICD_VENDORS");
  const char* vendor_path = std::getenv("OPENCL_VENDOR_PATH");
  if (vendors && *vendors) {
    // ocl-icd: a folder replaces /etc/OpenCL/vendors; an .icd file or a library is loaded alone.
    std::error_code ec;
    if (fs::is_directory(vendors, ec)) {
      add_folder(vendors);
    } else if (fs::path(vendors).extension() == ".icd") {
      add_icd_file(vendors, out);
    } else {
      out.push_back({"OCL_ICD_VENDORS", vendors, {}});
    }
  } else if (vendor_path && *vendor_path) {
    add_folder(vendor_path);  // ocl-icd's other name for the folder
  } else {
    add_folder("/etc/OpenCL/vendors");
  }
  if (const char* names = std::getenv("OCL_ICD_FILENAMES"); names && *names) {
    std::string_view rest = names;
    while (!rest.empty()) {
      const std::size_t colon = rest.find(':');
      if (std::string lib = trim(rest.substr(0, colon)); !lib.empty()) out.push_back({"OCL_ICD_FILENAMES", lib, {}});
      rest.remove_prefix(colon == std::string_view::npos ? rest.size() : colon + 1);
    }
  }
  return out;
}

void diagnose_icds(std::vector<IcdRegistration>& icds) {
  for (auto& icd : icds) {
    if (!icd.load_problem.empty()) continue;
    if (icd.library.empty()) {
      icd.load_problem = "the .icd file names no library";
      continue;
    }
    dlerror();
    void* handle = dlopen(icd.library.c_str(), RTLD_LAZY | RTLD_LOCAL);
    if (!handle) {
      const char* why = dlerror();
      icd.load_problem = fmt::format("failed to load: {}", why ? why : "dlopen failed");
      continue;
    }
    // The loader finds a driver's entry point through clGetExtensionFunctionAddress.
    if (!dlsym(handle, "clGetExtensionFunctionAddress") && !dlsym(handle, "clIcdGetPlatformIDsKHR")) {
      icd.load_problem =
          "failed to load as a driver: the library has no clGetExtensionFunctionAddress (it is not an OpenCL ICD)";
    } else {
      icd.load_problem =
          "the library loads, but its platform failed to initialise or gave no device "
          "(a missing kernel driver or device node, an unsupported device, or a clash with its dependencies)";
    }
    dlclose(handle);
  }
}

std::string no_device_message(const std::vector<IcdRegistration>& icds, const std::vector<std::string>& notes) {
  const char* vendors = std::getenv("OCL_ICD_VENDORS");
  const char* vendor_path = std::getenv("OPENCL_VENDOR_PATH");
  const std::string where = vendors && *vendors           ? fmt::format("OCL_ICD_VENDORS={}", vendors)
                            : vendor_path && *vendor_path ? fmt::format("OPENCL_VENDOR_PATH={}", vendor_path)
                                                          : std::string("/etc/OpenCL/vendors");
  if (icds.empty() && notes.empty()) {
    return fmt::format(
        "no OpenCL device found: no OpenCL driver is registered with the ICD loader (no .icd file in {}). "
        "Install one (for a CPU: apt-get install pocl-opencl-icd); see docs/troubleshooting.md",
        where);
  }
  std::string msg = "no OpenCL device found.";
  if (!icds.empty()) {
    msg += fmt::format(" The ICD loader has {} registered driver{} (in {}); they failed to load or gave no device:",
                       icds.size(), icds.size() == 1 ? "" : "s", where);
    for (const auto& icd : icds) {
      msg += fmt::format("\n  {} -> {}: {}", icd.source, icd.library.empty() ? "(no library)" : icd.library,
                         icd.load_problem.empty() ? "failed to load" : icd.load_problem);
    }
  }
  for (const auto& n : notes) msg += fmt::format("\n  {}", n);
  msg +=
      "\nTo see why: `ldd <library>` shows missing dependencies; `OCL_ICD_DEBUG=7 clinfo -l` makes ocl-icd's loader "
      "(where built with debug output) print each file and library it tries; `clinfo` shows what loaded. "
      "See docs/troubleshooting.md";
  return msg;
}

std::string no_device_message() {
  std::vector<std::string> notes;
  enumerate(&notes);
  auto icds = registered_icds();
  diagnose_icds(icds);
  return no_device_message(icds, notes);
}

}  // namespace ferry::cl
