// Planning a training run without allocating it (include/ferry/runtime/plan.hpp).
#include "ferry/runtime/plan.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "ferry/offload/chunk_codec.hpp"
#include "ferry/offload/host_memory.hpp"
#include "ferry/runtime/units.hpp"
#include "graph/autodiff.hpp"
#include "graph/node_view.hpp"
#include "graph/step_plan.hpp"
#include "ops/attrs.hpp"
#include "runtime/plan_search.hpp"
#include "trainer_internals.hpp"
#include "trainer_variants.hpp"

namespace ferry {

using graph::TensorId;

bool detail::at_gemm_rate(const graph::Graph& g, graph::NodeId n) {
  const ops::OpInfo& row = ops::op_info(g.nodes.op[n]);
  return row.flops && !graph::is_host_lane(g.nodes.lane[n]) && row.op_class != ops::OpClass::update &&
         row.op_class != ops::OpClass::communication && row.op_class != ops::OpClass::state_transfer &&
         row.op_class != ops::OpClass::batch_transfer;
}

std::uint64_t detail::gemm_rate_flops(const graph::Graph& g) {
  std::uint64_t flops = 0;
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    if (at_gemm_rate(g, n)) flops += ops::op_info(g.nodes.op[n]).flops(graph::NodeView<ops::ShapeView>(g, n));
  }
  return flops;
}

DeviceBreakdown device_breakdown(const graph::Graph& g, const graph::MemoryPlan& plan, const graph::Graph& training,
                                 std::uint64_t persistent_device_bytes) {
  DeviceBreakdown b;
  {
    const auto& t = training.tensors;
    for (TensorId id = 0; id < t.size(); ++id) {
      if (!graph::is_persistent(t.role[id]) || t.alias_of[id] != graph::no_tensor) continue;
      if (t.home[id] != graph::Home::device) continue;
      switch (t.role[id]) {
        case graph::Role::weight:
          b.weights += t.bytes(id);
          break;
        case graph::Role::optimizer_state:
          b.optimizer_state += t.bytes(id);
          break;
        default:
          b.other_state += t.bytes(id);
      }
    }
  }
  const auto& t = g.tensors;
  // Each device step tensor's span of nodes, then the node where most bytes are live.
  constexpr graph::NodeId none = ~graph::NodeId{0};
  std::vector<graph::NodeId> first(t.size(), none), last(t.size(), 0);
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    const auto touch = [&](TensorId x) {
      const TensorId s = t.storage(x);
      if (s >= plan.pool.size() || plan.pool[s] != graph::Pool::transient) return;
      first[s] = std::min(first[s], n);
      last[s] = std::max(last[s], n);
    };
    for (TensorId x : g.nodes.inputs(n)) touch(x);
    for (TensorId x : g.nodes.outputs(n)) touch(x);
    if (g.nodes.scratch[n] != graph::no_tensor) touch(g.nodes.scratch[n]);
  }
  std::vector<std::int64_t> delta(g.nodes.size() + 1, 0);
  for (TensorId s = 0; s < t.size(); ++s) {
    if (first[s] == none) continue;
    delta[first[s]] += static_cast<std::int64_t>(t.bytes(s));
    delta[last[s] + 1] -= static_cast<std::int64_t>(t.bytes(s));
  }
  std::int64_t live = 0, best = -1;
  graph::NodeId peak = 0;
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    live += delta[n];
    if (live > best) {
      best = live;
      peak = n;
    }
  }
  for (TensorId s = 0; s < t.size(); ++s) {
    if (first[s] == none || first[s] > peak || last[s] < peak) continue;
    switch (t.role[s]) {
      case graph::Role::gradient:
        b.gradients += t.bytes(s);
        break;
      case graph::Role::staged:
        b.streamed_copies += t.bytes(s);
        break;
      case graph::Role::scratch:
        b.scratch += t.bytes(s);
        break;
      default:
        b.activations += t.bytes(s);
    }
  }
  b.step_arena = plan.transient_bytes;
  b.pinned_staging = plan.staging_device_bytes();
  b.total = plan.transient_bytes + persistent_device_bytes + b.pinned_staging;
  return b;
}

DeviceBreakdown device_breakdown(const graph::CompiledStep& step, const graph::CompiledStep& training) {
  return device_breakdown(step.graph(), step.plan(), training.graph(), step.persistent()->device_bytes());
}

