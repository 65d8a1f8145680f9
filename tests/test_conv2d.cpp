// Conv2d: device (im2col + GEMM, direct, Winograd) against the direct-loop CPU reference for
// forward and both backward launches over odd, strided, 1x1 and the CNN's real shapes (including
// batches split into several GEMM groups), the Winograd transforms against the direct sum, and the
// reference backward against double finite differences.
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>

#include "ops/conv2d.hpp"
#include "ops/elementwise.hpp"
#include "ops/gemm.hpp"
#include "ops/quantize_host.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

struct ConvCase {
  std::string name;
  ops::Conv2dShape shape;
  bool bias = true;
};

ops::Conv2dShape with_relu(ops::Conv2dShape s) {
  s.relu = true;
  return s;
}

std::ostream& operator<<(std::ostream& os, const ConvCase& c) {
  return os << c.name;
}

std::size_t x_elems(const ops::Conv2dShape& s) {
  return s.N * s.C * s.H * s.W;
}
std::size_t w_elems(const ops::Conv2dShape& s) {
  return s.K * s.C * s.R * s.S;
}
std::size_t y_elems(const ops::Conv2dShape& s) {
  return s.N * s.K * s.P() * s.Q();
}

// Multiply-adds of the forward (each backward launch does as many).
std::size_t conv_work(const ops::Conv2dShape& s) {
  return y_elems(s) * s.C * s.R * s.S;
}

class Conv2dTest : public ::testing::TestWithParam<ConvCase> {};

void check_against_reference(const ConvCase& tc) {
  const ops::Conv2dShape& s = tc.shape;
  auto& dev = TestDevice::get();
  const auto x = random_vector(x_elems(s), 11);
  const auto w = random_vector(w_elems(s), 12);
  const auto b = random_vector(s.K, 13);
  const auto dy = random_vector(y_elems(s), 14);

  DeviceTensor dx_in(x, 7), dw_in(w, 3), db_in(b, 5), ddy(dy, 9);
  DeviceTensor dyo(y_elems(s), 11), ddx(x_elems(s), 1), ddw(w_elems(s), 13), ddb(s.K, 2);
  DeviceTensor scratch(ops::conv2d_scratch_elems(dev.env, s), 17);
  const ops::DeviceSpan bias = tc.bias ? db_in.span() : ops::DeviceSpan{};
  const ops::DeviceSpan dbias = tc.bias ? ddb.span() : ops::DeviceSpan{};

  ops::run_blocking(dev.context.compute(),
                    ops::conv2d_forward(dev.env, s, dx_in.span(), dw_in.span(), bias, dyo.span(), scratch.span()));
  ops::run_blocking(dev.context.compute(),
                    ops::conv2d_backward_data(dev.env, s, ddy.span(), dw_in.span(), ddx.span(), scratch.span()));
  ops::run_blocking(dev.context.compute(), ops::conv2d_backward_weights(dev.env, s, dx_in.span(), ddy.span(),
                                                                        ddw.span(), dbias, scratch.span()));

  const auto xd = to_double(x), wd = to_double(w), bd = to_double(b), dyd = to_double(dy);
  std::vector<double> y_ref(y_elems(s)), dx_ref(x_elems(s)), dw_ref(w_elems(s)), db_ref(s.K);
  ops::ref::conv2d_forward<double>(s, xd, wd, tc.bias ? std::span<const double>(bd) : std::span<const double>{}, y_ref);
  if (s.relu) {
    for (double& v : y_ref) v = v > 0.0 ? v : 0.0;
  }
  ops::ref::conv2d_backward_data<double>(s, dyd, wd, dx_ref);
  ops::ref::conv2d_backward_weights<double>(s, xd, dyd, dw_ref, db_ref);

  // Float sums of L terms of size ~1 (their magnitude ~sqrt(L)): the rounding error of a running
  // sum grows about like L * eps.
  const auto tol = [](std::size_t terms) { return 5e-7f * float(terms) + 1e-5f; };
  const std::size_t npq = s.N * s.P() * s.Q();
  expect_near(dyo.download(), to_float(y_ref), tol(s.C * s.R * s.S), 1e-5f, "y");
  expect_near(ddx.download(), to_float(dx_ref), tol(s.K * s.R * s.S), 1e-5f, "dx");
  expect_near(ddw.download(), to_float(dw_ref), tol(npq), 1e-5f, "dw");
  if (tc.bias) expect_near(ddb.download(), to_float(db_ref), tol(npq), 1e-5f, "dbias");
}

