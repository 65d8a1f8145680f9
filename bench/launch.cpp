// ferry-bench launch: what does one kernel launch cost on the device?
//
// N dependent tiny kernels (ReLU over 64 floats, ping-ponging between two buffers, bound once
// through ops::activation_forward and enqueued with ops::enqueue as a compiled step does) on the
// compute queue, timed on the host:
//   pipelined: all N enqueued, one clFinish at the end (what a compiled step does);
//   sync:      clFinish after every launch (a launch plus a full host-device round trip);
//   noevent:   pipelined, but through clEnqueueNDRangeKernel without asking for an event (what
//              the event object itself costs);
//   callback:  after every launch, wait for its completion callback (clSetEventCallback waking
//              the host through a condition variable): what each event gate of a compiled step
//              (before a host node, the commit point, the end of a step) costs beside clFinish;
//   wait:      clWaitForEvents on every launch's event.
// Each figure is the median over --repeat runs of N launches, after one warm-up run.
#include <fmt/format.h>

#include <condition_variable>
#include <cstdio>
#include <mutex>

#include "bench.hpp"
#include "ferry/cl/error.hpp"
#include "ferry/ops/activation.hpp"
#include "ferry/runtime/runtime.hpp"
#include "runtime/cli/validators.hpp"

namespace ferry::bench {
namespace {

struct LaunchBenchOptions {
  int launches = 1000;
  std::size_t elems = 64;
};

int run_launch(const BenchCommon& common, const LaunchBenchOptions& o) {
  Runtime runtime({.device = common.device});
  const cl::Context& ctx = runtime.context();
  const cl_command_queue q = ctx.compute();

  // Two buffers; relu(a) -> b and relu(b) -> a alternate, so every launch depends on the last.
  std::vector<float> init(o.elems);
  for (std::size_t i = 0; i < o.elems; ++i) init[i] = float(i % 7) - 3.0f;
  cl::Mem a = ctx.create_buffer(o.elems * sizeof(float), "launch bench a");
  cl::Mem b = ctx.create_buffer(o.elems * sizeof(float), "launch bench b");
  ctx.write(a.get(), 0, init.data(), init.size() * sizeof(float));
  ctx.write(b.get(), 0, init.data(), init.size() * sizeof(float));
  const ops::LaunchList ab =
      ops::activation_forward(runtime.env(), ops::Activation::relu, {a.get(), 0}, {b.get(), 0}, o.elems);
  const ops::LaunchList ba =
      ops::activation_forward(runtime.env(), ops::Activation::relu, {b.get(), 0}, {a.get(), 0}, o.elems);
  if (ab.size() != 1 || ab[0].custom) throw std::logic_error("relu is expected to bind to one kernel");

  auto pipelined = [&] {
    for (int i = 0; i < o.launches; ++i) ops::enqueue(q, i % 2 ? ba : ab, {});
    FERRY_CL(clFinish(q));
  };
  auto sync = [&] {
    for (int i = 0; i < o.launches; ++i) {
      ops::enqueue(q, i % 2 ? ba : ab, {});
      FERRY_CL(clFinish(q));
    }
  };
  auto noevent = [&] {
    for (int i = 0; i < o.launches; ++i) {
      const ops::KernelLaunch& l = (i % 2 ? ba : ab)[0];
      FERRY_CL(clEnqueueNDRangeKernel(q, l.kernel.get(), l.dims, nullptr, l.global.data(),
                                      l.local[0] ? l.local.data() : nullptr, 0, nullptr, nullptr));
    }
    FERRY_CL(clFinish(q));
  };

  // The host wakes from the driver's completion callback, as an event gate does.
  struct Wakeup {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    cl_int status = CL_COMPLETE;
    static void CL_CALLBACK on_complete(cl_event, cl_int status, void* user) {
      auto* w = static_cast<Wakeup*>(user);
      // Notified under the lock: the waiter (and `w` with it) cannot be gone before this returns.
      std::lock_guard lock(w->m);
      w->done = true;
      w->status = status;
      w->cv.notify_one();
    }
  };
  auto callback = [&] {
    for (int i = 0; i < o.launches; ++i) {
      Wakeup w;
      cl::Event ev = ops::enqueue(q, i % 2 ? ba : ab, {});
      FERRY_CL(clSetEventCallback(ev.get(), CL_COMPLETE, &Wakeup::on_complete, &w));
      FERRY_CL(clFlush(q));
      std::unique_lock lock(w.m);
      w.cv.wait(lock, [&] { return w.done; });
      if (w.status < 0) cl::check(w.status, "the relu kernel (reported by its callback)");
    }
  };
  auto wait = [&] {
    for (int i = 0; i < o.launches; ++i) {
      cl::Event ev = ops::enqueue(q, i % 2 ? ba : ab, {});
      const cl_event e = ev.get();
      FERRY_CL(clWaitForEvents(1, &e));
    }
  };

  // Warm up (program build, driver threads), then interleave the modes so that load changes on
  // this shared machine hit them alike.
  pipelined();
  sync();
  noevent();
  callback();
  wait();
  std::vector<double> t_pipe, t_sync, t_noevent, t_callback, t_wait;
  for (int r = 0; r < common.repeat; ++r) {
    t_pipe.push_back(time_ms(pipelined) * 1e3 / o.launches);
    t_sync.push_back(time_ms(sync) * 1e3 / o.launches);
    t_noevent.push_back(time_ms(noevent) * 1e3 / o.launches);
    t_callback.push_back(time_ms(callback) * 1e3 / o.launches);
    t_wait.push_back(time_ms(wait) * 1e3 / o.launches);
  }
  // The buffer the last launch wrote: launch i writes b when i is even (relu(a) -> b), a when odd;
  // with -n 1 only b was ever written.
  const bool last_wrote_a = (o.launches - 1) % 2 != 0;
  std::vector<float> out(o.elems);
  ctx.read((last_wrote_a ? a : b).get(), 0, out.data(), out.size() * sizeof(float));
  for (std::size_t i = 0; i < o.elems; ++i) {
    if (out[i] != std::max(init[i], 0.0f)) {
      throw std::runtime_error(fmt::format(
          "the relu chain produced a wrong value: element {} of buffer {} (written by launch {}) is {}, relu({}) is "
          "{}: the device ran the kernel wrongly, so its launch times are not reported",
          i, last_wrote_a ? "a" : "b", o.launches, out[i], init[i], std::max(init[i], 0.0f)));
    }
  }

  const double pipe = median(t_pipe), syn = median(t_sync), noev = median(t_noevent), cb = median(t_callback),
               wt = median(t_wait);
  const nlohmann::json base{{"bench", "launch"},      {"kernel", "relu"},        {"elems", o.elems},
                            {"launches", o.launches}, {"repeat", common.repeat}, {"device", runtime.device().name}};
  auto line = [&](const char* mode, double us, const std::vector<double>& all) {
    nlohmann::json j = base;
    j["mode"] = mode;
    j["us_per_launch"] = us;
    j["runs_us_per_launch"] = all;
    emit_json(j);
  };
  line("pipelined", pipe, t_pipe);
  line("sync", syn, t_sync);
  line("pipelined_noevent", noev, t_noevent);
  line("callback", cb, t_callback);
  line("wait", wt, t_wait);
  nlohmann::json j = base;
  j["mode"] = "ratio";
  j["ratio_sync_over_pipelined"] = syn / pipe;
  j["ratio_pipelined_over_noevent"] = pipe / noev;
  j["ratio_callback_over_sync"] = cb / syn;
  j["ratio_wait_over_sync"] = wt / syn;
  emit_json(j);
  return 0;
}

BenchRun setup(CLI::App& sub, const BenchCommon& common) {
  auto o = std::make_shared<LaunchBenchOptions>();
  sub.add_option("-n,--launches", o->launches, "dependent launches per run")
      ->capture_default_str()
      ->check(ferry::cli::positive_number());
  sub.add_option("--elems", o->elems,
                 "floats per kernel (up to 2^28: two device buffers of 1 GiB, filled from 1 GiB on the host)")
      ->capture_default_str()
      ->check(ferry::cli::whole_number())
      ->check(CLI::Range(1, 1 << 28));
  return [o, &common] { return run_launch(common, *o); };
}

FERRY_BENCH("launch",
            "cost of one tiny kernel launch: pipelined vs clFinish, a completion callback or clWaitForEvents after "
            "each (us per launch)",
            setup);

}  // namespace
}  // namespace ferry::bench
