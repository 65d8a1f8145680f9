// 2-D convolution, NCHW activations and KCRS weights, square stride and zero padding.
//
// Implementation (ops/conv2d.cpp, ops/kernels/conv2d.cl): im2col + one GEMM per group of images.
// The batch is split into groups of G images (conv2d_images_per_gemm) so that the column matrix
// stays within a fixed budget; each group does im2col over all its images into one column matrix
// [C*R*S, G*P*Q], so the GEMM is as large as the budget allows (few big GEMMs run far better on
// PoCL than N small ones). Where the GEMM reads and writes NCHW itself (ferry's packed kernel,
// gemm_takes_planes) the long dimension G*P*Q or C*R*S is the GEMM's M, nothing is permuted and
// no column matrix is written for the forward and weight products: their A is gathered from a
// zero-padded copy of x through offset tables. Forward y^T = cols^T w^T stored straight to NCHW
// with the bias; backward weights dw^T = cols dy^T (dy packed from NCHW) stored transposed into
// dw, accumulated over the groups (beta = 1 after the first); backward data, for stride 1, a
// square kernel and at least 16 input channels, the forward of dy (padded by R-1-pad) with the
// flipped weight, otherwise dcols = w^T dy with dy packed from NCHW, then col2im gathers the
// column gradients per input element (deterministic, no atomics). Elsewhere (GPU kernels, CLBlast) the
// GEMM result [K, G*P*Q] is permuted to NCHW with the bias, and dy permuted to it for both
// backward products. dbias is a fixed-order reduction over N, P, Q. The first layer of an image
// model (at most 4 input channels, stride 1) runs forward and its weight gradient as direct
// kernels (conv2d_direct.cl) instead: there K = C*R*S is a few dozen, and the implicit GEMM's
// time went to scattered NCHW stores and to packing the whole output gradient. On AVX-512 class
// CPU devices a stride-1 3x3 or 5x5 layer with at least 16 input and output channels runs all three
// passes as Winograd convolutions instead (ops/conv2d_winograd.cpp; conv2d_algorithms says which).
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "ferry/ops/launch.hpp"
#include "ferry/ops/types.hpp"