TEST_P(Conv2dTest, DeviceMatchesReference) {
  if (too_large_for_this_run(conv_work(GetParam().shape))) GTEST_SKIP() << "FERRY_TEST_SMALL: a large shape";
  check_against_reference(GetParam());
}

TEST_P(Conv2dTest, BackwardIsDeterministic) {
  const ConvCase& tc = GetParam();
  const ops::Conv2dShape& s = tc.shape;
  if (conv_work(s) > (std::size_t{1} << 24)) GTEST_SKIP() << "large shape: covered by the small ones";
  if (too_large_for_this_run(conv_work(s))) GTEST_SKIP() << "FERRY_TEST_SMALL: a large shape";
  auto& dev = TestDevice::get();
  DeviceTensor dx_in(random_vector(x_elems(s), 21)), dw_in(random_vector(w_elems(s), 22));
  DeviceTensor ddy(random_vector(y_elems(s), 23));
  DeviceTensor ddx(x_elems(s)), ddw(w_elems(s)), ddb(s.K);
  DeviceTensor scratch(ops::conv2d_scratch_elems(dev.env, s));
  auto data = ops::conv2d_backward_data(dev.env, s, ddy.span(), dw_in.span(), ddx.span(), scratch.span());
  auto weights =
      ops::conv2d_backward_weights(dev.env, s, dx_in.span(), ddy.span(), ddw.span(), ddb.span(), scratch.span());
  ops::run_blocking(dev.context.compute(), data);
  ops::run_blocking(dev.context.compute(), weights);
  const auto dx1 = ddx.download(), dw1 = ddw.download(), db1 = ddb.download();
  ops::run_blocking(dev.context.compute(), data);
  ops::run_blocking(dev.context.compute(), weights);
  EXPECT_EQ(ddx.download(), dx1);
  EXPECT_EQ(ddw.download(), dw1);
  EXPECT_EQ(ddb.download(), db1);
}

ops::Conv2dShape shape(std::size_t N, std::size_t C, std::size_t H, std::size_t W, std::size_t K, std::size_t R,
                       std::size_t S, std::size_t pad, std::size_t stride) {
  ops::Conv2dShape s;
  s.N = N, s.C = C, s.H = H, s.W = W, s.K = K, s.R = R, s.S = S, s.pad = pad, s.stride = stride;
  return s;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Conv2dTest,
    ::testing::Values(ConvCase{"odd_3x3_pad1_stride1", shape(3, 2, 7, 7, 5, 3, 3, 1, 1)},
                      ConvCase{"odd_3x3_pad1_stride2", shape(3, 2, 7, 7, 5, 3, 3, 1, 2)},
                      ConvCase{"rect_5x4_pad2_stride3_nobias", shape(2, 3, 9, 6, 4, 5, 4, 2, 3), false},
                      ConvCase{"1x1", shape(3, 8, 5, 5, 6, 1, 1, 0, 1)},
                      ConvCase{"k1_stride2_odd", shape(3, 5, 9, 7, 17, 1, 1, 0, 2)},
                      ConvCase{"k3_pad0_stride1_odd", shape(5, 3, 11, 9, 33, 3, 3, 0, 1)},
                      ConvCase{"k3_pad1_stride3", shape(2, 4, 10, 13, 7, 3, 3, 1, 3)},
                      ConvCase{"k5_pad1_stride2_c1", shape(3, 1, 13, 12, 19, 5, 5, 1, 2)},
                      ConvCase{"k7_pad3_stride1", shape(2, 3, 11, 10, 70, 7, 7, 3, 1)},
                      ConvCase{"k7_pad2_stride2_nobias", shape(3, 2, 15, 16, 9, 7, 7, 2, 2), false},
                      ConvCase{"k7_equals_input", shape(2, 3, 7, 7, 5, 7, 7, 0, 1)},
                      ConvCase{"direct_wide_rows_q40", shape(2, 2, 9, 40, 13, 3, 3, 1, 1)},
                      ConvCase{"direct_c3_nobias", shape(2, 3, 10, 11, 6, 3, 3, 1, 1), false},
                      // HP = 8 padded rows per plane: LLVM made conv2d_pad's border test a switch on
                      // an i3, which Oclgrind 21.10 took wrongly from the second image on (conv2d.cl).
                      ConvCase{"c1_batch4_6x6_oclgrind_pad_regression", shape(4, 1, 6, 6, 2, 3, 3, 1, 1)},
                      ConvCase{"gather_runs_q12", shape(2, 6, 12, 12, 20, 3, 3, 1, 1)},
                      ConvCase{"relu_gather_runs_q12", with_relu(shape(2, 6, 12, 12, 20, 3, 3, 1, 1))},
                      ConvCase{"relu_direct_c1", with_relu(shape(3, 1, 13, 12, 19, 5, 5, 2, 1))},
                      ConvCase{"relu_k3_pad1_stride2_nobias", with_relu(shape(3, 5, 9, 9, 40, 3, 3, 1, 2)), false},
                      ConvCase{"gather_runs_q12_stride2", shape(2, 6, 24, 23, 20, 3, 3, 1, 2)},
                      // Winograd on CPU devices (stride 1, 3x3 or 5x5, >= 16 channels; the data
                      // gradient too, as a forward): outputs that do not fill the last tile, channels
                      // past a 16 or 32 block, two channel passes, ReLU, no bias.
                      ConvCase{"winograd_k5_odd_tiles", shape(3, 17, 9, 11, 21, 5, 5, 2, 1)},
                      ConvCase{"winograd_k5_pad0", shape(2, 16, 12, 12, 16, 5, 5, 0, 1)},
                      ConvCase{"winograd_k3_pad1_k40", shape(2, 16, 10, 13, 40, 3, 3, 1, 1)},
                      ConvCase{"winograd_k3_pad2", shape(2, 20, 6, 7, 18, 3, 3, 2, 1)},
                      ConvCase{"winograd_relu_k3_c33_nobias", with_relu(shape(2, 33, 8, 8, 16, 3, 3, 0, 1)), false},
                      // Two passes of input channels forward; two blocks of 64 output channels in the
                      // data gradient.
                      ConvCase{"winograd_k3_c70_two_passes", shape(1, 70, 6, 6, 16, 3, 3, 1, 1)},
                      // Two blocks of 16 output channels per work-item with the AVX2 row's block,
                      // small enough for Oclgrind.
                      ConvCase{"winograd_k5_k32_small", shape(1, 16, 5, 5, 32, 5, 5, 2, 1)},
                      ConvCase{"cnn_layer1_two_groups", shape(128, 1, 28, 28, 32, 5, 5, 2, 1)},
                      ConvCase{"cnn_layer2", shape(64, 32, 14, 14, 64, 5, 5, 2, 1)}),
    [](const auto& info) { return info.param.name; });

