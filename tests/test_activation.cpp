// Activations (ReLU, GELU): device against the CPU reference, forward and backward, and the
// reference backward against double-precision finite differences.
#include <stdexcept>
#include <string>

#include "ferry/ops/activation.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

class ActivationTest : public ::testing::TestWithParam<std::tuple<ops::Activation, std::size_t>> {};

TEST_P(ActivationTest, ForwardAndBackwardMatchReference) {
  auto [act, n] = GetParam();
  auto& dev = TestDevice::get();
  auto x = random_vector(n, 1, -3.0f, 3.0f);
  auto dy = random_vector(n, 2);
  DeviceTensor dx_in(x), ddy(dy), dyo(n), ddx(n, 3);

  ops::run_blocking(dev.context.compute(), ops::activation_forward(dev.env, act, dx_in.span(), dyo.span(), n));
  std::vector<float> y_ref(n);
  ops::ref::activation_forward<float>(act, x, y_ref);
  expect_near(dyo.download(), y_ref, 1e-6f, 1e-5f, "forward");

  ops::run_blocking(dev.context.compute(),
                    ops::activation_backward(dev.env, act, dx_in.span(), ddy.span(), ddx.span(), n));
  std::vector<float> dx_ref(n);
  ops::ref::activation_backward<float>(act, x, dy, dx_ref);
  expect_near(ddx.download(), dx_ref, 1e-6f, 1e-5f, "backward");
}

TEST_P(ActivationTest, ReferenceBackwardMatchesFiniteDifferences) {
  auto [act, n] = GetParam();
  // Keep ReLU inputs away from the kink at 0, where the derivative is undefined.
  auto xf = random_vector(n, 3, -3.0f, 3.0f);
  for (auto& v : xf)
    if (std::abs(v) < 0.05f) v += 0.1f;
  auto x = to_double(xf);
  auto r = to_double(random_vector(n, 4));
  auto loss = [&, act = act](const std::vector<double>& in) {
    std::vector<double> y(in.size());
    ops::ref::activation_forward<double>(act, in, y);
    return weighted_sum(y, r);
  };
  std::vector<double> grad(n);
  ops::ref::activation_backward<double>(act, x, r, grad);
  expect_gradient_matches_finite_differences(loss, x, grad, "activation");
}

TEST(Activation, RejectsDtypesItHasNoKernelFor) {
  auto& dev = TestDevice::get();
  DeviceTensor t(8);
  for (ops::DType bad : {ops::DType::i8, ops::DType::u8, ops::DType::i32}) {
    for (bool backward : {false, true}) {
      try {
        (void)(backward ? ops::activation_backward(dev.env, ops::Activation::gelu, t.span(), t.span(), t.span(), 8, bad)
                        : ops::activation_forward(dev.env, ops::Activation::relu, t.span(), t.span(), 8, bad));
        ADD_FAILURE() << "no exception for " << ops::dtype_name(bad);
      } catch (const std::invalid_argument& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(backward ? "gelu_backward" : "relu_forward"), std::string::npos) << msg;
        EXPECT_NE(msg.find(ops::dtype_name(bad)), std::string::npos) << msg;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ActivationTest,
                         ::testing::Combine(::testing::Values(ops::Activation::relu, ops::Activation::gelu),
                                            ::testing::Values(1, 63, 64, 1000, 4097)));

}  // namespace
}  // namespace ferry::test
