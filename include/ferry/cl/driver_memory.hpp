// The device memory a GPU's driver counts as in use, where the driver says: a check of a device
// budget as the driver sees it, beside the plan's own peak. A driver may take device
// memory that no buffer of ferry's names (NVIDIA backs pinned host buffers with device memory too),
// and only its own count shows that.
//
// Sources, tried in this order:
//   nvml                            NVIDIA: libnvidia-ml.so.1 (installed with the driver), loaded at
//                                   run time; the GPU found by its PCI address (cl_khr_pci_bus_info,
//                                   or cl_nv_device_attribute_query's bus and slot). Its "used"
//                                   is what nvidia-smi prints: every process's allocations.
//   cl_amd_device_attribute_query   AMD: the global memory less CL_DEVICE_GLOBAL_FREE_MEMORY_AMD.
// Other devices report nothing, and say why (a CPU device's memory is the host's).
// FERRY_NVML_LIBRARY names another NVML library file; FERRY_NVML_GPU ("dddd:bb:dd.f") names the GPU
// whose count to read through NVML, whatever the OpenCL device (for a driver that does not give its
// GPU's PCI address; the tests use both with a stand-in library).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "ferry/cl/device.hpp"

namespace ferry::cl {

struct DriverMemoryReading {
  std::uint64_t used_bytes = 0;   // device memory in use, all processes together
  std::uint64_t total_bytes = 0;  // the device's memory as the driver counts it
  // What the driver says is free: less than total - used where it reserves memory of its own
  // (NVML's v2 count leaves the reserve out of `used`, as nvidia-smi does, and out of `free`).
  std::uint64_t free_bytes = 0;
};

class DriverMemory {
 public:
  // A source that reads nothing: `reason` says why.
  explicit DriverMemory(std::string reason);

  // The source for `device` (see above), or one that reads nothing and says why. Never throws:
  // the count is a report, and a driver without it must not stop a run.
  static DriverMemory for_device(const DeviceInfo& device);
  // NVML from `library` (a file name dlopen searches for, or a path) for the GPU at `pci_bus_id`
  // ("dddd:bb:dd.f", hexadecimal, as nvidia-smi prints it). Tests pass a stand-in library.
  static DriverMemory from_nvml(const std::string& library, const std::string& pci_bus_id);

  bool available() const noexcept { return reader_ != nullptr; }
  // "nvml", "cl_amd_device_attribute_query", or "" where nothing is read.
  const std::string& source() const noexcept { return source_; }
  // Where nothing is read, why (the device's kind, the library or symbol missing, the driver's
  // error); "" otherwise.
  const std::string& unavailable_reason() const noexcept { return reason_; }
  // The count now; nullopt where nothing is read or the driver refuses this once. Thread-safe.
  std::optional<DriverMemoryReading> read() const;
  // FERRY_NVML_LIBRARY and FERRY_NVML_GPU as set ("NAME=value", space-separated; "" where neither
  // is): a user who names them asked for a count, and is told where none is read.
  static std::string named_by_environment();

  struct Reader {
    virtual ~Reader() = default;
    virtual std::optional<DriverMemoryReading> read() const = 0;
  };

 private:
  DriverMemory(std::string source, std::shared_ptr<const Reader> reader);
  std::string source_, reason_;
  std::shared_ptr<const Reader> reader_;
};

// The driver's count at three moments of a run: before this process made its context (what the
// others hold; read by the constructor), after it (the context's own memory, the fixed overhead
// beside the plan; read by context_made()), and the largest seen since, read every `period` on a
// thread of its own from context_made() until the watch is destroyed.
class DriverMemoryWatch {
 public:
  explicit DriverMemoryWatch(DriverMemory source, std::chrono::milliseconds period = std::chrono::milliseconds(100));
  DriverMemoryWatch(const DriverMemoryWatch&) = delete;
  DriverMemoryWatch& operator=(const DriverMemoryWatch&) = delete;
  ~DriverMemoryWatch();
  // Call once, when the context exists: reads the count after it and starts the sampling.
  void context_made();

  const DriverMemory& source() const noexcept { return source_; }
  std::optional<std::uint64_t> used_before_context_bytes() const noexcept { return before_; }
  std::optional<std::uint64_t> used_after_context_bytes() const noexcept { return after_; }
  // The largest count read so far, a reading taken now included; nullopt where nothing is read.
  std::optional<std::uint64_t> peak_used_bytes() const;

 private:
  struct Sampler;
  DriverMemory source_;
  std::optional<std::uint64_t> before_, after_;
  std::chrono::milliseconds period_;
  std::unique_ptr<Sampler> sampler_;
};

}  // namespace ferry::cl