// The path GPUs take (local-memory tiled GEMM, with the permutes to and from the GEMM layout),
// forced on this device through the tuning override.
// A device operand of dtype t (f32, f16, bf16) holding `values` rounded to t; `stored` gets the
// values as stored.
DeviceBytes conv_operand(ops::DType t, const std::vector<float>& values, std::vector<float>& stored) {
  std::vector<std::uint16_t> narrow(values.size());
  ops::cast_host(ops::DType::f32, t, values.data(), narrow.data(), values.size());
  stored.resize(values.size());
  ops::cast_host(t, ops::DType::f32, narrow.data(), stored.data(), values.size());
  return DeviceBytes::from(narrow, 5);
}

std::vector<float> widened(ops::DType t, const DeviceBytes& d, std::size_t n) {
  const std::vector<std::uint16_t> narrow = d.download<std::uint16_t>();
  std::vector<float> out(n);
  ops::cast_host(t, ops::DType::f32, narrow.data(), out.data(), n);
  return out;
}

// The first layers' direct kernels (few input channels, stride 1) in mixed precision's storage: x,
// w, y, dy and dw f16 or bf16 (the bias and its gradient f32), against the reference on the values
// as stored; y and dw within their rounding. On CPU devices these shapes take the direct kernels.
TEST(Conv2dDtypes, DirectFirstLayersReadAndWriteNarrowStorage) {
  auto& dev = TestDevice::get();
  const ConvCase cases[] = {{"relu_c1_5x5", with_relu(shape(3, 1, 13, 12, 19, 5, 5, 2, 1))},
                            {"c3_nobias", shape(2, 3, 10, 11, 6, 3, 3, 1, 1), false},
                            {"c2_wide_rows_q40", shape(2, 2, 9, 40, 13, 3, 3, 1, 1)}};
  for (const ops::DType t : {ops::DType::bf16, ops::DType::f16}) {
    for (const ConvCase& tc : cases) {
      ops::Conv2dShape s = tc.shape;
      s.act = s.weight = t;
      const std::string what = fmt::format("{} {}", tc.name, ops::dtype_name(t));
      if (ops::gemm_takes_planes(dev.env)) {
        EXPECT_EQ(ops::conv2d_algorithms(dev.env, s).forward, "direct") << what;
        EXPECT_EQ(ops::conv2d_algorithms(dev.env, s).weight_grad, "direct") << what;
      }
      std::vector<float> x, w, dy;
      const DeviceBytes dx_in = conv_operand(t, random_vector(x_elems(s), 41), x);
      const DeviceBytes dw_in = conv_operand(t, random_vector(w_elems(s), 42), w);
      const DeviceBytes ddy = conv_operand(t, random_vector(y_elems(s), 43), dy);
      const auto b = random_vector(s.K, 44);
      DeviceTensor db_in(b, 5), ddb(s.K, 2);
      DeviceBytes dyo(y_elems(s), 2), ddw(w_elems(s), 2);
      DeviceTensor scratch(ops::conv2d_scratch_elems(dev.env, s), 17);
      const ops::DeviceSpan bias = tc.bias ? db_in.span() : ops::DeviceSpan{};
      ops::run_blocking(dev.context.compute(),
                        ops::conv2d_forward(dev.env, s, dx_in.span(), dw_in.span(), bias, dyo.span(), scratch.span()));
      ops::run_blocking(dev.context.compute(),
                        ops::conv2d_backward_weights(dev.env, s, dx_in.span(), ddy.span(), ddw.span(),
                                                     tc.bias ? ddb.span() : ops::DeviceSpan{}, scratch.span()));
      std::vector<double> y_ref(y_elems(s)), dw_ref(w_elems(s)), db_ref(s.K);
      const auto bd = to_double(b);
      ops::ref::conv2d_forward<double>(s, to_double(x), to_double(w),
                                       tc.bias ? std::span<const double>(bd) : std::span<const double>{}, y_ref);
      if (s.relu) {
        for (double& v : y_ref) v = v > 0.0 ? v : 0.0;
      }
      ops::ref::conv2d_backward_weights<double>(s, to_double(x), to_double(dy), dw_ref, db_ref);
      const float rounding = t == ops::DType::bf16 ? 1.0f / 256 : 1.0f / 2048;  // half an ulp, relative
      const std::size_t npq = s.N * s.P() * s.Q();
      expect_near(widened(t, dyo, y_elems(s)), to_float(y_ref), 5e-7f * float(s.C * s.R * s.S) + 1e-5f,
                  rounding + 1e-4f, (what + " y").c_str());
      expect_near(widened(t, ddw, w_elems(s)), to_float(dw_ref), 5e-7f * float(npq) + 1e-5f, rounding + 1e-4f,
                  (what + " dw").c_str());
      if (tc.bias)
        expect_near(ddb.download(), to_float(db_ref), 5e-7f * float(npq) + 1e-5f, 1e-5f, (what + " db").c_str());
      for (unsigned char byte : dyo.tail()) ASSERT_EQ(byte, 0xA5) << what << ": written past y";
      for (unsigned char byte : ddw.tail()) ASSERT_EQ(byte, 0xA5) << what << ": written past dw";
    }
  }
}

