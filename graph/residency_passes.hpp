// The residency passes of a compile (graph/pipeline.hpp's device passes): where each persistent
// tensor lives during the step, the fetch and write-back nodes that move it, and the memory plan
// that follows. Their options and report are public (ferry/graph/residency.hpp).
#pragma once

#include "ferry/graph/ir.hpp"
#include "ferry/graph/residency.hpp"
#include "graph/memory_plan.hpp"

namespace ferry::graph {

// State updates whose persistent outputs all live in homes that commit (their new values become
// state only when the step succeeds, and CompiledStep::run commits only when the overflow guard is
// finite) check the loss instead of the guard, so they need not wait for the last gradient. Those
// that write a tensor in place (device, host_mapped, and host_pinned and host_compressed when
// `pinned_in_place`: one copy) keep checking the guard and so come after it. No-op without a guard.
void check_updates_against_the_loss(Graph& g, bool pinned_in_place);

// Moves every optimizer update to right after the last node that uses its weight or gradient, so
// gradients and fetched copies die early (first check_updates_against_the_loss: an update that
// checks the guard comes after it). Does not change any result.
void place_updates_early(Graph& g, bool pinned_in_place);

// The host optimizer's passes (graph/passes/host_optimizer.cpp), in this order:
// With one copy of the state and accumulation, the gradient sums, in pinned host memory, summed on
// the host lane. A micro-batch's grad_accumulate reads its gradient written back right after the
// gradient's last other use on the device (and runs after the commit point, skipped with the
// updates when the guard is not finite); the last micro-batch's grad_mean runs on a host copy
// written back as early, which the update then reads (and SGD without momentum writes). Per
// micro-batch each gradient crosses the link once, where on the device its sum was fetched and
// written back beside it. With `narrow_copies`, a gradient the device widened from f16 or bf16
// crosses narrow, right after that cast, and a cast on the host lane widens it (the same bits).
// Not with collectives (data parallel: the sums stay on the device).
void move_accumulation_to_host(Graph& g, bool narrow_copies);
// Then every optimizer update on the host lane, reading and writing the host-resident weight and
// state; its gradient written back into pinned host memory just before it, or with
// `write_back_early` (one-copy state) right after its last use on the device; a data-parallel sum
// in pinned host memory, or a gradient a host-lane node made there (the mean above), read where it
// is; with `narrow_copies`, a gradient the device widened from f16 or bf16 written back narrow and
// read by the update, which widens it as it reads it (or, for an update that writes its gradient,
// widened by a cast on the host lane).
void move_updates_to_host(Graph& g, bool write_back_early, bool narrow_copies);
// Then: a device cast widening an f16 or bf16 gradient whose only reader is the overflow guard's
// check goes, and the check reads the narrow gradient times the cast's factor instead (the same
// finite test on the same f32 values): no f32 copy on the device, one pass over half the bytes.
void check_narrow_gradients(Graph& g);
// A data-parallel sum in pinned host memory that went back to the device only for the overflow
// guard's check is checked on the host lane instead, into the host copy of the guard that the
// ranks' agreement sums (or one made for the checks); the copy back and the device check go.
void check_reduced_gradients_on_host(Graph& g);
// ZeRO stages 1 and 2 with one copy of the state changed in place: the weights' all-gather works
// on their pinned host homes, where the host updates left this rank's shares.
void gather_weights_in_host_homes(Graph& g);

// Host updates deferred into the next step (ResidencyOptions::overlap_host_updates; the last pass
// before the memory plan, graph/passes/defer_updates.cpp): each host update, marked
// NodeTable::deferred and without its loss or guard input, goes just before the first other node
// that touches its weight or state, so that it applies the previous step's gradient as the forward
// reaches its weight. Throws std::invalid_argument for a step with collectives (data parallel).
void defer_host_updates(Graph& g);

// Routes the fetches and write-backs of tensors in staged homes (compressed, dropped) through
// pinned staging with unpack and pack nodes on the host lanes (graph/passes/staging.cpp). With
// `host_unified`, the device copies themselves are the staging. Host copies of pageable memory:
// `written`, the fetches of what the step wrote go through staging too; `staged`, also every other
// fetch and write-back of at least `host_copy_min_bytes`, the fetches among them (those of what
// the step did not write) as chunked fetches through a ring of pinned chunks of `chunk_bytes` when
// that is above 0.
enum class HostCopies : std::uint8_t { none, written, staged };
HostCopies host_copies_for(offload::HostMemory resolved);
void stage_home_transfers(Graph& g, bool host_unified, HostCopies host_copies = HostCopies::none,
                          std::uint64_t host_copy_min_bytes = 0, std::uint64_t chunk_bytes = 0);

// Runs of adjacent Adam updates over whole f32 tensors on the device (a resident step's updates,
// which come last) as adam_update_group nodes of up to ops::adam_group_slots parameters: one
// launch each, the same bits (graph/passes/update_groups.cpp). Only before the memory plan.
void group_updates(Graph& g);

// Rewrites `g` for the chosen mode, plans its memory and returns the plan. For stream mode it
// searches the largest cache limit whose planned device peak fits the budget. Throws BudgetError
// if the budget cannot hold the step even when every layer is fetched just in time.
// `host_unified`: the device's memory is the host's (mapped mode is possible).
MemoryPlan plan_residency(Graph& g, const ResidencyOptions& options, bool host_unified, MemoryPlanOptions mopt,
                          ResidencyReport& report);

}  // namespace ferry::graph
