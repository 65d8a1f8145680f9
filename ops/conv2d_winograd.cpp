// Winograd convolution on CPU devices: plan, transforms and launches (kernels in
// ops/kernels/conv2d_winograd.cl, which describes the algorithm and the layouts).
//
// Tile size: alpha = m + r - 1 = 6 for both kernel sizes, F(2x2, 5x5) and F(4x4, 3x3): 36
// products per tile and channel pair, 2.8x and 4x fewer multiply-adds than the direct sum, with
// transforms whose entries stay small (points 0, +-1, +-2). The work-item's register block is
// TB tiles x NVK float16 of output channels, TB * NVK accumulators as in the packed GEMM's block
// of the device's tuning row (24 on AVX-512, 6 on AVX2); a work-item may take several such blocks
// of output channels, one after another over the same transformed windows.
// The weight gradient runs on the same tiles: partial sums of the 36 products per chunk of tiles
// (4 x NVK float16 accumulators over 8 tiles at a time), then one pass adds the chunks in order
// and applies the output transform.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string_view>

#include "cl/env_switch.hpp"
#include "conv2d_internal.hpp"
#include "gemm_tuning.hpp"
#include "ops/gemm.hpp"

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
// At most 6 tiles per work-item: with 12 (for 32 output channels) the tiles' transforms (36 x TB x 32
// floats) left the L1 cache and the kernel was no faster (`ferry-bench conv --breakdown`).
constexpr std::size_t kMaxTiles = 6;
// Input channels per pass: every pass folds its 36 products into the outputs again, and one pass
// of 64 channels ran the CNN's data gradient (64 -> 32 channels) in 3.5 ms where two of 32 took
// 4.0-4.4 (its transforms, 36 x 6 x 64 floats, then outgrow the L1 cache, but the fold costs more).
constexpr std::size_t kMaxPassChannels = 64;
// Floats of output sums a forward work-item keeps (16 KiB): with a narrow register block (AVX2's
// one float16 of channels) a work-item takes several blocks of channels, so that each tile's
// window is transformed once, not once per block: the CNN's conv2 forward 14.4 -> 10 ms on AVX2.
constexpr std::size_t kOutputSumElems = 4096;
constexpr std::size_t kAlignElems = 16;

// Tiles of the weight gradient per group (its transforms, 36 x TB x (CC + KB) floats, in private
// memory; 4 and 16 were slower on the CNN's conv2) and work-items per compute unit (each sums a
// chunk of the tiles into partial sums of its own, added in order afterwards).
constexpr std::size_t kWeightTiles = 8;
constexpr std::size_t kWeightChunksPerUnit = 4;
// Floats the weight gradient's partial sums may take (16 MiB): wide layers (36 x C x K floats per
// chunk, 38 MB for 512 -> 512 channels) run as one chunk, their work-items split by channel
// blocks instead.
constexpr std::size_t kPartialBudgetElems = std::size_t{4} << 20;

// The work-item's register block, the packed GEMM's as the device's tuning row gives it (RB rows
// x NV float16): the products' accumulators, TB tiles x NVK float16 of output channels, number
// RB x NV (24 on AVX-512 rows, 6 on AVX2 ones, whose 16 vector registers hold 12 half-float16s
// and their operands), and NVK is at most NV.
struct RegisterBlock {
  std::size_t accumulators = 0, max_nvk = 0;
};

RegisterBlock register_block(OpEnv& env) {
  const GemmTuningRow row = gemm_tuning_for(env);
  if (row.config.kernel != GemmKernel::packed) return {};
  const auto nv = static_cast<std::size_t>(row.config.param("NV"));
  return {static_cast<std::size_t>(row.config.param("RB")) * nv, nv};
}

// One program's geometry. Forward: WINO_M = m outputs per tile side, WINO_R = R, the tile step m.
// Weight gradient: WINO_M = R (the taps it computes), WINO_R = m (the dy block), the same tiles.
struct Plan {
  std::size_t m = 0, r = 0, step = 0;
  std::size_t TR = 0, TQ = 0, HT = 0, WT = 0;              // tiles per column and row; xt's rows and columns
  std::size_t CC = 0, CP = 0;                              // input channels per pass (or block), padded count
  std::size_t NVK = 0, KB = 0, KP = 0;                     // float16 of output channels, their count, padded K
  std::size_t TB = 0, tiles = 0, blocks = 0;               // tiles per work-item (or group), in all, work-items
  std::size_t KBLOCKS = 1;                                 // blocks of KB output channels per work-item
  std::size_t chunks = 0, tiles_per_chunk = 0;             // weight gradient: tile chunks, tiles in each
  std::size_t DTH = 0, DTW = 0;                            // weight gradient: rows and columns of dy channels-last
  std::size_t xt_elems = 0, u_offset = 0, u_elems = 0;     // forward: xt, then U
  std::size_t dyt_offset = 0, part_offset = 0, total = 0;  // weight gradient: after xt; scratch in all
};

