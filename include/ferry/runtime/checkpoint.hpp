// Checkpoints: a Trainer's whole training state in one file, for a bit-identical resume.
//
// Trainer::save_checkpoint writes every persistent tensor as stored (weights, optimizer state in
// any home and format, predictor state, gradient sums), the step counts, the learning rate, the
// hybrid phase controller and predictor bookkeeping, the loss scaler, and an opaque section of
// the caller's own state (epoch, data order, schedule position...). Trainer::load_checkpoint
// reads and verifies all of it before it changes anything. The format, the guarantees and the
// errors are in docs/checkpoints.md.
#pragma once

#include <cstdint>
#include <filesystem>

namespace ferry {

// "FERRYCKP": the first 8 bytes of every checkpoint.
inline constexpr char checkpoint_magic[9] = "FERRYCKP";
// The format this ferry writes, and the newest it reads.
// Version 2 added the settings a resume must keep (ferry/runtime/training_setting.hpp); version 1
// files still load, without that comparison.
inline constexpr std::uint32_t checkpoint_format_version = 2;

// How Trainer::load_checkpoint treats a checkpoint trained with other settings than the
// trainer's (weight decay, momentum, betas, dropout...: TrainingSetting with `resume` set).
struct LoadOptions {
  // false: refuse it, naming the first setting that differs, so a resumed run is the run it
  // continues. true: load it and train on with this trainer's settings (fine-tuning with another
  // weight decay, say). The model, optimizer kind, batch, accumulation, precision, phases and the
  // 8-bit state's block must match either way: the tensors and counters depend on them.
  bool accept_other_settings = false;
};

// The ferry release this library is ("0.1.0").
const char* ferry_version() noexcept;

// Checks, before any training, that a checkpoint can be written at `path`: its folder exists and
// a file can be created there (a probe file is created and removed), and `path` is not a folder.
// Throws std::runtime_error naming the path, the reason and what to do.
void check_checkpoint_path(const std::filesystem::path& path);

// The checksum of every part of a checkpoint: 64-bit FNV-1a over 8-byte little-endian words (the
// last 0-7 bytes one by one). `seed` continues an earlier checksum (the FNV offset basis to start).
inline constexpr std::uint64_t checkpoint_checksum_basis = 0xcbf29ce484222325ull;
std::uint64_t checkpoint_checksum(const void* data, std::size_t bytes,
                                  std::uint64_t seed = checkpoint_checksum_basis) noexcept;

}  // namespace ferry
