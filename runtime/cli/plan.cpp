// `ferry plan`: plans a model's step variants for a configuration (ferry::plan_training: nothing
// is allocated or run) and prints what each phase holds on the device, the host bytes, the
// bytes moved and the predicted time per step, the smallest budgets it runs in, and the
// configurations that fit the given device and host budgets, with the fastest predicted
// (ferry::search_configurations).
#include "ferry/runtime/plan.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string_view>

#include "cli.hpp"
#include "runtime/plan_search.hpp"
#include "runtime/trainer_variants.hpp"

namespace ferry::cli {
namespace {

ferry::ModelSpec plan_model(const TrainArgs& a) {
  if (a.model != "gpt") return make_model(a);
  // The vocabulary comes from the text at training time; a plan assumes bytes (256 ids).
  ferry::models::GptConfig c;
  c.vocab = 256;
  c.width = a.width ? a.width : 192;
  c.depth = a.depth ? a.depth : 4;
  c.heads = a.heads;
  c.fused_attention = a.attention != "unfused";
  c.context = a.context;
  return ferry::models::gpt(c);
}

nlohmann::json to_json(const ferry::DeviceBreakdown& b) {
  return {{"weights_bytes", b.weights},
          {"gradients_bytes", b.gradients},
          {"optimizer_state_bytes", b.optimizer_state},
          {"other_state_bytes", b.other_state},
          {"activations_bytes", b.activations},
          {"scratch_bytes", b.scratch},
          {"streamed_copies_bytes", b.streamed_copies},
          {"pinned_staging_bytes", b.pinned_staging},
          {"step_arena_bytes", b.step_arena},
          {"total_bytes", b.total}};
}

// What a rate's measurement found beside the rate: where the GEMM rate was measured.
struct RateNotes {
  std::optional<ferry::StepGemmRate> gemm;
  std::optional<ferry::LinkRates> link;  // the link's three rates, measured together
};

// The link's rates for the host memory `options` stream from, measured once.
const ferry::LinkRates& measured_link(ferry::Runtime& rt, const ferry::TrainerOptions& options, RateNotes& notes) {
  if (!notes.link)
    notes.link =
        ferry::measure_link(rt, ferry::resolve_host_transfers(options.residency, rt.device()).homes.host_memory);
  return *notes.link;
}

// The rates of the step-time prediction (ferry::PlanRates): each given by its flag or measured.
struct RateSpec {
  const char* key;    // the JSON field (and its `_source`)
  const char* label;  // in the text output, with the unit
  const char* flag;
  const char* help;
  bool on_host;  // measured on this machine's cores, not on the device
  // Null, or where --link-gbps is given and this is not, its value from that rate: a link given by
  // its rate alone carries both directions at it, one at a time.
  double (*from_link)(double link_gbps);
  double ferry::PlanRates::*rate;
  // Null: not measured here. A measurement that says more than its rate notes it in `notes`.
  double (*measure)(ferry::Runtime&, const ferry::ModelSpec&, const ferry::TrainerOptions&, RateNotes& notes);
};
constexpr RateSpec rate_specs[] = {
    {"link_gbps", "link {:.2f} GB/s", "--link-gbps",
     "Host-to-device copy rate in GB/s (and the other way and both at once too, unless --link-d2h-gbps and "
     "--link-both-gbps say otherwise)",
     false, nullptr, &ferry::PlanRates::link_gbps,
     [](ferry::Runtime& rt, const ferry::ModelSpec&, const ferry::TrainerOptions& o, RateNotes& notes) {
       return measured_link(rt, o, notes).h2d_gbps;
     }},
    {"link_d2h_gbps", "{:.2f} GB/s back", "--link-d2h-gbps", "Device-to-host copy rate in GB/s", false,
     [](double link_gbps) { return link_gbps; }, &ferry::PlanRates::link_d2h_gbps,
     [](ferry::Runtime& rt, const ferry::ModelSpec&, const ferry::TrainerOptions& o, RateNotes& notes) {
       return measured_link(rt, o, notes).d2h_gbps;
     }},
    {"link_both_gbps", "{:.2f} GB/s both ways at once", "--link-both-gbps",
     "Both directions' bytes per second while copies run each way at once, GB/s: about the two rates' sum on a "
     "full-duplex link, about one of them where one direction waits for the other",
     false, [](double) { return 0.0; }, &ferry::PlanRates::link_both_gbps,
     [](ferry::Runtime& rt, const ferry::ModelSpec&, const ferry::TrainerOptions& o, RateNotes& notes) {
       return measured_link(rt, o, notes).both_gbps;
     }},
    {"gemm_gflops", "GEMM {:.1f} GFLOP/s", "--gemm-gflops", "GEMM rate in GFLOP/s at the step's own products", false,
     nullptr, &ferry::PlanRates::gemm_gflops,
     [](ferry::Runtime& rt, const ferry::ModelSpec& model, const ferry::TrainerOptions& o, RateNotes& notes) {
       notes.gemm = ferry::measure_step_gemm_gflops(rt, model, o);
       return notes.gemm->gflops;
     }},
    {"device_gbps", "device memory {:.2f} GB/s", "--device-gbps",
     "Device memory rate in GB/s of the nodes that are not GEMMs", false, nullptr, &ferry::PlanRates::device_gbps,
     [](ferry::Runtime& rt, const ferry::ModelSpec&, const ferry::TrainerOptions&, RateNotes&) {
       return ferry::measure_device_gbps(rt);
     }},
    {"device_8bit_gbps", "8-bit updates {:.2f} GB/s", "--device-8bit-gbps",
     "The same for 8-bit AdamW's updates on the device, bound by requantizing", false, nullptr,
     &ferry::PlanRates::device_8bit_gbps,
     [](ferry::Runtime& rt, const ferry::ModelSpec&, const ferry::TrainerOptions&, RateNotes&) {
       return ferry::measure_device_8bit_gbps(rt);
     }},
    {"launch_us", "launch {:.1f} us", "--launch-us", "The cost of one kernel launch in microseconds", false, nullptr,
     &ferry::PlanRates::launch_us,
     [](ferry::Runtime& rt, const ferry::ModelSpec&, const ferry::TrainerOptions&, RateNotes&) {
       return ferry::measure_launch_us(rt);
     }},
    {"host_gbps", "host optimizer {:.2f} GB/s", "--host-gbps",
     "The host optimizer's rate: bytes its updates read and write, GB/s", true, nullptr, &ferry::PlanRates::host_gbps,
     [](ferry::Runtime&, const ferry::ModelSpec&, const ferry::TrainerOptions&, RateNotes&) {
       return ferry::measure_host_update_gbps();
     }},
    {"host_8bit_gbps", "8-bit {:.2f} GB/s", "--host-8bit-gbps", "The same for the host optimizer's 8-bit AdamW updates",
     true, nullptr, &ferry::PlanRates::host_8bit_gbps,
     [](ferry::Runtime&, const ferry::ModelSpec&, const ferry::TrainerOptions&, RateNotes&) {
       return ferry::measure_host_update_gbps(true);
     }},
    {"codec_gbps", "codec {:.2f} GB/s", "--codec-gbps",
     "The compressed home's codec rate: uncompressed bytes packed and unpacked, GB/s", true, nullptr,
     &ferry::PlanRates::codec_gbps,
     [](ferry::Runtime&, const ferry::ModelSpec&, const ferry::TrainerOptions&, RateNotes&) {
       return ferry::measure_codec_gbps();
     }},
    {"network_gbps", "network {:.2f} GB/s", "--network-gbps",
     "With --ranks: what a rank sends over the network per second, GB/s (not measured: without it the network's time "
     "is left out of the prediction)",
     true, nullptr, &ferry::PlanRates::network_gbps, nullptr},
};
constexpr std::size_t rate_count = std::size(rate_specs);

// Everything `ferry plan` reports: the plan as configured, the minimum budgets, the rates of the
// prediction and the configurations it tried, with the one it recommends.
struct PlanReport {
  std::string device;
  ferry::PlanRates rates;
  // By rate_specs: where each rate came from: given, from --link-gbps, measured or not given.
  std::array<const char*, rate_count> rate_sources{};
  RateNotes rate_notes;
  ferry::PlanOutcome configured;
  std::uint64_t min_resident = 0;
  std::optional<std::uint64_t> min_streamed;
  // Mapped (a unified-memory device reads the state in host memory where it lies): none elsewhere.
  std::optional<std::uint64_t> min_mapped;
  std::uint64_t budget = 0, host_budget = 0, host_limit = 0;  // host_budget 0: not given (the limit is physical memory)
  std::string host_memory;
  std::string recompute_note;  // an explicit --recompute that buys nothing (recompute_cost_note)
  // Where the device budget came from, as ferry train here would take it now (trainer_budget_now):
  // "given", "device" (its memory less headroom) or "driver_free_memory"; and, where ferry train would
  // refuse the budget given (above what the driver counts free), why.
  const char* budget_source = "given";
  std::string budget_refused;
  ferry::ConfigurationSearch search;
  const ferry::Configuration* chosen() const { return search.chosen ? &search.tried[*search.chosen] : nullptr; }
  bool any_fits() const { return configured.fits() || search.chosen.has_value(); }
};

PlanReport make_report(const TrainArgs& a, ferry::Runtime& runtime, const ferry::ModelSpec& model,
                       ferry::TrainerOptions base) {
  PlanReport r;
  r.device = runtime.device().name;
  // The budget ferry train would plan in on this device now: on a GPU other processes share, what
  // the driver counts free bounds it. A budget it would refuse is still planned as given (a plan for
  // when the device is free), with the refusal said.
  try {
    const ferry::TrainerBudget taken = ferry::trainer_budget_now(runtime, base);
    r.budget_source = taken.from_free_memory ? "driver_free_memory" : base.residency.budget_bytes ? "given" : "device";
    base.residency.budget_bytes = taken.budget_bytes;
  } catch (const std::invalid_argument& e) {
    r.budget_refused = e.what();
    r.budget_source = base.residency.budget_bytes ? "given" : "device";
  }
  // The rates of the step-time prediction: given, or measured here.
  for (std::size_t i = 0; i < rate_count; ++i) {
    const RateSpec& spec = rate_specs[i];
    const double given = a.plan_rates.*spec.rate, link_given = a.plan_rates.link_gbps;
    double& rate = r.rates.*spec.rate;
    if (given > 0) {
      rate = given, r.rate_sources[i] = "given";
    } else if (spec.from_link && link_given > 0) {
      rate = spec.from_link(link_given), r.rate_sources[i] = "from --link-gbps";
    } else if (spec.measure) {
      rate = spec.measure(runtime, model, base, r.rate_notes), r.rate_sources[i] = "measured";
    } else {
      rate = 0.0, r.rate_sources[i] = "not given";
    }
  }

  // As configured: every phase's bytes (with a budget too small, the error says so).
  r.configured = ferry::plan_within_budgets(runtime, model, base, r.rates);
  r.recompute_note = recompute_cost_note(runtime, model, base);
  // Minimum budgets: everything resident, and streamed.
  ferry::TrainerOptions resident = base;
  resident.residency = {};
  resident.residency.mode = ferry::graph::ResidencyMode::resident;
  resident.residency.budget_bytes = ~std::uint64_t{0} >> 1;
  r.min_resident = ferry::plan_training(runtime, model, resident).device_peak_bytes;
  r.min_streamed = ferry::min_stream_budget(runtime, model, base);
  if (runtime.device().host_unified_memory) {
    ferry::TrainerOptions mapped = resident;
    mapped.residency.mode = ferry::graph::ResidencyMode::mapped;
    r.min_mapped = ferry::plan_training(runtime, model, mapped).device_peak_bytes;
  }
  r.budget = r.configured.plan ? r.configured.plan->device_budget_bytes
                               : ferry::detail::resolve_device_budget(base, runtime.device());
  r.host_budget = base.residency.host_budget_bytes;
  r.host_limit = r.host_budget ? r.host_budget : ferry::physical_memory_bytes();
  r.host_memory = ferry::offload::host_memory_name(
      r.configured.plan ? r.configured.plan->host_memory
                        : ferry::resolve_host_transfers(base.residency, runtime.device()).homes.host_memory);

  // The configuration to use for these budgets: the fastest predicted that fits.
  ferry::TrainerOptions searched = base;
  searched.residency.budget_bytes = r.budget;
  r.search = ferry::search_configurations(runtime, model, searched, r.rates);
  return r;
}

// The JSON fields of the plan as configured: the totals, and each phase's bytes.
void add_configured_fields(nlohmann::json& j, const ferry::PlanOutcome& configured) {
  nlohmann::json phases = nlohmann::json::object();
  if (const auto& p = configured.plan) {
    for (const auto& ph : p->phases) {
      nlohmann::json b = to_json(ph.device);
      b["host_step_bytes"] = ph.host_step_bytes;
      b["fetch_bytes"] = ph.fetch_bytes;
      b["write_back_bytes"] = ph.write_back_bytes;
      b["batch_bytes"] = ph.batch_bytes;
      b["flops"] = ph.flops;
      b["host_update_bytes"] = ph.host_update_bytes;
      b["codec_bytes"] = ph.codec_bytes;
      b["collective_bytes"] = ph.collective_bytes;
      b["collective_link_bytes"] = ph.collective_link_bytes;
      b["network_bytes"] = ph.network_bytes;
      b["predicted_step_ms"] = ph.predicted_step_ms;
      phases[ph.name] = b;
    }
    const auto& t = p->phases.front();
    j["residency"] = ferry::graph::residency_mode_name(p->mode);
    j["device_peak_bytes"] = p->device_peak_bytes;
    j["host_bytes"] = p->host_bytes;
    j["host_store_bytes"] = p->host_store_bytes;
    j["host_compressed_bytes"] = p->host_compressed_bytes;
    j["host_restore_bytes"] = p->host_restore_bytes;
    j["host_eval_bytes"] = p->host_eval_bytes;
    j["host_step_bytes"] = p->host_step_bytes;
    j["pinned_staging_bytes"] = t.pinned_staging_bytes;
    j["fetch_bytes"] = t.fetch_bytes;
    j["write_back_bytes"] = t.write_back_bytes;
    j["batch_bytes"] = t.batch_bytes;
    j["moved_bytes"] = t.fetch_bytes + t.write_back_bytes + t.batch_bytes;
    j["flops"] = t.flops;
    j["gemm_flops"] = t.gemm_flops;
    j["memory_bytes"] = t.memory_bytes;
    j["compute_ms"] = t.compute_ms;
    j["forward_ms"] = t.forward_ms;
    j["launches"] = t.launches;
    j["launch_ms"] = t.launch_ms;
    j["transfer_ms"] = t.transfer_ms;
    j["to_device_ms"] = t.to_device_ms;
    j["to_host_ms"] = t.to_host_ms;
    j["host_update_bytes"] = t.host_update_bytes;
    j["host_update_ms"] = t.host_update_ms;
    j["host_updates_after_backward"] = t.host_updates_after_backward;
    j["host_updates_deferred"] = t.host_updates_deferred;
    j["tail_transfer_bytes"] = t.tail_transfer_bytes;
    j["tail_compute_ms"] = t.tail_compute_ms;
    j["tail_transfer_ms"] = t.tail_transfer_ms;
    j["codec_bytes"] = t.codec_bytes;
    j["codec_ms"] = t.codec_ms;
    j["collective_bytes"] = t.collective_bytes;
    j["collective_link_bytes"] = t.collective_link_bytes;
    j["network_bytes"] = t.network_bytes;
    j["network_ms"] = t.network_ms;
    j["scheduled_step_ms"] = t.scheduled_step_ms;
    j["scheduled_compute_idle_ms"] = t.scheduled_compute_idle_ms;
    j["scheduled_longest_wait_ms"] = t.scheduled_longest_wait_ms;
    j["scheduled_longest_wait_before"] = t.scheduled_longest_wait_before;
    j["predicted_step_ms"] = p->predicted_step_ms;
    if (!configured.error.empty()) j["error"] = configured.error;
  } else {
    for (const char* k : {"residency",
                          "device_peak_bytes",
                          "host_bytes",
                          "host_store_bytes",
                          "host_compressed_bytes",
                          "host_restore_bytes",
                          "host_eval_bytes",
                          "host_step_bytes",
                          "pinned_staging_bytes",
                          "fetch_bytes",
                          "write_back_bytes",
                          "batch_bytes",
                          "moved_bytes",
                          "flops",
                          "gemm_flops",
                          "memory_bytes",
                          "compute_ms",
                          "forward_ms",
                          "transfer_ms",
                          "to_device_ms",
                          "to_host_ms",
                          "launches",
                          "launch_ms",
                          "host_update_bytes",
                          "host_update_ms",
                          "host_updates_after_backward",
                          "host_updates_deferred",
                          "tail_transfer_bytes",
                          "tail_compute_ms",
                          "tail_transfer_ms",
                          "codec_bytes",
                          "codec_ms",
                          "collective_bytes",
                          "collective_link_bytes",
                          "network_bytes",
                          "network_ms",
                          "scheduled_step_ms",
                          "scheduled_compute_idle_ms",
                          "scheduled_longest_wait_ms",
                          "scheduled_longest_wait_before",
                          "predicted_step_ms"}) {
      j[k] = nullptr;
    }
    j["error"] = configured.error;
  }
  j["phases"] = phases;
}

// Every configuration the search tried, in its order: what it is, whether it fits, and its figures.
nlohmann::json candidates_json(const ferry::ConfigurationSearch& search) {
  nlohmann::json out = nlohmann::json::array();
  for (std::size_t i = 0; i < search.tried.size(); ++i) {
    const ferry::Configuration& c = search.tried[i];
    nlohmann::json e = {
        {"flags", c.flags}, {"same_numerics", c.same_numerics}, {"fits", c.fits()}, {"chosen", search.chosen == i}};
    const bool planned = c.plan.has_value();
    e["device_bytes"] = planned ? nlohmann::json(c.plan->device_peak_bytes) : nullptr;
    e["host_bytes"] = planned ? nlohmann::json(c.plan->host_bytes) : nullptr;
    e["moved_bytes"] =
        planned ? nlohmann::json(c.plan->phases.front().fetch_bytes + c.plan->phases.front().write_back_bytes)
                : nullptr;
    e["predicted_step_ms"] = planned ? nlohmann::json(c.plan->predicted_step_ms) : nullptr;
    if (!c.error.empty()) e["error"] = c.error;
    out.push_back(std::move(e));
  }
  return out;
}

void print_plan_json(const TrainArgs& a, const ferry::ModelSpec& model, const ferry::TrainerOptions& base,
                     const PlanReport& r) {
  const auto& plan = r.configured.plan;
  const ferry::Configuration* chosen = r.chosen();
  const nlohmann::json refused = r.budget_refused.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.budget_refused);
  nlohmann::json j = {{"schema", plan_json_schema},
                      {"model", model.name},
                      {"batch", base.batch},
                      {"ranks", a.plan_ranks},
                      {"zero_stage", a.plan_ranks > 1 ? a.zero : 0},
                      {"optimizer", a.optimizer},
                      {"phases_mode", ferry::phases_name(base.phases.hybrid)},
                      {"accumulate", base.accumulate},
                      {"precision", precision_name(base.precision.compute)},
                      {"device_budget_bytes", r.budget},
                      {"device_budget_source", r.budget_source},
                      {"device_budget_refused", refused},
                      {"recompute", plan ? nlohmann::json(plan->recompute) : nullptr},
                      {"host_budget_bytes", r.host_limit},
                      {"host_budget_given", r.host_budget != 0},
                      {"host_memory", r.host_memory},
                      {"host_optimizer", plan ? nlohmann::json(plan->host_optimizer) : nullptr},
                      {"fits", r.configured.fits()},
                      {"min_budget_resident_bytes", r.min_resident},
                      {"min_budget_streamed_bytes", r.min_streamed ? nlohmann::json(*r.min_streamed) : nullptr},
                      {"min_budget_mapped_bytes", r.min_mapped ? nlohmann::json(*r.min_mapped) : nullptr},
                      {"recommended", chosen ? nlohmann::json{{"flags", chosen->flags},
                                                              {"device_bytes", chosen->plan->device_peak_bytes},
                                                              {"host_bytes", chosen->plan->host_bytes},
                                                              {"predicted_step_ms", chosen->plan->predicted_step_ms}}
                                             : nlohmann::json(nullptr)},
                      {"candidates", candidates_json(r.search)}};
  for (std::size_t i = 0; i < rate_count; ++i) {
    j[rate_specs[i].key] = r.rates.*rate_specs[i].rate;
    j[std::string(rate_specs[i].key) + "_source"] = r.rate_sources[i];
  }
  if (const auto& probe = r.rate_notes.gemm) {
    j["gemm_products_probed"] = probe->products();
    j["gemm_products"] = probe->distinct;
    j["gemm_probed_flops_share"] = probe->probed_share;
    j["gemm_probe_s"] = probe->seconds;
    j["gemm_probe_batch"] = probe->batch;
    nlohmann::json probes = nlohmann::json::array();
    for (const auto& p : probe->probes) {
      probes.push_back({{"node", p.node}, {"op", p.op}, {"nodes", p.nodes}, {"flops", p.flops}, {"gflops", p.gflops}});
    }
    j["gemm_probes"] = probes;
  }
  add_configured_fields(j, r.configured);
  std::cout << j.dump() << std::endl;
}

// The device bytes of each phase as configured, a table in MiB, and the totals under it.
void print_configured_table(const ferry::TrainingPlan& p) {
  const auto mib = [](std::uint64_t b) { return fmt::format("{:.1f}", b / 1048576.0); };
  std::cout << fmt::format(
      "device MiB per phase, as configured (residency {}, {}):\n", ferry::graph::residency_mode_name(p.mode),
      p.recompute ? fmt::format("recomputing segments of {} layers", p.recompute) : std::string("no recomputation"));
  std::cout << fmt::format("  {:<20} {:>9} {:>9} {:>9} {:>9} {:>11} {:>9} {:>9} {:>9}\n", "phase", "weights",
                           "gradients", "optimizer", "other", "activations", "scratch", "streamed", "total");
  for (const auto& ph : p.phases) {
    const auto& b = ph.device;
    std::cout << fmt::format("  {:<20} {:>9} {:>9} {:>9} {:>9} {:>11} {:>9} {:>9} {:>9}\n", ph.name, mib(b.weights),
                             mib(b.gradients), mib(b.optimizer_state), mib(b.other_state), mib(b.activations),
                             mib(b.scratch), mib(b.streamed_copies), mib(b.total));
  }
  std::cout << "  (other: predictor state, gradient sums; gradients to streamed: step tensors live at the peak "
               "node; total: persistent device tensors and the step buffers, which can be larger than what is "
               "live at once)\n";
  const auto& t = p.phases.front();
  std::cout << fmt::format(
      "device peak {}; host {} of {} memory ({} weights and state, {} step buffers){}; per step {} fetched, {} "
      "written back, {} batch; {:.3g} GFLOP; predicted step {:.1f} ms (compute {:.1f} ms, transfers {:.1f} ms{}, {} "
      "launches {:.1f} ms{}{}; in its nodes' order {:.1f} ms, the compute lane idle {:.1f} ms{})\n",
      ferry::format_bytes_up(p.device_peak_bytes), ferry::format_bytes(p.host_bytes),
      ferry::offload::host_memory_name(p.host_memory), ferry::format_bytes(p.host_store_bytes),
      ferry::format_bytes(p.host_step_bytes),
      fmt::format("{}{}{}",
                  p.host_compressed_bytes
                      ? fmt::format(", and up to {} of compressed chunks", ferry::format_bytes(p.host_compressed_bytes))
                      : std::string(),
                  p.host_restore_bytes ? fmt::format(", and {} for the Predict runs' restore point",
                                                     ferry::format_bytes(p.host_restore_bytes))
                                       : std::string(),
                  p.host_eval_bytes
                      ? fmt::format(", and up to {} for evaluation batches", ferry::format_bytes(p.host_eval_bytes))
                      : std::string()),
      ferry::format_bytes(t.fetch_bytes), ferry::format_bytes(t.write_back_bytes), ferry::format_bytes(t.batch_bytes),
      t.flops * 1e-9, p.predicted_step_ms, t.compute_ms, t.transfer_ms,
      t.to_device_ms > 0 && t.to_host_ms > 0
          ? fmt::format(" ({:.1f} there and {:.1f} back alone)", t.to_device_ms, t.to_host_ms)
          : std::string(),
      t.launches, t.launch_ms,
      t.host_update_bytes ? fmt::format(", host updates {:.1f} ms", t.host_update_ms) : std::string(),
      t.codec_bytes ? fmt::format(", codec {:.1f} ms", t.codec_ms) : std::string(), t.scheduled_step_ms,
      t.scheduled_compute_idle_ms,
      t.scheduled_longest_wait_before.empty() || t.scheduled_longest_wait_ms < 0.05  // none, or none shown
          ? std::string()
          : fmt::format(", longest wait {:.1f} ms before {}", t.scheduled_longest_wait_ms,
                        t.scheduled_longest_wait_before));
  if (p.host_optimizer_chosen) std::cout << ferry::optimizer_place_reason(p) << "\n";
}

// Of the configurations planned within the device budget (a host limit refused them), the one
// needing the least host memory; none where no configuration fit the device budget.
const ferry::Configuration* leanest_in_host_memory(const std::vector<ferry::Configuration>& tried) {
  const ferry::Configuration* lean = nullptr;
  for (const ferry::Configuration& c : tried) {
    if (c.plan && (!lean || ferry::detail::host_bytes_needed(*c.plan) < ferry::detail::host_bytes_needed(*lean->plan)))
      lean = &c;
  }
  return lean;
}

// The configurations that fit, in the order tried, with their predictions, then the one to use.
void print_search(const PlanReport& r) {
  const auto& tried = r.search.tried;
  const auto fitting = std::count_if(tried.begin(), tried.end(), [](const auto& c) { return c.fits(); });
  std::cout << fmt::format("configurations tried for a budget of {} and {} of host memory: {}, {} fit{}\n",
                           ferry::format_bytes(r.budget), ferry::format_bytes(r.host_limit), tried.size(), fitting,
                           fitting ? " (predicted step; * the fastest, ~ other numerics)" : "");
  for (std::size_t i = 0; i < tried.size(); ++i) {
    const ferry::Configuration& c = tried[i];
    if (!c.fits()) continue;
    std::cout << fmt::format("  {}{} {:>10.1f} ms  device {:>10}  host {:>10}  {}\n", r.search.chosen == i ? '*' : ' ',
                             c.same_numerics ? ' ' : '~', c.plan->predicted_step_ms,
                             ferry::format_bytes_up(c.plan->device_peak_bytes), ferry::format_bytes(c.plan->host_bytes),
                             c.flags);
  }
  if (const ferry::Configuration* c = r.chosen()) {
    std::cout << fmt::format(
        "for a budget of {} and {} of host memory: {} (device peak {}, host {}, predicted step {:.1f} ms)\n",
        ferry::format_bytes(r.budget), ferry::format_bytes(r.host_limit), c->flags,
        ferry::format_bytes_up(c->plan->device_peak_bytes), ferry::format_bytes(c->plan->host_bytes),
        c->plan->predicted_step_ms);
  } else if (const ferry::Configuration* lean = leanest_in_host_memory(tried)) {
    // Some fit the device budget: host memory is what none fits.
    std::cout << fmt::format(
        "for a budget of {} and {} of host memory: no configuration fits the host memory; of those that fit the "
        "device budget, the leanest in host memory ({}) needs {}\n",
        ferry::format_bytes(r.budget), ferry::format_bytes(r.host_limit), lean->flags,
        ferry::format_bytes_up(ferry::detail::host_bytes_needed(*lean->plan)));
  } else {
    // The least of the three ways to hold the state (a mapped step reads it where it lies in host
    // memory and can need less than a streamed one, which fetches layers into device buffers).
    std::uint64_t least = r.min_resident;
    const char* how = "--residency resident";
    if (r.min_streamed && *r.min_streamed < least) least = *r.min_streamed, how = "--residency stream";
    if (r.min_mapped && *r.min_mapped < least) least = *r.min_mapped, how = "--residency mapped";
    std::cout << fmt::format(
        "for a budget of {} and {} of host memory: no configuration fits; the smallest device budget is {} ({})\n",
        ferry::format_bytes(r.budget), ferry::format_bytes(r.host_limit), ferry::format_bytes_up(least), how);
  }
}

// How the host budget was set: this machine's memory, or a budget for a larger host than this one.
std::string host_limit_note(const PlanReport& r) {
  if (!r.host_budget) return " (physical memory)";
  const std::uint64_t physical = ferry::physical_memory_bytes();
  if (physical == 0 || r.host_budget <= physical) return "";
  return fmt::format(
      " (more than this machine's {}: planned for a larger host; ferry train here refuses a configuration needing more "
      "than it)",
      ferry::format_bytes(physical));
}

std::string device_budget_note(const PlanReport& r) {
  const std::string_view source = r.budget_source;
  if (source == "device") return " (the device's memory less headroom)";
  if (source == "driver_free_memory") {
    return " (what the driver counts free less headroom: other processes hold part of the device; ferry train here "
           "takes the same)";
  }
  return "";
}

void print_plan_text(const TrainArgs& a, const ferry::ModelSpec& model, const ferry::TrainerOptions& base,
                     const PlanReport& r) {
  std::cout << fmt::format(
      "ferry plan: {}, batch {}, {}, {}, phases {}{}, device budget {}{}, host budget {}{} on {}\n", model.name,
      base.batch, a.optimizer, precision_name(base.precision.compute), ferry::phases_name(base.phases.hybrid),
      base.accumulate > 1 ? fmt::format(", accumulate {}", base.accumulate) : "", ferry::format_bytes(r.budget),
      device_budget_note(r), ferry::format_bytes(r.host_limit), host_limit_note(r), r.device);
  if (!r.budget_refused.empty()) {
    std::cout << fmt::format("ferry train here would refuse this budget now: {}\n", r.budget_refused);
  }
  std::string rates;
  for (std::size_t i = 0; i < rate_count; ++i) {
    std::string source = r.rate_sources[i];
    if (rate_specs[i].rate == &ferry::PlanRates::gemm_gflops && r.rate_notes.gemm) {
      // Where: "measured at 6 of the step's 9 kinds of product, 97% of its GEMM FLOPs".
      const ferry::StepGemmRate& probe = *r.rate_notes.gemm;
      source += fmt::format(" at {} of the step's {} kinds of product, {:.0f}% of its GEMM FLOPs{}", probe.products(),
                            probe.distinct, 100.0 * probe.probed_share,
                            probe.batch != base.batch ? fmt::format(", probed at batch {}", probe.batch) : "");
    }
    rates += fmt::format("{}{} ({})", i ? ", " : "rates: ",
                         fmt::format(fmt::runtime(rate_specs[i].label), r.rates.*rate_specs[i].rate), source);
  }
  std::cout << rates << "\n";
  if (a.plan_ranks > 1) {
    std::cout << fmt::format(
        "data parallel over {} ranks at ZeRO stage {}: the figures are rank 0's ({} samples of each global batch of "
        "{})",
        a.plan_ranks, a.zero, base.batch, base.data_parallel.global_batch);
    if (const auto& p = r.configured.plan) {
      const auto& t = p->phases.front();
      std::cout << fmt::format(
          "; per step its collectives take in {} and send {} over the network ({}), and {} cross the link around them",
          ferry::format_bytes(t.collective_bytes), ferry::format_bytes(t.network_bytes),
          r.rates.network_gbps > 0 ? fmt::format("{:.1f} ms", t.network_ms)
                                   : std::string("its time not predicted without --network-gbps"),
          ferry::format_bytes(t.collective_link_bytes));
    }
    std::cout << "\n";
  }
  if (r.configured.plan) print_configured_table(*r.configured.plan);
  std::cout << r.recompute_note;
  if (!r.configured.fits()) std::cout << "as configured it does not fit: " << r.configured.error << "\n";
  const std::string min_streamed =
      r.min_streamed ? ferry::format_bytes_up(*r.min_streamed) : std::string("(nothing to stream)");
  std::cout << fmt::format(
      "minimum budget: {} with everything resident, {}{} streamed\n", ferry::format_bytes_up(r.min_resident),
      r.min_mapped ? ferry::format_bytes_up(*r.min_mapped) + " mapped, " : std::string(), min_streamed);
  print_search(r);
}

}  // namespace

