// Elementwise utilities (add, fill, copy): device against the CPU reference, including aliased
// operands and nonzero operand offsets, and the gradient of add against finite differences.
#include <bit>
#include <stdexcept>
#include <string>

#include "ops/elementwise.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

class ElementwiseTest : public ::testing::TestWithParam<std::size_t> {};

TEST_P(ElementwiseTest, AddMatchesReference) {
  const std::size_t n = GetParam();
  auto& dev = TestDevice::get();
  auto a = random_vector(n, 1), b = random_vector(n, 2);
  DeviceTensor da(a, 5), db(b, 11), dout(n, 3);
  ops::run_blocking(dev.context.compute(), ops::add(dev.env, da.span(), db.span(), dout.span(), n));
  std::vector<float> expected(n);
  ops::ref::add<float>(a, b, expected);
  expect_near(dout.download(), expected, 0.0f, 0.0f, "add");
}

TEST_P(ElementwiseTest, AddInPlaceAccumulates) {
  const std::size_t n = GetParam();
  auto& dev = TestDevice::get();
  auto a = random_vector(n, 3), b = random_vector(n, 4);
  DeviceTensor da(a), db(b, 0);
  // a += b twice through the same bound launch: out aliases the first input.
  const ops::LaunchList acc = ops::add(dev.env, da.span(), db.span(), da.span(), n);
  ops::run_blocking(dev.context.compute(), acc);
  ops::run_blocking(dev.context.compute(), acc);
  std::vector<float> expected(n);
  ops::ref::add<float>(a, b, expected);
  ops::ref::add<float>(expected, b, expected);
  expect_near(da.download(), expected, 0.0f, 0.0f, "a += b twice");
}

TEST_P(ElementwiseTest, FillAndCopyMatchReference) {
  const std::size_t n = GetParam();
  auto& dev = TestDevice::get();
  DeviceTensor dfill(n, 13);
  ops::run_blocking(dev.context.compute(), ops::fill(dev.env, dfill.span(), -2.5f, n));
  std::vector<float> expected(n);
  ops::ref::fill<float>(expected, -2.5f);
  expect_near(dfill.download(), expected, 0.0f, 0.0f, "fill");

  auto in = random_vector(n, 5);
  DeviceTensor din(in, 1), dout(n, 9);
  ops::run_blocking(dev.context.compute(), ops::copy(dev.env, din.span(), dout.span(), n));
  ops::ref::copy<float>(in, expected);
  expect_near(dout.download(), expected, 0.0f, 0.0f, "copy");
}

TEST(Elementwise, WritesNothingOutsideItsRange) {
  auto& dev = TestDevice::get();
  const std::size_t n = 70;
  std::vector<float> guard(n + 2, 42.0f);
  DeviceTensor dt(guard, 4);
  // Fill the middle n - 2 elements only; both neighbours must keep their value.
  ops::DeviceSpan mid = dt.span();
  mid.offset_bytes += sizeof(float);
  ops::run_blocking(dev.context.compute(), ops::fill(dev.env, mid, 0.0f, n));
  auto got = dt.download();
  EXPECT_EQ(got.front(), 42.0f);
  EXPECT_EQ(got.back(), 42.0f);
  for (std::size_t i = 1; i <= n; ++i) ASSERT_EQ(got[i], 0.0f) << i;
}

TEST(Elementwise, AddGradientMatchesFiniteDifferences) {
  // d/da sum(r * (a + b)) = r: add passes dy through to both inputs unchanged.
  const std::size_t n = 37;
  auto a = to_double(random_vector(n, 6)), b = to_double(random_vector(n, 7)), r = to_double(random_vector(n, 8));
  auto loss = [&](const std::vector<double>& in) {
    std::vector<double> y(n);
    ops::ref::add<double>(in, b, y);
    return weighted_sum(y, r);
  };
  expect_gradient_matches_finite_differences(loss, a, r, "add");
}

TEST(Elementwise, AddRejectsDtypesItHasNoKernelFor) {
  auto& dev = TestDevice::get();
  DeviceTensor t(8);
  for (ops::DType bad : {ops::DType::i8, ops::DType::u8, ops::DType::i32}) {
    try {
      (void)ops::add(dev.env, t.span(), t.span(), t.span(), 8, bad);
      ADD_FAILURE() << "no exception for " << ops::dtype_name(bad);
    } catch (const std::invalid_argument& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("add"), std::string::npos) << msg;
      EXPECT_NE(msg.find(ops::dtype_name(bad)), std::string::npos) << msg;
    }
  }
}

TEST(Elementwise, AddInF32IsTheDefault) {
  // The f32 build of the typed kernel: bit for bit what the default call computes.
  auto& dev = TestDevice::get();
  const std::size_t n = 1000;
  auto a = random_vector(n, 9, -1e3f, 1e3f), b = random_vector(n, 10, -1e-3f, 1e-3f);
  DeviceTensor da(a), db(b), d1(n), d2(n);
  ops::run_blocking(dev.context.compute(), ops::add(dev.env, da.span(), db.span(), d1.span(), n));
  ops::run_blocking(dev.context.compute(), ops::add(dev.env, da.span(), db.span(), d2.span(), n, ops::DType::f32));
  const auto r1 = d1.download(), r2 = d2.download();
  for (std::size_t i = 0; i < n; ++i)
    ASSERT_EQ(std::bit_cast<std::uint32_t>(r1[i]), std::bit_cast<std::uint32_t>(a[i] + b[i])) << i;
  EXPECT_EQ(r1, r2);
}

INSTANTIATE_TEST_SUITE_P(Sizes, ElementwiseTest, ::testing::Values(1, 3, 63, 64, 257, 1000, 4097));

}  // namespace
}  // namespace ferry::test
