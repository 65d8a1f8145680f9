// The compressed home's codec: a tensor's bytes as fixed-size chunks, each byte-plane shuffled
// (all first bytes of the chunk's elements, then all second bytes, ...) and zstd-compressed with
// zstd's content checksum, so every chunk is verified when it is decompressed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace ferry::offload {

struct CodecOptions {
  std::size_t chunk_bytes = 1 << 20;  // uncompressed bytes per chunk (rounded down to whole elements, at least one)
  int level = 1;                      // zstd compression level
  // TBB workers that (de)compress one tensor's chunks at once; 0: all. More than the machine's
  // hardware threads run as that many (TBB ignores the rest, and an arena of tens of thousands
  // crashed it at exit).
  unsigned workers = 0;
};
// Throws std::invalid_argument saying what is wrong and what to use.
void validate(const CodecOptions& o);
// The smallest chunk `ferry train --compress-chunk` takes. Each chunk carries a zstd frame (header,
// block header, checksum: about 13 bytes) and an allocation of its own, so chunks of a few bytes
// held 4.25x the state they compress (1-byte chunks) and ran steps 14x slower. The codec itself
// takes any size (its tests use tiny chunks to reach every path).
inline constexpr std::size_t min_useful_chunk_bytes = 4096;

// A corrupt, truncated or undecodable chunk, or a zstd failure: names the tensor and the chunk.
class ChunkError : public std::runtime_error {
 public:
  ChunkError(const std::string& what, std::string tensor, std::size_t chunk)
      : std::runtime_error(what), tensor_(std::move(tensor)), chunk_(chunk) {}
  const std::string& tensor() const noexcept { return tensor_; }
  std::size_t chunk() const noexcept { return chunk_; }

 private:
  std::string tensor_;
  std::size_t chunk_;
};

// One tensor's value as compressed chunks (move-only; each chunk an exact-size allocation).
class CompressedTensor {
 public:
  std::uint64_t raw_bytes() const noexcept { return raw_bytes_; }
  std::uint64_t compressed_bytes() const noexcept;
  std::size_t chunk_count() const noexcept { return chunks_.size(); }
  std::size_t elem_bytes() const noexcept { return elem_bytes_; }
  // Test hooks (simulated corruption): a chunk's stored bytes, and cutting a chunk short.
  std::span<std::byte> chunk_data(std::size_t i);
  void truncate_chunk(std::size_t i, std::size_t new_size);

 private:
  friend class ChunkCodec;
  struct Chunk {
    std::unique_ptr<std::byte[]> data;
    std::size_t size = 0;
  };
  std::vector<Chunk> chunks_;
  std::uint64_t raw_bytes_ = 0;
  std::size_t elem_bytes_ = 1, chunk_raw_bytes_ = 0;
};

// Compresses and decompresses tensors in parallel over their chunks on TBB workers.
class ChunkCodec {
 public:
  explicit ChunkCodec(CodecOptions o = {});  // validates
  ~ChunkCodec();
  ChunkCodec(const ChunkCodec&) = delete;
  ChunkCodec& operator=(const ChunkCodec&) = delete;
  const CodecOptions& options() const noexcept { return options_; }
  // `src` holds elements of `elem_bytes`; its size must be a multiple of it. `what` names the
  // tensor in errors. Empty `src` gives no chunks.
  CompressedTensor compress(std::span<const std::byte> src, std::size_t elem_bytes, std::string_view what) const;
  // dst.size() must equal t.raw_bytes(). Throws ChunkError for a bad chunk (dst is then
  // unspecified; `t` is unchanged).
  void decompress(const CompressedTensor& t, std::span<std::byte> dst, std::string_view what) const;
  // The most host memory a tensor of `raw_bytes` (elements of `elem_bytes`) can take compressed with
  // `o`: each chunk at zstd's bound for its size (data that does not compress is stored with a frame
  // header, block headers and a checksum) plus its allocation's bookkeeping. With chunks of a few
  // bytes that is many times the data.
  static std::uint64_t max_compressed_bytes(std::uint64_t raw_bytes, std::size_t elem_bytes, const CodecOptions& o);

 private:
  struct Arena;
  CodecOptions options_;
  std::unique_ptr<Arena> arena_;
};

// Single-thread primitives (the benchmark times one core with them).
void shuffle_planes(const std::byte* src, std::byte* dst, std::size_t elems, std::size_t elem_bytes);
void unshuffle_planes(const std::byte* src, std::byte* dst, std::size_t elems, std::size_t elem_bytes);

}  // namespace ferry::offload
