// ShuffledBatches (ferry/runtime/shuffled_batches.hpp): a shuffled order per epoch, gathered
// sample by sample from the data source into this object's buffers.
#include "ferry/runtime/shuffled_batches.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <stdexcept>

namespace ferry {

ShuffledBatches::ShuffledBatches(const DataSource& data, const ModelSpec& model, std::uint32_t batch,
                                 std::uint64_t seed, Shard shard)
    : data_(data), batch_(batch), shard_(shard.count ? shard : Shard{0, batch}), rng_(seed), order_(data.size()) {
  if (batch == 0) throw std::invalid_argument("shuffled batches: the batch must hold at least one sample");
  if (data.size() < batch) {
    throw std::invalid_argument(
        fmt::format("shuffled batches: a batch of {} is larger than the {} samples of the data", batch, data.size()));
  }
  if (std::uint64_t{shard_.first} + shard_.count > batch) {
    throw std::invalid_argument(fmt::format("shuffled batches: rows {} .. {} of this rank are outside the batch of {}",
                                            shard_.first, std::uint64_t{shard_.first} + shard_.count, batch));
  }
  steps_per_epoch_ = data.size() / batch;
  next_step_ = steps_per_epoch_;
  std::iota(order_.begin(), order_.end(), std::size_t{0});
  for (const auto* specs : {&model.inputs, &model.targets}) {
    for (const TensorSpec& spec : *specs) {
      tensors_.push_back({spec.name, spec.dtype, spec.sample_bytes(), {}});
      tensors_.back().bytes.resize(spec.sample_bytes() * shard_.count);
    }
  }
  for (const Tensor& t : tensors_) views_.insert_or_assign(t.name, HostView(t.dtype, t.bytes));
}

void ShuffledBatches::shuffle() {
  std::shuffle(order_.begin(), order_.end(), rng_);
  next_step_ = 0;
}

const Batch& ShuffledBatches::batch(std::size_t step) {
  if (step >= steps_per_epoch_) {
    throw std::out_of_range(
        fmt::format("shuffled batches: batch {} of an epoch of {} (full batches only)", step, steps_per_epoch_));
  }
  for (Tensor& t : tensors_) {
    for (std::uint32_t i = 0; i < shard_.count; ++i) {  // this rank's rows of the batch
      const std::size_t sample = order_[step * batch_ + shard_.first + i];
      data_.read(t.name, sample, 1, std::span(t.bytes).subspan(i * t.sample_bytes, t.sample_bytes));
    }
  }
  next_step_ = step + 1;
  return views_;
}

void ShuffledBatches::seek(std::size_t step) {
  if (step > steps_per_epoch_) {
    throw std::out_of_range(
        fmt::format("shuffled batches: cannot go on from batch {} of an epoch of {}", step, steps_per_epoch_));
  }
  next_step_ = step;
}

const Batch& ShuffledBatches::next() {
  if (next_step_ >= steps_per_epoch_) shuffle();
  return batch(next_step_);
}

void ShuffledBatches::set_order(std::span<const std::size_t> order) {
  if (order.size() != order_.size()) {
    throw std::invalid_argument(
        fmt::format("shuffled batches: an order of {} samples for data of {}", order.size(), order_.size()));
  }
  std::vector<bool> seen(order.size());
  for (const std::size_t s : order) {
    if (s >= order.size() || seen[s]) {
      throw std::invalid_argument(fmt::format("shuffled batches: the order names sample {} {}", s,
                                              s >= order.size() ? "out of range" : "twice"));
    }
    seen[s] = true;
  }
  order_.assign(order.begin(), order.end());
}

}  // namespace ferry