namespace {

// A data-parallel node's bytes (graph/passes/data_parallel.cpp): a collective's host buffers but
// the chain's order word, or a copy's across the link (a weight's share alone for ZeRO's gather).
void count_collective(const graph::Graph& g, graph::NodeId n, int ranks, PhasePlan& p) {
  const auto& t = g.tensors;
  const ops::OpId op = g.nodes.op[n];
  if (g.nodes.lane[n] == ops::Lane::comm) {
    std::uint64_t bytes = 0;
    for (TensorId x : g.nodes.inputs(n)) {
      if (t.name[x] != graph::collective_order_name) bytes += t.bytes(x);
    }
    p.collective_bytes += bytes;
    const double others = ranks > 1 ? static_cast<double>(ranks - 1) / ranks : 0.0;
    p.network_bytes += static_cast<std::uint64_t>(static_cast<double>(bytes) * others *
                                                  (op == ops::builtin::grad_allreduce ? 2.0 : 1.0));
    return;
  }
  const TensorId whole = g.nodes.lane[n] == ops::Lane::d2h ? g.nodes.inputs(n)[0] : g.nodes.outputs(n)[0];
  const std::uint64_t share = static_cast<std::uint64_t>(ops::ShareAttrs::of(g.nodes.attrs[n]).count) * sizeof(float);
  if (op == ops::builtin::share_send) {
    p.collective_link_bytes += share;
  } else if (op == ops::builtin::others_receive) {
    p.collective_link_bytes += t.bytes(whole) - share;
  } else {
    p.collective_link_bytes += t.bytes(whole);
  }
}

}  // namespace

double link_ms(const PlanRates& rates, std::uint64_t to_device, std::uint64_t to_host) {
  if (!(rates.link_gbps > 0)) return 0.0;
  // Bytes per ms each way alone, and while both run (each its share of the link, by its own rate).
  const double up = rates.link_gbps * 1e6, down = rates.to_host_gbps() * 1e6;
  const double up_ms = static_cast<double>(to_device) / up, down_ms = static_cast<double>(to_host) / down;
  if (!(rates.link_both_gbps > 0) || up_ms == 0 || down_ms == 0) return up_ms + down_ms;
  const double both = rates.link_both_gbps * 1e6;
  const double up_shared = both * up / (up + down), down_shared = both * down / (up + down);
  // Together until the shorter is through; the longer's rest alone.
  const double together_ms =
      std::min(static_cast<double>(to_device) / up_shared, static_cast<double>(to_host) / down_shared);
  const double up_left = std::max(0.0, static_cast<double>(to_device) - together_ms * up_shared);
  const double down_left = std::max(0.0, static_cast<double>(to_host) - together_ms * down_shared);
  return together_ms + up_left / up + down_left / down;
}

double predict_step_ms(const PhasePlan& p, bool shares_host_cores) {
  if (shares_host_cores)
    return p.compute_ms + p.transfer_ms + p.host_update_ms + p.codec_ms + p.launch_ms + p.network_ms;
  // Host updates start once what they wait for is done, and the next step's forward waits for all
  // of them (steps with host updates do not run ahead).
  // Deferred into the next step, they wait for nothing, but that step's forward ends only after the
  // last of them, and its backward follows.
  const double waited_for_ms = p.host_updates_deferred         ? 0.0
                               : p.host_updates_after_backward ? p.compute_ms
                                                               : p.forward_ms;
  const double followed_by_ms = p.host_updates_deferred ? p.compute_ms - p.forward_ms : 0.0;
  const double host_bound_ms = p.host_update_bytes ? waited_for_ms + p.host_update_ms + followed_by_ms : 0.0;
  // The device's updates of streamed state after the verdict: the forward and backward with what overlaps them,
  // then the updates' kernels with their fetches and write-backs. (Without transfers of their own, resident, they
  // end the compute, which the batch's transfers overlap from the step before.)
  const double tail_bound_ms = p.tail_transfer_ms > 0
                                   ? std::max(p.compute_ms - p.tail_compute_ms, p.transfer_ms - p.tail_transfer_ms) +
                                         std::max(p.tail_compute_ms, p.tail_transfer_ms)
                                   : 0.0;
  return std::max({p.compute_ms, p.transfer_ms, p.host_update_ms + p.codec_ms, host_bound_ms, tail_bound_ms,
                   p.launch_ms, p.network_ms, p.scheduled_step_ms});
}

namespace {

// The first of the device's updates when it follows the backward's last node (the updates wait for the step's
// verdict there), else g.nodes.size(): no tail.
graph::NodeId device_update_tail(const graph::Graph& g) {
  graph::NodeId first_update = g.nodes.size(), last_backward = 0;
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    const ops::OpClass c = ops::op_info(g.nodes.op[n]).op_class;
    if (c == ops::OpClass::backward) last_backward = n;
    if (c == ops::OpClass::update && g.nodes.lane[n] == ops::Lane::compute && first_update == g.nodes.size())
      first_update = n;
  }
  return first_update > last_backward ? first_update : g.nodes.size();
}

// The host bytes a variant's pool of step tensors adds (graph::host_pool_bytes_added), its pool's
// kind from its plan.
std::uint64_t new_host_pool_bytes(const graph::Graph& g, const graph::MemoryPlan& m,
                                  const graph::PersistentArena* arena, const offload::HomeStoreOptions& homes,
                                  const cl::DeviceInfo& device) {
  return graph::host_pool_bytes_added(m, arena, graph::host_pool_memory(g, m, homes.host_memory, device));
}

