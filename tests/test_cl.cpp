// cl/ contracts: device selection (names, aliases, the default choice, the error when the ICD
// loader finds nothing), OpenCL errors that name the call, the error and the op,
// the on-disk program cache (hits, disabling, corrupt entries), build failures with their log, and
// the object handles' reference counts, and a CPU device's large buffers in huge pages.
#include <fmt/format.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>
#include <vector>

#include "ferry/cl/context.hpp"
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

TEST(Devices, PoclAliasSelectsThePoclDevice) {
  const auto devices = cl::list_devices();
  const auto pocl = std::find_if(devices.begin(), devices.end(),
                                 [](const auto& d) { return d.platform_name == "Portable Computing Language"; });
  if (pocl == devices.end()) GTEST_SKIP() << "no PoCL device here";
  for (const char* name : {"pocl", "POCL", "PoCL", "portable computing", "the pocl project"}) {
    ::setenv("FERRY_DEVICE", name, 1);
    const auto chosen = cl::select_device();
    EXPECT_EQ(chosen.platform_name, "Portable Computing Language") << name;
    EXPECT_EQ(chosen.platform, pocl->platform) << name;
  }
  ::unsetenv("FERRY_DEVICE");
  EXPECT_EQ(cl::select_device("pocl").platform, pocl->platform);
}

TEST(Devices, UnknownNameListsTheDevicesSeen) {
  const auto devices = cl::list_devices();
  ASSERT_FALSE(devices.empty());
  ::setenv("FERRY_DEVICE", "no-such-device-anywhere", 1);
  try {
    cl::select_device();
    ADD_FAILURE() << "expected an error";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'no-such-device-anywhere' (from FERRY_DEVICE)"), std::string::npos) << what;
    for (const auto& d : devices) {
      EXPECT_NE(what.find(fmt::format("[{}] {} / {}", d.index, d.platform_name, d.name)), std::string::npos) << what;
    }
    EXPECT_NE(what.find("pocl, nvidia, intel, amd, oclgrind"), std::string::npos) << what;
  }
  ::unsetenv("FERRY_DEVICE");
}

constexpr cl_device_type all_types = CL_DEVICE_TYPE_CPU | CL_DEVICE_TYPE_GPU | CL_DEVICE_TYPE_ACCELERATOR;
const cl::DeviceFacts oclgrind{"Oclgrind", "University of Bristol", "Oclgrind Simulator", "University of Bristol",
                               all_types};
const cl::DeviceFacts pocl_cpu{"Portable Computing Language", "The pocl project", "pthread-haswell-Intel(R) Core",
                               "GenuineIntel", CL_DEVICE_TYPE_CPU};
const cl::DeviceFacts nvidia_gpu{"NVIDIA CUDA", "NVIDIA Corporation", "NVIDIA GeForce RTX 4090", "NVIDIA Corporation",
                                 CL_DEVICE_TYPE_GPU};
const cl::DeviceFacts amd_gpu{"AMD Accelerated Parallel Processing", "Advanced Micro Devices, Inc.", "gfx1100",
                              "Advanced Micro Devices, Inc.", CL_DEVICE_TYPE_GPU | CL_DEVICE_TYPE_DEFAULT};
const cl::DeviceFacts fpga{"Intel(R) FPGA Emulation Platform", "Intel(R) Corporation", "Intel(R) FPGA Emulation Device",
                           "Intel(R) Corporation", CL_DEVICE_TYPE_ACCELERATOR};

TEST(Devices, DefaultChoicePrefersGpusThenCpusAndNeverASimulator) {
  using Facts = std::vector<cl::DeviceFacts>;
  EXPECT_TRUE(cl::is_simulator(oclgrind));
  EXPECT_FALSE(cl::is_simulator(pocl_cpu));
  EXPECT_FALSE(cl::is_simulator(nvidia_gpu));
  // A device claiming to be CPU, GPU and accelerator at once is a simulator whatever its name.
  EXPECT_TRUE(cl::is_simulator({"Some Platform", "Someone", "dev", "Someone", all_types}));
  EXPECT_EQ(cl::default_device_index(Facts{oclgrind, pocl_cpu, nvidia_gpu}), 2u);
  EXPECT_EQ(cl::default_device_index(Facts{oclgrind, pocl_cpu}), 1u);             // Oclgrind also says "GPU"
  EXPECT_EQ(cl::default_device_index(Facts{pocl_cpu, amd_gpu, nvidia_gpu}), 1u);  // the first GPU
  EXPECT_EQ(cl::default_device_index(Facts{fpga, pocl_cpu}), 0u);                 // CPUs and accelerators rank alike
  EXPECT_EQ(cl::default_device_index(Facts{oclgrind}), std::nullopt);
  EXPECT_EQ(cl::default_device_index(Facts{}), std::nullopt);
}

