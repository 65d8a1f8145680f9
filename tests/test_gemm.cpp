// GEMM: every kernel (packed for CPUs, tiled for GPUs, naive, CLBlast when compiled in) against
// the CPU reference over awkward shapes, both transposes, alpha/beta/bias and operand offsets;
// the tuning data's error reporting; and the reference's gradients against finite differences.
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>

#include "ferry/ops/cast.hpp"
#include "ops/gemm.hpp"
#include "ops/gemm_tune.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

struct Case {
  std::size_t M, N, K;
};

// Shapes that are multiples of nothing, degenerate ones, wide small-K ones (Linear layers), and
// long-K ones (weight gradients), which the CPU kernel splits along K (with panels of 64 floats
// five splits of 512 rows at K = 2200, the last short; at K = 8500 nine of 1024 with panels of 64
// or 32, five of 2048 with panels of 16; with N a multiple of a panel 64 wide it reads a row-major
// B in place).
const Case kShapes[] = {{1, 1, 1},        {7, 13, 5},      {37, 1000, 129}, {64, 64, 64}, {65, 63, 17},
                        {1000, 1000, 16}, {128, 1000, 64}, {3, 200, 300},   {200, 3, 1},  {5, 9, 0},
                        {7, 21, 2200},    {13, 64, 2200},  {7, 21, 8500}};

// The configurations the tests force: ferry's CPU kernel in three block shapes (the AVX-512 and
// AVX2 rows of the tuning data, the latter with A packed, the k loop unrolled by 4 and 8 row blocks
// per work-item, and an odd one unrolled by 3 with 5 row blocks per work-item, so a remainder of k
// steps runs after the unrolled ones and a work-item's last row blocks may lie past M, fewer where the
// launch would be short of work-items), the GPU kernel in two tile shapes, one
// reading its local tiles as float2 and loading float4s from global memory (VG=4: whole tiles where offsets and
// leading dimensions allow it, floats at the edges, in a last partial k step and elsewhere), also on PoCL, where it
// is slow but must be correct. The naive fallback is checked
// through a tuning override below (each configuration costs PoCL compiles per transpose). On a device that is not a
// CPU, the packed kernel runs in its first configuration only (see GemmKernelTest).
constexpr const char* kPacked = "packed RB=6 NV=4";
constexpr const char* kPackedA = "packed RB=6 NV=1 PA=1 KU=4 WB=8";
const char* const kKernels[] = {kPacked, kPackedA, "packed RB=3 NV=2 KU=3 WB=5",
                                "tiled TSM=32 TSN=32 TSK=8 WPTM=4 WPTN=2 VW=2 VG=4",
                                "tiled TSM=16 TSN=8 TSK=5 WPTM=1 WPTN=1"};

// Reference in double precision from float inputs.
std::vector<float> reference(const ops::GemmShape& s, float alpha, const std::vector<float>& a,
                             const std::vector<float>& b, float beta, const std::vector<float>& c,
                             const std::vector<float>& bias) {
  auto cd = to_double(c);
  auto ad = to_double(a), bd = to_double(b), biasd = to_double(bias);
  ops::ref::gemm<double>(s, alpha, ad, bd, beta, cd, biasd);
  return to_float(cd);
}

// check_gemm's reference for one product. Its inputs are fixed by the shape, beta and the bias
// (the seeds below), so the result is computed once per binary and shared by every kernel that
// checks the same product and by the rerun. GemmKernelTest computed the reference of each of its
// 48 products (12 shapes x 4 transposes) 15 times, 3 for each of the five kernels (alpha/beta/bias,
// beta = 0 and its rerun): about 1.9G double multiply-adds on the host, whatever the device (the
// 1000 x 1000 x 16 shape alone is 16M). Now twice each: 2/15 of that.
const std::vector<float>& shared_reference(const ops::GemmShape& s, float alpha, const std::vector<float>& a,
                                           const std::vector<float>& b, float beta, const std::vector<float>& c,
                                           const std::vector<float>& bias) {
  using Key = std::tuple<std::size_t, std::size_t, std::size_t, bool, bool, float, float, bool>;
  static std::map<Key, std::vector<float>> done;
  const Key key{s.M, s.N, s.K, s.trans_a, s.trans_b, alpha, beta, !bias.empty()};
  auto it = done.find(key);
  if (it == done.end()) it = done.emplace(key, reference(s, alpha, a, b, beta, c, bias)).first;
  return it->second;
}

// Runs one GEMM on the device with C preloaded with `c0` and compares with the reference. The
// operands sit at odd element offsets, or with `aligned` at multiples of 4 (where VG=4 loads float4s).
void check_gemm(const ops::GemmShape& s, const ops::GemmOptions& base, float alpha, float beta, bool with_bias,
                const std::string& what, bool aligned = false) {
  auto& dev = TestDevice::get();
  // Fixed seeds: shared_reference relies on the inputs being a function of its key.
  const auto a = random_vector(s.M * s.K, 11);
  const auto b = random_vector(s.K * s.N, 12);
  const auto bias = with_bias ? random_vector(s.N, 13) : std::vector<float>{};
  // beta = 0: C is all NaN and must not be read.
  const auto c0 = beta == 0.0f ? std::vector<float>(s.M * s.N, std::nanf("")) : random_vector(s.M * s.N, 14);
  DeviceTensor da(a, aligned ? 4 : 3), db(b, aligned ? 8 : 5), dc(c0, 9),
      dbias(with_bias ? bias : std::vector<float>{0.0f}, 17);
  ops::GemmOptions options = base;
  if (with_bias) options.bias = dbias.span();
  const std::size_t scratch_elems = ops::gemm_scratch_elems(dev.env, s, options);
  DeviceTensor scratch(std::max<std::size_t>(scratch_elems, 1), 21);
  auto launches = ops::gemm(dev.env, s, alpha, da.span(), db.span(), beta, dc.span(),
                            scratch_elems ? scratch.span() : ops::DeviceSpan{}, options);
  ops::run_blocking(dev.context.compute(), launches);
  const float atol = 2e-6f * static_cast<float>(s.K) + 1e-5f;
  const std::vector<float>& want = shared_reference(s, alpha, a, b, beta, c0, bias);
  expect_near(dc.download(), want, atol, 1e-4f, what.c_str());
  // Bound once, enqueued again: the same result (the launches own no per-run state).
  if (beta == 0.0f) {
    ops::run_blocking(dev.context.compute(), launches);
    expect_near(dc.download(), want, atol, 1e-4f, (what + " rerun").c_str());
  }
}

using KernelParam = std::tuple<const char*, Case, bool, bool>;
class GemmKernelTest : public ::testing::TestWithParam<KernelParam> {};

TEST_P(GemmKernelTest, MatchesReference) {
  const auto& [kernel, shape, ta, tb] = GetParam();
  // The packed kernel is ferry's CPU kernel: no tuning row gives it to a GPU, and its other block
  // shapes are CPU rows (AVX2, an odd block). Off CPUs it runs in one configuration, kPacked, on
  // every shape and transpose (the widest block: the narrow shapes fit it down to NV = 1 and 2,
  // RB = 16 and 12). The two others are 12 of the 34 programs these cases build, and with a fresh
  // program cache the builds are most of this binary's time.
  if (std::string_view(kernel).starts_with("packed") && std::string_view(kernel) != kPacked &&
      !TestDevice::get().context.device().is_cpu()) {
    GTEST_SKIP() << kernel << ": a CPU block shape; on this device the packed kernel is checked as " << kPacked;
  }
  // Oclgrind simulates the tiled kernel's local-memory tiles (and the padding of partial tiles)
  // several times slower per multiply-add than the packed kernel.
  const std::size_t work = shape.M * shape.N * shape.K * (std::string_view(kernel).starts_with("tiled") ? 5 : 1);
  if (too_large_for_this_run(work)) GTEST_SKIP() << "FERRY_TEST_SMALL: a large shape";
  const ops::GemmShape s{shape.M, shape.N, shape.K, ta, tb};
  ops::GemmOptions options;
  options.backend = ops::GemmBackend::ferry;
  options.kernel = kernel;
  const std::string name = fmt::format("{} {}x{}x{} {}{}", kernel, s.M, s.N, s.K, ta ? "T" : "N", tb ? "T" : "N");
  check_gemm(s, options, 0.75f, -0.5f, true, name + " alpha/beta/bias");
  check_gemm(s, options, 1.0f, 0.0f, false, name + " beta=0 NaN C");
  if (std::string_view(kernel).find("VG=4") != std::string_view::npos) {
    check_gemm(s, options, 0.75f, -0.5f, true, name + " float4 loads", true);
  }
}

INSTANTIATE_TEST_SUITE_P(AllKernels, GemmKernelTest,
                         ::testing::Combine(::testing::ValuesIn(kKernels), ::testing::ValuesIn(kShapes),
                                            ::testing::Bool(), ::testing::Bool()));

// Narrow operands (mixed precision): A, B and C each f32, f16 or bf16. The reference multiplies
// the stored (rounded) inputs in double and rounds once into C's type, as the kernels promise;
// the tolerance is C's rounding (half an ulp of its type) plus fp32 accumulation. Both kernel
// families read the narrow types themselves (packed including the split-K and in-place-B shapes);
// the naive kernel runs them through f32 copies in scratch, as CLBlast does.
using ops::DType;
struct DtypeCase {
  const char* kernel;
  DType a, b, c;
  bool trans_a, trans_b;
  float beta;
};
// Each case is one or two program builds (about 3 s each on PoCL), so they are few and each covers
// something: every dtype in every operand position, every transpose, beta, and (for packed) the
// split-K and in-place-B paths of the long-K shapes.
constexpr const char* kTiled = "tiled TSM=16 TSN=8 TSK=5 WPTM=1 WPTN=1";
const DtypeCase kDtypeCases[] = {
    {kPacked, DType::bf16, DType::bf16, DType::bf16, false, false, 0.0f},
    {kPacked, DType::f16, DType::f16, DType::f16, true, true, 0.5f},
    {kPacked, DType::bf16, DType::f32, DType::f32, false, true, 0.0f},
    {kPacked, DType::f32, DType::f16, DType::bf16, true, false, 0.5f},
    {kPackedA, DType::f32, DType::bf16, DType::f16, true, false, 0.5f},  // f32 A packed, narrow B and C
    // an f16 A is packed whatever the row says (ops/gemm.cpp, fit_packed), row-major and transposed;
    // narrow B read 16 at a time, row-major and transposed
    {kPacked, DType::f16, DType::bf16, DType::f16, false, false, 0.5f},
    {kPacked, DType::f16, DType::f16, DType::f32, false, true, 0.0f},
    {kPacked, DType::f16, DType::bf16, DType::bf16, true, false, 0.0f},
    {kTiled, DType::f32, DType::f16, DType::bf16, false, false, 0.5f},
    {kTiled, DType::bf16, DType::f32, DType::f16, true, true, 0.0f},
    // VG=4 with narrow A and B: the kernel is built with float loads for both (float4s are f32's)
    {"tiled TSM=32 TSN=16 TSK=4 WPTM=4 WPTN=4 VW=4 VG=4", DType::f16, DType::bf16, DType::f32, false, true, 0.5f},
    {"naive", DType::f16, DType::bf16, DType::f16, false, true, 0.5f},
};

std::vector<std::uint16_t> narrow(DType t, const std::vector<float>& v) {
  std::vector<std::uint16_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) ops::ref::store_float(t, v[i], out.data(), i);
  return out;
}

std::vector<float> widen(DType t, const std::vector<std::uint16_t>& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = ops::ref::load_float(t, v.data(), i);
  return out;
}

// A device operand of dtype t holding `values` rounded to t; `stored` gets what was stored.
DeviceBytes operand(DType t, const std::vector<float>& values, std::vector<float>& stored, std::size_t offset) {
  if (t == DType::f32) {
    stored = values;
    return DeviceBytes::from(values, offset);
  }
  auto n = narrow(t, values);
  stored = widen(t, n);
  return DeviceBytes::from(n, offset);
}

