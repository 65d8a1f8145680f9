// Running a compiled step: submitting and waiting (the host's one wait per step), failures and
// what they leave, results, and the step's timeline. The enqueue itself is enqueue.cpp (one-pass
// form) or host_lane.cpp (flow-graph form).
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <exception>
#include <stdexcept>

#include "compiled_step_impl.hpp"

namespace ferry::graph {

void CompiledStep::Submission::reset(std::size_t nodes, bool profiling) {
  // assign() keeps each vector's capacity: after the first step, resetting allocates nothing.
  events.assign(nodes, cl::Event());
  started.assign(nodes, 0);
  if (profiling) {
    first_events.assign(nodes, cl::Event());
    enqueue_begin_ns.assign(nodes, 0);
    enqueue_end_ns.assign(nodes, 0);
    host_start_ns.assign(nodes, 0);
    host_end_ns.assign(nodes, 0);
    host_ready_ns.assign(nodes, 0);
    host_gate_ns.assign(nodes, 0);
  }
  waits.clear();
  done = false;
  commit_marker = cl::Event();
  commit_groups.clear();
  finish = cl::Event();
  status_host = 0;
  host_non_finite = false;
  requests.resize(nodes);  // a request left by a cancelled step is waited for where it is replaced
  comm_failures.assign(nodes, nullptr);
  failure = nullptr;
  cancelled = false;
  finish_status = CL_COMPLETE;
}

CompiledStep::~CompiledStep() {
  if (impl_) {
    impl_->flow.wait_for_all();
    try {
      impl_->ctx.finish_all();  // steps still in flight use the arena
    } catch (...) {
      // Destructors must not throw; the queues are being torn down anyway.
    }
  }
  if (persistent_ && persistent_->deferred_owner == this) {
    // Other variants holding the arena may go on with it: the last step's update goes into it now
    // (unless a step is still in flight: then the state is that step's business, and it was
    // abandoned). Alone with it, the state goes with this step.
    try {
      if (impl_->count == 0 && persistent_.use_count() > 1) apply_deferred_updates();
    } catch (...) {
      // A destructor cannot report it; the update is lost, as the step in flight would be.
    }
    persistent_->apply_deferred = nullptr;
    persistent_->deferred_owner = nullptr;
  }
}

const ops::LaunchList& CompiledStep::launches(NodeId n) const {
  return impl_->launches.at(n);
}

std::size_t CompiledStep::in_flight() const noexcept {
  return impl_->count;
}

bool CompiledStep::can_run_ahead() const noexcept {
  return impl_->one_pass && !impl_->commits_other_slot && !impl_->fetches_pageable;
}

std::uint64_t CompiledStep::host_waits() const noexcept {
  return impl_->host_waits.load();
}

void CompiledStep::check_device_status(const Submission& s, NodeId end, cl_int gate_status, const char* where) const {
  // A failed command does not always fail the commands after it in its queue (Oclgrind runs them;
  // only commands that wait on it are failed), so every command's own status is read.
  for (NodeId id = 0; id < end; ++id) {
    cl_int st = CL_COMPLETE;
    if (s.events[id] &&
        clGetEventInfo(s.events[id].get(), CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, nullptr) == CL_SUCCESS &&
        st < 0) {
      const std::string& name = graph_.nodes.name[id];
      throw cl::Error(fmt::format("the device command of step node '{}' (reported by its event)", name), st, name);
    }
  }
  if (gate_status < 0)
    throw cl::Error(fmt::format("a command of {} (reported by its event)", where), gate_status, "step");
}

std::exception_ptr CompiledStep::root_cause(const Submission& s, std::exception_ptr failure) const {
  // Called after the queues drained: the events are settled.
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
    check_device_status(s, static_cast<NodeId>(graph_.nodes.size()), CL_COMPLETE, "the step");
  } catch (const cl::Error& device) {
    if (device.op() == refused_op) return failure;  // the node failed and was refused itself
    return std::make_exception_ptr(
        cl::Error(fmt::format("{}; after it the driver refused a later command ({})", device.call(), refused),
                  device.code(), device.op()));
  }
  return failure;
}

