// The GEMM tuner: every candidate it may pick computes the right product (the GPU kernel's too,
// forced on this device), and first-use tuning, its cache, a damaged cache and FERRY_TUNE behave as
// gemm_tune.hpp says.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <optional>
#include <sstream>
#include <thread>
#include <tuple>

#include "ops/attention_tune.hpp"
#include "ops/gemm_tiled.hpp"
#include "ops/gemm_tune.hpp"
#include "ops/gemm_tune_cache.hpp"
#include "ops/tune_deadline.hpp"
#include "ops/tune_signals.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

std::filesystem::path temp_dir(const std::string& stem) {
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("ferry_{}_{}", stem, ::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// ops::gemm on `env` with `options` against the double-precision reference, alpha 1.5, beta 0.5;
// the operands at an odd element offset, or with `aligned` at one that float4 loads allow.
void expect_gemm_right(ops::OpEnv& env, const ops::GemmShape& s, const ops::GemmOptions& options,
                       const std::string& what, bool aligned = false) {
  const auto a = random_vector(s.M * s.K, 1), b = random_vector(s.K * s.N, 2), c0 = random_vector(s.M * s.N, 3);
  std::vector<double> want(s.M * s.N);
  for (std::size_t i = 0; i < s.M; ++i) {
    for (std::size_t j = 0; j < s.N; ++j) {
      double acc = 0;
      for (std::size_t k = 0; k < s.K; ++k) {
        acc += double(a[s.trans_a ? k * s.M + i : i * s.K + k]) * b[s.trans_b ? j * s.K + k : k * s.N + j];
      }
      want[i * s.N + j] = 1.5 * acc + 0.5 * c0[i * s.N + j];
    }
  }
  DeviceTensor da(a, aligned ? 8 : 7), db(b, aligned ? 4 : 7), dc(c0),
      scratch(std::max<std::size_t>(1, ops::gemm_scratch_elems(env, s, options)));
  const auto launches = ops::gemm(env, s, 1.5f, da.span(), db.span(), 0.5f, dc.span(), scratch.span(), options);
  ops::enqueue(TestDevice::get().context.compute(), launches, {});
  expect_near(dc.download(), to_float(want), 1e-4f, 1e-4f, what.c_str());
}

// The candidates to run here: all of them on a GPU; on a CPU device, where each GPU kernel takes
// seconds to build, one per (VW, TSK) pair, the one with the least unrolled work (the pairs change
// the kernel's code; the tile sizes only its constants, and test_gemm runs other tiles).
std::vector<std::string> candidates_to_check(const cl::DeviceInfo& device, const std::vector<std::string>& all) {
  if (!device.is_cpu()) return all;
  std::map<std::pair<int, int>, std::pair<int, std::string>> best;  // (VW, TSK) -> (work, kernel)
  for (const std::string& k : all) {
    int tsm = 0, tsn = 0, tsk = 0, wm = 0, wn = 0, vw = 0;
    if (std::sscanf(k.c_str(), "tiled TSM=%d TSN=%d TSK=%d WPTM=%d WPTN=%d VW=%d", &tsm, &tsn, &tsk, &wm, &wn, &vw) !=
        6) {
      ADD_FAILURE() << "unexpected candidate " << k;
      continue;
    }
    const int work = wm * wn * tsk;
    auto [it, added] = best.try_emplace({vw, tsk}, work, k);
    if (!added && work < it->second.first) it->second = {work, k};
  }
  std::vector<std::string> out;
  for (const auto& [key, v] : best) out.push_back(v.second);
  return out;
}

TEST(GemmTune, EveryGpuCandidateComputesTheProduct) {
  auto& dev = TestDevice::get();
  cl::DeviceInfo as_gpu = dev.context.device();
  as_gpu.type = CL_DEVICE_TYPE_GPU;  // the GPU kernel's candidates, run here (slowly, but they must be right)
  const auto all = ops::gemm_tune_candidates(as_gpu, ops::TuneMode::full);
  ASSERT_GE(all.size(), 20u);
  const auto candidates = candidates_to_check(dev.context.device(), all);
  EXPECT_GE(candidates.size(), 9u);  // every vector width and depth at least
  // Odd sizes cross every tile edge; the transposes rotate so each candidate meets one of them.
  const ops::GemmShape shapes[] = {
      {67, 45, 37, false, false}, {45, 67, 29, true, false}, {33, 70, 41, false, true}, {70, 33, 19, true, true}};
  std::size_t i = 0;
  for (const std::string& kernel : candidates) {
    const ops::GemmShape& s = shapes[i++ % 4];
    if (too_large_for_this_run(s.M * s.N * s.K)) continue;
    ops::GemmOptions o;
    o.backend = ops::GemmBackend::ferry;
    o.kernel = kernel;
    expect_gemm_right(dev.env, s, o, kernel);
  }
}

// Float4 loads (VG=4) in the tiles the tuner's twins use: the H200's 128 x 128 x 16 (two float4s per
// work-item and operand), the same tile with 16 x 8 and 8 x 16 results per work-item (four float4s
// per work-item and operand) and 64 x 64 x 8 with 4 x 4 blocks (fewer float4s than work-items), on
// shapes with whole tiles, edge tiles and a last partial k step, in every transpose.
TEST(GemmTune, VectorLoadTwinsComputeTheProduct) {
  auto& dev = TestDevice::get();
  const ops::GemmShape shapes[] = {{260, 136, 40, false, false}, {136, 260, 36, true, true},
                                   {132, 140, 44, false, true},  {140, 132, 24, true, false},
                                   {136, 260, 36, false, true},  {260, 136, 40, true, false},
                                   {140, 132, 24, false, false}, {132, 140, 44, true, true}};
  std::size_t i = 0;
  for (const char* kernel :
       {"tiled TSM=128 TSN=128 TSK=16 WPTM=8 WPTN=8 VW=2 VG=4", "tiled TSM=128 TSN=128 TSK=16 WPTM=16 WPTN=8 VW=4 VG=4",
        "tiled TSM=128 TSN=128 TSK=8 WPTM=8 WPTN=16 VW=4 VG=4", "tiled TSM=64 TSN=64 TSK=8 WPTM=4 WPTN=4 VW=4 VG=4"}) {
    for (int t = 0; t < 2; ++t) {
      const ops::GemmShape& s = shapes[i++];
      if (too_large_for_this_run(s.M * s.N * s.K * 5)) continue;
      ops::GemmOptions o;
      o.backend = ops::GemmBackend::ferry;
      o.kernel = kernel;
      expect_gemm_right(dev.env, s, o, fmt::format("{} {}{}", kernel, s.trans_a ? "T" : "N", s.trans_b ? "T" : "N"),
                        true);
    }
  }
}

// The tiled kernel with SK=1 splits K where its work-groups leave a wave short (two compute units
// here: three groups run as 2 + 1, two splits as 3 + 3 halves) and adds the splits in a second
// launch with alpha, beta, the bias and the epilogue; every transpose, a batch, a narrow C.
TEST(GemmTune, TiledSplitsOfKMatchTheReference) {
  auto& dev = TestDevice::get();
  const std::string kernel = "tiled TSM=32 TSN=32 TSK=8 WPTM=2 WPTN=2 SK=1";
  const ops::GemmKernelConfig cfg = ops::parse_gemm_kernel_spec(kernel, "test");
  EXPECT_EQ(ops::tiled_splits({96, 32, 300}, cfg, 2), 2u);
  EXPECT_EQ(ops::tiled_splits({96, 32, 100}, cfg, 2), 1u);  // chunks would be under 8 TSK rows
  EXPECT_EQ(ops::tiled_splits({96, 32, 300}, cfg, 3), 1u);  // three groups fill three units
  EXPECT_EQ(
      ops::tiled_splits({768, 3072, 2048, true, false},
                        ops::parse_gemm_kernel_spec("tiled TSM=128 TSN=128 TSK=16 WPTM=8 WPTN=8 SK=1", "test"), 132),
      7u);  // 144 groups on 132 units: 8 waves of a seventh instead of 2 whole ones
  EXPECT_EQ(
      ops::tiled_splits({2048, 768, 3072},
                        ops::parse_gemm_kernel_spec("tiled TSM=128 TSN=128 TSK=16 WPTM=8 WPTN=8 SK=1", "test"), 132),
      4u);  // 96 groups: 3 waves of a quarter
  EXPECT_EQ(ops::tiled_splits({96, 32, 300},
                              ops::parse_gemm_kernel_spec("tiled TSM=32 TSN=32 TSK=8 WPTM=2 WPTN=2", "test"), 2),
            1u);  // SK=0
  const ops::GemmShape shapes[] = {
      {96, 32, 300, false, false}, {32, 96, 257, true, false}, {96, 32, 299, false, true}, {32, 96, 260, true, true}};
  for (const ops::GemmShape& s : shapes) {
    ASSERT_GT(ops::tiled_splits(s, cfg, dev.context.device().compute_units), 1u) << "the case must split here";
    ops::GemmOptions o;
    o.backend = ops::GemmBackend::ferry;
    o.kernel = kernel;
    expect_gemm_right(dev.env, s, o, fmt::format("{}x{}x{} {}{}", s.M, s.N, s.K, s.trans_a, s.trans_b));
  }
  // A batch of three single-group products, with a bias and the ReLU: C = relu(A B + bias) per product.
  ops::GemmShape s{32, 20, 400};
  s.batch = 3;
  const auto a = random_vector(3 * 32 * 400, 4), b = random_vector(3 * 400 * 20, 5), bias = random_vector(20, 6);
  std::vector<double> want(3 * 32 * 20);
  for (std::size_t z = 0; z < 3; ++z) {
    for (std::size_t i = 0; i < 32; ++i) {
      for (std::size_t j = 0; j < 20; ++j) {
        double acc = bias[j];
        for (std::size_t k = 0; k < 400; ++k) acc += double(a[(z * 32 + i) * 400 + k]) * b[(z * 400 + k) * 20 + j];
        want[(z * 32 + i) * 20 + j] = std::max(acc, 0.0);
      }
    }
  }
  ops::GemmOptions o;
  o.backend = ops::GemmBackend::ferry;
  o.kernel = kernel;
  o.relu = true;
  DeviceTensor da(a), db(b), dbias(bias), dc(std::vector<float>(want.size(), std::nanf("")));
  o.bias = dbias.span();
  const std::size_t scratch_elems = ops::gemm_scratch_elems(dev.env, s, o);
  EXPECT_EQ(scratch_elems, 3 * ops::tiled_splits(s, cfg, dev.context.device().compute_units) * 32 * 20);
  DeviceTensor scratch(scratch_elems);
  const auto launches = ops::gemm(dev.env, s, 1.0f, da.span(), db.span(), 0.0f, dc.span(), scratch.span(), o);
  EXPECT_EQ(launches.size(), 2u);  // the split products, then their sum
  ops::enqueue(dev.context.compute(), launches, {});
  expect_near(dc.download(), to_float(want), 1e-4f, 1e-4f, "batched, bias, relu");
}

TEST(GemmTune, CandidateListsAreValidAndQuickIsShorter) {
  auto& dev = TestDevice::get();
  cl::DeviceInfo as_gpu = dev.context.device(), as_cpu = dev.context.device();
  as_gpu.type = CL_DEVICE_TYPE_GPU;
  as_cpu.type = CL_DEVICE_TYPE_CPU;
  for (const cl::DeviceInfo& d : {as_gpu, as_cpu}) {
    const auto quick = ops::gemm_tune_candidates(d, ops::TuneMode::quick);
    const auto full = ops::gemm_tune_candidates(d, ops::TuneMode::full);
    ASSERT_FALSE(quick.empty());
    EXPECT_LT(quick.size(), full.size());
    for (const std::string& k : quick) EXPECT_NE(std::find(full.begin(), full.end(), k), full.end()) << k;
    EXPECT_EQ(full.front().rfind(d.is_cpu() ? "packed " : "tiled ", 0), 0u) << full.front();
  }
}

// The quick search on a CPU probes only register blocks that fit the device's vector registers: with
// 8 lanes (AVX2: 16 registers, a float16 in two) one float16 per row and at most 6 rows; with 16
// lanes (AVX-512: 32 registers) the wider blocks, the likeliest (RB=6 NV=4) first. The full search
// lists every block either way.
TEST(GemmTune, QuickCpuCandidatesFitTheVectorRegisters) {
  auto& dev = TestDevice::get();
  cl::DeviceInfo d = dev.context.device();
  d.type = CL_DEVICE_TYPE_CPU;
  d.native_float_width = 8;
  const auto avx2 = ops::gemm_tune_candidates(d, ops::TuneMode::quick);
  EXPECT_EQ(avx2, (std::vector<std::string>{"packed RB=6 NV=1 KU=4", "packed RB=4 NV=1 KU=4"}));
  const auto avx2_full = ops::gemm_tune_candidates(d, ops::TuneMode::full);
  d.native_float_width = 16;
  const auto avx512 = ops::gemm_tune_candidates(d, ops::TuneMode::quick);
  ASSERT_FALSE(avx512.empty());
  EXPECT_EQ(avx512.front(), "packed RB=6 NV=4 KU=4");
  EXPECT_NE(std::find(avx512.begin(), avx512.end(), "packed RB=8 NV=2 KU=4"), avx512.end());
  EXPECT_GT(avx512.size(), avx2.size());
  EXPECT_EQ(avx2_full, ops::gemm_tune_candidates(d, ops::TuneMode::full)) << "the full search is the same list";
}

// On a CPU the best packed finalist is to be scored once more with A packed (PA=1, which the probe
// square cannot tell apart), with 8 row blocks per work-item (WB=8, not probed) and with both, and
// any may win. With a budget of 0.01 s one candidate is probed and scored; its twins are listed,
// not reached (the budget bounds the whole search).
TEST(GemmTune, PackedFinalistsGetPackedATwinsWithinTheBudget) {
  auto& dev = TestDevice::get();
  if (!dev.context.device().is_cpu()) GTEST_SKIP() << "the packed kernel's search runs on CPU devices";
  const auto dir = temp_dir("gemm_twins");
  cl::KernelLibrary kernels(dev.context, cl::ProgramCacheOptions{true, dir});
  ops::OpEnv env{kernels};
  ops::GemmTuneOptions options;
  options.mode = ops::TuneMode::quick;
  options.budget_seconds = 0.01;  // one candidate probed, then it on the shapes
  const ops::GemmTuneResult r = ops::tune_gemm(env, options);
  ASSERT_EQ(r.candidates.size(), 4u);
  const ops::GemmTuneCandidate& base = r.candidates.front();
  const std::string twins[] = {base.kernel + " PA=1", base.kernel + " WB=8", base.kernel + " PA=1 WB=8"};
  for (std::size_t i = 0; i < 3; ++i) {
    const ops::GemmTuneCandidate& twin = r.candidates[i + 1];
    EXPECT_EQ(twin.kernel, twins[i]);
    EXPECT_EQ(twin.probe_gflops, i == 0 ? base.probe_gflops : 0.0) << twin.kernel;
    EXPECT_EQ(twin.score_gflops, 0.0) << twin.kernel << ": scored past the budget";
    EXPECT_TRUE(twin.error.empty()) << twin.error;
  }
  EXPECT_GT(base.score_gflops, 0.0) << base.error;
  EXPECT_TRUE(r.budget_ran_out);
  EXPECT_EQ(r.best, base.kernel);
  // The probe square is the first scored shape on CPUs, fitted alike: its rate is the probe's, not
  // a second timing (which would differ in the last digits).
  ASSERT_EQ(r.shapes.front().M, 1024u);
  ASSERT_EQ(r.best_shape_gflops.size(), r.shapes.size());
  EXPECT_EQ(r.best_shape_gflops.front(), base.probe_gflops);
  EXPECT_EQ(r.planned, ops::gemm_tune_candidates(dev.context.device(), ops::TuneMode::quick).size() + 3);
  ops::forget_gemm_tuning();
  std::filesystem::remove_all(dir);
}

// A stop (ferry tune's: a signal arrived) ends the search as a spent budget does: the candidate
// being timed finishes, the best so far is scored on every shape, and that row is saved. ferry tune
// used to die on SIGINT with everything it had measured lost.
TEST(GemmTune, AStopEndsTheSearchWithTheBestSoFarSaved) {
  auto& dev = TestDevice::get();
  const auto dir = temp_dir("gemm_stop");
  cl::KernelLibrary kernels(dev.context, cl::ProgramCacheOptions{true, dir});
  ops::OpEnv env{kernels};
  ops::GemmTuneOptions options;
  options.budget_seconds = 3600;  // only the stop ends it
  int asked = 0;
  options.stop = [&] {
    ++asked;
    return true;  // from the first question on: as a signal during the first candidate
  };
  const ops::GemmTuneResult r = ops::tune_gemm(env, options);
  EXPECT_TRUE(r.stopped);
  EXPECT_FALSE(r.budget_ran_out);
  EXPECT_GE(asked, 2) << "asked between the probes and between the finalists";
  EXPECT_EQ(r.measured, 1u) << "one candidate probed; it is the finalist scored";
  ASSERT_FALSE(r.candidates.empty());
  EXPECT_EQ(r.best, r.candidates.front().kernel);
  EXPECT_GT(r.best_gflops, 0.0);
  EXPECT_TRUE(r.save_error.empty()) << r.save_error;
  ASSERT_FALSE(r.cache_path.empty());
  EXPECT_TRUE(std::filesystem::is_regular_file(r.cache_path));
  ops::forget_gemm_tuning();
  std::filesystem::remove_all(dir);
}

// Candidates built on other threads ahead of their timing (what GPUs do) are the same candidates,
// measured in the same order, none failing: a measurement that reaches a candidate being built
// waits for that build and uses its program.
TEST(GemmTune, BuildingAheadMeasuresTheSameCandidates) {
  auto& dev = TestDevice::get();
  auto run = [&](bool ahead, ops::GemmTuneResult& r) {
    const auto dir = temp_dir(ahead ? "gemm_ahead" : "gemm_in_turn");
    cl::KernelLibrary kernels(dev.context, cl::ProgramCacheOptions{true, dir});
    ops::OpEnv env{kernels};
    ops::GemmTuneOptions options;
    options.mode = ops::TuneMode::quick;
    options.budget_seconds = 0.01;  // one candidate probed, then the finalists on the shapes
    options.build_ahead_on_cpus = ahead;
    r = ops::tune_gemm(env, options);
    const cl::ProgramCacheStats stats = kernels.stats();
    ops::forget_gemm_tuning();
    std::filesystem::remove_all(dir);
    return stats;
  };
  ops::GemmTuneResult in_turn, ahead;
  const cl::ProgramCacheStats in_turn_stats = run(false, in_turn);
  const cl::ProgramCacheStats ahead_stats = run(true, ahead);
  ASSERT_EQ(ahead.candidates.size(), in_turn.candidates.size());
  for (std::size_t i = 0; i < ahead.candidates.size(); ++i) {
    EXPECT_EQ(ahead.candidates[i].kernel, in_turn.candidates[i].kernel) << i;
    EXPECT_EQ(ahead.candidates[i].error, "") << ahead.candidates[i].kernel;
  }
  EXPECT_GT(ahead.best_gflops, 0.0);
  // Every program measured was built (candidates past the budget may be built too, unused).
  EXPECT_GE(ahead_stats.source_builds, in_turn_stats.source_builds);
  EXPECT_EQ(ahead_stats.disk_hits, 0u);
}

// The GPU kernel's finalists are scored with K split, with float4 loads where the tile allows, and
// on NVIDIA with a register cap for 8 x 8 blocks; the CPU kernel's with A packed and with 8 row
// blocks per work-item; a finalist that already names them gets none.
TEST(GemmTune, TiledFinalistsGetSplitVectorAndRegisterTwins) {
  cl::DeviceInfo gpu;
  gpu.type = CL_DEVICE_TYPE_GPU;
  const std::string big = "tiled TSM=128 TSN=128 TSK=16 WPTM=8 WPTN=8 VW=2";
  EXPECT_EQ(ops::gemm_tune_twins(big, gpu), (std::vector<std::string>{big + " SK=1", big + " SK=1 VG=4"}));
  gpu.extensions = "cl_khr_fp64 cl_nv_compiler_options cl_nv_pragma_unroll";
  EXPECT_EQ(ops::gemm_tune_twins(big, gpu),
            (std::vector<std::string>{big + " SK=1", big + " SK=1 VG=4", big + " SK=1 VG=4 RR=128"}));
  const std::string tall = "tiled TSM=128 TSN=128 TSK=16 WPTM=16 WPTN=8 VW=4";  // 128 results: spills under a cap
  EXPECT_EQ(ops::gemm_tune_twins(tall, gpu), (std::vector<std::string>{tall + " SK=1", tall + " SK=1 VG=4"}));
  const std::string small = "tiled TSM=64 TSN=64 TSK=16 WPTM=4 WPTN=4 VW=4";  // 16 results: no cap
  EXPECT_EQ(ops::gemm_tune_twins(small, gpu), (std::vector<std::string>{small + " SK=1", small + " SK=1 VG=4"}));
  const std::string odd = "tiled TSM=16 TSN=8 TSK=5 WPTM=1 WPTN=1";  // k steps of 5: no float4s
  EXPECT_EQ(ops::gemm_tune_twins(odd, gpu), (std::vector<std::string>{odd + " SK=1"}));
  EXPECT_TRUE(ops::gemm_tune_twins(big + " SK=1", gpu).empty());
  EXPECT_TRUE(ops::gemm_tune_twins("packed RB=6 NV=4 PA=1 WB=8", gpu).empty());
  EXPECT_EQ(ops::gemm_tune_twins("packed RB=6 NV=4 PA=1", gpu),
            (std::vector<std::string>{"packed RB=6 NV=4 PA=1 WB=8"}));
  EXPECT_EQ(ops::gemm_tune_twins("packed RB=6 NV=4", gpu),
            (std::vector<std::string>{"packed RB=6 NV=4 PA=1", "packed RB=6 NV=4 WB=8", "packed RB=6 NV=4 PA=1 WB=8"}));
  gpu.extensions = "cl_nv_compiler_optionsX";  // a whole word only
  EXPECT_FALSE(gpu.has_extension("cl_nv_compiler_options"));
}

// A cached winner's key covers each kernel file it names, with the headers that file includes
// (until 2026-12-04 the names carried ".cl" and matched no embedded file, so only the headers
// counted), and a name that is not an embedded kernel file is an error, not a key of nothing.
TEST(GemmTune, CacheKeyCoversEachKernelFileNamed) {
  cl::DeviceInfo d;
  d.name = "some device";
  const std::uint64_t none = ops::tune_cache_key(d, {});
  const std::uint64_t tiled = ops::tune_cache_key(d, {"gemm_tiled"});
  const std::uint64_t both = ops::tune_cache_key(d, {"gemm_tiled", "gemm_packed"});
  EXPECT_NE(none, tiled);
  EXPECT_NE(tiled, both);
  EXPECT_NE(ops::tune_cache_key(d, {"gemm_packed"}), tiled);
  EXPECT_EQ(both, ops::tune_cache_key(d, {"gemm_tiled", "gemm_packed"}));
  cl::DeviceInfo other = d;
  other.driver = "2";
  EXPECT_NE(ops::tune_cache_key(other, {"gemm_tiled"}), tiled);
  EXPECT_THROW((void)ops::tune_cache_key(d, {"gemm_tiled.cl"}), std::invalid_argument);
}

TEST(GemmTune, FirstUseTunesCachesReloadsAndRetunesADamagedCache) {
  auto& dev = TestDevice::get();
  const auto dir = temp_dir("gemm_tune");
  cl::KernelLibrary kernels(dev.context, cl::ProgramCacheOptions{true, dir});
  ops::OpEnv env{kernels};
  // Tuning data with a generic row only, so this device has no row naming it.
  const std::string table = (dir / "table.tsv").string();
  std::ofstream(table) << "*\t*\t*\tferry\tnaive\t-\n";
  ScopedEnv tuning("FERRY_GEMM_TUNING", table);
  ScopedEnv mode("FERRY_TUNE", "quick");
  ScopedEnv budget("FERRY_TUNE_BUDGET_S", "0.01");  // one candidate, then the shape stage: seconds
  const std::string cache = ops::gemm_tune_cache_path(env);
  ASSERT_FALSE(cache.empty());
  ASSERT_FALSE(std::filesystem::exists(cache));

  ops::forget_gemm_tuning();
  testing::internal::CaptureStderr();
  const std::string tuned = ops::gemm_tuning_choice(env);
  std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("tuning the GEMM kernel"), std::string::npos) << err;
  EXPECT_NE(tuned.find(cache), std::string::npos) << tuned;
  EXPECT_EQ(tuned.find("naive"), std::string::npos) << tuned;
  ASSERT_TRUE(std::filesystem::exists(cache));
  expect_gemm_right(env, {70, 45, 37, true, false}, {}, "with the tuned row");

  // A later run (a fresh choice) reads the cache and does not tune.
  ops::forget_gemm_tuning();
  testing::internal::CaptureStderr();
  EXPECT_EQ(ops::gemm_tuning_choice(env), tuned);
  err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("tuning"), std::string::npos) << err;

  // A damaged cache: a warning naming it, then tuned again and rewritten whole.
  std::string text = read_file(cache);
  const std::size_t at = text.find("\tferry\t");
  ASSERT_NE(at, std::string::npos) << text;
  text.replace(at, 7, "\tferrx\t");
  std::ofstream(cache, std::ios::trunc) << text;
  ops::forget_gemm_tuning();
  testing::internal::CaptureStderr();
  EXPECT_EQ(ops::gemm_tuning_choice(env).find("naive"), std::string::npos);
  err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find(cache + " fails its checksum"), std::string::npos) << err;
  EXPECT_NE(err.find("tuning the GEMM kernel"), std::string::npos) << err;
  EXPECT_NE(read_file(cache).find("\tferry\t"), std::string::npos);

  // A row added after the checksum line is an edit too (the checksum covers the lines above it).
  std::ofstream(cache, std::ios::app) << "*\t*\t*\tferry\tnaive\t-\n";
  ops::forget_gemm_tuning();
  testing::internal::CaptureStderr();
  EXPECT_EQ(ops::gemm_tuning_choice(env).find("naive"), std::string::npos);
  err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find(cache + " fails its checksum"), std::string::npos) << err;
  EXPECT_EQ(read_file(cache).find("naive"), std::string::npos) << "tuned again and rewritten whole";

  // FERRY_TUNE=off: the tuning data alone (its generic row), cache or not.
  {
    ScopedEnv off("FERRY_TUNE", "off");
    ops::forget_gemm_tuning();
    EXPECT_NE(ops::gemm_tuning_choice(env).find("naive (" + table), std::string::npos);
  }
  // A row naming the device wins over the cache.
  const std::string naming = (dir / "naming.tsv").string();
  std::ofstream(naming) << fmt::format("*\t*\t{}\tferry\tnaive\t-\n*\t*\t*\tferry\tnaive\t-\n",
                                       dev.context.device().name);
  ScopedEnv tuning_naming("FERRY_GEMM_TUNING", naming);
  ops::forget_gemm_tuning();
  EXPECT_NE(ops::gemm_tuning_choice(env).find("naive (" + naming + ":1)"), std::string::npos);
  ops::forget_gemm_tuning();
  std::filesystem::remove_all(dir);
}

