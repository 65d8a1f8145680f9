// A step graph compiled for one device: memory planned, kernels bound, and run once per step.
//
// How a step reaches the device (docs/DESIGN.md, "The host runs ahead"): nodes on the same lane
// (compute, copy in, copy out) run in the static order on one in-order queue; a node that touches
// bytes another lane wrote or reads waits on that node's OpenCL event. A step without host-lane
// nodes (resident, mapped and streamed homes with device optimizers) is enqueued by one pass on
// the calling thread, in static order, with every dependency on the device: submit() returns
// without having waited for any device event, and wait() blocks once, on the step's last command.
// While one step runs, the next can be submitted (can_run_ahead()): its batch goes into the other
// of two host mirror slots, and its first command on each lane waits for the step before it.
// A step with host-lane nodes (a host optimizer, compressed or int8 homes) is lowered to a
// tbb::flow::graph instead: its device nodes are enqueued by graph nodes, and each host-lane node
// is woken by an event callback into an async_node gateway when the device commands it needs are
// done; no thread blocks on the device there either.
//
// The commit point: state homed where kernels change it in place (device, host_mapped) has no
// second copy to roll back to, so in a training step every node that writes such state comes
// after the overflow guard's last node (graph/autodiff.hpp). Those updates read the guard on the
// device and skip themselves when it is not finite. Device failures are kept from them on the
// device too: right after the commit node a marker waits, explicitly, for every command before
// it, and every in-place node waits for that marker, so a command that failed before the commit
// point fails the updates instead of letting them run (a failed command does not fail its
// in-order successors on every driver, only its explicit waiters). In the flow-graph form an event
// gate on the host plays that role, since a host-lane node's failure must stop them as well. A
// step that fails before its commit point therefore leaves all training state as it was; one that
// fails after it had enqueued such a node throws PartialUpdateError.
#pragma once

#include <array>
#include <atomic>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "ferry/cl/context.hpp"
#include "ferry/graph/ir.hpp"
#include "ferry/graph/residency.hpp"
#include "ferry/graph/step_report.hpp"
#include "ferry/offload/host_memory.hpp"
#include "ferry/ops/launch.hpp"
#include "graph/autodiff.hpp"
#include "graph/memory_plan.hpp"
#include "graph/pipeline.hpp"
#include "offload/home_store.hpp"

namespace ferry::graph {

// Weights and optimizer state, shared by every variant of one model (training, evaluation): one
// home store per home in use (ferry/offload/home.hpp), and where each tensor sits in its home.
// A streamed (host_pinned) tensor is fetched from its current copy and written back into the
// next, which becomes current only when the whole step succeeded (commit), so a failed step leaves
// the training state as it was.
struct PersistentArena {
  ResidencyMode mode = ResidencyMode::resident;  // the preset the model's homes came from
  std::array<std::unique_ptr<offload::HomeStore>, offload::home_count> homes;
  struct Entry {
    Home home = Home::device;
    Placement place;
    std::uint64_t bytes = 0;
  };
  std::unordered_map<std::string, Entry> placements;  // by tensor name
  // The step buffers of the model's first compiled variant (training). Later variants
  // (evaluation) pack their transient tensors into them first: variants never run at the same
  // time, so they share device memory instead of adding to it.
  std::vector<cl::Mem> step_buffers;
  std::vector<std::uint64_t> step_buffer_bytes;
  // The same for the host pool of its step tensors (batch mirrors, weight gradients; not the
  // pinned staging): later variants whose pool is of the same kind (or any, where this one is pinned)
  // pack theirs into these first.
  // With gradient accumulation the micro-batch step and the update step each held a pool as large
  // as the weight gradients: host memory 1.4-1.5x the training state instead of 1.0-1.25x.
  std::vector<std::shared_ptr<offload::HostBuffer>> host_step_buffers;
  std::vector<std::uint64_t> host_step_buffer_bytes;
  offload::HostMemory host_step_memory = offload::HostMemory::pinned;
  // Its pinned staging buffers and chunked fetches' ring, shared the same way (pinned always):
  // where the driver backs pinned memory with device memory (NVIDIA), each variant's own ring of
  // four chunks counted on the device beside the planned peak.
  std::vector<std::shared_ptr<offload::HostBuffer>> host_staging_buffers;
  std::vector<std::uint64_t> host_staging_buffer_bytes;
  std::shared_ptr<offload::HostBuffer> fetch_ring;
  std::uint64_t fetch_ring_bytes = 0;

