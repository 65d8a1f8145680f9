// The tuners' timing (ops/tune_timer.hpp).
#include "tune_timer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "ferry/cl/error.hpp"
#include "ferry/cl/program.hpp"

namespace ferry::ops {

double best_seconds_per_run(cl_command_queue queue, const LaunchList& launches, int max_runs, const char* what) {
  using Clock = std::chrono::steady_clock;
  auto run = [&](int n) {
    const auto t0 = Clock::now();
    for (int i = 0; i < n; ++i) enqueue(queue, launches, {});
    cl::check(clFinish(queue), fmt::format("clFinish ({})", what).c_str());
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  run(1);
  const double once = run(1);
  const int n = static_cast<int>(std::clamp(0.02 / std::max(once, 1e-6), 1.0, double(max_runs)));
  double best = once;
  // Five rounds: on a 2-vCPU cloud machine one round in three or four can run 20-40% slow, and the
  // rounds cost little beside a candidate's build.
  for (int round = 0; round < 5; ++round) best = std::min(best, run(n) / n);
  return best;
}

cl::Mem upload_random(const cl::Context& ctx, std::size_t n, std::mt19937& rng, const char* what) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> h(n);
  for (float& x : h) x = dist(rng);
  cl::Mem m = ctx.create_buffer(n * sizeof(float), what);
  ctx.write(m.get(), 0, h.data(), n * sizeof(float));
  return m;
}

BuildAhead::BuildAhead(const cl::DeviceInfo& device, bool enabled, std::vector<std::function<void()>> builds)
    : builds_(std::move(builds)) {
  // A simulator's builds are not thread-safe, also beside the kernels being timed: none ahead.
  if (!enabled || device.is_simulator()) return;
  const std::size_t threads = std::min(cl::build_threads(device), builds_.size());
  for (std::size_t t = 0; t < threads; ++t) {
    builders_.run([this] {
      for (std::size_t i = next_++; i < builds_.size() && !stop_; i = next_++) {
        try {
          builds_[i]();
        } catch (...) {  // left to the measurement, which builds it again and says why
        }
      }
    });
  }
}

BuildAhead::~BuildAhead() {
  stop_ = true;
  builders_.wait();
}

}  // namespace ferry::ops