std::vector<std::string> CompiledStep::changed_in_place(const Submission& s) const {
  const auto& t = graph_.tensors;
  const auto& n = graph_.nodes;
  std::vector<std::string> names;
  if (s.commit_marker) {
    // Every in-place node waited for this marker: if it failed, none of them ran.
    cl_int st = CL_COMPLETE;
    if (clGetEventInfo(s.commit_marker.get(), CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, nullptr) ==
            CL_SUCCESS &&
        st < 0)
      return names;
  }
  std::vector<char> seen(t.size(), 0);
  for (NodeId id = 0; id < n.size(); ++id) {
    if (!(impl_->in_place[id] && s.started[id]) && !deferred_failed_part_way(s, id)) continue;
    for (TensorId x : n.outputs(id)) {
      const TensorId st = t.storage(x);
      if (!changes_in_place(st) || seen[st]) continue;
      seen[st] = 1;
      names.push_back(t.name[st]);
    }
  }
  return names;
}

std::exception_ptr CompiledStep::fail_step(Submission& s, std::exception_ptr failure, bool cancelled) {
  // Commands already enqueued still use the arena: let them finish before anyone reuses it.
  try {
    impl_->ctx.finish_all();
  } catch (...) {
  }
  // clFinish is not always the end of a failed step: Oclgrind runs a queue's commands by pulling
  // each one's predecessors when something needs it, and a command that fails for a failed event
  // in its wait list returns without pulling the commands before it in its queue, which then run
  // later, inside the next step. Each command not done yet is pulled here, one by one, through a
  // marker that waits for it and a clFinish (on a driver where clFinish drained the queues, this
  // only reads each status once). Not clWaitForEvents: Oclgrind reports an API error for a
  // failed event in its list.
  const cl_command_queue q = impl_->ctx.compute();
  const auto settle = [q](const cl::Event& e) {
    cl_int st = CL_COMPLETE;
    if (!e || clGetEventInfo(e.get(), CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, nullptr) != CL_SUCCESS ||
        st <= CL_COMPLETE)
      return;
    cl_event ev = e.get();
    cl::Event pull;
    if (clEnqueueMarkerWithWaitList(q, 1, &ev, pull.out()) == CL_SUCCESS) (void)clFinish(q);
  };
  for (const cl::Event& e : s.events) settle(e);
  settle(s.commit_marker);
  settle(s.finish);
  if (cancelled && !impl_->one_pass) impl_->flow.reset();
  if (cancelled) failure = root_cause(s, failure);
  persistent_->abort();  // next values this step wrote are not the state
  std::vector<std::string> changed = changed_in_place(s);
  if (changed.empty()) return failure;
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
  // A deferred update that began and did not finish: the step before's update, abandoned now.
  const auto& deferred = impl_->deferred;
  if (std::any_of(deferred.begin(), deferred.end(), [&](NodeId id) { return deferred_failed_part_way(s, id); })) {
    const std::uint64_t of = impl_->deferred_step.step;
    abandon_deferred_updates(what);
    return std::make_exception_ptr(PartialUpdateError(
        fmt::format("{}; this step had begun applying the update of step {} deferred into it: {} may hold part of "
                    "that update, which is abandoned (other weights hold it whole or not at all)",
                    what, of, list),
        std::move(changed), failure));
  }
  return std::make_exception_ptr(
      PartialUpdateError(fmt::format("{}; this step had begun changing state kept in place (on the device, or streamed "
                                     "state in host memory): {} may hold this step's "
                                     "update, while the rest of the training state is as it was before the step",
                                     what, list),
                         std::move(changed), failure));
}

void CompiledStep::run(const ops::StepInfo& step, RunMode mode) {
  submit(step, mode);
  wait();
}