TEST(Devices, NamesAndAliasesMatchPlatformVendorAndDevice) {
  EXPECT_TRUE(cl::matches_selector(pocl_cpu, "pocl"));
  EXPECT_TRUE(cl::matches_selector(pocl_cpu, "PORTABLE"));
  EXPECT_TRUE(cl::matches_selector(pocl_cpu, "haswell"));
  EXPECT_TRUE(cl::matches_selector(pocl_cpu, "genuineintel"));
  EXPECT_TRUE(cl::matches_selector(pocl_cpu, "Portable Computing Language pthread"));
  EXPECT_FALSE(cl::matches_selector(pocl_cpu, "nvidia"));
  EXPECT_FALSE(cl::matches_selector(pocl_cpu, "oclgrind"));
  EXPECT_FALSE(cl::matches_selector(pocl_cpu, ""));
  EXPECT_TRUE(cl::matches_selector(nvidia_gpu, "NVIDIA"));
  EXPECT_TRUE(cl::matches_selector(nvidia_gpu, "rtx"));
  EXPECT_TRUE(cl::matches_selector(amd_gpu, "amd"));
  EXPECT_TRUE(cl::matches_selector(amd_gpu, "gfx11"));
  EXPECT_TRUE(cl::matches_selector(
      {"Some Platform", "Advanced Micro Devices, Inc.", "gfx90a", "Advanced Micro Devices, Inc.", CL_DEVICE_TYPE_GPU},
      "amd"));  // the alias: AMD's vendor string does not say "amd"
  EXPECT_TRUE(cl::matches_selector(fpga, "intel"));
  EXPECT_TRUE(cl::matches_selector(oclgrind, "oclgrind"));
  EXPECT_TRUE(cl::matches_selector(oclgrind, "bristol"));
}

// An ICD folder holding one .icd file that names a library that does not exist.
std::filesystem::path broken_icd_folder() {
  auto dir = fresh_dir("icd");
  std::ofstream(dir / "broken-vendor.icd") << "libferry-no-such-opencl-driver.so\n";
  return dir;
}

TEST(Devices, NoDeviceErrorNamesTheIcdsThatFailedToLoad) {
  const auto dir = broken_icd_folder();
  // Only the registration is read here: the loader of this process is not involved.
  ::setenv("OCL_ICD_VENDORS", dir.c_str(), 1);
  auto icds = cl::registered_icds();
  ASSERT_EQ(icds.size(), 1u);
  EXPECT_EQ(icds[0].source, (dir / "broken-vendor.icd").string());
  EXPECT_EQ(icds[0].library, "libferry-no-such-opencl-driver.so");
  cl::diagnose_icds(icds);
  EXPECT_NE(icds[0].load_problem.find("failed to load"), std::string::npos) << icds[0].load_problem;
  const std::string what = cl::no_device_message(icds);
  ::unsetenv("OCL_ICD_VENDORS");
  for (const std::string& part :
       {(dir / "broken-vendor.icd").string(), std::string("libferry-no-such-opencl-driver.so"),
        std::string("failed to load"), std::string("OCL_ICD_DEBUG=7"), std::string("clinfo")}) {
    EXPECT_NE(what.find(part), std::string::npos) << part << " in: " << what;
  }
  EXPECT_EQ(what.find("apt-get install"), std::string::npos) << "drivers are registered: " << what;
  // With nothing registered, the advice is to install a driver.
  EXPECT_NE(cl::no_device_message({}).find("apt-get install pocl-opencl-icd"), std::string::npos);
  std::filesystem::remove_all(dir);
}

// Run only in a child process (below), whose ICD loader starts with the environment it is given.
TEST(Devices, DISABLED_SelectDeviceInThisProcess) {
  try {
    const auto d = cl::select_device();
    std::cout << "SELECTED " << d.platform_name << "\n";
  } catch (const std::exception& e) {
    std::cout << "SELECT ERROR: " << e.what() << "\n";
  }
}

