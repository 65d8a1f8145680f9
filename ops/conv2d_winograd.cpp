// Winograd convolution on CPU devices: plan, transforms and launches (kernels in
// ops/kernels/conv2d_winograd.cl, which describes the algorithm and the layouts).
//
// Tile size: alpha = m + r - 1 = 6 for both kernel sizes, F(2x2, 5x5) and F(4x4, 3x3): 36
// products per tile and channel pair, 2.8x and 4x fewer multiply-adds than the direct sum, with
// transforms whose entries stay small (points 0, +-1, +-2). The work-item's register block is
// TB tiles x NVK float16 of output channels, TB * NVK = 24 accumulators as in the packed GEMM.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string_view>

#include "conv2d_internal.hpp"
#include "ferry/ops/gemm.hpp"

namespace ferry::ops {

WinogradTransform winograd_transform(std::size_t m, std::size_t r) {
  if (m < 2 || r < 2 || m + r - 1 > 6) {
    throw std::invalid_argument(
        fmt::format("winograd_transform: F({}, {}) is not supported: m and r at least 2, m + r - 1 at most 6", m, r));
  }
  const std::size_t a = m + r - 1;
  constexpr double kPoints[] = {0, 1, -1, 2, -2};
  // V evaluates a polynomial of degree alpha - 1 at the points and takes its leading coefficient
  // ("at infinity"); B^T = (V^-1)^T interpolates the product back, transposed for correlation.
  std::vector<double> V(a * a, 0.0), inv(a * a, 0.0);
  for (std::size_t j = 0; j + 1 < a; ++j) {
    for (std::size_t l = 0; l < a; ++l) V[j * a + l] = std::pow(kPoints[j], double(l));
  }
  V[(a - 1) * a + (a - 1)] = 1.0;
  for (std::size_t i = 0; i < a; ++i) inv[i * a + i] = 1.0;
  for (std::size_t col = 0; col < a; ++col) {  // Gauss-Jordan, partial pivoting
    std::size_t piv = col;
    for (std::size_t i = col + 1; i < a; ++i) {
      if (std::abs(V[i * a + col]) > std::abs(V[piv * a + col])) piv = i;
    }
    for (std::size_t l = 0; l < a; ++l) {
      std::swap(V[col * a + l], V[piv * a + l]);
      std::swap(inv[col * a + l], inv[piv * a + l]);
    }
    const double d = V[col * a + col];
    for (std::size_t l = 0; l < a; ++l) {
      V[col * a + l] /= d;
      inv[col * a + l] /= d;
    }
    for (std::size_t i = 0; i < a; ++i) {
      if (i == col) continue;
      const double f = V[i * a + col];
      for (std::size_t l = 0; l < a; ++l) {
        V[i * a + l] -= f * V[col * a + l];
        inv[i * a + l] -= f * inv[col * a + l];
      }
    }
  }
  WinogradTransform t{m, r, a, std::vector<double>(m * a, 0.0), std::vector<double>(a * a), std::vector<double>(a * r)};
  for (std::size_t i = 0; i < a; ++i) {
    for (std::size_t j = 0; j < a; ++j) t.BT[i * a + j] = inv[j * a + i];
  }
  for (std::size_t j = 0; j < a; ++j) {
    for (std::size_t k = 0; k < r; ++k) t.G[j * r + k] = j + 1 < a ? std::pow(kPoints[j], double(k)) : k + 1 == r;
    for (std::size_t i = 0; i < m; ++i) t.AT[i * a + j] = j + 1 < a ? std::pow(kPoints[j], double(i)) : i + 1 == m;
  }
  // Each row of B^T scaled to small integers, its G row by the inverse: the input transform (run
  // on every tile) is then exact in float, and only the filter transform rounds.
  for (std::size_t i = 0; i < a; ++i) {
    double smallest = 0.0;
    for (std::size_t j = 0; j < a; ++j) {
      const double v = std::abs(t.BT[i * a + j]);
      if (v > 1e-12 && (smallest == 0.0 || v < smallest)) smallest = v;
    }
    for (double k = 1; k <= 64; ++k) {
      bool integral = true;
      for (std::size_t j = 0; j < a; ++j) {
        const double v = t.BT[i * a + j] / smallest * k;
        integral = integral && std::abs(v - std::round(v)) < 1e-9;
      }
      if (!integral) continue;
      const double scale = k / smallest;
      for (std::size_t j = 0; j < a; ++j) t.BT[i * a + j] = std::round(t.BT[i * a + j] * scale);
      for (std::size_t j = 0; j < r; ++j) t.G[i * r + j] /= scale;
      break;
    }
  }
  return t;
}

namespace winograd {
namespace {

constexpr std::size_t kAlpha = 6;
constexpr std::size_t kAccumulators = 24;  // at most TB * NVK float16 accumulators per work-item
// At most 6 tiles per work-item: with 12 (for 32 output channels) the tiles' transforms (36 x TB x 32
// floats) left the L1 cache and the kernel was no faster (`ferry-bench conv --breakdown`).
constexpr std::size_t kMaxTiles = 6;
// Input channels per pass: every pass folds its 36 products into the outputs again, and one pass
// of 64 channels ran the CNN's data gradient (64 -> 32 channels) in 3.5 ms where two of 32 took
// 4.0-4.4 (its transforms, 36 x 6 x 64 floats, then outgrow the L1 cache, but the fold costs more).
constexpr std::size_t kMaxPassChannels = 64;
constexpr std::size_t kAlignElems = 16;

struct Plan {
  std::size_t m = 0, r = 0;
  std::size_t TR = 0, TQ = 0, HT = 0, WT = 0;  // tiles per column and row; xt's rows and columns
  std::size_t CC = 0, CP = 0;                  // channels per pass, padded input channels
  std::size_t NVK = 0, KB = 0, KP = 0;         // float16 of output channels, their count, padded K
  std::size_t TB = 0, tiles = 0, blocks = 0;   // tiles per work-item, in all, work-items per K block
  std::size_t xt_elems = 0, u_offset = 0, u_elems = 0;
};

Plan plan(const Conv2dShape& s) {
  Plan p;
  p.r = s.R;
  p.m = kAlpha + 1 - s.R;
  p.TR = (s.P() + p.m - 1) / p.m;
  p.TQ = (s.Q() + p.m - 1) / p.m;
  p.HT = p.TR * p.m + p.r - 1;
  p.WT = p.TQ * p.m + p.r - 1;
  const std::size_t passes = (s.C + kMaxPassChannels - 1) / kMaxPassChannels;
  p.CC = round_up((s.C + passes - 1) / passes, 16);
  p.CP = p.CC * passes;
  p.NVK = std::min<std::size_t>(4, (s.K + 15) / 16);
  p.KB = 16 * p.NVK;
  p.KP = round_up(s.K, p.KB);
  p.tiles = s.N * p.TR * p.TQ;
  p.TB = std::clamp<std::size_t>(std::min(kMaxTiles, kAccumulators / p.NVK), 1, p.tiles);
  p.blocks = (p.tiles + p.TB - 1) / p.TB;
  p.xt_elems = s.N * p.HT * p.WT * p.CP;
  p.u_offset = round_up(p.xt_elems, kAlignElems);
  p.u_elems = kAlpha * kAlpha * p.CP * p.KP;
  if (p.xt_elems > std::size_t(std::numeric_limits<std::int32_t>::max()) ||
      p.tiles > std::numeric_limits<std::uint32_t>::max()) {
    throw std::invalid_argument(fmt::format(
        "conv2d: the Winograd layout of this layer ({} padded input elements, {} tiles) is over the 31-bit limit",
        p.xt_elems, p.tiles));
  }
  return p;
}

// "{v0,v1,...}" as float literals, for the kernel's __constant arrays.
std::string initializer(const std::vector<double>& v) {
  std::string out = "{";
  for (std::size_t i = 0; i < v.size(); ++i) out += fmt::format("{}{:.9e}f", i ? "," : "", v[i]);
  return out + "}";
}

std::string defines(const Conv2dShape& s, const Plan& p, DType t) {
  const WinogradTransform w = winograd_transform(p.m, p.r);
  return fmt::format(
      "{} -DWINO_M={} -DWINO_R={} -DWINO_A={} -DWINO_AT={} -DWINO_BT={} -DWINO_G={} -DWINO_TR={} -DWINO_TQ={} "
      "-DWINO_HT={} -DWINO_WT={} -DWINO_CP={} -DWINO_KP={} -DWINO_CC={} -DWINO_TB={} -DWINO_NVK={}",
      conv2d_defines(s, t), p.m, p.r, kAlpha, initializer(w.AT), initializer(w.BT), initializer(w.G), p.TR, p.TQ, p.HT,
      p.WT, p.CP, p.KP, p.CC, p.TB, p.NVK);
}

DeviceSpan at(DeviceSpan span, std::size_t elems) {
  return span.advanced(elems * sizeof(float));
}

// FERRY_CONV_WINOGRAD: unset, "auto" or "1" lets applies() decide; "0" turns Winograd off.
bool enabled_by_env() {
  const char* v = std::getenv("FERRY_CONV_WINOGRAD");
  if (v == nullptr || *v == '\0') return true;
  const std::string_view s(v);
  if (s == "0") return false;
  if (s == "1" || s == "auto") return true;
  throw std::runtime_error(fmt::format("FERRY_CONV_WINOGRAD='{}': expected 0 (off), 1 or auto", s));
}

}  // namespace

bool applies(OpEnv& env, const Conv2dShape& s) {
  return s.stride == 1 && s.R == s.S && (s.R == 3 || s.R == 5) && s.C >= 16 && s.K >= 16 && enabled_by_env() &&
         gemm_takes_planes(env);
}

std::string name(const Conv2dShape& s) {
  const std::size_t m = kAlpha + 1 - s.R;
  return fmt::format("winograd F({}x{},{}x{})", m, m, s.R, s.R);
}

std::size_t scratch_elems(const Conv2dShape& s) {
  const Plan p = plan(s);
  return p.u_offset + p.u_elems;
}

LaunchList forward(OpEnv& env, const Conv2dShape& s, DeviceSpan x, DeviceSpan w, DeviceSpan bias, DeviceSpan y,
                   DeviceSpan scratch) {
  const Plan p = plan(s);
  const DeviceSpan xt = at(scratch, 0), u = at(scratch, p.u_offset);
  LaunchList list;

  cl::Kernel pad = env.kernels.kernel("conv2d_winograd", "winograd_pad", defines(s, p, s.act));
  cl::set_args(pad.get(), x.buffer, x.elem_offset(dtype_bytes(s.act)), xt.buffer, xt.elem_offset(),
               static_cast<cl_uint>(s.N));
  KernelLaunch lp;
  lp.kernel = std::move(pad);
  lp.dims = 3;
  lp.global = {p.CP / 16, p.HT, s.N};
  lp.local = {1, 1, 1};
  list.push_back(std::move(lp));

  cl::Kernel filter = env.kernels.kernel("conv2d_winograd", "winograd_filter", defines(s, p, s.weight));
  cl::set_args(filter.get(), w.buffer, w.elem_offset(dtype_bytes(s.weight)), u.buffer, u.elem_offset());
  KernelLaunch lf;
  lf.kernel = std::move(filter);
  lf.dims = 2;
  lf.global = {p.KP, p.CP, 1};
  lf.local = {16, 1, 1};  // KP is a multiple of 16
  list.push_back(std::move(lf));

  cl::Kernel k = env.kernels.kernel("conv2d_winograd", "winograd_forward", defines(s, p, s.act));
  const cl_uint has_bias = bias.buffer != nullptr;
  cl::set_args(k.get(), xt.buffer, xt.elem_offset(), u.buffer, u.elem_offset(), has_bias ? bias.buffer : u.buffer,
               bias.elem_offset(), has_bias, y.buffer, y.elem_offset(dtype_bytes(s.act)),
               static_cast<cl_uint>(p.tiles));
  KernelLaunch lk;
  lk.kernel = std::move(k);
  lk.dims = 2;
  lk.global = {p.blocks, p.KP / p.KB, 1};
  lk.local = {1, 1, 1};
  list.push_back(std::move(lk));
  return list;
}

}  // namespace winograd
}  // namespace ferry::ops