// The bytes a step moves each way over the link, all and the tail's (count_step).
struct LinkBytes {
  std::uint64_t to_device = 0, to_host = 0, tail_to_device = 0, tail_to_host = 0;
};

// The times of a counted step's work at `rates` (PhasePlan's *_ms but the schedule's).
void time_step(const PlanRates& rates, const LinkBytes& link, PhasePlan& p) {
  const auto ms = [](double amount, double per_ms) { return per_ms > 0 ? amount / per_ms : 0.0; };
  // Updates bound by quantization at their own rate, else (not known) at the memory rate.
  const double device_8bit_gbps = rates.device_8bit_gbps > 0 ? rates.device_8bit_gbps : rates.device_gbps;
  const double host_8bit_gbps = rates.host_8bit_gbps > 0 ? rates.host_8bit_gbps : rates.host_gbps;
  const auto device_ms = [&](std::uint64_t gemm_flops, std::uint64_t memory_bytes, std::uint64_t memory_8bit_bytes) {
    return ms(static_cast<double>(gemm_flops), rates.gemm_gflops * 1e6) +
           ms(static_cast<double>(memory_bytes - memory_8bit_bytes), rates.device_gbps * 1e6) +
           ms(static_cast<double>(memory_8bit_bytes), device_8bit_gbps * 1e6);
  };
  p.compute_ms = device_ms(p.gemm_flops, p.memory_bytes, p.memory_8bit_bytes);
  p.to_device_ms = link_ms(rates, link.to_device, 0);
  p.to_host_ms = link_ms(rates, 0, link.to_host);
  p.transfer_ms = link_ms(rates, link.to_device, link.to_host);
  p.host_update_ms = ms(static_cast<double>(p.host_update_bytes - p.host_update_8bit_bytes), rates.host_gbps * 1e6) +
                     ms(static_cast<double>(p.host_update_8bit_bytes), host_8bit_gbps * 1e6);
  p.codec_ms = ms(static_cast<double>(p.codec_bytes), rates.codec_gbps * 1e6);
  p.network_ms = ms(static_cast<double>(p.network_bytes), rates.network_gbps * 1e6);
  p.forward_ms = device_ms(p.forward_gemm_flops, p.forward_memory_bytes, 0);
  p.tail_compute_ms =
      device_ms(p.tail_gemm_flops, p.tail_memory_bytes + p.tail_memory_8bit_bytes, p.tail_memory_8bit_bytes);
  p.tail_transfer_ms = link_ms(rates, link.tail_to_device, link.tail_to_host);
  p.launch_ms = static_cast<double>(p.launches) * rates.launch_us * 1e-3;
}

