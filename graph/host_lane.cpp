// The flow-graph form of a step, for steps with host-lane nodes (a host optimizer, compressed or
// int8 homes): device nodes are enqueued by graph nodes, and each host-lane node's work runs on a
// TBB worker once an event callback has opened its gate; a host gate at the commit point keeps
// the in-place updates from running when anything before it, host work included, failed.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <stdexcept>
#include <utility>

#include "compiled_step_impl.hpp"
#include "ferry/offload/host_memory.hpp"
#include "graph/node_view.hpp"

namespace ferry::graph {

// The flow graph: a node per step node (plus an event gate and a worker node for host-lane
// nodes, and a settle gate for comm nodes), edges from the predecessors, the commit gate, and the
// finish gate after every lane's last node.
void CompiledStep::build_flow_graph(const cl::Context& context, bool serial,
                                    const std::vector<std::vector<NodeId>>& preds) {
  const std::size_t count = graph_.nodes.size();
  impl_->gates.resize(count);
  impl_->gate_nodes.resize(count);
  impl_->host_work.resize(count);
  impl_->settle_gates.resize(count);
  impl_->settle_checks.resize(count);
  add_node_bodies(serial);
  add_host_work(context);
  if (impl_->commit != Impl::no_node) add_commit_gate(context);
  for (NodeId id = 0; id < count; ++id) {
    if (preds[id].empty()) tbb::flow::make_edge(impl_->start, *impl_->nodes[id]);
    for (NodeId m : preds[id]) tbb::flow::make_edge(impl_->exit_of(m), *impl_->nodes[id]);
  }
  add_finish_gate(context);
}

tbb::flow::sender<continue_msg>& CompiledStep::Impl::exit_of(NodeId id) {
  if (settle_checks[id]) return *settle_checks[id];
  if (host_work[id]) return *host_work[id];
  if (id == commit) return *commit_check;
  return *nodes[id];
}

// Each node's body: a device node enqueues its commands and flushes; a host-lane node hands its
// wait list to its event gate (its work runs after, add_host_work).
void CompiledStep::add_node_bodies(bool serial) {
  const auto& n = graph_.nodes;
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
            Submission& s = *im->running;
            if (im->ctx.profiling()) s.enqueue_begin_ns[id] = steady_ns();
            // Reused every step: its capacity stays, so building a wait list allocates nothing.
            std::vector<cl_event>& wait = im->wait_lists[id];
            wait.clear();
            for (NodeId m : im->waits[id]) {
              if (s.events[m]) wait.push_back(s.events[m].get());
            }
            if (serial && id > 0 && s.events[id - 1]) wait.push_back(s.events[id - 1].get());
            if (is_host_lane(nodes.lane[id])) {
              im->gates[id]->wait.assign(wait.begin(), wait.end());  // the gate waits for these, then the work runs
              return;
            }
            enqueue_device_node(s, id, wait, fault);
            // Flush so that commands on other queues waiting on this one can start. clFlush may
            // also run the queue to completion before it returns (Oclgrind does): that is safe
            // because every event this node waits for was enqueued and flushed before it.
            FERRY_CL(clFlush(queue_of(im->ctx, nodes.lane[id])));
            if (im->ctx.profiling()) s.enqueue_end_ns[id] = steady_ns();
          } catch (const cl::Error&) {
            throw;  // already names the op through OpScope
          } catch (const std::exception& e) {
            throw std::runtime_error(
                fmt::format("step node '{}' ({}): {}", nodes.name[id], op_name(nodes.op[id]), e.what()));
          }
        }));
  }
}

