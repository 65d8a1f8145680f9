// Conv2d binding: im2col + GEMM over groups of images (ops/kernels/conv2d.cl, ops::gemm).
//
// Scratch layout (element offsets inside the one scratch span, each region 16-float aligned):
//   [0, A)        column matrix [C*R*S, G*P*Q]: im2col of x (forward, backward weights) or the
//                 column gradients w^T * dy (backward data)
//   [A, A+B)      [K, G*P*Q]: the forward GEMM result before the NCHW permute, or dy permuted
//                 into the GEMM layout (both backward launches)
//   [A+B, C)      with a narrow weight, the fp32 weight gradient summed over the groups, rounded
//                 once at the end (absent for an f32 weight)
//   [C, ...)      the scratch of whichever GEMM runs (the max over all of them)
// with G the largest group (conv2d_images_per_gemm). Groups run one after another on the in-order
// queue, so every group reuses the same regions.
#include "ops/conv2d.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <stdexcept>

#include "conv2d_internal.hpp"
#include "ferry/ops/cast.hpp"
#include "ops/gemm.hpp"

namespace ferry::ops {
namespace {

// Floats the column matrix plus the GEMM output of one group may take (16 MiB). Big enough that
// each GEMM has thousands of columns (the CNN's layers run in 1-3 groups at batch 64), small
// enough that the scratch stays a modest part of a device's memory at any batch size.
constexpr std::size_t kGroupBudgetElems = std::size_t{4} << 20;
constexpr std::size_t kAlignElems = 16;
// Floats after the padded input that conv2d_direct_forward's last vector loads may read.
constexpr std::size_t kDirectSlack = 32;
constexpr std::size_t kDirectChannels = 8;  // DIRECT_KB in conv2d_direct.cl
constexpr std::size_t kDirectColumns = 32;  // outputs of a row per work-item
constexpr std::size_t kLocalSize = 256;
constexpr std::size_t kPadLocalSize = 64;  // conv2d_pad: one work-item per padded row

// One work-item per element in work-groups of kLocalSize along the contiguous dimension (PoCL
// runs a work-group as one vectorised loop; fewer, longer groups cost less to schedule).
std::size_t local_size(OpEnv& env) {
  return std::min(kLocalSize, env.device().max_work_group_size);
}

// One work-item per work-group: for kernels whose work-items each loop over a long run of memory.
KernelLaunch launch_per_item(cl::Kernel kernel, std::size_t n) {
  KernelLaunch l;
  l.kernel = std::move(kernel);
  l.global[0] = std::max<std::size_t>(n, 1);
  l.local[0] = 1;
  return l;
}

KernelLaunch launch_1d(OpEnv& env, cl::Kernel kernel, std::size_t n) {
  const std::size_t local = local_size(env);
  KernelLaunch l;
  l.kernel = std::move(kernel);
  l.global[0] = round_up(std::max<std::size_t>(n, 1), local);
  l.local[0] = local;
  return l;
}

std::size_t align_up(std::size_t n) {
  return round_up(n, kAlignElems);
}

// A stride-1 square kernel's data gradient is itself a convolution, of dy padded by R-1-pad with
// the weight flipped and its channels swapped: dx[n, c] = sum over k, r, s of
// dy_pad[n, k, h + r, w + s] w[k, c, R-1-r, S-1-s]. Where the GEMM gathers its A (the packed
// kernel) that runs through the forward path, with no column matrix and no col2im.
bool data_as_forward(OpEnv& env, const Conv2dShape& s) {
  // Its GEMM's N is C: below 16 channels the register block is mostly padding (col2im wins).
  return s.stride == 1 && s.R == s.S && s.pad < s.R && s.C >= 16 && gemm_takes_planes(env);
}
// Rows of the forward GEMM's register block taken as one run of an output row (GemmOptions::
// a_gather_run), or 0 for a table entry per row: the largest divisor of Q that fits the registers
// beside the block's columns (runs of 8 or more rows only; below that the tuned block wins).
std::size_t gather_run(const Conv2dShape& s) {
  const std::size_t nv = std::min<std::size_t>(4, (s.K + 15) / 16);
  for (std::size_t d = 16; d >= 8; --d) {
    if (s.Q() % d == 0 && (d + 1) * nv <= 32) return d;
  }
  return 0;
}

// The first layer of an image model (few input channels, stride 1, the weight in the activations'
// dtype: f32, or both narrow under mixed precision) runs forward as a direct convolution
// (conv2d_direct.cl): with K = C*R*S a few dozen, the implicit GEMM's time went to its scattered
// NCHW stores. In bf16 the implicit GEMM took 4.9 ms for the CNN's first layer where the direct
// kernel takes 1.9 in f32 (batch 128, 1 -> 32 channels of 28 x 28; bench/RESULTS.md).
bool direct_forward(OpEnv& env, const Conv2dShape& s) {
  return gemm_takes_planes(env) && s.C <= 4 && s.stride == 1 && s.weight == s.act;
}

// The weight gradient of the same layers, direct too (conv2d_direct_weights) when the kernel is at
// most 7 wide: there the implicit GEMM packed the whole output gradient (6.3 ms in bf16 for the
// CNN's first layer against 1.8 direct in f32).
bool direct_weights(OpEnv& env, const Conv2dShape& s) {
  return direct_forward(env, s) && s.S <= 7;
}
// Image chunks of the direct weight gradient: partial sums per chunk, added in order after.
std::size_t direct_chunks(const Conv2dShape& s) {
  return std::clamp<std::size_t>(s.N, 1, 16);
}

// How conv2d_forward computes a shape (conv2d_algorithms names it): the choice made once, for
// binding and for the description alike.
enum class ForwardKind { direct, winograd, planes, columns };
ForwardKind forward_kind(OpEnv& env, const Conv2dShape& s) {
  if (direct_forward(env, s)) return ForwardKind::direct;
  if (winograd::applies(env, s)) return ForwardKind::winograd;
  return gemm_takes_planes(env) ? ForwardKind::planes : ForwardKind::columns;
}

// Whether some pass writes a column matrix: everything but the packed kernel's planes, and there
// the data gradient unless it runs as a forward convolution.
bool writes_columns(OpEnv& env, const Conv2dShape& s) {
  return !gemm_takes_planes(env) || !data_as_forward(env, s);
}

// The most images per group (at least one): those whose column matrix and GEMM output fit
// kGroupBudgetElems. With planes and no column matrix nothing per image is materialised but the
// packed output gradient of the weight product and the pixel table, so the whole batch usually
// runs as one GEMM (fewer, longer products; one pass of the K-split sums instead of one per group).
std::size_t max_images_per_group(const Conv2dShape& s, bool columns) {
  const std::size_t per_image = (columns ? s.C * s.R * s.S + s.K : s.K + 1) * s.P() * s.Q();
  const std::size_t fit = per_image == 0 ? 1 : kGroupBudgetElems / per_image;
  return std::clamp<std::size_t>(fit, 1, std::max<std::size_t>(s.N, 1));
}

void validate(const Conv2dShape& s) {
  if (!dtype_is_float(s.act) || !dtype_is_float(s.weight)) {
    throw std::invalid_argument(
        fmt::format("conv2d: dtypes {} (activations) and {} (weight); both must be f32, f16 or bf16", dtype_name(s.act),
                    dtype_name(s.weight)));
  }
  if (s.N == 0 || s.C == 0 || s.H == 0 || s.W == 0 || s.K == 0 || s.R == 0 || s.S == 0 || s.stride == 0) {
    throw std::invalid_argument(fmt::format("conv2d: zero dimension in N={} C={} H={} W={} K={} R={} S={} stride={}",
                                            s.N, s.C, s.H, s.W, s.K, s.R, s.S, s.stride));
  }
  if (s.R > s.H + 2 * s.pad || s.S > s.W + 2 * s.pad) {
    throw std::invalid_argument(fmt::format("conv2d: kernel {}x{} larger than the padded input {}x{}", s.R, s.S,
                                            s.H + 2 * s.pad, s.W + 2 * s.pad));
  }
}

// The batch split into balanced groups of at most max_images_per_group() images.
struct Groups {
  std::size_t count = 1, base = 0, extra = 0;  // group i has base + (i < extra) images
  Groups(const Conv2dShape& s, bool columns) {
    const std::size_t max_g = max_images_per_group(s, columns);
    count = std::max<std::size_t>(1, (s.N + max_g - 1) / max_g);
    base = s.N / count;
    extra = s.N % count;
  }
  std::size_t size(std::size_t i) const { return base + (i < extra ? 1 : 0); }
  std::size_t first(std::size_t i) const { return i * base + std::min(i, extra); }
  std::size_t largest() const { return base + (extra > 0 ? 1 : 0); }
};

struct Layout {
  bool planes = false;   // GEMMs read and write NCHW directly (gemm_takes_planes): no permutes
  bool columns = false;  // some pass writes a column matrix (writes_columns)
  std::size_t cols = 0, tmp = 0, dw32 = 0, gemm = 0;  // region offsets
  std::size_t xpad = 0, pixels = 0, taps = 0;         // with planes: padded x, offset tables (int32)
  std::size_t bias_part = 0;                          // per-image bias gradient sums [N, K]
  std::size_t direct_part = 0;                        // the direct weight gradient's partial sums per image chunk
  std::size_t total = 0;
};

// The GEMMs, in two orientations. With NCHW planes (ferry's packed kernel, CPUs) the long
// dimension of each product is M, the operand read in place (the column matrix, or the weight)
// is A and the one packed is small: forward y^T[G*PQ, K] = cols^T w^T written to NCHW with the
// bias; data dcols[CRS, G*PQ] = w^T dy with dy packed straight from NCHW; weights
// dw^T[CRS, K] = cols dy^T, dy again packed from NCHW, stored transposed into dw. Elsewhere
// (tiled kernels, CLBlast): forward w cols and data w^T dy through the [K, G*PQ] permutes,
// weights dy cols^T. The weight is the only operand that may be narrow besides the activations
// the planes read; the weight gradient is computed in f32 (summed over the groups) and rounded
// after.
GemmShape forward_gemm(const Conv2dShape& s, std::size_t g, bool planes) {
  const std::size_t ncols = g * s.P() * s.Q(), crs = s.C * s.R * s.S;
  if (planes) return {ncols, s.K, crs, false, /*trans_b=*/true, DType::f32, s.weight, s.act};
  return {s.K, ncols, crs, false, false, s.weight};
}
GemmShape data_gemm(const Conv2dShape& s, std::size_t g, bool planes) {
  GemmShape shape{s.C * s.R * s.S, g * s.P() * s.Q(), s.K, /*trans_a=*/true, false, s.weight};
  if (planes) shape.b = s.act;
  return shape;
}
GemmShape weights_gemm(const Conv2dShape& s, std::size_t g, bool planes) {
  const std::size_t ncols = g * s.P() * s.Q(), crs = s.C * s.R * s.S;
  if (planes) return {crs, s.K, ncols, false, /*trans_b=*/true, DType::f32, s.act};
  return {s.K, crs, ncols, false, /*trans_b=*/true};
}

Layout layout(OpEnv& env, const Conv2dShape& s) {
  validate(s);
  const bool columns = writes_columns(env, s);
  const Groups groups(s, columns);
  const std::size_t g = groups.largest();
  const std::size_t ncols = g * s.P() * s.Q();
  const std::size_t crs = s.C * s.R * s.S;
  // Every index the kernels compute within a group is 32-bit.
  const std::size_t biggest = std::max({crs * ncols, s.K * ncols, g * s.C * s.H * s.W});
  if (biggest > std::numeric_limits<std::uint32_t>::max()) {
    throw std::invalid_argument(
        fmt::format("conv2d: one image needs {} column elements, over the 32-bit limit", biggest));
  }
  Layout l;
  l.planes = gemm_takes_planes(env);
  l.columns = columns;
  std::size_t gemm_elems = 0;
  for (std::size_t size : {groups.base, groups.largest()}) {
    if (size == 0) continue;
    gemm_elems = std::max({gemm_elems, gemm_scratch_elems(env, forward_gemm(s, size, l.planes)),
                           gemm_scratch_elems(env, data_gemm(s, size, l.planes)),
                           gemm_scratch_elems(env, weights_gemm(s, size, l.planes))});
  }
  l.cols = 0;
  l.tmp = columns ? align_up(crs * ncols) : 0;
  l.dw32 = l.tmp + (l.planes ? 0 : align_up(s.K * ncols));
  l.gemm = l.dw32 + (s.weight == DType::f32 ? 0 : align_up(s.K * crs));
  l.total = l.gemm + gemm_elems;
  if (l.planes) {
    const std::size_t xpad = s.N * s.C * (s.H + 2 * s.pad) * (s.W + 2 * s.pad);
    if (xpad > std::size_t(std::numeric_limits<std::int32_t>::max())) {
      throw std::invalid_argument(fmt::format("conv2d: the padded input has {} elements, over the 31-bit limit", xpad));
    }
    l.xpad = align_up(l.total);
    l.pixels = l.xpad + align_up(xpad + kDirectSlack);
    l.taps = l.pixels + align_up(ncols);
    l.total = l.taps + align_up(crs);
  }
  l.bias_part = l.total;
  l.total += align_up(s.N * s.K);
  if (direct_weights(env, s)) {
    l.direct_part = l.total;
    l.total += align_up(direct_chunks(s) * (s.K * crs + s.K));
  }
  return l;
}

DeviceSpan at(DeviceSpan span, std::size_t elems, DType t = DType::f32) {
  return span.advanced(elems * dtype_bytes(t));
}

Conv2dShape data_shape(const Conv2dShape& s) {
  Conv2dShape t = s;
  t.C = s.K;
  t.H = s.P();
  t.W = s.Q();
  t.K = s.C;
  t.pad = s.R - 1 - s.pad;
  t.weight = DType::f32;  // the flipped copy
  t.relu = false;
  return t;
}

KernelLaunch im2col(OpEnv& env, const Conv2dShape& s, DeviceSpan x, DeviceSpan cols, std::size_t ncols) {
  cl::Kernel k = env.kernels.kernel("conv2d", "conv2d_im2col", conv2d_defines(s));
  cl::set_args(k.get(), x.buffer, x.elem_offset(dtype_bytes(s.act)), cols.buffer, cols.elem_offset(),
               static_cast<cl_uint>(ncols));
  KernelLaunch l;
  l.kernel = std::move(k);
  l.dims = 2;
  const std::size_t local = local_size(env);
  l.global = {round_up(ncols, local), s.C * s.R * s.S, 1};
  l.local = {local, 1, 1};
  return l;
}

KernelLaunch from_nchw(OpEnv& env, const Conv2dShape& s, DeviceSpan dy, DeviceSpan t, std::size_t ncols) {
  cl::Kernel k = env.kernels.kernel("conv2d", "conv2d_from_nchw", conv2d_defines(s));
  const std::size_t count = s.K * ncols;
  cl::set_args(k.get(), dy.buffer, dy.elem_offset(dtype_bytes(s.act)), t.buffer, t.elem_offset(),
               static_cast<cl_uint>(ncols), static_cast<cl_uint>(count));
  return launch_1d(env, std::move(k), count);
}

// The padded input (all N images, f32; conv2d_pad), then kDirectSlack zeros.
void pad_input(OpEnv& env, const Conv2dShape& s, const Layout& lay, DeviceSpan x, DeviceSpan scratch,
               LaunchList& list) {
  const DeviceSpan xp = at(scratch, lay.xpad);
  const std::size_t rows = s.N * s.C * (s.H + 2 * s.pad);
  cl::Kernel pad = env.kernels.kernel("conv2d", "conv2d_pad", conv2d_defines(s));
  cl::set_args(pad.get(), x.buffer, x.elem_offset(dtype_bytes(s.act)), xp.buffer, xp.elem_offset(),
               static_cast<cl_uint>(rows), static_cast<cl_uint>(kDirectSlack));
  // One work-item per padded row, in work-groups of 64 rows (what the kernel was timed with).
  KernelLaunch l;
  l.kernel = std::move(pad);
  l.local[0] = std::min<std::size_t>(kPadLocalSize, env.device().max_work_group_size);
  l.global[0] = round_up(rows, l.local[0]);
  list.push_back(std::move(l));
}

// The padded input and the offset tables of the implicit column matrix (conv2d_tables): what the
// forward and weight-gradient GEMMs read in place of im2col.
void pad_and_tables(OpEnv& env, const Conv2dShape& s, const Layout& lay, std::size_t npix, DeviceSpan x,
                    DeviceSpan scratch, LaunchList& list) {
  pad_input(env, s, lay, x, scratch, list);
  const DeviceSpan pixels = at(scratch, lay.pixels), taps = at(scratch, lay.taps);
  cl::Kernel tables = env.kernels.kernel("conv2d", "conv2d_tables", conv2d_defines(s));
  cl::set_args(tables.get(), pixels.buffer, pixels.elem_offset(4), static_cast<cl_uint>(npix), taps.buffer,
               taps.elem_offset(4));
  list.push_back(launch_1d(env, std::move(tables), std::max(npix, s.C * s.R * s.S)));
}

void append(LaunchList& list, LaunchList more) {
  for (auto& l : more) list.push_back(std::move(l));
}

// dbias[k] = sum over n, p, q of dy[n, k, p, q]: per-image plane sums, then over the batch, both
// in a fixed order.
LaunchList bias_gradient(OpEnv& env, const Conv2dShape& s, const Layout& lay, DeviceSpan dy, DeviceSpan dbias,
                         DeviceSpan scratch) {
  const DeviceSpan part = at(scratch, lay.bias_part);
  LaunchList list;
  cl::Kernel k = env.kernels.kernel("conv2d", "conv2d_bias_partial", conv2d_defines(s));
  cl::set_args(k.get(), dy.buffer, dy.elem_offset(dtype_bytes(s.act)), part.buffer, part.elem_offset(),
               static_cast<cl_uint>(s.N));
  list.push_back(launch_per_item(std::move(k), s.N));
  cl::Kernel sum = env.kernels.kernel("conv2d", "conv2d_bias_sum", conv2d_defines(s));
  cl::set_args(sum.get(), part.buffer, part.elem_offset(), dbias.buffer, dbias.elem_offset(),
               static_cast<cl_uint>(s.N));
  list.push_back(launch_per_item(std::move(sum), s.K));
  return list;
}

}  // namespace

std::string conv2d_defines(const Conv2dShape& s, std::optional<DType> t) {
  return fmt::format(
      "-DCONV_C={} -DCONV_H={} -DCONV_W={} -DCONV_K={} -DCONV_R={} -DCONV_S={} -DCONV_P={} -DCONV_Q={} "
      "-DCONV_STRIDE={} -DCONV_PAD={} -DCONV_RELU={} {}",
      s.C, s.H, s.W, s.K, s.R, s.S, s.P(), s.Q(), s.stride, s.pad, int(s.relu), dtype_define(t.value_or(s.act)));
}

Conv2dAlgorithms conv2d_algorithms(OpEnv& env, const Conv2dShape& s) {
  validate(s);
  const auto forward = [&](const Conv2dShape& f) -> std::string {
    switch (forward_kind(env, f)) {
      case ForwardKind::direct:
        return "direct";
      case ForwardKind::winograd:
        return winograd::name(f);
      case ForwardKind::planes:
        return "implicit GEMM (planes)";
      case ForwardKind::columns:
        break;
    }
    return "im2col GEMM";
  };
  Conv2dAlgorithms a;
  a.forward = forward(s);
  a.data_grad = data_as_forward(env, s) ? "forward of dy: " + forward(data_shape(s)) : "GEMM + col2im";
  // The weight gradient follows the forward's choice, with its own direct kernel on fewer shapes.
  switch (forward_kind(env, s)) {
    case ForwardKind::winograd:
      a.weight_grad = winograd::weights_name(s);
      break;
    case ForwardKind::direct:
      a.weight_grad = direct_weights(env, s) ? "direct" : "implicit GEMM (planes)";
      break;
    case ForwardKind::planes:
      a.weight_grad = "implicit GEMM (planes)";
      break;
    case ForwardKind::columns:
      a.weight_grad = "im2col GEMM";
      break;
  }
  return a;
}

std::size_t conv2d_images_per_gemm(OpEnv& env, const Conv2dShape& s) {
  return Groups(s, writes_columns(env, s)).largest();
}

std::size_t conv2d_scratch_elems(OpEnv& env, const Conv2dShape& s) {
  // The GEMM layout (the bias gradient's sums live there on every path), Winograd's forward and
  // weight gradient where they run, and the data gradient's flipped weight plus its forward.
  const auto forward_elems = [&](const Conv2dShape& f) {
    const std::size_t gemm = layout(env, f).total;
    return forward_kind(env, f) == ForwardKind::winograd ? std::max(gemm, winograd::forward_scratch_elems(env, f))
                                                         : gemm;
  };
  std::size_t total = forward_elems(s);
  if (forward_kind(env, s) == ForwardKind::winograd) total = std::max(total, winograd::weights_scratch_elems(env, s));
  if (data_as_forward(env, s)) total = std::max(total, align_up(s.K * s.C * s.R * s.S) + forward_elems(data_shape(s)));
  return total;
}

LaunchList conv2d_forward(OpEnv& env, const Conv2dShape& s, DeviceSpan x, DeviceSpan w, DeviceSpan bias, DeviceSpan y,
                          DeviceSpan scratch) {
  validate(s);
  const ForwardKind kind = forward_kind(env, s);
  if (kind == ForwardKind::winograd) return winograd::forward(env, s, x, w, bias, y, scratch);
  const Layout lay = layout(env, s);
  const Groups groups(s, lay.columns);
  const std::size_t PQ = s.P() * s.Q();
  const DeviceSpan cols = at(scratch, lay.cols), tmp = at(scratch, lay.tmp), gscratch = at(scratch, lay.gemm);
  const cl_uint has_bias = bias.buffer != nullptr;
  LaunchList list;
  if (kind == ForwardKind::direct) {
    pad_input(env, s, lay, x, scratch, list);
    cl::Kernel k = env.kernels.kernel("conv2d_direct", "conv2d_direct_forward", conv2d_defines(s));
    const DeviceSpan xp = at(scratch, lay.xpad);
    const std::size_t rows = s.N * s.P();
    cl::set_args(k.get(), xp.buffer, xp.elem_offset(), w.buffer, w.elem_offset(dtype_bytes(s.weight)),
                 has_bias ? bias.buffer : w.buffer, bias.elem_offset(), has_bias, y.buffer,
                 y.elem_offset(dtype_bytes(s.act)), static_cast<cl_uint>(rows));
    KernelLaunch l;
    l.kernel = std::move(k);
    l.dims = 3;
    l.global = {rows, (s.K + kDirectChannels - 1) / kDirectChannels, (s.Q() + kDirectColumns - 1) / kDirectColumns};
    l.local = {1, 1, 1};
    list.push_back(std::move(l));
    return list;
  }
  for (std::size_t i = 0; i < groups.count; ++i) {
    const std::size_t g = groups.size(i), n0 = groups.first(i), ncols = g * PQ;
    const DeviceSpan yg = at(y, n0 * s.K * PQ, s.act);
    if (lay.planes) {
      if (i == 0) pad_and_tables(env, s, lay, groups.largest() * PQ, x, scratch, list);
      GemmOptions o;
      o.bias = bias;
      o.c_planes = PQ;
      o.a_gather_rows = at(scratch, lay.pixels);
      o.a_gather_cols = at(scratch, lay.taps);
      o.a_gather_run = gather_run(s);
      o.a_gather_step = s.stride;
      o.relu = s.relu;
      const DeviceSpan xp = at(scratch, lay.xpad + n0 * s.C * (s.H + 2 * s.pad) * (s.W + 2 * s.pad));
      append(list, gemm(env, forward_gemm(s, g, true), 1.0f, xp, w, 0.0f, yg, gscratch, o));
      continue;
    }
    list.push_back(im2col(env, s, at(x, n0 * s.C * s.H * s.W, s.act), cols, ncols));
    append(list, gemm(env, forward_gemm(s, g, false), 1.0f, w, cols, 0.0f, tmp, gscratch));
    cl::Kernel k = env.kernels.kernel("conv2d", "conv2d_to_nchw", conv2d_defines(s));
    const std::size_t count = g * s.K * PQ;
    cl::set_args(k.get(), tmp.buffer, tmp.elem_offset(), has_bias ? bias.buffer : tmp.buffer, bias.elem_offset(),
                 has_bias, yg.buffer, yg.elem_offset(dtype_bytes(s.act)), static_cast<cl_uint>(ncols),
                 static_cast<cl_uint>(count));
    list.push_back(launch_1d(env, std::move(k), count));
  }
  return list;
}

LaunchList conv2d_backward_data(OpEnv& env, const Conv2dShape& s, DeviceSpan dy, DeviceSpan w, DeviceSpan dx,
                                DeviceSpan scratch) {
  if (data_as_forward(env, s)) {
    validate(s);
    const std::size_t count = s.K * s.C * s.R * s.S;
    cl::Kernel flip = env.kernels.kernel("conv2d", "conv2d_flip_weights", conv2d_defines(s, s.weight));
    cl::set_args(flip.get(), w.buffer, w.elem_offset(dtype_bytes(s.weight)), scratch.buffer, scratch.elem_offset(),
                 static_cast<cl_uint>(count));
    LaunchList list;
    list.push_back(launch_1d(env, std::move(flip), count));
    append(list, conv2d_forward(env, data_shape(s), dy, scratch, {}, dx, at(scratch, align_up(count))));
    return list;
  }
  const Layout lay = layout(env, s);
  const Groups groups(s, lay.columns);
  const std::size_t PQ = s.P() * s.Q();
  const DeviceSpan dcols = at(scratch, lay.cols), dyt = at(scratch, lay.tmp), gscratch = at(scratch, lay.gemm);
  LaunchList list;
  for (std::size_t i = 0; i < groups.count; ++i) {
    const std::size_t g = groups.size(i), n0 = groups.first(i), ncols = g * PQ;
    const DeviceSpan dyg = at(dy, n0 * s.K * PQ, s.act);
    if (lay.planes) {
      GemmOptions o;
      o.b_planes = PQ;
      append(list, gemm(env, data_gemm(s, g, true), 1.0f, w, dyg, 0.0f, dcols, gscratch, o));
    } else {
      list.push_back(from_nchw(env, s, dyg, dyt, ncols));
      append(list, gemm(env, data_gemm(s, g, false), 1.0f, w, dyt, 0.0f, dcols, gscratch));
    }
    cl::Kernel k = env.kernels.kernel("conv2d", "conv2d_col2im", conv2d_defines(s));
    const DeviceSpan dxg = at(dx, n0 * s.C * s.H * s.W, s.act);
    const std::size_t count = g * s.C * s.H * s.W;
    cl::set_args(k.get(), dcols.buffer, dcols.elem_offset(), dxg.buffer, dxg.elem_offset(dtype_bytes(s.act)),
                 static_cast<cl_uint>(ncols), static_cast<cl_uint>(count));
    list.push_back(launch_1d(env, std::move(k), count));
  }
  return list;
}

LaunchList conv2d_backward_weights(OpEnv& env, const Conv2dShape& s, DeviceSpan x, DeviceSpan dy, DeviceSpan dw,
                                   DeviceSpan dbias, DeviceSpan scratch) {
  const Layout lay = layout(env, s);
  const Groups groups(s, lay.columns);
  const std::size_t PQ = s.P() * s.Q();
  const DeviceSpan cols = at(scratch, lay.cols), dyt = at(scratch, lay.tmp), gscratch = at(scratch, lay.gemm);
  const DeviceSpan dw32 = s.weight == DType::f32 ? dw : at(scratch, lay.dw32);
  LaunchList list;
  if (forward_kind(env, s) == ForwardKind::winograd) {
    list = winograd::backward_weights(env, s, x, dy, dw, scratch);
    if (dbias.buffer != nullptr) append(list, bias_gradient(env, s, lay, dy, dbias, scratch));
    return list;
  }
  if (direct_weights(env, s)) {
    const std::size_t chunks = direct_chunks(s), per_chunk = (s.N + chunks - 1) / chunks;
    const DeviceSpan xp = at(scratch, lay.xpad), part = at(scratch, lay.direct_part);
    pad_input(env, s, lay, x, scratch, list);
    cl::Kernel k = env.kernels.kernel("conv2d_direct", "conv2d_direct_weights", conv2d_defines(s));
    cl::set_args(k.get(), xp.buffer, xp.elem_offset(), dy.buffer, dy.elem_offset(dtype_bytes(s.act)), part.buffer,
                 part.elem_offset(), static_cast<cl_uint>(s.N), static_cast<cl_uint>(per_chunk));
    KernelLaunch l;
    l.kernel = std::move(k);
    l.dims = 3;
    l.global = {(s.K + 3) / 4, s.C * s.R, (s.N + per_chunk - 1) / per_chunk};
    l.local = {1, 1, 1};
    list.push_back(std::move(l));
    const cl_uint has_bias = dbias.buffer != nullptr;
    cl::Kernel sum = env.kernels.kernel("conv2d_direct", "conv2d_direct_weights_sum", conv2d_defines(s));
    cl::set_args(sum.get(), part.buffer, part.elem_offset(), static_cast<cl_uint>(l.global[2]), dw.buffer,
                 dw.elem_offset(dtype_bytes(s.weight)), has_bias ? dbias.buffer : dw.buffer, dbias.elem_offset(),
                 has_bias);
    list.push_back(launch_1d(env, std::move(sum), s.K * s.C * s.R * s.S + s.K));
    return list;
  }
  for (std::size_t i = 0; i < groups.count; ++i) {
    const std::size_t g = groups.size(i), n0 = groups.first(i), ncols = g * PQ;
    const DeviceSpan dyg = at(dy, n0 * s.K * PQ, s.act);
    const float beta = i == 0 ? 0.0f : 1.0f;
    if (lay.planes) {
      if (i == 0) pad_and_tables(env, s, lay, groups.largest() * PQ, x, scratch, list);
      GemmOptions o;
      o.b_planes = PQ;
      o.c_planes = s.C * s.R * s.S;  // dw^T [CRS, K] stored as dw [K, CRS]
      o.a_gather_rows = at(scratch, lay.taps);
      o.a_gather_cols = at(scratch, lay.pixels);
      const DeviceSpan xp = at(scratch, lay.xpad + n0 * s.C * (s.H + 2 * s.pad) * (s.W + 2 * s.pad));
      append(list, gemm(env, weights_gemm(s, g, true), 1.0f, xp, dyg, beta, dw32, gscratch, o));
    } else {
      list.push_back(im2col(env, s, at(x, n0 * s.C * s.H * s.W, s.act), cols, ncols));
      list.push_back(from_nchw(env, s, dyg, dyt, ncols));
      append(list, gemm(env, weights_gemm(s, g, false), 1.0f, dyt, cols, beta, dw32, gscratch));
    }
  }
  if (s.weight != DType::f32) append(list, cast(env, DType::f32, s.weight, dw32, dw, s.K * s.C * s.R * s.S));
  if (dbias.buffer != nullptr) append(list, bias_gradient(env, s, lay, dy, dbias, scratch));
  return list;
}

}  // namespace ferry::ops