// The per-step figures of one planned variant (everything but the device breakdown). On a CPU
// device (`shares_host_cores`) kernels, copies (memcpys), host updates and the codec all run on
// the same cores, so their times add up instead of overlapping.
void count_step(const graph::Graph& g, const graph::StepPlan& planned, const PlanRates& rates,
                const cl::DeviceInfo& device, int ranks, const offload::HomeStoreOptions& homes,
                const graph::PersistentArena* arena, PhasePlan& p) {
  const bool shares_host_cores = device.is_cpu();
  const std::uint32_t pinned_copies = homes.pinned_copies;
  p.nodes = g.nodes.size();
  // The device's updates wait for the step's verdict when the first comes after the backward's last node: from
  // there on, what they fetch and write back and their kernels follow the backward instead of overlapping it.
  const graph::NodeId tail_start = device_update_tail(g);
  // The step's host pool (what it adds to the training step's), and the other slot's batch mirrors
  // where it runs ahead.
  p.host_step_bytes = new_host_pool_bytes(g, planned.memory, arena, homes, device) +
                      graph::run_ahead_mirror_bytes(g, planned.memory, homes, device);
  p.pinned_staging_bytes = planned.memory.host_staging_bytes;
  p.fetch_bytes = planned.residency.fetch_bytes;
  p.write_back_bytes = planned.residency.write_back_bytes;
  // Each direction's bytes over the link (the copy lanes'), and those of the tail's.
  LinkBytes link{.to_device = p.fetch_bytes, .to_host = p.write_back_bytes};
  const auto direction = [&](graph::NodeId n) -> std::uint64_t& {
    return g.nodes.lane[n] == ops::Lane::d2h ? link.to_host : link.to_device;
  };
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    const ops::OpInfo& row = ops::op_info(g.nodes.op[n]);
    if (row.op_class == ops::OpClass::batch_transfer) {
      for (TensorId x : g.nodes.outputs(n)) {
        p.batch_bytes += g.tensors.bytes(x);
        direction(n) += g.tensors.bytes(x);
      }
      continue;
    }
    if (g.nodes.op[n] == graph::builtin::unpack || g.nodes.op[n] == graph::builtin::pack) {
      const bool unpack = g.nodes.op[n] == graph::builtin::unpack;
      // The codec's work for compressed (and dropped) homes; a copy of pageable memory through
      // staging runs on all cores beside the link and is left out.
      const TensorId home = g.tensors.storage(unpack ? g.nodes.inputs(n)[0] : g.nodes.outputs(n)[0]);
      if (!offload::home_traits(g.tensors.home[home]).staged) continue;
      for (TensorId x : unpack ? g.nodes.outputs(n) : g.nodes.inputs(n)) p.codec_bytes += g.tensors.bytes(x);
      continue;
    }
    // Updates on the host, and the gradient sums summed there with them (memory-bound alike).
    if (g.nodes.lane[n] == ops::Lane::host &&
        (row.op_class == ops::OpClass::update || row.op_class == ops::OpClass::state_update)) {
      // A deferred update waits for no commit point (it applies the step before's update).
      const bool deferred = g.nodes.deferred[n] != 0;
      p.host_updates_deferred = p.host_updates_deferred || deferred;
      for (TensorId x : deferred ? std::span<const TensorId>{} : g.nodes.outputs(n)) {
        const TensorId s = g.tensors.storage(x);
        if (graph::is_persistent(g.tensors.role[s]) && offload::changes_in_place(g.tensors.home[s], pinned_copies))
          p.host_updates_after_backward = true;
      }
      // The tensors it streams through (not the step's guard flag, read once).
      const auto add = [&](TensorId x) {
        if (g.tensors.role[g.tensors.storage(x)] == graph::Role::stats) return;
        p.host_update_bytes += g.tensors.bytes(x);
        if (row.update_bound == ops::UpdateBound::quantization) p.host_update_8bit_bytes += g.tensors.bytes(x);
      };
      for (TensorId x : g.nodes.inputs(n)) add(x);
      for (TensorId x : g.nodes.outputs(n)) add(x);
      continue;
    }
    if (row.op_class == ops::OpClass::communication) {
      const std::uint64_t link_before = p.collective_link_bytes;
      count_collective(g, n, ranks, p);
      direction(n) += p.collective_link_bytes - link_before;
      continue;
    }
    const bool in_tail = n >= tail_start;
    if (in_tail && (g.nodes.op[n] == graph::builtin::fetch || g.nodes.op[n] == graph::builtin::write_back)) {
      const std::uint64_t bytes = g.tensors.bytes(g.nodes.inputs(n)[0]);
      p.tail_transfer_bytes += bytes;
      (g.nodes.op[n] == graph::builtin::fetch ? link.tail_to_device : link.tail_to_host) += bytes;
    }
    if (row.op_class == ops::OpClass::state_transfer || graph::is_host_lane(g.nodes.lane[n])) continue;
    // GEMM-like nodes at the GEMM rate; every other node is bound by the bytes it reads and writes.
    ++p.launches;
    const bool forward = row.op_class == ops::OpClass::forward || row.op_class == ops::OpClass::loss;
    if (detail::at_gemm_rate(g, n)) {
      const std::uint64_t f = row.flops(graph::NodeView<ops::ShapeView>(g, n));
      p.flops += f;
      p.gemm_flops += f;
      if (forward) p.forward_gemm_flops += f;
      if (in_tail) p.tail_gemm_flops += f;
    } else {
      std::uint64_t bytes = 0;
      for (TensorId x : g.nodes.inputs(n)) bytes += g.tensors.bytes(x);
      for (TensorId x : g.nodes.outputs(n)) {
        bytes += g.tensors.bytes(x);
        p.flops += g.tensors.shape[x].elems();
      }
      const bool quantization = row.update_bound == ops::UpdateBound::quantization;
      p.memory_bytes += bytes;
      if (quantization) p.memory_8bit_bytes += bytes;
      if (forward) p.forward_memory_bytes += bytes;
      if (in_tail) (quantization ? p.tail_memory_8bit_bytes : p.tail_memory_bytes) += bytes;
    }
  }
  time_step(rates, link, p);
  detail::schedule_step(g, planned.memory, rates, pinned_copies, p);
  p.predicted_step_ms = predict_step_ms(p, shares_host_cores);
}

