// Fuzzes the compressed home's codec (offload/chunk_codec.cpp). The first two bytes choose the
// element size, the chunk size and how many damages follow; the damages (4 bytes each) are taken
// from the end and the bytes between are the tensor. What must hold:
//  - compress then decompress gives back every byte, in the chunk count the sizes imply;
//  - after damaging the compressed chunks (bytes flipped, chunks cut short) decompress either
//    throws ChunkError naming the tensor and a chunk that exists, or gives back every byte (a
//    damage that changed nothing zstd reads); it never returns other bytes, crashes or hangs;
//  - a destination of the wrong size is refused with std::invalid_argument.
#include "ferry/offload/chunk_codec.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "fuzz_support.hpp"

namespace {

using namespace ferry::offload;

using ferry::fuzz::check;

bool same(const std::vector<std::byte>& out, std::span<const std::byte> raw) {
  return out.size() == raw.size() && (raw.empty() || std::memcmp(out.data(), raw.data(), raw.size()) == 0);
}

constexpr std::size_t elem_sizes[] = {1, 2, 4, 8};
// Uncompressed bytes per chunk: one element (the codec's minimum), odd sizes, the default.
constexpr std::size_t chunk_sizes[] = {1, 3, 16, 64, 255, 1024, 4096, 1 << 20};
constexpr std::size_t damage_bytes = 4;

// One codec per chunk size, made on first use, single-threaded so that a finding replays the same way.
const ChunkCodec& codec(std::size_t size_index) {
  static std::unique_ptr<ChunkCodec> codecs[std::size(chunk_sizes)];
  std::unique_ptr<ChunkCodec>& c = codecs[size_index];
  if (!c)
    c = std::make_unique<ChunkCodec>(CodecOptions{.chunk_bytes = chunk_sizes[size_index], .level = 1, .workers = 1});
  return *c;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  const std::size_t elem = elem_sizes[data[0] & 3];
  const std::size_t size_index = (data[0] >> 2) & 7;
  const std::size_t chunk_bytes = chunk_sizes[size_index];
  std::size_t damages = data[1] & 15;
  data += 2;
  size -= 2;
  damages = std::min(damages, size / damage_bytes);
  const std::uint8_t* damage = data + size - damages * damage_bytes;
  const std::size_t raw_bytes = (size - damages * damage_bytes) / elem * elem;
  const std::span<const std::byte> raw(reinterpret_cast<const std::byte*>(data), raw_bytes);

  const ChunkCodec& c = codec(size_index);
  CompressedTensor t = c.compress(raw, elem, "fuzzed");
  check(t.raw_bytes() == raw_bytes && t.elem_bytes() == elem);
  const std::size_t per_chunk = std::max(chunk_bytes / elem, std::size_t{1}) * elem;
  check(t.chunk_count() == (raw_bytes + per_chunk - 1) / per_chunk);

  std::vector<std::byte> out(raw_bytes, std::byte{0xa5});
  c.decompress(t, out, "fuzzed");
  check(same(out, raw));

  if (raw_bytes > 0) {
    std::vector<std::byte> wrong(raw_bytes - 1 + 2 * (raw_bytes % 2));
    try {
      c.decompress(t, wrong, "fuzzed");
      std::abort();
    } catch (const std::invalid_argument&) {
    }
  }

  // Damage: chunk (byte 0), offset in it (bytes 1-2), then XOR it with byte 3, or with byte 3 = 0
  // cut the chunk short at that offset.
  if (t.chunk_count() == 0 || damages == 0) return 0;
  for (std::size_t d = 0; d < damages; ++d) {
    const std::uint8_t* op = damage + d * damage_bytes;
    const std::size_t chunk = op[0] % t.chunk_count();
    const std::span<std::byte> bytes = t.chunk_data(chunk);
    if (bytes.empty()) continue;
    const std::size_t at = (op[1] | std::size_t{op[2]} << 8) % bytes.size();
    if (op[3] == 0) {
      t.truncate_chunk(chunk, at);
    } else {
      bytes[at] ^= static_cast<std::byte>(op[3]);
    }
  }
  std::fill(out.begin(), out.end(), std::byte{0x5a});
  try {
    c.decompress(t, out, "fuzzed");
    check(same(out, raw));
  } catch (const ChunkError& e) {
    check(e.tensor() == "fuzzed" && e.chunk() < t.chunk_count());
    check(std::strstr(e.what(), "fuzzed") != nullptr);
  }
  return 0;
}
