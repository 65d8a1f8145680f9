// The configuration a budget calls for (ferry::search_configurations, include/ferry/runtime/plan.hpp):
// every candidate is planned (graph, passes, residency and memory plans; nothing allocated), and
// the fastest predicted that fits is chosen, keeping the given numerics where any candidate can.
#include "runtime/plan_search.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <string>
#include <utility>

#include "ferry/graph/residency.hpp"
#include "ferry/runtime/plan.hpp"
#include "ferry/runtime/units.hpp"
#include "runtime/trainer_variants.hpp"

namespace ferry {
namespace {

using graph::Home;
using graph::ResidencyMode;

// How far a configuration departs from the given options, leanest first. Each is tried as given
// and, unless the layers are narrow already, with bf16 layers (half the activation bytes).
enum class Lean {
  resident,
  mapped,
  stream,
  compressed_state,
  eight_bit,
  eight_bit_compressed,
  host_optimizer,
  overlapped_host_updates,  // the host's updates during the next step's forward
  eight_bit_host_optimizer,
};
constexpr Lean leans[] = {Lean::resident,
                          Lean::mapped,
                          Lean::stream,
                          Lean::compressed_state,
                          Lean::eight_bit,
                          Lean::eight_bit_compressed,
                          Lean::host_optimizer,
                          Lean::overlapped_host_updates,
                          Lean::eight_bit_host_optimizer};

// The candidate `lean` (narrow: with bf16 layers) at `split` micro-batches, or nothing where it
// is not one (mapped on a discrete device, 8-bit state without Adam or asked for already, the host optimizer asked for
// already, overlapped host updates where the step cannot run them).
std::optional<Configuration> candidate(const TrainerOptions& base, std::uint32_t split, Lean lean, bool narrow,
                                       bool unified, int zero_stage) {
  const bool adam = base.optimizer.kind != ops::OptimizerConfig::Kind::sgd;
  if (lean == Lean::mapped && !unified) return std::nullopt;
  const bool eight_bit =
      lean == Lean::eight_bit || lean == Lean::eight_bit_compressed || lean == Lean::eight_bit_host_optimizer;
  const bool overlapped = lean == Lean::overlapped_host_updates;
  const bool host = lean == Lean::host_optimizer || overlapped || lean == Lean::eight_bit_host_optimizer;
  const bool eight_bit_given = base.optimizer.kind == ops::OptimizerConfig::Kind::adamw8bit;
  if (eight_bit && (!adam || eight_bit_given)) return std::nullopt;  // the plain leans have it already
  if (host && base.residency.host_optimizer) return std::nullopt;    // so from stream on
  Configuration c;
  TrainerOptions& o = c.options;
  o = base;
  o.host_optimizer_auto = false;  // each lean says where the optimizer runs
  std::string flags;
  if (narrow) {
    o.precision.compute = ops::DType::bf16;
    o.precision.scaling = PrecisionConfig::Scaling::automatic;
    flags += " --precision bf16";
  }
  if (zero_stage != base.data_parallel.zero_stage) {
    o.data_parallel.zero_stage = zero_stage;
    flags += fmt::format(" --zero {}", zero_stage);
  }
  o.batch = base.batch / split;
  o.accumulate = base.accumulate * split;
  // Overlapped updates where the trainer would refuse them (accumulation included): no candidate.
  if (overlapped && detail::overlapped_updates_conflict(o) != nullptr) return std::nullopt;
  if (split > 1) flags += fmt::format(" --batch {} --accumulate {}", o.batch, o.accumulate);
  switch (lean) {
    case Lean::resident:
      o.residency.mode = ResidencyMode::resident;
      flags += " --residency resident";
      break;
    case Lean::mapped:
      o.residency.mode = ResidencyMode::mapped;
      flags += " --residency mapped";
      break;
    default:
      o.residency.mode = ResidencyMode::stream;
      flags += " --residency stream";
  }
  if (lean == Lean::compressed_state || lean == Lean::eight_bit_compressed) {
    o.residency.state_home = Home::host_compressed;
    flags += " --state-home compressed";
  }
  if (overlapped) {
    // The host's updates applied during the next step's forward, each before its weight's fetch,
    // instead of after the backward with the device idle (the same results as the host optimizer's).
    o.residency.host_optimizer = true;
    o.residency.overlap_host_updates = true;
    flags += " --overlap-host-updates";
  } else if (host) {
    // Updates on the host (ZeRO-Offload's way): no optimizer state on the device or the link.
    o.residency.host_optimizer = true;
    flags += " --host-optimizer";
  } else if (base.host_optimizer_auto && !unified && o.residency.mode == ResidencyMode::stream) {
    // Planned with the device's updates: said, since ferry train would otherwise choose the place
    // again (and may take the host, which this candidate's prediction is not).
    flags += " --no-host-optimizer";
  }
  if (eight_bit) {
    o.optimizer.kind = ops::OptimizerConfig::Kind::adamw8bit;
    flags += " --optimizer adamw8bit";
  }
  c.flags = flags.substr(1);
  c.same_numerics = o.precision.compute == base.precision.compute && o.optimizer.kind == base.optimizer.kind;
  return c;
}

// Plans a candidate; a budget it does not fit, or options the planner refuses together
// (std::invalid_argument), make it a non-fit with the reason.
void plan_candidate(Runtime& runtime, const ModelSpec& model, const PlanRates& rates, Configuration& c) {
  try {
    static_cast<PlanOutcome&>(c) = plan_within_budgets(runtime, model, c.options, rates);
  } catch (const std::invalid_argument& e) {
    c.plan.reset();
    c.error = e.what();
  }
  // Recomputation chosen for the budget (recompute_auto) is part of what to run.
  if (c.fits() && c.options.recompute_auto && c.plan->recompute > 0)
    c.flags += fmt::format(" --recompute {}", c.plan->recompute);
}

// Of the candidates tried from `first` on that fit, the fastest predicted with the given numerics
// (else of all), the leanest among those within 2% of it.
std::optional<std::size_t> fastest(const std::vector<Configuration>& tried, std::size_t first) {
  for (const bool need_same : {true, false}) {
    double best = std::numeric_limits<double>::infinity();
    for (std::size_t i = first; i < tried.size(); ++i) {
      const Configuration& c = tried[i];
      if (c.fits() && (c.same_numerics || !need_same)) best = std::min(best, c.plan->predicted_step_ms);
    }
    if (best == std::numeric_limits<double>::infinity()) continue;
    for (std::size_t i = first; i < tried.size(); ++i) {
      const Configuration& c = tried[i];
      if (c.fits() && (c.same_numerics || !need_same) && c.plan->predicted_step_ms <= best * 1.02) return i;
    }
  }
  return std::nullopt;
}

}  // namespace

namespace detail {

ConfigurationSearch search_configurations(Runtime& runtime, const ModelSpec& model, const TrainerOptions& options,
                                          const PlanRates& rates, bool host_unified_memory) {
  ConfigurationSearch out;
  // Data parallel: higher ZeRO stages only when nothing fits at the given one (what they save is
  // device memory; what they cost is network time, which a plan predicts only when given a rate).
  const auto& dp = options.data_parallel;
  const int last_stage = dp.communicator && dp.communicator->size() > 1 ? 2 : dp.zero_stage;
  const std::uint64_t host_limit = host_limit_bytes(options.residency.host_budget_bytes, HostLimit::budget_if_given);
  for (int zero = dp.zero_stage; zero <= last_stage; ++zero) {
    // Per lean (and bf16 or not) at this stage: why no smaller micro-batch can fit the host, once
    // one did not for bytes a split does not lower. Those are not planned again (at 7B, most of
    // what `ferry plan` would spend on a machine whose memory cannot hold the state).
    std::map<std::pair<Lean, bool>, std::string> host_bound;
    // Smaller micro-batches only when nothing fits at this size: they run slower kernels.
    for (const std::uint32_t split : {1u, 2u, 4u, 8u, 16u, 32u}) {
      if (options.batch % split != 0 || (split > 1 && options.phases.hybrid)) continue;
      const std::size_t first = out.tried.size();
      for (const Lean lean : leans) {
        for (const bool narrow : {false, true}) {
          if (narrow && options.precision.compute != ops::DType::f32) continue;
          std::optional<Configuration> c = candidate(options, split, lean, narrow, host_unified_memory, zero);
          if (!c) continue;
          if (const auto bound = host_bound.find({lean, narrow}); bound != host_bound.end()) {
            c->error = bound->second;
          } else {
            plan_candidate(runtime, model, rates, *c);
            if (c->plan && !c->fits() && host_limit != 0 && host_bytes_at_any_batch(*c->plan) > host_limit) {
              host_bound[{lean, narrow}] = fmt::format(
                  "not planned: at --batch {} its weights and optimizer state alone needed {} of host memory, more "
                  "than {}, and a smaller micro-batch does not lower them",
                  c->options.batch, format_bytes(host_bytes_at_any_batch(*c->plan)), format_bytes(host_limit));
            }
          }
          out.tried.push_back(std::move(*c));
        }
      }
      out.chosen = fastest(out.tried, first);
      if (out.chosen) return out;
    }
  }
  return out;
}

}  // namespace detail

ConfigurationSearch search_configurations(Runtime& runtime, const ModelSpec& model, const TrainerOptions& options,
                                          const PlanRates& rates) {
  return detail::search_configurations(runtime, model, options, rates, runtime.device().host_unified_memory);
}

}  // namespace ferry
