// The host lane's int8 quantization (ops/quantize_host.hpp).
#include "quantize_host.hpp"

#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/enumerable_thread_specific.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "ops/host_clones.hpp"

namespace ferry::ops {
namespace {

// As ref::quantize_i8: 0 for a zero or non-finite scale and a value that is not finite, else the
// IEEE quotient rounded half to even and clamped. Clamped first, then rounded by adding and taking
// away 1.5 * 2^23 (exact rounding to nearest even below 2^22 in the default rounding mode): the same
// integer, and no call of nearbyint, so the loops vectorise.
std::int8_t quantize_one(float v, float s) {
  const std::uint32_t su = std::bit_cast<std::uint32_t>(s), vu = std::bit_cast<std::uint32_t>(v) & 0x7fffffffu;
  const bool valid = su != 0 && (su & 0x7fffffffu) < 0x7f800000u && vu < 0x7f800000u;
  constexpr float round_even = 0x1.8p23f;
  const float a = valid ? std::clamp(v / s, -127.0f, 127.0f) : 0.0f;
  return static_cast<std::int8_t>((a + round_even) - round_even);
}

constexpr std::size_t rows_per_task = 64;

}  // namespace

void quantize_i8_host(std::span<const float> x, QuantLayout l, std::span<std::int8_t> q, std::span<float> scales) {
  if (x.size() != l.elems() || q.size() != l.elems() || scales.size() != l.channels) {
    throw std::invalid_argument(
        fmt::format("quantize_i8 (host): x {}, q {}, scales {} elements for layout [{}, {}, {}]", x.size(), q.size(),
                    scales.size(), l.outer, l.channels, l.inner));
  }
  if (l.elems() == 0) return;
  // The kernels' [rows, cols] view (ops/kernels/cast.cl): with inner 1 a row holds one element of
  // every channel, otherwise a row is one channel's inner run.
  const bool by_column = l.inner == 1;
  const std::size_t cols = by_column ? l.channels : l.inner, rows = l.elems() / cols;
  const auto channel_of_row = [&](std::size_t row) { return row % l.channels; };

  // |x| as bits, NaN skipped: the largest pattern is the absmax whatever order the rows come in.
  tbb::enumerable_thread_specific<std::vector<std::uint32_t>> partial(
      [&] { return std::vector<std::uint32_t>(l.channels, 0); });
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, rows, rows_per_task), [&](const auto& r) {
    std::vector<std::uint32_t>& amax = partial.local();
    const auto take = [](std::uint32_t& m, float v) {
      const std::uint32_t a = std::bit_cast<std::uint32_t>(v) & 0x7fffffffu;
      m = std::max(m, a <= 0x7f800000u ? a : 0u);
    };
    for (std::size_t row = r.begin(); row < r.end(); ++row) {
      const float* in = x.data() + row * cols;
      if (by_column) {
        for (std::size_t j = 0; j < cols; ++j) take(amax[j], in[j]);
      } else {
        std::uint32_t& m = amax[channel_of_row(row)];
        for (std::size_t j = 0; j < cols; ++j) take(m, in[j]);
      }
    }
  });
  std::vector<std::uint32_t> amax(l.channels, 0);
  for (const auto& p : partial) {
    for (std::size_t c = 0; c < l.channels; ++c) amax[c] = std::max(amax[c], p[c]);
  }
  for (std::size_t c = 0; c < l.channels; ++c) scales[c] = std::bit_cast<float>(amax[c]) / 127.0f;

  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, rows, rows_per_task), [&](const auto& r) {
    for (std::size_t row = r.begin(); row < r.end(); ++row) {
      // int8_t may alias anything: without __restrict the compiler must assume each store can
      // change the floats it reads, and does not vectorise the loops.
      const float* __restrict in = x.data() + row * cols;
      const float* __restrict scale = scales.data();
      std::int8_t* __restrict out = q.data() + row * cols;
      if (by_column) {
        for (std::size_t j = 0; j < cols; ++j) out[j] = quantize_one(in[j], scale[j]);
      } else {
        const float s = scale[channel_of_row(row)];
        for (std::size_t j = 0; j < cols; ++j) out[j] = quantize_one(in[j], s);
      }
    }
  });
}

namespace {

// The widening of a narrow gradient and the narrowing of a weight: ref::cast's conversions
// (written without branches) in loops that vectorise, not through its per-element type switch. A
// factor of 1 multiplies nothing (a product would quiet a signalling NaN).
FERRY_HOST_CLONES void widen(DType from, const std::uint16_t* in, float* out, std::size_t n, float factor) {
  if (from == DType::f16) {
    for (std::size_t i = 0; i < n; ++i) out[i] = ref::half_to_float(in[i]);
  } else {
    for (std::size_t i = 0; i < n; ++i) out[i] = ref::bf16_to_float(in[i]);
  }
  if (factor != 1.0f) {
    for (std::size_t i = 0; i < n; ++i) out[i] *= factor;
  }
}

FERRY_HOST_CLONES void narrow(DType to, const float* in, std::uint16_t* out, std::size_t n) {
  if (to == DType::f16) {
    for (std::size_t i = 0; i < n; ++i) out[i] = ref::float_to_half(in[i]);
  } else {
    for (std::size_t i = 0; i < n; ++i) out[i] = ref::float_to_bf16(in[i]);
  }
}

// One block: the loops above where they apply, else the reference.
void cast_block(DType from, DType to, const std::byte* in, std::byte* out, std::size_t n, float factor) {
  const bool narrow_in = from == DType::f16 || from == DType::bf16;
  if (narrow_in && to == DType::f32) {
    widen(from, reinterpret_cast<const std::uint16_t*>(in), reinterpret_cast<float*>(out), n, factor);
  } else if (from == DType::f32 && (to == DType::bf16 || to == DType::f16) && factor == 1.0f) {
    narrow(to, reinterpret_cast<const float*>(in), reinterpret_cast<std::uint16_t*>(out), n);
  } else {
    ref::cast(from, to, in, out, n, factor);
  }
}

}  // namespace

void cast_host(DType from, DType to, const void* in, void* out, std::size_t n, float factor) {
  // Blocks of 64K elements on the TBB workers, each converting as the reference does.
  constexpr std::size_t block = std::size_t{1} << 16;
  const std::size_t in_size = dtype_bytes(from), out_size = dtype_bytes(to);
  ref::cast(from, to, in, out, 0, factor);  // the pair refused here, not inside a task
  const auto* src = static_cast<const std::byte*>(in);
  auto* dst = static_cast<std::byte*>(out);
  if (n <= block) return cast_block(from, to, src, dst, n, factor);
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, block), [&](const tbb::blocked_range<std::size_t>& r) {
    cast_block(from, to, src + r.begin() * in_size, dst + r.begin() * out_size, r.size(), factor);
  });
}

}  // namespace ferry::ops
