// The fused attention's kernel choice as text (ops/attention_config.hpp).
#include "ops/attention_config.hpp"

#include <fmt/format.h>

#include <charconv>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string_view>

namespace ferry::ops {

std::string AttentionConfig::text() const {
  switch (family) {
    case AttentionFamily::cpu:
      return fmt::format("cpu RB={} QB={} KB={} PASS={} LT={}", rb, qb, kb, pass, lt);
    case AttentionFamily::tiled:
      return fmt::format("tiled BQ={} BK={}", bq, bk);
    case AttentionFamily::gemm:
      return mib == attention_gemm_default_mib ? std::string("gemm") : fmt::format("gemm MIB={}", mib);
    case AttentionFamily::blocked:
      break;
  }
  return fmt::format("blocked TQ={} TK={}", tq, tk) + (rr ? fmt::format(" RR={}", rr) : "");
}

AttentionConfig parse_attention_config(const std::string& spec) {
  std::istringstream in(spec);
  std::string family;
  in >> family;
  AttentionConfig c;
  if (family == "cpu") {
    c.family = AttentionFamily::cpu;
  } else if (family == "tiled") {
    c.family = AttentionFamily::tiled;
  } else if (family == "blocked") {
    c.family = AttentionFamily::blocked;
  } else if (family == "gemm") {
    c.family = AttentionFamily::gemm;
  } else {
    throw std::invalid_argument(fmt::format(
        "attention: unknown kernel '{}' (expected \"cpu RB=n QB=n KB=n PASS=0|1|2 LT=n\", \"tiled BQ=n BK=n\", "
        "\"blocked TQ=n TK=n [RR=n]\" or \"gemm [MIB=n]\")",
        spec));
  }
  std::set<std::string> given;
  for (std::string kv; in >> kv;) {
    const std::size_t eq = kv.find('=');
    const std::string key = kv.substr(0, eq);
    // The whole value must be a number: "TQ=16x" or "RB=6=7" is a typo, not 16 or 6.
    std::size_t value = 0;
    const std::string_view digits = eq == std::string::npos ? std::string_view() : std::string_view(kv).substr(eq + 1);
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
    const bool number = !digits.empty() && ec == std::errc() && end == digits.data() + digits.size();
    const bool pass = c.family == AttentionFamily::cpu && key == "PASS";
    const bool lt = c.family == AttentionFamily::cpu && key == "LT";  // a context: 0 (never) and up
    if (!number || value > (lt ? 65536 : 256) || (value == 0 && !pass && !lt)) {
      throw std::invalid_argument(fmt::format("attention: kernel parameter '{}' in '{}' needs a whole number in {}", kv,
                                              spec,
                                              pass ? "0..2"
                                              : lt ? "0..65536"
                                                   : "1..256"));
    }
    if (!given.insert(key).second) {
      throw std::invalid_argument(fmt::format("attention: parameter {} is given twice in '{}'", key, spec));
    }
    const bool cpu = c.family == AttentionFamily::cpu, tiled = c.family == AttentionFamily::tiled,
               blocked = c.family == AttentionFamily::blocked;
    if (cpu && key == "RB") {
      c.rb = value;
    } else if (cpu && key == "QB") {
      c.qb = value;
    } else if (cpu && key == "KB") {
      c.kb = value;
    } else if (pass) {
      if (value > 2) {
        throw std::invalid_argument(fmt::format(
            "attention: '{}' in '{}': PASS is 1 (a work-item per head), 2 (dk dv, then dq) or 0 (by heads)", kv, spec));
      }
      c.pass = value;
    } else if (lt) {
      c.lt = value;
    } else if (tiled && key == "BQ") {
      c.bq = value;
    } else if (tiled && key == "BK") {
      c.bk = value;
    } else if (blocked && key == "TQ") {
      c.tq = value;
    } else if (blocked && key == "TK") {
      c.tk = value;
    } else if (c.family == AttentionFamily::gemm && key == "MIB") {
      c.mib = value;
    } else if (blocked && key == "RR") {
      if (value < 16 || value > 255) {
        throw std::invalid_argument(
            fmt::format("attention: '{}' in '{}': a register cap is 16..255 registers per work-item", kv, spec));
      }
      c.rr = value;
    } else {
      throw std::invalid_argument(
          fmt::format("attention: '{}' is not a parameter of the {} kernel (in '{}')", key, family, spec));
    }
  }
  if (c.cpu() && (c.rb > 8 || c.qb % c.rb != 0 || c.kb % 16 != 0)) {
    throw std::invalid_argument(fmt::format(
        "attention: '{}': RB (rows per register tile) is at most 8, QB a multiple of it and KB a multiple of 16",
        spec));
  }
  // The tiled forward takes a tile's keys 8 at a time: another BK read past the tile in local
  // memory and counted keys of the next tile twice (wrong attention, no error).
  if (c.family == AttentionFamily::tiled && c.bk % 8 != 0) {
    throw std::invalid_argument(fmt::format(
        "attention: '{}': BK (keys per tile) is a multiple of 8 (the forward reads a tile's keys 8 at a time)", spec));
  }
  auto tile = [](std::size_t t) { return t >= 4 && t <= 64 && (t & (t - 1)) == 0; };
  if (c.family == AttentionFamily::blocked && (!tile(c.tq) || !tile(c.tk))) {
    throw std::invalid_argument(
        fmt::format("attention: '{}': TQ and TK (queries and keys per tile) are 4, 8, 16, 32 or 64", spec));
  }
  return c;
}

}  // namespace ferry::ops