// Host-lane nodes: the event gate that waits for the device commands a node reads, then its work
// on a TBB worker (and for comm nodes, the settle gate after it).
void CompiledStep::add_host_work(const cl::Context& context) {
  const auto& n = graph_.nodes;
  Impl* im = impl_.get();
  for (NodeId id = 0; id < n.size(); ++id) {
    if (!is_host_lane(n.lane[id])) continue;
    auto gate = std::make_unique<EventGate>();
    gate->queue = context.queue(cl::QueueKind::d2h);
    gate->opened = &impl_->host_waits;
    gate->timed = impl_->ctx.profiling();
    EventGate* g = gate.get();
    impl_->gates[id] = std::move(gate);
    impl_->gate_nodes[id] = std::make_unique<DoneNode>(impl_->flow, tbb::flow::unlimited,
                                                       [im, g, id](const continue_msg&, DoneNode::gateway_type& gw) {
                                                         if (g->timed) im->running->host_ready_ns[id] = steady_ns();
                                                         g->open(gw);
                                                       });
    impl_->host_work[id] =
        std::make_unique<tbb::flow::continue_node<continue_msg>>(impl_->flow, [this, im, g, id](const continue_msg&) {
          const auto& nodes = graph_.nodes;
          if (g->status < 0) {
            throw cl::Error(fmt::format("a device command host node '{}' waited for", nodes.name[id]), g->status,
                            nodes.name[id]);
          }
          Submission& s = *im->running;
          if (s.mode == RunMode::transfers_only) return;
          // After the commit point, a step whose gradients are not finite changes no state.
          if (im->in_place[id] && s.skip_host_updates) return;
          // A deferred update applies the step before's, if that one left it pending.
          const bool deferred = nodes.deferred[id] != 0;
          if (deferred && !im->deferred_pending[id]) return;
          if (im->in_place[id] || deferred) s.started[id] = 1;
          if (im->ctx.profiling()) {
            s.host_gate_ns[id] = g->opened_ns.load();
            s.host_start_ns[id] = steady_ns();
          }
          run_host_node(id, s);
          if (deferred) im->deferred_pending[id] = 0;
          if (im->ctx.profiling()) s.host_end_ns[id] = steady_ns();
        });
    tbb::flow::make_edge(*impl_->nodes[id], *impl_->gate_nodes[id]);
    tbb::flow::make_edge(*impl_->gate_nodes[id], *impl_->host_work[id]);
    if (n.lane[id] == Lane::comm) add_settle_gate(id);
  }
}

// The commit gate: after the commit node and the last node before it on every other lane, a
// gate waits for their commands (and the guard's read after them); then every command before the
// commit point must have succeeded before anything after it is enqueued.
void CompiledStep::add_commit_gate(const cl::Context& context) {
  const auto& n = graph_.nodes;
  Impl* im = impl_.get();
  const NodeId commit = impl_->commit;
  impl_->commit_gate.queue = queue_of(context, n.lane[commit]);
  impl_->commit_gate.opened = &impl_->host_waits;
  impl_->commit_join = std::make_unique<tbb::flow::continue_node<continue_msg>>(impl_->flow, [im](const continue_msg&) {
    im->commit_gate.wait.clear();
    for (NodeId m : im->commit_waits) {
      if (im->running->events[m]) im->commit_gate.wait.push_back(im->running->events[m].get());
    }
    Submission& sub = *im->running;
    sub.skip_host_updates = false;
    if (im->guard_span.buffer) {
      // The guard's value once every command before the commit point is done: host-lane
      // updates after it apply only if it is finite.
      cl::OpScope scope("the overflow guard at the commit point");
      auto& wait = im->commit_gate.wait;
      FERRY_CL(clEnqueueReadBuffer(im->commit_gate.queue, im->guard_span.buffer, CL_FALSE, im->guard_span.offset_bytes,
                                   sizeof(float), &sub.guard_at_commit, static_cast<cl_uint>(wait.size()),
                                   wait.empty() ? nullptr : wait.data(), im->guard_read.out()));
      wait.assign(1, im->guard_read.get());
    }
  });
  impl_->commit_gate_node =
      std::make_unique<DoneNode>(impl_->flow, tbb::flow::unlimited,
                                 [im](const continue_msg&, DoneNode::gateway_type& gw) { im->commit_gate.open(gw); });
  impl_->commit_check =
      std::make_unique<tbb::flow::continue_node<continue_msg>>(impl_->flow, [this, im, commit](const continue_msg&) {
        check_device_status(*im->running, commit + 1, im->commit_gate.status, "the step before its commit point");
        if (im->guard_span.buffer) im->running->skip_host_updates = !std::isfinite(im->running->guard_at_commit);
      });
  tbb::flow::make_edge(*impl_->nodes[commit], *impl_->commit_join);
  for (NodeId m : impl_->commit_waits) {
    if (m != commit) tbb::flow::make_edge(impl_->exit_of(m), *impl_->commit_join);
  }
  tbb::flow::make_edge(*impl_->commit_join, *impl_->commit_gate_node);
  tbb::flow::make_edge(*impl_->commit_gate_node, *impl_->commit_check);
}

