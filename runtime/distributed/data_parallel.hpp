// The trainer's side of data-parallel training (runtime/distributed/data_parallel.cpp). Private
// to the library.
#pragma once

#include "ferry/graph/ir.hpp"
#include "ferry/runtime/trainer.hpp"

namespace ferry::detail {

// Data-parallel training is on: a communicator of more than one rank.
bool data_parallel(const TrainerOptions& o);
// The checks of TrainerOptions::data_parallel (std::invalid_argument saying what to change): the
// ZeRO stage, the batch as a share of the global batch (0: the
// batch times the ranks), the bucket size.
void validate_data_parallel(TrainerOptions& options);
// At construction, on `control` (a communicator of its own): every rank has the same weights'
// names and shapes and the options that decide the update (a hash of them), and the ranks'
// batches add up to the global batch; else every rank throws std::invalid_argument naming the
// ranks that differ, before anything is allocated.
void check_ranks_agree(ops::Communicator& control, const graph::Graph& training, const ModelSpec& model,
                       const TrainerOptions& o);
// After planning with TrainerOptions::host_optimizer_auto, on `control`: every rank put the optimizer
// in the same place (`on_host`); else every rank throws std::invalid_argument naming the ranks
// whose plans chose the host (their devices differ in kind), before anything is allocated.
void check_ranks_place_optimizer_alike(ops::Communicator& control, bool on_host);

}  // namespace ferry::detail
