// A user's own op, added to ferry from outside its tree: SiLU, y = x * sigmoid(x), with its OpenCL
// kernels, shape rule, backward rule and CPU reference registered as rows of the op table, then
// used in a regression model (named inputs, a mean-squared-error loss) that trains on data this
// program generates. Checks that the trained model's predictions on the device match a CPU
// forward pass of the same weights, and that the loss fell.
//
//   custom_op [--steps N] [--device INDEX_OR_NAME]
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "example_options.hpp"
#include "ferry/ferry.hpp"
#include "silu_op.hpp"

namespace {

using silu_op::register_silu;
using silu_op::sigmoid;

// Samples of x [4] with target y = sin(x0) + x1 x2 - 0.5 x3, from a fixed seed.
struct Regression final : ferry::DataSource {
  std::vector<float> x, y;
  explicit Regression(std::size_t n, unsigned seed) : x(n * 4), y(n) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.5f, 1.5f);
    for (auto& v : x) v = u(rng);
    for (std::size_t i = 0; i < n; ++i) {
      const float* s = &x[i * 4];
      y[i] = std::sin(s[0]) + s[1] * s[2] - 0.5f * s[3];
    }
  }
  std::size_t size() const override { return y.size(); }
  void read(std::string_view name, std::size_t first, std::size_t count, std::span<std::byte> out) const override {
    const bool is_x = name == "x";
    const float* src = is_x ? x.data() + first * 4 : y.data() + first;
    std::memcpy(out.data(), src, count * (is_x ? 4 : 1) * sizeof(float));
  }
};

struct Args {
  std::uint32_t steps = 300;
  std::string device;  // empty: $FERRY_DEVICE, else the first GPU, else the first device
};

int run(const Args& a) {
  const ferry::ops::OpId silu = register_silu("example_silu");
  ferry::ModelSpec model;
  model.name = "silu-regression";
  model.inputs = {ferry::TensorSpec{"x", ferry::graph::Shape{4}}};
  model.targets = {ferry::TensorSpec{"y", ferry::graph::Shape{1}}};
  model.forward = [silu](ferry::graph::Builder& b, std::span<const ferry::TensorId> in) {
    const ferry::TensorId h[] = {b.linear(in[0], 32)};
    return b.linear(b.apply(silu, h)[0], 1);  // the user's op between two library layers
  };
  model.loss = [](ferry::graph::Builder& b, ferry::TensorId p, std::span<const ferry::TensorId> t) {
    return b.mse(p, t[0]);
  };

  ferry::Runtime runtime({.device = a.device});
  ferry::TrainerOptions options;
  options.batch = 64;
  options.lr = 3e-3f;
  ferry::Trainer trainer(runtime, model, options);
  const Regression train(64 * 16, 1), test(500, 2);
  const double before = trainer.evaluate(test).loss;
  std::vector<float> x(64 * 4), y(64);
  for (std::uint32_t s = 0; s < a.steps; ++s) {
    const std::size_t first = (s % 16) * 64;
    train.read("x", first, 64, std::as_writable_bytes(std::span(x)));
    train.read("y", first, 64, std::as_writable_bytes(std::span(y)));
    trainer.step(ferry::Batch{{"x", ferry::HostView(std::span<const float>(x))},
                              {"y", ferry::HostView(std::span<const float>(y))}});
  }
  const double after = trainer.evaluate(test).loss;
  std::printf("%s on %s: test MSE %.4f before training, %.4f after %u steps\n", trainer.model().name.c_str(),
              runtime.device().name.c_str(), before, after, a.steps);

  // The device's predictions against a CPU forward pass with the trained weights.
  const auto prediction = trainer.predict(test);
  const auto* p = reinterpret_cast<const float*>(prediction.bytes.data());
  const auto w0 = trainer.read_parameter("linear0.w"), b0 = trainer.read_parameter("linear0.b");
  const auto w1 = trainer.read_parameter("linear2.w"), b1 = trainer.read_parameter("linear2.b");
  double worst = 0;
  for (std::size_t i = 0; i < test.size(); ++i) {
    double out = b1[0];
    for (std::size_t j = 0; j < 32; ++j) {
      double h = b0[j];
      for (std::size_t k = 0; k < 4; ++k) h += double(test.x[i * 4 + k]) * w0[k * 32 + j];
      out += h * sigmoid(h) * w1[j];
    }
    worst = std::max(worst, std::abs(out - p[i]));
  }
  std::printf("predictions: %zu, largest difference from a CPU forward pass %.2e\n", test.size(), worst);
  if (worst > 1e-4) {
    std::fprintf(stderr, "custom_op: the device's predictions differ from the CPU's by %.2e\n", worst);
    return 1;
  }
  if (!(after < 0.25 * before)) {
    std::fprintf(stderr, "custom_op: the test loss did not fall to a quarter (%.4f -> %.4f)\n", before, after);
    return 1;
  }
  return 0;
}

void usage() {
  std::fputs("usage: custom_op [--steps N] [--device INDEX_OR_NAME]\n", stderr);
}

Args parse_args(int argc, char** argv) {
  Args a;
  example::for_each_option(argc, argv, usage, [&](std::string_view name, std::string_view value) {
    if (name == "--steps") {
      a.steps = example::parse_count(name, value);
    } else if (name == "--device") {
      a.device = value;
    } else {
      return false;
    }
    return true;
  });
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  return example::main_of("custom_op", argc, argv, usage, parse_args, run);
}
