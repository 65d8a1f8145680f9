// A compiled step: compiling it (plan, arena, binding, lowering) and where its tensors live.
// Running it is step_run.cpp; its enqueue is enqueue.cpp (one-pass form) or host_lane.cpp
// (flow-graph form).
#include "graph/compiled_step.hpp"

#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <set>
#include <stdexcept>

#include "compiled_step_impl.hpp"
#include "graph/bind.hpp"
#include "graph/dependencies.hpp"
#include "graph/step_plan.hpp"

namespace ferry::graph {

namespace {

// Whether a fetch of the step copies from pageable memory (its home's, or the host pool's) rather
// than from pinned staging: such a step does not run ahead (CompiledStep, step_runs_ahead).
bool fetches_from_pageable(const Graph& g, const MemoryPlan& plan, bool homes_pageable, bool pool_pageable) {
  const auto& n = g.nodes;
  const auto& t = g.tensors;
  for (NodeId id = 0; id < n.size(); ++id) {
    if (n.op[id] != builtin::fetch) continue;
    const TensorId source = t.storage(n.inputs(id)[0]);
    if (t.role[source] != Role::staged && (plan.pool[source] == Pool::persistent ? homes_pageable : pool_pageable)) {
      return true;
    }
  }
  return false;
}

}  // namespace

std::optional<PersistentArena::Entry> PersistentArena::find(const std::string& name) const {
  if (auto it = placements.find(name); it != placements.end()) return it->second;
  return std::nullopt;
}

offload::HomeStore& PersistentArena::store(Home home) const {
  const auto& s = homes[static_cast<int>(home)];
  if (!s) throw std::logic_error(fmt::format("no tensor of this model lives in home '{}'", offload::home_name(home)));
  return *s;
}

void PersistentArena::commit() {
  for (auto& s : homes) {
    if (s) s->commit();
  }
}

void PersistentArena::abort() {
  for (auto& s : homes) {
    if (s) s->abort();
  }
}

void PersistentArena::write(Home home, const Placement& p, const void* src, std::size_t n) {
  settle_deferred();  // (else the pending update would land on the value written here)
  store(home).write({p.buffer, p.offset_bytes}, src, n);
}

bool PersistentArena::fill_in_place(Home home, const Placement& p, std::size_t n,
                                    const std::function<void(std::byte*)>& fill) {
  settle_deferred();
  return store(home).fill_in_place({p.buffer, p.offset_bytes}, n, fill);
}

void PersistentArena::write_zeros(Home home, const Placement& p, std::size_t n) {
  settle_deferred();
  store(home).write_zeros({p.buffer, p.offset_bytes}, n);
}

void PersistentArena::read(Home home, const Placement& p, void* dst, std::size_t n) const {
  settle_deferred();
  store(home).read({p.buffer, p.offset_bytes}, dst, n);
}

std::uint64_t PersistentArena::host_bytes() const {
  std::uint64_t b = 0;
  for (const auto& s : homes) b += s ? s->host_bytes() : 0;
  return b;
}

std::uint64_t PersistentArena::device_bytes() const {
  std::uint64_t b = 0;
  for (const auto& s : homes) b += s ? s->device_bytes() : 0;
  return b;
}

CompiledStep::CompiledStep(Graph graph, const OptimizerConfig& optimizer, ops::OpEnv& env, const cl::Context& context,
                           std::shared_ptr<PersistentArena> shared, const StepOptions& options)
    : graph_(std::move(graph)), impl_(std::make_unique<Impl>(context)) {
  // The device passes, in order (graph/pipeline.hpp); each one's wall time goes into
  // pass_timings().
  auto clock = std::chrono::steady_clock::now();
  auto done = [&](const char* pass) {
    const auto now = std::chrono::steady_clock::now();
    pass_timings_.push_back({pass, std::chrono::duration<double, std::milli>(now - clock).count()});
    clock = now;
  };
  // check dtypes, scratch, residency and memory plan: the planning passes (graph/step_plan.cpp).
  StepPlan planned = plan_step(graph_, env, context.device(), shared.get(), options.residency);
  plan_ = std::move(planned.memory);
  residency_ = planned.residency;
  pass_timings_ = std::move(planned.pass_timings);
  clock = std::chrono::steady_clock::now();
  allocate(context, std::move(shared), options.residency.homes);
  done("arena");
  bind(env, optimizer, options.bind_kernels);
  done("bind");
  lower(context, options.serial);
  register_deferred_updates();
  done("lower");
}

bool shares_host_pool(const PersistentArena* arena, offload::HostMemory pool_memory) {
  if (arena == nullptr) return false;
  // A pinned pool serves a variant that wants pageable (or staged) memory too: its copies read the
  // pool's host addresses either way. Evaluation, whose kernels address no host tensor, wants the
  // homes' kind where the training step's pool had to be pinned (mapped homes), and had allocated
  // a pool of its own for every batch size. Not the reverse: a kernel addresses a pinned pool.
  return arena->host_step_memory == pool_memory ||
         (offload::is_pinned(arena->host_step_memory) && !offload::is_pinned(pool_memory));
}

std::uint64_t host_pool_bytes_added(const MemoryPlan& plan, const PersistentArena* arena,
                                    offload::HostMemory pool_memory) {
  if (arena == nullptr) return plan.host_transient_bytes;
  if (!shares_host_pool(arena, pool_memory)) {
    return plan.host_transient_bytes - plan.host_staging_bytes + plan.new_host_staging_bytes;
  }
  return plan.new_host_transient_bytes;
}

void CompiledStep::allocate_host_pool(const cl::Context& context, offload::HostMemory pool_memory, bool first) {
  // Variants never run at the same time (PersistentArena): a later one packs its pool into the
  // first's buffers (MemoryPlan::shared_host_buffers), as large as it needs by plan, where
  // shares_host_pool says so; its staging and fetch ring likewise (pinned always). The first
  // variant's arena came from planned_arena, which recorded the sizes and the kind.
  PersistentArena& arena = *persistent_;
  const bool share_pool = !first && shares_host_pool(&arena, pool_memory);
  const std::size_t count = plan_.host_transient_buffers.size(), from = plan_.host_staging_from;
  const bool ring = plan_.fetch_ring_chunk_bytes > 0;
  const auto existing = [&](std::size_t b) -> std::shared_ptr<offload::HostBuffer> {
    if (first) return nullptr;
    if (b < from) {
      return share_pool && b < plan_.shared_host_buffers && b < arena.host_step_buffers.size()
                 ? arena.host_step_buffers[b]
                 : nullptr;
    }
    if (ring && b + 1 == count) return plan_.shared_fetch_ring ? arena.fetch_ring : nullptr;
    const std::size_t s = b - from;
    return s < plan_.shared_staging_buffers && s < arena.host_staging_buffers.size() ? arena.host_staging_buffers[s]
                                                                                     : nullptr;
  };
  for (std::size_t b = 0; b < count; ++b) {
    if (std::shared_ptr<offload::HostBuffer> shared = existing(b)) {
      if (shared->bytes() < plan_.host_transient_buffers[b]) {
        throw std::logic_error(fmt::format("a variant's host buffer {} needs {} bytes, the model's first has {}", b,
                                           plan_.host_transient_buffers[b], shared->bytes()));
      }
      impl_->host_transient.push_back(std::move(shared));
      continue;
    }
    const bool staging = b >= from;  // what the link copies from: pinned always
    impl_->host_transient.push_back(std::make_shared<offload::HostBuffer>(offload::allocate_host(
        context, plan_.host_transient_buffers[b], staging ? offload::HostMemory::pinned : pool_memory,
        staging ? fmt::format("pinned staging buffer {} of the step's transfers", b)
                : fmt::format("host buffer {} of step tensors (batch mirrors, weight gradients)", b))));
    impl_->host_own_bytes += plan_.host_transient_buffers[b];
  }
  if (first) {
    const auto& bufs = impl_->host_transient;
    arena.host_step_buffers.assign(bufs.begin(), bufs.begin() + from);
    arena.host_staging_buffers.assign(bufs.begin() + from, bufs.end() - (ring ? 1 : 0));
    arena.fetch_ring = ring ? bufs.back() : nullptr;
  }
}

// The persistent arena (a store per home in use, unless a variant shares its model's), the step
// buffers, and the host buffers of step tensors whose home is the host.
void CompiledStep::allocate(const cl::Context& context, std::shared_ptr<PersistentArena> shared,
                            const offload::HomeStoreOptions& homes) {
  auto& t = graph_.tensors;
  const bool first_variant = shared == nullptr;
  const offload::HostMemory pool_memory = host_pool_memory(graph_, plan_, homes.host_memory, context.device());
  // 2. Arena buffers.
  if (shared) {
    persistent_ = std::move(shared);
  } else {
    persistent_ = planned_arena(graph_, plan_, residency_.mode, pool_memory);
    // A store per home in use, with the buffers the memory plan packed that home's tensors into;
    // every tensor of each home, for stores that keep tensors apart (compressed, dropped), and the
    // first one, for errors.
    std::array<std::string, offload::home_count> first_of;
    std::array<std::vector<offload::HomeTensor>, offload::home_count> tensors_of;
    for (TensorId id = 0; id < t.size(); ++id) {
      if (!is_persistent(t.role[id]) || t.alias_of[id] != no_tensor) continue;
      std::string& first = first_of[static_cast<int>(t.home[id])];
      if (first.empty()) first = fmt::format("{} ({}...)", role_name(t.role[id]), t.name[id]);
      tensors_of[static_cast<int>(t.home[id])].push_back({{t.placement[id].buffer, t.placement[id].offset_bytes},
                                                          t.bytes(id),
                                                          static_cast<std::uint32_t>(dtype_bytes(t.dtype[id])),
                                                          t.name[id]});
    }
    for (int h = 0; h < offload::home_count; ++h) {
      if (plan_.persistent_buffers[h].empty()) continue;
      persistent_->homes[h] =
          offload::make_home_store(static_cast<Home>(h), context, plan_.persistent_buffers[h], tensors_of[h], homes,
                                   fmt::format("the weights and optimizer state, first {}", first_of[h]));
    }
  }
  for (std::size_t b = 0; b < plan_.transient_buffers.size(); ++b) {
    if (b < persistent_->step_buffers.size()) {
      impl_->transient.push_back(persistent_->step_buffers[b]);  // another variant's, large enough by plan
      continue;
    }
    impl_->transient.push_back(
        context.create_buffer(plan_.transient_buffers[b], fmt::format("step arena buffer {}", b)));
  }
  if (persistent_->step_buffers.empty()) {
    persistent_->step_buffers = impl_->transient;
    persistent_->step_buffer_bytes = plan_.transient_buffers;
  }
  allocate_host_pool(context, pool_memory, first_variant);
  if (plan_.fetch_ring_chunk_bytes > 0) {
    impl_->fetch_ring = std::make_unique<offload::FetchRing>(
        static_cast<std::byte*>(impl_->host_transient.back()->data()), plan_.fetch_ring_chunk_bytes,
        offload::FetchRing::default_slots, offload::FetchRing::filling_for(context.device().facts()));
  }

  // 3. The batch and the results cross the link through host mirrors (pinned, from the plan's
  // host pool): the caller fills the input ones before run() and reads the results after.
  const auto& n = graph_.nodes;
  for (NodeId id = 0; id < n.size(); ++id) {
    const ops::OpClass kind = ops::op_info(n.op[id]).op_class;
    if (kind != ops::OpClass::batch_transfer) continue;
    // Uploads read a host mirror, downloads write one; either is named "<name>@host".
    const bool upload = n.lane[id] == Lane::h2d;
    for (TensorId host : upload ? n.inputs(id) : n.outputs(id)) {
      std::string name = t.name[host];
      if (name.ends_with("@host")) name.resize(name.size() - 5);
      (upload ? impl_->uploads : impl_->downloads)[name] = host;
      if (graph_.loss != no_tensor && t.role[host] == Role::stats && name == t.name[graph_.loss]) impl_->stats = host;
      if (graph_.guard != no_tensor && t.role[host] == Role::stats && name == t.name[graph_.guard]) impl_->guard = host;
    }
  }

  // 4. The form the step runs in (see the header), and for a step that can run ahead the batch
  // mirrors of the other slots: one pinned buffer per mirror, since the plan's host pool may hold
  // far larger tensors (mapped mode's weight gradients) that need no second copy.
  // A step whose fetches read pageable memory does not run ahead: NVIDIA's driver read a pageable
  // source when the copy was enqueued, which for the next step would be before this one's
  // write-backs had landed (graph/passes/staging.cpp stages such fetches within a step).
  const bool homes_pageable = !offload::is_pinned(offload::resolve_host_memory(homes.host_memory, context.device()));
  const bool pool_pageable = !offload::is_pinned(pool_memory);
  impl_->fetches_pageable = fetches_from_pageable(graph_, plan_, homes_pageable, pool_pageable);
  for (NodeId id = 0; id < n.size(); ++id) {
    if (is_host_lane(n.lane[id])) impl_->one_pass = false;
    const bool writes_state_on_host =
        n.lane[id] == Lane::host ||
        (n.op[id] == builtin::write_back && plan_.pool[t.storage(n.outputs(id)[0])] == Pool::persistent &&
         !changes_in_place(n.outputs(id)[0]));
    impl_->commits_other_slot = impl_->commits_other_slot || writes_state_on_host;
  }
  if (can_run_ahead()) {
    for (const auto* mirrors : {&impl_->uploads, &impl_->downloads}) {
      for (const auto& entry : *mirrors) impl_->mirror_index.emplace(t.storage(entry.second), 0);
    }
    // Numbered in the map's order, the order the buffers are made in below. (Numbered by name as
    // they were found, a mirror got the buffer of another, of another size, where names and ids
    // are in other orders: an input "x" with a target "a".)
    std::size_t next = 0;
    for (auto& [id, index] : impl_->mirror_index) index = next++;
    impl_->extra_mirrors.resize(max_in_flight - 1);
    for (std::size_t slot = 1; slot < max_in_flight; ++slot) {
      for (const auto& [id, index] : impl_->mirror_index) {
        impl_->extra_mirrors[slot - 1].push_back(offload::allocate_pinned_host(
            context, std::max<std::uint64_t>(t.bytes(id), 1),
            fmt::format("host mirror '{}' of batch slot {} (a step staged while the one before it runs)", t.name[id],
                        slot)));
      }
    }
  }
}

// Binds every device-lane node through its row.
void CompiledStep::bind(ops::OpEnv& env, const OptimizerConfig& optimizer, bool bind_kernels) {
  const auto& n = graph_.nodes;
  TensorLocator at;
  at.device = [this](TensorId id) { return span(id); };
  at.host = [this](TensorId id, bool write) -> ops::HostAddress {
    const TensorId s = graph_.tensors.storage(id);
    if (plan_.pool[s] == Pool::persistent) {
      // Streamed state: read the current copy, write the next (committed when the step succeeds).
      offload::HomeStore* store = &persistent_->store(graph_.tensors.home[s]);
      const offload::HomePlace p{graph_.tensors.placement[s].buffer, graph_.tensors.placement[s].offset_bytes};
      return [store, p, write] { return static_cast<void*>(write ? store->next(p) : store->current(p)); };
    }
    if (impl_->mirror_index.count(s)) {
      // A batch mirror: the slot of the step being enqueued.
      Impl* im = impl_.get();
      return [this, im, s] { return static_cast<void*>(host_address(s, false, im->enqueue_slot.load())); };
    }
    std::byte* fixed = host_address(id, false);
    return [fixed] { return static_cast<void*>(fixed); };
  };
  for (NodeId id = 0; id < n.size() && bind_kernels; ++id) {
    if (!is_host_lane(n.lane[id]) && ops::op_info(n.op[id]).op_class == ops::OpClass::update) {
      impl_->status = impl_->ctx.create_buffer(sizeof(cl_uint), "the step's status word");
      at.status = ops::DeviceSpan{impl_->status.get(), 0};
      break;
    }
  }
  at.staged_copier = impl_->fetch_ring.get();
  impl_->launches.resize(n.size());
  impl_->bound = bind_kernels;
  if (bind_kernels) bind_nodes(at, env, optimizer);
  impl_->optimizer = optimizer;
}

// Binding builds the programs the nodes need, and on a GPU with a cold program cache the driver's
// compiler takes most of a first run's compile time (27 s of a 1.0B GPT's on an H200): nodes bind
// in parallel, so that their programs build at the same time (cl::KernelLibrary builds different
// programs concurrently; a driver that serialises its compiler loses nothing). The first node of
// each op kind binds alone, before the others, so that a first-use tuner (GEMM, attention) times
// its candidates with no build competing for the device or the cores. An error is the one the
// first failing node in node order raises, as when binding one node at a time; a thread that waited
// for a program another node's thread failed to build raises that build's error, which names that
// node.
void CompiledStep::bind_nodes(const TensorLocator& at, ops::OpEnv& env, const OptimizerConfig& optimizer) {
  const auto& n = graph_.nodes;
  std::vector<NodeId> rest;
  std::vector<char> kind_seen;
  std::exception_ptr first_error;  // of the nodes bound alone: only the nodes before it are bound after
  for (NodeId id = 0; id < n.size() && !first_error; ++id) {
    if (is_host_lane(n.lane[id])) continue;
    const auto kind = static_cast<std::size_t>(n.op[id]);
    if (kind >= kind_seen.size()) kind_seen.resize(kind + 1, 0);
    if (kind_seen[kind]) {
      rest.push_back(id);
      continue;
    }
    kind_seen[kind] = 1;
    try {
      impl_->launches[id] = bind_node(graph_, id, at, env, optimizer);
    } catch (...) {
      first_error = std::current_exception();
    }
  }
  std::vector<std::exception_ptr> failed(rest.size());
  auto bind_one = [&](std::size_t i) {
    try {
      impl_->launches[rest[i]] = bind_node(graph_, rest[i], at, env, optimizer);
    } catch (...) {
      failed[i] = std::current_exception();
    }
  };
  const std::size_t threads =
      std::min<std::size_t>({cl::build_threads(env.device()), rest.size(),
                             static_cast<std::size_t>(tbb::this_task_arena::max_concurrency())});
  if (threads <= 1) {
    for (std::size_t i = 0; i < rest.size(); ++i) {
      bind_one(i);
      if (failed[i]) break;
    }
  } else {
    tbb::task_arena arena(static_cast<int>(threads));
    arena.execute([&] {
      tbb::parallel_for(tbb::blocked_range<std::size_t>(0, rest.size(), 1),
                        [&](const tbb::blocked_range<std::size_t>& r) {
                          for (std::size_t i = r.begin(); i != r.end(); ++i) bind_one(i);
                        });
    });
  }
  for (const auto& e : failed) {
    if (e) std::rethrow_exception(e);
  }
  if (first_error) std::rethrow_exception(first_error);
}

// Lowering: dependencies between lanes, the commit point, and for steps with host-lane nodes
// the flow graph.
void CompiledStep::lower(const cl::Context& context, bool serial) {
  auto preds = order_nodes(serial);
  find_commit_point();
  // Host-lane nodes that change state in place run only after the commit gate (the flow graph's
  // edge from the commit node leaves its check): not as soon as their own inputs are ready.
  if (impl_->commit != Impl::no_node) {
    for (NodeId id = impl_->commit + 1; id < graph_.nodes.size(); ++id) {
      if (!impl_->in_place[id] || !is_host_lane(graph_.nodes.lane[id])) continue;
      if (std::find(preds[id].begin(), preds[id].end(), impl_->commit) == preds[id].end()) {
        preds[id].push_back(impl_->commit);
      }
    }
  }
  impl_->serial = serial;
  const auto& n = graph_.nodes;
  for (NodeId id = 0; id < n.size(); ++id) impl_->last_on_lane[static_cast<int>(n.lane[id])] = id;
  impl_->wait_lists.resize(n.size());
  for (auto& s : impl_->subs) s.reset(n.size(), impl_->ctx.profiling());
  if (!impl_->one_pass) build_flow_graph(context, serial, preds);
}

void CompiledStep::find_commit_point() {
  const auto& n = graph_.nodes;
  impl_->in_place.assign(n.size(), 0);
  NodeId first_in_place = Impl::no_node;
  bool host_in_place = false;
  for (NodeId id = 0; id < n.size(); ++id) {
    if (n.deferred[id]) continue;  // it applies the step before's update, which committed
    for (TensorId x : n.outputs(id)) {
      if (!changes_in_place(x)) continue;
      impl_->in_place[id] = 1;
      host_in_place = host_in_place || is_host_lane(n.lane[id]);
    }
    if (impl_->in_place[id] && first_in_place == Impl::no_node) first_in_place = id;
  }
  if (first_in_place == Impl::no_node || graph_.guard == no_tensor) return;
  const NodeId commit = commit_point(graph_);
  if (commit == Impl::no_node || commit > first_in_place || is_host_lane(n.lane[commit])) {
    throw std::logic_error(fmt::format(
        "step node '{}' changes state kept in place before the step's commit point (the overflow guard's last node)",
        n.name[first_in_place]));
  }
  impl_->commit = commit;
  if (host_in_place) impl_->guard_span = span(graph_.guard);
  impl_->commit_waits.push_back(commit);
  for (int lane = 0; lane < lane_count; ++lane) {
    if (lane == static_cast<int>(n.lane[commit])) continue;
    for (NodeId id = commit; id-- > 0;) {
      if (static_cast<int>(n.lane[id]) == lane) {
        impl_->commit_waits.push_back(id);
        break;
      }
    }
  }
}

std::optional<NodeId> CompiledStep::commit_node() const noexcept {
  if (impl_->commit == Impl::no_node) return std::nullopt;
  return impl_->commit;
}

// Each node's predecessors: the node before it on its lane (in-order queues keep that order),
// the latest conflicting node of every other lane (also its OpenCL wait list), and with `serial`
// the node before it in the static order.
std::vector<std::vector<NodeId>> CompiledStep::order_nodes(bool serial) {
  auto& n = graph_.nodes;
  const auto accesses = node_byte_accesses(graph_, plan_.pool);
  // Per other lane, the latest conflicting node suffices: its lane runs in order.
  impl_->waits = cross_lane_dependencies(n.lane, accesses);
  std::array<NodeId, lane_count> last_on_lane;
  last_on_lane.fill(static_cast<NodeId>(-1));
  std::vector<std::vector<NodeId>> preds(n.size());
  for (NodeId id = 0; id < n.size(); ++id) {
    const int lane = static_cast<int>(n.lane[id]);
    if (last_on_lane[lane] != static_cast<NodeId>(-1)) preds[id].push_back(last_on_lane[lane]);
    if (serial && id > 0 && n.lane[id - 1] != n.lane[id]) preds[id].push_back(id - 1);
    preds[id].insert(preds[id].end(), impl_->waits[id].begin(), impl_->waits[id].end());
    last_on_lane[lane] = id;
  }

  return preds;
}

bool CompiledStep::changes_in_place(TensorId x) const {
  const TensorId s = graph_.tensors.storage(x);
  return plan_.pool[s] == Pool::persistent && persistent_->store(graph_.tensors.home[s]).updates_in_place();
}

std::byte* CompiledStep::host_address(TensorId id, bool next, int slot) const {
  const TensorId s = graph_.tensors.storage(id);
  const Placement& p = graph_.tensors.placement[s];
  if (slot > 0) {
    if (const auto it = impl_->mirror_index.find(s); it != impl_->mirror_index.end()) {
      const cl::PinnedBuffer& mirror = impl_->extra_mirrors.at(slot - 1).at(it->second);
      if (mirror.bytes() < graph_.tensors.bytes(s)) {  // the caller writes or reads all of it
        throw std::logic_error(fmt::format("host mirror '{}' of batch slot {} holds {} bytes of its {}",
                                           graph_.tensors.name[s], slot, mirror.bytes(), graph_.tensors.bytes(s)));
      }
      return static_cast<std::byte*>(mirror.data());
    }
  }
  if (plan_.pool[s] == Pool::persistent) {
    const offload::HomeStore& store = persistent_->store(graph_.tensors.home[s]);
    return next ? store.next({p.buffer, p.offset_bytes}) : store.current({p.buffer, p.offset_bytes});
  }
  if (plan_.pool[s] == Pool::host_transient) {
    return static_cast<std::byte*>(impl_->host_transient.at(p.buffer)->data()) + p.offset_bytes;
  }
  throw std::logic_error(fmt::format("tensor '{}' has no host memory", graph_.tensors.name[id]));
}

ops::DeviceSpan CompiledStep::span(TensorId id) const {
  const TensorId s = graph_.tensors.storage(id);
  const Placement& p = graph_.tensors.placement[s];
  if (plan_.pool[s] == Pool::persistent) {
    return {persistent_->store(graph_.tensors.home[s]).device_buffer(p.buffer), p.offset_bytes};
  }
  if (plan_.pool[s] == Pool::host_transient) {
    const offload::HostBuffer& b = *impl_->host_transient.at(p.buffer);
    if (!b.pinned()) {  // host_pool_memory keeps the pool pinned when a kernel addresses it
      throw std::logic_error(
          fmt::format("tensor '{}' is in pageable host memory, which kernels cannot address", graph_.tensors.name[id]));
    }
    return {b.mem(), p.offset_bytes};
  }
  return {impl_->transient.at(p.buffer).get(), p.offset_bytes};
}

offload::HostMemory host_pool_memory(const Graph& g, const MemoryPlan& plan, offload::HostMemory wanted,
                                     const cl::DeviceInfo& device) {
  const offload::HostMemory m = offload::resolve_host_memory(wanted, device);
  if (offload::is_pinned(m)) return m;
  const auto& n = g.nodes;
  for (NodeId id = 0; id < n.size(); ++id) {
    if (n.lane[id] != Lane::compute) continue;
    for (const auto& list : {n.inputs(id), n.outputs(id)}) {
      for (const TensorId x : list) {
        if (plan.pool[g.tensors.storage(x)] == Pool::host_transient) return offload::HostMemory::pinned;
      }
    }
  }
  return m;
}

// A step whose fetches read pageable memory does not run ahead: NVIDIA's driver read a pageable
// source when the copy was enqueued, which for the next step would be before this one's
// write-backs had landed (graph/passes/staging.cpp stages such fetches within a step).
bool step_runs_ahead(const Graph& g, const MemoryPlan& plan, const offload::HomeStoreOptions& homes,
                     const cl::DeviceInfo& device) {
  const auto& n = g.nodes;
  const auto& t = g.tensors;
  const bool homes_pageable = !offload::is_pinned(offload::resolve_host_memory(homes.host_memory, device));
  const bool pool_pageable = !offload::is_pinned(host_pool_memory(g, plan, homes.host_memory, device));
  if (fetches_from_pageable(g, plan, homes_pageable, pool_pageable)) return false;
  for (NodeId id = 0; id < n.size(); ++id) {
    if (is_host_lane(n.lane[id])) return false;  // not the one-pass form
    if (n.op[id] == builtin::write_back) {
      const TensorId home = t.storage(n.outputs(id)[0]);
      // State written on the host into the other copy, current only once the step succeeded.
      if (plan.pool[home] == Pool::persistent && !offload::changes_in_place(t.home[home], homes.pinned_copies)) {
        return false;
      }
    }
  }
  return true;
}

namespace {

// The batch mirrors: the host tensors batch transfers read (uploads) or write (downloads), once
// each.
std::set<TensorId> batch_mirrors(const Graph& g) {
  std::set<TensorId> mirrors;
  const auto& n = g.nodes;
  for (NodeId id = 0; id < n.size(); ++id) {
    if (ops::op_info(n.op[id]).op_class != ops::OpClass::batch_transfer) continue;
    for (TensorId host : n.lane[id] == Lane::h2d ? n.inputs(id) : n.outputs(id))
      mirrors.insert(g.tensors.storage(host));
  }
  return mirrors;
}

}  // namespace

std::uint64_t run_ahead_mirror_bytes(const Graph& g, const MemoryPlan& plan, const offload::HomeStoreOptions& homes,
                                     const cl::DeviceInfo& device) {
  if (!step_runs_ahead(g, plan, homes, device)) return 0;
  std::uint64_t bytes = 0;
  for (const TensorId x : batch_mirrors(g)) bytes += std::max<std::uint64_t>(g.tensors.bytes(x), 1);
  return (CompiledStep::max_in_flight - 1) * bytes;
}

std::uint64_t CompiledStep::host_bytes() const noexcept {
  std::uint64_t bytes = impl_->host_own_bytes;
  for (const auto& slot : impl_->extra_mirrors) {
    for (const auto& b : slot) bytes += b.bytes();
  }
  return bytes;
}

namespace {
std::string names_of(const std::map<std::string, TensorId, std::less<>>& m) {
  std::string out;
  for (const auto& [name, id] : m) out += (out.empty() ? "'" : ", '") + name + "'";
  return out.empty() ? "none" : out;
}
}  // namespace

std::span<std::byte> CompiledStep::host_input(std::string_view name) const {
  const auto it = impl_->uploads.find(name);
  if (it == impl_->uploads.end()) {
    throw std::invalid_argument(
        fmt::format("this step has no batch tensor '{}'; it uploads: {}", name, names_of(impl_->uploads)));
  }
  if (persistent_->deferred_owner != this) persistent_->settle_deferred();
  return {host_address(it->second, false, static_cast<int>(impl_->next)), graph_.tensors.bytes(it->second)};
}

std::span<const std::byte> CompiledStep::host_output(std::string_view name) const {
  const auto it = impl_->downloads.find(name);
  if (it == impl_->downloads.end()) {
    throw std::invalid_argument(
        fmt::format("this step has no result '{}'; it downloads: {}", name, names_of(impl_->downloads)));
  }
  return {host_address(it->second, false, impl_->result), graph_.tensors.bytes(it->second)};
}

std::vector<std::string> CompiledStep::host_input_names() const {
  std::vector<std::string> out;
  for (const auto& [name, id] : impl_->uploads) out.push_back(name);
  return out;
}

const float* CompiledStep::stats_host() const {
  return impl_->stats == no_tensor ? nullptr
                                   : reinterpret_cast<const float*>(host_address(impl_->stats, false, impl_->result));
}

}  // namespace ferry::graph