TEST(Conv2dTiledPath, MatchesReference) {
  const ScopedTempFile row("conv_tiled.tsv", "*\t*\t*\tferry\ttiled\tTSM=32 TSN=32 TSK=8 WPTM=2 WPTN=2\n");
  ScopedEnv tuning("FERRY_GEMM_TUNING", row.path());
  for (const ConvCase& tc : {ConvCase{"tiled_k3_pad1_stride2", shape(3, 2, 7, 7, 5, 3, 3, 1, 2)},
                             ConvCase{"tiled_k7_pad3", shape(2, 3, 11, 10, 9, 7, 7, 3, 1), false},
                             ConvCase{"tiled_relu_k3", with_relu(shape(2, 3, 8, 9, 9, 3, 3, 1, 1))},
                             ConvCase{"tiled_cnn_layer2", shape(4, 32, 14, 14, 64, 5, 5, 2, 1)}}) {
    SCOPED_TRACE(tc.name);
    if (too_large_for_this_run(conv_work(tc.shape))) continue;
    check_against_reference(tc);
  }
}

// A GEMM tuning row of ferry's packed kernel that matches every device.
std::string packed_row(const std::string& params) {
  return "*\t*\t*\tferry\tpacked\t" + params + "\n";
}

// What gemm() runs on this device for a product wide enough (N = 256) that the packed block is
// not narrowed to fit it, e.g. "ferry packed RB=6 NV=4 NN (ops/tuning/gemm.tsv (embedded):27)".
std::string wide_gemm_kernel(ops::OpEnv& env) {
  ops::GemmShape g;
  g.M = g.N = g.K = 256;
  return ops::gemm_kernel_description(env, g);
}

