// English text as character (byte) tokens for language models: a corpus from files, its
// vocabulary, a held-out tail, and windows of it as batches (a DataSource).
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/runtime/data_source.hpp"
#include "ferry/runtime/distributed.hpp"

namespace ferry {

struct TextCorpus {
  std::vector<std::int32_t> ids;          // every byte of the text as its token id
  std::vector<std::uint8_t> vocab;        // token id -> byte: the distinct bytes present, ascending
  std::array<std::int16_t, 256> id_of{};  // byte -> token id, -1 for bytes not in the text
  std::size_t train_end = 0;              // ids [0, train_end) train, [train_end, size) are held out
  std::size_t files = 0;

  std::uint32_t vocab_size() const { return static_cast<std::uint32_t>(vocab.size()); }
  std::string decode(std::span<const std::int32_t> ids) const;
  // Token ids of `text`; throws std::invalid_argument naming a byte the vocabulary lacks.
  std::vector<std::int32_t> encode(std::string_view text) const;
};

// The fortune files of Debian's `fortunes` packages: every regular file directly in `dir`
// ($FERRY_TEXT_DIR if set, else /usr/share/games/fortunes), symlinks followed and duplicates
// dropped, except the .dat indexes and .u8 copies, sorted by resolved path. Throws
// std::runtime_error saying to install `fortunes` when there are none, and naming the folder, the
// system's reason and a fix when it cannot be listed (no read or search permission).
std::vector<std::filesystem::path> fortune_files(std::filesystem::path dir = {});

// Reads and concatenates `files` in order; the last `holdout` fraction (by integer arithmetic:
// floor(n * 9 / 10) bytes train for 0.1) is held out. Throws std::runtime_error naming a file that
// is missing, unreadable (with the reason and a fix), empty or binary, or the corpus when it holds
// a single distinct character; std::invalid_argument for a holdout outside (0, 1).
TextCorpus load_text_corpus(const std::vector<std::filesystem::path>& files, double holdout = 0.1);

// Windows of `context` + 1 tokens of a corpus: sample i is the window starting at starts[i];
// "tokens" is its first `context` ids and "next" the `context` ids one position later.
class TextWindows final : public DataSource {
 public:
  TextWindows(const TextCorpus& corpus, std::uint32_t context, std::vector<std::size_t> starts);
  // Non-overlapping windows of the held-out tail at 0, context, 2 context, ..., at most
  // `max_windows` of them spread evenly over it (all of them for 0).
  static TextWindows held_out(const TextCorpus& corpus, std::uint32_t context, std::size_t max_windows);

  std::size_t size() const override { return starts_.size(); }
  void read(std::string_view name, std::size_t first, std::size_t count, std::span<std::byte> out) const override;
  const std::vector<std::size_t>& starts() const { return starts_; }

 private:
  const TextCorpus& corpus_;
  std::uint32_t context_;
  std::vector<std::size_t> starts_;
};

// Training batches: `batch` windows of `context` + 1 tokens at uniformly random starts in the
// training part of a corpus, drawn from `seed`. next() returns "tokens" and "next" (the same
// windows one position later) as views of buffers this object owns, valid until the next call.
class RandomWindows final : public BatchSource {
 public:
  // Data parallel: each batch draws all `batch` windows, and next() gives the rows of `shard`
  // (this rank's share; ferry::shard_of): the ranks' shares make the same batches as one rank's.
  RandomWindows(const TextCorpus& corpus, std::uint32_t context, std::uint32_t batch, std::uint64_t seed,
                Shard shard = {});
  // The next batch of windows; the views are valid until the next call.
  const Batch& next() override;
  // Where the draw of windows stands (the generator's state as text), for checkpoints; restore()
  // puts one back and throws std::invalid_argument for text that is not one.
  std::string state() const;
  void restore(const std::string& state);

 private:
  const TextCorpus& corpus_;
  std::uint32_t context_, batch_;
  Shard shard_;
  std::vector<std::int32_t> tokens_, next_;
  Batch views_;
  std::mt19937_64 rng_;
  std::uniform_int_distribution<std::size_t> start_;
};

}  // namespace ferry
