// MaxPool2d: device against the CPU reference (values, argmax and the backward gather) for
// non-overlapping and overlapping windows, odd sizes and ties, and the reference backward against
// double finite differences.
#include <bit>
#include <cmath>
#include <cstring>
#include <string>

#include "ferry/ops/cast.hpp"
#include "ops/pool.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

struct PoolCase {
  std::string name;
  ops::Pool2dShape shape;
  bool ties = false;  // inputs drawn from a few integers, so most windows hold equal maxima
};

ops::Pool2dShape with_relu(ops::Pool2dShape s) {
  s.relu = true;
  return s;
}

std::ostream& operator<<(std::ostream& os, const PoolCase& c) {
  return os << c.name;
}

ops::Pool2dShape shape(std::size_t N, std::size_t C, std::size_t H, std::size_t W, std::size_t window,
                       std::size_t stride) {
  ops::Pool2dShape s;
  s.N = N, s.C = C, s.H = H, s.W = W, s.window = window, s.stride = stride;
  return s;
}

std::size_t x_elems(const ops::Pool2dShape& s) {
  return s.N * s.C * s.H * s.W;
}
std::size_t y_elems(const ops::Pool2dShape& s) {
  return s.N * s.C * s.P() * s.Q();
}

std::vector<float> input(const PoolCase& tc, std::uint32_t seed) {
  auto x = random_vector(x_elems(tc.shape), seed, -2.0f, 2.0f);
  if (tc.ties) {
    for (auto& v : x) v = std::round(v);
  }
  return x;
}

// argmax lives in a float tensor's storage (int32 and float are both 4 bytes).
std::vector<std::int32_t> as_ints(const std::vector<float>& v) {
  std::vector<std::int32_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = std::bit_cast<std::int32_t>(v[i]);
  return out;
}

class MaxPoolTest : public ::testing::TestWithParam<PoolCase> {};

TEST_P(MaxPoolTest, DeviceMatchesReference) {
  const PoolCase& tc = GetParam();
  const ops::Pool2dShape& s = tc.shape;
  auto& dev = TestDevice::get();
  const auto x = input(tc, 1);
  const auto dy = random_vector(y_elems(s), 2);
  DeviceTensor dx_in(x, 7), dyo(y_elems(s), 3), darg(y_elems(s), 5), ddy(dy, 11), ddx(x_elems(s), 13);

  ops::run_blocking(dev.context.compute(), ops::maxpool2d_forward(dev.env, s, dx_in.span(), dyo.span(), darg.span()));
  ops::run_blocking(dev.context.compute(), ops::maxpool2d_backward(dev.env, s, ddy.span(), darg.span(), ddx.span()));

  std::vector<float> y_ref(y_elems(s)), dx_ref(x_elems(s));
  std::vector<std::int32_t> arg_ref(y_elems(s));
  ops::ref::maxpool2d_forward<float>(s, x, y_ref, arg_ref);
  ops::ref::maxpool2d_backward<float>(s, dy, arg_ref, dx_ref);

  // Max and the gather are exact: the device sums contributions in the reference's order.
  EXPECT_EQ(dyo.download(), y_ref);
  EXPECT_EQ(as_ints(darg.download()), arg_ref);
  EXPECT_EQ(ddx.download(), dx_ref);
}

