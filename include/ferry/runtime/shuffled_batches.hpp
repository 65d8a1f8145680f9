// Training batches from any DataSource: a new shuffled order every epoch, full batches only, each
// gathered into buffers this object owns and handed to Trainer::step as a Batch.
//
//   ferry::ShuffledBatches batches(train_data, trainer.model(), options.batch, /*seed=*/1);
//   for (int epoch = 0; epoch < epochs; ++epoch)
//     for (std::size_t s = 0; s < batches.steps_per_epoch(); ++s) trainer.step(batches.next());
//
// The order is std::shuffle of 0 .. size-1 with std::mt19937_64(seed), shuffled again at the start
// of every epoch; batch s of an epoch is samples order[s * batch ..], the last partial batch
// dropped. Under data parallelism each rank takes its Shard (shard_of) of every global batch, so
// the batches and their order do not depend on the number of ranks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "ferry/runtime/data_source.hpp"
#include "ferry/runtime/distributed.hpp"
#include "ferry/runtime/model.hpp"

namespace ferry {

class ShuffledBatches final : public BatchSource {
 public:
  // `batch` is the global batch (all ranks); `shard` this rank's rows of it (default: all of them).
  // Throws std::invalid_argument when the data holds fewer samples than one batch, or the shard
  // does not lie inside the batch. `data` must outlive this object.
  ShuffledBatches(const DataSource& data, const ModelSpec& model, std::uint32_t batch, std::uint64_t seed = 1,
                  Shard shard = {});

  std::size_t steps_per_epoch() const noexcept { return steps_per_epoch_; }
  // The next batch in order: at the start of an epoch (the first call, and after the last batch
  // of the one before) the order is shuffled first. The views are valid until the next call.
  const Batch& next() override;

  // Random access, for loops that keep their own position (resume mid-epoch, a checkpoint per
  // step): shuffle() draws the next epoch's order; batch(s) gathers batch s of the current one.
  // After them, next() goes on from batch s + 1.
  void shuffle();
  const Batch& batch(std::size_t step);
  // Where next() goes on, in the current order: batch `step` (resuming mid-epoch), or with
  // steps_per_epoch() a new order first (as after the last batch). Throws std::out_of_range past it.
  void seek(std::size_t step);

  // What a checkpoint keeps to go on exactly: the engine (its state streams with << and >>) and
  // the current order. set_order throws std::invalid_argument, changing nothing, unless `order`
  // is a permutation of 0 .. size-1.
  std::mt19937_64& engine() noexcept { return rng_; }
  const std::mt19937_64& engine() const noexcept { return rng_; }
  std::span<const std::size_t> order() const noexcept { return order_; }
  void set_order(std::span<const std::size_t> order);

 private:
  struct Tensor {
    std::string name;
    ops::DType dtype;
    std::size_t sample_bytes;
    std::vector<std::byte> bytes;
  };
  const DataSource& data_;
  std::uint32_t batch_;
  Shard shard_;
  std::size_t steps_per_epoch_;
  std::mt19937_64 rng_;
  std::vector<std::size_t> order_;
  std::size_t next_step_ = 0;  // the batch next() gathers; steps_per_epoch_: shuffle first
  std::vector<Tensor> tensors_;
  Batch views_;
};

}  // namespace ferry