void check_limits(const Plan& p, std::size_t largest) {
  if (largest > std::size_t(std::numeric_limits<std::int32_t>::max()) ||
      p.tiles > std::numeric_limits<std::uint32_t>::max()) {
    throw std::invalid_argument(fmt::format(
        "conv2d: the Winograd layout of this layer ({} elements in one buffer, {} tiles) is over the 31-bit limit",
        largest, p.tiles));
  }
}

// The most blocks of output channels per work-item, out of `blocks`, that divide them and that
// `fits` accepts; 1 if none does.
template <class Fits>
std::size_t blocks_per_item(std::size_t blocks, Fits fits) {
  for (std::size_t d = blocks; d > 1; --d) {
    if (blocks % d == 0 && fits(d)) return d;
  }
  return 1;
}

// Tiles and the padded input, common to both directions.
Plan tiles(const Conv2dShape& s, const RegisterBlock& block, std::size_t step) {
  Plan p;
  p.step = step;
  p.TR = (s.P() + step - 1) / step;
  p.TQ = (s.Q() + step - 1) / step;
  p.HT = p.TR * step + s.R - 1;
  p.WT = p.TQ * step + s.R - 1;
  p.NVK = std::min(block.max_nvk, (s.K + 15) / 16);
  p.KB = 16 * p.NVK;
  p.KP = round_up(s.K, p.KB);
  p.tiles = s.N * p.TR * p.TQ;
  return p;
}

Plan plan(OpEnv& env, const Conv2dShape& s) {
  const RegisterBlock block = register_block(env);
  Plan p = tiles(s, block, kAlpha + 1 - s.R);
  p.m = p.step;
  p.r = s.R;
  const std::size_t passes = (s.C + kMaxPassChannels - 1) / kMaxPassChannels;
  p.CC = round_up((s.C + passes - 1) / passes, 16);
  p.CP = p.CC * passes;
  p.TB = std::clamp<std::size_t>(std::min(kMaxTiles, block.accumulators / p.NVK), 1, p.tiles);
  p.blocks = (p.tiles + p.TB - 1) / p.TB;
  // As many blocks of output channels per work-item as keep its outputs' sums (TB x m^2 x KB floats
  // a block) within kOutputSumElems.
  p.KBLOCKS =
      blocks_per_item(p.KP / p.KB, [&](std::size_t d) { return p.TB * p.m * p.m * p.KB * d <= kOutputSumElems; });
  p.xt_elems = s.N * p.HT * p.WT * p.CP;
  p.u_offset = round_up(p.xt_elems, kAlignElems);
  p.u_elems = kAlpha * kAlpha * p.CP * p.KP;
  p.total = p.u_offset + p.u_elems;
  check_limits(p, p.xt_elems);
  return p;
}

