// Shared helpers for op tests: one device per test binary, host<->device tensors, random data,
// and a double-precision finite-difference check of CPU reference backward rules.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "ferry/cl/context.hpp"
#include "ferry/cl/program.hpp"
#include "ferry/ops/launch.hpp"

namespace ferry::test {

// The device every test in this binary uses (FERRY_DEVICE selects it, as for the CLI).
struct TestDevice {
  cl::Context context;
  cl::KernelLibrary kernels;
  ops::OpEnv env;
  TestDevice() : context(select()), kernels(context), env{kernels} {}
  // Tests never tune the GEMM on first use unless they ask (FERRY_TUNE set): a tuning file a test
  // writes with generic rows must mean those rows, also when the binary runs outside ctest.
  static cl::DeviceInfo select() {
    setenv("FERRY_TUNE", "off", 0);
    return cl::select_device();
  }
  static TestDevice& get() {
    static auto* device = new TestDevice();  // leaked on purpose: outlives all static test state
    return *device;
  }
};

// Sets an environment variable for a scope, then restores what it was (or unsets it):
// tests/oclgrind's packed run sets FERRY_GEMM_TUNING for the whole binary.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// A file of the given text in the temporary folder ("ferry-test-<pid>-<name>"), removed when the
// scope ends: a test that fails, skips or continues part way leaves nothing behind.
class ScopedTempFile {
 public:
  ScopedTempFile(const std::string& name, const std::string& text)
      : path_((std::filesystem::temp_directory_path() / ("ferry-test-" + std::to_string(::getpid()) + "-" + name))
                  .string()) {
    std::ofstream(path_) << text;
  }
  ~ScopedTempFile() {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }
  ScopedTempFile(const ScopedTempFile&) = delete;
  ScopedTempFile& operator=(const ScopedTempFile&) = delete;
  const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
};

// Small shapes only: tests/oclgrind/run_test.sh sets FERRY_TEST_SMALL=1, since Oclgrind simulates
// every work-item and a case of a few million multiply-adds takes it seconds to minutes. Op tests
// skip their cases whose work (multiply-adds, or elements for elementwise kernels) is above
// small_work_limit() then, so that each binary's small cases run there in about a minute.
inline bool small_shapes_only() {
  const char* v = std::getenv("FERRY_TEST_SMALL");
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}
inline constexpr std::size_t small_work_limit() {
  return 400000;
}
// True when a case of `work` should be skipped in this run.
inline bool too_large_for_this_run(std::size_t work) {
  return small_shapes_only() && work > small_work_limit();
}

// The name of a parameterised case from its values: each prefixed, joined by '_' (values (64, 1000,
// 0) with prefixes {"r", "c", "g"}: "r64_c1000_g0"), so that filters (the Oclgrind entries of
// tests/CMakeLists.txt) name cases by what they are rather than by their position.
template <class... T>
std::string case_name(const std::tuple<T...>& values, const std::array<const char*, sizeof...(T)>& prefixes) {
  std::string out;
  std::size_t i = 0;
  const auto add = [&](const auto& v) {
    if (i > 0) out += '_';
    out += prefixes[i++];
    out += std::to_string(v);
  };
  std::apply([&](const auto&... v) { (add(v), ...); }, values);
  return out;
}

// A float buffer on the test device, optionally placed at a nonzero element offset to check
// that kernels honour operand offsets.
class DeviceTensor {
 public:
  explicit DeviceTensor(std::size_t n, std::uint64_t offset = 7) : n_(n), offset_(offset) {
    auto& dev = TestDevice::get();
    mem_ = dev.context.create_buffer((n + offset) * sizeof(float), "test tensor");
    std::vector<float> poison(n + offset, std::nanf(""));
    dev.context.write(mem_.get(), 0, poison.data(), poison.size() * sizeof(float));
  }
  explicit DeviceTensor(const std::vector<float>& values, std::uint64_t offset = 7)
      : DeviceTensor(values.size(), offset) {
    upload(values);
  }
  void upload(const std::vector<float>& values) {
    TestDevice::get().context.write(mem_.get(), offset_ * sizeof(float), values.data(), values.size() * sizeof(float));
  }
  std::vector<float> download() const {
    std::vector<float> out(n_);
    TestDevice::get().context.read(mem_.get(), offset_ * sizeof(float), out.data(), n_ * sizeof(float));
    return out;
  }
  ops::DeviceSpan span() const { return {mem_.get(), offset_ * sizeof(float)}; }
  std::size_t size() const { return n_; }

 private:
  std::size_t n_;
  std::uint64_t offset_;
  cl::Mem mem_;
};

// A device buffer of raw storage placed `offset_elems` elements into its cl_mem (so kernels must
// honour operand offsets), poisoned around and under the data.
class DeviceBytes {
 public:
  DeviceBytes(std::size_t n, std::size_t elem_bytes, std::size_t offset_elems = 7)
      : n_(n), elem_(elem_bytes), offset_(offset_elems * elem_bytes) {
    auto& dev = TestDevice::get();
    const std::size_t total = offset_ + (n + 5) * elem_;
    mem_ = dev.context.create_buffer(total, "dtype test tensor");
    std::vector<unsigned char> poison(total, 0xA5);
    dev.context.write(mem_.get(), 0, poison.data(), total);
  }
  template <class T>
  static DeviceBytes from(const std::vector<T>& v, std::size_t offset_elems = 7) {
    DeviceBytes d(v.size(), sizeof(T), offset_elems);
    d.upload(v);
    return d;
  }
  template <class T>
  void upload(const std::vector<T>& v) {
    ASSERT_EQ(sizeof(T), elem_);
    TestDevice::get().context.write(mem_.get(), offset_, v.data(), v.size() * sizeof(T));
  }
  template <class T>
  std::vector<T> download() const {
    EXPECT_EQ(sizeof(T), elem_);
    std::vector<T> out(n_);
    TestDevice::get().context.read(mem_.get(), offset_, out.data(), n_ * sizeof(T));
    return out;
  }
  // The bytes just past the data: still poison unless a kernel wrote out of range.
  std::vector<unsigned char> tail() const {
    std::vector<unsigned char> out(5 * elem_);
    TestDevice::get().context.read(mem_.get(), offset_ + n_ * elem_, out.data(), out.size());
    return out;
  }
  ops::DeviceSpan span() const { return {mem_.get(), offset_}; }