std::vector<float> result(DType t, const DeviceBytes& d) {
  return t == DType::f32 ? d.download<float>() : widen(t, d.download<std::uint16_t>());
}

float half_ulp(DType t) {
  return t == DType::bf16 ? 1.0f / 256 : t == DType::f16 ? 1.0f / 2048 : 0.0f;
}

TEST(GemmDtypes, NarrowOperandsMatchReference) {
  auto& dev = TestDevice::get();
  // 9 x 4200 x 40: 66 panels, packed by the product's own work-items where B is transposed.
  const Case shapes[] = {{7, 13, 5}, {65, 63, 17}, {7, 21, 2200}, {13, 64, 2200}, {9, 4200, 40}};
  for (const DtypeCase& d : kDtypeCases) {
    for (const Case& shape : shapes) {
      if (too_large_for_this_run(shape.M * shape.N * shape.K)) continue;
      const ops::GemmShape s{shape.M, shape.N, shape.K, d.trans_a, d.trans_b, d.a, d.b, d.c};
      const std::string what =
          fmt::format("{} {}x{}x{} {}{} {}*{}->{} beta {}", d.kernel, s.M, s.N, s.K, s.trans_a ? "T" : "N",
                      s.trans_b ? "T" : "N", ops::dtype_name(d.a), ops::dtype_name(d.b), ops::dtype_name(d.c), d.beta);
      std::vector<float> a, b, c0;
      DeviceBytes da = operand(d.a, random_vector(s.M * s.K, 31), a, 3);
      DeviceBytes db = operand(d.b, random_vector(s.K * s.N, 32), b, 5);
      DeviceBytes dc = operand(d.c, random_vector(s.M * s.N, 33), c0, 9);
      const auto bias = random_vector(s.N, 34);
      DeviceTensor dbias(bias, 2);
      ops::GemmOptions options;
      options.backend = ops::GemmBackend::ferry;
      options.kernel = d.kernel;
      options.bias = dbias.span();
      const std::size_t scratch_elems = ops::gemm_scratch_elems(dev.env, s, options);
      DeviceTensor scratch(std::max<std::size_t>(scratch_elems, 1), 4);
      ops::run_blocking(dev.context.compute(), ops::gemm(dev.env, s, 0.75f, da.span(), db.span(), d.beta, dc.span(),
                                                         scratch_elems ? scratch.span() : ops::DeviceSpan{}, options));
      const auto want = reference(s, 0.75f, a, b, d.beta, c0, bias);
      expect_near(result(d.c, dc), want, 2e-6f * static_cast<float>(s.K) + 1e-5f, half_ulp(d.c) + 1e-4f, what.c_str());
      for (unsigned char byte : dc.tail()) ASSERT_EQ(byte, 0xA5) << what << ": written past C";
    }
  }
}

// A strided batch (GemmShape::batch, the batched matmul's product) through everything else the
// GEMM does, every kernel family: beta and a bias on every product, narrow storage, transposes, a
// long K split (each product's partial products summed on their own) and a small B read in place.
// Nothing past the last product is written.
TEST(GemmBatch, EveryProductMatchesReference) {
  auto& dev = TestDevice::get();
  struct BatchCase {
    std::size_t batch, M, N, K;
    bool trans_a, trans_b;
    DType a, b, c;
  };
  const BatchCase cases[] = {
      {3, 7, 13, 5, false, false, DType::f32, DType::f32, DType::f32},      // B in place, last panel partial
      {3, 17, 40, 23, true, true, DType::f32, DType::f32, DType::f32},      // B packed
      {2, 6, 20, 2100, true, false, DType::f32, DType::f32, DType::f32},    // K split in five
      {3, 9, 33, 11, false, true, DType::f16, DType::bf16, DType::f16},     // narrow storage
      {2, 5, 64, 2100, false, false, DType::bf16, DType::f32, DType::f32},  // narrow A, split, B in place
  };
  // RB=5: every product's packed A ends in a padded block.
  for (const char* kernel :
       {kPacked, "packed RB=5 NV=1 PA=1 KU=2", "tiled TSM=16 TSN=8 TSK=5 WPTM=1 WPTN=1", "naive"}) {
    for (const BatchCase& x : cases) {
      const ops::GemmShape s{x.M, x.N, x.K, x.trans_a, x.trans_b, x.a, x.b, x.c, x.batch};
      if (too_large_for_this_run(s.batch * s.M * s.N * s.K)) continue;
      const std::string what =
          fmt::format("{}: batch {} of {}x{}x{} {}{} {}*{}->{}", kernel, s.batch, s.M, s.N, s.K, s.trans_a ? "T" : "N",
                      s.trans_b ? "T" : "N", ops::dtype_name(s.a), ops::dtype_name(s.b), ops::dtype_name(s.c));
      std::vector<float> a, b, c0;
      DeviceBytes da = operand(s.a, random_vector(s.batch * s.M * s.K, 41), a, 3);
      DeviceBytes db = operand(s.b, random_vector(s.batch * s.K * s.N, 42), b, 5);
      DeviceBytes dc = operand(s.c, random_vector(s.batch * s.M * s.N, 43), c0, 9);
      const auto bias = random_vector(s.N, 44);
      DeviceTensor dbias(bias, 2);
      ops::GemmOptions options;
      options.kernel = kernel;
      options.bias = dbias.span();
      const std::size_t scratch_elems = ops::gemm_scratch_elems(dev.env, s, options);
      DeviceTensor scratch(std::max<std::size_t>(scratch_elems, 1), 4);
      ops::run_blocking(dev.context.compute(), ops::gemm(dev.env, s, 0.75f, da.span(), db.span(), 0.5f, dc.span(),
                                                         scratch_elems ? scratch.span() : ops::DeviceSpan{}, options));
      const auto want = reference(s, 0.75f, a, b, 0.5f, c0, bias);
      expect_near(result(s.c, dc), want, 2e-6f * static_cast<float>(s.K) + 1e-5f, half_ulp(s.c) + 1e-4f, what.c_str());
      for (unsigned char byte : dc.tail()) ASSERT_EQ(byte, 0xA5) << what << ": written past C";
    }
  }
}

// The epilogues on every kernel family: a ReLU (GemmOptions::relu, C = max(0, alpha op(A) op(B) +
// beta C + bias)) and an activation's backward (GemmOptions::dact: C = act'(z) * (...), z stored
// like C). The packed kernel applies them in its epilogue, unsplit and after the sum of K splits,
// over every product of a batch and narrow storage; the other kernels run the activation kernel
// over C after the product. Against the reference product followed by the reference activation.
TEST(GemmEpilogue, ActivationsMatchReference) {
  auto& dev = TestDevice::get();
  struct EpilogueCase {
    std::size_t batch, M, N, K;
    bool trans_a;
    DType c;  // C and z
  };
  const EpilogueCase cases[] = {
      {1, 33, 48, 20, true, DType::f32},     // whole vectors: GELU's slope in the epilogue too
      {1, 65, 63, 17, false, DType::f32},    // last panel partial (GELU: its kernel after the product)
      {1, 21, 64, 2200, true, DType::f32},   // K split (panels of 64): the epilogue in gemm_sum_splits
      {1, 7, 32, 8500, true, DType::f32},    // K split with panels of 16 too
      {2, 9, 33, 11, false, DType::bf16},    // a batch, narrow C and z
      {1, 13, 64, 2200, false, DType::f16},  // K split, narrow C and z
  };
  enum class Epilogue { relu, relu_grad, gelu_grad };
  // Every case on the packed kernel (its epilogue has the most paths); two on the others (each
  // combination is a program build, about 3 s on PoCL).
  for (const char* kernel : {kPacked, kPackedA, kTiled, "naive"}) {
    const bool packed = std::string_view(kernel).starts_with("packed");
    for (const Epilogue e : {Epilogue::relu, Epilogue::relu_grad, Epilogue::gelu_grad}) {
      for (const EpilogueCase& x : cases) {
        if (!packed && &x != &cases[0] && &x != &cases[4]) continue;
        const ops::GemmShape s{x.M, x.N, x.K, x.trans_a, false, DType::f32, DType::f32, x.c, x.batch};
        if (too_large_for_this_run(s.batch * s.M * s.N * s.K)) continue;
        const char* name = e == Epilogue::relu        ? "ReLU"
                           : e == Epilogue::relu_grad ? "ReLU derivative"
                                                      : "GELU derivative";
        const std::string what = fmt::format("{}: {}, batch {} of {}x{}x{} {}N -> {}", kernel, name, s.batch, s.M, s.N,
                                             s.K, s.trans_a ? "T" : "N", ops::dtype_name(s.c));
        const std::size_t mn = s.batch * s.M * s.N;
        const auto a = random_vector(s.batch * s.M * s.K, 51), b = random_vector(s.batch * s.K * s.N, 52);
        std::vector<float> c0, z;
        DeviceBytes dc = operand(s.c, random_vector(mn, 53), c0, 9);
        DeviceBytes dz = operand(s.c, random_vector(mn, 54), z, 6);
        const auto bias = random_vector(s.N, 55);
        DeviceTensor da(a, 3), db(b, 5), dbias(bias, 2);
        ops::GemmOptions options;
        options.kernel = kernel;
        options.bias = dbias.span();
        options.relu = e == Epilogue::relu;
        if (e != Epilogue::relu) {
          options.dact_input = dz.span();
          options.dact = e == Epilogue::relu_grad ? ops::Activation::relu : ops::Activation::gelu;
        }
        const std::size_t scratch_elems = ops::gemm_scratch_elems(dev.env, s, options);
        DeviceTensor scratch(std::max<std::size_t>(scratch_elems, 1), 4);
        ops::run_blocking(dev.context.compute(),
                          ops::gemm(dev.env, s, 0.75f, da.span(), db.span(), 0.5f, dc.span(),
                                    scratch_elems ? scratch.span() : ops::DeviceSpan{}, options));
        // The product rounded to C's type (as the unfused path stores it), then the activation.
        std::vector<float> product = reference(s, 0.75f, a, b, 0.5f, c0, bias), want(mn);
        if (s.c != DType::f32) product = widen(s.c, narrow(s.c, product));
        if (e == Epilogue::relu) {
          ops::ref::activation_forward<float>(ops::Activation::relu, product, want);
        } else {
          ops::ref::activation_backward<float>(options.dact, z, product, want);
        }
        expect_near(result(s.c, dc), want, 2e-6f * static_cast<float>(s.K) + 1e-5f, 2 * half_ulp(s.c) + 1e-4f,
                    what.c_str());
        for (unsigned char byte : dc.tail()) ASSERT_EQ(byte, 0xA5) << what << ": written past C";
      }
    }
  }
}