void CompiledStep::submit(const ops::StepInfo& step, RunMode mode) {
  Impl& im = *impl_;
  if (!im.bound) throw std::logic_error("this step was compiled without kernels (bind_kernels = false): it cannot run");
  if (im.count == max_in_flight) {
    throw std::logic_error(
        fmt::format("{} steps are in flight already: wait() for the oldest before submitting another", max_in_flight));
  }
  if (im.count > 0 && !can_run_ahead()) {
    throw std::logic_error(
        "this step cannot be submitted while the one before it runs (it has host-lane nodes, or its state commits on "
        "the host when it succeeds): wait() for that one first");
  }
  refuse_after_deferred_failure();
  // Another variant's update deferred into its next step goes into the state before this step reads it.
  if (persistent_->deferred_owner != this) persistent_->settle_deferred();
  const std::size_t index = im.next;
  Submission& s = im.subs[index];
  const Submission* previous = im.count > 0 ? &im.subs[(index + max_in_flight - 1) % max_in_flight] : nullptr;
  s.reset(graph_.nodes.size(), im.ctx.profiling());
  s.step = step;
  s.mode = mode;
  s.slot = static_cast<int>(index);
  im.enqueue_slot = s.slot;
  if (im.status) {
    // The updates' status word, cleared in order on the compute queue, where the device updates
    // run: before any of them, and after the previous step's read of it.
    const cl_uint zero = 0;
    cl::OpScope scope("the step's status word");
    FERRY_CL(clEnqueueFillBuffer(im.ctx.compute(), im.status.get(), &zero, sizeof zero, 0, sizeof zero, 0, nullptr,
                                 nullptr));
  }
  if (!im.one_pass) {
    // The flow-graph form runs the whole step here; wait() reports what it ended with.
    run_flow_graph(s);
  } else {
    try {
      enqueue_pass(s, previous);
    } catch (...) {
      // Nothing of this step is in flight any more once fail_step has drained the queues; the
      // steps submitted before it stay valid.
      std::rethrow_exception(fail_step(s, std::current_exception(), true));
    }
  }
  ++im.count;
  im.next = can_run_ahead() ? (index + 1) % max_in_flight : 0;
}

void CompiledStep::wait() {
  Impl& im = *impl_;
  if (im.count == 0) throw std::logic_error("no step is in flight: submit() one before waiting for it");
  Submission& s = im.subs[im.oldest];
  im.oldest = can_run_ahead() ? (im.oldest + 1) % max_in_flight : 0;
  --im.count;
  im.result = s.slot;
  std::exception_ptr failure = s.failure;
  cl_int finish_status = s.finish_status;
  if (im.one_pass && s.finish) {
    // The host's one wait of the step: its last command. Its status is read below, node by node.
    const std::uint64_t begin = steady_ns();
    cl_event e = s.finish.get();
    s.done.wait(false);
    ++im.host_waits;
    if (im.ctx.profiling()) s.waits.push_back({begin, steady_ns()});
    if (clGetEventInfo(e, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof finish_status, &finish_status, nullptr) !=
        CL_SUCCESS)
      finish_status = CL_COMPLETE;
  }
  if (im.ctx.profiling()) im.waited = s;  // (the record alone: a copy of its events and clocks)
  if (!failure) {
    // A command failed on the device: its node is the first whose event says so.
    try {
      check_device_status(s, static_cast<NodeId>(graph_.nodes.size()), finish_status, "the step");
    } catch (...) {
      failure = std::current_exception();
    }
  }
  if (failure) {
    // A step submitted after this one waited for it on the device (its first command of every
    // lane): it is cancelled with it. Drained, it cannot have begun changing state in place
    // unless this failure did not reach it; then that is said too.
    std::vector<std::string> also;
    if (im.count > 0) {
      Submission& later = im.subs[im.oldest];
      try {
        im.ctx.finish_all();
      } catch (...) {
      }
      also = changed_in_place(later);
      im.count = 0;
      im.oldest = im.next = 0;
    } else {
      im.next = im.oldest;
    }
    std::exception_ptr thrown = fail_step(s, failure, s.cancelled);
    if (also.empty()) std::rethrow_exception(thrown);
    std::string what;
    try {
      std::rethrow_exception(thrown);
    } catch (const std::exception& e) {
      what = e.what();
    }
    throw PartialUpdateError(
        fmt::format("{}; the step submitted after it ran its updates of state kept in place before it was cancelled: "
                    "{} may hold its update",
                    what, fmt::join(also, ", ")),
        also, failure);
  }
  // The step's updates hold when it computed (a transfers-only run did not: its write-backs are not
  // a new state) and what they check (the overflow guard, else the loss) is finite.
  const TensorId guard = im.guard != no_tensor ? im.guard : im.stats;
  const float* checked =
      guard == no_tensor ? nullptr : reinterpret_cast<const float*>(host_address(guard, false, s.slot));
  const bool updates_hold = s.mode == RunMode::normal && (checked == nullptr || std::isfinite(checked[0]));
  // Host updates deferred into the next step: this step's become pending there.
  if (updates_hold) defer_update_of(s.step);
  // Every updated tensor now sits in the other slot: it becomes the current state. A step whose
  // overflow guard is not finite skipped its updates on the device; streamed updates, which check
  // only the loss, and host updates are undone by not committing their slot.
  if (im.commits_other_slot) {
    if (updates_hold) {
      persistent_->commit();
    } else {
      persistent_->abort();
    }
  }
}