 private:
  std::size_t n_, elem_, offset_;
  cl::Mem mem_;
};

// Class labels in [0, classes), seeded.
inline std::vector<std::int32_t> labels_for(std::size_t n, std::uint32_t seed, std::uint32_t classes = 10) {
  std::mt19937 rng(seed);
  std::vector<std::int32_t> l(n);
  for (auto& v : l) v = static_cast<std::int32_t>(rng() % classes);
  return l;
}

// Whether two float vectors hold the same bits (NaNs and signed zeros included).
inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline std::vector<float> random_vector(std::size_t n, std::uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

inline std::vector<double> to_double(const std::vector<float>& v) {
  return {v.begin(), v.end()};
}
inline std::vector<float> to_float(const std::vector<double>& v) {
  return {v.begin(), v.end()};
}

// Asserts |a - b| <= atol + rtol * |b| elementwise, reporting the first few mismatches.
inline void expect_near(const std::vector<float>& actual, const std::vector<float>& expected, float atol, float rtol,
                        const char* what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  int reported = 0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const float tol = atol + rtol * std::abs(expected[i]);
    if (!(std::abs(actual[i] - expected[i]) <= tol)) {  // also catches NaN
      ADD_FAILURE() << what << "[" << i << "]: got " << actual[i] << ", expected " << expected[i];
      if (++reported == 5) return;
    }
  }
}

// Checks a backward rule against central finite differences in double precision.
// `loss(x)` is a scalar function of the flat input (usually sum(r * forward(x)) for random r);
// `grad` is the analytic gradient at x. Checks every element up to `max_checks`, spread evenly.
inline void expect_gradient_matches_finite_differences(const std::function<double(const std::vector<double>&)>& loss,
                                                       std::vector<double> x, const std::vector<double>& grad,
                                                       const char* what, double eps = 1e-6, double tol = 1e-5,
                                                       std::size_t max_checks = 64) {
  ASSERT_EQ(x.size(), grad.size()) << what;
  const std::size_t stride = std::max<std::size_t>(1, x.size() / max_checks);
  for (std::size_t i = 0; i < x.size(); i += stride) {
    const double saved = x[i];
    x[i] = saved + eps;
    const double up = loss(x);
    x[i] = saved - eps;
    const double down = loss(x);
    x[i] = saved;
    const double numeric = (up - down) / (2 * eps);
    EXPECT_NEAR(grad[i], numeric, tol * std::max(1.0, std::abs(numeric))) << what << " element " << i;
  }
}

// Forces the local size of the per-row reductions while alive (0: the device default, which is a
// work-item per row on CPUs), so the work-group tree path that GPUs take is tested here too.
class ScopedRowGroupSize {
 public:
  explicit ScopedRowGroupSize(std::size_t size) {
    if (size != 0) setenv("FERRY_ROW_GROUP_SIZE", std::to_string(size).c_str(), 1);
  }
  ~ScopedRowGroupSize() { unsetenv("FERRY_ROW_GROUP_SIZE"); }
  ScopedRowGroupSize(const ScopedRowGroupSize&) = delete;
  ScopedRowGroupSize& operator=(const ScopedRowGroupSize&) = delete;
};

// Gives staged host memory's chunked fetches a filler thread while alive (FERRY_FETCH_FILLER=1,
// read when a step is compiled; offload::FetchRing::Filling), or leaves them inline.
class ScopedFetchFiller {
 public:
  explicit ScopedFetchFiller(bool on) {
    if (on) setenv("FERRY_FETCH_FILLER", "1", 1);
  }
  ~ScopedFetchFiller() { unsetenv("FERRY_FETCH_FILLER"); }
  ScopedFetchFiller(const ScopedFetchFiller&) = delete;
  ScopedFetchFiller& operator=(const ScopedFetchFiller&) = delete;
};

// sum_i r_i * y_i: a scalar loss whose gradient with respect to y is r.
inline double weighted_sum(const std::vector<double>& y, const std::vector<double>& r) {
  double s = 0;
  for (std::size_t i = 0; i < y.size(); ++i) s += y[i] * r[i];
  return s;
}

// Runs `f` on another thread and gives it 60 s: what is tested must never hang the caller. A hang ends
// the test binary at once (the thread cannot be cancelled), naming what hung. The bound is far
// above a step's time here (milliseconds) so that a sanitizer build on a loaded 2-core CI machine,
// which may also compile kernels inside `f`, cannot trip it; a hang never ends, so it still does.
template <class F>
auto within_deadline(const char* what, F f) {
  auto result = std::async(std::launch::async, std::move(f));
  if (result.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    std::fprintf(stderr, "FAILED: %s did not return within 60 s\n", what);
    std::fflush(stderr);
    std::_Exit(1);
  }
  return result.get();
}

}  // namespace ferry::test