// The fusion pass relies on this: an activation's derivative in the epilogue gives the bits of the
// product stored and then passed through relu_backward or gelu_backward (a narrow C's product is
// rounded to its type before the derivative multiplies it, as the unfused pair does). N = 40: rows
// end in a partial chunk, so lanes the epilogue takes 16 wide the activation kernel takes one by
// one and the other way round.
TEST(GemmEpilogue, DerivativeIsBitIdenticalToTheUnfusedKernels) {
  auto& dev = TestDevice::get();
  for (const char* kernel : {"", kTiled}) {  // the device's row (packed on a CPU), and the GPU kernel
    for (const auto& [act, t] :
         {std::pair{ops::Activation::relu, DType::f32}, std::pair{ops::Activation::relu, DType::bf16},
          std::pair{ops::Activation::gelu, DType::f32}, std::pair{ops::Activation::gelu, DType::bf16},
          std::pair{ops::Activation::gelu, DType::f16}}) {
      for (const ops::GemmShape s :
           {ops::GemmShape{8, 48, 48, false, true, t, t, t}, ops::GemmShape{9, 40, 48, false, true, t, t, t},
            ops::GemmShape{21, 64, 2200, true, false, t, t, t}, ops::GemmShape{7, 32, 8500, true, false, t, t, t}}) {
        if (*kernel && s.K > 48) continue;  // the tiled kernel has no split: one shape is enough
        // K split with any panel width (2200: panels of 64 only); not on Oclgrind (FERRY_TEST_SMALL).
        if (s.K > 2200 && too_large_for_this_run(s.M * s.N * s.K)) continue;
        const std::string what =
            fmt::format("{} {} {}x{}x{} {}", *kernel ? kernel : "default",
                        act == ops::Activation::relu ? "ReLU" : "GELU", s.M, s.N, s.K, ops::dtype_name(t));
        std::vector<float> a, b, z, c0;
        DeviceBytes da = operand(t, random_vector(s.M * s.K, 61), a, 3);
        DeviceBytes db = operand(t, random_vector(s.K * s.N, 62), b, 5);
        DeviceBytes dz = operand(t, random_vector(s.M * s.N, 63), z, 6);
        DeviceBytes fused = operand(t, std::vector<float>(s.M * s.N, 0.0f), c0, 9);
        DeviceBytes plain = operand(t, std::vector<float>(s.M * s.N, 0.0f), c0, 9);
        ops::GemmOptions options;
        options.kernel = kernel;
        const std::size_t scratch_elems = ops::gemm_scratch_elems(dev.env, s, options);
        DeviceTensor scratch(std::max<std::size_t>(scratch_elems, 1), 4);
        const ops::DeviceSpan sc = scratch_elems ? scratch.span() : ops::DeviceSpan{};
        ops::run_blocking(dev.context.compute(),
                          ops::gemm(dev.env, s, 1.0f, da.span(), db.span(), 0.0f, plain.span(), sc, options));
        ops::run_blocking(dev.context.compute(),
                          ops::activation_backward(dev.env, act, dz.span(), plain.span(), plain.span(), s.M * s.N, t));
        options.dact_input = dz.span();
        options.dact = act;
        ops::run_blocking(dev.context.compute(),
                          ops::gemm(dev.env, s, 1.0f, da.span(), db.span(), 0.0f, fused.span(), sc, options));
        const std::vector<float> got = result(t, fused), want = result(t, plain);
        ASSERT_EQ(got.size(), want.size());
        std::size_t differ = 0;
        for (std::size_t i = 0; i < got.size(); ++i)
          differ += std::bit_cast<std::uint32_t>(got[i]) != std::bit_cast<std::uint32_t>(want[i]);
        EXPECT_EQ(differ, 0u) << what << ": elements whose bits differ";
      }
    }
  }
}

TEST(GemmEpilogue, ActivationDerivativeRefusesTheReluAndPlanes) {
  auto& dev = TestDevice::get();
  DeviceTensor a(std::vector<float>(4, 1.0f)), b(std::vector<float>(4, 1.0f)), c(std::vector<float>(4, 0.0f)),
      z(std::vector<float>(4, 1.0f));
  ops::GemmOptions options;
  options.dact_input = z.span();
  options.relu = true;
  EXPECT_THROW(ops::gemm(dev.env, {2, 2, 2}, 1.0f, a.span(), b.span(), 0.0f, c.span(), {}, options),
               std::invalid_argument);
}

// The overflow guard over C (GemmOptions::guard): one element of C made infinite (1e30 * 1e30 at
// row M-1, column N-1, where edge tiles and partial vectors store it) sets the guard to NaN; a
// finite C leaves it as it was; C is what the product stores without the guard, bit for bit. The
// packed and tiled kernels check in their epilogues, split K in its sum, the naive kernel and a
// ReLU run after the product are followed by a check.
TEST(GemmGuard, NotFiniteElementOfCSetsTheGuard) {
  auto& dev = TestDevice::get();
  struct GuardCase {
    const char* kernel;
    ops::GemmShape s;
    bool relu;
  };
  const GuardCase cases[] = {
      {kPacked, {37, 45, 29, false, false}, false},
      {kPackedA, {45, 37, 29, true, false}, false},
      {kPacked, {40, 24, 4096, true, false}, false},                       // K split: the sum checks
      {"packed RB=6 NV=1 KU=4 WB=8", {45, 512, 600, true, false}, false},  // K in chunks: the last checks
      {kPacked, {21, 33, 17, false, true}, true},                          // the ReLU in the epilogue, then the check
      {"tiled TSM=32 TSN=32 TSK=8 WPTM=4 WPTN=2 VW=2 VG=4", {37, 45, 29, false, true}, false},
      {"tiled TSM=32 TSN=32 TSK=8 WPTM=2 WPTN=2 SK=1", {96, 32, 300, true, false}, false},  // split on 2 units
      {"naive", {13, 7, 5, false, false}, true},
  };
  for (const GuardCase& x : cases) {
    const ops::GemmShape& s = x.s;
    if (too_large_for_this_run(s.M * s.N * s.K * 5)) continue;
    for (const bool infinite : {false, true}) {
      const std::string what = fmt::format("{} {}x{}x{}{} {}", x.kernel, s.M, s.N, s.K, x.relu ? " relu" : "",
                                           infinite ? "infinite" : "finite");
      auto a = random_vector(s.M * s.K, 61), b = random_vector(s.K * s.N, 62);
      if (infinite) {
        a[s.trans_a ? s.M - 1 : (s.M - 1) * s.K] = 1e30f;  // A(M-1, 0)
        b[s.trans_b ? (s.N - 1) * s.K : s.N - 1] = 1e30f;  // B(0, N-1)
      }
      DeviceTensor da(a, 3), db(b, 5), plain_c(std::vector<float>(s.M * s.N, 0.0f), 7),
          guarded_c(std::vector<float>(s.M * s.N, 0.0f), 9), guard(std::vector<float>{2.5f}, 1);
      ops::GemmOptions options;
      options.backend = ops::GemmBackend::ferry;
      options.kernel = x.kernel;
      options.relu = x.relu;
      const std::size_t scratch_elems = ops::gemm_scratch_elems(dev.env, s, options);
      DeviceTensor scratch(std::max<std::size_t>(scratch_elems, 1), 11);
      const ops::DeviceSpan sc = scratch_elems ? scratch.span() : ops::DeviceSpan{};
      ops::run_blocking(dev.context.compute(),
                        ops::gemm(dev.env, s, 1.0f, da.span(), db.span(), 0.0f, plain_c.span(), sc, options));
      options.guard = guard.span();
      ops::run_blocking(dev.context.compute(),
                        ops::gemm(dev.env, s, 1.0f, da.span(), db.span(), 0.0f, guarded_c.span(), sc, options));
      const std::vector<float> plain = plain_c.download(), guarded = guarded_c.download();
      EXPECT_EQ(std::memcmp(plain.data(), guarded.data(), plain.size() * sizeof(float)), 0) << what;
      EXPECT_EQ(std::isinf(plain.back()), infinite) << what;  // +inf: the ReLU keeps it
      const float g = guard.download()[0];
      if (infinite) {
        EXPECT_TRUE(std::isnan(g)) << what << ": guard " << g;
      } else {
        EXPECT_EQ(g, 2.5f) << what;
      }
    }
  }
}

TEST(GemmGuard, NeedsAnF32CInRows) {
  auto& dev = TestDevice::get();
  DeviceTensor a(std::vector<float>(4, 1.0f)), b(std::vector<float>(4, 1.0f)), guard(std::vector<float>{0.0f});
  DeviceBytes c(4, 2);
  ops::GemmOptions options;
  options.guard = guard.span();
  try {
    ops::gemm(dev.env, {2, 2, 2, false, false, DType::f32, DType::f32, DType::bf16}, 1.0f, a.span(), b.span(), 0.0f,
              c.span(), {}, options);
    ADD_FAILURE() << "a bf16 C with the guard was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("f32 C"), std::string::npos) << e.what();
  }
}

// A product whose A outgrows the device's cache share runs its row blocks in groups (see
// gemm_packed): 600 rows of K = 1024 are 100 blocks of 6, in groups of fewer, the last one
// partial, with A read in place and (transposed) packed, B's last panel partial.
TEST(GemmTraversal, GroupedRowBlocksMatchReference) {
  auto& dev = TestDevice::get();
  const ops::GemmShape shape{600, 80, 1024};
  if (too_large_for_this_run(shape.M * shape.N * shape.K)) GTEST_SKIP() << "FERRY_TEST_SMALL: a large shape";
  const std::uint32_t group = ops::gemm_traversal_group_blocks(dev.env, shape, 6);
  if (group == 0) GTEST_SKIP() << "this device reports a cache that holds all of A: no groups";
  ASSERT_LT(group, 100u);
  for (const auto& [kernel, trans_a] : {std::pair{"packed RB=6 NV=1", false}, std::pair{kPackedA, true}}) {
    ops::GemmShape s = shape;
    s.trans_a = trans_a;
    ops::GemmOptions options;
    options.backend = ops::GemmBackend::ferry;
    options.kernel = kernel;
    check_gemm(s, options, 0.75f, -0.5f, true, fmt::format("{} grouped by {} blocks", kernel, group));
  }
}

// kPacked's options by name.
ops::GemmOptions packed_options() {
  ops::GemmOptions options;
  options.backend = ops::GemmBackend::ferry;
  options.kernel = kPacked;
  return options;
}

// What gemm() binds for shape `s` (operands uninitialised: the binding is what is looked at): each
// launch's kernel name and its program's build options, where the binding states what it chose
// that the description does not name (K_CHUNK, C_STREAM).
struct BoundLaunch {
  std::string kernel, build_options;
};
std::vector<BoundLaunch> bound_launches(const ops::GemmShape& s, const ops::GemmOptions& options, float beta = 0.0f) {
  auto& dev = TestDevice::get();
  DeviceTensor scratch(std::max<std::size_t>(ops::gemm_scratch_elems(dev.env, s, options), 1)), a(s.batch * s.M * s.K),
      b(s.batch * s.K * s.N), c(s.batch * s.M * s.N);
  auto text = [](auto query, const char* what) {
    std::size_t size = 0;
    cl::check(query(0, nullptr, &size), what);
    std::string out(size, '\0');
    cl::check(query(size, out.data(), nullptr), what);
    return std::string(out.c_str());
  };
  std::vector<BoundLaunch> out;
  for (const ops::KernelLaunch& l :
       ops::gemm(dev.env, s, 1.0f, a.span(), b.span(), beta, c.span(), scratch.span(), options)) {
    cl_program program = nullptr;
    cl::check(clGetKernelInfo(l.kernel.get(), CL_KERNEL_PROGRAM, sizeof program, &program, nullptr), "clGetKernelInfo");
    const cl_device_id device = dev.context.device().id;
    out.push_back(
        {text([&](std::size_t n, char* p,
                  std::size_t* r) { return clGetKernelInfo(l.kernel.get(), CL_KERNEL_FUNCTION_NAME, n, p, r); },
              "clGetKernelInfo"),
         text([&](std::size_t n, char* p,
                  std::size_t* r) { return clGetProgramBuildInfo(program, device, CL_PROGRAM_BUILD_OPTIONS, n, p, r); },
              "clGetProgramBuildInfo")});
  }
  return out;
}

// The kernels, by name, of the launches for shape `s` (kPacked's unless told).
std::vector<std::string> packed_kernel_names(const ops::GemmShape& s,
                                             const ops::GemmOptions& options = packed_options()) {
  std::vector<std::string> names;
  for (const BoundLaunch& l : bound_launches(s, options)) names.push_back(l.kernel);
  return names;
}

// The build options of each gemm_packed launch of `s`.
std::vector<std::string> packed_build_options(const ops::GemmShape& s, const ops::GemmOptions& options,
                                              float beta = 0.0f) {
  std::vector<std::string> out;
  for (const BoundLaunch& l : bound_launches(s, options, beta)) {
    if (l.kernel == "gemm_packed") out.push_back(l.build_options);
  }
  return out;
}

bool all_contain(const std::vector<std::string>& texts, std::string_view word) {
  return !texts.empty() && std::all_of(texts.begin(), texts.end(),
                                       [&](const std::string& t) { return t.find(word) != std::string::npos; });
}

