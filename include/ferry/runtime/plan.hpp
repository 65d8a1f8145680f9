// What a compiled variant holds on the device at its peak, by what the bytes are for: the
// numbers `ferry plan` prints per phase.
#pragma once

#include <cstdint>

#include "ferry/graph/compiled_step.hpp"

namespace ferry {

struct DeviceBreakdown {
  // Persistent tensors whose home is the device.
  std::uint64_t weights = 0, optimizer_state = 0, other_state = 0;  // other: predictor state, gradient sums
  // Step tensors live at the peak node (the node with the most live step bytes).
  std::uint64_t gradients = 0;        // of weights and of activations
  std::uint64_t activations = 0;      // forward results, the batch, loss statistics
  std::uint64_t scratch = 0;          // op temporaries (im2col columns, packed GEMM panels)
  std::uint64_t streamed_copies = 0;  // device copies of host-homed weights and state
  std::uint64_t step_arena = 0;       // the step buffers as allocated (>= the live bytes: fragmentation)
  std::uint64_t total = 0;            // what the variant needs on the device: persistent + step arena
};

// `step`'s bytes at its peak; the persistent tensors are those of `training` (the model's training
// variant, which holds them all): a variant that does not use a device-resident tensor (Predict
// and the optimizer state) still finds it on the device.
DeviceBreakdown device_breakdown(const graph::CompiledStep& step, const graph::CompiledStep& training);

}  // namespace ferry
