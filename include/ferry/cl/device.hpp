// OpenCL devices: enumerate all platforms' devices and pick one by index or name.
#pragma once

#include <CL/cl.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ferry::cl {

struct DeviceInfo {
  std::size_t index = 0;  // position in list_devices()
  cl_platform_id platform = nullptr;
  cl_device_id id = nullptr;
  std::string name, vendor, version, driver, platform_name, platform_version, c_version;
  cl_device_type type = 0;
  std::uint64_t global_mem_bytes = 0;
  std::uint64_t max_alloc_bytes = 0;  // largest single buffer (CL_DEVICE_MAX_MEM_ALLOC_SIZE)
  std::uint64_t local_mem_bytes = 0;
  std::uint32_t compute_units = 0;
  std::size_t max_work_group_size = 0;
  std::uint32_t base_align_bytes = 0;  // sub-buffer origin alignment
  bool host_unified_memory = false;    // device memory is the host's (CPU devices, iGPUs)
  bool is_cpu() const { return (type & CL_DEVICE_TYPE_CPU) != 0; }
  bool is_gpu() const { return (type & CL_DEVICE_TYPE_GPU) != 0; }
  std::string type_name() const;
};

// All devices of all platforms, in a stable order. Empty when no OpenCL platform is installed.
std::vector<DeviceInfo> list_devices();

// Picks a device. `selector` is a decimal index into list_devices() or a case-insensitive
// substring of "<platform> <device name>". Empty selector: the FERRY_DEVICE environment
// variable if set, else the first GPU, else the first device. Throws std::runtime_error naming
// the selector and listing the devices when nothing matches or no device exists.
DeviceInfo select_device(std::string_view selector = {});

}  // namespace ferry::cl
