// 64-bit FNV-1a: the one byte hash of ferry's cache keys and entries (program cache, GEMM tuning
// cache, the trainer's ranks agreement). Every step is a bijection of the state, so any single
// changed byte changes the hash. Not for adversarial input. Private to the library (every layer
// may use it: it is below them all).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

namespace ferry::cl {

inline constexpr std::uint64_t fnv1a_basis = 0xcbf29ce484222325ull;
inline constexpr std::uint64_t fnv1a_prime = 0x100000001b3ull;

// `bytes` hashed on from `h` (the basis to start; an earlier hash to continue).
constexpr std::uint64_t fnv1a(std::span<const unsigned char> bytes, std::uint64_t h = fnv1a_basis) noexcept {
  for (const unsigned char c : bytes) h = (h ^ c) * fnv1a_prime;
  return h;
}

constexpr std::uint64_t fnv1a(std::string_view s, std::uint64_t h = fnv1a_basis) noexcept {
  for (const char c : s) h = (h ^ static_cast<unsigned char>(c)) * fnv1a_prime;
  return h;
}

}  // namespace ferry::cl