void add_rate_options(CLI::App* plan, TrainArgs& t) {
  for (const RateSpec& r : rate_specs) {
    const std::string measured =
        r.measure ? fmt::format("; default: measured on {}", r.on_host ? "this machine's cores" : "the device")
                  : std::string();
    plan->add_option(r.flag, t.plan_rates.*r.rate, fmt::format("{} (for the step-time prediction{})", r.help, measured))
        ->check(positive_number());
  }
}

// `ferry plan --ranks N`: rank 0 of N, which planning asks who it is and nothing else (a plan runs
// no collective).
class PlannedRanks final : public ferry::ops::Communicator {
 public:
  explicit PlannedRanks(int n) : n_(n) {}
  int rank() const override { return 0; }
  int size() const override { return n_; }
  std::string name() const override { return "planned"; }
  void allreduce_sum(std::span<const std::span<float>>) override { refuse(); }
  void allreduce_sum(std::span<double>) override { refuse(); }
  void reduce_scatter_sum(std::span<const ferry::ops::ScatterBuffer>) override { refuse(); }
  void allgather(std::span<ferry::ops::GatherBuffer>) override { refuse(); }
  std::vector<std::uint64_t> allgather(std::uint64_t) override { refuse(); }
  std::unique_ptr<ferry::ops::Communicator> split() const override { return std::make_unique<PlannedRanks>(n_); }
  [[noreturn]] void abort(int code) const override { std::exit(code); }

 private:
  [[noreturn]] static void refuse() { throw std::logic_error("a plan runs no collective"); }
  int n_;
};

int cmd_plan(const TrainArgs& a) {
  ferry::Runtime runtime({.device = a.device});
  ferry::TrainerOptions base;
  base.batch = a.batch ? a.batch : default_batch(a.model);
  configure_trainer(a, base);
  if (a.plan_ranks < 2 && a.zero > 0) {
    throw std::invalid_argument(fmt::format(
        "--zero {} shards state over ranks: plan it with --ranks N (N >= 2), the ranks mpirun -np starts", a.zero));
  }
  if (a.plan_ranks > 1) {
    // Rank 0's step: its share of the global batch (--batch), its shares at ZeRO stages 1 and 2.
    TrainArgs ranked = a;
    ranked.world = std::make_shared<PlannedRanks>(a.plan_ranks);
    configure_ranks(ranked, base.batch, base);
  }
  const ferry::ModelSpec model = plan_model(a);
  const PlanReport report = make_report(a, runtime, model, base);
  if (a.json) {
    print_plan_json(a, model, base, report);
  } else {
    print_plan_text(a, model, base, report);
  }
  return report.any_fits() ? 0 : 1;
}

}  // namespace ferry::cli