// plan_training for validated options with the recomputation fixed; `training_step_only`: the
// training step's plan alone (whether it fits, and its minimum), the other variants left out.
TrainingPlan plan_as_given(Runtime& runtime, const ModelSpec& model, const TrainerOptions& options,
                           const PlanRates& rates, bool training_step_only = false) {
  TrainingPlan out;
  out.recompute = options.recompute;
  out.eight_bit_state = options.optimizer.kind == ops::OptimizerConfig::Kind::adamw8bit;
  out.rates = rates;
  out.device_budget_bytes = detail::resolve_device_budget(options, runtime.device());
  const graph::ResidencyOptions residency = detail::residency_options(options, out.device_budget_bytes);
  const auto build = [&](const graph::VariantKey& key) {
    return graph::prepare_step_graph(forward_graph(model, key), key, options.optimizer);
  };

  // The training step: it places the persistent tensors every other variant shares.
  const graph::VariantKey train_key = detail::training_key(options);
  const int ranks = static_cast<int>(train_key.ranks);
  graph::Graph training = build(train_key);
  const graph::StepPlan train_plan = graph::plan_step(training, runtime.env(), runtime.device(), nullptr, residency);
  out.mode = train_plan.residency.mode;
  out.min_budget_bytes = train_plan.residency.min_budget_bytes;
  const std::uint64_t persistent_device = train_plan.memory.persistent_device_bytes;
  {
    PhasePlan p;
    p.name = options.phases.hybrid ? "warmup/full/correct" : "full";
    p.device = device_breakdown(training, train_plan.memory, training, persistent_device);
    count_step(training, train_plan, rates, runtime.device(), ranks, residency.homes, nullptr, p);
    out.phases.push_back(std::move(p));
  }
  if (training_step_only) return out;
  const auto arena = graph::planned_arena(
      training, train_plan.memory, train_plan.residency.mode,
      graph::host_pool_memory(training, train_plan.memory, residency.homes.host_memory, runtime.device()));
  for (const auto& v : detail::upfront_variants(options)) {
    graph::Graph g = build(v.key);
    const graph::StepPlan planned = graph::plan_step(g, runtime.env(), runtime.device(), arena.get(), residency);
    PhasePlan p;
    p.name = v.phase;
    p.device = device_breakdown(g, planned.memory, training, persistent_device);
    count_step(g, planned, rates, runtime.device(), ranks, residency.homes, arena.get(), p);
    out.phases.push_back(std::move(p));
  }

  for (int h = 0; h < offload::home_count; ++h) {
    std::uint64_t bytes = 0;
    for (const std::uint64_t b : train_plan.memory.persistent_buffers[h]) bytes += b;
    out.host_store_bytes += bytes * offload::host_copies(static_cast<offload::Home>(h), residency.homes);
    if (static_cast<offload::Home>(h) != offload::Home::host_compressed) continue;
    // Each tensor's chunks at most at the codec's bound (about its uncompressed size with chunks of
    // kilobytes and more): one set, and a tensor's new chunks while they are made (in place), or two
    // sets until the step commits.
    std::uint64_t chunks = 0, largest = 0;
    for (TensorId x = 0; x < training.tensors.size(); ++x) {
      if (training.tensors.storage(x) == x && training.tensors.home[x] == graph::Home::host_compressed) {
        const std::uint64_t most = offload::ChunkCodec::max_compressed_bytes(
            training.tensors.bytes(x), graph::dtype_bytes(training.tensors.dtype[x]), residency.homes.codec);
        chunks += most;
        largest = std::max(largest, most);
      }
    }
    out.host_compressed_bytes +=
        offload::changes_in_place(offload::Home::host_compressed, residency.homes.pinned_copies) ? chunks + largest
                                                                                                 : 2 * chunks;
  }
  // Evaluation's variants (Trainer::evaluate): the batch, and for a data set's tail the batch
  // halved (rounded down) until one sample, each compiled once at its first use.
  for (std::uint32_t count = options.batch; count > 0; count /= 2) {
    graph::Graph g = build(detail::evaluation_key(options, count));
    const graph::StepPlan planned = graph::plan_step(g, runtime.env(), runtime.device(), arena.get(), residency);
    out.host_eval_bytes += new_host_pool_bytes(g, planned.memory, arena.get(), residency.homes, runtime.device()) +
                           graph::run_ahead_mirror_bytes(g, planned.memory, residency.homes, runtime.device());
  }
  if (options.phases.hybrid) {
    for (TensorId x = 0; x < training.tensors.size(); ++x) {
      if (training.tensors.storage(x) == x && training.tensors.role[x] == graph::Role::weight) {
        out.host_restore_bytes += training.tensors.bytes(x);
      }
    }
  }
  for (const PhasePlan& p : out.phases) {
    out.device_peak_bytes = std::max(out.device_peak_bytes, p.device.total);
    out.host_step_bytes += p.host_step_bytes;
  }
  out.host_bytes = out.host_store_bytes + out.host_step_bytes;
  out.host_memory = offload::resolve_host_memory(options.residency.homes.host_memory, runtime.device());
  out.staging_chunk_bytes = options.residency.staging_chunk_bytes;
  out.host_optimizer = options.residency.host_optimizer;
  out.predicted_step_ms = out.phases.front().predicted_step_ms;
  return out;
}

