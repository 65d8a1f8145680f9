// Device enumeration and selection.
#include "ferry/cl/device.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <stdexcept>

#include "ferry/cl/error.hpp"

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

std::string describe_all(const std::vector<DeviceInfo>& devices) {
  std::string out;
  for (const auto& d : devices)
    out += fmt::format("\n  [{}] {} / {} ({})", d.index, d.platform_name, d.name, d.type_name());
  return out;
}

}  // namespace

std::string DeviceInfo::type_name() const {
  if (is_gpu()) return "GPU";
  if (is_cpu()) return "CPU";
  if (type & CL_DEVICE_TYPE_ACCELERATOR) return "accelerator";
  return "other";
}

std::vector<DeviceInfo> list_devices() {
  cl_uint n_platforms = 0;
  cl_int status = clGetPlatformIDs(0, nullptr, &n_platforms);
  if (status == -1001 /*CL_PLATFORM_NOT_FOUND_KHR*/ || n_platforms == 0) return {};
  FERRY_CL(status);
  std::vector<cl_platform_id> platforms(n_platforms);
  FERRY_CL(clGetPlatformIDs(n_platforms, platforms.data(), nullptr));

  std::vector<DeviceInfo> devices;
  for (cl_platform_id p : platforms) {
    cl_uint n = 0;
    status = clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, 0, nullptr, &n);
    if (status == CL_DEVICE_NOT_FOUND || n == 0) continue;
    FERRY_CL(status);
    std::vector<cl_device_id> ids(n);
    FERRY_CL(clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, n, ids.data(), nullptr));
    for (cl_device_id id : ids) {
      DeviceInfo d;
      d.index = devices.size();
      d.platform = p;
      d.id = id;
      d.platform_name = platform_string(p, CL_PLATFORM_NAME);
      d.platform_version = platform_string(p, CL_PLATFORM_VERSION);
      d.name = device_string(id, CL_DEVICE_NAME);
      d.vendor = device_string(id, CL_DEVICE_VENDOR);
      d.version = device_string(id, CL_DEVICE_VERSION);
      d.driver = device_string(id, CL_DRIVER_VERSION);
      d.c_version = device_string(id, CL_DEVICE_OPENCL_C_VERSION);
      d.type = device_value<cl_device_type>(id, CL_DEVICE_TYPE);
      d.global_mem_bytes = device_value<cl_ulong>(id, CL_DEVICE_GLOBAL_MEM_SIZE);
      d.max_alloc_bytes = device_value<cl_ulong>(id, CL_DEVICE_MAX_MEM_ALLOC_SIZE);
      d.local_mem_bytes = device_value<cl_ulong>(id, CL_DEVICE_LOCAL_MEM_SIZE);
      d.compute_units = device_value<cl_uint>(id, CL_DEVICE_MAX_COMPUTE_UNITS);
      d.max_work_group_size = device_value<std::size_t>(id, CL_DEVICE_MAX_WORK_GROUP_SIZE);
      d.base_align_bytes = device_value<cl_uint>(id, CL_DEVICE_MEM_BASE_ADDR_ALIGN) / 8;
      d.host_unified_memory = device_value<cl_bool>(id, CL_DEVICE_HOST_UNIFIED_MEMORY) == CL_TRUE;
      devices.push_back(std::move(d));
    }
  }
  return devices;
}

DeviceInfo select_device(std::string_view selector) {
  std::string from = "selector";
  if (selector.empty()) {
    if (const char* env = std::getenv("FERRY_DEVICE"); env && *env) {
      selector = env;
      from = "FERRY_DEVICE";
    }
  }
  auto devices = list_devices();
  if (devices.empty()) {
    throw std::runtime_error(
        "no OpenCL device found: install an OpenCL driver (for a CPU: apt-get install pocl-opencl-icd) "
        "and check that an ICD file exists in /etc/OpenCL/vendors");
  }
  if (selector.empty()) {
    auto gpu = std::find_if(devices.begin(), devices.end(), [](const DeviceInfo& d) { return d.is_gpu(); });
    return gpu != devices.end() ? *gpu : devices.front();
  }
  std::size_t index = 0;
  auto [ptr, ec] = std::from_chars(selector.data(), selector.data() + selector.size(), index);
  if (ec == std::errc() && ptr == selector.data() + selector.size()) {
    if (index < devices.size()) return devices[index];
    throw std::runtime_error(
        fmt::format("device index {} (from {}) is out of range; devices:{}", index, from, describe_all(devices)));
  }
  const std::string needle = lower(selector);
  for (const auto& d : devices) {
    if (lower(d.platform_name + " " + d.name).find(needle) != std::string::npos) return d;
  }
  throw std::runtime_error(fmt::format("no OpenCL device matches '{}' (from {}); pick an index or a name part of:{}",
                                       selector, from, describe_all(devices)));
}

}  // namespace ferry::cl