// A transposed f32 A of at most 192 rows, read in place (PA=0) with 16-wide panels and row blocks
// in turn, runs K in chunks of 256 rows whose sums wait in C (ops/gemm.cpp, k_chunk_rows): a K
// that is no multiple of the chunk, a last row block past M, a batch of two (each product parks in
// its own C), B's rows far apart (prefetched, several panels per work-item, a last work-item with
// fewer). The same bits as the unchunked product with A packed (PA=1), which sums each element in
// the same order. Unchunked where C is read (beta != 0), which also matches the reference.
TEST(GemmLayouts, TransposedAInKChunksMatchesReference) {
  auto& dev = TestDevice::get();
  if (!dev.context.device().is_cpu()) GTEST_SKIP() << "the packed kernel is a CPU kernel";
  const std::size_t units = dev.context.device().compute_units;
  if (units > 64) GTEST_SKIP() << "the shapes below leave fewer than four panels per compute unit";
  // Four panels per compute unit: each runs all its row blocks in turn (OWN_PANEL).
  const std::size_t n = 64 * std::max<std::size_t>(1, units);
  ops::GemmOptions chunked = packed_options();
  chunked.kernel = "packed RB=6 NV=1 KU=4 WB=8";
  ops::GemmOptions packed = chunked;
  packed.kernel = "packed RB=6 NV=1 PA=1 KU=4 WB=8";
  // Rows of B 2 KiB apart and more are prefetched a chunk ahead, four panels to a work-item where
  // that leaves four work-items per compute unit: 4 x 4 units + 1 panels leave the last one alone.
  const std::size_t wide = std::max<std::size_t>(512, 256 * units) + 16;
  for (const ops::GemmShape s : {ops::GemmShape{192, n, 1000, true, false}, ops::GemmShape{43, n, 600, true, false},
                                 ops::GemmShape{114, n, 513, true, true},
                                 ops::GemmShape{31, n, 300, true, false, DType::f32, DType::f32, DType::f32, 2},
                                 ops::GemmShape{131, wide, 700, true, false}}) {
    if (too_large_for_this_run(s.batch * s.M * s.N * s.K * 3)) continue;
    const std::string what = fmt::format("{}x{}x{} T{} batch {}", s.M, s.N, s.K, s.trans_b ? "T" : "N", s.batch);
    EXPECT_TRUE(all_contain(packed_build_options(s, chunked), "-DK_CHUNK=256")) << what;
    const bool far_rows = s.N == wide;
    EXPECT_TRUE(all_contain(packed_build_options(s, chunked), far_rows ? "-DPREFETCH_B=1" : "-DPREFETCH_B=0")) << what;
    if (far_rows) {
      EXPECT_TRUE(all_contain(packed_build_options(s, chunked), "-DOWN_PANELS=4")) << what;
    }
    EXPECT_TRUE(all_contain(packed_build_options(s, packed), "-DK_CHUNK=0")) << what;
    EXPECT_TRUE(all_contain(packed_build_options(s, chunked, 0.5f), "-DK_CHUNK=0")) << what << ", beta 0.5";
    const auto a = random_vector(s.batch * s.M * s.K, 71), b = random_vector(s.batch * s.K * s.N, 72);
    auto run = [&](const ops::GemmOptions& o) {
      DeviceTensor da(a, 3), db(b, 5), dc(std::vector<float>(s.batch * s.M * s.N, std::nanf("")), 9),
          scratch(std::max<std::size_t>(ops::gemm_scratch_elems(dev.env, s, o), 1), 4);
      ops::run_blocking(dev.context.compute(),
                        ops::gemm(dev.env, s, 0.75f, da.span(), db.span(), 0.0f, dc.span(), scratch.span(), o));
      return dc.download();
    };
    const std::vector<float> in_chunks = run(chunked), whole = run(packed);
    ASSERT_EQ(in_chunks.size(), whole.size());
    EXPECT_EQ(std::memcmp(in_chunks.data(), whole.data(), whole.size() * sizeof(float)), 0) << what << ": bits";
    if (s.batch == 1) {
      check_gemm(s, chunked, 0.75f, 0.0f, true, what + ", chunked, bias");
      check_gemm(s, chunked, 0.75f, -0.5f, true, what + ", beta -0.5: unchunked");
    } else {
      expect_near(in_chunks, reference(s, 0.75f, a, b, 0.0f, std::vector<float>(s.batch * s.M * s.N, 0.0f), {}),
                  2e-6f * s.K + 1e-5f, 1e-4f, what.c_str());
    }
  }
  // More than 192 rows, a last panel past N, or a K within one chunk: unchunked.
  for (const ops::GemmShape s :
       {ops::GemmShape{193, n, 1000, true, false}, ops::GemmShape{192, n + 8, 1000, true, false},
        ops::GemmShape{192, n, 256, true, false}}) {
    EXPECT_TRUE(all_contain(packed_build_options(s, chunked), "-DK_CHUNK=0")) << s.M << "x" << s.N << "x" << s.K;
  }
}

// An f32 C of at least half the last-level cache, from K of at most 512 rows, or of an eighth of
// it from K of at most 256, is stored past the caches (ops/gemm.cpp, stream_c; C_STREAM in
// gemm_packed.cl): N = 1000 leaves rows whose starts are not 64-byte aligned, which take the
// ordinary store; alpha, beta and a bias.
TEST(GemmLayouts, CStoredPastTheCachesMatchesReference) {
  auto& dev = TestDevice::get();
  if (!dev.context.device().is_cpu()) GTEST_SKIP() << "the packed kernel is a CPU kernel";
  const std::size_t cache = dev.context.device().global_mem_cache_bytes;
  if (cache == 0 || cache > (std::size_t{128} << 20)) GTEST_SKIP() << "last-level cache of " << cache << " bytes";
  const std::size_t n = 1000, m = (cache / 2 / sizeof(float) + n - 1) / n;
  const ops::GemmShape s{m, n, 300}, short_k{m / 2, n, 40};
  if (too_large_for_this_run(s.M * s.N * s.K)) GTEST_SKIP() << "FERRY_TEST_SMALL: a large shape";
  ops::GemmOptions o = packed_options();
  o.kernel = "packed RB=6 NV=1 KU=4 WB=8";
  EXPECT_TRUE(all_contain(packed_build_options(s, o), "-DC_STREAM=1"));
  EXPECT_TRUE(all_contain(packed_build_options({m / 2, n, 300}, o), "-DC_STREAM=0"));
  EXPECT_TRUE(all_contain(packed_build_options(short_k, o), "-DC_STREAM=1"));
  EXPECT_TRUE(all_contain(packed_build_options({m / 2, n, 256}, o), "-DC_STREAM=1"));
  EXPECT_TRUE(all_contain(packed_build_options({m / 2, n, 257}, o), "-DC_STREAM=0"));
  EXPECT_TRUE(all_contain(packed_build_options({m / 16, n, 40}, o), "-DC_STREAM=0"));
  EXPECT_TRUE(all_contain(packed_build_options({m, n, 513}, o), "-DC_STREAM=0"));
  check_gemm(s, o, 0.75f, -0.5f, true, fmt::format("{}x{}x300, C streamed", m, n));
  check_gemm(s, o, 1.0f, 0.0f, false, fmt::format("{}x{}x300, C streamed, beta 0", m, n));
  check_gemm(short_k, o, 0.75f, -0.5f, true, fmt::format("{}x{}x40, C streamed from an eighth", m / 2, n));
}

// Where N leaves the last panel mostly empty, that panel runs in a launch of its own with as many
// vectors as it needs (ops/gemm.cpp, tail_panel): 784 = 12 x 64 + 16 (the MLP's input width), and
// 100 = 64 + 36 with K split into 16 partial products. Every transpose, alpha, beta and a bias.
TEST(GemmLayouts, NarrowLastPanelMatchesReference) {
  auto& dev = TestDevice::get();
  if (!dev.context.device().is_cpu()) GTEST_SKIP() << "the packed kernel is a CPU kernel";
  for (const ops::GemmShape& shape : {ops::GemmShape{512, 784, 512}, ops::GemmShape{128, 100, 8192}}) {
    if (too_large_for_this_run(shape.M * shape.N * shape.K)) GTEST_SKIP() << "FERRY_TEST_SMALL: a large shape";
    for (const bool ta : {false, true}) {
      for (const bool tb : {false, true}) {
        ops::GemmShape s = shape;
        s.trans_a = ta;
        s.trans_b = tb;
        const auto names = packed_kernel_names(s);
        EXPECT_EQ(std::count(names.begin(), names.end(), "gemm_packed"), 2) << s.M << "x" << s.N << "x" << s.K;
        check_gemm(s, packed_options(), 0.75f, -0.5f, true,
                   fmt::format("last panel alone {}x{}x{} {}{}", s.M, s.N, s.K, ta ? "T" : "N", tb ? "T" : "N"));
      }
    }
  }
}

// A transposed B with panels enough for every compute unit is packed by the product's work-items,
// each its own panel (ops/gemm.cpp, own_panel; no gemm_pack_b launch): 4200 columns are 66 panels;
// 32 x 1100 x 8192 has 18 panels times 16 K splits, and 256 x 784 x 1024 13 panels unsplit, whose
// last runs in a launch of its own (one work-item per row block), packed by the first launch's
// work-items, each a share of its k rows (OWN_TAIL). With at most 512 rows each work-item's row
// blocks prefetch the next panel's part of B (PREFETCH_B=2), which changes no bits.
TEST(GemmLayouts, OwnPanelsMatchReference) {
  auto& dev = TestDevice::get();
  if (!dev.context.device().is_cpu()) GTEST_SKIP() << "the packed kernel is a CPU kernel";
  if (dev.context.device().compute_units > 16) {
    GTEST_SKIP() << "these shapes have 66 and 288 work-items, fewer than 4 per compute unit here";
  }
  for (const ops::GemmShape& shape :
       {ops::GemmShape{37, 4200, 129}, ops::GemmShape{32, 1100, 8192}, ops::GemmShape{256, 784, 1024}}) {
    if (too_large_for_this_run(shape.M * shape.N * shape.K)) GTEST_SKIP() << "FERRY_TEST_SMALL: a large shape";
    for (const bool ta : {false, true}) {
      ops::GemmShape s = shape;
      s.trans_a = ta;
      s.trans_b = true;
      const auto names = packed_kernel_names(s);
      EXPECT_EQ(std::count(names.begin(), names.end(), "gemm_pack_b"), 0) << s.M << "x" << s.N << "x" << s.K;
      EXPECT_EQ(std::count(names.begin(), names.end(), "gemm_packed"), s.N == 4200 ? 1 : 2)
          << s.M << "x" << s.N << "x" << s.K;
      // Few rows: the next panel's part of B is prefetched (not by the last panel's own launch).
      const auto built = packed_build_options(s, packed_options());
      ASSERT_FALSE(built.empty());
      EXPECT_NE(built.front().find("-DPREFETCH_B=2"), std::string::npos) << s.M << "x" << s.N << "x" << s.K;
      check_gemm(s, packed_options(), 0.75f, -0.5f, true,
                 fmt::format("own panels {}x{}x{} {}T", s.M, s.N, s.K, ta ? "T" : "N"));
    }
  }
  // More rows: the pack is a small part of each work-item's time, and nothing is prefetched.
  const ops::GemmShape many_rows{600, 4200, 129, false, true};
  const auto names = packed_kernel_names(many_rows);
  EXPECT_EQ(std::count(names.begin(), names.end(), "gemm_pack_b"), 0);
  EXPECT_TRUE(all_contain(packed_build_options(many_rows, packed_options()), "-DPREFETCH_B=0"));
}