  std::optional<Entry> find(const std::string& name) const;
  // The store of `home`; throws std::logic_error if no tensor lives there.
  offload::HomeStore& store(Home home) const;
  // The step succeeded: every home's next copies become current.
  void commit();
  // The step failed: next values written into homes that keep them apart are discarded.
  void abort();
  // Set-up and inspection, outside any step: write sets every copy, read reads the current one.
  // Both apply a deferred update first (below).
  void write(Home home, const Placement& p, const void* src, std::size_t bytes);
  void read(Home home, const Placement& p, void* dst, std::size_t bytes) const;
  // Set-up: the tensor's value made by `fill` where its home keeps it in host memory (HomeStore::
  // fill_in_place); false (nothing called) for homes that do not.
  bool fill_in_place(Home home, const Placement& p, std::size_t bytes, const std::function<void(std::byte*)>& fill);
  void write_zeros(Home home, const Placement& p, std::size_t bytes);  // HomeStore::write_zeros
  // A compiled step whose host updates run in the step after (ResidencyOptions::
  // overlap_host_updates) leaves its last step's update pending until then. It registers here
  // how to apply it (CompiledStep::apply_deferred_updates), so that whatever reads or writes the
  // state outside it (read, write, a step of another variant) sees the state the steps made.
  std::function<void()> apply_deferred;
  const void* deferred_owner = nullptr;  // the compiled step that registered it
  void settle_deferred() const {
    if (apply_deferred) apply_deferred();
  }
  std::uint64_t host_bytes() const;    // pinned host bytes of every home (both copies when streamed)
  std::uint64_t device_bytes() const;  // device bytes of the device home
};

// How run() executes a step. transfers_only exists to measure overlap (bench/overlap.cpp).
enum class RunMode : std::uint8_t {
  normal,          // lanes run concurrently, ordered only by real dependencies
  transfers_only,  // copies only: compute nodes enqueue nothing (results are meaningless)
};

// How a step is compiled.
// The memory of a step's host pool: as `wanted` resolves on `device` (pageable where pinned
// buffers take device memory too), except that a pool some kernel addresses in place (mapped
// mode's weight gradients, zero-copy staging) must be pinned.
offload::HostMemory host_pool_memory(const Graph& g, const MemoryPlan& plan, offload::HostMemory wanted,
                                     const cl::DeviceInfo& device);
// Whether a step of `g` planned as `plan` may be submitted while the one before it still runs
// (CompiledStep::can_run_ahead, known before anything is allocated): every device command
// enqueued by one pass (no host-lane node), no fetch from pageable memory, and no state written on
// the host that becomes current only at commit.
bool step_runs_ahead(const Graph& g, const MemoryPlan& plan, const offload::HomeStoreOptions& homes,
                     const cl::DeviceInfo& device);
// The host bytes such a step adds for the other slots' batch mirrors (0 when it does not run
// ahead): what ferry plan and the host budget count beside the plan's host pool.
std::uint64_t run_ahead_mirror_bytes(const Graph& g, const MemoryPlan& plan, const offload::HomeStoreOptions& homes,
                                     const cl::DeviceInfo& device);
// Whether a variant whose host pool is of kind `pool_memory` packs it into the buffers of the
// model's first variant (`arena`'s; nullptr: it is the first): where the kinds agree, or the first's
// is pinned and this one's is not.
// CompiledStep::allocate_host_pool shares by this; its staging and fetch ring are shared always.
bool shares_host_pool(const PersistentArena* arena, offload::HostMemory pool_memory);
// The host bytes of its plan's host pool a variant allocates itself (CompiledStep::host_bytes but
// the run-ahead mirrors): all of them for the first variant (no `arena`), else what it needs beyond
// the first's buffers, its pool in full where it does not share it.
std::uint64_t host_pool_bytes_added(const MemoryPlan& plan, const PersistentArena* arena,
                                    offload::HostMemory pool_memory);

struct StepOptions {
  // Where weights and optimizer state live and the device budget (see residency.hpp); a budget
  // the step cannot fit in throws BudgetError naming the minimum.
  ResidencyOptions residency;
  // Every node waits for the one before it in the static order, across lanes: the step without
  // any overlap, which the overlap benchmark compares against.
  bool serial = false;
  // false: plan and lower without building or binding any kernel (the step cannot run; for
  // measuring compile time, `ferry-bench compile`).
  bool bind_kernels = true;
};

// How an injected failure (CompiledStep::inject_failure) makes a node fail.
enum class Fault : std::uint8_t {
  // The node's body throws before it enqueues anything (a host-lane node: before its work).
  exception,
  // The driver refuses the node's command: a device-lane node enqueues a real command with an
  // invalid object (a kernel launch without a kernel on the compute lane, a copy without buffers
  // on the transfer lanes), so the OpenCL call itself returns an error.
  enqueue_error,
  // The command is accepted but fails on the device: the node's command waits on a user event
  // that is then set to an error status, so its event (and the step's completion) reports it.
  device_error,
  // A host-lane node's own work throws from inside the op's host function, after its event gate
  // opened (on other nodes: as exception).
  host_throw,
};

class CompiledStep {
 public:
  // `graph` must be complete (forward, and for training backward, optimizer and download).
  // With `shared`, persistent tensors are looked up by name there instead of allocated, and the
  // residency mode is the arena's.
  CompiledStep(Graph graph, const OptimizerConfig& optimizer, ops::OpEnv& env, const cl::Context& context,
               std::shared_ptr<PersistentArena> shared = nullptr, const StepOptions& options = {});
  ~CompiledStep();
  CompiledStep(const CompiledStep&) = delete;
  CompiledStep& operator=(const CompiledStep&) = delete;

