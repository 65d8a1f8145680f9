// The driver's count of device memory in use, reported after `ferry train` beside the plan's peak.
#include <fmt/format.h>

#include <algorithm>
#include <iostream>

#include "cli.hpp"

namespace ferry::cli {
namespace {

// What the driver counted beyond the context and the plan's peak, where it counted.
struct DriverCount {
  std::uint64_t before = 0, after_context = 0, peak = 0;
  std::int64_t beyond_plan = 0;  // peak - after_context - the plan's device peak; negative: less
};

std::optional<DriverCount> driver_count(const ferry::Trainer& trainer) {
  const cl::DriverMemoryWatch& w = trainer.driver_memory();
  const auto peak = w.peak_used_bytes();
  const auto after = w.used_after_context_bytes();
  if (!peak || !after) return std::nullopt;
  DriverCount c;
  c.before = w.used_before_context_bytes().value_or(*after);
  c.after_context = *after;
  c.peak = std::max(*peak, *after);
  c.beyond_plan =
      static_cast<std::int64_t>(c.peak - c.after_context) - static_cast<std::int64_t>(trainer.device_peak_bytes());
  return c;
}

// Beyond the plan by more than the driver's rounding of buffers: the larger of 256 MiB and 5% of
// the plan's peak.
bool beyond_what_the_plan_explains(const DriverCount& c, std::uint64_t planned) {
  const std::int64_t slack = std::max<std::int64_t>(std::int64_t{256} << 20, static_cast<std::int64_t>(planned / 20));
  return c.beyond_plan > slack;
}

}  // namespace

void add_driver_memory_fields(nlohmann::json& j, const ferry::Trainer& trainer) {
  const cl::DriverMemory& source = trainer.driver_memory().source();
  const auto c = driver_count(trainer);
  j["driver_memory_source"] = source.available() ? nlohmann::json(source.source()) : nlohmann::json(nullptr);
  j["driver_memory_unavailable"] =
      source.available() ? nlohmann::json(nullptr) : nlohmann::json(source.unavailable_reason());
  const auto or_null = [&](auto DriverCount::*field) {
    return c ? nlohmann::json((*c).*field) : nlohmann::json(nullptr);
  };
  j["driver_device_used_before_bytes"] = or_null(&DriverCount::before);
  j["driver_device_used_after_context_bytes"] = or_null(&DriverCount::after_context);
  j["driver_device_used_peak_bytes"] = or_null(&DriverCount::peak);
  j["driver_device_bytes_beyond_plan"] = or_null(&DriverCount::beyond_plan);
}

std::string unread_driver_memory_warning(const cl::DriverMemory& source) {
  const std::string named = cl::DriverMemory::named_by_environment();
  if (source.available() || named.empty()) return "";
  return fmt::format("ferry: warning: {} is set, but no device memory count is read: {}\n", named,
                     source.unavailable_reason());
}

void report_driver_memory(const TrainArgs& a, const ferry::Trainer& trainer) {
  if (!a.primary) return;
  std::cerr << unread_driver_memory_warning(trainer.driver_memory().source());
  const auto c = driver_count(trainer);
  if (!c) return;
  const std::string source = trainer.driver_memory().source().source();
  const auto signed_bytes = [](std::int64_t b) {
    return b < 0 ? "-" + format_bytes(static_cast<std::uint64_t>(-b)) : format_bytes(static_cast<std::uint64_t>(b));
  };
  if (!a.quiet) {
    std::cerr << fmt::format(
        "ferry: device memory as the driver counts it ({}): {} in use at the peak, {} once the context was made ({} "
        "before it); beyond the context and the plan's device peak ({}): {}\n",
        source, format_bytes(c->peak), format_bytes(c->after_context), format_bytes(c->before),
        format_bytes(trainer.device_peak_bytes()), signed_bytes(c->beyond_plan));
  }
  if (beyond_what_the_plan_explains(*c, trainer.device_peak_bytes())) {
    const std::uint64_t ours = c->peak - c->after_context, budget = trainer.device_budget_bytes();
    std::cerr << fmt::format(
        "ferry: warning: the driver ({}) counted {} of device memory in use, {} more than this run's context ({}) and "
        "its planned device peak ({}) explain; beyond the context that is {} the device budget ({}). Another process "
        "may have taken it, or this driver backs pinned host memory with device memory too: --host-memory staged or "
        "pageable keeps host buffers off the device (docs/troubleshooting.md)\n",
        source, format_bytes(c->peak), format_bytes(static_cast<std::uint64_t>(c->beyond_plan)),
        format_bytes(c->after_context - std::min(c->after_context, c->before)),
        format_bytes(trainer.device_peak_bytes()), ours > budget ? "over" : "within", format_bytes(budget));
  }
}

std::string budget_from_free_memory_note(const ferry::Trainer& trainer) {
  if (!trainer.budget_from_free_memory()) return "";
  const auto count = trainer.driver_memory().source().read();
  return fmt::format(
      "; no --device-budget given, so the budget is the free memory as the driver ({}) counts it{}, "
      "less headroom: other processes hold part of the device",
      trainer.driver_memory().source().source(),
      count ? fmt::format(" ({} of {} in use)", format_bytes(count->used_bytes), format_bytes(count->total_bytes))
            : std::string());
}

}  // namespace ferry::cli
