// cl::DriverMemory and cl::DriverMemoryWatch (ferry/cl/driver_memory.hpp): the device memory a
// driver counts in use, read through NVML from a stand-in library (tests/stand_ins/fake_nvml.cpp,
// loaded as the real one is), the reasons given where nothing can be read, and the runtime's watch
// on a device without a count (PoCL).
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>

#include "ferry/cl/driver_memory.hpp"
#include "ferry/runtime/plan.hpp"
#include "ferry/runtime/runtime.hpp"
#include "runtime/trainer_variants.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

constexpr const char* gpu_address = "00000000:3b:00.0";
constexpr std::uint64_t gib = std::uint64_t{1} << 30;

// The stand-in's own controls, from the copy of it the process has loaded.
struct FakeNvml {
  FakeNvml() {
    handle = dlopen(FAKE_NVML, RTLD_NOW | RTLD_LOCAL);
    EXPECT_NE(handle, nullptr) << dlerror();
    set_used = reinterpret_cast<void (*)(unsigned long long)>(dlsym(handle, "fake_nvml_set_used"));
    initialised = reinterpret_cast<int (*)()>(dlsym(handle, "fake_nvml_initialised"));
  }
  ~FakeNvml() { dlclose(handle); }
  void* handle = nullptr;
  void (*set_used)(unsigned long long) = nullptr;
  int (*initialised)() = nullptr;
};

// The tests that read through the stand-in. It is built beside this binary; a binary copied
// without it (the GPU kit packs the test binaries alone) skips them and says why.
class StandInNvml : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(FAKE_NVML)) {
      GTEST_SKIP() << "the stand-in NVML library " << FAKE_NVML << " is not here (a test binary copied without it)";
    }
  }
};

TEST_F(StandInNvml, ReadsNvmlsCountForTheGpuAtItsAddress) {
  FakeNvml fake;
  fake.set_used(3 * gib);
  {
    const cl::DriverMemory m = cl::DriverMemory::from_nvml(FAKE_NVML, gpu_address);
    ASSERT_TRUE(m.available()) << m.unavailable_reason();
    EXPECT_EQ(m.source(), "nvml");
    EXPECT_EQ(m.unavailable_reason(), "");
    EXPECT_EQ(fake.initialised(), 1);
    const auto r = m.read();
    ASSERT_TRUE(r.has_value());
    // nvidia-smi's figure (nvmlDeviceGetMemoryInfo_v2), not v1's, which adds the driver's reserve.
    EXPECT_EQ(r->used_bytes, 3 * gib);
    EXPECT_EQ(r->total_bytes, 80 * gib);
    fake.set_used(5 * gib);
    EXPECT_EQ(m.read()->used_bytes, 5 * gib);
  }
  EXPECT_EQ(fake.initialised(), 0) << "NVML is shut down with the last copy of the source";
}

TEST_F(StandInNvml, SaysWhyNothingIsRead) {
  const cl::DriverMemory missing = cl::DriverMemory::from_nvml("/nonexistent/libnvidia-ml.so.1", gpu_address);
  EXPECT_FALSE(missing.available());
  EXPECT_FALSE(missing.read().has_value());
  EXPECT_EQ(missing.source(), "");
  EXPECT_NE(missing.unavailable_reason().find("cannot load /nonexistent/libnvidia-ml.so.1"), std::string::npos)
      << missing.unavailable_reason();

  const cl::DriverMemory not_nvml = cl::DriverMemory::from_nvml("libm.so.6", gpu_address);
  EXPECT_FALSE(not_nvml.available());
  EXPECT_NE(not_nvml.unavailable_reason().find("NVML (libm.so.6): it has no nvmlInit_v2"), std::string::npos)
      << "the reason names the library: " << not_nvml.unavailable_reason();

  FakeNvml fake;
  const cl::DriverMemory elsewhere = cl::DriverMemory::from_nvml(FAKE_NVML, "00000000:65:00.0");
  EXPECT_FALSE(elsewhere.available());
  EXPECT_NE(elsewhere.unavailable_reason().find("nvmlDeviceGetHandleByPciBusId_v2(\"00000000:65:00.0\") returned 6 "
                                                "(Not Found)"),
            std::string::npos)
      << elsewhere.unavailable_reason();
  EXPECT_EQ(fake.initialised(), 0) << "a failed search shuts NVML down again";

  ::setenv("FAKE_NVML_INIT_FAILS", "1", 1);
  const cl::DriverMemory no_driver = cl::DriverMemory::from_nvml(FAKE_NVML, gpu_address);
  ::unsetenv("FAKE_NVML_INIT_FAILS");
  EXPECT_FALSE(no_driver.available());
  EXPECT_NE(no_driver.unavailable_reason().find("nvmlInit_v2 returned 9 (Driver Not Loaded)"), std::string::npos)
      << no_driver.unavailable_reason();
}

