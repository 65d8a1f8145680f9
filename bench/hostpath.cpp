// ferry-bench hostpath: what does the host add to a step whose kernels cost next to nothing?
//
// A model of many trivially small layers (an MLP of --layers hidden layers of --width, batch
// --batch, Adam) trains through Trainer::submit / result with one step in flight, as ferry train
// does. Its kernels take a few microseconds, so the step's wall time is what the host and the
// driver spend on it. Against it, a bare loop enqueues the same bound commands (every device
// node's launches, in the step's order, on the compute queue, no wait lists) and waits once.
//   step_us                   wall time per step, pipelined
//   host_us_per_node          time inside submit() per node (the host's enqueue pass)
//   host_waits_per_step       times the host blocked on the device per step
//   bare_enqueue_us_per_node  the bare loop's time per node (enqueue and run)
//   ratio_step_over_bare      step_us over the bare loop's time per step
// Medians over --repeat, each the mean of --steps steps, the two interleaved.
#include <fmt/format.h>

#include <optional>
#include <random>

#include "bench.hpp"
#include "ferry/cl/error.hpp"
#include "ferry/ferry.hpp"
#include "runtime/cli/validators.hpp"
#include "runtime/trainer_internals.hpp"

namespace ferry::bench {
namespace {

struct HostpathOptions {
  std::uint32_t layers = 100, width = 16, batch = 1;
  int steps = 50, warmup = 5;
};

int run_hostpath(const BenchCommon& common, const HostpathOptions& o) {
  Runtime runtime({.device = common.device});
  TrainerOptions to;
  to.batch = o.batch;
  Trainer trainer(runtime, models::mlp(std::vector<std::uint32_t>(o.layers, o.width)), to);
  graph::CompiledStep& step = compiled_train_step(trainer);
  const auto& nodes = step.graph().nodes;

  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> images(std::size_t(o.batch) * 784);
  for (float& v : images) v = normal(rng);
  std::vector<std::int32_t> labels(o.batch);
  for (std::uint32_t i = 0; i < o.batch; ++i) labels[i] = static_cast<std::int32_t>(i % 10);
  const Batch batch{{"input", HostView(images)}, {"labels", HostView(labels)}};

  // Steps with one in flight; returns ms per step and adds the time spent in submit().
  double submit_ms = 0;
  auto pipelined = [&](int steps) {
    return time_ms([&] {
             std::optional<StepHandle> previous;
             for (int s = 0; s < steps; ++s) {
               StepHandle h;
               submit_ms += time_ms([&] { h = trainer.submit(batch); });
               if (previous) trainer.result(*previous);
               previous = h;
             }
             trainer.result(*previous);
           }) /
           steps;
  };
  // The same bound commands in a bare loop on the compute queue, one clFinish per step.
  const cl_command_queue q = runtime.context().compute();
  std::size_t device_nodes = 0;
  for (graph::NodeId id = 0; id < nodes.size(); ++id) device_nodes += !ops::is_host_lane(nodes.lane[id]);
  auto bare = [&](int steps) {
    return time_ms([&] {
             for (int s = 0; s < steps; ++s) {
               const ops::StepInfo info{trainer.steps_done() + 1, trainer.lr()};
               for (graph::NodeId id = 0; id < nodes.size(); ++id) {
                 if (!ops::is_host_lane(nodes.lane[id])) ops::enqueue(q, step.launches(id), {}, info);
               }
               FERRY_CL(clFinish(q));
             }
           }) /
           steps;
  };
  pipelined(o.warmup);
  bare(o.warmup);
  std::vector<double> t_step, t_bare, t_submit;
  std::uint64_t waits = 0;
  int timed_steps = 0;
  for (int r = 0; r < common.repeat; ++r) {
    submit_ms = 0;
    const std::uint64_t w0 = step.host_waits();
    t_step.push_back(pipelined(o.steps) * 1e3);
    waits += step.host_waits() - w0;
    timed_steps += o.steps;
    t_submit.push_back(submit_ms * 1e3 / o.steps);
    t_bare.push_back(bare(o.steps) * 1e3);
  }
  const double step_us = median(t_step), bare_us = median(t_bare), submit_us = median(t_submit);
  emit_json({{"bench", "hostpath"},
             {"layers", o.layers},
             {"width", o.width},
             {"batch", o.batch},
             {"steps", o.steps},
             {"repeat", common.repeat},
             {"device", runtime.device().name},
             {"runs_ahead", trainer.runs_ahead()},
             {"nodes", nodes.size()},
             {"device_nodes", device_nodes},
             {"step_us", step_us},
             {"host_us_per_node", submit_us / double(nodes.size())},
             {"host_waits_per_step", double(waits) / timed_steps},
             {"bare_step_us", bare_us},
             {"bare_enqueue_us_per_node", bare_us / double(device_nodes)},
             {"ratio_step_over_bare", step_us / bare_us},
             {"runs_step_us", t_step},
             {"runs_bare_step_us", t_bare}});
  return 0;
}

BenchRun setup(CLI::App& sub, const BenchCommon& common) {
  auto o = std::make_shared<HostpathOptions>();
  sub.add_option("--layers", o->layers, "hidden layers")
      ->capture_default_str()
      ->check(ferry::cli::whole_number())
      ->check(CLI::Range(1u, 100000u));
  sub.add_option("--width", o->width, "width of each hidden layer")
      ->capture_default_str()
      ->check(ferry::cli::whole_number())
      ->check(CLI::Range(1u, 65536u));
  sub.add_option("--batch", o->batch, "samples per step")
      ->capture_default_str()
      ->check(ferry::cli::whole_number())
      ->check(CLI::Range(1u, 65536u));
  sub.add_option("--steps", o->steps, "steps per timed repetition")
      ->capture_default_str()
      ->check(ferry::cli::whole_number())
      ->check(CLI::Range(1, 1000000));
  sub.add_option("--warmup", o->warmup, "untimed steps first")
      ->capture_default_str()
      ->check(ferry::cli::whole_number())
      ->check(CLI::Range(1, 1000000));
  return [o, &common] { return run_hostpath(common, *o); };
}

FERRY_BENCH("hostpath",
            "host cost of a step of trivially small kernels (submit/result, one step in flight) vs the same commands "
            "in a bare loop",
            setup);

}  // namespace
}  // namespace ferry::bench