// The register block of that kernel's row in float16 per row (NV): 4 on the AVX-512 rows of
// ops/tuning/gemm.tsv, 1 on the AVX2 one; 0 for kernels other than ferry's packed one.
int packed_block_width(const std::string& kernel) {
  if (kernel.rfind("ferry packed ", 0) != 0) return 0;
  const std::size_t at = kernel.find(" NV=");
  return at == std::string::npos ? 0 : std::stoi(kernel.substr(at + 4));
}

// The three algorithms the CNN's second layer (C = 32, 5x5, stride 1) gets: Winograd, the
// implicit GEMM over NCHW planes (CPU devices whose GEMM row does not hold the block, or Winograd
// turned off), or im2col + GEMM (devices whose GEMM does not take planes: GPUs).
enum class ConvPath { winograd, planes, columns };
void expect_cnn_layer2_path(ops::OpEnv& env, ConvPath path) {
  const ops::Conv2dAlgorithms cnn = ops::conv2d_algorithms(env, shape(4, 32, 14, 14, 64, 5, 5, 2, 1));
  const ops::Conv2dAlgorithms k3 = ops::conv2d_algorithms(env, shape(4, 16, 10, 13, 40, 3, 3, 1, 1));
  switch (path) {
    case ConvPath::winograd:
      EXPECT_EQ(cnn.forward, "winograd F(2x2,5x5)");
      EXPECT_EQ(cnn.data_grad, "forward of dy: winograd F(2x2,5x5)");
      EXPECT_EQ(cnn.weight_grad, "winograd F(5x5,2x2)");
      EXPECT_EQ(k3.forward, "winograd F(4x4,3x3)");
      break;
    case ConvPath::planes:
      EXPECT_EQ(cnn.forward, "implicit GEMM (planes)");
      EXPECT_EQ(cnn.data_grad, "forward of dy: implicit GEMM (planes)");
      EXPECT_EQ(cnn.weight_grad, "implicit GEMM (planes)");
      EXPECT_EQ(k3.forward, "implicit GEMM (planes)");
      break;
    case ConvPath::columns:
      EXPECT_EQ(cnn.forward, "im2col GEMM");
      EXPECT_EQ(cnn.data_grad, "GEMM + col2im");
      EXPECT_EQ(cnn.weight_grad, "im2col GEMM");
      EXPECT_EQ(k3.forward, "im2col GEMM");
      break;
  }
}