namespace ferry::ops {

struct Conv2dShape {
  std::size_t N = 0, C = 0, H = 0, W = 0;  // input
  std::size_t K = 0, R = 0, S = 0;         // output channels, kernel height and width
  std::size_t stride = 1, pad = 0;
  // Storage types (f32, f16, bf16): of x, y and their gradients, and of the weight and its
  // gradient. Bias and its gradient are f32; the column matrices and products are fp32.
  DType act = DType::f32, weight = DType::f32;
  // Forward only: y = max(0, conv + bias), a ReLU fused into the epilogue (made by the graph's
  // fusion pass from conv2d -> relu; backward masks dy with y > 0 first). NaN gives 0, as the
  // ReLU does.
  bool relu = false;
  std::size_t P() const { return (H + 2 * pad - R) / stride + 1; }  // output height
  std::size_t Q() const { return (W + 2 * pad - S) / stride + 1; }  // output width
};

// Scratch in floats needed by the forward and both backward launches (the max of the three).
std::size_t conv2d_scratch_elems(OpEnv& env, const Conv2dShape& s);

// How each pass computes a shape on this device, for benchmarks and logs. Forward: "direct",
// "winograd F(2x2,5x5)" (or F(4x4,3x3)), "implicit GEMM (planes)" or "im2col GEMM"; data
// gradient: "forward of dy: <forward algorithm>" (stride 1, a square kernel, at least 16 input
// channels, on CPU devices), else "GEMM + col2im"; weight gradient: "direct", "winograd
// F(5x5,2x2)" (or F(3x3,4x4)), "implicit GEMM (planes)" or "im2col GEMM".
struct Conv2dAlgorithms {
  std::string forward, data_grad, weight_grad;
};
Conv2dAlgorithms conv2d_algorithms(OpEnv& env, const Conv2dShape& s);

// Winograd's minimal filtering F(m, r) with interpolation points 0, 1, -1, 2, -2 (as many as
// alpha - 1 = m + r - 2 needs) and infinity: the 1-D correlation y[i] = sum_j d[i + j] g[j]
// (i < m, j < r) is A^T [(G g) (.) (B^T d)], and the 2-D one A^T [(G g G^T) (.) (B^T d B)] A.
// Row-major, in double; each row of B^T is scaled to small integers (exact in float: the input
// transform, run on every tile, does not round) and its row of G by the inverse.
struct WinogradTransform {
  std::size_t m = 0, r = 0, alpha = 0;
  std::vector<double> AT;  // m x alpha
  std::vector<double> BT;  // alpha x alpha
  std::vector<double> G;   // alpha x r
};
// Throws std::invalid_argument unless 2 <= m, 2 <= r and alpha = m + r - 1 <= 6.
WinogradTransform winograd_transform(std::size_t m, std::size_t r);

// The most images one GEMM covers: the batch runs as balanced groups of at most this many images
// (through im2col: column matrix plus GEMM output within a fixed 16 MiB budget; with NCHW planes,
// where no column matrix exists, the packed output gradient within it). Depends only on the shape
// and the device's GEMM, so scratch sizing and binding always agree.
std::size_t conv2d_images_per_gemm(OpEnv& env, const Conv2dShape& s);

// y[N,K,P,Q] = conv(x, w) + bias[K] (bias optional: buffer null).
LaunchList conv2d_forward(OpEnv& env, const Conv2dShape& s, DeviceSpan x, DeviceSpan w, DeviceSpan bias, DeviceSpan y,
                          DeviceSpan scratch);
// dx[N,C,H,W] from dy and w (overwrites dx).
LaunchList conv2d_backward_data(OpEnv& env, const Conv2dShape& s, DeviceSpan dy, DeviceSpan w, DeviceSpan dx,
                                DeviceSpan scratch);
// dw[K,C,R,S] and dbias[K] (optional) from x and dy (overwrite).
LaunchList conv2d_backward_weights(OpEnv& env, const Conv2dShape& s, DeviceSpan x, DeviceSpan dy, DeviceSpan dw,
                                   DeviceSpan dbias, DeviceSpan scratch);

// CPU references (direct loops, no im2col), for tests; T is float or double.
namespace ref {

// Calls fn(y_index, x_index, w_index) for every output element and every kernel tap that falls
// inside the (unpadded) input, in the order n, k, p, q, c, r, t. The three rules below differ only
// in what they accumulate.
template <class Fn>
void for_each_tap(const Conv2dShape& s, Fn&& fn) {
  const std::size_t P = s.P(), Q = s.Q();
  for (std::size_t n = 0; n < s.N; ++n) {
    for (std::size_t k = 0; k < s.K; ++k) {
      for (std::size_t p = 0; p < P; ++p) {
        for (std::size_t q = 0; q < Q; ++q) {
          const std::size_t yi = ((n * s.K + k) * P + p) * Q + q;
          for (std::size_t c = 0; c < s.C; ++c) {
            for (std::size_t r = 0; r < s.R; ++r) {
              const std::ptrdiff_t h = std::ptrdiff_t(p * s.stride + r) - std::ptrdiff_t(s.pad);
              if (h < 0 || h >= std::ptrdiff_t(s.H)) continue;
              for (std::size_t t = 0; t < s.S; ++t) {
                const std::ptrdiff_t v = std::ptrdiff_t(q * s.stride + t) - std::ptrdiff_t(s.pad);
                if (v < 0 || v >= std::ptrdiff_t(s.W)) continue;
                fn(yi, ((n * s.C + c) * s.H + std::size_t(h)) * s.W + std::size_t(v),
                   ((k * s.C + c) * s.R + r) * s.S + t);
              }
            }
          }
        }
      }
    }
  }
}

// Index of the output channel of output element yi.
inline std::size_t output_channel(const Conv2dShape& s, std::size_t yi) {
  return yi / (s.P() * s.Q()) % s.K;
}

template <class T>
void conv2d_forward(const Conv2dShape& s, std::span<const T> x, std::span<const T> w, std::span<const T> bias,
                    std::span<T> y) {
  for (std::size_t yi = 0; yi < y.size(); ++yi) y[yi] = bias.empty() ? T(0) : bias[output_channel(s, yi)];
  for_each_tap(s, [&](std::size_t yi, std::size_t xi, std::size_t wi) { y[yi] += x[xi] * w[wi]; });
}

// dx = d(sum dy * y) / dx for y = conv2d_forward(x, w).
template <class T>
void conv2d_backward_data(const Conv2dShape& s, std::span<const T> dy, std::span<const T> w, std::span<T> dx) {
  for (auto& v : dx) v = T(0);
  for_each_tap(s, [&](std::size_t yi, std::size_t xi, std::size_t wi) { dx[xi] += dy[yi] * w[wi]; });
}

// dw and (if not empty) dbias for y = conv2d_forward(x, w, bias) and upstream gradient dy.
template <class T>
void conv2d_backward_weights(const Conv2dShape& s, std::span<const T> x, std::span<const T> dy, std::span<T> dw,
                             std::span<T> dbias) {
  for (auto& v : dw) v = T(0);
  for (auto& v : dbias) v = T(0);
  if (!dbias.empty()) {
    for (std::size_t yi = 0; yi < s.N * s.K * s.P() * s.Q(); ++yi) dbias[output_channel(s, yi)] += dy[yi];
  }
  for_each_tap(s, [&](std::size_t yi, std::size_t xi, std::size_t wi) { dw[wi] += dy[yi] * x[xi]; });
}

}  // namespace ref
}  // namespace ferry::ops
