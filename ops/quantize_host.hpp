// int8 quantization of a tensor in host memory for the host lane (a streamed weight quantized
// before it crosses the link): the bits of ref::quantize_i8 and of the kernel, on all cores.
#pragma once

#include <cstdint>
#include <span>

#include "ferry/ops/cast.hpp"

namespace ferry::ops {

// ref::quantize_i8's result (the same checks and errors), in parallel: the channels' absmax over
// blocks of rows, then the elements row by row, without a division per element to find a channel.
void quantize_i8_host(std::span<const float> x, QuantLayout layout, std::span<std::int8_t> q, std::span<float> scales);

}  // namespace ferry::ops
