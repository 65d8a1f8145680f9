// Byte-plane shuffle + zstd per chunk, chunks in parallel on TBB workers. Each worker thread
// keeps its zstd contexts and scratch buffers for its life, so a chunk allocates only its
// exact-size result.
#include "ferry/offload/chunk_codec.hpp"

#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>
#include <zstd.h>
#include <zstd_errors.h>

#include <algorithm>
#include <cstring>
#include <new>

namespace ferry::offload {

void validate(const CodecOptions& o) {
  if (o.chunk_bytes == 0) {
    throw std::invalid_argument("compressed home: chunk size 0: use a positive size such as 1 MiB");
  }
  if (o.level < ZSTD_minCLevel() || o.level > ZSTD_maxCLevel()) {
    throw std::invalid_argument(fmt::format("compressed home: zstd level {} is outside {}..{}: use 1 (fast) to 19",
                                            o.level, ZSTD_minCLevel(), ZSTD_maxCLevel()));
  }
}

std::uint64_t CompressedTensor::compressed_bytes() const noexcept {
  std::uint64_t b = 0;
  for (const Chunk& c : chunks_) b += c.size;
  return b;
}

std::span<std::byte> CompressedTensor::chunk_data(std::size_t i) {
  Chunk& c = chunks_.at(i);
  return {c.data.get(), c.size};
}

void CompressedTensor::truncate_chunk(std::size_t i, std::size_t new_size) {
  Chunk& c = chunks_.at(i);
  c.size = std::min(c.size, new_size);
}

namespace {

template <std::size_t E>
void shuffle_fixed(const std::byte* src, std::byte* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t b = 0; b < E; ++b) dst[b * n + i] = src[i * E + b];
  }
}

// Element size 8 (no ferry dtype today, but the codec takes it): plane by plane over blocks of
// 256 elements (2 KiB, in L1), about 1.5x the element-by-element loop, which GCC vectorises for
// sizes 2 and 4 only.
template <std::size_t E, std::size_t Block>
void shuffle_blocked(const std::byte* src, std::byte* dst, std::size_t n) {
  std::size_t first = 0;
  for (; first + Block <= n; first += Block) {
    for (std::size_t b = 0; b < E; ++b) {
      for (std::size_t i = 0; i < Block; ++i) dst[b * n + first + i] = src[(first + i) * E + b];
    }
  }
  for (std::size_t i = first; i < n; ++i) {
    for (std::size_t b = 0; b < E; ++b) dst[b * n + i] = src[i * E + b];
  }
}

template <std::size_t E>
void unshuffle_fixed(const std::byte* src, std::byte* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t b = 0; b < E; ++b) dst[i * E + b] = src[b * n + i];
  }
}

// The frame header descriptor follows the 4-byte magic number; its bit 2 says the frame ends in a
// content checksum (RFC 8878, 3.1.1.1.1). Read directly: the header parser is zstd's static-only API.
constexpr std::size_t frame_descriptor_offset = 4;
constexpr std::byte content_checksum_flag{0x04};

// Per worker thread: zstd contexts and scratch, kept for the thread's life.
struct Scratch {
  ZSTD_CCtx* cctx = nullptr;
  ZSTD_DCtx* dctx = nullptr;
  std::vector<std::byte> planes, out;
  ~Scratch() {
    ZSTD_freeCCtx(cctx);
    ZSTD_freeDCtx(dctx);
  }
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

std::string where(std::string_view tensor, std::size_t chunk, std::size_t count) {
  return fmt::format("tensor '{}', chunk {} of {}", tensor, chunk, count);
}

}  // namespace

void shuffle_planes(const std::byte* src, std::byte* dst, std::size_t elems, std::size_t elem_bytes) {
  switch (elem_bytes) {
    case 1:
      std::memcpy(dst, src, elems);
      return;
    case 2:
      return shuffle_fixed<2>(src, dst, elems);
    case 4:
      return shuffle_fixed<4>(src, dst, elems);
    case 8:
      return shuffle_blocked<8, 256>(src, dst, elems);
  }
  for (std::size_t i = 0; i < elems; ++i) {
    for (std::size_t b = 0; b < elem_bytes; ++b) dst[b * elems + i] = src[i * elem_bytes + b];
  }
}

