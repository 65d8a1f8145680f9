// The private state of a CompiledStep, shared by its five files: compiled_step.cpp (compiling),
// step_run.cpp (submit and wait, failures, results), enqueue.cpp (the one-pass form),
// host_lane.cpp (the flow-graph form for steps with host-lane nodes) and deferred_updates.cpp (host
// updates deferred into the next step).
#pragma once

#include <tbb/flow_graph.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ferry/cl/error.hpp"
#include "ferry/offload/pinned_host.hpp"
#include "graph/compiled_step.hpp"
#include "offload/fetch_ring.hpp"
#include "request_poller.hpp"

namespace ferry::graph {

using tbb::flow::continue_msg;

// The host's steady clock in nanoseconds (host spans of the timeline).
inline std::uint64_t steady_ns() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

inline cl_command_queue queue_of(const cl::Context& ctx, Lane lane) {
  switch (lane) {
    case Lane::h2d:
      return ctx.queue(cl::QueueKind::h2d);
    case Lane::d2h:
      return ctx.queue(cl::QueueKind::d2h);
    default:
      return ctx.queue(cl::QueueKind::compute);
  }
}

// What timeline() and host_activity() read of a step: its commands' events and, when profiling,
// the host's clock at its enqueues, host-lane work and waits.
struct CompiledStep::StepRecord {
  RunMode mode = RunMode::normal;
  std::vector<cl::Event> events;        // per node: its last command (host-lane nodes: none)
  std::vector<cl::Event> first_events;  // per node: its first command (profiling only)
  // Profiling only, host steady clock in ns: when each device node's enqueue began and ended, when
  // each host-lane node's work ran, and the host thread's waits for this step.
  std::vector<std::uint64_t> enqueue_begin_ns, enqueue_end_ns, host_start_ns, host_end_ns;
  // Host-lane nodes: when the gate began waiting, and when it opened (steady_ns).
  std::vector<std::uint64_t> host_ready_ns, host_gate_ns;
  struct Wait {
    std::uint64_t begin_ns, end_ns;
  };
  std::vector<Wait> waits;
};

// One submitted step: what its commands left behind until wait() has read it. There are
// max_in_flight of these, used in turn; a step's batch mirrors are those of its slot.
struct CompiledStep::Submission : StepRecord {
  int slot = 0;
  ops::StepInfo step;
  std::vector<char> started;  // per node that changes state in place: it was enqueued
  // The marker after the commit node that every in-place node waits for (one-pass form).
  cl::Event commit_marker;
  std::vector<cl::Event> commit_groups;  // the markers it waits for (enqueue_commit_markers)
  cl::Event finish;                      // the step's last command: every lane's tail, then the status word's read
  // Set by the finish command's completion callback (one-pass form): wait() sleeps on it rather
  // than in clWaitForEvents, which some implementations (Oclgrind) report as an API error when the
  // step failed, and which some drivers answer by spinning.
  std::atomic<bool> done{false};
  static void CL_CALLBACK on_finish(cl_event, cl_int, void* user);
  cl_uint status_host = 0;
  std::atomic<bool> host_non_finite{false};
  // Per comm node: the collective its work started, until the node's settle gate hands it to the
  // poller; what the poller caught when testing it failed.
  std::vector<std::unique_ptr<ops::CommRequest>> requests;
  std::vector<std::exception_ptr> comm_failures;
  // Flow-graph form: the overflow guard as the commit gate read it. Not finite: the host-lane
  // updates after the commit point skip themselves, as the device updates do.
  float guard_at_commit = 0.0f;
  bool skip_host_updates = false;
  // The flow-graph form runs to completion in submit(): what it ended with.
  std::exception_ptr failure;
  bool cancelled = false;
  cl_int finish_status = CL_COMPLETE;

