// The planning passes of a compile (graph/step_plan.hpp), shared by
// graph::CompiledStep and the planner.
#include "graph/step_plan.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "graph/bind.hpp"
#include "graph/residency_passes.hpp"

namespace ferry::graph {

StepPlan plan_step(Graph& g, ops::OpEnv& env, const cl::DeviceInfo& device, const PersistentArena* shared,
                   const ResidencyOptions& residency) {
  StepPlan out;
  auto clock = std::chrono::steady_clock::now();
  auto done = [&](const char* pass) {
    const auto now = std::chrono::steady_clock::now();
    out.pass_timings.push_back({pass, std::chrono::duration<double, std::milli>(now - clock).count()});
    clock = now;
  };
  check_dtypes(g);
  done("check dtypes");
  assign_scratch(g, env);
  done("scratch");
  // Residency and the memory plan; persistent placements come from `shared` if given.
  auto& t = g.tensors;
  MemoryPlanOptions mopt;
  mopt.max_buffer_bytes = device.max_alloc_bytes;
  mopt.alignment = std::max<std::uint32_t>(256, device.base_align_bytes);
  mopt.plan_persistent = shared == nullptr;
  if (shared) {
    mopt.existing_transient_buffers = shared->step_buffer_bytes;
    mopt.existing_host_buffers = shared->host_step_buffer_bytes;
    mopt.existing_staging_buffers = shared->host_staging_buffer_bytes;
    mopt.existing_fetch_ring_bytes = shared->fetch_ring_bytes;
    for (TensorId id = 0; id < t.size(); ++id) {
      if (!is_persistent(t.role[id]) || t.alias_of[id] != no_tensor) continue;
      auto e = shared->find(t.name[id]);
      if (!e) throw std::logic_error(fmt::format("variant uses weight '{}' that the model does not have", t.name[id]));
      // A forward that makes other weights for another batch size would read past them.
      if (e->bytes != t.bytes(id)) {
        throw std::invalid_argument(fmt::format(
            "a variant's '{}' has shape {} ({} bytes), the training step's has {} bytes: a model's forward must make "
            "the same weights at every batch size",
            t.name[id], t.shape[id].str(), t.bytes(id), e->bytes));
      }
      t.placement[id] = e->place;
      t.home[id] = e->home;
    }
  }
  ResidencyOptions ropt = residency;
  if (shared) ropt.mode = shared->mode;  // a variant lives where the model's weights live
  ropt.homes.host_memory = offload::resolve_host_memory(ropt.homes.host_memory, device);
  // Pinned staging takes device memory where every pinned buffer does: the budget counts it.
  mopt.staging_on_device = offload::pinned_buffers_take_device_memory(device.facts(), device.host_unified_memory);
  out.memory = plan_residency(g, ropt, device.host_unified_memory, mopt, out.residency);
  done("residency and memory plan");
  return out;
}

std::shared_ptr<PersistentArena> planned_arena(const Graph& g, const MemoryPlan& plan, ResidencyMode mode,
                                               offload::HostMemory host_pool) {
  auto arena = std::make_shared<PersistentArena>();
  arena->mode = mode;
  const auto& t = g.tensors;
  for (TensorId id = 0; id < t.size(); ++id) {
    if (!is_persistent(t.role[id]) || t.alias_of[id] != no_tensor) continue;
    arena->placements.emplace(t.name[id], PersistentArena::Entry{t.home[id], t.placement[id], t.bytes(id)});
  }
  arena->step_buffer_bytes = plan.transient_buffers;
  arena->host_step_buffer_bytes.assign(plan.host_transient_buffers.begin(),
                                       plan.host_transient_buffers.begin() + plan.host_staging_from);
  arena->host_step_memory = host_pool;
  const bool ring = plan.fetch_ring_chunk_bytes > 0;
  arena->host_staging_buffer_bytes.assign(plan.host_transient_buffers.begin() + plan.host_staging_from,
                                          plan.host_transient_buffers.end() - (ring ? 1 : 0));
  arena->fetch_ring_bytes = ring ? plan.host_transient_buffers.back() : 0;
  return arena;
}

}  // namespace ferry::graph
