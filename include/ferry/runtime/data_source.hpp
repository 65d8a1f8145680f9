// Batches from the caller's memory: a view per batch tensor for one step (Batch), a source of
// samples a trainer reads in chunks of its own choosing (DataSource: evaluation, prediction), and
// a source of whole batches for a training loop (BatchSource).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>

#include "ferry/ops/types.hpp"

namespace ferry {

// The host bytes of one batch tensor, and their dtype (checked against the model's).
struct HostView {
  ops::DType dtype = ops::DType::f32;
  std::span<const std::byte> bytes;
  HostView(ops::DType d, std::span<const std::byte> b) : dtype(d), bytes(b) {}
  HostView(std::span<const float> v) : dtype(ops::DType::f32), bytes(std::as_bytes(v)) {}
  HostView(std::span<const std::int32_t> v) : dtype(ops::DType::i32), bytes(std::as_bytes(v)) {}
};

// One step's batch: a view per input and target of the model, by name ("input", "labels", ...).
using Batch = std::map<std::string, HostView, std::less<>>;

// Samples a trainer reads in chunks: evaluation and prediction batch them as they choose.
class DataSource {
 public:
  virtual ~DataSource() = default;
  // How many samples there are.
  virtual std::size_t size() const = 0;
  // Writes samples [first, first + count) of batch tensor `name` into `out`, which holds exactly
  // `count` samples of that tensor's sample shape and dtype. Throws std::invalid_argument for a
  // name it does not provide.
  virtual void read(std::string_view name, std::size_t first, std::size_t count, std::span<std::byte> out) const = 0;
};

// Where a training loop's batches come from (TrainingLoop): ShuffledBatches (epochs over a
// DataSource), RandomWindows (windows of a text), or the caller's own. The views next() returns
// stay valid until the next call (Trainer::submit stages them before it returns). A source moves
// (its buffers move with the views into them) but is not copied: a copy's views would be the
// original's buffers.
class BatchSource {
 public:
  BatchSource() = default;
  BatchSource(BatchSource&&) = default;
  BatchSource& operator=(BatchSource&&) = default;
  BatchSource(const BatchSource&) = delete;
  BatchSource& operator=(const BatchSource&) = delete;
  virtual ~BatchSource() = default;
  virtual const Batch& next() = 0;
};

}  // namespace ferry
