// A checkpoint written by the ranks of a ZeRO run (each file holding its rank's shares of the
// optimizer state), or one whole-state checkpoint, loaded into a trainer that cuts the state
// otherwise: another number of ranks, another ZeRO stage, or alone (docs/distributed.md,
// "Checkpoints"). Private to the library; Trainer::load_resharded_checkpoint uses it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "checkpoint_format.hpp"
#include "ferry/graph/ir.hpp"
#include "ferry/ops/optimizer.hpp"
#include "graph/pipeline.hpp"

namespace ferry::detail {

// Where each of a trainer's checkpoint tensors comes from in the files of a checkpoint written by
// `files.size()` ranks at ZeRO stage 1 or 2 (file r: rank r's), or in one whole-state file.
// Weights and predictor state are whole in every file and come from the first; the optimizer state
// of each weight is put together from the files' shares (cut as ops::zero_shard cut them for that
// many ranks) and cut anew for this trainer's share. Gradient sums (inside a group of
// micro-batches) are each file's own rank's: they come as the group's sums, every file's weighted
// by its rank's share of the global batch (group_sums_for_rank takes this rank's part of them).
class ReshardedState {
 public:
  // `training`: the trainer's training graph; `key`: its training variant (ranks, rank, stage).
  // Throws std::invalid_argument naming the file and tensor when a file lacks a tensor this
  // trainer needs or holds a share of another size than that many ranks would have written.
  // `global_batch`: the samples of a global batch (the files' too: the fingerprints agree on it).
  ReshardedState(const graph::Graph& training, const graph::VariantKey& key, const ops::OptimizerConfig& optimizer,
                 std::uint32_t global_batch, std::span<const std::filesystem::path> files,
                 std::span<const ckpt::Contents> contents);

  // Tensor `id` of the trainer as its bytes, from the files' tensors read by `read(file, index)`
  // (the payload of fingerprint tensor `index` of file `file`).
  using Read = std::function<std::span<const std::byte>(std::size_t file, std::size_t index)>;
  std::vector<std::byte> value(graph::TensorId id, const Read& read) const;

 private:
  // One file's piece of a tensor of this trainer: rows of `units` units from unit `first` of the
  // weight (units: elements, or the 8-bit optimizer's blocks).
  struct Piece {
    std::size_t file, index;  // the file, and the tensor's place in its fingerprint
    std::size_t first, units;
    double weight = 0;  // gradient sums: the file's rank's share of the batch
  };
  struct Source {
    std::vector<Piece> pieces;
    std::size_t rows = 1, first = 0, units = 0;  // this trainer's tensor: rows x units from unit `first`
    bool weighted_sum = false;                   // the pieces' values weighted and added (gradient sums)
  };
  std::vector<std::byte> weighted_sum(graph::TensorId id, const Source& s, const Read& read) const;
  const graph::Graph& training_;
  std::vector<Source> sources_;  // by TensorId
};

// Gradient sums of a checkpoint are the group's (the ranks' sums, each weighted by its share of
// the global batch; one rank's alone). This rank's part, in place (f32 values): rank 0 takes them
// all, divided by its own share, and the others start from zeros, so that at the group's end the
// ranks' sums, weighted by their shares, add up to the group's again (to f32 rounding; exactly on
// one rank, whose share is 1).
void group_sums_for_rank(std::span<std::byte> sums, int rank, double share);

}  // namespace ferry::detail