// Finish: an event gate after every lane's last command; its opening ends wait_for_all().
void CompiledStep::add_finish_gate(const cl::Context& context) {
  Impl* im = impl_.get();
  std::vector<NodeId> lane_tails;
  for (NodeId tail : impl_->last_on_lane) {
    if (tail != static_cast<NodeId>(-1)) lane_tails.push_back(tail);
  }
  impl_->finish_gate.queue = context.compute();
  impl_->finish_gate.opened = &impl_->host_waits;
  impl_->finish =
      std::make_unique<tbb::flow::continue_node<continue_msg>>(impl_->flow, [im, lane_tails](const continue_msg&) {
        im->finish_gate.wait.clear();
        Submission& s = *im->running;
        for (NodeId tail : lane_tails) {
          if (s.events[tail]) im->finish_gate.wait.push_back(s.events[tail].get());
        }
        if (im->status) {
          // The status word after every command of the step; the gate waits for this read.
          cl::OpScope scope("the step's status word");
          auto& wait = im->finish_gate.wait;
          FERRY_CL(clEnqueueReadBuffer(im->ctx.compute(), im->status.get(), CL_FALSE, 0, sizeof(cl_uint),
                                       &s.status_host, static_cast<cl_uint>(wait.size()),
                                       wait.empty() ? nullptr : wait.data(), s.finish.out()));
          wait.assign(1, s.finish.get());
        }
      });
  for (NodeId tail : lane_tails) tbb::flow::make_edge(impl_->exit_of(tail), *impl_->finish);
  impl_->done =
      std::make_unique<DoneNode>(impl_->flow, tbb::flow::unlimited,
                                 [im](const continue_msg&, DoneNode::gateway_type& gw) { im->finish_gate.open(gw); });
  tbb::flow::make_edge(*impl_->finish, *impl_->done);
}

// A comm node completes when its collective does: after the work that started it, a gate that
// hands the request to the poller (or opens at once when the work left none: one rank, a
// transfers-only run), then a node that raises what the poller caught testing it.
void CompiledStep::add_settle_gate(NodeId id) {
  Impl* im = impl_.get();
  if (!im->poller) im->poller = std::make_unique<RequestPoller>();
  im->settle_gates[id] = std::make_unique<DoneNode>(
      im->flow, tbb::flow::unlimited, [im, id](const continue_msg&, DoneNode::gateway_type& gw) {
        Submission& s = *im->running;
        std::unique_ptr<ops::CommRequest> request = std::move(s.requests[id]);
        if (!request) {
          gw.try_put(continue_msg{});
          return;
        }
        const bool timed = im->ctx.profiling();
        im->poller->add(std::move(request), {&gw, &s.comm_failures[id], timed ? &s.host_end_ns[id] : nullptr});
      });
  im->settle_checks[id] =
      std::make_unique<tbb::flow::continue_node<continue_msg>>(im->flow, [this, im, id](const continue_msg&) {
        Submission& s = *im->running;
        if (!s.comm_failures[id]) return;
        const std::exception_ptr failure = std::exchange(s.comm_failures[id], nullptr);
        try {
          std::rethrow_exception(failure);
        } catch (const std::exception& e) {
          const auto& nodes = graph_.nodes;
          throw std::runtime_error(fmt::format("step node '{}' ({}): the collective failed: {}", nodes.name[id],
                                               op_name(nodes.op[id]), e.what()));
        }
      });
  tbb::flow::make_edge(*im->host_work[id], *im->settle_gates[id]);
  tbb::flow::make_edge(*im->settle_gates[id], *im->settle_checks[id]);
}

