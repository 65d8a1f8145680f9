// Whether a run's checkpoints fit where they go, checked before its first step: a full disk found
// at the first boundary would lose every step before it. The TrainingLoop asks this once per run.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>

#include "ferry/ops/communicator.hpp"

namespace ferry {

// What one rank writes and where: `need` bytes (0: it writes no file) into a folder of a file
// system with `free` bytes available to it; ranks of one `file_system` share those bytes.
struct CheckpointSpace {
  std::uint64_t need = 0;
  std::uint64_t free = 0;
  std::uint64_t file_system = 0;  // this host and the file system's id, hashed
};

// The free space a run that writes more than one checkpoint of `each` bytes needs: the second is
// written whole beside the first before it replaces it, and the first replaces the `there` bytes
// of a file at the path now (a resumed run's checkpoint): 2 * each - min(there, each).
constexpr std::uint64_t checkpoints_need(std::uint64_t each, std::uint64_t there) {
  return each + (each - (there < each ? there : each));
}

// The free space and file system of the folder `path` would be written in; nullopt when the
// folder cannot be asked (a missing folder: the write itself reports that).
std::optional<CheckpointSpace> checkpoint_space_at(const std::filesystem::path& path, std::uint64_t need);

// Why the ranks' checkpoints (ranks[r]: rank r's) do not fit, or nothing when they do: the first
// file system whose ranks together need more than it has free.
std::optional<std::string> checkpoint_space_shortage(std::span<const CheckpointSpace> ranks);

// Throws std::runtime_error, on every rank alike, when a checkpoint of `need` bytes at `path` (this
// rank's; 0 for none) does not fit beside those of the other ranks of `control` (null: alone).
void check_checkpoint_space(const std::filesystem::path& path, std::uint64_t need, ops::Communicator* control);

}  // namespace ferry
