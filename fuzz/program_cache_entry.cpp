// Fuzzes the program cache entry reader (cl::decode_cache_entry): any bytes, with and without an
// expected key, must give either a problem or a payload that lies inside the entry; and an entry
// the encoder writes must decode to its own payload.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <span>

#include "ferry/cl/program.hpp"
#include "fuzz_support.hpp"

namespace {

using ferry::fuzz::check;

void decode_checked(std::span<const unsigned char> entry, std::optional<std::uint64_t> key) {
  const auto v = ferry::cl::decode_cache_entry(entry, key);
  if (v.problem.empty()) {
    check(!v.binary.empty());
    check(v.binary.data() == entry.data() + ferry::cl::program_cache_header_bytes);
    check(v.binary.size() == entry.size() - ferry::cl::program_cache_header_bytes);
  } else {
    check(v.binary.empty());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const unsigned char> in(data, size);
  decode_checked(in, std::nullopt);
  std::uint64_t key = 0;
  for (std::size_t i = 0; i < 8 && i < size; ++i) key |= std::uint64_t{data[i]} << (8 * i);
  decode_checked(in, key);
  // The input as the payload of a well-formed entry: must decode to exactly that payload, and
  // any single flipped byte must be caught.
  auto entry = ferry::cl::encode_cache_entry(key, in);
  const auto v = ferry::cl::decode_cache_entry(entry, key);
  check(v.problem.empty() == !in.empty());
  if (!in.empty()) {
    check(std::equal(v.binary.begin(), v.binary.end(), in.begin(), in.end()));
    const std::size_t at = key % entry.size();
    entry[at] ^= static_cast<unsigned char>(1u << (key >> 61));
    check(!ferry::cl::decode_cache_entry(entry, key).problem.empty());
  }
  return 0;
}