// Runs `f` (which returns the error it met, or "") on another thread. Should it still be waiting
// after 10 s, as an open of the FIFO `fifo` for reading waits for a writer, the test fails and
// opens the FIFO for writing, so that `f` returns instead of hanging the test.
std::string without_waiting_on(const std::string& fifo, const std::function<std::string()>& f) {
  auto done = std::async(std::launch::async, f);
  if (done.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << "waited for a writer of the FIFO " << fifo;
    const int writer = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (writer >= 0) ::close(writer);
  }
  return done.get();
}

// The error gemm_tuning_choice throws with FERRY_GEMM_TUNING set to `path`, or "".
std::string tuning_file_error(ops::OpEnv& env, const std::string& path) {
  ScopedEnv tuning("FERRY_GEMM_TUNING", path);
  ops::forget_gemm_tuning();
  try {
    ops::gemm_tuning_choice(env);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// The warning read_tune_cache_text prints for `path`, or "" when it read a text.
std::string tune_cache_warning(const std::string& path) {
  testing::internal::CaptureStderr();
  const bool read = ops::read_tune_cache_text(path, "GEMM tuning cache").has_value();
  const std::string err = testing::internal::GetCapturedStderr();
  return read ? "" : err;
}

// A FIFO, a folder or an oversized file named as a tuning file (FERRY_GEMM_TUNING) or found where
// a tuning cache belongs is refused at once, saying what it is: the FIFO was opened and waited on
// for ever, and a folder in the cache's place was tuned again on every run.
TEST(GemmTune, TuningFilesThatAreNotSmallRegularFilesAreRefusedAtOnce) {
  auto& dev = TestDevice::get();
  const auto dir = temp_dir("gemm_tuning_files");
  cl::KernelLibrary kernels(dev.context, cl::ProgramCacheOptions{true, dir});
  ops::OpEnv env{kernels};
  const std::string fifo = (dir / "fifo.tsv").string(), folder = (dir / "folder.tsv").string(),
                    big = (dir / "big.tsv").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  std::filesystem::create_directories(folder);
  std::ofstream(big) << std::string(ops::max_tuning_file_bytes + 1, '#');

  std::string err = without_waiting_on(fifo, [&] { return tuning_file_error(env, fifo); });
  EXPECT_NE(err.find(fmt::format("FERRY_GEMM_TUNING: '{}' is a FIFO (named pipe)", fifo)), std::string::npos) << err;
  err = tuning_file_error(env, folder);
  EXPECT_NE(err.find(fmt::format("FERRY_GEMM_TUNING: '{}' is a folder", folder)), std::string::npos) << err;
  err = tuning_file_error(env, big);
  EXPECT_NE(err.find("more than the 1048576 bytes (1 MiB) a tuning file may hold"), std::string::npos) << err;

  err = without_waiting_on(fifo, [&] { return tune_cache_warning(fifo); });
  EXPECT_NE(err.find(fifo + " is a FIFO (named pipe), not a regular file"), std::string::npos) << err;
  err = tune_cache_warning(big);
  EXPECT_NE(err.find(big + " is 1048577 bytes"), std::string::npos) << err;
  // A folder where the cache belongs cannot be replaced by the tuner's file: the warning says to
  // remove it, and so does the failed write.
  err = tune_cache_warning(folder);
  EXPECT_NE(err.find(folder + " is a folder, not a file"), std::string::npos) << err;
  EXPECT_NE(err.find("tuned again on every run: remove it (rm -r '" + folder + "')"), std::string::npos) << err;
  testing::internal::CaptureStderr();
  const std::string failed = ops::write_tune_cache_text(folder, "# a row\n", "GEMM tuning cache");
  testing::internal::GetCapturedStderr();
  EXPECT_NE(failed.find("it is a folder: remove it"), std::string::npos) << failed;
  ops::forget_gemm_tuning();
  std::filesystem::remove_all(dir);
}

// A device that never ends (/dev/zero) is refused without reading it: reading it whole grew the
// process's memory without bound.
TEST(GemmTune, ADeviceNamedAsATuningFileIsRefusedWithoutReadingIt) {
  auto& dev = TestDevice::get();
  cl::KernelLibrary kernels(dev.context, cl::ProgramCacheOptions{false, {}});
  ops::OpEnv env{kernels};
  std::string err = tuning_file_error(env, "/dev/zero");
  EXPECT_NE(err.find("FERRY_GEMM_TUNING: '/dev/zero' is a device, not a regular file"), std::string::npos) << err;
  err = tune_cache_warning("/dev/zero");
  EXPECT_NE(err.find("/dev/zero is a device, not a regular file"), std::string::npos) << err;
  ops::forget_gemm_tuning();
}

// The budget stops a search before a candidate that would end past it, judged by the last one's
// time: one that took 30 ms does not fit in what is left of 50 ms after it; a quick one fits in
// 10 s; the first always runs.
TEST(GemmTune, DeadlineStopsBeforeACandidateThatWouldEndPastTheBudget) {
  using Clock = ops::TuneDeadline::Clock;
  ops::TuneDeadline tight(0.05, Clock::now());
  EXPECT_TRUE(tight.next_fits());
  tight.begin();
  ::usleep(30'000);
  tight.end();
  EXPECT_FALSE(tight.next_fits()) << "30 ms spent, a 30 ms candidate does not end within 50 ms";
  ops::TuneDeadline roomy(10.0, Clock::now());
  roomy.begin();
  roomy.end();
  EXPECT_TRUE(roomy.next_fits());
  ops::TuneDeadline spent(0.0, Clock::now() - std::chrono::seconds(1));
  EXPECT_TRUE(spent.next_fits()) << "the first candidate always runs";
}

// A cached result records how much of its search it covered, in the comment line every cache has
// had since the tuner exists ("<mode> search, N of M candidates in S s"), now with ", budget
// spent" or ", stopped by a signal" after it; a new result replaces it only when its search
// measured at least as many candidates. A `ferry tune --budget-seconds 0.001` (1 of 11) had
// replaced a complete search's row (11 of 11).
TEST(GemmTune, CachesSayWhatTheirSearchCoveredAndTheMoreCompleteIsKept) {
  const std::string head = "# ferry GEMM tuning cache, written by the tuner (`ferry tune`); delete it to tune again.\n";
  const std::string old_file = head +
                               "# device 'pthread-haswell-AMD EPYC 7B13 64-Core Processor', driver 5.0, quick search, "
                               "11 of 11 candidates in 44.1 s\n# GFLOPS per shape: 1024x1024x1024: 150\nrow\n";
  const std::optional<ops::TuneCoverage> old = ops::tune_cache_coverage(old_file);
  ASSERT_TRUE(old);
  EXPECT_EQ(old->measured, 11u);
  EXPECT_EQ(old->planned, 11u);
  EXPECT_FALSE(old->stopped);
  for (const auto& [measured, planned, budget, stopped] :
       {std::tuple{1, 14, true, false}, {3, 14, false, true}, {14, 14, false, false}}) {
    const std::string comment = ops::tune_coverage_comment(measured, planned, 2.25, budget, stopped);
    const std::optional<ops::TuneCoverage> c =
        ops::tune_cache_coverage(head + "# device 'd', driver 1, full search, " + comment + "\nrow\n");
    ASSERT_TRUE(c) << comment;
    EXPECT_EQ(c->measured, std::size_t(measured)) << comment;
    EXPECT_EQ(c->planned, std::size_t(planned)) << comment;
    EXPECT_EQ(c->stopped, stopped) << comment;
  }
  EXPECT_EQ(ops::tune_coverage_comment(1, 14, 0.54, true, false), "1 of 14 candidates in 0.5 s, budget spent");
  EXPECT_FALSE(ops::tune_cache_coverage(head + "row\n")) << "a file that records nothing: any search replaces it";

  EXPECT_FALSE(ops::tune_cache_to_keep(std::nullopt, 1)) << "nothing cached";
  const std::optional<ops::TuneCoverage> keep = ops::tune_cache_to_keep(old_file, 1);
  ASSERT_TRUE(keep);
  EXPECT_EQ(keep->measured, 11u);
  EXPECT_FALSE(ops::tune_cache_to_keep(old_file, 11)) << "as many candidates: the newer replaces it";
  EXPECT_FALSE(ops::tune_cache_to_keep(old_file, 12));
  EXPECT_FALSE(ops::tune_cache_to_keep(head + "row\n", 0));
}

// The tuning row for this device as the tuner writes it, with the naive kernel (which any device runs).
std::string naive_row_for(const cl::DeviceInfo& d) {
  return fmt::format("{}\t*\t{} {}\tferry\tnaive\t-",
                     d.is_cpu()   ? "cpu"
                     : d.is_gpu() ? "gpu"
                                  : "*",
                     d.platform_name, d.name);
}

// A shorter search than the cached row's (one candidate of the quick list) keeps that row and says
// so (GemmTuneResult::kept), leaving the file as it was; forced (ferry tune --force), it replaces
// it. A row for another device is no row to keep.
TEST(GemmTune, AShorterSearchKeepsTheMoreCompleteCachedRowUnlessForced) {
  auto& dev = TestDevice::get();
  const cl::DeviceInfo& d = dev.context.device();
  const auto dir = temp_dir("gemm_keep");
  cl::KernelLibrary kernels(dev.context, cl::ProgramCacheOptions{true, dir});
  ops::OpEnv env{kernels};
  const std::string cache = ops::gemm_tune_cache_path(env);
  ASSERT_EQ(ops::write_gemm_tune_cache(
                cache, naive_row_for(d),
                fmt::format("device '{}', driver {}, quick search, 11 of 11 candidates in 44.1 s", d.name, d.driver)),
            "");
  ASSERT_TRUE(ops::valid_gemm_tune_cache_body(cache, d));
  const std::string before = read_file(cache);

  ops::GemmTuneOptions o;
  o.budget_seconds = 0.01;  // one candidate probed, then it on the shapes
  const ops::GemmTuneResult shorter = ops::tune_gemm(env, o);
  EXPECT_EQ(shorter.measured, 1u);
  ASSERT_TRUE(shorter.kept);
  EXPECT_EQ(shorter.kept->measured, 11u);
  EXPECT_EQ(shorter.kept->planned, 11u);
  EXPECT_EQ(shorter.cache_path, cache);
  EXPECT_TRUE(shorter.save_error.empty()) << shorter.save_error;
  EXPECT_EQ(read_file(cache), before) << "the more complete row stays as it was";

  o.replace_cached = true;
  const ops::GemmTuneResult forced = ops::tune_gemm(env, o);
  EXPECT_FALSE(forced.kept);
  EXPECT_EQ(forced.cache_path, cache);
  ops::TuneCoverage coverage;
  const std::optional<ops::GemmTuningRow> saved = ops::read_gemm_tune_cache(cache, d, &coverage);
  ASSERT_TRUE(saved);
  EXPECT_TRUE(saved->config.text().starts_with(forced.best)) << saved->config.text();
  EXPECT_EQ(coverage.measured, 1u);
  EXPECT_EQ(coverage.planned, forced.planned);
  EXPECT_FALSE(coverage.stopped);
  EXPECT_NE(read_file(cache).find(" candidates in "), std::string::npos);

  // Another device's row (a copied file) is not kept, however many candidates it claims.
  cl::DeviceInfo other = d;
  other.name = "another device";
  const std::string foreign = (dir / "foreign.tsv").string();
  ASSERT_EQ(ops::write_gemm_tune_cache(foreign, naive_row_for(other),
                                       "device 'another device', driver 1, quick search, 99 of 99 candidates in 1.0 s"),
            "");
  EXPECT_FALSE(ops::valid_gemm_tune_cache_body(foreign, d));
  EXPECT_TRUE(ops::valid_gemm_tune_cache_body(foreign, other));
  ops::forget_gemm_tuning();
  std::filesystem::remove_all(dir);
}

// The attention's cache follows the same rule: fewer candidates keep the cached winners, forced
// they are replaced.
TEST(GemmTune, TheAttentionCacheKeepsTheMoreCompleteSearchesWinnersToo) {
  auto& dev = TestDevice::get();
  const auto dir = temp_dir("attention_keep");
  cl::KernelLibrary kernels(dev.context, cl::ProgramCacheOptions{true, dir});
  ops::OpEnv env{kernels};
  ops::AttentionTuneOptions o;
  o.candidates = {"blocked TQ=8 TK=8", "tiled BQ=16 BK=8"};
  o.shapes = {{1, 40, 2, 16}};
  o.budget_seconds = 3600;
  const ops::AttentionTuneResult both = ops::tune_attention(env, o);
  EXPECT_FALSE(both.kept);
  ASSERT_FALSE(both.cache_path.empty()) << both.save_error;
  const std::string before = read_file(both.cache_path);
  EXPECT_NE(before.find(", 2 of 2 candidates in "), std::string::npos) << before;

  o.candidates = {"tiled BQ=16 BK=8"};
  const ops::AttentionTuneResult one = ops::tune_attention(env, o);
  ASSERT_TRUE(one.kept);
  EXPECT_EQ(one.kept->measured, 2u);
  EXPECT_EQ(one.cache_path, both.cache_path);
  EXPECT_EQ(read_file(both.cache_path), before);

  o.replace_cached = true;
  const ops::AttentionTuneResult forced = ops::tune_attention(env, o);
  EXPECT_FALSE(forced.kept);
  ops::TuneCoverage coverage;
  const auto kernels_now = ops::read_attention_tune_cache(env, both.cache_path, &coverage);
  ASSERT_TRUE(kernels_now);
  EXPECT_EQ(kernels_now->at(64), "tiled BQ=16 BK=8");
  EXPECT_EQ(coverage.measured, 1u);
  ops::forget_attention_tuning();
  std::filesystem::remove_all(dir);
}

// ferry tune asks before it measures: a folder it can make and write a file in (and the file is
// gone after), or why not. `FERRY_CACHE_DIR=/proc/nope ferry tune` searched for its whole budget,
// then could not save.
TEST(GemmTune, ACacheFolderIsTriedBeforeTheSearch) {
  const auto dir = temp_dir("tune_folder");
  const std::string fresh = (dir / "new" / "cache").string();
  EXPECT_EQ(ops::tune_cache_folder_problem(fresh), "");
  EXPECT_TRUE(std::filesystem::is_directory(fresh));
  EXPECT_TRUE(std::filesystem::is_empty(fresh)) << "the trial file is removed";
  const std::string file = (dir / "file").string();
  std::ofstream(file) << "x";
  EXPECT_NE(ops::tune_cache_folder_problem(file), "");
  EXPECT_TRUE(ops::tune_cache_folder_problem("/proc/ferry-no-such-cache").starts_with("cannot create it: "))
      << ops::tune_cache_folder_problem("/proc/ferry-no-such-cache");
  std::filesystem::remove_all(dir);
}

// First use with OpEnv::tune_progress false (ferry train --quiet) says nothing; a cached row from
// a search a signal stopped is searched again, and the new one replaces it.
TEST(GemmTune, FirstUseIsQuietWhenAskedAndSearchesAStoppedRowAgain) {
  auto& dev = TestDevice::get();
  const cl::DeviceInfo& d = dev.context.device();
  const auto dir = temp_dir("gemm_quiet");
  cl::KernelLibrary kernels(dev.context, cl::ProgramCacheOptions{true, dir});
  ops::OpEnv env{kernels, false};
  const std::string table = (dir / "table.tsv").string();
  std::ofstream(table) << "*\t*\t*\tferry\tnaive\t-\n";
  ScopedEnv tuning("FERRY_GEMM_TUNING", table);
  ScopedEnv mode("FERRY_TUNE", "quick");
  ScopedEnv budget("FERRY_TUNE_BUDGET_S", "0.01");
  const std::string cache = ops::gemm_tune_cache_path(env);
  ASSERT_EQ(ops::write_gemm_tune_cache(cache, naive_row_for(d),
                                       fmt::format("device '{}', driver {}, quick search, {}", d.name, d.driver,
                                                   ops::tune_coverage_comment(1, 14, 3.0, false, true))),
            "");
  ops::forget_gemm_tuning();
  testing::internal::CaptureStderr();
  const std::string choice = ops::gemm_tuning_choice(env);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("tun"), std::string::npos) << err;
  EXPECT_EQ(err.find("search"), std::string::npos) << err;
  EXPECT_EQ(choice.find("naive"), std::string::npos) << "searched again and replaced: " << choice;
  ops::TuneCoverage coverage;
  ASSERT_TRUE(ops::read_gemm_tune_cache(cache, d, &coverage));
  EXPECT_EQ(coverage.measured, 1u);
  EXPECT_FALSE(coverage.stopped);
  ops::forget_gemm_tuning();
  std::filesystem::remove_all(dir);
}

// While a TuneStopSignals lives, SIGINT is recorded (and acknowledged) whatever handled it before
// (PoCL's LLVM has a handler that ends the process), an inner one shares the outer one's, and the
// handler from before comes back with the outer one.
TEST(GemmTune, TuneStopSignalsRecordTheSignalWhileTheyLive) {
  static volatile std::sig_atomic_t own = 0;
  struct sigaction mine {
  }, before{};
  mine.sa_handler = [](int) { own = 1; };
  sigemptyset(&mine.sa_mask);
  ASSERT_EQ(sigaction(SIGINT, &mine, &before), 0);
  testing::internal::CaptureStderr();
  {
    const ops::TuneStopSignals outer("the search stops");
    EXPECT_EQ(ops::TuneStopSignals::received(), 0);
    {
      const ops::TuneStopSignals inner("inner");
      std::raise(SIGINT);
      EXPECT_EQ(ops::TuneStopSignals::received(), SIGINT);
    }
    EXPECT_EQ(ops::TuneStopSignals::received(), SIGINT);
  }
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(err, "\nferry: SIGINT received: the search stops\n");
  EXPECT_EQ(own, 0) << "the handler from before does not run while the search does";
  struct sigaction now {};
  sigaction(SIGINT, nullptr, &now);
  EXPECT_EQ(now.sa_handler, mine.sa_handler) << "it is back after";
  std::raise(SIGINT);
  EXPECT_EQ(own, 1);
  ASSERT_EQ(sigaction(SIGINT, &before, nullptr), 0);
}

// SIGINT during first use (inside ferry train) ended the process by the signal: no message, the
// progress line unended, the search lost. Now the search ends as a spent budget does, its best so
// far is saved (nothing better being cached) marked as a stopped search's, the progress line is
// ended, and TuneStopped says so (ferry exits 130). The next first use searches again.
TEST(GemmTune, ASignalDuringFirstUseEndsTheSearchAndThrowsTuneStopped) {
  auto& dev = TestDevice::get();
  const cl::DeviceInfo& d = dev.context.device();
  const auto dir = temp_dir("gemm_sigint");
  cl::KernelLibrary kernels(dev.context, cl::ProgramCacheOptions{true, dir});
  ops::OpEnv env{kernels};
  const std::string table = (dir / "table.tsv").string();
  std::ofstream(table) << "*\t*\t*\tferry\tnaive\t-\n";
  ScopedEnv tuning("FERRY_GEMM_TUNING", table);
  ScopedEnv mode("FERRY_TUNE", "quick");
  ScopedEnv budget("FERRY_TUNE_BUDGET_S", "600");  // only the signal ends it early
  ops::forget_gemm_tuning();
  struct sigaction now {};
  sigaction(SIGINT, nullptr, &now);
  const auto original = now.sa_handler;  // the default, or the driver's (PoCL's LLVM has one)
  std::atomic<bool> done{false};
  // As a person's Ctrl-C once the search is under way (its handler in place).
  std::thread sender([&] {
    for (int i = 0; i < 120000 && !done; ++i) {
      struct sigaction h {};
      sigaction(SIGINT, nullptr, &h);
      if (h.sa_handler != original) {
        ::kill(::getpid(), SIGINT);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  testing::internal::CaptureStderr();
  int signal = 0;
  std::string what;
  try {
    ops::gemm_tuning_choice(env);
  } catch (const ops::TuneStopped& e) {
    signal = e.signal;
    what = e.what();
  }
  done = true;
  sender.join();
  std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(signal, SIGINT) << what;
  EXPECT_NE(what.find("GEMM tuning for '" + d.name + "' stopped by SIGINT after 1 of "), std::string::npos) << what;
  EXPECT_NE(what.find("as a stopped search's, which the next run searches again"), std::string::npos) << what;
  EXPECT_NE(err.find("\nferry: SIGINT received: the GEMM tuning stops after the candidate being timed"),
            std::string::npos)
      << err;
  ASSERT_FALSE(err.empty());
  EXPECT_EQ(err.back(), '\n') << "the progress line is ended";
  sigaction(SIGINT, nullptr, &now);
  EXPECT_EQ(now.sa_handler, original) << "the handler from before is back";
  const std::string cache = ops::gemm_tune_cache_path(env);
  ops::TuneCoverage coverage;
  ASSERT_TRUE(ops::read_gemm_tune_cache(cache, d, &coverage));
  EXPECT_EQ(coverage.measured, 1u);
  EXPECT_TRUE(coverage.stopped);
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    EXPECT_FALSE(name.starts_with("gemm-tuning") && name.find(".tmp") != std::string::npos) << name;
  }

  // The next first use searches again, says why, and its search (as many candidates) replaces it.
  ScopedEnv shorter("FERRY_TUNE_BUDGET_S", "0.01");
  ops::forget_gemm_tuning();
  testing::internal::CaptureStderr();
  ops::gemm_tuning_choice(env);
  err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find(fmt::format("cached GEMM row in {} is from a search stopped after 1 of ", cache)),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("tuning the GEMM kernel"), std::string::npos) << err;
  ASSERT_TRUE(ops::read_gemm_tune_cache(cache, d, &coverage));
  EXPECT_FALSE(coverage.stopped);
  ops::forget_gemm_tuning();
  std::filesystem::remove_all(dir);
}

// OpEnv::tune_stop_signals false (RuntimeOptions::tune_stop_signals: a program that handles the
// signals itself): first use leaves the program's handlers in place while it searches.
TEST(GemmTune, FirstUseLeavesTheProgramsHandlersWhenAsked) {
  auto& dev = TestDevice::get();
  const auto dir = temp_dir("gemm_own_handlers");
  cl::KernelLibrary kernels(dev.context, cl::ProgramCacheOptions{true, dir});
  ops::OpEnv env{kernels, false, false};
  const std::string table = (dir / "table.tsv").string();
  std::ofstream(table) << "*\t*\t*\tferry\tnaive\t-\n";
  ScopedEnv tuning("FERRY_GEMM_TUNING", table);
  ScopedEnv mode("FERRY_TUNE", "quick");
  ScopedEnv budget("FERRY_TUNE_BUDGET_S", "0.5");
  ops::forget_gemm_tuning();
  struct sigaction now {};
  sigaction(SIGINT, nullptr, &now);
  const auto original = now.sa_handler;
  std::atomic<bool> done{false}, replaced{false};
  std::thread watcher([&] {
    while (!done) {
      struct sigaction h {};
      sigaction(SIGINT, nullptr, &h);
      if (h.sa_handler != original) replaced = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  const std::string choice = ops::gemm_tuning_choice(env);
  done = true;
  watcher.join();
  EXPECT_FALSE(replaced) << "a handler of the search's replaced the program's";
  EXPECT_EQ(choice.find("naive"), std::string::npos) << "it searched: " << choice;
  ops::forget_gemm_tuning();
  std::filesystem::remove_all(dir);
}

TEST(GemmTune, BadSettingsNameTheVariable) {
  {
    ScopedEnv bad("FERRY_TUNE", "fast");
    EXPECT_THROW(
        {
          try {
            ops::tune_mode_from_env();
          } catch (const std::invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find("FERRY_TUNE='fast': expected off, quick or full"), std::string::npos);
            throw;
          }
        },
        std::invalid_argument);
  }
  // Decimal seconds only: strtod alone took hexadecimal ("0x10": 16 s), exponents and 1e-300.
  for (const char* v :
       {"0", "-3", "abc", "5s", "0x10", "1e-300", "1e3", "inf", "nan", " 5", "5.", ".5.", "0.0001", "604801"}) {
    ScopedEnv bad("FERRY_TUNE_BUDGET_S", v);
    try {
      ops::tune_budget_from_env();
      ADD_FAILURE() << "FERRY_TUNE_BUDGET_S=" << v << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(fmt::format("FERRY_TUNE_BUDGET_S='{}': expected", v)), std::string::npos)
          << e.what();
    }
  }
  for (auto [text, seconds] :
       {std::pair{"2.5", 2.5}, {"0.01", 0.01}, {"60", 60.0}, {"604800", 604800.0}, {".5", 0.5}}) {
    ScopedEnv ok("FERRY_TUNE_BUDGET_S", text);
    EXPECT_EQ(ops::tune_budget_from_env(), seconds) << text;
  }
}

}  // namespace
}  // namespace ferry::test