  // The host staging of batch tensor `name` (Builder::input) that its upload node copies from:
  // fill it before run() or submit() (with a step in flight, this is the other slot's mirror: the
  // in-flight step's batch is not touched). Throws std::invalid_argument naming the batch tensors there are.
  // In a variant that shares the first's host pool (PersistentArena::host_step_buffers), the
  // first's deferred host updates are applied before: they read gradients the batch would overwrite.
  std::span<std::byte> host_input(std::string_view name) const;
  template <class T>
  std::span<T> host_input_as(std::string_view name) const {
    const auto b = host_input(name);
    return {reinterpret_cast<T*>(b.data()), b.size() / sizeof(T)};
  }
  std::vector<std::string> host_input_names() const;
  // A result filled by its download node when run() or wait() returns (the step last waited for): an output
  // (Builder::output) or a loss's stats ("loss.stats"), until another variant of the model runs a
  // step (it may share the host pool). Throws std::invalid_argument naming the results there are.
  std::span<const std::byte> host_output(std::string_view name) const;
  // The loss's stats (element 0: the loss; softmax_xent adds the argmax-hit count); nullptr in
  // a graph without a loss (prediction).
  const float* stats_host() const;

  // Runs one step: submit() then wait(). A failing node cancels the step; the error is rethrown
  // naming the node, all queues are drained and the step can run again. A failure before the
  // commit point (see above) leaves every persistent tensor as it was; a later one that may have
  // changed state in place throws PartialUpdateError naming those tensors.
  void run(const ops::StepInfo& step, RunMode mode = RunMode::normal);

  // Enqueues one step from the batch staged in host_input() and returns. Without host-lane nodes
  // it returns before the device has run any of it; with them (flow-graph form) it returns when
  // the step has finished on the device, and wait() only reports. At most max_in_flight steps
  // may be submitted and not yet waited for, and a second only when can_run_ahead(): otherwise
  // std::logic_error says what to wait for. An enqueue that fails throws here, after draining
  // the queues (the steps submitted before it stay valid and are waited for as usual).
  void submit(const ops::StepInfo& step, RunMode mode = RunMode::normal);
  // Waits for the oldest submitted step (the host's one wait per step), then makes its results
  // readable (host_output, stats_host, wrote_non_finite_weight) and commits or rolls back its
  // state. Throws as run() does; a step that failed also cancels the step submitted after it
  // (which is drained and rolled back; if it had begun changing state in place, the error is a
  // PartialUpdateError). std::logic_error when nothing is in flight.
  void wait();
  static constexpr std::size_t max_in_flight = 2;
  std::size_t in_flight() const noexcept;
  // Whether a step may be submitted while the one before it still runs: every device command is
  // enqueued by one pass (no host-lane nodes) and no state commits on the host after the step
  // (no streamed home whose next copy becomes current only when the step succeeded).
  bool can_run_ahead() const noexcept;
  // Times the host has blocked on the device so far (waits for a step's end, event gates).
  std::uint64_t host_waits() const noexcept;
  // Deferred host updates (ResidencyOptions::overlap_host_updates): the update of the last step
  // that succeeded with a finite guard is applied by the next step, each weight's just before its
  // fetch. This applies what is still pending now, on the calling thread (with TBB workers), and
  // returns whether an update made a weight not finite; nothing pending: false at once. The
  // arena's read and write and other variants' steps call it (PersistentArena::apply_deferred).
  // std::logic_error while a step is in flight; PartialUpdateError if an update failed part-way.
  bool apply_deferred_updates();
  // Whether an update is pending (always false without deferred updates).
  bool has_deferred_updates() const noexcept;
  // The state is about to be written whole (a checkpoint's load): what is pending no longer
  // applies, and a step refused after a deferred update failed part-way may run again.
  void discard_deferred_updates() noexcept;