// f16 and bf16 storage: the same windows on the rounded inputs. A maximum and a routed gradient are
// stored values, so forward and the 2 x 2 backward are exact; overlapping windows sum in f32 and
// round once, as the reference's sum rounded. The 2 x 2 kernels take eight windows at a time,
// narrow rows widened and rounded 16 wide.
TEST_P(MaxPoolTest, NarrowStorageMatchesTheReferenceOfTheRoundedInputs) {
  const PoolCase& tc = GetParam();
  auto& dev = TestDevice::get();
  for (const ops::DType t : {ops::DType::f16, ops::DType::bf16}) {
    SCOPED_TRACE(ops::dtype_name(t));
    ops::Pool2dShape s = tc.shape;
    s.dtype = t;
    auto narrow = [&](const std::vector<float>& v) {
      std::vector<std::uint16_t> w(v.size());
      ops::ref::cast(ops::DType::f32, t, v.data(), w.data(), v.size());
      return w;
    };
    auto widen = [&](const std::vector<std::uint16_t>& w) {
      std::vector<float> v(w.size());
      ops::ref::cast(t, ops::DType::f32, w.data(), v.data(), w.size());
      return v;
    };
    const auto x16 = narrow(input(tc, 1)), dy16 = narrow(random_vector(y_elems(s), 2));
    auto dx_in = DeviceBytes::from(x16, 7), ddy = DeviceBytes::from(dy16, 11);
    DeviceBytes dyo(y_elems(s), 2, 3), ddx(x_elems(s), 2, 13);
    DeviceTensor darg(y_elems(s), 5);
    ops::run_blocking(dev.context.compute(), ops::maxpool2d_forward(dev.env, s, dx_in.span(), dyo.span(), darg.span()));
    ops::run_blocking(dev.context.compute(), ops::maxpool2d_backward(dev.env, s, ddy.span(), darg.span(), ddx.span()));

    std::vector<float> y_ref(y_elems(s)), dx_ref(x_elems(s));
    std::vector<std::int32_t> arg_ref(y_elems(s));
    ops::ref::maxpool2d_forward<float>(s, widen(x16), y_ref, arg_ref);
    ops::ref::maxpool2d_backward<float>(s, widen(dy16), arg_ref, dx_ref);
    EXPECT_EQ(dyo.download<std::uint16_t>(), narrow(y_ref));
    EXPECT_EQ(as_ints(darg.download()), arg_ref);
    EXPECT_EQ(ddx.download<std::uint16_t>(), narrow(dx_ref));
    for (const auto* d : {&dyo, &ddx}) {
      for (const unsigned char byte : d->tail()) ASSERT_EQ(byte, 0xA5) << "written past the end";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MaxPoolTest,
    ::testing::Values(PoolCase{"2x2s2_even", shape(2, 3, 8, 8, 2, 2)}, PoolCase{"2x2s2_odd", shape(3, 2, 7, 9, 2, 2)},
                      PoolCase{"3x3s2_overlapping", shape(3, 2, 7, 7, 3, 2)},
                      PoolCase{"3x3s2_overlapping_ties", shape(2, 3, 9, 8, 3, 2), true},
                      PoolCase{"2x2s2_ties", shape(2, 2, 6, 7, 2, 2), true}, PoolCase{"3x3s1", shape(1, 2, 6, 6, 3, 1)},
                      PoolCase{"cnn_pool1", shape(64, 32, 28, 28, 2, 2)},
                      PoolCase{"2x2s2_odd_wide", shape(2, 3, 9, 19, 2, 2)},
                      PoolCase{"2x2s2_odd_wide_ties", shape(2, 3, 11, 37, 2, 2), true},
                      PoolCase{"relu_2x2s2_odd", with_relu(shape(3, 2, 7, 9, 2, 2))},
                      PoolCase{"relu_2x2s2_odd_wide_ties", with_relu(shape(2, 3, 9, 35, 2, 2)), true},
                      PoolCase{"relu_2x2s2_ties", with_relu(shape(2, 2, 6, 7, 2, 2)), true},
                      PoolCase{"relu_3x3s2_overlapping_ties", with_relu(shape(2, 3, 9, 8, 3, 2)), true},
                      PoolCase{"relu_cnn_pool1", with_relu(shape(16, 32, 28, 28, 2, 2))},
                      PoolCase{"cnn_pool2", shape(64, 64, 14, 14, 2, 2)}),
    [](const auto& info) { return info.param.name; });

TEST(MaxPoolRef, TiesGoToTheFirstMaximum) {
  const auto s = shape(1, 1, 3, 3, 2, 1);
  const std::vector<float> x{1, 1, 0,  //
                             1, 1, 2,  //
                             0, 2, 2};
  std::vector<float> y(4);
  std::vector<std::int32_t> arg(4);
  ops::ref::maxpool2d_forward<float>(s, x, y, arg);
  EXPECT_EQ(arg, (std::vector<std::int32_t>{0, 5, 7, 5}));
}

// The fused pool (Pool2dShape::relu) against the pair it replaces, relu then max-pool, in the
// reference: the same outputs, and the same input gradient once the ReLU's mask is applied, on
// inputs with ties, zeros and windows that are all negative.
TEST(MaxPoolRef, FusedReluEqualsReluThenPool) {
  for (const auto& base : {shape(2, 3, 6, 7, 2, 2), shape(2, 2, 9, 8, 3, 2), shape(1, 2, 6, 6, 3, 1)}) {
    const ops::Pool2dShape fused = with_relu(base);
    auto x = random_vector(x_elems(base), 5, -3.0f, 1.0f);
    for (auto& v : x) v = std::round(v);  // ties, exact zeros and many all-negative windows
    const auto dy = random_vector(y_elems(base), 6);
    std::vector<float> relu(x.size()), y_pair(y_elems(base)), y_fused(y_elems(base));
    std::vector<std::int32_t> arg_pair(y_elems(base)), arg_fused(y_elems(base));
    for (std::size_t i = 0; i < x.size(); ++i) relu[i] = x[i] > 0.0f ? x[i] : 0.0f;
    ops::ref::maxpool2d_forward<float>(base, relu, y_pair, arg_pair);
    ops::ref::maxpool2d_forward<float>(fused, x, y_fused, arg_fused);
    EXPECT_EQ(y_fused, y_pair);
    std::vector<float> dx_pair(x.size()), dx_fused(x.size());
    ops::ref::maxpool2d_backward<float>(base, dy, arg_pair, dx_pair);
    for (std::size_t i = 0; i < x.size(); ++i) dx_pair[i] = x[i] > 0.0f ? dx_pair[i] : 0.0f;  // the ReLU's mask
    ops::ref::maxpool2d_backward<float>(fused, dy, arg_fused, dx_fused);
    EXPECT_EQ(dx_fused, dx_pair);
    std::size_t none = 0;
    for (std::int32_t a : arg_fused) none += a < 0;
    EXPECT_GT(none, 0u) << "no window without a positive value: the case tests nothing of the ReLU";
  }
}

class MaxPoolGradTest : public ::testing::TestWithParam<ops::Pool2dShape> {};

TEST_P(MaxPoolGradTest, ReferenceBackwardMatchesFiniteDifferences) {
  const ops::Pool2dShape s = GetParam();
  // Distinct values (a shuffled ramp with spacing 1e-2, centred on 0 and kept 5e-3 off it), so
  // every max, and with a fused ReLU every sign, is isolated by far more than the step.
  std::vector<double> x(x_elems(s));
  const double half = double(x.size() / 2);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = (double((i * 7919) % x.size()) - half + 0.5) * 1e-2;
  const auto r = to_double(random_vector(y_elems(s), 4));
  const auto loss = [&](const std::vector<double>& in) {
    std::vector<double> y(y_elems(s));
    std::vector<std::int32_t> arg(y_elems(s));
    ops::ref::maxpool2d_forward<double>(s, in, y, arg);
    return weighted_sum(y, r);
  };
  std::vector<double> y(y_elems(s)), dx(x.size());
  std::vector<std::int32_t> arg(y_elems(s));
  ops::ref::maxpool2d_forward<double>(s, x, y, arg);
  ops::ref::maxpool2d_backward<double>(s, r, arg, dx);
  expect_gradient_matches_finite_differences(loss, x, dx, "maxpool dx", 1e-6, 1e-5, 1000);
}

INSTANTIATE_TEST_SUITE_P(Shapes, MaxPoolGradTest,
                         ::testing::Values(shape(2, 2, 6, 6, 2, 2), shape(1, 2, 7, 7, 3, 2), shape(1, 1, 5, 6, 3, 1),
                                           with_relu(shape(2, 2, 6, 6, 2, 2)), with_relu(shape(1, 2, 7, 7, 3, 2))));

}  // namespace
}  // namespace ferry::test