bool CompiledStep::wrote_non_finite_weight() const noexcept {
  const Submission& s = impl_->subs[static_cast<std::size_t>(impl_->result)];
  return s.status_host != 0 || s.host_non_finite;
}

namespace {

TimelineEntry describe(const Graph& g, NodeId id) {
  const auto& nodes = g.nodes;
  TimelineEntry e{nodes.name[id], nodes.lane[id], 0, 0, 0};
  e.op = std::string(op_name(nodes.op[id]));
  for (TensorId t : nodes.inputs(id)) {
    e.inputs.push_back(g.tensors.name[t]);
    e.bytes += g.tensors.bytes(t);
  }
  for (TensorId t : nodes.outputs(id)) {
    e.outputs.push_back(g.tensors.name[t]);
    e.bytes += g.tensors.bytes(t);
  }
  return e;
}

cl_ulong profiling_info(const cl::Event& ev, cl_profiling_info what) {
  cl_ulong v = 0;
  clGetEventProfilingInfo(ev.get(), what, sizeof v, &v, nullptr);
  return v;
}

// Host clock to device clock: the driver stamps a command's QUEUED time just after the host
// began its enqueue, so the smallest difference is the closest estimate of the offset.
std::int64_t host_to_device_offset(const Graph& g, const std::vector<cl::Event>& events,
                                   const std::vector<cl::Event>& first_events,
                                   const std::vector<std::uint64_t>& enqueue_ns) {
  bool have = false;
  std::int64_t offset = 0;
  for (NodeId id = 0; id < g.nodes.size(); ++id) {
    if (is_host_lane(g.nodes.lane[id]) || !events[id] || enqueue_ns[id] == 0) continue;
    const cl_ulong queued =
        profiling_info(first_events[id] ? first_events[id] : events[id], CL_PROFILING_COMMAND_QUEUED);
    if (queued == 0) continue;
    const auto d = static_cast<std::int64_t>(queued) - static_cast<std::int64_t>(enqueue_ns[id]);
    if (!have || d < offset) offset = d;
    have = true;
  }
  return offset;
}

// The same for a submission (a template: the submission's type is private to CompiledStep).
template <class Submission>
std::int64_t host_to_device_offset(const Graph& g, const Submission& s) {
  return host_to_device_offset(g, s.events, s.first_events, s.enqueue_begin_ns);
}

std::uint64_t shifted(std::uint64_t host_ns, std::int64_t offset) {
  return static_cast<std::uint64_t>(static_cast<std::int64_t>(host_ns) + offset);
}

// `e` spanning a stretch of the host's clock [begin_ns, end_ns), on the device clock.
TimelineEntry host_span(TimelineEntry e, std::uint64_t begin_ns, std::uint64_t end_ns, std::int64_t offset) {
  e.queued_ns = e.start_ns = shifted(begin_ns, offset);
  e.end_ns = shifted(end_ns, offset);
  return e;
}

// Names, in each entry, the node it waited for that ended last: the one before it on its lane or
// the latest of its cross-lane dependencies (`waits`, by node), among the entries listed. Where
// a lane sat idle, the entry after the gap names what it was waiting for.
void name_last_dependencies(std::vector<TimelineEntry>& entries, const std::vector<NodeId>& ids,
                            const std::vector<std::vector<NodeId>>& waits) {
  constexpr std::size_t none = static_cast<std::size_t>(-1);
  std::vector<std::size_t> entry_of(waits.size(), none);  // by node: its entry, or none
  for (std::size_t i = 0; i < ids.size(); ++i) entry_of[ids[i]] = i;
  std::array<std::size_t, lane_count> previous;
  previous.fill(none);
  for (std::size_t i = 0; i < entries.size(); ++i) {
    std::size_t last = previous[static_cast<std::size_t>(entries[i].lane)];
    for (NodeId m : waits[ids[i]]) {
      const std::size_t k = entry_of[m];
      if (k != none && (last == none || entries[k].end_ns > entries[last].end_ns)) last = k;
    }
    if (last != none) entries[i].after = entries[last].name;
    previous[static_cast<std::size_t>(entries[i].lane)] = i;
  }
}

}  // namespace