// What else lowers a step's device bytes, of what `o` does not use yet, each planned at the
// recomputation `o` has: "a smaller batch (half: needs at least 3.1 MiB), 8-bit optimizer state
// (...) (fits the device budget)". A setting is listed only when its plan needs less than `leanest` (8-bit state or
// streaming do nothing for a step whose activations set the minimum, and were suggested all the
// same); "" when none does.
std::string leaner_settings(Runtime& runtime, const ModelSpec& model, const TrainerOptions& o, const PlanRates& rates,
                            std::uint64_t leanest) {
  struct Way {
    std::string what;
    TrainerOptions options;
  };
  std::vector<Way> ways;
  if (o.batch > 1) {
    ways.push_back({"a smaller batch (--batch; TrainerOptions::batch), half of it", o});
    ways.back().options.batch = o.batch / 2;
  }
  if (o.precision.compute == graph::DType::f32) {
    ways.push_back({"bf16 layers (--precision bf16; PrecisionConfig::compute)", o});
    ways.back().options.precision.compute = graph::DType::bf16;
    ways.back().options.precision.scaling = PrecisionConfig::Scaling::automatic;
  }
  const auto kind = o.optimizer.kind;
  if (kind == ops::OptimizerConfig::Kind::adam || kind == ops::OptimizerConfig::Kind::adamw) {
    ways.push_back({"8-bit optimizer state (--optimizer adamw8bit; OptimizerConfig::Kind::adamw8bit)", o});
    ways.back().options.optimizer.kind = ops::OptimizerConfig::Kind::adamw8bit;
  }
  const auto mode = o.residency.mode;
  // Resident by request, or weights or state homed on the device: streaming them needs less.
  const auto on_device = [](const std::optional<graph::Home>& h) { return h && *h == graph::Home::device; };
  if (mode == graph::ResidencyMode::resident || on_device(o.residency.weights_home) ||
      on_device(o.residency.state_home)) {
    ways.push_back(
        {"weights and optimizer state streamed from host memory (--residency stream and no "
         "--weights-home or --state-home device; ResidencyOptions::mode)",
         o});
    TrainerOptions& t = ways.back().options;
    t.residency.mode = graph::ResidencyMode::stream;
    if (on_device(t.residency.weights_home)) t.residency.weights_home.reset();
    if (on_device(t.residency.state_home)) t.residency.state_home.reset();
  }
  if (!o.residency.host_optimizer && mode != graph::ResidencyMode::resident && mode != graph::ResidencyMode::mapped) {
    ways.push_back({"the optimizer on the host (--host-optimizer; ResidencyOptions::host_optimizer)", o});
    ways.back().options.residency.host_optimizer = true;
  }
  std::vector<std::string> lower;
  for (const Way& w : ways) {
    std::string needs;
    try {
      TrainerOptions t = w.options;
      detail::validate_trainer_options(model, t);
      (void)plan_as_given(runtime, model, t, rates, true);
      needs = "fits the device budget";  // the host's memory is not checked here: ferry plan's search does
    } catch (const graph::BudgetError& e) {
      if (e.min_budget() >= leanest) continue;
      needs = fmt::format("needs at least {}", format_bytes_up(e.min_budget()));
    } catch (const std::invalid_argument&) {
      continue;  // not a setting this run can take (say, a model whose shapes the batch fixes)
    }
    lower.push_back(fmt::format("{} ({})", w.what, needs));
  }
  std::string text;
  for (std::size_t i = 0; i < lower.size(); ++i)
    text += (i == 0 ? "" : i + 1 == lower.size() ? " or " : ", ") + lower[i];
  return text;
}

// recompute_auto: none when the step fits the device budget, else the longest segment that fits
// (the plan that fitted is the answer: nothing is planned twice).
TrainingPlan plan_choosing_recompute(Runtime& runtime, const ModelSpec& model, TrainerOptions o,
                                     const PlanRates& rates) {
  o.recompute_auto = false;
  o.recompute = 0;
  std::uint64_t without = 0;
  try {
    return plan_as_given(runtime, model, o, rates);
  } catch (const graph::BudgetError& e) {
    without = e.min_budget();
  }
  std::uint64_t leanest = without;
  std::uint32_t leanest_every = 0;
  for (const std::uint32_t every : {64u, 48u, 32u, 24u, 16u, 12u, 8u, 6u, 4u, 3u, 2u, 1u}) {
    o.recompute = every;
    try {
      return plan_as_given(runtime, model, o, rates);
    } catch (const graph::BudgetError& e) {
      if (e.min_budget() < leanest) {
        leanest = e.min_budget();
        leanest_every = every;
      }
    } catch (const std::invalid_argument&) {
      // Segments longer than the model: nothing to recompute at this length.
    }
  }
  const std::uint64_t budget = detail::resolve_device_budget(o, runtime.device());
  o.recompute = leanest_every;
  const std::string leaner = leaner_settings(runtime, model, o, rates, leanest);
  throw graph::BudgetError(
      fmt::format("a device budget of {} is too small for this step even with recomputation: without it the step "
                  "needs {}{}; raise the budget to at least {}{}",
                  format_bytes(budget), format_bytes_up(without),
                  leanest_every ? fmt::format(", recomputing segments of {} layer{} (the leanest) {}", leanest_every,
                                              leanest_every == 1 ? "" : "s", format_bytes_up(leanest))
                                : std::string(", and recomputation does not lower that"),
                  format_bytes_up(leanest),
                  leaner.empty() ? std::string(" (no other setting of this run lowers it)")
                                 : fmt::format(", or use {}", leaner)),
      leanest);
}

}  // namespace

