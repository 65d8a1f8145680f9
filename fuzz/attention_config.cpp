// Fuzzes the fused attention's kernel choice as text (ops/attention_config.cpp: the text of
// FERRY_ATTENTION_KERNEL, AttentionOptions::kernel, the attention tuner's cache lines). The bytes
// are the text. What must hold: parse_attention_config returns a configuration or throws
// std::invalid_argument naming the text, nothing else; a configuration's text names its family
// and parses back to the same configuration.
#include "ops/attention_config.hpp"

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "fuzz_support.hpp"

namespace {

using ferry::fuzz::check;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string spec(reinterpret_cast<const char*>(data), size);
  ferry::ops::AttentionConfig c;
  try {
    c = ferry::ops::parse_attention_config(spec);
  } catch (const std::invalid_argument& e) {
    check(std::string(e.what()).find("attention") != std::string::npos);
    return 0;
  }
  const std::string text = c.text();
  const char* names[] = {"cpu", "tiled", "blocked", "gemm"};
  check(text.starts_with(names[static_cast<int>(c.family)]));
  check(ferry::ops::parse_attention_config(text) == c);
  return 0;
}
