// `ferry plan`: compiles a model's step variants for a configuration (without running them) and
// prints what each phase holds on the device, the smallest budgets it runs in, and the first
// configuration, from fastest to leanest, that fits the given budget.
#include "ferry/runtime/plan.hpp"

#include <fmt/format.h>

#include <array>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "cli.hpp"

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
  c.context = a.context;
  return ferry::models::gpt(c);
}

struct Phase {
  std::string name;
  ferry::DeviceBreakdown bytes;
};

// The variants a trainer compiles up front, by the phases they serve.
std::vector<Phase> phases_of(const ferry::Trainer& t) {
  std::vector<Phase> out;
  const bool hybrid = t.phases() != nullptr;
  out.push_back({hybrid ? "warmup/full/correct" : "full", ferry::device_breakdown(t.train_step(), t.train_step())});
  for (const auto& [key, step] : t.variants()) {
    if (key.apply_predictor) out.push_back({"predict", ferry::device_breakdown(*step, t.train_step())});
    if (key.micro) out.push_back({"micro-batch", ferry::device_breakdown(*step, t.train_step())});
  }
  return out;
}

nlohmann::json to_json(const ferry::DeviceBreakdown& b) {
  return {{"weights_bytes", b.weights},
          {"gradients_bytes", b.gradients},
          {"optimizer_state_bytes", b.optimizer_state},
          {"other_state_bytes", b.other_state},
          {"activations_bytes", b.activations},
          {"scratch_bytes", b.scratch},
          {"streamed_copies_bytes", b.streamed_copies},
          {"step_arena_bytes", b.step_arena},
          {"total_bytes", b.total}};
}

// A candidate configuration: the flags a user adds, and the options they make.
struct Candidate {
  std::string flags;
  ferry::TrainerOptions options;
};

// Fastest first: everything resident, mapped (unified-memory devices: no copies), streamed, then
// streamed with leaner state; each as configured and then with bf16 layers (half the activation
// bytes) unless already narrow, and with the batch split into micro-batches when that is needed.
std::vector<Candidate> candidates(const ferry::TrainerOptions& base, bool adam, bool unified) {
  using ferry::graph::Residency;
  using ferry::graph::ResidencyMode;
  std::vector<Candidate> out;
  for (std::uint32_t split : {1u, 2u, 4u, 8u, 16u, 32u}) {
    if (base.batch % split != 0 || (split > 1 && base.phases.hybrid)) continue;
    for (int level = 0; level < 12; ++level) {
      const int lean = std::array{0, -1, 1, 2, 3, 4}[level / 2];  // -1: mapped
      const bool narrow = level % 2 == 1;
      if (lean == -1 && !unified) continue;
      if (narrow && base.precision.compute != ferry::ops::DType::f32) continue;
      ferry::TrainerOptions o = base;
      std::string flags;
      if (narrow) {
        o.precision.compute = ferry::ops::DType::bf16;
        o.precision.scaling = ferry::PrecisionConfig::Scaling::automatic;
        flags += " --precision bf16";
      }
      o.batch = base.batch / split;
      o.accumulate = base.accumulate * split;
      if (split > 1) flags += fmt::format(" --batch {} --accumulate {}", o.batch, o.accumulate);
      if (lean == 0) {
        o.residency.mode = ResidencyMode::resident;
        flags += " --residency resident";
      } else if (lean == -1) {
        o.residency.mode = ResidencyMode::mapped;
        flags += " --residency mapped";
      } else {
        o.residency.mode = ResidencyMode::stream;
        flags += " --residency stream";
      }
      if (lean == 2 || lean == 4) {
        o.residency.state_home = Residency::host_compressed;
        flags += " --state-home compressed";
      }
      if (lean >= 3) {
        if (!adam) continue;
        o.optimizer.kind = ferry::graph::OptimizerSpec::Kind::adamw8bit;
        flags += " --optimizer adamw8bit";
      }
      out.push_back({flags.substr(1), o});
    }
  }
  return out;
}

}  // namespace