// A row-major B with panels 16 wide (the AVX2 row) is packed by the product's work-items too, while
// A fits a quarter of the device's last-level cache (ops/gemm.cpp, own_panel): 263 panels of
// an odd width, 69 panels times 4 K splits, and the MLP's input gradient; A transposed or not.
// With 8 row blocks per work-item where the launch is not an own panel's (WB, ignored there).
TEST(GemmLayouts, OwnPanelsOfRowMajorBMatchReference) {
  auto& dev = TestDevice::get();
  if (!dev.context.device().is_cpu()) GTEST_SKIP() << "the packed kernel is a CPU kernel";
  if (dev.context.device().compute_units > 16) {
    GTEST_SKIP() << "the first shapes have 263 and 276 work-items, fewer than 4 per compute unit would skip own panels";
  }
  ops::GemmOptions o = packed_options();
  o.kernel = kPackedA;
  for (const ops::GemmShape& shape :
       {ops::GemmShape{37, 4200, 129}, ops::GemmShape{32, 1100, 8192}, ops::GemmShape{256, 784, 1024}}) {
    if (too_large_for_this_run(shape.M * shape.N * shape.K)) GTEST_SKIP() << "FERRY_TEST_SMALL: a large shape";
    const bool a_fits = shape.M * shape.K * sizeof(float) <= dev.context.device().global_mem_cache_bytes / 4;
    for (const bool ta : {false, true}) {
      ops::GemmShape s = shape;
      s.trans_a = ta;
      const auto names = packed_kernel_names(s, o);
      EXPECT_EQ(std::count(names.begin(), names.end(), "gemm_pack_b"), a_fits ? 0 : 1)
          << s.M << "x" << s.N << "x" << s.K;
      const auto built = packed_build_options(s, o);
      ASSERT_FALSE(built.empty());
      EXPECT_EQ(built.front().find("-DPREFETCH_B=2") != std::string::npos, a_fits) << s.M << "x" << s.N << "x" << s.K;
      check_gemm(s, o, 0.75f, -0.5f, true, fmt::format("own panels {}x{}x{} {}N", s.M, s.N, s.K, ta ? "T" : "N"));
    }
  }
  // A larger than a quarter of the cache: B packed by its own launch, as before.
  const std::size_t cache = dev.context.device().global_mem_cache_bytes;
  if (cache > 0 && cache / 4 / sizeof(float) / 1024 <= 8192) {
    const ops::GemmShape big{1024, 64, cache / 4 / sizeof(float) / 1024 + 1};
    const auto names = packed_kernel_names(big, o);
    EXPECT_EQ(std::count(names.begin(), names.end(), "gemm_pack_b"), 1) << big.K;
  }
}

// WB row blocks per work-item, the most up to the kernel's that leave the launch at least four
// work-items per compute unit: 10 row blocks by 2 panels lower it (to 1 where even one block per
// work-item is too few), 1000 row blocks keep it; the description names the WB that runs.
TEST(GemmLayouts, RowBlocksPerWorkItemLeaveEveryComputeUnitWork) {
  auto& dev = TestDevice::get();
  if (!dev.context.device().is_cpu()) GTEST_SKIP() << "the packed kernel is a CPU kernel";
  ops::GemmOptions o = packed_options();
  o.kernel = "packed RB=6 NV=1 KU=4 WB=8";
  const std::size_t wanted = 4 * std::max<std::size_t>(1, dev.context.device().compute_units);
  auto wb_of = [&](const ops::GemmShape& s) {
    const std::string desc = ops::gemm_kernel_description(dev.env, s, o);
    const std::size_t at = desc.find("WB=");
    EXPECT_NE(at, std::string::npos) << desc;
    return at == std::string::npos ? 0 : std::stoul(desc.substr(at + 3));
  };
  const std::size_t small = wb_of({60, 32, 512});
  auto items = [](std::size_t wb) { return (10 + wb - 1) / wb * 2; };
  EXPECT_GE(small, 1u);
  EXPECT_LE(small, 8u);
  if (small > 1) {
    EXPECT_GE(items(small), wanted) << small;
  }
  if (small < 8) {
    EXPECT_LT(items(small + 1), wanted) << small;
  }
  if (wanted <= 125) {
    EXPECT_EQ(wb_of({6000, 32, 64}), 8u);
  }
  check_gemm({60, 32, 512}, o, 0.75f, -0.5f, true, fmt::format("WB={} of 8: 60x32x512", small));
}

// A transposed A packed (PA=1) by gemm_pack_a's work-items of PACK_A_TK = 8 k rows and 128 / RB
// row blocks, copying each block's RB values of a k row in vector moves for RB = 4, 6, 8, 12 and 16
// and one by one otherwise (7): M spans two groups of blocks and a last block that repeats row M - 1,
// K is no multiple of 8, and a batch of two runs in the same launches.
TEST(GemmLayouts, TransposedAPacksMatchReference) {
  auto& dev = TestDevice::get();
  if (!dev.context.device().is_cpu()) GTEST_SKIP() << "the packed kernel is a CPU kernel";
  for (const int rb : {4, 6, 7, 8, 12, 16}) {
    const std::size_t m = 2 * static_cast<std::size_t>(128 / rb * rb) + 5;
    ops::GemmOptions o = packed_options();
    o.kernel = fmt::format("packed RB={} NV=1 PA=1", rb);
    const ops::GemmShape s{m, 19, 37, true, false};
    const auto names = packed_kernel_names(s, o);
    EXPECT_EQ(std::count(names.begin(), names.end(), "gemm_pack_a"), 1) << o.kernel;
    check_gemm(s, o, 0.75f, -0.5f, true, fmt::format("{}: {}x19x37 TN", o.kernel, m));
  }
  // The batch: both products' blocks packed, each from its own A.
  const ops::GemmShape s{133, 21, 45, true, false, DType::f32, DType::f32, DType::f32, 2};
  std::vector<float> a = random_vector(s.batch * s.M * s.K, 51), b = random_vector(s.batch * s.K * s.N, 52);
  std::vector<float> c0(s.batch * s.M * s.N, 0.0f);
  DeviceTensor da(a, 3), db(b, 5), dc(c0, 9);
  ops::GemmOptions o = packed_options();
  o.kernel = "packed RB=6 NV=2 PA=1";
  DeviceTensor scratch(ops::gemm_scratch_elems(dev.env, s, o), 4);
  ops::run_blocking(dev.context.compute(),
                    ops::gemm(dev.env, s, 1.0f, da.span(), db.span(), 0.0f, dc.span(), scratch.span(), o));
  expect_near(dc.download(), reference(s, 1.0f, a, b, 0.0f, c0, {}), 2e-6f * s.K + 1e-5f, 1e-4f,
              "a batch of two 133x21x45 TN, A packed");
}

// The last panel alone computes every result as the padded panel did (the same products summed in
// the same order): 256 x 784 x 1024 gives the bits of the first 784 columns of 256 x 832 x 1024
// whose B has 48 more columns.
TEST(GemmLayouts, NarrowLastPanelGivesThePaddedPanelsBits) {
  auto& dev = TestDevice::get();
  if (!dev.context.device().is_cpu()) GTEST_SKIP() << "the packed kernel is a CPU kernel";
  const std::size_t M = 256, N = 784, wide = 832, K = 1024;
  if (too_large_for_this_run(M * wide * K)) GTEST_SKIP() << "FERRY_TEST_SMALL: a large shape";
  const std::vector<float> a = random_vector(M * K, 31), b = random_vector(K * N, 32);
  std::vector<float> b_wide(K * wide, 0.0f);
  for (std::size_t k = 0; k < K; ++k) std::copy_n(b.begin() + k * N, N, b_wide.begin() + k * wide);
  const ops::GemmOptions options = packed_options();
  auto run = [&](const std::vector<float>& bm, std::size_t n, std::size_t want_launches) {
    const ops::GemmShape s{M, n, K};
    DeviceTensor da(a), db(bm), dc(M * n), scratch(ops::gemm_scratch_elems(dev.env, s, options));
    const auto launches = ops::gemm(dev.env, s, 1.0f, da.span(), db.span(), 0.0f, dc.span(), scratch.span(), options);
    EXPECT_EQ(launches.size(), want_launches) << "N = " << n;  // B's pack, the products
    ops::run_blocking(dev.context.compute(), launches);
    return dc.download();
  };
  const std::vector<float> narrow = run(b, N, 3), padded = run(b_wide, wide, 2);
  std::size_t differ = 0;
  for (std::size_t i = 0; i < M; ++i) {
    differ += !std::equal(
        narrow.begin() + i * N, narrow.begin() + (i + 1) * N, padded.begin() + i * wide,
        [](float x, float y) { return std::bit_cast<std::uint32_t>(x) == std::bit_cast<std::uint32_t>(y); });
  }
  EXPECT_EQ(differ, 0u) << "rows whose bits differ";
}

TEST(GemmBatch, OneProductViewsAreRefusedForABatch) {
  auto& dev = TestDevice::get();
  ops::GemmShape s{4, 4, 4};
  s.batch = 2;
  ops::GemmOptions options;
  options.kernel = kPacked;
  options.b_planes = 2;
  try {
    (void)ops::gemm_scratch_elems(dev.env, s, options);
    FAIL() << "a batch with NCHW planes was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("batch 1"), std::string::npos) << e.what();
  }
}

TEST(GemmDtypes, NonFloatOperandIsRejected) {
  auto& dev = TestDevice::get();
  const ops::GemmShape s{4, 4, 4, false, false, DType::i8, DType::f32, DType::f32};
  try {
    (void)ops::gemm_scratch_elems(dev.env, s);
    FAIL() << "an i8 operand was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("i8"), std::string::npos) << e.what();
  }
}

TEST(Gemm, AutomaticFollowsTuningData) {
  auto& dev = TestDevice::get();
  const ops::GemmShape s{37, 1000, 129};
  const std::string desc = ops::gemm_kernel_description(dev.env, s);
  EXPECT_NE(desc.find("gemm.tsv"), std::string::npos) << desc;
  if (dev.context.device().is_cpu()) {
    EXPECT_NE(desc.find("packed"), std::string::npos) << desc;
    // B packed into panels of 16 * NV columns (NV from the row the device got: 4 on AVX-512, 1 on
    // AVX2), N = 1000 padded up to whole panels, K = 129 rows.
    const std::size_t nv_at = desc.find("NV=");
    ASSERT_NE(nv_at, std::string::npos) << desc;
    const std::size_t panel = 16 * std::stoul(desc.substr(nv_at + 3));
    // A is not transposed: not packed whatever PA says.
    EXPECT_EQ(ops::gemm_scratch_elems(dev.env, s), (1000 + panel - 1) / panel * panel * 129u) << desc;
  }
  check_gemm(s, {}, 1.0f, 1.0f, true, "automatic");
}

