// The configuration search of ferry::search_configurations with the device's kind given, so that
// a test on a unified-memory CPU device can search as for a discrete GPU (no mapped candidate).
#pragma once

#include "ferry/runtime/plan.hpp"

namespace ferry::detail {

ConfigurationSearch search_configurations(Runtime& runtime, const ModelSpec& model, const TrainerOptions& options,
                                          const PlanRates& rates, bool host_unified_memory);

}  // namespace ferry::detail