  void reset(std::size_t nodes, bool profiling);
};

// Waits for OpenCL events without blocking a thread: a marker on `queue` with the events as its
// wait list, whose completion callback opens an async_node gateway. Used by the flow-graph form
// before each host-lane node, at its commit point and at the end of the step.
// Opens when every event in `wait` has completed: a callback on each counts down, so a host node
// waits for exactly the commands it reads. (A marker on an in-order queue would also wait for
// every command enqueued on that queue before it: a host update behind all of the step's
// write-backs, not only its own gradient's.)
struct EventGate {
  cl_command_queue queue = nullptr;  // flushed when the gate opens: the commands it waits for were enqueued there
  std::vector<cl_event> wait;
  DoneNode::gateway_type* gateway = nullptr;
  std::atomic<cl_int> status{CL_COMPLETE};
  std::atomic<int> pending{0};                   // callbacks still to come, plus one while open() registers them
  std::atomic<std::uint64_t>* opened = nullptr;  // counts the host's waits
  bool timed = false;                            // the context profiles: note when the gateway opened
  std::atomic<std::uint64_t> opened_ns{0};       // steady_ns() then, if timed

  // The async_node's body: hand the wait over to the driver and return.
  void open(DoneNode::gateway_type& gw);
  // Runs on a driver thread, or inline if the event already completed: hand over, never wait.
  static void CL_CALLBACK on_complete(cl_event, cl_int status, void* user);
  void arrive();  // one callback (or open()'s hold) done; the last opens the gateway
};

struct CompiledStep::Impl {
  // The bound kernels released newest first: PoCL keeps a program's kernels in a list it prepends
  // to and searches from its head on release, so releasing them in the order they were made took
  // time quadratic in the nodes (a 65,536-node step: 5.6 s at exit, a 262,144-node one minutes).
  ~Impl() {
    for (; !launches.empty(); launches.pop_back()) {
      for (ops::LaunchList& list = launches.back(); !list.empty();) list.pop_back();
    }
  }
  const cl::Context& ctx;
  std::vector<cl::Mem> transient;
  // The plan's host pool: batch mirrors, spilled weight gradients, staging; in mapped mode weight
  // gradients that kernels address (then always pinned).
  // Shared with the model's other variants where the plan packed into theirs
  // (PersistentArena::host_step_buffers); host_own_bytes: the bytes of the ones this step allocated.
  std::vector<std::shared_ptr<offload::HostBuffer>> host_transient;
  std::uint64_t host_own_bytes = 0;
  // Chunked fetches' ring, over the plan's last pinned staging buffer (MemoryPlan::fetch_ring_chunk_bytes).
  std::unique_ptr<offload::FetchRing> fetch_ring;
  // The batch mirrors of host mirror slots 1.. (slot 0's live in host_transient, from the plan):
  // per slot, one pinned buffer per mirror tensor.
  std::map<TensorId, std::size_t> mirror_index;              // batch mirror -> index
  std::vector<std::vector<cl::PinnedBuffer>> extra_mirrors;  // [slot - 1][index]
  std::vector<ops::LaunchList> launches;                     // per node
  std::vector<std::vector<NodeId>> waits;                    // cross-lane predecessors, per node
  std::vector<std::vector<cl_event>> wait_lists;             // per node: the events it waits on this step
  std::vector<cl_event> commit_wait;                         // the commit marker's and the end's wait lists
  // Host mirrors by name without "@host": what the caller fills (uploads) and reads (downloads).
  std::map<std::string, TensorId, std::less<>> uploads, downloads;
  TensorId stats = no_tensor;  // the loss's host mirror, if the graph has a loss
  TensorId guard = no_tensor;  // the host mirror of what the updates check, if not the loss
  bool bound = true;           // kernels bound: the step can run
  bool serial = false;
  bool one_pass = true;           // no host-lane node: the one-pass form
  bool fetches_pageable = false;  // a fetch copies from pageable memory: the step does not run ahead
  OptimizerConfig optimizer;
  bool commits_other_slot = false;  // the step writes the next state into the other host slot