// Which algorithm runs where, and the GEMM path of shapes that take Winograd by default
// (FERRY_CONV_WINOGRAD=0), so both stay covered on CPU devices. Winograd runs on the devices whose
// GEMM takes NCHW planes (ferry's packed kernel), with the register block of their tuning row: 6 x
// 4 float16 on AVX-512 CPUs, 6 x 1 on AVX2 ones (PoCL's pthread-haswell), where a work-item then
// takes several blocks of output channels. Both rows are also forced through FERRY_GEMM_TUNING, and
// the one this device does not get runs a Winograd shape against the reference, so both blocks are
// checked on every CPU device whichever row it really gets.
TEST(Conv2dWinograd, AlgorithmAndGemmPathWhenTurnedOff) {
  auto& env = TestDevice::get().env;
  const bool planes = ops::gemm_takes_planes(env);
  const std::string kernel = wide_gemm_kernel(env);
  SCOPED_TRACE("device '" + TestDevice::get().context.device().name + "', GEMM " + kernel +
               (planes ? ": Winograd expected" : ": no Winograd expected"));
  const ConvPath gemm_path = planes ? ConvPath::planes : ConvPath::columns;
  expect_cnn_layer2_path(env, planes ? ConvPath::winograd : gemm_path);
  // Too few channels, stride 2, 7x7: not Winograd.
  for (const auto& other : {shape(4, 8, 14, 14, 64, 5, 5, 2, 1), shape(4, 32, 14, 14, 64, 5, 5, 2, 2),
                            shape(4, 32, 14, 14, 64, 7, 7, 3, 1)}) {
    EXPECT_EQ(ops::conv2d_algorithms(env, other).forward.rfind("winograd", 0), std::string::npos);
  }

  if (planes) {
    // Each row runs Winograd on any CPU device. One shape (5x5, partial tiles, channels past a block
    // of 16 so that the AVX2 block takes two blocks of output channels, bias) runs against the
    // reference with the row this device does not get; the Conv2dTest cases named winograd_* run
    // its own. (One shape only: each is about ten program builds, 15-20 s on a 2-core PoCL machine.)
    const int own_width = packed_block_width(kernel);
    struct ForcedRow {
      const char* stem;
      const char* params;
      int width;  // NV
    };
    for (const ForcedRow row : {ForcedRow{"avx2", "RB=6 NV=1", 1}, ForcedRow{"avx512", "RB=6 NV=4", 4}}) {
      const ScopedTempFile file(std::string("conv_") + row.stem + ".tsv", packed_row(row.params));
      ScopedEnv tuning("FERRY_GEMM_TUNING", file.path());
      SCOPED_TRACE(std::string("forced row packed ") + row.params);
      const int width = packed_block_width(wide_gemm_kernel(env));
      ASSERT_EQ(width, row.width) << wide_gemm_kernel(env);
      expect_cnn_layer2_path(env, ConvPath::winograd);
      const ConvCase forced{"forced_winograd_k5_odd_tiles", shape(3, 17, 9, 11, 21, 5, 5, 2, 1)};
      if (width != own_width && !too_large_for_this_run(conv_work(forced.shape))) {
        SCOPED_TRACE(forced.name);
        ASSERT_EQ(ops::conv2d_algorithms(env, forced.shape).forward, "winograd F(2x2,5x5)");
        check_against_reference(forced);
      }
      ScopedEnv off("FERRY_CONV_WINOGRAD", "0");
      expect_cnn_layer2_path(env, ConvPath::planes);
    }
  }

  {
    // This device's own row with Winograd turned off: the GEMM path, checked against the reference
    // on the shapes that take Winograd where it is on.
    ScopedEnv off("FERRY_CONV_WINOGRAD", "0");
    expect_cnn_layer2_path(env, gemm_path);
    for (const ConvCase& tc : {ConvCase{"gemm_k5_odd_tiles", shape(3, 17, 9, 11, 21, 5, 5, 2, 1)},
                               ConvCase{"gemm_k3_pad1_k40", shape(2, 16, 10, 13, 40, 3, 3, 1, 1)},
                               ConvCase{"gemm_cnn_layer2", shape(8, 32, 14, 14, 64, 5, 5, 2, 1)}}) {
      SCOPED_TRACE(tc.name);
      if (too_large_for_this_run(conv_work(tc.shape))) continue;
      check_against_reference(tc);
    }
  }
  ScopedEnv bad("FERRY_CONV_WINOGRAD", "sometimes");
  try {
    (void)ops::conv2d_scratch_elems(env, shape(4, 32, 14, 14, 64, 5, 5, 2, 1));
    ADD_FAILURE() << "a bad FERRY_CONV_WINOGRAD was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("FERRY_CONV_WINOGRAD='sometimes'"), std::string::npos) << e.what();
  }
}

// A wide layer's weight gradient keeps one chunk of partial sums (36 x C x K floats, 38 MB here)
// instead of one per work-item (8 here: 300 MB): the scratch stays within twice that chunk (the
// GEMM path's own scratch for the layer is about 1.3 chunks).
TEST(Conv2dWinograd, WideLayerScratchStaysBounded) {
  auto& env = TestDevice::get().env;
  const ops::Conv2dShape wide = shape(2, 512, 16, 16, 512, 3, 3, 1, 1);
  if (ops::conv2d_algorithms(env, wide).weight_grad.rfind("winograd", 0) != 0) GTEST_SKIP() << "no Winograd here";
  const std::size_t one_chunk = 36u * 512 * 512;
  EXPECT_LT(ops::conv2d_scratch_elems(env, wide), 2 * one_chunk);
}