// The output of this test binary running DISABLED_SelectDeviceInThisProcess with OCL_ICD_VENDORS=dir.
std::string select_in_child(const std::filesystem::path& dir) {
  const auto self = std::filesystem::read_symlink("/proc/self/exe");
  const std::string command = fmt::format(
      "env -u FERRY_DEVICE -u OCL_ICD_FILENAMES OCL_ICD_VENDORS='{}' '{}' "
      "--gtest_filter=Devices.DISABLED_SelectDeviceInThisProcess --gtest_also_run_disabled_tests 2>&1",
      dir.string(), self.string());
  std::string out;
  if (FILE* pipe = ::popen(command.c_str(), "r")) {
    std::array<char, 4096> buf{};
    while (std::size_t n = std::fread(buf.data(), 1, buf.size(), pipe)) out.append(buf.data(), n);
    ::pclose(pipe);
  }
  return out;
}

TEST(Devices, NoDeviceInAFreshProcessNamesTheBrokenIcd) {
  const auto dir = broken_icd_folder();
  const std::string out = select_in_child(dir);
  EXPECT_NE(out.find("SELECT ERROR: no OpenCL device found"), std::string::npos) << out;
  EXPECT_NE(out.find((dir / "broken-vendor.icd").string()), std::string::npos) << out;
  EXPECT_NE(out.find("failed to load"), std::string::npos) << out;
  EXPECT_NE(out.find("OCL_ICD_DEBUG=7"), std::string::npos) << out;
  std::filesystem::remove_all(dir);

  const auto empty = fresh_dir("no-icd");
  const std::string none = select_in_child(empty);
  EXPECT_NE(none.find("no OpenCL driver is registered"), std::string::npos) << none;
  EXPECT_NE(none.find("apt-get install pocl-opencl-icd"), std::string::npos) << none;
  std::filesystem::remove_all(empty);
}

cl_uint reference_count(cl_event e) {
  cl_uint count = 0;
  FERRY_CL(clGetEventInfo(e, CL_EVENT_REFERENCE_COUNT, sizeof count, &count, nullptr));
  return count;
}

// The count once the driver has let go of its own reference: a driver may hold one until a little
// after the command completes (PoCL drops it on a thread of its own, after clFinish has returned).
// Waits at most a second for the count to fall to `expected`.
cl_uint settled_reference_count(cl_event e, cl_uint expected) {
  for (int i = 0; i < 1000 && reference_count(e) > expected; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return reference_count(e);
}

// A handle reused for a new object (the commit gate's guard read, step after step) drops the one it
// held: before, each step's read event stayed referenced forever.
TEST(Handles, OutDropsTheObjectTheHandleHeld) {
  auto& dev = TestDevice::get();
  const cl_command_queue q = dev.context.compute();
  cl::Event reused;
  FERRY_CL(clEnqueueMarkerWithWaitList(q, 0, nullptr, reused.out()));
  FERRY_CL(clFinish(q));
  const cl::Event first = cl::Event::retain(reused.get());
  ASSERT_EQ(settled_reference_count(first.get(), 2u), 2u);  // the handle's and ours
  FERRY_CL(clEnqueueMarkerWithWaitList(q, 0, nullptr, reused.out()));
  FERRY_CL(clFinish(q));
  EXPECT_NE(reused.get(), first.get());
  EXPECT_EQ(settled_reference_count(first.get(), 1u), 1u) << "the reused handle still holds its first event";
  EXPECT_EQ(settled_reference_count(reused.get(), 1u), 1u);
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

// The mapping of this process that holds `p`, as /proc/self/smaps lists it: its header line and
// fields ("THPeligible:  1", "VmFlags: rd wr ...", ...); empty where no mapping holds `p`.
std::string smaps_entry_holding(const void* p) {
  std::ifstream in("/proc/self/smaps");
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  std::string line, entry;
  bool holding = false;
  while (std::getline(in, line)) {
    std::uintptr_t lo = 0, hi = 0;
    // A header starts "lo-hi perms ...": hex digits then a dash; field lines start "Name:".
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find('-') < line.find(' ')) {
      if (holding) return entry;
      holding = lo <= at && at < hi;
      entry.clear();
    }
    if (holding) entry += line + "\n";
  }
  return holding ? entry : std::string();
}

bool thp_enabled_is_never() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  return !std::getline(in, line) || line.find("[never]") != std::string::npos;
}

template <class T>
T mem_info(cl_mem m, cl_mem_info what) {
  T v{};
  EXPECT_EQ(clGetMemObjectInfo(m, what, sizeof v, &v, nullptr), CL_SUCCESS);
  return v;
}