Plan weights_plan(OpEnv& env, const Conv2dShape& s) {
  Plan p = tiles(s, register_block(env), kAlpha + 1 - s.R);
  p.m = s.R;
  p.r = p.step;
  p.CC = s.C > 16 ? 32 : 16;
  p.CP = round_up(s.C, p.CC);
  p.TB = kWeightTiles;
  const std::size_t groups = (p.tiles + p.TB - 1) / p.TB;
  const std::size_t per_chunk = kAlpha * kAlpha * p.CP * p.KP;
  p.chunks = std::clamp<std::size_t>(
      std::min<std::size_t>(kWeightChunksPerUnit * env.device().compute_units, kPartialBudgetElems / per_chunk), 1,
      groups);
  p.tiles_per_chunk = (groups + p.chunks - 1) / p.chunks * p.TB;
  p.chunks = (p.tiles + p.tiles_per_chunk - 1) / p.tiles_per_chunk;
  // Blocks of output channels per work-item (each tile's window transformed once for all of
  // them) while the work-items still number kWeightChunksPerUnit per compute unit: the CNN's conv2
  // on AVX2 (one float16 of channels a block) 15.8-20.6 -> 13.6-14.9 ms with all four in one.
  const std::size_t kblocks = p.KP / p.KB, wanted = kWeightChunksPerUnit * env.device().compute_units;
  p.KBLOCKS =
      blocks_per_item(kblocks, [&](std::size_t d) { return p.chunks * (kblocks / d) * (p.CP / p.CC) >= wanted; });
  p.xt_elems = s.N * p.HT * p.WT * p.CP;
  p.DTH = p.TR * p.step;
  p.DTW = p.TQ * p.step;
  const std::size_t dyt_elems = s.N * p.DTH * p.DTW * p.KP;
  const std::size_t part_elems = p.chunks * per_chunk;
  p.dyt_offset = round_up(p.xt_elems, kAlignElems);
  p.part_offset = p.dyt_offset + round_up(dyt_elems, kAlignElems);
  p.total = p.part_offset + part_elems;
  check_limits(p, std::max({p.xt_elems, dyt_elems, part_elems}));
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
  std::string d = fmt::format(
      "{} -DWINO_M={} -DWINO_R={} -DWINO_A={} -DWINO_AT={} -DWINO_BT={} -DWINO_G={} -DWINO_TR={} -DWINO_TQ={} "
      "-DWINO_HT={} -DWINO_WT={} -DWINO_CP={} -DWINO_KP={} -DWINO_CC={} -DWINO_TB={} -DWINO_NVK={} -DWINO_KBLOCKS={}",
      conv2d_defines(s, t), p.m, p.r, kAlpha, initializer(w.AT), initializer(w.BT), initializer(w.G), p.TR, p.TQ, p.HT,
      p.WT, p.CP, p.KP, p.CC, p.TB, p.NVK, p.KBLOCKS);
  if (p.chunks != 0) d += fmt::format(" -DWINO_WEIGHTS -DWINO_DT_H={} -DWINO_DT_W={}", p.DTH, p.DTW);
  return d;
}

// winograd_pad of `src` (NCHW: C x H x W per image, stored as `t`) into `dst`: HT x WT x CP per
// image, channels-last, `pad` rows and columns of zeros before, zeros after.
KernelLaunch pad_launch(cl::Kernel kernel, DeviceSpan src, DType t, DeviceSpan dst, std::size_t N, std::size_t C,
                        std::size_t H, std::size_t W, std::size_t pad, std::size_t HT, std::size_t WT, std::size_t CP) {
  const auto u = [](std::size_t v) { return static_cast<cl_uint>(v); };
  cl::set_args(kernel.get(), src.buffer, src.elem_offset(dtype_bytes(t)), dst.buffer, dst.elem_offset(), u(N), u(C),
               u(H), u(W), u(pad), u(HT), u(WT), u(CP));
  KernelLaunch l;
  l.kernel = std::move(kernel);
  l.dims = 3;
  l.global = {CP / 16, HT, N};  // CP is a multiple of 16
  l.local = {1, 1, 1};
  return l;
}

DeviceSpan at(DeviceSpan span, std::size_t elems) {
  return span.advanced(elems * sizeof(float));
}

// FERRY_CONV_WINOGRAD: unset, "auto" or on ("1") lets applies() decide; off ("0") turns Winograd off.
bool enabled_by_env() {
  const char* v = std::getenv("FERRY_CONV_WINOGRAD");
  if (v != nullptr && std::string_view(v) == "auto") return true;
  return cl::env_switch("FERRY_CONV_WINOGRAD", "0 turns the Winograd convolutions off; 1 or auto: where they apply")
      .value_or(true);
}

}  // namespace

bool applies(OpEnv& env, const Conv2dShape& s) {
  return s.stride == 1 && s.R == s.S && (s.R == 3 || s.R == 5) && s.C >= 16 && s.K >= 16 && enabled_by_env() &&
         gemm_takes_planes(env) && register_block(env).accumulators != 0;
}

std::string name(const Conv2dShape& s) {
  const std::size_t m = kAlpha + 1 - s.R;
  return fmt::format("winograd F({}x{},{}x{})", m, m, s.R, s.R);
}

std::string weights_name(const Conv2dShape& s) {
  const std::size_t m = kAlpha + 1 - s.R;
  return fmt::format("winograd F({}x{},{}x{})", s.R, s.R, m, m);
}

std::size_t forward_scratch_elems(OpEnv& env, const Conv2dShape& s) {
  return plan(env, s).total;
}

