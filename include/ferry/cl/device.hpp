// OpenCL devices: enumerate all platforms' devices and pick one by index, name or alias.
#pragma once

#include <CL/cl.h>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace ferry::cl {

// What the default choice and name matching look at: a device without its handles, so the
// choice is a pure function that tests can feed any set of devices.
struct DeviceFacts {
  std::string platform_name, platform_vendor, name, vendor;
  cl_device_type type = 0;
};

struct DeviceInfo {
  std::size_t index = 0;  // position in list_devices()
  cl_platform_id platform = nullptr;
  cl_device_id id = nullptr;
  std::string name, vendor, version, driver, platform_name, platform_vendor, platform_version, c_version;
  std::string extensions;  // CL_DEVICE_EXTENSIONS, space-separated
  cl_device_type type = 0;
  std::uint64_t global_mem_bytes = 0;
  std::uint64_t max_alloc_bytes = 0;  // largest single buffer (CL_DEVICE_MAX_MEM_ALLOC_SIZE)
  std::uint64_t local_mem_bytes = 0;
  std::uint64_t global_mem_cache_bytes = 0;  // CL_DEVICE_GLOBAL_MEM_CACHE_SIZE (a CPU's last-level cache)
  std::uint32_t compute_units = 0;
  std::uint32_t native_float_width = 0;  // CL_DEVICE_NATIVE_VECTOR_WIDTH_FLOAT: a CPU's lanes (AVX-512 16, AVX2 8)
  std::size_t max_work_group_size = 0;
  std::uint32_t base_align_bytes = 0;  // sub-buffer origin alignment
  bool host_unified_memory = false;    // device memory is the host's (CPU devices, iGPUs)
  bool is_cpu() const { return (type & CL_DEVICE_TYPE_CPU) != 0; }
  bool is_gpu() const { return (type & CL_DEVICE_TYPE_GPU) != 0; }
  bool is_simulator() const;
  bool has_extension(std::string_view name) const;  // a whole word of `extensions`
  std::string type_name() const;
  DeviceFacts facts() const { return {platform_name, platform_vendor, name, vendor, type}; }
};

// The build option that caps a kernel's registers per work-item at `registers` (NVIDIA's
// -cl-nv-maxrregcount: more work-groups resident per compute unit, at the risk of spills); "" for 0.
// Other drivers would reject or ignore it, so on a device without cl_nv_compiler_options it throws
// std::runtime_error naming `what` (the kernel whose parameters asked for it).
std::string register_cap_option(const DeviceInfo& device, int registers, std::string_view what);

// All devices of all platforms, in a stable order (the order `clinfo -l` shows). Empty when no
// OpenCL platform is installed or none loaded; a platform that fails to list its devices is
// skipped.
std::vector<DeviceInfo> list_devices();

// A device simulator (Oclgrind: its platform or device name says so, and it reports itself as
// CPU, GPU and accelerator at once). It is never chosen by default.
bool is_simulator(const DeviceFacts& device);
// The default choice's preference: 3 a GPU, 2 a CPU or an accelerator, 1 anything else, 0 a
// simulator (chosen only by index or name).
int default_rank(const DeviceFacts& device);
// The device chosen when none is named: the first of the highest rank above 0; nullopt when
// there are only simulators or no devices.
std::optional<std::size_t> default_device_index(std::span<const DeviceFacts> devices);
// Whether `selector` names the device: a case-insensitive part of its platform name, platform
// vendor, device name or device vendor (or of "<platform name> <device name>"), or one of the
// aliases pocl ("Portable Computing Language"), nvidia, intel, amd ("Advanced Micro Devices"),
// oclgrind.
bool matches_selector(const DeviceFacts& device, std::string_view selector);

// Picks a device. `selector` is a decimal index into list_devices() or a name part or alias
// (matches_selector); when several devices match, the best of them by default_rank (the first
// on ties). Empty selector: the FERRY_DEVICE environment variable if set, else the
// default_device_index() choice. Throws std::runtime_error naming the selector and listing the
// devices when nothing matches, and explaining what the ICD loader was given when there is no
// device at all (no_device_message()).
// With no selector and no FERRY_DEVICE, rank `local_rank` of a data-parallel run on one node
// takes the (local_rank mod n)-th of the n devices ranked best (one GPU per rank).
DeviceInfo select_device(std::string_view selector = {}, int local_rank = 0);

// One OpenCL driver the ICD loader is told about: an .icd file (in /etc/OpenCL/vendors, or in
// the folder $OCL_ICD_VENDORS or else $OPENCL_VENDOR_PATH names) and the library it names, or an
// .icd file or library named directly by $OCL_ICD_VENDORS, or a library in $OCL_ICD_FILENAMES
// (read by the Khronos loader).
struct IcdRegistration {
  std::string source;        // the .icd file's path, or "OCL_ICD_VENDORS"/"OCL_ICD_FILENAMES"
  std::string library;       // the driver library it names
  std::string load_problem;  // why loading it fails (empty: not checked, or it loads)
};
// The drivers registered with the ICD loader, as the environment and /etc/OpenCL/vendors say.
std::vector<IcdRegistration> registered_icds();
// Tries to load each registration's library as the loader would (dlopen, then look for the
// entry point the loader calls, clGetExtensionFunctionAddress) and fills load_problem.
void diagnose_icds(std::vector<IcdRegistration>& icds);
// The error for "no OpenCL device": with no driver registered, how to install one; with drivers
// registered, their files and libraries, that they failed to load (and why, where known), and
// how to see more (OCL_ICD_DEBUG=7 clinfo -l). `notes` are platforms that loaded but gave no
// device.
std::string no_device_message(const std::vector<IcdRegistration>& icds, const std::vector<std::string>& notes = {});
// The same for this machine now: lists platforms, reads the registrations and diagnoses them.
std::string no_device_message();

}  // namespace ferry::cl