  const Graph& graph() const noexcept { return graph_; }
  const MemoryPlan& plan() const noexcept { return plan_; }
  // Peak device bytes of the step, from the plan: the step arena, plus the weights when resident.
  // (and pinned staging where the driver backs it with device memory, MemoryPlan::peak_bytes).
  std::uint64_t device_bytes() const noexcept {
    return plan_.transient_bytes + persistent_->device_bytes() + plan_.staging_device_bytes();
  }
  const ResidencyReport& residency() const noexcept { return residency_; }
  // Host bytes of step-lifetime tensors kept on the host (mapped mode: weight gradients; the
  // host optimizer's gradients; staging), the buffers it shares with the model's first variant
  // included.
  std::uint64_t host_step_bytes() const noexcept { return plan_.host_transient_bytes; }
  // All host memory the step holds itself: its host pool but the buffers it shares with the
  // model's first variant (PersistentArena::host_step_buffers) and, when it runs ahead, the other
  // slots' batch mirrors (run_ahead_mirror_bytes).
  std::uint64_t host_bytes() const noexcept;
  // After a run that succeeded: whether an optimizer update (on the device or the host) made a
  // weight not finite. Read from one status word the step downloads with its last command, so
  // no weight is read back to check it.
  bool wrote_non_finite_weight() const noexcept;
  const std::shared_ptr<PersistentArena>& persistent() const noexcept { return persistent_; }
  ops::DeviceSpan span(TensorId t) const;
  std::size_t node_count() const noexcept { return graph_.nodes.size(); }
  // The commit point: the node after which nodes that change state in place may be enqueued
  // (the overflow guard's last check); nullopt when the step has no such nodes or no guard.
  std::optional<NodeId> commit_node() const noexcept;

  // The bound launches of device node `n` (empty for host-lane nodes), for measuring what the
  // same commands cost enqueued without the step around them (`ferry-bench hostpath`).
  const ops::LaunchList& launches(NodeId n) const;

  // Wall time of each device pass of this compile, in pipeline order (graph/pipeline.hpp).
  const std::vector<PassTiming>& pass_timings() const noexcept { return pass_timings_; }

  // Per-node device times of the step last waited for; empty unless the context has profiling
  // enabled. host_activity() has the host thread's own spans.
  std::vector<TimelineEntry> timeline() const;
  // What the host thread did for the step last waited for, on the same clock as timeline(): one
  // span per node it enqueued ("enqueue <node>") and one per wait ("wait"); empty unless
  // profiling. Any idle stretch on a device lane lines up with one of these or with nothing
  // (then the device itself, or a host-lane node, is the cause).
  std::vector<TimelineEntry> host_activity() const;

  // Test hook: node `n` fails, the way `kind` says, when it next runs (to check cancellation and
  // recovery; tests/test_faults.cpp). One injection at a time; it is used up by the failure.
  void inject_failure(NodeId n, Fault kind = Fault::exception) {
    fail_kind_.store(kind);
    fail_node_.store(n);
  }