std::size_t weights_scratch_elems(OpEnv& env, const Conv2dShape& s) {
  return weights_plan(env, s).total;
}

LaunchList forward(OpEnv& env, const Conv2dShape& s, DeviceSpan x, DeviceSpan w, DeviceSpan bias, DeviceSpan y,
                   DeviceSpan scratch) {
  const Plan p = plan(env, s);
  const DeviceSpan xt = at(scratch, 0), u = at(scratch, p.u_offset);
  LaunchList list;

  const std::string act_defines = defines(s, p, s.act);
  list.push_back(pad_launch(env.kernels.kernel("conv2d_winograd", "winograd_pad", act_defines), x, s.act, xt, s.N, s.C,
                            s.H, s.W, s.pad, p.HT, p.WT, p.CP));

  cl::Kernel filter = env.kernels.kernel("conv2d_winograd", "winograd_filter", defines(s, p, s.weight));
  cl::set_args(filter.get(), w.buffer, w.elem_offset(dtype_bytes(s.weight)), u.buffer, u.elem_offset());
  KernelLaunch lf;
  lf.kernel = std::move(filter);
  lf.dims = 2;
  lf.global = {p.KP, p.CP, 1};
  lf.local = {16, 1, 1};  // KP is a multiple of 16
  list.push_back(std::move(lf));

  cl::Kernel k = env.kernels.kernel("conv2d_winograd", "winograd_forward", act_defines);
  const cl_uint has_bias = bias.buffer != nullptr;
  cl::set_args(k.get(), xt.buffer, xt.elem_offset(), u.buffer, u.elem_offset(), has_bias ? bias.buffer : u.buffer,
               bias.elem_offset(), has_bias, y.buffer, y.elem_offset(dtype_bytes(s.act)),
               static_cast<cl_uint>(p.tiles));
  KernelLaunch lk;
  lk.kernel = std::move(k);
  lk.dims = 2;
  lk.global = {p.blocks, p.KP / (p.KB * p.KBLOCKS), 1};
  lk.local = {1, 1, 1};
  list.push_back(std::move(lk));
  return list;
}

LaunchList backward_weights(OpEnv& env, const Conv2dShape& s, DeviceSpan x, DeviceSpan dy, DeviceSpan dw,
                            DeviceSpan scratch) {
  const Plan p = weights_plan(env, s);
  const DeviceSpan xt = at(scratch, 0), dyt = at(scratch, p.dyt_offset), part = at(scratch, p.part_offset);
  const std::string act_defines = defines(s, p, s.act);
  LaunchList list;
  list.push_back(pad_launch(env.kernels.kernel("conv2d_winograd", "winograd_pad", act_defines), x, s.act, xt, s.N, s.C,
                            s.H, s.W, s.pad, p.HT, p.WT, p.CP));
  list.push_back(pad_launch(env.kernels.kernel("conv2d_winograd", "winograd_pad", act_defines), dy, s.act, dyt, s.N,
                            s.K, s.P(), s.Q(), 0, p.DTH, p.DTW, p.KP));

  cl::Kernel k = env.kernels.kernel("conv2d_winograd", "winograd_weights", act_defines);
  cl::set_args(k.get(), xt.buffer, xt.elem_offset(), dyt.buffer, dyt.elem_offset(), part.buffer, part.elem_offset(),
               static_cast<cl_uint>(p.tiles), static_cast<cl_uint>(p.tiles_per_chunk));
  KernelLaunch lk;
  lk.kernel = std::move(k);
  lk.dims = 3;
  lk.global = {p.chunks, p.KP / (p.KB * p.KBLOCKS), p.CP / p.CC};
  lk.local = {1, 1, 1};
  list.push_back(std::move(lk));

  cl::Kernel sum = env.kernels.kernel("conv2d_winograd", "winograd_weights_sum", defines(s, p, s.weight));
  cl::set_args(sum.get(), part.buffer, part.elem_offset(), static_cast<cl_uint>(p.chunks), dw.buffer,
               dw.elem_offset(dtype_bytes(s.weight)));
  KernelLaunch ls;
  ls.kernel = std::move(sum);
  ls.dims = 2;
  ls.global = {p.KP / 16, s.C, 1};
  ls.local = {1, 1, 1};
  list.push_back(std::move(ls));
  return list;
}

}  // namespace winograd
}  // namespace ferry::ops