void unshuffle_planes(const std::byte* src, std::byte* dst, std::size_t elems, std::size_t elem_bytes) {
  switch (elem_bytes) {
    case 1:
      std::memcpy(dst, src, elems);
      return;
    case 2:
      return unshuffle_fixed<2>(src, dst, elems);
    case 4:
      return unshuffle_fixed<4>(src, dst, elems);
    case 8:
      return unshuffle_fixed<8>(src, dst, elems);
  }
  for (std::size_t i = 0; i < elems; ++i) {
    for (std::size_t b = 0; b < elem_bytes; ++b) dst[i * elem_bytes + b] = src[b * elems + i];
  }
}

struct ChunkCodec::Arena {
  tbb::task_arena arena;
  explicit Arena(unsigned workers) : arena(static_cast<int>(workers)) {}
};

ChunkCodec::ChunkCodec(CodecOptions o) : options_(o) {
  validate(options_);
  const auto threads = static_cast<unsigned>(std::max(1, tbb::info::default_concurrency()));
  options_.workers = std::min(options_.workers, threads);
  if (options_.workers > 0) arena_ = std::make_unique<Arena>(options_.workers);
}

std::uint64_t ChunkCodec::max_compressed_bytes(std::uint64_t raw_bytes, std::size_t elem_bytes, const CodecOptions& o) {
  // A chunk's record and the allocator's header of its exact-size allocation (glibc: 16 bytes).
  constexpr std::uint64_t bookkeeping = sizeof(CompressedTensor::Chunk) + 16;
  const std::uint64_t elem = std::max<std::size_t>(1, elem_bytes);
  const std::uint64_t chunk = std::max<std::uint64_t>(1, o.chunk_bytes / elem) * elem;
  const std::uint64_t whole = raw_bytes / chunk, rest = raw_bytes % chunk;
  std::uint64_t bytes = whole * (ZSTD_compressBound(chunk) + bookkeeping);
  if (rest != 0) bytes += ZSTD_compressBound(rest) + bookkeeping;
  return bytes;
}

ChunkCodec::~ChunkCodec() = default;

namespace {

// Runs body(i) for every chunk i, in parallel, inside `arena` when there is one.
template <class Body>
void for_each_chunk(tbb::task_arena* arena, std::size_t count, const Body& body) {
  auto loop = [&] {
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, count, 1), [&](const tbb::blocked_range<std::size_t>& r) {
      for (std::size_t i = r.begin(); i != r.end(); ++i) body(i);
    });
  };
  if (count <= 1) {
    if (count == 1) body(0);
  } else if (arena) {
    arena->execute(loop);
  } else {
    loop();
  }
}

}  // namespace

CompressedTensor ChunkCodec::compress(std::span<const std::byte> src, std::size_t elem_bytes,
                                      std::string_view what) const {
  if (elem_bytes == 0 || src.size() % elem_bytes != 0) {
    throw std::invalid_argument(
        fmt::format("compressing '{}': {} bytes are not whole elements of {} bytes", what, src.size(), elem_bytes));
  }
  CompressedTensor t;
  t.raw_bytes_ = src.size();
  t.elem_bytes_ = elem_bytes;
  t.chunk_raw_bytes_ = std::max<std::size_t>(1, options_.chunk_bytes / elem_bytes) * elem_bytes;
  const std::size_t count = (src.size() + t.chunk_raw_bytes_ - 1) / t.chunk_raw_bytes_;
  try {
    t.chunks_.resize(count);
    for_each_chunk(arena_ ? &arena_->arena : nullptr, count, [&](std::size_t i) {
      const std::size_t begin = i * t.chunk_raw_bytes_;
      const std::size_t raw = std::min(t.chunk_raw_bytes_, src.size() - begin);
      Scratch& s = scratch();
      if (!s.cctx) {
        s.cctx = ZSTD_createCCtx();
        if (!s.cctx) throw std::bad_alloc();
      }
      auto zstd_failed = [&](std::size_t code) {
        if (ZSTD_getErrorCode(code) == ZSTD_error_memory_allocation) throw std::bad_alloc();
        return ChunkError(fmt::format("compressing {}: zstd: {}; the tensor keeps its previous value (report this "
                                      "with the zstd version, {})",
                                      where(what, i, count), ZSTD_getErrorName(code), ZSTD_versionString()),
                          std::string(what), i);
      };
      for (const auto& [param, value] :
           {std::pair{ZSTD_c_compressionLevel, options_.level}, std::pair{ZSTD_c_checksumFlag, 1}}) {
        const std::size_t rc = ZSTD_CCtx_setParameter(s.cctx, param, value);
        if (ZSTD_isError(rc)) throw zstd_failed(rc);
      }
      const std::byte* in = src.data() + begin;
      if (elem_bytes > 1) {
        s.planes.resize(raw);
        shuffle_planes(in, s.planes.data(), raw / elem_bytes, elem_bytes);
        in = s.planes.data();
      }
      s.out.resize(ZSTD_compressBound(raw));
      const std::size_t n = ZSTD_compress2(s.cctx, s.out.data(), s.out.size(), in, raw);
      if (ZSTD_isError(n)) throw zstd_failed(n);
      auto& chunk = t.chunks_[i];
      chunk.data = std::make_unique_for_overwrite<std::byte[]>(n);
      std::memcpy(chunk.data.get(), s.out.data(), n);
      chunk.size = n;
    });
  } catch (const std::bad_alloc&) {
    throw std::runtime_error(fmt::format(
        "out of host memory compressing '{}' ({} bytes): its previous value is kept; free host memory or use a "
        "home that needs less",
        what, src.size()));
  }
  return t;
}

