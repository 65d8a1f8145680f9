// The one-pass form of a step (steps without host-lane nodes): every device command, in static
// order, enqueued by the calling thread with its dependencies as OpenCL wait lists. Nothing here
// waits for the device, allocates after the first step, takes a lock or wakes a thread.
#include <fmt/format.h>

#include <algorithm>

#include "compiled_step_impl.hpp"
#include "ops/attrs.hpp"

namespace ferry::graph {
namespace {

// A queue is flushed after this many commands of the step if nothing else flushed it: often
// enough that a GPU starts on the step while the host is still enqueueing it, rarely enough that
// clFlush (a few microseconds on some drivers) stays a small part of a node's cost.
constexpr std::uint32_t flush_every = 16;

// Which node each lane's queue has flushed up to this step. OpenCL requires that a command whose
// event another queue waits on was flushed before that wait can be relied on, so a flush is
// owed only where a node waits on another lane's unflushed command, and at the end.
class Flusher {
 public:
  explicit Flusher(const cl::Context& ctx) : ctx_(ctx) { pending_.fill(none); }
  // Node `id` on `lane` was enqueued.
  void enqueued(Lane lane, NodeId id) {
    const auto l = static_cast<std::size_t>(lane);
    if (pending_[l] == none) pending_[l] = id;
    if (++since_[l] >= flush_every) flush(lane);
  }
  // A command is about to wait on node `m` of `lane`.
  void before_waiting_on(Lane lane, NodeId m) {
    const auto l = static_cast<std::size_t>(lane);
    if (pending_[l] != none && pending_[l] <= m) flush(lane);
  }
  void flush(Lane lane) {
    const auto l = static_cast<std::size_t>(lane);
    FERRY_CL(clFlush(queue_of(ctx_, lane)));
    pending_[l] = none;
    since_[l] = 0;
  }
  void flush_all() {
    for (int l = 0; l < lane_count; ++l) {
      if (pending_[l] != none) flush(static_cast<Lane>(l));
    }
  }

