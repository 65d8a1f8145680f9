// The program cache's entry format: a checked header in front of a program binary. Kept apart
// from the cache itself so the reader can be tested and fuzzed without an OpenCL device.
#include <fmt/format.h>

#include <algorithm>
#include <iterator>

#include "cl/fnv1a.hpp"
#include "ferry/cl/program.hpp"

namespace ferry::cl {
namespace {

constexpr unsigned char entry_magic[8] = {'F', 'E', 'R', 'R', 'Y', 'P', 'C', 'B'};

void put_le(unsigned char* p, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

std::uint64_t get_le(const unsigned char* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= std::uint64_t{p[i]} << (8 * i);
  return v;
}

}  // namespace

std::vector<unsigned char> encode_cache_entry(std::uint64_t key, std::span<const unsigned char> binary) {
  std::vector<unsigned char> out(program_cache_header_bytes + binary.size());
  unsigned char* h = out.data();
  std::copy(std::begin(entry_magic), std::end(entry_magic), h);
  put_le(h + 8, program_cache_format, 4);
  put_le(h + 12, program_cache_header_bytes, 4);
  put_le(h + 16, key, 8);
  put_le(h + 24, binary.size(), 8);
  std::copy(binary.begin(), binary.end(), out.begin() + program_cache_header_bytes);
  const std::uint64_t sum = fnv1a(binary, fnv1a(std::span<const unsigned char>(h, 32)));
  put_le(h + 32, sum, 8);
  return out;
}

CacheEntryView decode_cache_entry(std::span<const unsigned char> entry, std::optional<std::uint64_t> key) {
  CacheEntryView v;
  const std::size_t n = entry.size();
  if (n < program_cache_header_bytes) {
    v.problem = fmt::format("truncated: {} bytes, shorter than the {}-byte header", n, program_cache_header_bytes);
    return v;
  }
  const unsigned char* h = entry.data();
  if (!std::equal(std::begin(entry_magic), std::end(entry_magic), h)) {
    v.problem = "no ferry program cache header: written by an older ferry or overwritten";
    return v;
  }
  if (const auto format = get_le(h + 8, 4); format != program_cache_format) {
    v.problem = fmt::format("format version {}, this ferry reads version {}", format, program_cache_format);
    return v;
  }
  if (const auto header = get_le(h + 12, 4); header != program_cache_header_bytes) {
    v.problem = fmt::format("header size {}, expected {}", header, program_cache_header_bytes);
    return v;
  }
  if (const auto payload = get_le(h + 24, 8); payload != n - program_cache_header_bytes) {
    v.problem = fmt::format("{}: {} bytes after the header, which announces a {}-byte program binary",
                            payload > n - program_cache_header_bytes ? "truncated" : "wrong size",
                            n - program_cache_header_bytes, payload);
    return v;
  }
  const std::span<const unsigned char> binary = entry.subspan(program_cache_header_bytes);
  if (fnv1a(binary, fnv1a(entry.first(32))) != get_le(h + 32, 8)) {
    v.problem = "checksum mismatch: the file was damaged";
    return v;
  }
  if (key && get_le(h + 16, 8) != *key) {
    v.problem = fmt::format("it holds the program of key {:016x}, not {:016x}", get_le(h + 16, 8), *key);
    return v;
  }
  if (binary.empty()) {
    v.problem = "empty program binary";
    return v;
  }
  v.binary = binary;
  return v;
}

}  // namespace ferry::cl
