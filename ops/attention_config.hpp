// The fused attention's kernel choice as text: "cpu RB=n QB=n KB=n PASS=n LT=n", "tiled BQ=n BK=n",
// "blocked TQ=n TK=n [RR=n]" or "gemm [MIB=n]" (AttentionOptions::kernel, FERRY_ATTENTION_KERNEL,
// the attention tuner's candidates and its cache). Private to ops/; no OpenCL calls, so the fuzz
// target `attention_config` builds the parser alone.
#pragma once

#include <cstddef>
#include <string>

#include "ops/attention_gemm.hpp"

namespace ferry::ops {

// The kernel family: cpu (ops/kernels/attention.cl's CPU kernels), tiled (its GPU ones), blocked
// (attention_blocked.cl) or gemm (ops/attention_gemm.hpp).
enum class AttentionFamily { cpu, tiled, blocked, gemm };

struct AttentionConfig {
  AttentionFamily family = AttentionFamily::cpu;
  std::size_t rb = 6, qb = 48;   // cpu: query rows per register tile (at most 8), per work-item
  std::size_t kb = 64;           // cpu forward: keys per online-softmax block (a multiple of 16)
  std::size_t pass = 0;          // cpu backward: 1 (a work-item per head) or 2 (dk dv, then dq); 0: by heads
  std::size_t lt = 4096;         // cpu: contexts up to LT stage each head in local memory where it fits (0: never)
  std::size_t bq = 64, bk = 32;  // tiled: queries (keys) per work-group, keys (queries) per local tile
  std::size_t tq = 64, tk = 32;  // blocked: queries and keys per tile, before fitting to local memory
  std::size_t rr = 0;            // blocked: registers per work-item (NVIDIA's cap; 0: the compiler's choice)
  std::size_t mib = attention_gemm_default_mib;  // gemm: MiB of scores a chunk of heads holds

  bool cpu() const { return family == AttentionFamily::cpu; }
  // The family and its parameters, as parse_attention_config reads them back.
  std::string text() const;
  bool operator==(const AttentionConfig&) const = default;
};

// Parses a kernel choice; parameters not given keep the defaults above. Throws
// std::invalid_argument naming the text and what is wrong: an unknown family, a parameter another
// family takes or given twice, a value that is not a whole number in range (1..256; PASS 0..2,
// RR 16..255, LT 0..65536), tiles the kernels have no build for.
AttentionConfig parse_attention_config(const std::string& spec);

}  // namespace ferry::ops