TrainingPlan plan_training(Runtime& runtime, const ModelSpec& model, const TrainerOptions& given,
                           const PlanRates& rates, HostLimit host_limit) {
  TrainerOptions options = given;
  detail::validate_trainer_options(model, options);
  // A rate is a speed (0: left out of the prediction): a negative or non-finite one would make the
  // prediction so too.
  const std::pair<const char*, double> given_rates[] = {
      {"link_gbps", rates.link_gbps},           {"link_d2h_gbps", rates.link_d2h_gbps},
      {"link_both_gbps", rates.link_both_gbps}, {"gemm_gflops", rates.gemm_gflops},
      {"device_gbps", rates.device_gbps},       {"device_8bit_gbps", rates.device_8bit_gbps},
      {"host_gbps", rates.host_gbps},           {"host_8bit_gbps", rates.host_8bit_gbps},
      {"codec_gbps", rates.codec_gbps},         {"launch_us", rates.launch_us},
      {"network_gbps", rates.network_gbps}};
  for (const auto& [name, value] : given_rates) {
    if (!(value >= 0) || !std::isfinite(value)) {
      throw std::invalid_argument(fmt::format("PlanRates::{} is {}: a rate is a finite number >= 0", name, value));
    }
  }
  // Copies each way at once cannot outrun each direction alone at its own rate.
  const double each_alone = rates.link_gbps + rates.to_host_gbps();
  if (rates.link_both_gbps > each_alone) {
    throw std::invalid_argument(fmt::format(
        "PlanRates::link_both_gbps is {:g} (--link-both-gbps), above the two directions' rates together ({:g} GB/s "
        "to the device and back): both ways at once carry at most their sum; give a rate up to {:g}",
        rates.link_both_gbps, each_alone, each_alone));
  }
  return detail::plan_with_host_optimizer(options, runtime.device(), host_limit, [&](const TrainerOptions& placed) {
    return detail::plan_with_host_transfers(placed, runtime.device(), [&](const TrainerOptions& o) {
      return o.recompute_auto ? plan_choosing_recompute(runtime, model, o, rates)
                              : plan_as_given(runtime, model, o, rates);
    });
  });
}

std::uint64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) : 0;
}

std::uint32_t choose_recompute(Runtime& runtime, const ModelSpec& model, const TrainerOptions& options) {
  TrainerOptions o = options;
  o.recompute_auto = true;
  o.recompute = 0;  // what it chooses
  return plan_training(runtime, model, o).recompute;
}

PlanOutcome plan_within_budgets(Runtime& runtime, const ModelSpec& model, const TrainerOptions& options,
                                const PlanRates& rates) {
  PlanOutcome out;
  try {
    // A budget given is the host's memory being planned for, which need not be this machine's.
    out.plan = plan_training(runtime, model, options, rates, HostLimit::budget_if_given);
    check_host_budget(*out.plan, options.residency.host_budget_bytes, HostLimit::budget_if_given);
  } catch (const graph::BudgetError& e) {
    out.error = e.what();
  } catch (const HostBudgetError& e) {
    out.error = e.what();
  }
  return out;
}

namespace {

// a + b, or the largest value where that would wrap around: byte counts this large are refused,
// not wrapped around below the budget.
std::uint64_t saturating_add(std::uint64_t a, std::uint64_t b) {
  return a > std::numeric_limits<std::uint64_t>::max() - b ? std::numeric_limits<std::uint64_t>::max() : a + b;
}

}  // namespace