TEST(Buffers, LargeOnesOfACpuDeviceLiveInHugePagesTheyOwn) {
  auto& dev = TestDevice::get();
  if (!dev.context.device().is_cpu()) GTEST_SKIP() << "huge-page buffers are a CPU device's";
  if (thp_enabled_is_never()) {
    EXPECT_FALSE(dev.context.huge_page_buffers());
    GTEST_SKIP() << "this kernel's transparent huge pages are off";
  }
  ASSERT_TRUE(dev.context.huge_page_buffers()) << "FERRY_HUGE_PAGES=off in the environment?";
  const std::size_t bytes = (std::size_t{5} << 20) + 100;  // a tail that is no whole page
  const void* block = nullptr;
  {
    cl::Mem big = dev.context.create_buffer(bytes, "a large buffer");
    ASSERT_TRUE(mem_info<cl_mem_flags>(big.get(), CL_MEM_FLAGS) & CL_MEM_USE_HOST_PTR);
    block = mem_info<void*>(big.get(), CL_MEM_HOST_PTR);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(block) % (std::size_t{2} << 20), 0u);
    // Advised (VmFlags "hg") and eligible as the kernel reads it.
    const std::string entry = smaps_entry_holding(block);
    const std::size_t flags = entry.find("VmFlags:");
    ASSERT_NE(flags, std::string::npos) << entry;
    EXPECT_NE(entry.find(" hg", flags), std::string::npos) << entry;
    const std::size_t eligible = entry.find("THPeligible:");
    ASSERT_NE(eligible, std::string::npos) << entry;
    EXPECT_EQ(std::atoi(entry.c_str() + eligible + 12), 1) << entry;
    // The buffer works as any other, to its last byte.
    std::vector<unsigned char> in(bytes), out(bytes);
    for (std::size_t i = 0; i < bytes; ++i) in[i] = static_cast<unsigned char>(i * 7 + 3);
    dev.context.write(big.get(), 0, in.data(), bytes);
    dev.context.read(big.get(), 0, out.data(), bytes);
    EXPECT_EQ(in, out);
    // A small one keeps the driver's own memory.
    cl::Mem small = dev.context.create_buffer(std::size_t{1} << 20, "a small buffer");
    EXPECT_FALSE(mem_info<cl_mem_flags>(small.get(), CL_MEM_FLAGS) & CL_MEM_USE_HOST_PTR);
  }
  // Released with its buffer: the mapping is gone (the driver may release a moment later).
  std::string entry = smaps_entry_holding(block);
  for (int i = 0; i < 100 && !entry.empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    entry = smaps_entry_holding(block);
  }
  EXPECT_EQ(entry, "") << "the huge-page block outlived its buffer";
  // Turned off, large buffers are the driver's too.
  cl::Context plain(dev.context.device(), cl::ContextOptions{.huge_pages = false});
  EXPECT_FALSE(plain.huge_page_buffers());
  cl::Mem big = plain.create_buffer(bytes, "a large buffer");
  EXPECT_FALSE(mem_info<cl_mem_flags>(big.get(), CL_MEM_FLAGS) & CL_MEM_USE_HOST_PTR);
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

// Programs build on the threads that ask for them: one build per (file, options) however many
// threads ask at once, every one of them given the same program; different programs each built
// once; a failed build's error reaches every thread that waited for it, and a later request
// builds it again (the failure is not remembered as a program).
TEST(ProgramBuild, ConcurrentRequestsBuildEachProgramOnce) {
  auto& ctx = TestDevice::get().context;
  cl::KernelLibrary lib(ctx, cl::ProgramCacheOptions{false, {}});
  constexpr int threads = 8;
  std::array<cl_program, threads> same{};
  std::array<cl_program, threads> own{};
  {
    std::vector<std::thread> pool;
    for (int i = 0; i < threads; ++i) {
      pool.emplace_back([&, i] {
        same[i] = lib.program("activation", "-DSHARED=1");
        own[i] = lib.program("activation", fmt::format("-DOWN={}", i));
      });
    }
    for (auto& t : pool) t.join();
  }
  for (int i = 0; i < threads; ++i) {
    EXPECT_EQ(same[i], same[0]) << "thread " << i;
    for (int j = 0; j < i; ++j) EXPECT_NE(own[i], own[j]) << "threads " << i << " and " << j;
  }
  EXPECT_EQ(lib.stats().source_builds, 1u + threads);
  EXPECT_EQ(lib.stats().memory_hits, threads - 1u);

  const char* broken = "__kernel void broken(__global float* x) { x[0] = not_declared_here; }";
  std::atomic<int> errors{0};
  {
    std::vector<std::thread> pool;
    for (int i = 0; i < threads; ++i) {
      pool.emplace_back([&] {
        try {
          lib.program_from_source("broken_kernels", broken);
        } catch (const cl::Error& e) {
          if (std::string(e.what()).find("not_declared_here") != std::string::npos) ++errors;
        }
      });
    }
    for (auto& t : pool) t.join();
  }
  EXPECT_EQ(errors.load(), threads);
  EXPECT_THROW(lib.program_from_source("broken_kernels", broken), cl::Error);
  EXPECT_EQ(lib.stats().source_builds, 1u + threads);  // failed builds are not counted as built
}

