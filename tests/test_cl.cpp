// cl/ contracts: device selection, OpenCL errors that name the call, the error and the op,
// the on-disk program cache (hits, disabling, corrupt entries) and build failures with their log.
#include <fmt/format.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "ferry/cl/device.hpp"
#include "ferry/cl/error.hpp"
#include "ferry/cl/program.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

namespace fs = std::filesystem;

fs::path fresh_dir(const char* name) {
  fs::path dir = fs::temp_directory_path() / fmt::format("ferry-test-{}-{}", name, ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

TEST(Devices, SelectByIndexNameAndEnvironment) {
  const auto devices = cl::list_devices();
  ASSERT_FALSE(devices.empty());
  EXPECT_EQ(cl::select_device("0").id, devices[0].id);
  // A case-insensitive part of the name finds the same device.
  std::string part = devices[0].name.substr(0, 6);
  for (auto& c : part) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  EXPECT_EQ(cl::select_device(part).id, devices[0].id);
  ::setenv("FERRY_DEVICE", "0", 1);
  EXPECT_EQ(cl::select_device().id, devices[0].id);
  ::setenv("FERRY_DEVICE", "no-such-device", 1);
  try {
    cl::select_device();
    ADD_FAILURE() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("FERRY_DEVICE"), std::string::npos) << e.what();
  }
  ::unsetenv("FERRY_DEVICE");
  EXPECT_GT(devices[0].global_mem_bytes, 0u);
  EXPECT_GT(devices[0].max_alloc_bytes, 0u);
  EXPECT_GT(devices[0].compute_units, 0u);
}

TEST(Errors, NameTheCallTheErrorAndTheOp) {
  cl::OpScope scope("linear7");
  try {
    cl::check(CL_INVALID_KERNEL_ARGS, "clEnqueueNDRangeKernel");
    FAIL();
  } catch (const cl::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("linear7"), std::string::npos) << what;
    EXPECT_NE(what.find("clEnqueueNDRangeKernel"), std::string::npos) << what;
    EXPECT_NE(what.find("CL_INVALID_KERNEL_ARGS"), std::string::npos) << what;
    EXPECT_EQ(e.code(), CL_INVALID_KERNEL_ARGS);
  }
  // A real failing call: a buffer larger than the device allows is refused with its name.
  auto& dev = TestDevice::get();
  try {
    dev.context.create_buffer(dev.context.device().max_alloc_bytes + 1, "the huge one");
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("the huge one"), std::string::npos) << e.what();
  }
  EXPECT_STREQ(cl::error_name(CL_OUT_OF_RESOURCES), "CL_OUT_OF_RESOURCES");
}

TEST(ProgramCache, SecondLibraryLoadsBinariesFromDisk) {
  auto& ctx = TestDevice::get().context;
  cl::ProgramCacheOptions opt{true, fresh_dir("cache")};
  {
    cl::KernelLibrary first(ctx, opt);
    first.kernel("activation", "relu_forward");
    first.kernel("activation", "relu_forward");
    EXPECT_EQ(first.stats().source_builds, 1u);
    EXPECT_EQ(first.stats().memory_hits, 1u);
  }
  ASSERT_FALSE(fs::is_empty(opt.dir));
  cl::KernelLibrary second(ctx, opt);
  second.kernel("activation", "relu_forward");
  EXPECT_EQ(second.stats().disk_hits, 1u);
  EXPECT_EQ(second.stats().source_builds, 0u);
  // Other build options are another program, not a stale hit.
  second.kernel("activation", "relu_forward", "-DUNUSED=1");
  EXPECT_EQ(second.stats().source_builds, 1u);
  fs::remove_all(opt.dir);
}

TEST(ProgramCache, CorruptEntryIsRebuiltAndDisabledCacheWritesNothing) {
  auto& ctx = TestDevice::get().context;
  cl::ProgramCacheOptions opt{true, fresh_dir("corrupt")};
  { cl::KernelLibrary(ctx, opt).kernel("activation", "relu_forward"); }
  for (const auto& f : fs::directory_iterator(opt.dir)) {
    std::ofstream(f.path(), std::ios::binary | std::ios::trunc) << "not a program binary";
  }
  cl::KernelLibrary lib(ctx, opt);
  lib.kernel("activation", "relu_forward");  // must not throw
  EXPECT_EQ(lib.stats().corrupt_entries, 1u);
  EXPECT_EQ(lib.stats().source_builds, 1u);

  cl::ProgramCacheOptions off{false, fresh_dir("off")};
  cl::KernelLibrary uncached(ctx, off);
  uncached.kernel("activation", "relu_forward");
  EXPECT_TRUE(fs::is_empty(off.dir));
  fs::remove_all(opt.dir);
  fs::remove_all(off.dir);
}

TEST(ProgramBuild, FailureShowsTheBuildLog) {
  auto& ctx = TestDevice::get().context;
  cl::KernelLibrary lib(ctx, cl::ProgramCacheOptions{false, {}});
  const char* broken = "__kernel void broken(__global float* x) { x[0] = undeclared_thing; }";
  try {
    lib.program_from_source("my_kernels", broken);
    FAIL() << "a broken kernel must not build";
  } catch (const cl::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("my_kernels"), std::string::npos) << what;
    EXPECT_NE(what.find("build log"), std::string::npos) << what;
    EXPECT_NE(what.find("undeclared_thing"), std::string::npos) << what;  // the compiler's own message
  }
  EXPECT_THROW(lib.kernel("no_such_file", "k"), std::invalid_argument);
  EXPECT_THROW(lib.kernel("activation", "no_such_kernel"), cl::Error);
}

}  // namespace
}  // namespace ferry::test
