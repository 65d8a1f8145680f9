// A stand-in for NVIDIA's libnvidia-ml.so.1 with the calls cl::DriverMemory makes, for
// tests/test_driver_memory.cpp on machines without an NVIDIA driver: one GPU at PCI address
// 00000000:3b:00.0 whose memory in use the test sets (fake_nvml_set_used). Its return codes are
// NVML's: 0 success, 6 not found, 9 driver not loaded, 25 argument version mismatch.
// FAKE_NVML_INIT_FAILS in the environment makes nvmlInit_v2 fail as on a machine whose driver is
// not loaded; FAKE_NVML_USED="b0,b1,..." makes the memory reads return b0 bytes in use, then b1,
// and so on, the last for every read after (for a whole `ferry train`, tests/cli/run.sh).
#include <atomic>
#include <cstdlib>
#include <cstring>

namespace {

struct Memory {
  unsigned long long total, free, used;
};
struct MemoryV2 {
  unsigned int version;
  unsigned long long total, reserved, free, used;
};

constexpr unsigned long long total_bytes = 80ull << 30, reserved_bytes = 512ull << 20;
std::atomic<unsigned long long> used_bytes{1ull << 30};
std::atomic<int> initialised{0};
int the_gpu = 0;  // its address is the device handle
std::atomic<unsigned> reads{0};

// The bytes in use this read: FAKE_NVML_USED's next value where it is set, else the test's.
unsigned long long used_now() {
  const char* script = std::getenv("FAKE_NVML_USED");
  if (script == nullptr) return used_bytes;
  const unsigned n = reads++;
  unsigned long long value = 0;
  const char* p = script;
  for (unsigned i = 0; i <= n && *p != '\0'; ++i) {
    char* end = nullptr;
    value = std::strtoull(p, &end, 10);
    p = *end == ',' ? end + 1 : end;
  }
  return value;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void fake_nvml_set_used(unsigned long long bytes) {
  used_bytes = bytes;
}
__attribute__((visibility("default"))) int fake_nvml_initialised() {
  return initialised.load();
}

__attribute__((visibility("default"))) int nvmlInit_v2() {
  if (std::getenv("FAKE_NVML_INIT_FAILS") != nullptr) return 9;
  ++initialised;
  return 0;
}

__attribute__((visibility("default"))) int nvmlShutdown() {
  --initialised;
  return 0;
}

__attribute__((visibility("default"))) const char* nvmlErrorString(int r) {
  switch (r) {
    case 6:
      return "Not Found";
    case 9:
      return "Driver Not Loaded";
    case 25:
      return "Argument Version Mismatch";
    default:
      return "Unknown Error";
  }
}

__attribute__((visibility("default"))) int nvmlDeviceGetHandleByPciBusId_v2(const char* bus_id, void** device) {
  if (initialised.load() <= 0) return 9;
  if (std::strcmp(bus_id, "00000000:3b:00.0") != 0) return 6;
  *device = &the_gpu;
  return 0;
}

// v1 counts the driver's reserved memory as used too; v2 does not (nvidia-smi's figure).
// The structs come as void*, as cl/driver_memory.cpp declares the calls (the C library's types).
__attribute__((visibility("default"))) int nvmlDeviceGetMemoryInfo(void* device, void* out) {
  if (device != &the_gpu) return 2;
  auto* m = static_cast<Memory*>(out);
  m->used = used_now() + reserved_bytes;
  m->total = total_bytes;
  m->free = total_bytes > m->used ? total_bytes - m->used : 0;
  return 0;
}

__attribute__((visibility("default"))) int nvmlDeviceGetMemoryInfo_v2(void* device, void* out) {
  if (device != &the_gpu) return 2;
  auto* m = static_cast<MemoryV2*>(out);
  if (m->version != (sizeof(MemoryV2) | (2u << 24))) return 25;
  m->used = used_now();
  m->reserved = reserved_bytes;
  m->total = total_bytes;
  m->free = total_bytes > m->used + reserved_bytes ? total_bytes - m->used - reserved_bytes : 0;
  return 0;
}

}  // extern "C"
