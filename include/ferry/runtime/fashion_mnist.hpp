// Fashion-MNIST from the gzipped IDX files (Debian: dataset-fashion-mnist).
#pragma once

#include <cstdint>
#include <filesystem>
#include <vector>

#include "ferry/runtime/data_source.hpp"

namespace ferry {

// Images and their class labels in memory. As a DataSource it provides "input" (f32, one image
// per sample) and "labels" (i32), the batch tensors of models::classifier.
struct Dataset final : DataSource {
  std::vector<float> images;         // count * rows * cols, pixel / 255 in [0, 1], row-major per image
  std::vector<std::int32_t> labels;  // count, in [0, 10)
  std::size_t count = 0, rows = 0, cols = 0;
  std::size_t sample_elems() const { return rows * cols; }

  std::size_t size() const override { return count; }
  // Throws std::invalid_argument when the vectors hold fewer than `count` samples of rows x cols
  // (read() checks it first, so a wrong count is an error, never a read past the end; a count
  // below what they hold uses the first `count` samples).
  void validate() const;
  void read(std::string_view name, std::size_t first, std::size_t n, std::span<std::byte> out) const override;
};

enum class Split : std::uint8_t { train, test };

// The folder holding the four .gz files: $FERRY_DATA_DIR if set, else Debian's
// /usr/share/datasets/fashion-mnist.
std::filesystem::path default_fashion_mnist_dir();

// Loads "<dir>/train-images-idx3-ubyte.gz" + "train-labels-idx1-ubyte.gz" (Split::train) or the
// "t10k-" pair (Split::test). Throws std::runtime_error naming the file and what is wrong (missing,
// not gzip, truncated, bad magic, image and label counts disagree, label out of range), and saying
// what to do (e.g. apt-get install dataset-fashion-mnist).
Dataset load_fashion_mnist(const std::filesystem::path& dir, Split split);

}  // namespace ferry
