// Byte sizes as people write them ("64MiB", "1.5GiB", "256MB", "4096"), and durations ("0:02:05").
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
// The same, rounded up at the digit shown: for a minimum that, given back, is enough ("16.1 MiB"
// for a byte over 16 MiB, where format_bytes says "16.0 MiB").
std::string format_bytes_up(std::uint64_t bytes);

// "h:mm:ss", whole seconds (negative: 0).
std::string format_duration(double seconds);

}  // namespace ferry
