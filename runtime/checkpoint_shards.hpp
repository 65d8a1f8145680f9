// A checkpoint written by the ranks of a ZeRO run (each file holding its rank's shares of the
// optimizer state), or one whole-state checkpoint, loaded into a trainer that cuts the state
// otherwise: another number of ranks, another ZeRO stage, or alone (docs/distributed.md,
// "Checkpoints"). Private to the library; Trainer::load_resharded_checkpoint uses it.
#pragma once

#include <cstddef>
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
// Weights, predictor state and gradient sums are whole in every file and come from the first; the
// optimizer state of each weight is put together from the files' shares (cut as ops::zero_shard
// cut them for that many ranks) and cut anew for this trainer's share.
class ReshardedState {
 public:
  // `training`: the trainer's training graph; `key`: its training variant (ranks, rank, stage).
  // Throws std::invalid_argument naming the file and tensor when a file lacks a tensor this
  // trainer needs or holds a share of another size than that many ranks would have written.
  ReshardedState(const graph::Graph& training, const graph::VariantKey& key, const ops::OptimizerConfig& optimizer,
                 std::span<const std::filesystem::path> files, std::span<const ckpt::Contents> contents);

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
  };
  struct Source {
    std::vector<Piece> pieces;
    std::size_t rows = 1, first = 0, units = 0;  // this trainer's tensor: rows x units from unit `first`
  };
  const graph::Graph& training_;
  std::vector<Source> sources_;  // by TensorId
};

}  // namespace ferry::detail
