// The driver's count of device memory in use (ferry/cl/driver_memory.hpp).
#include "ferry/cl/driver_memory.hpp"

#include <CL/cl_ext.h>
#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace ferry::cl {
namespace {

// cl_nv_device_attribute_query's PCI address, which the headers do not declare.
constexpr cl_device_info pci_bus_id_nv = 0x4008, pci_slot_id_nv = 0x4009, pci_domain_id_nv = 0x400A;

// A PCI address as NVML spells it: domain:bus:device.function, hexadecimal.
std::string nvml_address(cl_uint domain, cl_uint bus, cl_uint device, cl_uint function) {
  return fmt::format("{:08x}:{:02x}:{:02x}.{:x}", domain, bus, device, function);
}

// The device's PCI address as NVML spells it, or "" where the driver does not say.
std::string pci_bus_id(const DeviceInfo& device) {
  if (device.has_extension("cl_khr_pci_bus_info")) {
    cl_device_pci_bus_info_khr info{};
    if (clGetDeviceInfo(device.id, CL_DEVICE_PCI_BUS_INFO_KHR, sizeof info, &info, nullptr) == CL_SUCCESS) {
      return nvml_address(info.pci_domain, info.pci_bus, info.pci_device, info.pci_function);
    }
  }
  if (device.has_extension("cl_nv_device_attribute_query")) {
    cl_uint bus = 0, slot = 0, domain = 0;
    if (clGetDeviceInfo(device.id, pci_bus_id_nv, sizeof bus, &bus, nullptr) != CL_SUCCESS ||
        clGetDeviceInfo(device.id, pci_slot_id_nv, sizeof slot, &slot, nullptr) != CL_SUCCESS) {
      return "";
    }
    // Older drivers lack the domain query: domain 0 then, as on most machines.
    if (clGetDeviceInfo(device.id, pci_domain_id_nv, sizeof domain, &domain, nullptr) != CL_SUCCESS) domain = 0;
    // The slot holds the device number above three bits of function.
    return nvml_address(domain, bus, slot >> 3, slot & 7);
  }
  return "";
}

// NVML through dlopen: ferry neither builds nor links against it, and a machine without the
// NVIDIA driver has no such library.
class NvmlReader final : public DriverMemory::Reader {
 public:
  using Return = int;  // nvmlReturn_t; 0 is success
  struct Memory {      // nvmlMemory_t
    unsigned long long total, free, used;
  };
  struct MemoryV2 {  // nvmlMemory_v2_t
    unsigned int version;
    unsigned long long total, reserved, free, used;
  };

  // Opens the library and finds the device; throws std::runtime_error saying which step failed.
  NvmlReader(const std::string& library, const std::string& bus_id) {
    handle_ = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle_ == nullptr) throw std::runtime_error(fmt::format("cannot load {}: {}", library, dlerror()));
    try {
      init_ = symbol<Return (*)()>("nvmlInit_v2");
      shutdown_ = symbol<Return (*)()>("nvmlShutdown");
      by_bus_id_ = symbol<Return (*)(const char*, void**)>("nvmlDeviceGetHandleByPciBusId_v2");
      memory_ = symbol<Return (*)(void*, void*)>("nvmlDeviceGetMemoryInfo");
      memory_v2_ = reinterpret_cast<Return (*)(void*, void*)>(dlsym(handle_, "nvmlDeviceGetMemoryInfo_v2"));
      error_string_ = reinterpret_cast<const char* (*)(Return)>(dlsym(handle_, "nvmlErrorString"));
      check(init_(), "nvmlInit_v2");
      initialised_ = true;
      check(by_bus_id_(bus_id.c_str(), &device_), fmt::format("nvmlDeviceGetHandleByPciBusId_v2(\"{}\")", bus_id));
      if (!read()) throw std::runtime_error("nvmlDeviceGetMemoryInfo failed on its first call");
    } catch (...) {
      close();
      throw;
    }
  }
  NvmlReader(const NvmlReader&) = delete;
  NvmlReader& operator=(const NvmlReader&) = delete;
  ~NvmlReader() override { close(); }

  std::optional<DriverMemoryReading> read() const override {
    // v2's "used" is what nvidia-smi prints; v1's adds memory the driver reserves. v2 first.
    if (memory_v2_ != nullptr) {
      MemoryV2 m{};
      m.version = static_cast<unsigned int>(sizeof(MemoryV2) | (2u << 24));
      if (memory_v2_(device_, &m) == 0) return DriverMemoryReading{m.used, m.total, m.free};
    }
    Memory m{};
    if (memory_(device_, &m) != 0) return std::nullopt;
    return DriverMemoryReading{m.used, m.total, m.free};
  }

 private:
  template <class F>
  F symbol(const char* name) {
    void* p = dlsym(handle_, name);
    if (p == nullptr) throw std::runtime_error(fmt::format("it has no {} (an NVML older than R450?)", name));
    return reinterpret_cast<F>(p);
  }
  void check(Return r, const std::string& call) const {
    if (r == 0) return;
    throw std::runtime_error(fmt::format("{} returned {} ({})", call, r,
                                         error_string_ != nullptr ? error_string_(r) : "no nvmlErrorString"));
  }
  void close() noexcept {
    if (initialised_) shutdown_();
    initialised_ = false;
    if (handle_ != nullptr) dlclose(handle_);
    handle_ = nullptr;
  }