TEST(Gemm, PackedScratchCoversPaddedPanels) {
  auto& dev = TestDevice::get();
  ops::GemmOptions o;
  o.kernel = "packed RB=4 NV=2";
  EXPECT_EQ(ops::gemm_scratch_elems(dev.env, {5, 33, 7}, o), 64u * 7u);
  EXPECT_EQ(ops::gemm_scratch_elems(dev.env, {5, 32, 7}, o), 32u * 7u);
  // Long K (at least 4 max(M, N) and 4 splits' rows, a split's B sub-panel being at least 128 KiB
  // and 512 rows: 1024 rows with panels of 32 floats) is split, here into five (the last 304
  // rows), each with its own M x N partial product after the panels; with N a multiple of a panel
  // at least 64 wide B is read in place (no panels), narrower panels are packed.
  EXPECT_EQ(ops::gemm_scratch_elems(dev.env, {7, 21, 4400}, o), 32u * 4400u + 5u * 7u * 21u);
  EXPECT_EQ(ops::gemm_scratch_elems(dev.env, {13, 64, 4400}, o), 64u * 4400u + 5u * 13u * 64u);
  EXPECT_EQ(ops::gemm_scratch_elems(dev.env, {7, 21, 4095}, o), 32u * 4095u);  // short of 4096: one pass
  // With panels of 16 floats (NV = 1, the AVX2 row) a split is 2048 rows: K = 4096 runs unsplit.
  o.kernel = "packed RB=4 NV=1";
  EXPECT_EQ(ops::gemm_scratch_elems(dev.env, {7, 21, 4096}, o), 32u * 4096u);
  EXPECT_EQ(ops::gemm_scratch_elems(dev.env, {7, 21, 8500}, o), 32u * 8500u + 5u * 7u * 21u);
  o.kernel = "packed RB=4 NV=2";
  // Packed A (PA=1): a transposed f32 A in blocks of RB = 4 rows after the panels, the last
  // padded; never a bf16 or a row-major f32 A. An f16 A is packed even where the row says PA=0.
  o.kernel = "packed RB=4 NV=2 PA=1";
  EXPECT_EQ(ops::gemm_scratch_elems(dev.env, {5, 33, 7, true, false}, o), 64u * 7u + 8u * 7u);
  EXPECT_EQ(ops::gemm_scratch_elems(dev.env, {5, 33, 7}, o), 64u * 7u);
  EXPECT_EQ(ops::gemm_scratch_elems(dev.env, {5, 33, 7, true, false, DType::bf16}, o), 64u * 7u);
  o.kernel = "packed RB=4 NV=2";
  EXPECT_EQ(ops::gemm_scratch_elems(dev.env, {5, 33, 7, false, false, DType::f16}, o), 64u * 7u + 8u * 7u);
  EXPECT_EQ(ops::gemm_scratch_elems(dev.env, {5, 33, 7, true, false, DType::f16}, o), 64u * 7u + 8u * 7u);
  o.kernel = "packed RB=4 NV=4";
  EXPECT_EQ(ops::gemm_scratch_elems(dev.env, {13, 64, 2200}, o), 5u * 13u * 64u);
  o.kernel = "tiled TSM=16 TSN=16 TSK=4 WPTM=2 WPTN=2";
  EXPECT_EQ(ops::gemm_scratch_elems(dev.env, {5, 33, 7}, o), 0u);
}

TEST(Gemm, BadKernelOptionIsRejected) {
  auto& dev = TestDevice::get();
  ops::GemmOptions o;
  o.kernel = "packed RB=6";  // NV missing
  EXPECT_THROW(ops::gemm_kernel_description(dev.env, {4, 4, 4}, o), std::runtime_error);
  o.kernel = "blocked RB=6 NV=4";
  EXPECT_THROW(ops::gemm_kernel_description(dev.env, {4, 4, 4}, o), std::runtime_error);
  o.kernel = "tiled TSM=30 TSN=32 TSK=8 WPTM=4 WPTN=4";  // 30 % 4 != 0
  EXPECT_THROW(ops::gemm_kernel_description(dev.env, {4, 4, 4}, o), std::runtime_error);
  o.kernel = "tiled TSM=32 TSN=32 TSK=8 WPTM=4 WPTN=4 VG=2";  // float4s or floats
  EXPECT_THROW(ops::gemm_kernel_description(dev.env, {4, 4, 4}, o), std::runtime_error);
  o.kernel = "tiled TSM=16 TSN=8 TSK=5 WPTM=1 WPTN=1 VG=4";  // k steps of 5 are no float4s
  EXPECT_THROW(ops::gemm_kernel_description(dev.env, {4, 4, 4}, o), std::runtime_error);
  o.kernel = "tiled TSM=32 TSN=32 TSK=8 WPTM=4 WPTN=4 RR=16";  // fewer registers than any kernel needs
  EXPECT_THROW(ops::gemm_kernel_description(dev.env, {4, 4, 4}, o), std::runtime_error);
}

// RR (a register cap) is NVIDIA's compiler option: elsewhere the kernel's binding says so rather
// than handing a driver an option it does not know.
TEST(Gemm, RegisterCapNeedsNvidiasCompilerOptions) {
  auto& dev = TestDevice::get();
  if (dev.context.device().has_extension("cl_nv_compiler_options")) GTEST_SKIP() << "this device has them";
  ops::GemmOptions o;
  o.backend = ops::GemmBackend::ferry;
  o.kernel = "tiled TSM=16 TSN=16 TSK=4 WPTM=2 WPTN=2 RR=64";
  DeviceTensor a(std::vector<float>(16, 1.0f), 1), b(std::vector<float>(16, 1.0f), 2), c(std::size_t{16}, 3);
  try {
    ops::gemm(dev.env, {4, 4, 4}, 1.0f, a.span(), b.span(), 0.0f, c.span(), {}, o);
    ADD_FAILURE() << "RR=64 was accepted on " << dev.context.device().name;
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("cl_nv_compiler_options"), std::string::npos) << e.what();
  }
}

TEST(GemmTuning, OverrideFileSelectsKernel) {
  auto& dev = TestDevice::get();
  const ScopedTempFile file("tuning_ok.tsv", "# a comment\n\n*\t*\t*\t\tferry\tnaive\t-\n");
  const std::string& path = file.path();
  ScopedEnv env("FERRY_GEMM_TUNING", path);
  const ops::GemmShape s{9, 70, 3, true, false};
  const std::string desc = ops::gemm_kernel_description(dev.env, s);
  EXPECT_NE(desc.find("naive"), std::string::npos) << desc;
  EXPECT_NE(desc.find(path + ":3"), std::string::npos) << desc;
  EXPECT_EQ(ops::gemm_scratch_elems(dev.env, s), 0u);
  check_gemm(s, {}, 2.0f, 0.0f, true, "override naive TN");
  check_gemm({37, 100, 29, false, true}, {}, 0.5f, 2.0f, true, "override naive NT");
}

// A tiled row from the tuning data shrinks its tile for small products: first along a side of the
// product no longer than half the tile's (that side's tile and results per work-item halved, same
// group), then, for products with fewer tiles than the device has compute units, both (half the
// results per work-item each time, down to 2 x 2); a kernel asked for by name runs as given.
// Results checked at each size.
TEST(GemmTuning, TiledTileShrinksForSmallProducts) {
  auto& dev = TestDevice::get();
  const ScopedTempFile file("tuning_tiled.tsv", "*\t*\t*\t\tferry\ttiled\tTSM=64 TSN=64 TSK=8 WPTM=8 WPTN=8\n");
  const std::string& path = file.path();
  ScopedEnv env("FERRY_GEMM_TUNING", path);
  const std::uint32_t units = dev.context.device().compute_units;
  for (const ops::GemmShape s : {ops::GemmShape{7, 9, 5}, ops::GemmShape{70, 33, 16}, ops::GemmShape{200, 150, 9},
                                 ops::GemmShape{300, 20, 40}}) {
    std::size_t tsm = 64, tsn = 64, wm = 8, wn = 8;
    for (; s.N * 2 <= tsn && wn >= 2; tsn /= 2) wn /= 2;
    for (; s.M * 2 <= tsm && wm >= 2; tsm /= 2) wm /= 2;
    while (((s.M + tsm - 1) / tsm) * ((s.N + tsn - 1) / tsn) < units && wm >= 4 && wn >= 4) {
      tsm /= 2;
      tsn /= 2;
      wm /= 2;
      wn /= 2;
    }
    const std::string want = fmt::format("tiled TSM={} TSN={} TSK=8 WPTM={} WPTN={}", tsm, tsn, wm, wn);
    const std::string desc = ops::gemm_kernel_description(dev.env, s);
    EXPECT_NE(desc.find(want), std::string::npos) << desc << " (" << units << " compute units)";
    check_gemm(s, {}, 1.0f, 0.5f, true, desc.c_str());
  }
  ops::GemmOptions named;
  named.kernel = "tiled TSM=64 TSN=64 TSK=8 WPTM=8 WPTN=8";
  EXPECT_NE(ops::gemm_kernel_description(dev.env, {7, 9, 5}, named).find(named.kernel), std::string::npos);
}

// With float4 loads (VG=4) the fit never halves a tile to a side that is not a multiple of 4: a
// 12 x 12 tile of 3 x 3 work-items stays as it is (6 x 6 would not build).
TEST(GemmTuning, TiledTileKeepsWholeFloat4s) {
  auto& dev = TestDevice::get();
  const ScopedTempFile file("tuning_tiled_vg.tsv", "*\t*\t*\t\tferry\ttiled\tTSM=12 TSN=12 TSK=8 WPTM=4 WPTN=4 VG=4\n");
  const std::string& path = file.path();
  ScopedEnv env("FERRY_GEMM_TUNING", path);
  const ops::GemmShape s{7, 9, 8};  // one tile: the fit would halve it where it could
  const std::string desc = ops::gemm_kernel_description(dev.env, s);
  EXPECT_NE(desc.find("tiled TSM=12 TSN=12 TSK=8 WPTM=4 WPTN=4 VG=4"), std::string::npos) << desc;
  check_gemm(s, {}, 1.0f, 0.5f, true, desc + " (aligned)", true);
}

// The fit never halves the results per work-item below the vector width the kernel reads with.
TEST(GemmTuning, TiledTileKeepsItsVectorWidth) {
  auto& dev = TestDevice::get();
  const ScopedTempFile file("tuning_tiled_vw.tsv", "*\t*\t*\t\tferry\ttiled\tTSM=64 TSN=64 TSK=8 WPTM=8 WPTN=8 VW=4\n");
  const std::string& path = file.path();
  ScopedEnv env("FERRY_GEMM_TUNING", path);
  const ops::GemmShape s{7, 9, 5};  // one tile at any size: halving stops at 4 x 4 per work-item
  const std::string desc = ops::gemm_kernel_description(dev.env, s);
  if (dev.context.device().compute_units > 1) {
    EXPECT_NE(desc.find("tiled TSM=32 TSN=32 TSK=8 WPTM=4 WPTN=4 VW=4"), std::string::npos) << desc;
  }
  check_gemm(s, {}, 1.0f, 0.5f, true, desc.c_str());
}

// A packed row from the tuning data that reads a transposed A in place (PA=0) packs it where its
// rows are a power of two of at least 512 floats apart in a product with K >= 2048 and N >= 256
// (values of successive k steps would share a few cache sets; packing costs a pass over A); other
// transposed or row-major A, and a kernel asked for by name, keep the row's PA. Scratch: B's
// panels (N = 256, K = 2048 rows, unsplit) and, packed, A's 512 x 2048.
TEST(GemmTuning, PackedRowPacksATransposedAWhoseRowsAlias) {
  auto& dev = TestDevice::get();
  const ScopedTempFile file("tuning_packed.tsv", "*\t*\t*\t\tferry\tpacked\tRB=4 NV=1\n");
  ScopedEnv env("FERRY_GEMM_TUNING", file.path());
  const ops::GemmShape aliased{512, 256, 2048, true, false};
  const std::size_t panels = 256u * 2048u;
  std::string desc = ops::gemm_kernel_description(dev.env, aliased);
  EXPECT_NE(desc.find("PA=1"), std::string::npos) << desc;
  EXPECT_EQ(ops::gemm_scratch_elems(dev.env, aliased), panels + 512u * 2048u);
  // Results where large shapes run: a simulator (Oclgrind) would take minutes over these products.
  const bool check_results = !too_large_for_this_run(aliased.M * aliased.N * aliased.K);
  if (check_results) check_gemm(aliased, {}, 1.0f, 0.5f, true, desc);
  // Rows a multiple of 256 floats apart alias too, from K = 768 on.
  for (const ops::GemmShape s :
       {ops::GemmShape{768, 256, 1024, true, false}, ops::GemmShape{1536, 256, 768, true, false}}) {
    desc = ops::gemm_kernel_description(dev.env, s);
    EXPECT_NE(desc.find("PA=1"), std::string::npos) << s.M << "x" << s.N << "x" << s.K << " " << desc;
  }
  for (const ops::GemmShape s :
       {ops::GemmShape{1000, 256, 2048, true, false}, ops::GemmShape{256, 256, 2048, true, false},
        ops::GemmShape{512, 256, 2048, false, false}, ops::GemmShape{512, 256, 512, true, false},
        ops::GemmShape{512, 240, 2048, true, false}, ops::GemmShape{640, 256, 2048, true, false}}) {
    desc = ops::gemm_kernel_description(dev.env, s);
    EXPECT_NE(desc.find("PA=0"), std::string::npos) << s.M << "x" << s.N << "x" << s.K << " " << desc;
  }
  if (check_results) {
    check_gemm({768, 256, 1024, true, false}, {}, 1.0f, 0.5f, true, "768 TN, A packed");
    check_gemm({1000, 256, 2048, true, false}, {}, 1.0f, 0.5f, true, "1000 TN, A read in place");
  }
  ops::GemmOptions named;
  named.kernel = "packed RB=4 NV=1";
  desc = ops::gemm_kernel_description(dev.env, aliased, named);
  EXPECT_NE(desc.find("PA=0"), std::string::npos) << desc;
  EXPECT_EQ(ops::gemm_scratch_elems(dev.env, aliased, named), panels);
}

