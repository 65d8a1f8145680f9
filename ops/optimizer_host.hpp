// Optimizer updates on the host, for weights whose home is host memory (ZeRO-Offload's CPU Adam
// idea): only the weights go to the device and only their gradients come back; the optimizer
// state never crosses the link.
//
// In place (one host copy of streamed state, after the step's commit point) or out of place (two
// copies: it reads one slot and writes the other, made current when the step commits): each
// element is read before it is written, so the slots may be the same memory. Runs in
// parallel over chunks on TBB workers; the same update as the device kernels, in fp32, with Adam's
// bias corrections applied as factors (one division an element instead of three): not
// bit-identical to the kernels, whose order of rounding differs.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ferry/ops/optimizer.hpp"
#include "ferry/ops/types.hpp"

namespace ferry::ops {

struct AdamSlots {
  const float* w_in;
  const float* m_in;
  const float* v_in;
  float* w_out;
  float* m_out;
  float* v_out;
};

struct SgdSlots {
  const float* w_in;
  const float* velocity_in;
  float* w_out;
  float* velocity_out;
};

// 8-bit state (adamw8bit): u8 codes of the moments and their block scales, [2, blocks] (the m
// scales, then the v scales).
struct Adam8bitSlots {
  const float* w_in;
  const std::uint8_t* m_in;
  const std::uint8_t* v_in;
  const float* scales_in;
  float* w_out;
  std::uint8_t* m_out;
  std::uint8_t* v_out;
  float* scales_out;
};

// The gradient an update reads: f32, or the f16 or bf16 copy a mixed-precision step writes back,
// widened (times `factor`, as ops::cast_host widens it) chunk by chunk as the update reads it, so
// the update is the one of its widened f32 copy, bit for bit, without that copy in host memory.
struct HostGradient {
  HostGradient(const float* f32) : data(f32) {}  // NOLINT(google-explicit-constructor): f32 is the plain case
  HostGradient(const void* narrow, DType type, float widen_by) : data(narrow), dtype(type), factor(widen_by) {}
  const void* data = nullptr;  // element 0 of the updated range
  DType dtype = DType::f32;
  float factor = 1.0f;
};

// What one update of n parameters reads and writes (its rate's numerator, host or device): Adam
// with fp32 moments reads w, g, m, v and writes w, m, v (28 bytes a parameter); 8-bit AdamW in
// blocks of `block` reads w, g and the two u8 moments and writes w and the moments (16 bytes a
// parameter), and reads and writes the blocks' two scales.
inline double adam_update_bytes(std::size_t n) {
  return 28.0 * static_cast<double>(n);
}
inline double adam8bit_update_bytes(std::size_t n, std::uint32_t block) {
  return 16.0 * static_cast<double>(n) + 2.0 * 2.0 * sizeof(float) * static_cast<double>(adam8bit_blocks(n, block));
}

// Each returns whether every weight it wrote is finite (the step's divergence guard).
bool host_adam_update(const AdamConfig& c, const StepInfo& step, HostGradient grad, AdamSlots s, std::size_t n);
bool host_sgd_update(const SgdConfig& c, const StepInfo& step, HostGradient grad, SgdSlots s, std::size_t n);
// adam8bit_update on the host (ops/optimizer.hpp): per block of `block` elements, the moments
// dequantized with the old scales, the Adam / AdamW update in fp32, the block's absmax as its new
// scale and the moments requantized to the nearest code (ops/quant_map.hpp), blocks in parallel.
bool host_adam8bit_update(const AdamConfig& c, std::uint32_t block, const StepInfo& step, HostGradient grad,
                          Adam8bitSlots s, std::size_t n);

}  // namespace ferry::ops
