// Ops of sequence models: embedding lookup, the causal (lower-triangular) attention mask and
// dropout with a counter-based mask (ops/kernels/sequence.cl).
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>

#include "ferry/ops/launch.hpp"

namespace ferry::ops {

// Embedding: y[n, d] = table[ids[n], d] for `positions` ids (i32) and a table [vocab, dim].
// An id outside [0, vocab) cannot be reported from a kernel: its row of y is written as zeros
// (nothing outside the table is read). Validate ids on the host before they reach the device.
LaunchList embedding_forward(OpEnv& env, DeviceSpan ids, DeviceSpan table, DeviceSpan y, std::size_t positions,
                             std::size_t vocab, std::size_t dim);
// dtable[v, d] = sum over the positions n with ids[n] == v of dy[n, d], in position order (one
// work-item per (v, d): deterministic, no atomics); dtable is overwritten. Out-of-range ids are
// skipped.
LaunchList embedding_backward(OpEnv& env, DeviceSpan ids, DeviceSpan dy, DeviceSpan dtable, std::size_t positions,
                              std::size_t vocab, std::size_t dim);

// Causal mask over `matrices` square [t, t] matrices: y[i, j] = x[i, j] for j <= i, -inf for
// j > i (a following softmax gives those 0).
LaunchList causal_mask_forward(OpEnv& env, DeviceSpan x, DeviceSpan y, std::size_t matrices, std::size_t t);
// dx[i, j] = dy[i, j] for j <= i, 0 for j > i.
LaunchList causal_mask_backward(OpEnv& env, DeviceSpan dy, DeviceSpan dx, std::size_t matrices, std::size_t t);

// Dropout: y = x * m / (1 - p) with m = dropout_keep(dropout_key(seed, s), s.step, i,
// dropout_threshold(p)) for the flat element index i and the StepInfo s at enqueue time (set per
// step), so every step draws a new mask, every micro-batch and rank of one update another, and the
// backward launch (same seed, same step) recomputes the forward's mask.
// Throws std::invalid_argument for p outside [0, 1).
LaunchList dropout_forward(OpEnv& env, DeviceSpan x, DeviceSpan y, std::size_t n, float p, std::uint32_t seed);
// dx = dy * m / (1 - p): the same kernel on the gradient.
LaunchList dropout_backward(OpEnv& env, DeviceSpan dy, DeviceSpan dx, std::size_t n, float p, std::uint32_t seed);

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"), bit-identical to
// the kernel's: counter (index lo, index hi, step lo, step hi), key (seed, 0).
inline std::array<std::uint32_t, 4> philox4x32_10(std::array<std::uint32_t, 4> c, std::array<std::uint32_t, 2> k) {
  constexpr std::uint32_t m0 = 0xD2511F53u, m1 = 0xCD9E8D57u, w0 = 0x9E3779B9u, w1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = std::uint64_t(m0) * c[0], p1 = std::uint64_t(m1) * c[2];
    const auto hi0 = std::uint32_t(p0 >> 32), lo0 = std::uint32_t(p0);
    const auto hi1 = std::uint32_t(p1 >> 32), lo1 = std::uint32_t(p1);
    c = {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
    k[0] += w0;
    k[1] += w1;
  }
  return c;
}

// The drop threshold of probability p: an element is dropped when its 32-bit draw is below it,
// so the kept fraction is 1 - threshold / 2^32. Throws std::invalid_argument unless 0 <= p < 1.
inline std::uint32_t dropout_threshold(float p) {
  if (!(p >= 0.0f && p < 1.0f)) {
    throw std::invalid_argument("dropout: p must be in [0, 1), got " + std::to_string(p));
  }
  return static_cast<std::uint32_t>(std::floor(double(p) * 4294967296.0));
}

// The Philox key of a dropout layer's draws in one step: the layer's seed, moved by the step's
// first sample (StepInfo::first_row) times an odd constant, so that the micro-batches and ranks of
// one update, whose element indices and step count are the same, draw independent masks. The
// layer's own seed where first_row is 0 (one rank, no accumulation).
inline std::uint32_t dropout_key(std::uint32_t seed, const StepInfo& s) {
  return seed + static_cast<std::uint32_t>(s.first_row) * 0x9E3779B9u;
}

// Makes `l` set its dropout arguments per step: a kernel that draws dropout masks takes the seed,
// threshold, scale, step_lo and step_hi as five arguments from `seed_arg` on; the seed becomes
// dropout_key(seed, s) and the step words s.step's.
void dropout_step_args(KernelLaunch& l, cl_uint seed_arg, std::uint32_t seed);

// Whether element `index` is kept at `step` (the mask bit m).
inline bool dropout_keep(std::uint32_t seed, std::uint64_t step, std::uint64_t index, std::uint32_t threshold) {
  const auto r = philox4x32_10(
      {std::uint32_t(index), std::uint32_t(index >> 32), std::uint32_t(step), std::uint32_t(step >> 32)}, {seed, 0u});
  return r[0] >= threshold;
}

namespace ref {

// Throws std::invalid_argument naming the position and the id for an id outside [0, vocab).
template <class T>
void embedding_forward(std::span<const std::int32_t> ids, std::span<const T> table, std::span<T> y, std::size_t vocab,
                       std::size_t dim) {
  for (std::size_t n = 0; n < ids.size(); ++n) {
    const std::int32_t id = ids[n];
    if (id < 0 || std::size_t(id) >= vocab) {
      throw std::invalid_argument("embedding: id " + std::to_string(id) + " at position " + std::to_string(n) +
                                  " is outside [0, " + std::to_string(vocab) + ")");
    }
    for (std::size_t d = 0; d < dim; ++d) y[n * dim + d] = table[std::size_t(id) * dim + d];
  }
}

// dtable (overwritten) = the dy rows summed per id, in position order. Throws as the forward.
template <class T>
void embedding_backward(std::span<const std::int32_t> ids, std::span<const T> dy, std::span<T> dtable,
                        std::size_t vocab, std::size_t dim) {
  for (std::size_t i = 0; i < vocab * dim; ++i) dtable[i] = T(0);
  for (std::size_t n = 0; n < ids.size(); ++n) {
    const std::int32_t id = ids[n];
    if (id < 0 || std::size_t(id) >= vocab) {
      throw std::invalid_argument("embedding: id " + std::to_string(id) + " at position " + std::to_string(n) +
                                  " is outside [0, " + std::to_string(vocab) + ")");
    }
    for (std::size_t d = 0; d < dim; ++d) dtable[std::size_t(id) * dim + d] += dy[n * dim + d];
  }
}

// x and y hold whole [t, t] matrices.
template <class T>
void causal_mask_forward(std::span<const T> x, std::span<T> y, std::size_t t) {
  for (std::size_t k = 0; k < x.size(); ++k) {
    const std::size_t j = k % t, i = (k / t) % t;
    y[k] = j > i ? -std::numeric_limits<T>::infinity() : x[k];
  }
}

template <class T>
void causal_mask_backward(std::span<const T> dy, std::span<T> dx, std::size_t t) {
  for (std::size_t k = 0; k < dy.size(); ++k) {
    const std::size_t j = k % t, i = (k / t) % t;
    dx[k] = j > i ? T(0) : dy[k];
  }
}

// The same mask as the kernel, bit for bit; the scale is 1 / (1 - p) in T.
template <class T>
void dropout_forward(std::span<const T> x, std::span<T> y, float p, std::uint32_t seed, std::uint64_t step) {
  const std::uint32_t threshold = dropout_threshold(p);
  const T scale = T(1) / (T(1) - T(p));
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = dropout_keep(seed, step, i, threshold) ? x[i] * scale : T(0);
}

template <class T>
void dropout_backward(std::span<const T> dy, std::span<T> dx, float p, std::uint32_t seed, std::uint64_t step) {
  dropout_forward<T>(dy, dx, p, seed, step);
}

}  // namespace ref
}  // namespace ferry::ops