 private:
  static constexpr NodeId none = static_cast<NodeId>(-1);
  const cl::Context& ctx_;
  std::array<NodeId, lane_count> pending_;  // the first node not yet flushed, per lane
  std::array<std::uint32_t, lane_count> since_{};
};

}  // namespace

void CompiledStep::enqueue_device_node(Submission& s, NodeId id, std::vector<cl_event>& wait,
                                       std::optional<Fault> fault) {
  Impl& im = *impl_;
  const Lane lane = graph_.nodes.lane[id];
  const bool profiling = im.ctx.profiling();
  const cl_command_queue q = queue_of(im.ctx, lane);
  if (fault == Fault::enqueue_error) {
    // A real command the driver must refuse: the node's kernel launched with 0 dimensions,
    // or a copy far past the end of a step buffer.
    const std::size_t one = 1;
    const auto kernel = std::find_if(im.launches[id].begin(), im.launches[id].end(),
                                     [](const ops::KernelLaunch& l) { return l.kernel.get() != nullptr; });
    if (lane == Lane::compute && kernel != im.launches[id].end()) {
      FERRY_CL(clEnqueueNDRangeKernel(q, kernel->kernel.get(), 0, nullptr, &one, nullptr, 0, nullptr, nullptr));
    } else {
      const cl_mem b = im.transient.at(0).get();
      FERRY_CL(clEnqueueCopyBuffer(q, b, b, 0, std::size_t{1} << 40, std::size_t{1} << 40, 0, nullptr, nullptr));
    }
    throw std::logic_error("the driver accepted a command it must refuse");
  }
  cl::Event failing;  // Fault::device_error: a user event the command waits on, then set to an error
  if (fault == Fault::device_error) {
    cl_int rc = CL_SUCCESS;
    failing = cl::Event(clCreateUserEvent(im.ctx.get(), &rc));
    cl::check(rc, "clCreateUserEvent(injected failure)");
    wait.push_back(failing.get());
  }
  // A chunked fetch waits, while it is enqueued, for its first chunks' copies (and so for its wait
  // list) once its tensor outgrows the ring: its wait list may hold only commands that complete
  // without it, so an injected failure is set before it is enqueued, not after.
  const bool chunked =
      graph_.nodes.op[id] == builtin::fetch && ops::FetchAttrs::of(graph_.nodes.attrs[id]).chunk_kib > 0;
  if (failing && chunked) FERRY_CL(clSetUserEventStatus(failing.get(), CL_OUT_OF_RESOURCES));
  cl::Event ev;
  // Transfers-only runs (overlap measurement) enqueue the copies but no compute.
  if (s.mode != RunMode::transfers_only || lane != Lane::compute) {
    if (im.in_place[id]) s.started[id] = 1;  // from here its commands may run
    ev = ops::enqueue(q, im.launches[id], wait, s.step, profiling ? &s.first_events[id] : nullptr);
  }
  if (!ev) {
    FERRY_CL(clEnqueueMarkerWithWaitList(q, static_cast<cl_uint>(wait.size()), wait.empty() ? nullptr : wait.data(),
                                         ev.out()));
  }
  s.events[id] = std::move(ev);
  if (failing && !chunked) FERRY_CL(clSetUserEventStatus(failing.get(), CL_OUT_OF_RESOURCES));
}

// The commit point: a marker that every in-place node after it waits for, and that fails when
// any command of the step before it failed. Failure reaches it only through explicit waits (a
// failed command does not fail its in-order successors everywhere; Oclgrind runs them), so it
// depends, directly, on every command so far. One marker with hundreds of events in its list
// cost PoCL milliseconds (5.4 ms for 450 in `ferry-bench hostpath`), so the events go into
// markers of at most 32 each, and the commit marker waits for those. Each group is flushed
// before the next depends on it: an implementation that runs commands when they are flushed
// (Oclgrind) then has every dependency settled, failed or not, when a waiter checks it.
void CompiledStep::enqueue_commit_markers(Submission& s) {
  Impl& im = *impl_;
  const auto& nodes = graph_.nodes;
  const cl_command_queue q = queue_of(im.ctx, nodes.lane[im.commit]);
  constexpr std::size_t group = 32;
  std::vector<cl_event>& list = im.commit_wait;
  std::vector<cl::Event>& groups = s.commit_groups;
  groups.clear();
  list.clear();
  for (NodeId m = 0; m <= im.commit; ++m) {
    if (s.events[m]) list.push_back(s.events[m].get());
    if (list.size() == group || (m == im.commit && !list.empty())) {
      cl::Event g;
      FERRY_CL(clEnqueueMarkerWithWaitList(q, static_cast<cl_uint>(list.size()), list.data(), g.out()));
      groups.push_back(std::move(g));
      list.clear();
    }
  }
  FERRY_CL(clFlush(q));
  for (const cl::Event& g : groups) list.push_back(g.get());
  FERRY_CL(clEnqueueMarkerWithWaitList(q, static_cast<cl_uint>(list.size()), list.empty() ? nullptr : list.data(),
                                       s.commit_marker.out()));
  FERRY_CL(clFlush(q));
}

void CompiledStep::enqueue_pass(Submission& s, const Submission* previous) {
  Impl& im = *impl_;
  const auto& nodes = graph_.nodes;
  const bool profiling = im.ctx.profiling();
  Flusher flusher(im.ctx);
  // The step before this one, if still in flight, must be done with the arena before this
  // step's commands touch it: each lane's first command waits for its end (the compute lane is
  // in order after it already). The device runs the two back to back; the host waits for neither.
  std::array<bool, lane_count> lane_started{};
  const cl_event before = previous && previous->finish ? previous->finish.get() : nullptr;

  for (NodeId id = 0; id < nodes.size(); ++id) {
    if (profiling) s.enqueue_begin_ns[id] = steady_ns();
    const Lane lane = nodes.lane[id];
    cl::OpScope scope(nodes.name[id]);
    try {
      const std::optional<Fault> fault = take_injected_failure(id);
      if (fault == Fault::exception || fault == Fault::host_throw) throw std::runtime_error("injected failure");
      // Reused every step: its capacity stays, so building a wait list allocates nothing.
      std::vector<cl_event>& wait = im.wait_lists[id];
      wait.clear();
      for (NodeId m : im.waits[id]) {
        if (!s.events[m]) continue;
        flusher.before_waiting_on(nodes.lane[m], m);
        wait.push_back(s.events[m].get());
      }
      if (im.serial && id > 0 && s.events[id - 1]) {
        flusher.before_waiting_on(nodes.lane[id - 1], id - 1);
        wait.push_back(s.events[id - 1].get());
      }
      if (!lane_started[static_cast<int>(lane)]) {
        lane_started[static_cast<int>(lane)] = true;
        if (before && lane != Lane::compute) wait.push_back(before);
      }
      // After the commit point, explicitly: its failure fails this node.
      if (im.in_place[id] && s.commit_marker) wait.push_back(s.commit_marker.get());
      enqueue_device_node(s, id, wait, fault);
      flusher.enqueued(lane, id);
      if (id == im.commit) {
        flusher.flush_all();  // (every lane: see enqueue_commit_markers)
        enqueue_commit_markers(s);
      }
    } catch (const cl::Error&) {
      throw;  // already names the op through OpScope
    } catch (const std::exception& e) {
      throw std::runtime_error(fmt::format("step node '{}' ({}): {}", nodes.name[id], op_name(nodes.op[id]), e.what()));
    }
    if (profiling) s.enqueue_end_ns[id] = steady_ns();
  }

  // The end of the step: one command after every lane's last one (the status word's read when the
  // updates have one), which is all the host waits for.
  cl::OpScope scope("the end of the step");
  std::vector<cl_event>& tails = im.commit_wait;
  tails.clear();
  for (NodeId tail : im.last_on_lane) {
    if (tail == Impl::no_node || !s.events[tail]) continue;
    flusher.before_waiting_on(nodes.lane[tail], tail);
    tails.push_back(s.events[tail].get());
  }
  if (im.status) {
    FERRY_CL(clEnqueueReadBuffer(im.ctx.compute(), im.status.get(), CL_FALSE, 0, sizeof(cl_uint), &s.status_host,
                                 static_cast<cl_uint>(tails.size()), tails.empty() ? nullptr : tails.data(),
                                 s.finish.out()));
  } else {
    FERRY_CL(clEnqueueMarkerWithWaitList(im.ctx.compute(), static_cast<cl_uint>(tails.size()),
                                         tails.empty() ? nullptr : tails.data(), s.finish.out()));
  }
  FERRY_CL(clSetEventCallback(s.finish.get(), CL_COMPLETE, &Submission::on_finish, &s));
  flusher.flush_all();
  flusher.flush(Lane::compute);
}

void CL_CALLBACK CompiledStep::Submission::on_finish(cl_event, cl_int, void* user) {
  // On a driver thread, or inline if the command is already complete: hand over, never wait.
  auto* s = static_cast<Submission*>(user);
  s->done.store(true);
  s->done.notify_all();
}

}  // namespace ferry::graph