  // The submissions, used in turn; `oldest` is the next one wait() reads, `next` the next one
  // submit() uses; `result` the slot whose results host_output() shows; `enqueue_slot` the batch
  // mirror slot whose addresses the bound copies read and write while a pass enqueues them.
  std::array<Submission, max_in_flight> subs;
  std::size_t oldest = 0, next = 0, count = 0;
  int result = 0;
  // When profiling, the record of the step wait() read last, copied out of its submission there:
  // a step that does not run ahead (the flow-graph form) runs the next one in the same submission
  // before its caller has read the timeline of this one.
  StepRecord waited;
  std::atomic<int> enqueue_slot{0};
  Submission* running = nullptr;  // the submission the flow graph is running
  std::atomic<std::uint64_t> host_waits{0};

  // The divergence guard's view of the updates (ops::BindContext::step_status): a device word
  // the device updates set when they make a weight not finite, cleared at the start of each step
  // and read back after its last command; host updates set the flag beside it.
  cl::Mem status;  // null when no device-lane update was bound

  // The commit point (CompiledStep::find_commit_point). Per node: whether it writes persistent
  // state that lives in place (device, host_mapped).
  static constexpr NodeId no_node = static_cast<NodeId>(-1);
  std::vector<char> in_place;
  NodeId commit = no_node;
  // The commit node itself and the last node before it on every other lane: the flow-graph
  // form's gate waits for their commands and the flow graph for their bodies.
  std::vector<NodeId> commit_waits;
  // Where the overflow guard lives, when host-lane nodes change state in place after the commit
  // point (the host optimizer with one copy of streamed state): the commit gate reads it.
  ops::DeviceSpan guard_span{};
  std::array<NodeId, lane_count> last_on_lane;
  // Deferred host updates (graph::defer_host_updates), in static order, and per node whether it
  // still has to apply the update of the step `deferred_step` describes (the last one that
  // succeeded with a finite guard). A node clears its flag once its update is done, so a step
  // that fails leaves the updates it did not reach pending, and one that failed part-way is known.
  std::vector<NodeId> deferred;
  std::vector<char> deferred_pending;
  ops::StepInfo deferred_step;
  // A deferred update failed part-way: the update was abandoned (nothing pending) and the step
  // refuses to run until the state is written whole (discard_deferred_updates). What failed.
  std::string deferred_failure;

  // The flow-graph form (steps with host-lane nodes).
  tbb::flow::graph flow;
  tbb::flow::broadcast_node<continue_msg> start{flow};
  std::vector<std::unique_ptr<tbb::flow::continue_node<continue_msg>>> nodes;
  std::unique_ptr<tbb::flow::continue_node<continue_msg>> finish;
  std::unique_ptr<DoneNode> done;
  std::vector<std::unique_ptr<EventGate>> gates;  // per host-lane node; null for device nodes
  std::vector<std::unique_ptr<DoneNode>> gate_nodes;
  std::vector<std::unique_ptr<tbb::flow::continue_node<continue_msg>>> host_work;
  EventGate finish_gate;  // the end of the step
  std::unique_ptr<tbb::flow::continue_node<continue_msg>> commit_join, commit_check;
  std::unique_ptr<DoneNode> commit_gate_node;
  EventGate commit_gate;
  cl::Event guard_read;  // the commit gate's read of the guard (guard_at_commit)
  // Comm nodes: after the work that starts a node's collective, a gate the poller opens when it
  // completes, and a node that raises what the poller caught. The poller is declared after the
  // flow graph so that it stops (its requests complete) before the nodes it opens are destroyed.
  std::vector<std::unique_ptr<DoneNode>> settle_gates;
  std::vector<std::unique_ptr<tbb::flow::continue_node<continue_msg>>> settle_checks;
  std::unique_ptr<RequestPoller> poller;

  // Where a node's completion leaves the flow graph: a comm node's settle check, a host-lane
  // node's work, the commit node's check, else the node itself.
  tbb::flow::sender<continue_msg>& exit_of(NodeId id);

  explicit Impl(const cl::Context& c) : ctx(c) { last_on_lane.fill(no_node); }
};

}  // namespace ferry::graph