  void* handle_ = nullptr;
  bool initialised_ = false;
  Return (*init_)() = nullptr;
  Return (*shutdown_)() = nullptr;
  Return (*by_bus_id_)(const char*, void**) = nullptr;
  // The struct pointers as void*: the C functions' types, whatever their structs are called there.
  Return (*memory_)(void*, void*) = nullptr;
  Return (*memory_v2_)(void*, void*) = nullptr;
  const char* (*error_string_)(Return) = nullptr;
  void* device_ = nullptr;
};

// AMD's free-memory query: kilobytes free (and the largest free block), next to the device's size.
class AmdReader final : public DriverMemory::Reader {
 public:
  explicit AmdReader(const DeviceInfo& device) : id_(device.id), total_(device.global_mem_bytes) {}
  std::optional<DriverMemoryReading> read() const override {
    std::array<std::size_t, 2> free_kib{};
    if (clGetDeviceInfo(id_, CL_DEVICE_GLOBAL_FREE_MEMORY_AMD, sizeof free_kib, free_kib.data(), nullptr) != CL_SUCCESS)
      return std::nullopt;
    const std::uint64_t free = std::uint64_t{free_kib[0]} * 1024;
    return DriverMemoryReading{total_ > free ? total_ - free : 0, total_, free};
  }

 private:
  cl_device_id id_;
  std::uint64_t total_;
};

}  // namespace

DriverMemory::DriverMemory(std::string reason) : reason_(std::move(reason)) {}

DriverMemory::DriverMemory(std::string source, std::shared_ptr<const Reader> reader)
    : source_(std::move(source)), reader_(std::move(reader)) {}

std::optional<DriverMemoryReading> DriverMemory::read() const {
  return reader_ ? reader_->read() : std::nullopt;
}

DriverMemory DriverMemory::from_nvml(const std::string& library, const std::string& bus_id) {
  try {
    return DriverMemory("nvml", std::make_shared<const NvmlReader>(library, bus_id));
  } catch (const std::exception& e) {
    return DriverMemory(fmt::format("NVML ({}): {}", library, e.what()));
  }
}

std::string DriverMemory::named_by_environment() {
  std::string named;
  for (const char* name : {"FERRY_NVML_LIBRARY", "FERRY_NVML_GPU"}) {
    if (const char* value = std::getenv(name); value != nullptr && *value != '\0') {
      named += fmt::format("{}{}={}", named.empty() ? "" : " ", name, value);
    }
  }
  return named;
}

DriverMemory DriverMemory::for_device(const DeviceInfo& device) {
  const char* library = std::getenv("FERRY_NVML_LIBRARY");
  const std::string nvml = library != nullptr && *library != '\0' ? library : "libnvidia-ml.so.1";
  if (const char* gpu = std::getenv("FERRY_NVML_GPU"); gpu != nullptr && *gpu != '\0') return from_nvml(nvml, gpu);
  if (device.is_simulator()) return DriverMemory("a simulator: no driver memory to count");
  if (device.is_cpu() || device.host_unified_memory) {
    return DriverMemory("a CPU or integrated device, whose memory is host memory: no separate count");
  }
  if (device.has_extension("cl_amd_device_attribute_query")) {
    auto reader = std::make_shared<const AmdReader>(device);
    if (reader->read()) return DriverMemory("cl_amd_device_attribute_query", std::move(reader));
    return DriverMemory("the AMD driver refused CL_DEVICE_GLOBAL_FREE_MEMORY_AMD");
  }
  const bool nvidia =
      device.platform_name.find("NVIDIA") != std::string::npos || device.has_extension("cl_nv_device_attribute_query");
  if (!nvidia)
    return DriverMemory(fmt::format("the driver of {} reports no device memory in use", device.platform_name));
  const std::string bus_id = pci_bus_id(device);
  if (bus_id.empty())
    return DriverMemory(
        "the NVIDIA driver gives no PCI address for this GPU, so NVML cannot find it (FERRY_NVML_GPU names it)");
  return from_nvml(nvml, bus_id);
}

struct DriverMemoryWatch::Sampler {
  std::mutex mutex;
  std::condition_variable wake;
  bool stop = false;
  std::uint64_t peak = 0;
  std::thread thread;
};

DriverMemoryWatch::DriverMemoryWatch(DriverMemory source, std::chrono::milliseconds period)
    : source_(std::move(source)), period_(period) {
  if (const auto now = source_.read()) before_ = now->used_bytes;
}

void DriverMemoryWatch::context_made() {
  if (!source_.available() || sampler_) return;
  if (const auto now = source_.read()) after_ = now->used_bytes;
  sampler_ = std::make_unique<Sampler>();
  sampler_->peak = after_.value_or(0);
  sampler_->thread = std::thread([this] {
    Sampler& s = *sampler_;
    std::unique_lock lock(s.mutex);
    while (!s.wake.wait_for(lock, period_, [&] { return s.stop; })) {
      lock.unlock();
      const auto now = source_.read();  // outside the lock: a driver call may take a while
      lock.lock();
      if (now) s.peak = std::max(s.peak, now->used_bytes);
    }
  });
}

DriverMemoryWatch::~DriverMemoryWatch() {
  if (!sampler_) return;
  {
    std::lock_guard lock(sampler_->mutex);
    sampler_->stop = true;
  }
  sampler_->wake.notify_all();
  sampler_->thread.join();
}

std::optional<std::uint64_t> DriverMemoryWatch::peak_used_bytes() const {
  if (!sampler_) return std::nullopt;
  const auto now = source_.read();
  std::lock_guard lock(sampler_->mutex);
  if (now) sampler_->peak = std::max(sampler_->peak, now->used_bytes);
  return sampler_->peak;
}

}  // namespace ferry::cl