TEST(ProgramBuild, BuildThreadsComeFromTheEnvironment) {
  {
    ScopedEnv three("FERRY_BUILD_THREADS", "3");
    EXPECT_EQ(cl::build_threads(), 3u);
  }
  {
    ScopedEnv unset("FERRY_BUILD_THREADS", "");  // empty: the default
    EXPECT_GE(cl::build_threads(), 1u);
    EXPECT_LE(cl::build_threads(), 8u);
  }
  {
    // A simulator builds one at a time, whatever is asked: Oclgrind's concurrent builds corrupt its
    // heap. Other devices get what the environment says.
    ScopedEnv three("FERRY_BUILD_THREADS", "3");
    cl::DeviceInfo oclgrind;
    oclgrind.platform_name = "Oclgrind";
    oclgrind.name = "Oclgrind Simulator";
    oclgrind.type = CL_DEVICE_TYPE_CPU | CL_DEVICE_TYPE_GPU | CL_DEVICE_TYPE_ACCELERATOR;
    EXPECT_EQ(cl::build_threads(oclgrind), 1u);
    cl::DeviceInfo gpu;
    gpu.platform_name = "NVIDIA CUDA";
    gpu.name = "NVIDIA H200";
    gpu.type = CL_DEVICE_TYPE_GPU;
    EXPECT_EQ(cl::build_threads(gpu), 3u);
    ScopedEnv bad("FERRY_BUILD_THREADS", "two");
    EXPECT_THROW(cl::build_threads(oclgrind), std::invalid_argument) << "a bad value is an error on a simulator too";
  }
  for (const char* bad : {"0", "-2", "two", "4x", "100000"}) {
    ScopedEnv set("FERRY_BUILD_THREADS", bad);
    try {
      cl::build_threads();
      ADD_FAILURE() << "FERRY_BUILD_THREADS=" << bad << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("FERRY_BUILD_THREADS"), std::string::npos) << e.what();
    }
  }
}

// The switches read one way: the words for on and off, and a refusal for anything else (a misspelt
// "off" used to leave the program cache on, and FERRY_VERBOSE=off turned the warnings on).
TEST(ProgramBuild, SwitchVariablesTakeTheSameWordsAndRefuseOthers) {
  ScopedEnv dir("FERRY_CACHE_DIR", "/nonexistent/ferry-switch-test");  // from_env creates nothing
  for (const char* off : {"0", "off", "false", "no"}) {
    ScopedEnv set("FERRY_PROGRAM_CACHE", off);
    EXPECT_FALSE(cl::ProgramCacheOptions::from_env().enabled) << off;
  }
  for (const char* on : {"1", "on", "true", "yes", ""}) {
    ScopedEnv set("FERRY_PROGRAM_CACHE", on);
    EXPECT_TRUE(cl::ProgramCacheOptions::from_env().enabled) << "'" << on << "'";
  }
  for (const char* bad : {"of", "OFF", "2", " 0", "disabled"}) {
    ScopedEnv set("FERRY_PROGRAM_CACHE", bad);
    try {
      (void)cl::ProgramCacheOptions::from_env();
      ADD_FAILURE() << "FERRY_PROGRAM_CACHE=" << bad << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(fmt::format("FERRY_PROGRAM_CACHE='{}'", bad)), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("off/on"), std::string::npos) << e.what();
    }
  }
  // FERRY_VERBOSE is read where a program is built: a bad word fails the build, naming it.
  cl::KernelLibrary lib(TestDevice::get().context, cl::ProgramCacheOptions{false, {}});
  const std::string source = "__kernel void switch_test(__global float* x) { x[0] = 1.0f; }\n";
  {
    ScopedEnv set("FERRY_VERBOSE", "off");
    EXPECT_NO_THROW(lib.program_from_source("switch_test_off", source));
  }
  ScopedEnv set("FERRY_VERBOSE", "loud");
  try {
    lib.program_from_source("switch_test_loud", source);
    ADD_FAILURE() << "FERRY_VERBOSE=loud was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("FERRY_VERBOSE='loud'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace ferry::test