// The transforms compute the 1-D and 2-D correlations exactly (in double), B^T is integral, and
// tiles past alpha = 6 are refused.
TEST(Conv2dWinograd, TransformComputesTheCorrelation) {
  const std::pair<std::size_t, std::size_t> sizes[] = {{2, 3}, {2, 5}, {4, 3}, {3, 3}, {2, 4}, {3, 4}, {2, 2}};
  for (const auto& [m, r] : sizes) {
    SCOPED_TRACE(testing::Message() << "F(" << m << "," << r << ")");
    const ops::WinogradTransform t = ops::winograd_transform(m, r);
    const std::size_t a = t.alpha;
    ASSERT_EQ(a, m + r - 1);
    ASSERT_EQ(t.AT.size(), m * a);
    ASSERT_EQ(t.BT.size(), a * a);
    ASSERT_EQ(t.G.size(), a * r);
    for (double v : t.BT) EXPECT_EQ(v, std::round(v));
    const auto d = to_double(random_vector(a * a, 41)), g = to_double(random_vector(r * r, 42));
    // 2-D: Y = A^T [(G g G^T) (.) (B^T d B)] A against the direct sum.
    std::vector<double> U(a * a, 0.0), V(a * a, 0.0);
    for (std::size_t i = 0; i < a; ++i) {
      for (std::size_t j = 0; j < a; ++j) {
        for (std::size_t k = 0; k < r; ++k) {
          for (std::size_t l = 0; l < r; ++l) U[i * a + j] += t.G[i * r + k] * g[k * r + l] * t.G[j * r + l];
        }
        for (std::size_t k = 0; k < a; ++k) {
          for (std::size_t l = 0; l < a; ++l) V[i * a + j] += t.BT[i * a + k] * d[k * a + l] * t.BT[j * a + l];
        }
      }
    }
    for (std::size_t i = 0; i < m; ++i) {
      for (std::size_t j = 0; j < m; ++j) {
        double y = 0.0, direct = 0.0;
        for (std::size_t k = 0; k < a; ++k) {
          for (std::size_t l = 0; l < a; ++l) y += t.AT[i * a + k] * U[k * a + l] * V[k * a + l] * t.AT[j * a + l];
        }
        for (std::size_t k = 0; k < r; ++k) {
          for (std::size_t l = 0; l < r; ++l) direct += d[(i + k) * a + j + l] * g[k * r + l];
        }
        EXPECT_NEAR(y, direct, 1e-9 * (1.0 + std::abs(direct))) << "y[" << i << "][" << j << "]";
      }
    }
  }
  EXPECT_THROW(ops::winograd_transform(4, 5), std::invalid_argument);
  EXPECT_THROW(ops::winograd_transform(1, 3), std::invalid_argument);
  EXPECT_THROW(ops::winograd_transform(2, 1), std::invalid_argument);
}

TEST(Conv2dGroups, LargeBatchesSplitIntoBalancedGroups) {
  auto& env = TestDevice::get().env;
  // The CNN's first layer at batch 128 writes a column matrix (its data gradient, C = 1, goes
  // through col2im) and splits into 2 groups of 64, which the cnn_layer1_two_groups case checks
  // against the reference. The second layer at batch 64 splits into 3 groups (22 + 21 + 21) where
  // it writes column matrices; with planes and its data gradient as a forward convolution
  // nothing per image is large and the batch is one group.
  EXPECT_EQ(ops::conv2d_images_per_gemm(env, shape(128, 1, 28, 28, 32, 5, 5, 2, 1)), 64u);
  EXPECT_EQ(ops::conv2d_images_per_gemm(env, shape(64, 32, 14, 14, 64, 5, 5, 2, 1)),
            ops::gemm_takes_planes(env) ? 64u : 22u);
  EXPECT_EQ(ops::conv2d_images_per_gemm(env, shape(1, 512, 64, 64, 512, 3, 3, 1, 1)), 1u);
  EXPECT_EQ(ops::conv2d_images_per_gemm(env, shape(3, 2, 7, 7, 5, 3, 3, 1, 1)), 3u);
}

// The reference backward rules against central differences of the reference forward, in double.
class Conv2dGradTest : public ::testing::TestWithParam<ops::Conv2dShape> {};

TEST_P(Conv2dGradTest, ReferenceBackwardMatchesFiniteDifferences) {
  const ops::Conv2dShape s = GetParam();
  const auto x = to_double(random_vector(x_elems(s), 31));
  const auto w = to_double(random_vector(w_elems(s), 32));
  const auto b = to_double(random_vector(s.K, 33));
  const auto r = to_double(random_vector(y_elems(s), 34));
  const auto loss = [&](const std::vector<double>& xv, const std::vector<double>& wv, const std::vector<double>& bv) {
    std::vector<double> y(y_elems(s));
    ops::ref::conv2d_forward<double>(s, xv, wv, bv, y);
    return weighted_sum(y, r);
  };
  std::vector<double> dx(x.size()), dw(w.size()), db(b.size());
  ops::ref::conv2d_backward_data<double>(s, r, w, dx);
  ops::ref::conv2d_backward_weights<double>(s, x, r, dw, db);
  expect_gradient_matches_finite_differences([&](const auto& v) { return loss(v, w, b); }, x, dx, "dx");
  expect_gradient_matches_finite_differences([&](const auto& v) { return loss(x, v, b); }, w, dw, "dw");
  expect_gradient_matches_finite_differences([&](const auto& v) { return loss(x, w, v); }, b, db, "dbias");
}

