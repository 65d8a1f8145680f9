// Lowering of a planned step graph to tbb::flow::graph, and running it.
#include "ferry/graph/compiled_step.hpp"

#include <fmt/format.h>
#include <tbb/flow_graph.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <map>
#include <stdexcept>

#include "ferry/cl/error.hpp"
#include "ferry/graph/bind.hpp"
#include "ferry/graph/dependencies.hpp"
#include "ferry/graph/node_view.hpp"
#include "ferry/offload/pinned_host.hpp"

namespace ferry::graph {

using tbb::flow::continue_msg;
using DoneNode = tbb::flow::async_node<continue_msg, continue_msg>;

std::optional<PersistentArena::Entry> PersistentArena::find(const std::string& name) const {
  if (auto it = placements.find(name); it != placements.end()) return it->second;
  return std::nullopt;
}

offload::HomeStore& PersistentArena::store(Residency home) const {
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

void PersistentArena::write(Residency home, const Placement& p, const void* src, std::size_t n) {
  store(home).write({p.buffer, p.offset_bytes}, src, n);
}

void PersistentArena::read(Residency home, const Placement& p, void* dst, std::size_t n) const {
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

namespace {

// The host's steady clock in nanoseconds (host-lane spans of the timeline).
std::uint64_t steady_ns() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

cl_command_queue queue_of(const cl::Context& ctx, Lane lane) {
  switch (lane) {
    case Lane::h2d:
      return ctx.queue(cl::QueueKind::h2d);
    case Lane::d2h:
      return ctx.queue(cl::QueueKind::d2h);
    default:
      return ctx.queue(cl::QueueKind::compute);
  }
}

}  // namespace

struct CompiledStep::Impl {
  const cl::Context& ctx;
  std::vector<cl::Mem> transient;
  std::vector<cl::PinnedBuffer> host_transient;   // mapped mode: weight gradients in host memory
  std::vector<ops::LaunchList> launches;          // per node
  std::vector<std::vector<NodeId>> waits;         // cross-lane predecessors, per node
  std::vector<std::vector<cl_event>> wait_lists;  // per node: the events it waits on this step
  std::vector<cl::Event> events;                  // per node: its last command, this step
  std::vector<cl::Event> first_events;            // per node: its first command (profiling only)
  // Profiling only, host steady clock in ns: when each device node was enqueued (to relate the
  // host clock to the device clock) and when each host-lane node's work ran, this step.
  std::vector<std::uint64_t> host_enqueue_ns, host_start_ns, host_end_ns;
  // Host mirrors by name without "@host": what the caller fills (uploads) and reads (downloads).
  std::map<std::string, TensorId, std::less<>> uploads, downloads;
  TensorId stats = no_tensor;  // the loss's host mirror, if the graph has a loss
  TensorId guard = no_tensor;  // the host mirror of what the updates check, if not the loss
  ops::StepInfo step;
  RunMode mode = RunMode::normal;
  bool bound = true;  // kernels bound: the step can run

  tbb::flow::graph flow;
  tbb::flow::broadcast_node<continue_msg> start{flow};
  std::vector<std::unique_ptr<tbb::flow::continue_node<continue_msg>>> nodes;
  std::unique_ptr<tbb::flow::continue_node<continue_msg>> finish;
  std::unique_ptr<DoneNode> done;
  OptimizerSpec optimizer;
  bool commits_other_slot = false;  // the step writes the next state into the other host slot

  // The divergence guard's view of the updates (ops::BindContext::step_status): a device word
  // the device updates set when they make a weight not finite, cleared at the start of each step
  // and read back after its last command; host updates set the flag beside it.
  cl::Mem status;  // null when no device-lane update was bound
  cl_uint status_host = 0;
  cl::Event status_read;
  std::atomic<bool> host_non_finite{false};

  // Waits for OpenCL events without blocking a thread: a marker on `queue` with the events as its
  // wait list, whose completion callback opens an async_node gateway. Used before each host-lane
  // node and once at the end of the step.
  struct EventGate {
    cl_command_queue queue = nullptr;
    std::vector<cl_event> wait;
    cl::Event marker;
    DoneNode::gateway_type* gateway = nullptr;
    std::atomic<cl_int> status{CL_COMPLETE};

    // The async_node's body: hand the wait over to the driver and return.
    void open(DoneNode::gateway_type& gw) {
      if (wait.empty()) {
        gw.try_put(continue_msg{});
        return;
      }
      gateway = &gw;
      gw.reserve_wait();  // reserve before the callback can fire (it may fire inside the call)
      cl::Event m;
      cl_int rc = clEnqueueMarkerWithWaitList(queue, static_cast<cl_uint>(wait.size()), wait.data(), m.out());
      if (rc == CL_SUCCESS) rc = clSetEventCallback(m.get(), CL_COMPLETE, &EventGate::on_complete, this);
      if (rc != CL_SUCCESS) {
        gw.release_wait();
        cl::check(rc, "clSetEventCallback(event gate)");
      }
      marker = std::move(m);
      FERRY_CL(clFlush(queue));
    }
    // Runs on a driver thread, or inline if the marker already completed: hand over, never wait.
    static void CL_CALLBACK on_complete(cl_event, cl_int status, void* user) {
      auto* gate = static_cast<EventGate*>(user);
      if (status < 0) gate->status = status;
      gate->gateway->try_put(continue_msg{});
      gate->gateway->release_wait();
    }
  };
  std::vector<std::unique_ptr<EventGate>> gates;  // per host-lane node; null for device nodes
  std::vector<std::unique_ptr<DoneNode>> gate_nodes;
  std::vector<std::unique_ptr<tbb::flow::continue_node<continue_msg>>> host_work;
  EventGate finish_gate;  // the end of the step

  // The commit point (CompiledStep::find_commit_point). Per node: whether it writes persistent
  // state that lives in place (device, host_mapped), and whether it did enqueue commands this step
  // (each node writes only its own element).
  static constexpr NodeId no_node = static_cast<NodeId>(-1);
  std::vector<char> in_place, started;
  NodeId commit = no_node;
  // The commit node itself and the last node before it on every other lane: the gate waits for
  // their commands (device lanes) and the flow graph for their bodies.
  std::vector<NodeId> commit_waits;
  std::unique_ptr<tbb::flow::continue_node<continue_msg>> commit_join, commit_check;
  std::unique_ptr<DoneNode> commit_gate_node;
  EventGate commit_gate;

  explicit Impl(const cl::Context& c) : ctx(c) {}
};

CompiledStep::CompiledStep(Graph graph, const OptimizerSpec& optimizer, ops::OpEnv& env, const cl::Context& context,
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
  check_dtypes(graph_);
  done("check dtypes");
  assign_scratch(graph_, env);
  done("scratch");
  plan(context.device(), shared.get(), options.residency);
  done("residency and memory plan");
  allocate(context, std::move(shared), options.residency.homes);
  done("arena");
  bind(env, optimizer, options.bind_kernels);
  done("bind");
  lower(context, options.serial);
  done("lower");
}

// Residency and the memory plan; persistent placements come from `shared` if given.
void CompiledStep::plan(const cl::DeviceInfo& device, const PersistentArena* shared,
                        const ResidencyOptions& residency) {
  auto& t = graph_.tensors;
  MemoryPlanOptions mopt;
  mopt.max_buffer_bytes = device.max_alloc_bytes;
  mopt.alignment = std::max<std::uint32_t>(256, device.base_align_bytes);
  mopt.plan_persistent = shared == nullptr;
  if (shared) mopt.existing_transient_buffers = shared->step_buffer_bytes;
  if (shared) {
    for (TensorId id = 0; id < t.size(); ++id) {
      if (!is_persistent(t.role[id]) || t.alias_of[id] != no_tensor) continue;
      auto e = shared->find(t.name[id]);
      if (!e) throw std::logic_error(fmt::format("variant uses weight '{}' that the model does not have", t.name[id]));
      t.placement[id] = e->place;
      t.home[id] = e->home;
    }
  }
  ResidencyOptions ropt = residency;
  if (shared) ropt.mode = shared->mode;  // a variant lives where the model's weights live
  plan_ = plan_residency(graph_, ropt, device.host_unified_memory, mopt, residency_);
}

// The persistent arena (a store per home in use, unless a variant shares its model's), the step
// buffers, and the host buffers of step tensors whose home is the host.
void CompiledStep::allocate(const cl::Context& context, std::shared_ptr<PersistentArena> shared,
                            const offload::HomeStoreOptions& homes) {
  auto& t = graph_.tensors;
  // 2. Arena buffers.
  if (shared) {
    persistent_ = std::move(shared);
  } else {
    persistent_ = std::make_shared<PersistentArena>();
    persistent_->mode = residency_.mode;
    // A store per home in use, with the buffers the memory plan packed that home's tensors into.
    std::array<std::string, offload::home_count> first_of;  // a tensor living there, for errors
    for (TensorId id = 0; id < t.size(); ++id) {
      if (!is_persistent(t.role[id]) || t.alias_of[id] != no_tensor) continue;
      std::string& first = first_of[static_cast<int>(t.home[id])];
      if (first.empty()) first = fmt::format("{} ({}...)", role_name(t.role[id]), t.name[id]);
      persistent_->placements.emplace(t.name[id], PersistentArena::Entry{t.home[id], t.placement[id], t.bytes(id)});
    }
    // Every tensor of each home, for stores that keep tensors apart (compressed, dropped).
    std::array<std::vector<offload::HomeTensor>, offload::home_count> tensors_of;
    for (TensorId id = 0; id < t.size(); ++id) {
      if (!is_persistent(t.role[id]) || t.alias_of[id] != no_tensor) continue;
      tensors_of[static_cast<int>(t.home[id])].push_back({{t.placement[id].buffer, t.placement[id].offset_bytes},
                                                          t.bytes(id),
                                                          static_cast<std::uint32_t>(dtype_bytes(t.dtype[id])),
                                                          t.name[id]});
    }
    for (int h = 0; h < offload::home_count; ++h) {
      if (plan_.persistent_buffers[h].empty()) continue;
      persistent_->homes[h] =
          offload::make_home_store(static_cast<Residency>(h), context, plan_.persistent_buffers[h], tensors_of[h],
                                   homes, fmt::format("the weights and optimizer state, first {}", first_of[h]));
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
  for (std::size_t b = 0; b < plan_.host_transient_buffers.size(); ++b) {
    impl_->host_transient.push_back(offload::allocate_pinned_host(
        context, plan_.host_transient_buffers[b],
        fmt::format("host buffer {} of step tensors (batch mirrors, weight gradients)", b)));
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
}

// Binds every device-lane node through its row.
void CompiledStep::bind(ops::OpEnv& env, const OptimizerSpec& optimizer, bool bind_kernels) {
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
  impl_->launches.resize(n.size());
  impl_->bound = bind_kernels;
  for (NodeId id = 0; id < n.size(); ++id) {
    if (is_host_lane(n.lane[id]) || !bind_kernels) continue;
    cl::OpScope scope(n.name[id]);
    impl_->launches[id] = bind_node(graph_, id, at, env, optimizer);
  }

  impl_->optimizer = optimizer;
}

// Lowering: dependencies between lanes, then the flow graph.
void CompiledStep::lower(const cl::Context& context, bool serial) {
  auto preds = order_nodes(serial);
  find_commit_point();
  build_flow_graph(context, serial, preds);
}

void CompiledStep::find_commit_point() {
  const auto& t = graph_.tensors;
  const auto& n = graph_.nodes;
  impl_->in_place.assign(n.size(), 0);
  impl_->started.assign(n.size(), 0);
  NodeId first_in_place = Impl::no_node;
  for (NodeId id = 0; id < n.size(); ++id) {
    if (is_host_lane(n.lane[id])) continue;  // host nodes write the next copy of streamed state
    for (TensorId x : n.outputs(id)) {
      const TensorId s = t.storage(x);
      if (plan_.pool[s] == Pool::persistent && offload::home_traits(t.home[s]).addressed_in_place) {
        impl_->in_place[id] = 1;
      }
    }
    if (impl_->in_place[id] && first_in_place == Impl::no_node) first_in_place = id;
  }
  if (first_in_place == Impl::no_node || graph_.guard == no_tensor) return;
  NodeId commit = Impl::no_node;
  for (NodeId id = 0; id < n.size(); ++id) {
    for (TensorId x : n.outputs(id)) {
      if (t.storage(x) == t.storage(graph_.guard)) commit = id;
    }
  }
  if (commit == Impl::no_node || commit > first_in_place || is_host_lane(n.lane[commit])) {
    throw std::logic_error(fmt::format(
        "step node '{}' changes state kept in place before the step's commit point (the overflow guard's last node)",
        n.name[first_in_place]));
  }
  impl_->commit = commit;
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

void CompiledStep::check_device_status(NodeId end, cl_int gate_status, const char* where) const {
  // A failed command does not always fail the commands after it in its queue (Oclgrind runs them;
  // only commands that wait on it are failed), so every command's own status is read.
  for (NodeId id = 0; id < end; ++id) {
    cl_int st = CL_COMPLETE;
    if (impl_->events[id] &&
        clGetEventInfo(impl_->events[id].get(), CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, nullptr) ==
            CL_SUCCESS &&
        st < 0) {
      const std::string& name = graph_.nodes.name[id];
      throw cl::Error(fmt::format("the device command of step node '{}' (reported by its event)", name), st, name);
    }
  }
  if (gate_status < 0)
    throw cl::Error(fmt::format("a command of {} (reported by its event)", where), gate_status, "step");
}

std::exception_ptr CompiledStep::root_cause(std::exception_ptr failure) const {
  // Called after the flow graph stopped and the queues drained: the events are settled.
  std::string refused, refused_op;
  try {
    std::rethrow_exception(failure);
  } catch (const cl::Error& e) {
    refused = e.what();
    refused_op = e.op();
  } catch (...) {
    return failure;  // not a driver's error: it is its own cause
  }
  try {
    check_device_status(static_cast<NodeId>(graph_.nodes.size()), CL_COMPLETE, "the step");
  } catch (const cl::Error& device) {
    if (device.op() == refused_op) return failure;  // the node failed and was refused itself
    return std::make_exception_ptr(
        cl::Error(fmt::format("{}; after it the driver refused a later command ({})", device.call(), refused),
                  device.code(), device.op()));
  }
  return failure;
}

std::vector<std::string> CompiledStep::changed_in_place() const {
  const auto& t = graph_.tensors;
  const auto& n = graph_.nodes;
  std::vector<std::string> names;
  std::vector<char> seen(t.size(), 0);
  for (NodeId id = 0; id < n.size(); ++id) {
    if (!impl_->in_place[id] || !impl_->started[id]) continue;
    for (TensorId x : n.outputs(id)) {
      const TensorId s = t.storage(x);
      if (plan_.pool[s] != Pool::persistent || !offload::home_traits(t.home[s]).addressed_in_place || seen[s]) continue;
      seen[s] = 1;
      names.push_back(t.name[s]);
    }
  }
  return names;
}

// Each node's predecessors: the node before it on its lane (in-order queues keep that order),
// the latest conflicting node of every other lane (also its OpenCL wait list), and with `serial`
// the node before it in the static order.
std::vector<std::vector<NodeId>> CompiledStep::order_nodes(bool serial) {
  auto& t = graph_.tensors;
  auto& n = graph_.nodes;
  std::vector<std::vector<ByteAccess>> accesses(n.size());
  for (NodeId id = 0; id < n.size(); ++id) {
    auto add = [&](TensorId tid, bool write) {
      if (tid == no_tensor) return;
      const TensorId s = t.storage(tid);
      const Placement& p = t.placement[s];
      // One space per (pool, home, buffer): persistent tensors of different homes never share bytes.
      const std::uint32_t home = plan_.pool[s] == Pool::persistent ? static_cast<std::uint32_t>(t.home[s]) : 0;
      const std::uint32_t space =
          (p.buffer * 4u + static_cast<std::uint32_t>(plan_.pool[s])) * offload::home_count + home;
      accesses[id].push_back({space, p.offset_bytes, p.offset_bytes + t.bytes(tid), write});
    };
    for (TensorId tid : n.inputs(id)) add(tid, false);
    for (TensorId tid : n.outputs(id)) add(tid, true);
    add(n.scratch[id], true);
  }
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

  for (NodeId id = 0; id < n.size(); ++id) {
    const bool writes_state_on_host =
        n.lane[id] == Lane::host ||
        (n.op[id] == builtin::write_back && plan_.pool[t.storage(n.outputs(id)[0])] == Pool::persistent);
    impl_->commits_other_slot = impl_->commits_other_slot || writes_state_on_host;
  }
  return preds;
}

// The flow graph: a node per step node (plus an event gate and a worker node for host-lane
// nodes), edges from the predecessors, and the finish gate after every lane's last node.
void CompiledStep::build_flow_graph(const cl::Context& context, bool serial,
                                    const std::vector<std::vector<NodeId>>& preds) {
  auto& n = graph_.nodes;
  std::array<NodeId, lane_count> last_on_lane;
  last_on_lane.fill(static_cast<NodeId>(-1));
  for (NodeId id = 0; id < n.size(); ++id) last_on_lane[static_cast<int>(n.lane[id])] = id;
  impl_->events.resize(n.size());
  impl_->wait_lists.resize(n.size());
  impl_->gates.resize(n.size());
  impl_->gate_nodes.resize(n.size());
  impl_->host_work.resize(n.size());
  impl_->first_events.resize(n.size());
  impl_->host_enqueue_ns.assign(n.size(), 0);
  impl_->host_start_ns.assign(n.size(), 0);
  impl_->host_end_ns.assign(n.size(), 0);
  Impl* im = impl_.get();
  for (NodeId id = 0; id < n.size(); ++id) {
    impl_->nodes.push_back(std::make_unique<tbb::flow::continue_node<continue_msg>>(
        impl_->flow, [this, im, id, serial](const continue_msg&) {
          const auto& nodes = graph_.nodes;
          cl::OpScope scope(nodes.name[id]);
          try {
            // A host-lane node's failure is injected where its work runs (run_host_node).
            const std::optional<Fault> fault = is_host_lane(nodes.lane[id]) ? std::nullopt : take_injected_failure(id);
            if (fault == Fault::exception || fault == Fault::host_throw) {
              throw std::runtime_error("injected failure");
            }
            // Reused every step: its capacity stays, so building a wait list allocates nothing.
            std::vector<cl_event>& wait = im->wait_lists[id];
            wait.clear();
            for (NodeId m : im->waits[id]) {
              if (im->events[m]) wait.push_back(im->events[m].get());
            }
            if (serial && id > 0 && im->events[id - 1]) wait.push_back(im->events[id - 1].get());
            if (is_host_lane(nodes.lane[id])) {
              im->gates[id]->wait.assign(wait.begin(), wait.end());  // the gate waits for these, then the work runs
              return;
            }
            const cl_command_queue q = queue_of(im->ctx, nodes.lane[id]);
            if (fault == Fault::enqueue_error) {
              // A real command the driver must refuse: the node's kernel launched with 0 dimensions,
              // or a copy far past the end of a step buffer.
              const std::size_t one = 1;
              const auto kernel = std::find_if(im->launches[id].begin(), im->launches[id].end(),
                                               [](const ops::KernelLaunch& l) { return l.kernel.get() != nullptr; });
              if (nodes.lane[id] == Lane::compute && kernel != im->launches[id].end()) {
                FERRY_CL(
                    clEnqueueNDRangeKernel(q, kernel->kernel.get(), 0, nullptr, &one, nullptr, 0, nullptr, nullptr));
              } else {
                const cl_mem b = im->transient.at(0).get();
                FERRY_CL(
                    clEnqueueCopyBuffer(q, b, b, 0, std::size_t{1} << 40, std::size_t{1} << 40, 0, nullptr, nullptr));
              }
              throw std::logic_error("the driver accepted a command it must refuse");
            }
            cl::Event failing;  // Fault::device_error: a user event the command waits on, then set to an error
            if (fault == Fault::device_error) {
              cl_int rc = CL_SUCCESS;
              failing = cl::Event(clCreateUserEvent(im->ctx.get(), &rc));
              cl::check(rc, "clCreateUserEvent(injected failure)");
              wait.push_back(failing.get());
            }
            cl::Event ev;
            // Transfers-only runs (overlap measurement) enqueue the copies but no compute.
            if (im->mode != RunMode::transfers_only || nodes.lane[id] != Lane::compute) {
              if (im->ctx.profiling()) im->host_enqueue_ns[id] = steady_ns();
              if (im->in_place[id]) im->started[id] = 1;  // from here its commands may run
              ev = ops::enqueue(q, im->launches[id], wait, im->step,
                                im->ctx.profiling() ? &im->first_events[id] : nullptr);
            }
            if (!ev) {
              FERRY_CL(clEnqueueMarkerWithWaitList(q, static_cast<cl_uint>(wait.size()),
                                                   wait.empty() ? nullptr : wait.data(), ev.out()));
            }
            im->events[id] = std::move(ev);
            if (failing) FERRY_CL(clSetUserEventStatus(failing.get(), CL_OUT_OF_RESOURCES));
            // Flush so that commands on other queues waiting on this one can start. clFlush may
            // also run the queue to completion before it returns (Oclgrind does): that is safe
            // because every event this node waits for was enqueued and flushed before it.
            FERRY_CL(clFlush(q));
          } catch (const cl::Error&) {
            throw;  // already names the op through OpScope
          } catch (const std::exception& e) {
            throw std::runtime_error(
                fmt::format("step node '{}' ({}): {}", nodes.name[id], op_name(nodes.op[id]), e.what()));
          }
        }));
  }
  for (NodeId id = 0; id < n.size(); ++id) {
    if (!is_host_lane(n.lane[id])) continue;
    auto gate = std::make_unique<Impl::EventGate>();
    gate->queue = context.queue(cl::QueueKind::d2h);
    Impl::EventGate* g = gate.get();
    impl_->gates[id] = std::move(gate);
    impl_->gate_nodes[id] = std::make_unique<DoneNode>(
        impl_->flow, tbb::flow::unlimited, [g](const continue_msg&, DoneNode::gateway_type& gw) { g->open(gw); });
    impl_->host_work[id] =
        std::make_unique<tbb::flow::continue_node<continue_msg>>(impl_->flow, [this, im, g, id](const continue_msg&) {
          const auto& nodes = graph_.nodes;
          if (g->status < 0) {
            throw cl::Error(fmt::format("a device command host node '{}' waited for", nodes.name[id]), g->status,
                            nodes.name[id]);
          }
          if (im->mode == RunMode::transfers_only) return;
          if (im->ctx.profiling()) im->host_start_ns[id] = steady_ns();
          run_host_node(id);
          if (im->ctx.profiling()) im->host_end_ns[id] = steady_ns();
        });
    tbb::flow::make_edge(*impl_->nodes[id], *impl_->gate_nodes[id]);
    tbb::flow::make_edge(*impl_->gate_nodes[id], *impl_->host_work[id]);
  }
  auto exit_of = [&](NodeId id) -> tbb::flow::sender<continue_msg>& {
    if (impl_->host_work[id]) return *impl_->host_work[id];
    if (id == impl_->commit) return *impl_->commit_check;
    return *impl_->nodes[id];
  };
  if (impl_->commit != Impl::no_node) {
    // The commit gate: after the commit node and the last node before it on every other lane, a
    // marker on the commit node's queue waits for their commands; then every command before the
    // commit point must have succeeded before anything after it is enqueued.
    const NodeId commit = impl_->commit;
    impl_->commit_gate.queue = queue_of(context, n.lane[commit]);
    impl_->commit_join =
        std::make_unique<tbb::flow::continue_node<continue_msg>>(impl_->flow, [im](const continue_msg&) {
          im->commit_gate.wait.clear();
          for (NodeId m : im->commit_waits) {
            if (im->events[m]) im->commit_gate.wait.push_back(im->events[m].get());
          }
        });
    impl_->commit_gate_node =
        std::make_unique<DoneNode>(impl_->flow, tbb::flow::unlimited,
                                   [im](const continue_msg&, DoneNode::gateway_type& gw) { im->commit_gate.open(gw); });
    impl_->commit_check =
        std::make_unique<tbb::flow::continue_node<continue_msg>>(impl_->flow, [this, im, commit](const continue_msg&) {
          check_device_status(commit + 1, im->commit_gate.status, "the step before its commit point");
        });
    tbb::flow::make_edge(*impl_->nodes[commit], *impl_->commit_join);
    for (NodeId m : impl_->commit_waits) {
      if (m != commit) tbb::flow::make_edge(exit_of(m), *impl_->commit_join);
    }
    tbb::flow::make_edge(*impl_->commit_join, *impl_->commit_gate_node);
    tbb::flow::make_edge(*impl_->commit_gate_node, *impl_->commit_check);
  }
  for (NodeId id = 0; id < n.size(); ++id) {
    if (preds[id].empty()) tbb::flow::make_edge(impl_->start, *impl_->nodes[id]);
    for (NodeId m : preds[id]) tbb::flow::make_edge(exit_of(m), *impl_->nodes[id]);
  }

  // Finish: an event gate after every lane's last command; its opening ends wait_for_all().
  std::vector<NodeId> lane_tails;
  for (NodeId tail : last_on_lane) {
    if (tail != static_cast<NodeId>(-1)) lane_tails.push_back(tail);
  }
  impl_->finish_gate.queue = context.compute();
  impl_->finish =
      std::make_unique<tbb::flow::continue_node<continue_msg>>(impl_->flow, [im, lane_tails](const continue_msg&) {
        im->finish_gate.wait.clear();
        for (NodeId tail : lane_tails) {
          if (im->events[tail]) im->finish_gate.wait.push_back(im->events[tail].get());
        }
        if (im->status) {
          // The status word after every command of the step; the gate waits for this read.
          cl::OpScope scope("the step's status word");
          cl::Event read;
          auto& wait = im->finish_gate.wait;
          FERRY_CL(clEnqueueReadBuffer(im->ctx.compute(), im->status.get(), CL_FALSE, 0, sizeof(cl_uint),
                                       &im->status_host, static_cast<cl_uint>(wait.size()),
                                       wait.empty() ? nullptr : wait.data(), read.out()));
          im->status_read = std::move(read);
          wait.assign(1, im->status_read.get());
        }
      });
  for (NodeId tail : lane_tails) tbb::flow::make_edge(exit_of(tail), *impl_->finish);
  impl_->done =
      std::make_unique<DoneNode>(impl_->flow, tbb::flow::unlimited,
                                 [im](const continue_msg&, DoneNode::gateway_type& gw) { im->finish_gate.open(gw); });
  tbb::flow::make_edge(*impl_->finish, *impl_->done);
}

CompiledStep::~CompiledStep() {
  if (impl_) {
    impl_->flow.wait_for_all();
    try {
      impl_->ctx.finish_all();
    } catch (...) {
      // Destructors must not throw; the queues are being torn down anyway.
    }
  }
}

namespace {

// A host-lane node's operands in host memory: persistent tensors read from the current slot and
// written into the other; step tensors (a gradient written back for the host) have one place.
class HostNode final : public NodeView<ops::HostContext> {
 public:
  HostNode(const Graph& g, NodeId n, const PersistentArena& arena, std::function<std::byte*(TensorId, bool)> at,
           const ops::StepInfo& step, const OptimizerSpec& optimizer, std::atomic<bool>& non_finite)
      : NodeView(g, n),
        arena_(arena),
        at_(std::move(at)),
        step_(step),
        optimizer_(optimizer),
        non_finite_(non_finite) {}
  void report_non_finite_weight() const override { non_finite_ = true; }
  const std::byte* in(std::size_t i) const override {
    if (fail_) throw std::runtime_error(fmt::format("injected failure reading input {} in the host work", i));
    return at_(in_ids()[i], false);
  }
  std::byte* out(std::size_t i) const override { return at_(out_ids()[i], true); }
  void unpack_home(std::size_t i, std::byte* dst) const override {
    if (fail_) throw std::runtime_error(fmt::format("injected failure unpacking input {} in the host work", i));
    const TensorId id = graph_.tensors.storage(in_ids()[i]);
    store_of(id).unpack(place_of(id), dst, graph_.tensors.bytes(id));
  }
  // Fault::host_throw: reading an operand throws, from inside the op's host function.
  void fail() { fail_ = true; }
  const ops::StepInfo& step() const override { return step_; }
  const OptimizerSpec& optimizer() const override { return optimizer_; }
  void pack_home(std::size_t i, const std::byte* src) const override {
    const TensorId id = graph_.tensors.storage(out_ids()[i]);
    store_of(id).pack(place_of(id), src, graph_.tensors.bytes(id));
  }

 private:
  offload::HomeStore& store_of(TensorId id) const { return arena_.store(graph_.tensors.home[id]); }
  offload::HomePlace place_of(TensorId id) const {
    const Placement& p = graph_.tensors.placement[id];
    return {p.buffer, p.offset_bytes};
  }
  const PersistentArena& arena_;
  std::function<std::byte*(TensorId, bool)> at_;
  const ops::StepInfo& step_;
  const OptimizerSpec& optimizer_;
  std::atomic<bool>& non_finite_;
  bool fail_ = false;
};

}  // namespace

void CompiledStep::run_host_node(NodeId id) {
  const auto& nodes = graph_.nodes;
  cl::OpScope scope(nodes.name[id]);
  const std::optional<Fault> fault = take_injected_failure(id);
  if (fault == Fault::exception) {
    throw std::runtime_error(
        fmt::format("step node '{}' (host {}): injected failure", nodes.name[id], op_name(nodes.op[id])));
  }
  const ops::OpInfo& row = ops::op_info(nodes.op[id]);
  if (!row.host) {
    throw std::logic_error(fmt::format("node '{}' ({}) cannot run on the host", nodes.name[id], row.name));
  }
  auto at = [this](TensorId x, bool write) { return host_address(x, write); };
  HostNode node(graph_, id, *persistent_, at, impl_->step, impl_->optimizer, impl_->host_non_finite);
  if (fault) node.fail();
  try {
    row.host(node);
  } catch (const cl::Error&) {
    throw;  // names the op through OpScope
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("step node '{}' (host {}): {}", nodes.name[id], row.name, e.what()));
  }
}

std::byte* CompiledStep::host_address(TensorId id, bool next) const {
  const TensorId s = graph_.tensors.storage(id);
  const Placement& p = graph_.tensors.placement[s];
  if (plan_.pool[s] == Pool::persistent) {
    const offload::HomeStore& store = persistent_->store(graph_.tensors.home[s]);
    return next ? store.next({p.buffer, p.offset_bytes}) : store.current({p.buffer, p.offset_bytes});
  }
  if (plan_.pool[s] == Pool::host_transient) {
    return static_cast<std::byte*>(impl_->host_transient.at(p.buffer).data()) + p.offset_bytes;
  }
  throw std::logic_error(fmt::format("tensor '{}' has no host memory", graph_.tensors.name[id]));
}

ops::DeviceSpan CompiledStep::span(TensorId id) const {
  const TensorId s = graph_.tensors.storage(id);
  const Placement& p = graph_.tensors.placement[s];
  if (plan_.pool[s] == Pool::persistent) {
    return {persistent_->store(graph_.tensors.home[s]).device_buffer(p.buffer), p.offset_bytes};
  }
  if (plan_.pool[s] == Pool::host_transient) return {impl_->host_transient.at(p.buffer).mem(), p.offset_bytes};
  return {impl_->transient.at(p.buffer).get(), p.offset_bytes};
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
  return {host_address(it->second, false), graph_.tensors.bytes(it->second)};
}

std::span<const std::byte> CompiledStep::host_output(std::string_view name) const {
  const auto it = impl_->downloads.find(name);
  if (it == impl_->downloads.end()) {
    throw std::invalid_argument(
        fmt::format("this step has no result '{}'; it downloads: {}", name, names_of(impl_->downloads)));
  }
  return {host_address(it->second, false), graph_.tensors.bytes(it->second)};
}

std::vector<std::string> CompiledStep::host_input_names() const {
  std::vector<std::string> out;
  for (const auto& [name, id] : impl_->uploads) out.push_back(name);
  return out;
}

const float* CompiledStep::stats_host() const {
  return impl_->stats == no_tensor ? nullptr : reinterpret_cast<const float*>(host_address(impl_->stats, false));
}

void CompiledStep::run(const ops::StepInfo& step, RunMode mode) {
  if (!impl_->bound)
    throw std::logic_error("this step was compiled without kernels (bind_kernels = false): it cannot run");
  impl_->step = step;
  impl_->mode = mode;
  impl_->finish_gate.status = CL_COMPLETE;
  if (impl_->ctx.profiling()) {
    std::fill(impl_->host_enqueue_ns.begin(), impl_->host_enqueue_ns.end(), 0);
    std::fill(impl_->host_start_ns.begin(), impl_->host_start_ns.end(), 0);
    std::fill(impl_->host_end_ns.begin(), impl_->host_end_ns.end(), 0);
  }
  for (auto& gate : impl_->gates) {
    if (gate) gate->status = CL_COMPLETE;
  }
  impl_->commit_gate.status = CL_COMPLETE;
  std::fill(impl_->started.begin(), impl_->started.end(), 0);
  impl_->host_non_finite = false;
  impl_->status_host = 0;
  if (impl_->status) {
    // In order on the compute queue, where the device updates run: cleared before any of them.
    const cl_uint zero = 0;
    cl::OpScope scope("the step's status word");
    FERRY_CL(clEnqueueFillBuffer(impl_->ctx.compute(), impl_->status.get(), &zero, sizeof zero, 0, sizeof zero, 0,
                                 nullptr, nullptr));
  }
  impl_->start.try_put(continue_msg{});
  std::exception_ptr failure;
  bool cancelled = false;
  try {
    impl_->flow.wait_for_all();
  } catch (...) {
    failure = std::current_exception();
    cancelled = true;
  }
  if (!failure) {
    // A command failed on the device: its node is the first whose event says so.
    try {
      check_device_status(static_cast<NodeId>(graph_.nodes.size()), impl_->finish_gate.status, "the step");
    } catch (...) {
      failure = std::current_exception();
    }
  }
  if (failure) {
    // Commands already enqueued still use the arena: let them finish before anyone reuses it.
    try {
      impl_->ctx.finish_all();
    } catch (...) {
    }
    if (cancelled) impl_->flow.reset();
    if (cancelled) failure = root_cause(failure);
    for (auto& e : impl_->events) e = cl::Event();
    persistent_->abort();  // next values this step wrote are not the state
    std::vector<std::string> changed = changed_in_place();
    if (changed.empty()) std::rethrow_exception(failure);
    std::string what;
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
      what = "an unknown failure";
    }
    constexpr std::size_t shown = 8;
    std::string list;
    for (std::size_t i = 0; i < changed.size() && i < shown; ++i)
      list += fmt::format("{}'{}'", i ? ", " : "", changed[i]);
    if (changed.size() > shown) list += fmt::format(" and {} more", changed.size() - shown);
    throw PartialUpdateError(
        fmt::format("{}; this step had begun changing state kept in place (on the device): {} may hold this step's "
                    "update, while the rest of the training state is as it was before the step",
                    what, list),
        std::move(changed), failure);
  }
  // Every updated tensor now sits in the other slot: it becomes the current state.
  // (A transfers-only run computed nothing: its write-backs are not a new state.)
  // A step whose overflow guard is not finite skipped its updates on the device; streamed
  // updates, which check only the loss, and host updates are undone by not committing their slot.
  if (impl_->commits_other_slot) {
    const TensorId guard = impl_->guard != no_tensor ? impl_->guard : impl_->stats;
    const float* checked = guard == no_tensor ? nullptr : reinterpret_cast<const float*>(host_address(guard, false));
    if (mode == RunMode::normal && (checked == nullptr || std::isfinite(checked[0]))) {
      persistent_->commit();
    } else {
      persistent_->abort();
    }
  }
}

bool CompiledStep::wrote_non_finite_weight() const noexcept {
  return impl_->status_host != 0 || impl_->host_non_finite;
}

std::vector<TimelineEntry> CompiledStep::timeline() const {
  std::vector<TimelineEntry> out;
  if (!impl_->ctx.profiling()) return out;
  const auto& nodes = graph_.nodes;
  const auto describe = [&](NodeId id) {
    TimelineEntry e{nodes.name[id], nodes.lane[id], 0, 0, 0};
    e.op = std::string(op_name(nodes.op[id]));
    for (TensorId t : nodes.inputs(id)) {
      e.inputs.push_back(graph_.tensors.name[t]);
      e.bytes += graph_.tensors.bytes(t);
    }
    for (TensorId t : nodes.outputs(id)) {
      e.outputs.push_back(graph_.tensors.name[t]);
      e.bytes += graph_.tensors.bytes(t);
    }
    return e;
  };
  // Host clock to device clock: the driver stamps a command's QUEUED time just after the host
  // stamped its enqueue, so the smallest difference is the closest estimate of the offset.
  bool have_offset = false;
  std::int64_t offset = 0;
  for (NodeId id = 0; id < nodes.size(); ++id) {
    const cl::Event& ev = impl_->events[id];
    if (is_host_lane(nodes.lane[id])) {
      if (impl_->host_end_ns[id] == 0) continue;
      TimelineEntry e = describe(id);
      e.queued_ns = e.start_ns = impl_->host_start_ns[id];
      e.end_ns = impl_->host_end_ns[id];
      out.push_back(std::move(e));
      continue;
    }
    if (!ev) continue;
    TimelineEntry e = describe(id);
    clGetEventProfilingInfo(impl_->first_events[id] ? impl_->first_events[id].get() : ev.get(),
                            CL_PROFILING_COMMAND_QUEUED, sizeof(cl_ulong), &e.queued_ns, nullptr);
    const cl::Event& first = impl_->first_events[id] ? impl_->first_events[id] : ev;
    clGetEventProfilingInfo(first.get(), CL_PROFILING_COMMAND_START, sizeof(cl_ulong), &e.start_ns, nullptr);
    clGetEventProfilingInfo(ev.get(), CL_PROFILING_COMMAND_END, sizeof(cl_ulong), &e.end_ns, nullptr);
    if (impl_->host_enqueue_ns[id] != 0 && e.queued_ns != 0) {
      const auto d = static_cast<std::int64_t>(e.queued_ns) - static_cast<std::int64_t>(impl_->host_enqueue_ns[id]);
      if (!have_offset || d < offset) offset = d;
      have_offset = true;
    }
    out.push_back(std::move(e));
  }
  for (auto& e : out) {
    if (!is_host_lane(e.lane)) continue;
    e.queued_ns = static_cast<std::uint64_t>(static_cast<std::int64_t>(e.queued_ns) + offset);
    e.start_ns = static_cast<std::uint64_t>(static_cast<std::int64_t>(e.start_ns) + offset);
    e.end_ns = static_cast<std::uint64_t>(static_cast<std::int64_t>(e.end_ns) + offset);
  }
  return out;
}

}  // namespace ferry::graph
