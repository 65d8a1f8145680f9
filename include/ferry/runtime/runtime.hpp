// What a trainer links first: the device, its context and queues, and the kernel library.
#pragma once

#include <memory>
#include <string>

#include "ferry/cl/context.hpp"
#include "ferry/cl/driver_memory.hpp"
#include "ferry/cl/program.hpp"
#include "ferry/ops/launch.hpp"

namespace ferry {

struct RuntimeOptions {
  // Device index or name substring; empty: $FERRY_DEVICE, else the first GPU, else the first device.
  std::string device;
  // Data-parallel runs on one node: with no device named, rank `local_rank` takes the
  // (local_rank mod n)-th of the n best devices (ferry::local_rank(); cl::select_device).
  int local_rank = 0;
  // Record device timestamps of every command (for traces and the timeline); costs a little.
  bool profiling = false;
  // Read the device memory the driver counts in use (cl::DriverMemory: NVML on NVIDIA, AMD's
  // free-memory query) before the context is made, after, and every 100 ms on a thread of its own:
  // driver_memory() below. Nothing is read on devices whose driver has no count (CPUs, PoCL).
  bool watch_driver_memory = true;
  // First-use tuning's progress on stderr (ops::OpEnv::tune_progress): false for a quiet program
  // (ferry train --quiet).
  bool tune_progress = true;
  // A stop signal during first-use tuning ends the search and throws ops::TuneStopped
  // (ops::OpEnv::tune_stop_signals); false leaves a program's own signal handlers in place.
  bool tune_stop_signals = true;
};

class Runtime {
 public:
  explicit Runtime(RuntimeOptions options = {});
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  const cl::DeviceInfo& device() const noexcept { return shared_->context->device(); }
  const cl::Context& context() const noexcept { return *shared_->context; }
  cl::KernelLibrary& kernels() noexcept { return *shared_->kernels; }
  ops::OpEnv& env() noexcept { return shared_->env; }
  const RuntimeOptions& options() const noexcept { return options_; }
  // The driver's count of device memory in use, before this runtime's context, after it, and
  // the largest since (cl::DriverMemoryWatch); its source() says why nothing is read where not.
  const cl::DriverMemoryWatch& driver_memory() const noexcept { return *shared_->driver_memory; }

  // The objects every compiled step uses: the context and its queues, the kernel library and the
  // ops' environment. Each Trainer made on this runtime holds them too, so a runtime destroyed
  // before its trainers leaves them working (their last commands finish on the same context).
  struct Shared {
    explicit Shared(const RuntimeOptions& options);
    std::unique_ptr<cl::DriverMemoryWatch> driver_memory;  // made around the context
    std::unique_ptr<cl::Context> context;
    std::unique_ptr<cl::KernelLibrary> kernels;
    ops::OpEnv env;
    // On Oclgrind only: a oneTBB global_control limiting the flow graphs to one thread (its OpenCL
    // runtime is not thread-safe; see runtime.cpp). Opaque here so that this header needs no oneTBB.
    std::shared_ptr<void> one_thread;
  };
  const std::shared_ptr<Shared>& shared() const noexcept { return shared_; }

 private:
  RuntimeOptions options_;
  std::shared_ptr<Shared> shared_;
};

}  // namespace ferry