TEST_F(StandInNvml, TheWatchKeepsTheCountsBeforeAndAfterTheContextAndTheLargestSince) {
  FakeNvml fake;
  fake.set_used(1 * gib);
  cl::DriverMemoryWatch watch(cl::DriverMemory::from_nvml(FAKE_NVML, gpu_address), std::chrono::milliseconds(5));
  EXPECT_EQ(watch.used_before_context_bytes(), 1 * gib);
  EXPECT_FALSE(watch.used_after_context_bytes().has_value()) << "no context made yet";
  EXPECT_FALSE(watch.peak_used_bytes().has_value()) << "nothing sampled before the context";
  fake.set_used(2 * gib);  // the context's own memory
  watch.context_made();
  EXPECT_EQ(watch.used_after_context_bytes(), 2 * gib);
  EXPECT_EQ(watch.peak_used_bytes(), 2 * gib);
  fake.set_used(6 * gib);  // for a while, then freed: only the sampling thread sees it
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  fake.set_used(3 * gib);
  EXPECT_EQ(watch.peak_used_bytes(), 6 * gib);
  fake.set_used(7 * gib);  // read by the call itself
  EXPECT_EQ(watch.peak_used_bytes(), 7 * gib);
  EXPECT_EQ(watch.used_before_context_bytes(), 1 * gib);
}

TEST(DriverMemoryWatch, ReadsNothingFromASourceWithoutACount) {
  cl::DriverMemoryWatch watch(cl::DriverMemory("a test's reason"));
  watch.context_made();
  EXPECT_FALSE(watch.used_before_context_bytes().has_value());
  EXPECT_FALSE(watch.used_after_context_bytes().has_value());
  EXPECT_FALSE(watch.peak_used_bytes().has_value());
  EXPECT_EQ(watch.source().unavailable_reason(), "a test's reason");
}

// A Trainer's budget against what the driver counts free (detail::budget_within_free_memory).
TEST_F(StandInNvml, ABudgetMustFitWhatTheDriverCountsFree) {
  FakeNvml fake;
  const cl::DeviceInfo device = cl::select_device();  // its size for the default budget; no context needed
  const std::uint64_t mib = std::uint64_t{1} << 20, free = 100 * mib;
  const cl::DriverMemory count = cl::DriverMemory::from_nvml(FAKE_NVML, gpu_address);
  // Others hold all but 100 MiB of the stand-in's 80 GiB, less the 512 MiB its driver reserves
  // (NVML's free figure, not total - used: that would take the reserve for free memory).
  fake.set_used(80 * gib - 512 * mib - free);
  try {
    detail::budget_within_free_memory(gib, count, device, false);
    ADD_FAILURE() << "a budget above the free memory was taken";
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("device budget 1.0 GiB is more than the driver (nvml) counts 100.0 MiB free"), std::string::npos)
        << m;
    EXPECT_NE(m.find("(79.4 GiB of its 80.0 GiB in use, by this process and others; 512.0 MiB reserved by the driver)"),
              std::string::npos)
        << m;
  }
  EXPECT_EQ(detail::budget_within_free_memory(64 * mib, count, device, false), 64 * mib);
  // No budget: the free memory less its headroom (half of it, below 512 MiB), where the device's
  // own less headroom would not fit.
  ASSERT_GT(detail::resolve_device_budget(0, device), free);
  EXPECT_EQ(detail::budget_within_free_memory(0, count, device, false), free / 2);
  EXPECT_THROW(detail::budget_within_free_memory(0, count, device, true), std::invalid_argument)
      << "a rank of a data-parallel run may not choose its own budget";

  fake.set_used(1 * gib);  // read again: the count now, not an earlier one
  ASSERT_GT(79 * gib, detail::resolve_device_budget(0, device));
  EXPECT_EQ(detail::budget_within_free_memory(0, count, device, true), 0u) << "the device's own default stands";
  EXPECT_EQ(detail::budget_within_free_memory(0, cl::DriverMemory("no count"), device, false), 0u);
  EXPECT_EQ(detail::budget_within_free_memory(100 * gib, cl::DriverMemory("no count"), device, false), 100 * gib)
      << "without a count the budget is as given (the device's own size is checked elsewhere)";
}

