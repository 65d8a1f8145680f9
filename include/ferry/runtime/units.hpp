// Byte sizes as people write them: "64MiB", "1.5GiB", "256MB", "4096".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace ferry {

// Parses a byte size with an optional unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB; case-
// insensitive; K/M/G alone mean KiB/MiB/GiB). Throws std::invalid_argument saying what is wrong.
std::uint64_t parse_bytes(std::string_view text);

// "64.0 MiB"
std::string format_bytes(std::uint64_t bytes);

}  // namespace ferry