std::vector<TimelineEntry> CompiledStep::timeline() const {
  std::vector<TimelineEntry> out;
  if (!impl_->ctx.profiling()) return out;
  const StepRecord& s = impl_->waited;
  if (s.events.empty()) return out;  // no step waited for yet
  const std::int64_t offset = host_to_device_offset(graph_, s);
  const auto& nodes = graph_.nodes;
  std::vector<NodeId> ids;  // the node of each entry
  for (NodeId id = 0; id < nodes.size(); ++id) {
    if (is_host_lane(nodes.lane[id])) {
      if (s.host_end_ns[id] == 0) continue;
      TimelineEntry e = host_span(describe(graph_, id), s.host_start_ns[id], s.host_end_ns[id], offset);
      if (s.host_ready_ns[id] != 0) e.ready_ns = shifted(s.host_ready_ns[id], offset);
      if (s.host_gate_ns[id] != 0) e.events_done_ns = shifted(s.host_gate_ns[id], offset);
      out.push_back(std::move(e));
      ids.push_back(id);
      continue;
    }
    const cl::Event& ev = s.events[id];
    if (!ev) continue;
    // A transfers-only run enqueued a marker for each compute node: no work, and drivers stamp
    // markers inconsistently (NVIDIA's can end before they start), so they are not listed.
    if (s.mode == RunMode::transfers_only && nodes.lane[id] == Lane::compute) continue;
    TimelineEntry e = describe(graph_, id);
    const cl::Event& first = s.first_events[id] ? s.first_events[id] : ev;
    e.queued_ns = profiling_info(first, CL_PROFILING_COMMAND_QUEUED);
    e.start_ns = profiling_info(first, CL_PROFILING_COMMAND_START);
    e.end_ns = profiling_info(ev, CL_PROFILING_COMMAND_END);
    out.push_back(std::move(e));
    ids.push_back(id);
  }
  name_last_dependencies(out, ids, impl_->waits);
  return out;
}

std::vector<TimelineEntry> CompiledStep::host_activity() const {
  std::vector<TimelineEntry> out;
  if (!impl_->ctx.profiling()) return out;
  const StepRecord& s = impl_->waited;
  if (s.events.empty()) return out;  // no step waited for yet
  const std::int64_t offset = host_to_device_offset(graph_, s);
  const auto& nodes = graph_.nodes;
  for (NodeId id = 0; id < nodes.size(); ++id) {
    if (s.enqueue_begin_ns[id] == 0 || s.enqueue_end_ns[id] == 0) continue;
    TimelineEntry e{"enqueue " + nodes.name[id], nodes.lane[id], 0, 0, 0};
    e.op = "enqueue";
    out.push_back(host_span(std::move(e), s.enqueue_begin_ns[id], s.enqueue_end_ns[id], offset));
  }
  for (const auto& w : s.waits) {
    TimelineEntry e{"wait", Lane::compute, 0, 0, 0};
    e.op = "wait";
    out.push_back(host_span(std::move(e), w.begin_ns, w.end_ns, offset));
  }
  return out;
}

}  // namespace ferry::graph