// A packed row from the tuning data that packs a transposed A (PA=1) reads it in place instead,
// K in chunks, where it has at most 192 rows and the panels are 16 wide (ops/gemm.cpp,
// direct_transposed_a): the default GPT's weight gradients. More rows, wider panels, a K of one
// chunk or a row-major A keep the row's PA; so does a kernel asked for by name. Scratch: no A.
TEST(GemmTuning, PackedRowReadsATransposedAOfFewRowsInPlace) {
  auto& dev = TestDevice::get();
  const ScopedTempFile file("tuning_direct_a.tsv", "*\t*\t*\t\tferry\tpacked\tRB=6 NV=1 PA=1 KU=4 WB=8\n");
  ScopedEnv env("FERRY_GEMM_TUNING", file.path());
  const ops::GemmShape few{192, 192, 4096, true, false};
  std::string desc = ops::gemm_kernel_description(dev.env, few);
  EXPECT_NE(desc.find("PA=0"), std::string::npos) << desc;
  EXPECT_EQ(ops::gemm_scratch_elems(dev.env, few), 192u * 4096u);  // B's panels only
  for (const ops::GemmShape s :
       {ops::GemmShape{193, 192, 4096, true, false}, ops::GemmShape{192, 192, 256, true, false}}) {
    desc = ops::gemm_kernel_description(dev.env, s);
    EXPECT_NE(desc.find("PA=1"), std::string::npos) << s.M << "x" << s.N << "x" << s.K << " " << desc;
  }
  ops::GemmOptions named;
  named.kernel = "packed RB=6 NV=1 PA=1 KU=4 WB=8";
  desc = ops::gemm_kernel_description(dev.env, few, named);
  EXPECT_NE(desc.find("PA=1"), std::string::npos) << desc;
  const ScopedTempFile wide("tuning_direct_a_wide.tsv", "*\t*\t*\t\tferry\tpacked\tRB=6 NV=4 PA=1\n");
  ScopedEnv wide_env("FERRY_GEMM_TUNING", wide.path());
  desc = ops::gemm_kernel_description(dev.env, few);
  EXPECT_NE(desc.find("PA=1"), std::string::npos) << desc;
}

// A weight gradient of many rows and few columns (M > 192 >= N, a multiple of 16) from a packed row
// of the tuning data that packs its transposed A (PA=1) runs as its transpose (ops/gemm.cpp, transposed_product): Cᵀ =
// op(B)ᵀ op(A), a product of few rows whose transposed A is read in place in K chunks, then transposed into C. The same
// bits as the product itself (a kernel asked for by name, which runs as given), the reference, and the overflow guard
// over the result; with beta != 0 or a bias C is computed as it is.
TEST(GemmTuning, PackedRowRunsAWeightGradientOfManyRowsAsItsTranspose) {
  auto& dev = TestDevice::get();
  if (!dev.context.device().is_cpu()) GTEST_SKIP() << "the packed kernel is a CPU kernel";
  const ScopedTempFile file("tuning_transposed.tsv", "*\t*\t*\t\tferry\tpacked\tRB=6 NV=1 PA=1 KU=4 WB=8\n");
  ScopedEnv env("FERRY_GEMM_TUNING", file.path());
  const ops::GemmShape s{208, 64, 600, true, false};
  std::string desc = ops::gemm_kernel_description(dev.env, s);
  EXPECT_NE(desc.find("as its transpose"), std::string::npos) << desc;
  EXPECT_NE(desc.find("PA=0"), std::string::npos) << desc;
  for (const ops::GemmShape other :
       {ops::GemmShape{208, 208, 600, true, false}, ops::GemmShape{200, 64, 600, true, false},
        ops::GemmShape{208, 64, 256, true, false}, ops::GemmShape{208, 64, 600, false, false},
        ops::GemmShape{208, 64, 600, true, true}}) {
    desc = ops::gemm_kernel_description(dev.env, other);
    EXPECT_EQ(desc.find("as its transpose"), std::string::npos)
        << other.M << "x" << other.N << "x" << other.K << (other.trans_a ? " T" : " N") << (other.trans_b ? "T " : "N ")
        << desc;
  }
  auto a = random_vector(s.M * s.K, 81), b = random_vector(s.K * s.N, 82);
  auto run = [&](const ops::GemmOptions& o, DeviceTensor* guard) {
    DeviceTensor da(a, 3), db(b, 5), dc(std::vector<float>(s.M * s.N, std::nanf("")), 9),
        scratch(ops::gemm_scratch_elems(dev.env, s, o), 4);
    ops::GemmOptions with = o;
    if (guard) with.guard = guard->span();
    const auto launches = ops::gemm(dev.env, s, 0.75f, da.span(), db.span(), 0.0f, dc.span(), scratch.span(), with);
    ops::run_blocking(dev.context.compute(), launches);
    return dc.download();
  };
  ops::GemmOptions as_given;
  as_given.kernel = "packed RB=6 NV=1 PA=1 KU=4 WB=8";
  const std::vector<float> transposed = run({}, nullptr), direct = run(as_given, nullptr);
  EXPECT_EQ(std::memcmp(transposed.data(), direct.data(), direct.size() * sizeof(float)), 0) << "bits";
  expect_near(transposed, reference(s, 0.75f, a, b, 0.0f, std::vector<float>(s.M * s.N, 0.0f), {}), 2e-6f * s.K + 1e-5f,
              1e-4f, "208x64x600 TN as its transpose");
  check_gemm(s, {}, 0.75f, -0.5f, true, "208x64x600 TN, beta and a bias: as it is");
  {
    DeviceTensor da(a), db(b), dc(s.M * s.N);  // the transpose's result lives in scratch
    EXPECT_THROW(ops::gemm(dev.env, s, 1.0f, da.span(), db.span(), 0.0f, dc.span(), {}), std::invalid_argument);
  }
  DeviceTensor guard(std::vector<float>{2.5f});
  run({}, &guard);
  EXPECT_EQ(guard.download()[0], 2.5f);
  a[s.M - 1] = 1e30f;  // A(M - 1, 0): A is stored [K, M]
  b[s.N - 1] = 1e30f;  // B(0, N - 1)
  const std::vector<float> overflowed = run({}, &guard);
  EXPECT_TRUE(std::isinf(overflowed.back()));
  EXPECT_TRUE(std::isnan(guard.download()[0]));
  // A row that reads such an A in place (no pack whose scratch the transpose would take over).
  const ScopedTempFile in_place("tuning_transposed_in_place.tsv", "*\t*\t*\t\tferry\tpacked\tRB=6 NV=1 KU=4 WB=8\n");
  ScopedEnv in_place_env("FERRY_GEMM_TUNING", in_place.path());
  desc = ops::gemm_kernel_description(dev.env, s);
  EXPECT_EQ(desc.find("as its transpose"), std::string::npos) << desc;
}

TEST(GemmTuning, BadRowsNameFileAndLine) {
  auto& dev = TestDevice::get();
  const struct {
    const char* text;
    const char* expect;
  } bad[] = {
      {"# ok\ncpu\t*\t*\tferry\tpacked\tRB=6 NV=4 XX=1\n", ":2: kernel packed has no parameter 'XX'"},
      {"gpu\t*\t*\tferry\ttiled\tTSM=64\n", ":1: kernel tiled needs parameter"},
      {"\n\ncpu\t*\t*\tferry\tpacked\n", ":3: expected 6 tab-separated fields"},
      {"phone\t*\t*\tferry\tnaive\t-\n", ":1: device type 'phone'"},
      {"*\t*\t*\tcublas\tnaive\t-\n", ":1: backend 'cublas'"},
      {"*\t*\t*\tferry\tpacked\tRB=0 NV=4\n", ":1: RB=0 is not an integer"},
      {"*\t*\t*\tferry\ttiled\tTSM=64 TSN=64 TSK=8 WPTM=2 WPTN=2 VW=4\n", ":1: tiled needs VW = 1, 2 or 4, dividing"},
      {"gpu\t*\t*\tferry\tnaive\t-\n", "has no row for device"},  // valid, but matches no CPU
  };
  int i = 0;
  for (const auto& b : bad) {
    const ScopedTempFile file(fmt::format("tuning_bad{}.tsv", i++), b.text);
    const std::string& path = file.path();
    ScopedEnv env("FERRY_GEMM_TUNING", path);
    // (Only on a device that is a CPU and not a GPU: Oclgrind says it is both, and all three types.)
    if (std::string(b.expect) == "has no row for device" &&
        (!dev.context.device().is_cpu() || dev.context.device().is_gpu()))
      continue;
    try {
      ops::gemm_kernel_description(dev.env, {4, 4, 4});
      ADD_FAILURE() << "no error for " << b.text;
    } catch (const std::runtime_error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      EXPECT_NE(msg.find(b.expect), std::string::npos) << msg;
    }
  }
  ScopedEnv env("FERRY_GEMM_TUNING", "/nonexistent/ferry_gemm.tsv");
  EXPECT_THROW(ops::gemm_kernel_description(dev.env, {4, 4, 4}), std::runtime_error);
}

TEST(GemmBackend, EnvironmentOverridesAutomatic) {
  auto& dev = TestDevice::get();
  {
    ScopedEnv env("FERRY_GEMM_BACKEND", "ferry");
    EXPECT_EQ(ops::gemm_kernel_description(dev.env, {4, 4, 4}).rfind("ferry", 0), 0u);
  }
  {
    ScopedEnv env("FERRY_GEMM_BACKEND", "cuda");
    EXPECT_THROW(ops::gemm_kernel_description(dev.env, {4, 4, 4}), std::runtime_error);
  }
  if (!ops::gemm_have_clblast()) {
    ScopedEnv env("FERRY_GEMM_BACKEND", "clblast");
    EXPECT_THROW(ops::gemm_kernel_description(dev.env, {4, 4, 4}), std::runtime_error);
    ops::GemmOptions o;
    o.backend = ops::GemmBackend::clblast;
    EXPECT_THROW(ops::gemm_kernel_description(dev.env, {4, 4, 4}, o), std::runtime_error);
  }
}

// What --json's gemm_tuning names is what runs: with FERRY_GEMM_BACKEND=clblast, CLBlast, not the
// row ferry's kernel would have followed (it named that row while CLBlast ran).
TEST(GemmBackend, TheChoiceNamesTheBackendThatRuns) {
  if (!ops::gemm_have_clblast()) GTEST_SKIP() << "built without CLBlast";
  auto& dev = TestDevice::get();
  {
    ScopedEnv env("FERRY_GEMM_BACKEND", "clblast");
    EXPECT_EQ(ops::gemm_tuning_choice(dev.env).rfind("clblast (FERRY_GEMM_BACKEND=clblast", 0), 0u)
        << ops::gemm_tuning_choice(dev.env);
  }
  ScopedEnv env("FERRY_GEMM_BACKEND", "ferry");
  EXPECT_EQ(ops::gemm_tuning_choice(dev.env).find("clblast"), std::string::npos) << ops::gemm_tuning_choice(dev.env);
}

