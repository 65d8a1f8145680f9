// A model's initial weights and optimizer state (graph::WeightInit), made as a function of each
// element's index: any range of a tensor can be made on its own, in parallel or in pieces, with
// the values the whole tensor would have. Not installed; the Trainer uses it to fill the homes.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "ferry/graph/ir.hpp"

namespace ferry::graph {
struct PersistentArena;
}

namespace ferry {

// The key of a tensor's draws: the run's seed and the tensor's name, so that its values do not
// depend on the order tensors are created or filled in.
std::uint64_t initial_values_key(std::uint64_t seed, std::string_view tensor_name) noexcept;

// Elements [first, first + out.size()) of an f32 tensor initialised as `init` under `key`: ones,
// zeros, or uniform in [-bound, bound) from a counter-based generator (SplitMix64's finaliser of
// key + (i + 1) times the golden ratio's 64-bit constant; 24 bits of the result make the fraction).
// The element's value is the same whichever range it is made in.
void initial_values(const graph::WeightInit& init, std::uint64_t key, std::uint64_t first, std::span<float> out);

// The same for `count` elements of `elem_bytes` bytes each at `dst`, on all cores for a large
// range: zeros for any element size, other kinds for f32 (4 bytes) only (std::invalid_argument
// otherwise, naming `what`).
void initial_values_parallel(const graph::WeightInit& init, std::uint64_t key, std::uint64_t first, std::uint64_t count,
                             std::uint32_t elem_bytes, std::byte* dst, std::string_view what);

// Writes the initial value of each tensor of `ids` (persistent tensors of `tensors`, not views)
// into its home in `arena` under the run's `seed`. Host homes (pinned, mapped) make each value
// where it lives; the compressed home takes it whole, the dropped home nothing for zeros; device
// buffers are written from their start to their last tensor's end, padding as zeros, through
// one reused host image of at most 64 MiB, with large zero ranges filled on the device.
// Throws std::logic_error for a kind other than zeros on a tensor that is not f32.
void write_initial_values(graph::PersistentArena& arena, const graph::TensorTable& tensors,
                          std::span<const graph::TensorId> ids, std::uint64_t seed);

}  // namespace ferry