int cmd_plan(const TrainArgs& a) {
  ferry::Runtime runtime({.device = a.device});
  ferry::TrainerOptions base;
  base.batch = a.batch ? a.batch : default_batch(a.model);
  configure_trainer(a, base);
  const ferry::ModelSpec model = plan_model(a);

  // As configured: every phase's bytes (with a budget too small, the error says so).
  std::optional<ferry::Trainer> configured;
  std::string configured_error;
  try {
    configured.emplace(runtime, model, base);
  } catch (const ferry::graph::BudgetError& e) {
    configured_error = e.what();
  }
  // Minimum budgets: everything resident, and streamed.
  ferry::TrainerOptions resident = base;
  resident.residency = {};
  resident.residency.mode = ferry::graph::ResidencyMode::resident;
  resident.residency.budget_bytes = ~std::uint64_t{0} >> 1;
  std::uint64_t min_resident = 0;
  {
    ferry::Trainer t(runtime, model, resident);
    for (const auto& p : phases_of(t)) min_resident = std::max(min_resident, p.bytes.total);
  }
  const auto min_streamed = ferry::min_stream_budget(runtime, model, base);
  const std::uint64_t budget =
      configured ? configured->device_budget_bytes()
                 : (base.residency.budget_bytes ? base.residency.budget_bytes : runtime.device().global_mem_bytes);

  // The first candidate, fastest first, that fits the budget.
  const bool adam = base.optimizer.kind != ferry::graph::OptimizerSpec::Kind::sgd;
  std::optional<Candidate> chosen;
  std::uint64_t chosen_total = 0;
  for (const Candidate& c : candidates(base, adam, runtime.device().host_unified_memory)) {
    ferry::TrainerOptions o = c.options;
    o.residency.budget_bytes = budget;
    try {
      ferry::Trainer t(runtime, model, o);
      chosen = c;
      for (const auto& p : phases_of(t)) chosen_total = std::max(chosen_total, p.bytes.total);
      break;
    } catch (const ferry::graph::BudgetError&) {
    }
  }

  if (a.json) {
    nlohmann::json phases = nlohmann::json::object();
    if (configured) {
      for (const auto& p : phases_of(*configured)) phases[p.name] = to_json(p.bytes);
    }
    nlohmann::json j = {
        {"schema", plan_json_schema},
        {"model", model.name},
        {"batch", base.batch},
        {"optimizer", a.optimizer},
        {"phases_mode", ferry::phases_name(base.phases.hybrid)},
        {"accumulate", base.accumulate},
        {"precision", precision_name(base.precision.compute)},
        {"device_budget_bytes", budget},
        {"fits", configured.has_value()},
        {"phases", phases},
        {"min_budget_resident_bytes", min_resident},
        {"min_budget_streamed_bytes", min_streamed ? nlohmann::json(*min_streamed) : nullptr},
        {"recommended",
         chosen ? nlohmann::json{{"flags", chosen->flags}, {"device_bytes", chosen_total}} : nlohmann::json(nullptr)}};
    std::cout << j.dump() << std::endl;
    return 0;
  }
  const auto mib = [](std::uint64_t b) { return fmt::format("{:.1f}", b / 1048576.0); };
  std::cout << fmt::format("ferry plan: {}, batch {}, {}, {}, phases {}{}, device budget {} on {}\n", model.name,
                           base.batch, a.optimizer, precision_name(base.precision.compute),
                           ferry::phases_name(base.phases.hybrid),
                           base.accumulate > 1 ? fmt::format(", accumulate {}", base.accumulate) : "",
                           ferry::format_bytes(budget), runtime.device().name);
  if (configured) {
    std::cout << fmt::format("device MiB per phase, as configured (residency {}):\n",
                             ferry::graph::residency_mode_name(configured->residency().mode));
    std::cout << fmt::format("  {:<20} {:>9} {:>9} {:>9} {:>9} {:>11} {:>9} {:>9} {:>9}\n", "phase", "weights",
                             "gradients", "optimizer", "other", "activations", "scratch", "streamed", "total");
    for (const auto& p : phases_of(*configured)) {
      const auto& b = p.bytes;
      std::cout << fmt::format("  {:<20} {:>9} {:>9} {:>9} {:>9} {:>11} {:>9} {:>9} {:>9}\n", p.name, mib(b.weights),
                               mib(b.gradients), mib(b.optimizer_state), mib(b.other_state), mib(b.activations),
                               mib(b.scratch), mib(b.streamed_copies), mib(b.total));
    }
    std::cout << "  (other: predictor state, gradient sums; gradients to streamed: step tensors live at the peak "
                 "node; total: persistent device tensors and the step buffers, which can be larger than what is "
                 "live at once)\n";
  } else {
    std::cout << "as configured it does not fit: " << configured_error << "\n";
  }
  std::cout << fmt::format("minimum budget: {} with everything resident, {} streamed\n",
                           ferry::format_bytes(min_resident),
                           min_streamed ? ferry::format_bytes(*min_streamed) : std::string("(nothing to stream)"));
  if (chosen) {
    std::cout << fmt::format("for a budget of {}: {} (device peak {})\n", ferry::format_bytes(budget), chosen->flags,
                             ferry::format_bytes(chosen_total));
  } else {
    std::cout << fmt::format("for a budget of {}: no configuration fits; the smallest is {}\n",
                             ferry::format_bytes(budget),
                             min_streamed ? ferry::format_bytes(*min_streamed) : ferry::format_bytes(min_resident));
  }
  return configured || chosen ? 0 : 1;
}

}  // namespace ferry::cli