TEST(GemmBackend, ClblastMatchesReference) {
  if (!ops::gemm_have_clblast()) GTEST_SKIP() << "built without CLBlast";
  auto& dev = TestDevice::get();
  ops::GemmOptions o;
  o.backend = ops::GemmBackend::clblast;
  EXPECT_EQ(ops::gemm_kernel_description(dev.env, {4, 4, 4}, o).rfind("clblast", 0), 0u);
  EXPECT_EQ(ops::gemm_scratch_elems(dev.env, {4, 4, 4}, o), 0u);
  for (const Case& c : {Case{7, 13, 5}, Case{37, 100, 29}}) {
    for (bool t : {false, true}) {
      const ops::GemmShape s{c.M, c.N, c.K, t, t};
      const std::string name = fmt::format("clblast {}x{}x{} {}", c.M, c.N, c.K, t ? "TT" : "NN");
      check_gemm(s, o, 0.75f, -0.5f, true, name + " alpha/beta/bias");
      check_gemm(s, o, 1.0f, 0.0f, false, name + " beta=0 NaN C");
    }
  }
}

// The launch list honours a wait list for the deferred CLBlast call as for kernels: a GEMM (and
// the bias kernel after it) waiting on two user events runs only once both have completed.
//
// This thread flushes and finishes the queue on a worker while it opens the gates one by one,
// reading the GEMM's and the bias kernel's events before each: an implementation may run the
// queue to completion inside clFlush (Oclgrind does, waiting there for the gates), so nothing
// may need clFlush to return before the gates open, and PoCL starts ready commands at once, so
// 100 ms is ample for a GEMM that ignored its wait list. With the barrier in ops/gemm_clblast.cpp
// removed, this test fails on PoCL and on Oclgrind. Every wait is bounded: a driver that does not
// finish within 30 s of the gates opening ends the binary with a message.
TEST(GemmBackend, ClblastWaitsForItsInputs) {
  if (!ops::gemm_have_clblast()) GTEST_SKIP() << "built without CLBlast";
  auto& dev = TestDevice::get();
  const ops::GemmShape s{8, 8, 8};
  const auto a = random_vector(64, 1), b = random_vector(64, 2), bias = random_vector(8, 3);
  DeviceTensor da(a), db(b), dc(64), dbias(bias);
  ops::GemmOptions o;
  o.backend = ops::GemmBackend::clblast;
  o.bias = dbias.span();
  auto launches = ops::gemm(dev.env, s, 1.0f, da.span(), db.span(), 0.0f, dc.span(), {}, o);
  ASSERT_EQ(launches.size(), 2u);  // the CLBlast call, then the bias kernel
  cl_int err = CL_SUCCESS;
  cl::Event gate_a(clCreateUserEvent(dev.context.get(), &err));
  ASSERT_EQ(err, CL_SUCCESS);
  cl::Event gate_b(clCreateUserEvent(dev.context.get(), &err));
  ASSERT_EQ(err, CL_SUCCESS);
  const cl_event wait[] = {gate_a.get(), gate_b.get()};
  cl::Event gemm_done;
  cl::Event done = ops::enqueue(dev.context.compute(), launches, wait, {}, &gemm_done);
  auto state_of = [](const cl::Event& e) {
    cl_int state = -1;  // not CL_COMPLETE (0) if the query fails
    EXPECT_EQ(clGetEventInfo(e.get(), CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof(state), &state, nullptr), CL_SUCCESS);
    return state;
  };
  auto drain = std::async(std::launch::async, [q = dev.context.compute()] {
    cl_int flushed = clFlush(q);
    cl_int finished = clFinish(q);
    return flushed != CL_SUCCESS ? flushed : finished;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_NE(state_of(gemm_done), CL_COMPLETE) << "the CLBlast GEMM ran with both of its input events unset";
  EXPECT_NE(state_of(done), CL_COMPLETE);
  EXPECT_EQ(clSetUserEventStatus(gate_b.get(), CL_COMPLETE), CL_SUCCESS);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_NE(state_of(gemm_done), CL_COMPLETE) << "the CLBlast GEMM ran with one of its two input events unset";
  EXPECT_NE(state_of(done), CL_COMPLETE);
  EXPECT_EQ(clSetUserEventStatus(gate_a.get(), CL_COMPLETE), CL_SUCCESS);
  if (drain.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    std::fprintf(stderr, "FAILED: the queue did not finish within 30 s of the GEMM's input events completing\n");
    std::_Exit(1);
  }
  EXPECT_EQ(drain.get(), CL_SUCCESS);
  EXPECT_EQ(state_of(gemm_done), CL_COMPLETE);
  EXPECT_EQ(state_of(done), CL_COMPLETE);
  expect_near(dc.download(), reference(s, 1.0f, a, b, 0.0f, std::vector<float>(64, 0.0f), bias), 1e-5f, 1e-5f,
              "gated clblast");
}

// The reference's gradients (the GEMMs Linear's backward uses) against finite differences:
// for L = sum(R * C), C = op(A) op(B): dL/dop(A) = R op(B)^T and dL/dop(B) = op(A)^T R.
TEST(GemmReference, GradientsMatchFiniteDifferences) {
  const std::size_t M = 5, N = 4, K = 3;
  const auto a = to_double(random_vector(M * K, 31));
  const auto b = to_double(random_vector(K * N, 32));
  const auto r = to_double(random_vector(M * N, 33));
  const ops::GemmShape fwd{M, N, K};
  auto loss_a = [&](const std::vector<double>& x) {
    std::vector<double> c(M * N);
    ops::ref::gemm<double>(fwd, 1.0, x, b, 0.0, c);
    return weighted_sum(c, r);
  };
  auto loss_b = [&](const std::vector<double>& x) {
    std::vector<double> c(M * N);
    ops::ref::gemm<double>(fwd, 1.0, a, x, 0.0, c);
    return weighted_sum(c, r);
  };
  std::vector<double> da(M * K), db(K * N);
  ops::ref::gemm<double>({M, K, N, false, true}, 1.0, r, b, 0.0, da);  // dA[M,K] = R[M,N] B^T
  ops::ref::gemm<double>({K, N, M, true, false}, 1.0, a, r, 0.0, db);  // dB[K,N] = A^T R[M,N]
  expect_gradient_matches_finite_differences(loss_a, a, da, "dA");
  expect_gradient_matches_finite_differences(loss_b, b, db, "dB");
}

// The layouts convolutions use (packed kernel only): B read as NCHW planes, C written as planes,
// A gathered through offset tables; against the reference on the plain layouts, with K split
// (long K) and not, B transposed and not, and shapes that do not fill the register blocks.
TEST(GemmLayouts, PlanesAndGatherMatchTheReference) {
  auto& dev = TestDevice::get();
  if (!ops::gemm_takes_planes(dev.env)) GTEST_SKIP() << "the device's GEMM does not take planes";
  struct Case {
    std::size_t M, N, K, planes_b, planes_c;
    bool trans_b;
    std::size_t run = 0;  // GemmOptions::a_gather_run (the gapped rows below are K + 3 apart)
  };
  // The long-K ones split K (K >= 2048 and 4 max(M, N)); the 5th and 6th are small enough for
  // FERRY_TEST_SMALL; the last four read A in runs (a_gather_run).
  for (const Case& c :
       {Case{35, 21, 19, 7, 7, false}, Case{35, 21, 19, 19, 5, true}, Case{26, 40, 4800, 96, 13, true},
        Case{49, 66, 3000, 11, 49, false}, Case{11, 12, 2200, 100, 11, true}, Case{7, 22, 2200, 11, 7, false},
        Case{35, 21, 19, 7, 7, false, 7}, Case{35, 21, 19, 19, 5, true, 5}, Case{42, 70, 300, 7, 42, false, 14},
        Case{48, 9, 3000, 3, 6, false, 16}}) {
    if (too_large_for_this_run(c.M * c.N * c.K)) continue;
    SCOPED_TRACE(fmt::format("M={} N={} K={} trans_b={} run={}", c.M, c.N, c.K, c.trans_b, c.run));
    const ops::GemmShape s{c.M, c.N, c.K, false, c.trans_b};
    const auto a = random_vector(c.M * c.K, 41), b = random_vector(c.K * c.N, 42), bias = random_vector(c.N, 43);
    // B's stored matrix [rows, cols] laid out as planes of planes_b columns.
    const std::size_t rows = c.trans_b ? c.N : c.K, cols = c.trans_b ? c.K : c.N;
    ASSERT_EQ(cols % c.planes_b, 0u);
    std::vector<float> b_planes(b.size());
    for (std::size_t i = 0; i < rows; ++i) {
      for (std::size_t j = 0; j < cols; ++j) {
        b_planes[((j / c.planes_b) * rows + i) * c.planes_b + j % c.planes_b] = b[i * cols + j];
      }
    }
    // A gathered: a stored with a gap of 3 floats after each row, rows[m] = m (K + 3), cols[k] = k.
    std::vector<float> a_gapped(c.M * (c.K + 3), 0.0f), rows_t(c.M), cols_t(c.K);
    for (std::size_t m = 0; m < c.M; ++m) {
      for (std::size_t k = 0; k < c.K; ++k) a_gapped[m * (c.K + 3) + k] = a[m * c.K + k];
      rows_t[m] = std::bit_cast<float>(static_cast<std::int32_t>(m * (c.K + 3)));
    }
    for (std::size_t k = 0; k < c.K; ++k) cols_t[k] = std::bit_cast<float>(static_cast<std::int32_t>(k));
    DeviceTensor da(a_gapped), db(b_planes), dbias(bias), drows(rows_t), dcols(cols_t), dc(c.M * c.N);
    ops::GemmOptions o;
    o.bias = dbias.span();
    o.b_planes = c.planes_b;
    o.c_planes = c.planes_c;
    o.a_gather_rows = drows.span();
    o.a_gather_cols = dcols.span();
    o.a_gather_run = c.run;
    o.a_gather_step = c.run > 0 ? c.K + 3 : 0;
    DeviceTensor scratch(std::max<std::size_t>(ops::gemm_scratch_elems(dev.env, s, o), 1));
    ops::run_blocking(dev.context.compute(),
                      ops::gemm(dev.env, s, 1.0f, da.span(), db.span(), 0.0f, dc.span(), scratch.span(), o));
    const auto ad = to_double(a), bd = to_double(b), biasd = to_double(bias);
    std::vector<double> ref(c.M * c.N);
    ops::ref::gemm<double>(s, 1.0, ad, bd, 0.0, ref, biasd);
    std::vector<float> expected(ref.size());
    for (std::size_t m = 0; m < c.M; ++m) {
      for (std::size_t n = 0; n < c.N; ++n) {
        expected[((m / c.planes_c) * c.N + n) * c.planes_c + m % c.planes_c] = float(ref[m * c.N + n]);
      }
    }
    expect_near(dc.download(), expected, 5e-7f * float(c.K) + 1e-5f, 1e-5f, "C");
  }
}

TEST(GemmLayouts, GatherRunsAreChecked) {
  auto& dev = TestDevice::get();
  if (!ops::gemm_takes_planes(dev.env)) GTEST_SKIP() << "the device's GEMM does not take planes";
  DeviceTensor a(64), b(64), c(64), t(16), scratch(4096);
  ops::GemmOptions o;
  o.a_gather_rows = t.span();
  o.a_gather_cols = t.span();
  o.a_gather_run = 5;  // M = 8 is no multiple of 5
  o.a_gather_step = 1;
  EXPECT_THROW(ops::gemm(dev.env, {8, 8, 8}, 1.0f, a.span(), b.span(), 0.0f, c.span(), scratch.span(), o),
               std::invalid_argument);
  o.a_gather_run = 17;  // more than a register block holds
  EXPECT_THROW(ops::gemm(dev.env, {17, 8, 8}, 1.0f, a.span(), b.span(), 0.0f, c.span(), scratch.span(), o),
               std::invalid_argument);
}

}  // namespace
}  // namespace ferry::test