void ChunkCodec::decompress(const CompressedTensor& t, std::span<std::byte> dst, std::string_view what) const {
  if (dst.size() != t.raw_bytes_) {
    throw std::invalid_argument(
        fmt::format("decompressing '{}': {} bytes asked for a tensor of {}", what, dst.size(), t.raw_bytes_));
  }
  const std::size_t count = t.chunks_.size();
  for_each_chunk(arena_ ? &arena_->arena : nullptr, count, [&](std::size_t i) {
    const std::size_t begin = i * t.chunk_raw_bytes_;
    const std::size_t raw = std::min<std::size_t>(t.chunk_raw_bytes_, t.raw_bytes_ - begin);
    const auto& chunk = t.chunks_[i];
    auto fail = [&](const std::string& why) -> ChunkError {
      return ChunkError(fmt::format("the compressed state is corrupt: {}: {}; restore it from a checkpoint",
                                    where(what, i, count), why),
                        std::string(what), i);
    };
    const unsigned long long declared = ZSTD_getFrameContentSize(chunk.data.get(), chunk.size);
    if (declared == ZSTD_CONTENTSIZE_ERROR || declared == ZSTD_CONTENTSIZE_UNKNOWN) {
      throw fail("its zstd frame header is unreadable");
    }
    if (declared != raw)
      throw fail(fmt::format("its frame header says {} bytes, the chunk should hold {}", declared, raw));
    // Every chunk was written as one frame with a content checksum. The flag that asks zstd to
    // verify it lies in the chunk's own bytes: a damage that clears it and cuts the checksum off
    // would let damaged content decode unchecked, so a frame without it is corrupt.
    if ((chunk.data[frame_descriptor_offset] & content_checksum_flag) == std::byte{0})
      throw fail("its zstd frame header lost the content checksum every chunk is written with");
    const std::size_t frame = ZSTD_findFrameCompressedSize(chunk.data.get(), chunk.size);
    if (ZSTD_isError(frame)) throw fail(fmt::format("zstd: {}", ZSTD_getErrorName(frame)));
    if (frame != chunk.size) throw fail(fmt::format("it holds {} bytes, its zstd frame {}", chunk.size, frame));
    Scratch& s = scratch();
    if (!s.dctx) {
      s.dctx = ZSTD_createDCtx();
      if (!s.dctx) throw std::bad_alloc();
    }
    std::byte* out = dst.data() + begin;
    if (t.elem_bytes_ > 1) {
      s.planes.resize(raw);
      out = s.planes.data();
    }
    const std::size_t n = ZSTD_decompressDCtx(s.dctx, out, raw, chunk.data.get(), chunk.size);
    if (ZSTD_isError(n)) {
      if (ZSTD_getErrorCode(n) == ZSTD_error_memory_allocation) throw std::bad_alloc();  // not the chunk's fault
      throw fail(fmt::format("zstd: {}", ZSTD_getErrorName(n)));
    }
    if (n != raw) throw fail(fmt::format("it decompressed to {} bytes, not {}", n, raw));
    if (t.elem_bytes_ > 1) unshuffle_planes(out, dst.data() + begin, raw / t.elem_bytes_, t.elem_bytes_);
  });
}

}  // namespace ferry::offload