 private:
  struct Impl;
  struct StepRecord;
  struct Submission;
  // The device passes after the planning ones (graph/step_plan.hpp), in order.
  void allocate(const cl::Context& context, std::shared_ptr<PersistentArena> shared,
                const offload::HomeStoreOptions& homes);
  // The host pool of step tensors: the model's first variant's buffers where the plan packed into
  // them and the kinds agree, the rest (and the pinned staging) allocated here.
  // `first`: this step made the arena (the model's first variant), whose host buffers it records;
  // `pool_memory`: host_pool_memory of this step.
  void allocate_host_pool(const cl::Context& context, offload::HostMemory pool_memory, bool first);
  void bind(ops::OpEnv& env, const OptimizerConfig& optimizer, bool bind_kernels);
  void bind_nodes(const struct TensorLocator& at, ops::OpEnv& env, const OptimizerConfig& optimizer);
  void lower(const cl::Context& context, bool serial);
  // Marks the nodes that change persistent state in place and finds the commit point.
  void find_commit_point();
  // The one-pass form (graph/enqueue.cpp): every device command of the step, in static order.
  void enqueue_pass(Submission& s, const Submission* previous);
  // The markers at the commit point (enqueue.cpp), after every lane has been flushed.
  void enqueue_commit_markers(Submission& s);
  // One device node's commands (or the failure injected into it), waiting on `wait`; both forms.
  void enqueue_device_node(Submission& s, NodeId id, std::vector<cl_event>& wait, std::optional<Fault> fault);
  // The flow-graph form (graph/host_lane.cpp), for steps with host-lane nodes.
  void build_flow_graph(const cl::Context& context, bool serial, const std::vector<std::vector<NodeId>>& preds);
  void add_node_bodies(bool serial);
  void add_host_work(const cl::Context& context);
  void add_settle_gate(NodeId id);
  void add_commit_gate(const cl::Context& context);
  void add_finish_gate(const cl::Context& context);
  void run_flow_graph(Submission& s);
  // After a failure: drains the queues, rolls back what the step wrote into homes that commit,
  // and returns the exception to throw (PartialUpdateError if it had begun changing state in place).
  std::exception_ptr fail_step(Submission& s, std::exception_ptr failure, bool cancelled);
  // Throws, naming the node, if a device command among nodes [0, end) failed in `s`.
  void check_device_status(const Submission& s, NodeId end, cl_int gate_status, const char* where) const;
  // A cancelled step's failure, or the device failure behind it: some drivers (NVIDIA's) refuse
  // later enqueues once a command failed, so the first error thrown can name a bystander.
  std::exception_ptr root_cause(const Submission& s, std::exception_ptr failure) const;
  // The persistent tensors that nodes which change state in place and did run in `s` write, in
  // graph order.
  std::vector<std::string> changed_in_place(const Submission& s) const;
  std::vector<std::vector<NodeId>> order_nodes(bool serial);
  // The tensor is persistent and its home store changes it where it lives (device, mapped,
  // one-copy pinned): the nodes writing it come after the commit point.
  bool changes_in_place(TensorId id) const;
  // Host memory of a host-resident tensor: its current value, or where its next value goes. A
  // batch mirror is the one of host mirror slot `slot`.
  std::byte* host_address(TensorId id, bool next, int slot = 0) const;
  // Runs a host-lane node (an optimizer update on the host) on the calling TBB worker; a deferred
  // one with the step info of the step whose update it applies.
  void run_host_node(NodeId id, Submission& s);
  // Deferred updates (graph/deferred_updates.cpp): the nodes and the arena's hook, set up once;
  // the update of a step whose updates hold (it succeeded, its guard finite) becomes pending; a
  // deferred node that began in `s` and did not finish has changed part of its weight.
  void register_deferred_updates();
  void defer_update_of(const ops::StepInfo& step);
  bool deferred_failed_part_way(const Submission& s, NodeId id) const;
  // A deferred update failed part-way (`what`): nothing stays pending, and steps refuse to run
  // (refuse_after_deferred_failure) until discard_deferred_updates.
  void abandon_deferred_updates(const std::string& what);
  void refuse_after_deferred_failure() const;
  Graph graph_;
  MemoryPlan plan_;
  ResidencyReport residency_;
  std::shared_ptr<PersistentArena> persistent_;
  std::unique_ptr<Impl> impl_;
  // The node inject_failure() named; nodes run concurrently, so the one that takes it does so
  // with a compare-exchange.
  std::atomic<NodeId> fail_node_{static_cast<NodeId>(-1)};
  std::atomic<Fault> fail_kind_{Fault::exception};
  std::optional<Fault> take_injected_failure(NodeId id) {
    // A plain load first: with nothing injected, no node writes the shared word.
    if (fail_node_.load(std::memory_order_relaxed) != id) return std::nullopt;
    NodeId expected = id;
    if (!fail_node_.compare_exchange_strong(expected, static_cast<NodeId>(-1))) return std::nullopt;
    return fail_kind_.load();
  }
  std::vector<PassTiming> pass_timings_;
};

}  // namespace ferry::graph
