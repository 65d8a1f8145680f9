// The compressed home's codec: bit-exact round trips for every element size, chunk sizes that do
// not divide the tensor or are smaller than one element, empty and single-element tensors, any
// worker count and fast to strong levels; corrupt,
// re-checksummed and truncated chunks are errors naming the tensor and the chunk.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "ferry/offload/chunk_codec.hpp"

namespace ferry::test {
namespace {

using offload::ChunkCodec;
using offload::ChunkError;
using offload::CodecOptions;

std::vector<std::byte> data_of(std::size_t bytes, int kind, std::uint32_t seed) {
  std::vector<std::byte> out(bytes);
  std::mt19937 rng(seed);
  switch (kind) {
    case 0:  // all zeros
      break;
    case 1:  // incompressible
      for (auto& b : out) b = static_cast<std::byte>(rng());
      break;
    case 3: {  // random floats of every magnitude and sign, as raw bytes of whatever element size
      std::normal_distribution<float> d(0.0f, 1.0f);
      for (std::size_t i = 0; i + 4 <= bytes; i += 4) {
        const float f = d(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20);
        std::memcpy(out.data() + i, &f, 4);
      }
      break;
    }
    default: {  // small floats like Adam moments, as raw bytes of whatever element size
      std::normal_distribution<float> d(0.0f, 1e-3f);
      for (std::size_t i = 0; i + 4 <= bytes; i += 4) {
        const float f = d(rng) * d(rng);
        std::memcpy(out.data() + i, &f, 4);
      }
    }
  }
  return out;
}

CodecOptions options(std::size_t chunk, unsigned workers, int level = 1) {
  CodecOptions o;
  o.chunk_bytes = chunk;
  o.workers = workers;
  o.level = level;
  return o;
}

TEST(ChunkCodec, RoundTripsBitExactForEveryElementSizeChunkSizeAndWorkerCount) {
  for (unsigned workers : {0u, 1u, 2u}) {
    for (std::size_t chunk :
         {std::size_t{1}, std::size_t{3}, std::size_t{1000}, std::size_t{4096}, std::size_t{1} << 20}) {
      const ChunkCodec codec(options(chunk, workers));
      for (std::size_t elem : {1, 2, 4, 8}) {
        for (std::size_t elems : {0, 1, 7, 1000, 12345}) {
          for (int kind : {0, 1, 2, 3}) {
            if (chunk < 64 && elems > 1000) continue;  // a chunk per element: slow, nothing new
            SCOPED_TRACE(::testing::Message() << "workers " << workers << ", chunk " << chunk << ", elem " << elem
                                              << ", elems " << elems << ", kind " << kind);
            const auto raw = data_of(elems * elem, kind, static_cast<std::uint32_t>(elems + elem));
            const auto t = codec.compress(raw, elem, "t");
            EXPECT_EQ(t.raw_bytes(), raw.size());
            EXPECT_EQ(t.elem_bytes(), elem);
            const std::size_t chunk_elems = std::max<std::size_t>(1, chunk / elem);
            EXPECT_EQ(t.chunk_count(), (elems + chunk_elems - 1) / chunk_elems);
            std::vector<std::byte> back(raw.size(), std::byte{0x77});
            codec.decompress(t, back, "t");
            ASSERT_EQ(back, raw);
          }
        }
      }
    }
  }
}

TEST(ChunkCodec, RoundTripsAtFastAndStrongLevelsAndForDoubles) {
  std::vector<double> values(3000);
  std::mt19937 rng(5);
  std::normal_distribution<double> d(0.0, 1e-4);
  for (double& v : values) v = d(rng);
  const auto raw = std::as_bytes(std::span(values));
  for (int level : {-5, 1, 9, 19}) {
    SCOPED_TRACE(::testing::Message() << "level " << level);
    const ChunkCodec codec(options(5000, 2, level));  // 625 doubles a chunk: 5 chunks, the last short
    const auto t = codec.compress(raw, 8, "w.adam_m");
    EXPECT_EQ(t.chunk_count(), 5u);
    if (level >= 1) {  // negative levels store literals as they are
      EXPECT_LT(t.compressed_bytes(), t.raw_bytes()) << "the exponent planes of doubles compress";
    }
    std::vector<std::byte> back(raw.size());
    codec.decompress(t, back, "w.adam_m");
    EXPECT_TRUE(std::equal(back.begin(), back.end(), raw.begin()));
  }
}

TEST(ChunkCodec, ShuffledPlanesCompressSmallFloatsBetterThanZerosNeedAlmostNothing) {
  const ChunkCodec codec(options(1 << 16, 0));
  const auto zeros = data_of(1 << 20, 0, 1);
  EXPECT_LT(codec.compress(zeros, 4, "zeros").compressed_bytes(), zeros.size() / 100);
  const auto moments = data_of(1 << 20, 2, 2);
  const auto shuffled = codec.compress(moments, 4, "m").compressed_bytes();
  const auto unshuffled = codec.compress(moments, 1, "m").compressed_bytes();  // element size 1: no shuffle
  EXPECT_LT(shuffled, unshuffled) << "byte planes separate the exponents from the noisy mantissas";
  EXPECT_LT(shuffled, moments.size());
}

TEST(ChunkCodec, PlaneShuffleIsItsOwnInverse) {
  for (std::size_t elem : {1, 2, 3, 4, 8}) {
    const auto raw = data_of(999 * elem, 1, 9);  // 999: whole blocks of 256 elements and a tail
    std::vector<std::byte> planes(raw.size()), back(raw.size());
    offload::shuffle_planes(raw.data(), planes.data(), 999, elem);
    for (std::size_t i = 0; i < 999; ++i) {
      for (std::size_t b = 0; b < elem; ++b) {
        ASSERT_EQ(planes[b * 999 + i], raw[i * elem + b])
            << "plane " << b << " holds byte " << b << " of element " << i << " (element size " << elem << ")";
      }
    }
    offload::unshuffle_planes(planes.data(), back.data(), 999, elem);
    EXPECT_EQ(back, raw) << elem;
  }
}

// Flips a byte in the middle of chunk 2, overwrites the checksum at the end of chunk 1's frame,
// and truncates chunk 0: each is a ChunkError naming the tensor and that chunk.
TEST(ChunkCodec, CorruptChunksAreErrorsNamingTensorAndChunk) {
  const ChunkCodec codec(options(4096, 0));
  const auto raw = data_of(5 * 4096, 2, 3);
  std::vector<std::byte> out(raw.size());
  auto expect_error = [&](const offload::CompressedTensor& t, std::size_t chunk) {
    try {
      codec.decompress(t, out, "layer3.w.adam_v");
      FAIL() << "corrupt chunk " << chunk << " was accepted";
    } catch (const ChunkError& e) {
      EXPECT_EQ(e.chunk(), chunk);
      EXPECT_EQ(e.tensor(), "layer3.w.adam_v");
      const std::string what = e.what();
      EXPECT_NE(what.find("layer3.w.adam_v"), std::string::npos) << what;
      EXPECT_NE(what.find("chunk " + std::to_string(chunk) + " of 5"), std::string::npos) << what;
      EXPECT_NE(what.find("checkpoint"), std::string::npos) << "says what to do: " << what;
    }
  };
  {
    auto t = codec.compress(raw, 4, "x");
    auto b = t.chunk_data(2);
    b[b.size() / 2] ^= std::byte{0x10};
    expect_error(t, 2);
    b[b.size() / 2] ^= std::byte{0x10};  // the failed decompression left the chunks as they were
    codec.decompress(t, out, "x");
    EXPECT_EQ(out, raw);
  }
  {
    auto t = codec.compress(raw, 4, "x");
    auto b = t.chunk_data(1);
    for (std::size_t i = b.size() - 4; i < b.size(); ++i) b[i] ^= std::byte{0xff};  // the content checksum
    expect_error(t, 1);
  }
  {
    auto t = codec.compress(raw, 4, "x");
    t.truncate_chunk(0, t.chunk_data(0).size() - 7);
    expect_error(t, 0);
  }
  {
    // The fuzzer's finding: the frame's checksum flag cleared, the checksum cut off and a content
    // byte changed decoded as a valid frame of other bytes. Incompressible bytes are stored as a
    // raw block, where a changed byte is nothing zstd's decoder itself could notice.
    const auto noise = data_of(raw.size(), 1, 7);
    auto t = codec.compress(noise, 4, "x");
    auto b = t.chunk_data(3);
    ASSERT_NE(b[4] & std::byte{0x04}, std::byte{0}) << "chunks are written with a content checksum";
    b[4] ^= std::byte{0x04};
    b[b.size() / 2] ^= std::byte{0x11};
    t.truncate_chunk(3, b.size() - 4);
    expect_error(t, 3);
  }
  {
    auto t = codec.compress(raw, 4, "x");
    t.truncate_chunk(4, 3);  // not even a frame header
    expect_error(t, 4);
  }
  auto t = codec.compress(raw, 4, "x");
  codec.decompress(t, out, "x");
  EXPECT_EQ(out, raw) << "an intact tensor still decodes";
}

// max_compressed_bytes bounds what incompressible data takes at any chunk size, and stays near the
// data's size for chunks of kilobytes and more; more workers than the machine's threads run as that many
// (an arena of 70,000 crashed TBB when the codec was destroyed).
TEST(ChunkCodec, TheBoundHoldsAndWorkersAreTheMachinesAtMost) {
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  for (const std::size_t chunk : {std::size_t{1}, std::size_t{16}, std::size_t{5000}, std::size_t{1} << 20}) {
    SCOPED_TRACE(::testing::Message() << "chunk " << chunk);
    const ChunkCodec codec(options(chunk, 70000));
    EXPECT_GT(codec.options().workers, 0u);
    EXPECT_LE(codec.options().workers, threads);
    const auto raw = data_of(chunk < 64 ? 4000 : 3'000'004, 1, 11);
    const auto t = codec.compress(raw, 4, "x");
    const std::uint64_t bound = ChunkCodec::max_compressed_bytes(raw.size(), 4, codec.options());
    EXPECT_LE(t.compressed_bytes(), bound);
    if (chunk >= 4096) {  // zstd's margin of a few dozen bytes a chunk, 1/256 of the data
      EXPECT_LE(bound, raw.size() + raw.size() / (chunk >= (1 << 20) ? 200 : 30))
          << "within 0.5% of the data (1 MiB chunks), 3.3% (5000-byte chunks)";
    } else {
      EXPECT_GT(t.compressed_bytes(), raw.size()) << "tiny chunks are larger than their data";
    }
    std::vector<std::byte> out(raw.size());
    codec.decompress(t, out, "x");
    EXPECT_EQ(out, raw);
  }
}

TEST(ChunkCodec, BadSettingsAndSizesAreClearErrors) {
  EXPECT_THROW(ChunkCodec(options(0, 0)), std::invalid_argument);
  EXPECT_THROW(ChunkCodec(options(4096, 0, 1000)), std::invalid_argument);
  try {
    offload::validate(options(0, 0));
    FAIL() << "chunk size 0 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("chunk size 0"), std::string::npos) << e.what();
  }
  const ChunkCodec codec(options(4096, 0));
  const auto raw = data_of(10, 1, 4);
  EXPECT_THROW(codec.compress(raw, 4, "x"), std::invalid_argument) << "10 bytes are not whole 4-byte elements";
  EXPECT_THROW(codec.compress(raw, 0, "x"), std::invalid_argument) << "elements of no bytes";
  const auto t = codec.compress(std::span(raw).first(8), 4, "x");
  std::vector<std::byte> wrong(12);
  EXPECT_THROW(codec.decompress(t, wrong, "x"), std::invalid_argument);
}

}  // namespace
}  // namespace ferry::test
