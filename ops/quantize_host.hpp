// Conversions of tensors in host memory for the host lane, on all cores: int8 quantization (a
// streamed weight quantized before it crosses the link) and casts among f32, f16 and bf16 (a weight
// narrowed before its fetch, a narrow gradient widened after its write-back): the bits of the
// references (ref::quantize_i8, ref::cast) and of the kernels.
#pragma once

#include <cstdint>
#include <span>

#include "ferry/ops/cast.hpp"

namespace ferry::ops {

// ref::quantize_i8's result (the same checks and errors), in parallel: the channels' absmax over
// blocks of rows, then the elements row by row, without a division per element to find a channel.
void quantize_i8_host(std::span<const float> x, QuantLayout layout, std::span<std::int8_t> q, std::span<float> scales);

// ref::cast(from, to, in, out, n, factor) (the same checks and errors), in blocks on the TBB workers.
void cast_host(DType from, DType to, const void* in, void* out, std::size_t n, float factor = 1.0f);

}  // namespace ferry::ops