// The budget a Trainer made now would plan in, through a Runtime whose driver counts (the stand-in
// named as a user names a library and a GPU): ferry::trainer_budget_now, which ferry plan reports.
TEST_F(StandInNvml, TheTrainersBudgetIsTheRuntimesCountNow) {
  FakeNvml fake;
  const ScopedEnv library("FERRY_NVML_LIBRARY", FAKE_NVML);
  const ScopedEnv gpu("FERRY_NVML_GPU", gpu_address);
  const std::uint64_t mib = std::uint64_t{1} << 20;
  fake.set_used(1 * gib);
  Runtime runtime;
  ASSERT_TRUE(runtime.driver_memory().source().available()) << runtime.driver_memory().source().unavailable_reason();
  TrainerOptions options;
  fake.set_used(80 * gib - 612 * mib);  // others took all but 100 MiB (and the reserve) after the runtime was made
  TrainerBudget taken = trainer_budget_now(runtime, options);
  EXPECT_EQ(taken.budget_bytes, 50 * mib) << "the free memory less its headroom";
  EXPECT_TRUE(taken.from_free_memory);
  options.residency.budget_bytes = 64 * mib;
  taken = trainer_budget_now(runtime, options);
  EXPECT_EQ(taken.budget_bytes, 64 * mib);
  EXPECT_FALSE(taken.from_free_memory);
  options.residency.budget_bytes = gib;
  EXPECT_THROW(trainer_budget_now(runtime, options), std::invalid_argument);
  fake.set_used(1 * gib);  // freed again: the device's own default stands
  options.residency.budget_bytes = 0;
  taken = trainer_budget_now(runtime, options);
  EXPECT_EQ(taken.budget_bytes, 0u);
  EXPECT_FALSE(taken.from_free_memory);
}

TEST(DriverMemory, TheRuntimesDeviceSaysWhetherItsDriverCounts) {
  Runtime runtime;
  const cl::DriverMemoryWatch& watch = runtime.driver_memory();
  const cl::DeviceInfo& d = runtime.device();
  if (d.is_cpu() || d.host_unified_memory || d.is_simulator()) {
    // PoCL and Oclgrind: the memory is the host's, and the reason says so.
    EXPECT_FALSE(watch.source().available());
    EXPECT_FALSE(watch.peak_used_bytes().has_value());
    EXPECT_NE(watch.source().unavailable_reason(), "");
  } else if (watch.source().available()) {
    // A GPU whose driver counts (the GPU session's kit): the context took some memory.
    EXPECT_GE(*watch.peak_used_bytes(), *watch.used_after_context_bytes());
    EXPECT_GE(*watch.used_after_context_bytes(), watch.used_before_context_bytes().value_or(0));
  } else {
    EXPECT_NE(watch.source().unavailable_reason(), "");
  }
  Runtime unwatched(RuntimeOptions{.watch_driver_memory = false});
  EXPECT_FALSE(unwatched.driver_memory().source().available());
  EXPECT_NE(unwatched.driver_memory().source().unavailable_reason().find("watch_driver_memory is off"),
            std::string::npos);
}

}  // namespace
}  // namespace ferry::test