INSTANTIATE_TEST_SUITE_P(Shapes, Conv2dGradTest,
                         ::testing::Values(shape(2, 2, 5, 5, 3, 3, 3, 1, 1), shape(2, 2, 6, 5, 3, 3, 2, 1, 2),
                                           shape(1, 3, 4, 4, 2, 1, 1, 0, 1), shape(2, 1, 7, 7, 2, 5, 5, 2, 2),
                                           shape(1, 2, 9, 8, 2, 7, 7, 3, 2), shape(1, 2, 5, 6, 3, 1, 1, 0, 2),
                                           shape(1, 1, 8, 9, 2, 7, 7, 0, 1)));

}  // namespace
}  // namespace ferry::test

namespace ferry::test {
namespace {

// Per-launch times of the CNN's conv layers (each launch enqueued and waited alone, so every
// figure includes about 0.1 ms of launch overhead). Run with --gtest_also_run_disabled_tests.
TEST(Conv2dTiming, DISABLED_LaunchTimes) {
  auto& dev = TestDevice::get();
  for (const auto& s : {shape(64, 1, 28, 28, 32, 5, 5, 2, 1), shape(64, 32, 14, 14, 64, 5, 5, 2, 1)}) {
    DeviceTensor x(random_vector(x_elems(s), 1)), w(random_vector(w_elems(s), 2)), b(random_vector(s.K, 3));
    DeviceTensor y(y_elems(s)), dy(random_vector(y_elems(s), 4)), dx(x_elems(s)), dw(w_elems(s)), db(s.K);
    DeviceTensor scratch(ops::conv2d_scratch_elems(dev.env, s));
    const std::pair<const char*, ops::LaunchList> lists[] = {
        {"forward", ops::conv2d_forward(dev.env, s, x.span(), w.span(), b.span(), y.span(), scratch.span())},
        {"backward_data", ops::conv2d_backward_data(dev.env, s, dy.span(), w.span(), dx.span(), scratch.span())},
        {"backward_weights",
         ops::conv2d_backward_weights(dev.env, s, x.span(), dy.span(), dw.span(), db.span(), scratch.span())}};
    {
      // Baseline: a plain copy as large as one group's column matrix (what im2col writes).
      const std::size_t n = s.C * s.R * s.S * ops::conv2d_images_per_gemm(dev.env, s) * s.P() * s.Q();
      DeviceTensor src(n), dst(n);
      const auto list = ops::copy(dev.env, src.span(), dst.span(), n);
      ops::run_blocking(dev.context.compute(), list);
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 5; ++i) ops::run_blocking(dev.context.compute(), list);
      std::printf("C=%zu K=%zu copy of one column matrix (%zu floats): %.2f ms\n", s.C, s.K, n,
                  std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 5);
    }
    for (const auto& [what, list] : lists) {
      ops::run_blocking(dev.context.compute(), list);  // warm up
      const int reps = 5;
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < reps; ++i) ops::run_blocking(dev.context.compute(), list);
      const double total = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      std::printf("C=%zu K=%zu %s: %.2f ms (%zu launches)\n", s.C, s.K, what, total / reps, list.size());
      std::map<std::string, double> per_kernel;
      for (const auto& l : list) {
        char name[128] = {};
        clGetKernelInfo(l.kernel.get(), CL_KERNEL_FUNCTION_NAME, sizeof(name), name, nullptr);
        const ops::LaunchList one{l};
        const auto k0 = std::chrono::steady_clock::now();
        for (int i = 0; i < reps; ++i) ops::run_blocking(dev.context.compute(), one);
        per_kernel[name] +=
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - k0).count() / reps;
      }
      for (const auto& [name, ms] : per_kernel) std::printf("    %-20s %.2f ms\n", name.c_str(), ms);
    }
  }
}

}  // namespace
}  // namespace ferry::test