namespace {

// A host-lane node's operands in host memory: persistent tensors read from the current slot and
// written into the other; step tensors (a gradient written back for the host) have one place.
class HostNode final : public NodeView<ops::HostContext> {
 public:
  HostNode(const Graph& g, NodeId n, const PersistentArena& arena, std::function<std::byte*(TensorId, bool)> at,
           const ops::StepInfo& step, const OptimizerConfig& optimizer, std::atomic<bool>& non_finite,
           std::unique_ptr<ops::CommRequest>* request)
      : NodeView(g, n),
        arena_(arena),
        at_(std::move(at)),
        step_(step),
        optimizer_(optimizer),
        non_finite_(non_finite),
        request_(request) {}
  void report_non_finite_weight() const override { non_finite_ = true; }
  // A comm node's collective: its settle gate takes it from here. Other lanes have no gate after
  // their work, so there the request is waited for (the default).
  void complete_when(std::unique_ptr<ops::CommRequest> request) const override {
    if (!request_) return HostContext::complete_when(std::move(request));
    *request_ = std::move(request);
  }
  const std::byte* in(std::size_t i) const override {
    if (fail_) throw std::runtime_error(fmt::format("injected failure reading input {} in the host work", i));
    return at_(in_ids()[i], false);
  }
  std::byte* out(std::size_t i) const override { return at_(out_ids()[i], true); }
  void unpack_home(std::size_t i, std::byte* dst) const override {
    if (fail_) throw std::runtime_error(fmt::format("injected failure unpacking input {} in the host work", i));
    const TensorId id = graph_.tensors.storage(in_ids()[i]);
    if (!is_persistent(graph_.tensors.role[id])) {  // a step tensor in pageable host memory, copied to staging
      offload::copy_in_parallel(dst, at_(id, false), graph_.tensors.bytes(id));
      return;
    }
    store_of(id).unpack(place_of(id), dst, graph_.tensors.bytes(id));
  }
  // Fault::host_throw: reading an operand throws, from inside the op's host function.
  void fail() { fail_ = true; }
  const ops::StepInfo& step() const override { return step_; }
  const OptimizerConfig& optimizer() const override { return optimizer_; }
  void pack_home(std::size_t i, const std::byte* src) const override {
    const TensorId id = graph_.tensors.storage(out_ids()[i]);
    if (!is_persistent(graph_.tensors.role[id])) {
      offload::copy_in_parallel(at_(id, true), src, graph_.tensors.bytes(id));
      return;
    }
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
  const OptimizerConfig& optimizer_;
  std::atomic<bool>& non_finite_;
  std::unique_ptr<ops::CommRequest>* request_;
  bool fail_ = false;
};

}  // namespace

void CompiledStep::run_host_node(NodeId id, Submission& s) {
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
  const ops::StepInfo& step = nodes.deferred[id] ? impl_->deferred_step : s.step;
  HostNode node(graph_, id, *persistent_, at, step, impl_->optimizer, s.host_non_finite,
                nodes.lane[id] == Lane::comm ? &s.requests[id] : nullptr);
  if (fault) node.fail();
  try {
    row.host(node);
  } catch (const cl::Error&) {
    throw;  // names the op through OpScope
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("step node '{}' (host {}): {}", nodes.name[id], row.name, e.what()));
  }
}

void CompiledStep::run_flow_graph(Submission& s) {
  Impl& im = *impl_;
  im.running = &s;
  im.finish_gate.status = CL_COMPLETE;
  for (auto& gate : im.gates) {
    if (gate) gate->status = CL_COMPLETE;
  }
  im.commit_gate.status = CL_COMPLETE;
  im.start.try_put(continue_msg{});
  try {
    im.flow.wait_for_all();
  } catch (...) {
    s.failure = std::current_exception();
    s.cancelled = true;
  }
  s.finish_status = im.finish_gate.status;
}

void EventGate::open(DoneNode::gateway_type& gw) {
  if (wait.empty()) {
    if (timed) opened_ns = steady_ns();
    gw.try_put(continue_msg{});
    return;
  }
  if (opened) ++*opened;
  gateway = &gw;
  gw.reserve_wait();  // reserve before a callback can fire (it may fire inside the call)
  if (queue) FERRY_CL(clFlush(queue));
  // The hold keeps the gate shut while callbacks are registered; one that cannot be is a failure
  // the host node reports (it checks `status` before its work).
  // An event already done counts at once: Oclgrind never calls a callback registered after its
  // event completed (the standard says it is called then).
  pending = static_cast<int>(wait.size()) + 1;
  for (cl_event e : wait) {
    cl_int done = CL_QUEUED;
    cl_int rc = clGetEventInfo(e, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof(done), &done, nullptr);
    if (rc == CL_SUCCESS && done <= CL_COMPLETE) {
      if (done < 0) status = done;
      arrive();
      continue;
    }
    if (rc == CL_SUCCESS) rc = clSetEventCallback(e, CL_COMPLETE, &EventGate::on_complete, this);
    if (rc != CL_SUCCESS) {
      status = rc;
      arrive();
    }
  }
  arrive();
}

void CL_CALLBACK EventGate::on_complete(cl_event, cl_int status, void* user) {
  auto* gate = static_cast<EventGate*>(user);
  if (status < 0) gate->status = status;
  gate->arrive();
}

void EventGate::arrive() {
  if (pending.fetch_sub(1) != 1) return;
  if (timed) opened_ns = steady_ns();
  gateway->try_put(continue_msg{});
  gateway->release_wait();
}

}  // namespace ferry::graph