namespace detail {

std::uint64_t host_limit_bytes(std::uint64_t host_budget_bytes, HostLimit limit_by) {
  const std::uint64_t physical =
      limit_by == HostLimit::budget_if_given && host_budget_bytes != 0 ? 0 : physical_memory_bytes();
  if (host_budget_bytes == 0) return physical;
  return physical == 0 ? host_budget_bytes : std::min(host_budget_bytes, physical);
}

graph::BudgetError with_recompute_hint(const graph::BudgetError& error, Runtime& runtime, const ModelSpec& model,
                                       const TrainerOptions& options) {
  if (options.recompute_auto) return error;
  TrainerOptions chosen = options;
  chosen.recompute_auto = true;
  std::uint32_t every = 0;
  try {
    every = plan_training(runtime, model, chosen).recompute;
  } catch (const std::exception&) {
    return error;  // no recomputation fits either (or the step fails otherwise): the error says enough
  }
  if (every == options.recompute) return error;
  return graph::BudgetError(
      fmt::format("{}; {} fits it: --recompute {}, or auto", error.what(),
                  every ? fmt::format("recomputing segments of {} layer{}", every, every == 1 ? "" : "s")
                        : std::string("no recomputation"),
                  every),
      error.min_budget());
}

std::uint64_t host_bytes_needed(const TrainingPlan& plan) {
  return saturating_add(
      saturating_add(saturating_add(plan.host_bytes, plan.host_compressed_bytes), plan.host_restore_bytes),
      plan.host_eval_bytes);
}

std::uint64_t host_bytes_at_any_batch(const TrainingPlan& plan) {
  return saturating_add(saturating_add(plan.host_store_bytes, plan.host_compressed_bytes), plan.host_restore_bytes);
}

}  // namespace detail

void check_host_budget(const TrainingPlan& plan, std::uint64_t host_budget_bytes, HostLimit limit_by) {
  // The smaller of the budget and physical memory, where each applies: a plan over it is over that one.
  const std::uint64_t limit = detail::host_limit_bytes(host_budget_bytes, limit_by);
  const std::uint64_t needed = detail::host_bytes_needed(plan);
  if (limit == 0 || needed <= limit) return;
  // The need rounded up and the limit down; in bytes where both would read alike (a budget a few bytes short).
  std::string needed_text = format_bytes_up(needed), limit_text = format_bytes(limit);
  if (needed_text == limit_text)
    needed_text = fmt::format("{} bytes", needed), limit_text = fmt::format("{} bytes", limit);
  const std::string what = limit == host_budget_bytes ? fmt::format("the host budget of {}", limit_text)
                                                      : fmt::format("this machine's physical memory ({})", limit_text);
  // What lowers the need, but what the plan already does.
  const std::string lower = fmt::format(
      "{}{}", plan.eight_bit_state ? "" : "8-bit optimizer state (--optimizer adamw8bit), ",
      plan.host_compressed_bytes ? "" : "compressed state (--state-home compressed, about 0.84 of fp32 Adam's), ");
  throw HostBudgetError(
      fmt::format(
          "the training state needs {} of host memory ({} for the weights and optimizer state, {} for "
          "the training steps' host buffers{}), more than {}: {}use {}a smaller batch or model, or keep more on the "
          "device (a larger --device-budget); `ferry plan` shows what each needs",
          needed_text, format_bytes(plan.host_store_bytes), format_bytes(plan.host_step_bytes),
          fmt::format(
              "{}{}{}",
              plan.host_compressed_bytes
                  ? fmt::format(", up to {} for compressed chunks", format_bytes(plan.host_compressed_bytes))
                  : std::string(),
              plan.host_restore_bytes
                  ? fmt::format(", {} for the Predict runs' restore point", format_bytes(plan.host_restore_bytes))
                  : std::string(),
              plan.host_eval_bytes ? fmt::format(", {} for evaluation batches", format_bytes(plan.host_eval_bytes))
                                   : std::string()),
          what, limit == host_budget_bytes ? "raise --host-budget if the machine has the memory, or " : "", lower),
      needed, limit);
}

std::uint64_t link_bytes_per_step(const TrainingPlan& plan) {
  if (plan.phases.empty()) return 0;
  return plan.phases.front().fetch_bytes + plan.phases.front().write_back_bytes;
}

std::string optimizer_place_reason(const TrainingPlan& plan) {
  const char* here = plan.host_optimizer ? "host" : "device";
  const char* there = plan.host_optimizer ? "device" : "host";
  const std::uint64_t moved = link_bytes_per_step(plan);
  std::string other = plan.other_place_moved_bytes
                          ? fmt::format("{} with them on the {}", format_bytes(plan.other_place_moved_bytes), there)
                          : fmt::format("with them on the {} the step does not fit the device budget", there);
  // The device's updates kept although the host's would move fewer bytes: plan_with_host_optimizer's other tests.
  if (!plan.host_optimizer && plan.other_place_moved_bytes != 0 && plan.other_place_moved_bytes < moved) {
    other += ", whose plan recomputes more or needs more host memory than there is";
  }
  return fmt::format(
      "optimizer updates on the {}: the step moves {} over the link, {} ({})", here, format_bytes(moved), other,
      plan.host_optimizer ? "--no-host-optimizer keeps them on the device" : "--host-optimizer runs them on the host");
}

}  // namespace ferry
