// Binding of the fused attention kernels (ops/kernels/attention.cl).
#include "ops/attention.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <stdexcept>

#include "ferry/cl/error.hpp"
#include "ops/attention_config.hpp"
#include "ops/attention_gemm.hpp"
#include "ops/attention_tune.hpp"

namespace ferry::ops {
namespace {

// The family and parameters of a kernel choice (ops/attention_config.hpp).
using Family = AttentionFamily;

std::size_t padded_dim(const AttentionShape& s) {
  return round_up(s.head_dim, 16);
}
std::size_t padded_context(const AttentionShape& s) {
  return round_up(s.context, 16);
}

// Defaults: on CPU devices register tiles of 6 query rows (the most whose scores fit AVX2's sixteen
// vector registers: 8 spilled; 8 where vectors are 16 floats wide), 48 rows per work-item and softmax blocks of 64 keys
// (measured on PoCL's pthread device against RB 2, 4 and 8, QB 30 and 48, KB 16 and 128: bench/RESULTS.md, "Attention's
// CPU kernels fitted to AVX2"); elsewhere the tuned kernel. A tiled kernel's BQ and BK shrink to the device's
// work-group limit and local memory when they are defaults; the blocked kernels' tiles are fitted per kernel
// (blocked_tiles).
AttentionConfig choose_config(OpEnv& env, const AttentionShape& s, const AttentionOptions& given) {
  AttentionOptions o = given;
  // FERRY_ATTENTION_KERNEL names the kernel of every fused attention whose options name none (a
  // model's, in a compiled step): as if given there, so a bad one is an error.
  const char* env_kernel = std::getenv("FERRY_ATTENTION_KERNEL");
  const bool from_env = o.kernel.empty() && env_kernel && *env_kernel;
  if (from_env) o.kernel = env_kernel;
  AttentionConfig c;
  if (!o.kernel.empty()) {
    try {
      c = parse_attention_config(o.kernel);
    } catch (const std::invalid_argument& e) {
      if (!from_env) throw;
      // The variable is set far from where the error shows (in a model's compile): name it.
      throw std::invalid_argument(
          fmt::format("FERRY_ATTENTION_KERNEL='{}': {}; set it to a kernel as AttentionOptions::kernel takes it "
                      "(docs/building.md), or unset it for the device's default",
                      env_kernel, e.what()));
    }
  } else if (env.device().is_cpu()) {
    c.family = Family::cpu;
    // Eight rows a register tile where vectors are 16 floats wide: AVX-512's 32 registers hold
    // eight rows of scores (one register each) beside the key vectors, and the default GPT's
    // attention ran 4-8% faster than with six, forward and backward, at contexts 128-2048
    // (bench/RESULTS.md, "Attention staged per head in local memory").
    if (env.device().native_float_width >= 16) c.rb = 8;
  } else {
    // Other devices: the tuner's winner for this device (ops/attention_tune.hpp), else the blocked
    // family's default tiles.
    const std::string tuned = attention_tuning_for(env).kernel_for(s.head_dim);
    c = tuned.empty() ? parse_attention_config("blocked") : parse_attention_config(tuned);
  }
  // The one-pass backward runs a work-item per head: it takes over once there are four heads per
  // compute unit (fewer would leave cores idle), and computes five products instead of seven.
  if (c.cpu() && c.pass == 0)
    c.pass = s.batch * s.heads >= 4 * std::max<std::size_t>(env.device().compute_units, 1) ? 1 : 2;
  if (c.family == Family::tiled && o.kernel.empty()) {
    c.bq = std::min<std::size_t>(c.bq, std::max<std::size_t>(env.device().max_work_group_size, 1));
    const std::uint64_t local = env.device().local_mem_bytes;
    while (c.bk > 8 && (2 * c.bk * s.head_dim + 2 * c.bk) * sizeof(float) > local) c.bk /= 2;
  }
  // The gemm family holds the scores of whole heads (two matrices each in the backward): past the
  // context where one head's fit its MIB, the blocked family's default runs (both passes decide
  // alike; attention_kernel_description says which ran).
  if (c.family == Family::gemm && attention_gemm_chunk_heads(s, c.mib, 2) == 0) {
    if (!o.kernel.empty()) {
      throw std::invalid_argument(
          fmt::format("attention: '{}' holds two {} x {} score matrices per head in at most {} MiB, and one head's "
                      "take {:.1f} MiB; "
                      "give a larger MIB (at most 256) or another family",
                      o.kernel, padded_context(s), padded_context(s), c.mib,
                      2.0 * double(padded_context(s) * padded_context(s)) * sizeof(float) / double(1 << 20)));
    }
    c = parse_attention_config("blocked");
  }
  return c;
}

// The blocked family's three kernels and the local memory each declares (floats), as in
// attention_blocked.cl (rows padded to RS = DP + 4 floats): TQ and TK are fitted per kernel.
enum class BlockedKernel { forward, dq, dkv };

std::size_t blocked_local_floats(BlockedKernel k, std::size_t dp, std::size_t tq, std::size_t tk) {
  const std::size_t rs = dp + 4;
  switch (k) {
    case BlockedKernel::forward:  // q rows; k rows, then the probabilities; v rows; row partials
      return tq * rs + tk * std::max(rs, tq) + tk * dp + tq * tk / 4;
    case BlockedKernel::dq:  // q and do rows; the step's k and v rows; ds
      return 2 * tq * rs + 2 * tk * rs + tk * tq;
    case BlockedKernel::dkv:
      break;
  }
  return 2 * tk * rs + 2 * tq * rs + 2 * tq * tk + 2 * tq;  // k and v rows; q and do rows; p and ds; lse, delta
}

// TQ and TK for one blocked kernel: the configuration's, the larger halved (TQ on a tie) until its
// local arrays fit the device and its (TQ / 4) (TK / 4) work-items fit a work-group. At head
// dimension 64 in NVIDIA's 48 KiB the forward runs 64 x 32 tiles (36 KiB), dq 32 x 32 (38 KiB) and
// dk dv 32 x 32 (42 KiB).
std::pair<std::size_t, std::size_t> blocked_tiles(OpEnv& env, const AttentionShape& s, const AttentionConfig& c,
                                                  BlockedKernel k) {
  const std::size_t dp = padded_dim(s);
  const std::uint64_t local = env.device().local_mem_bytes;
  const std::size_t group = std::max<std::size_t>(env.device().max_work_group_size, 1);
  std::size_t tq = c.tq, tk = c.tk;
  while (blocked_local_floats(k, dp, tq, tk) * sizeof(float) > local || (tq / 4) * (tk / 4) > group) {
    if (tq <= 4 && tk <= 4) {
      throw std::invalid_argument(fmt::format(
          "attention: the blocked kernels need {} bytes of local memory at head dimension {} with 4 x 4 tiles, and "
          "{} has {}; use the tiled kernels (\"tiled BQ=n BK=n\") or the unfused attention",
          blocked_local_floats(k, dp, 4, 4) * sizeof(float), s.head_dim, env.device().name, local));
    }
    if (tq >= tk && tq > 4) {
      tq /= 2;
    } else {
      tk /= 2;
    }
  }
  return {tq, tk};
}

// Floats of local memory a work-item's staged head takes in the STAGE_LOCAL kernels
// (attention.cl): the forward's kᵀ and v rows; the one-pass backward's kᵀ, vᵀ, rows of k, q, do and
// dq, and delta.
std::size_t local_forward_floats(const AttentionShape& s) {
  return padded_context(s) * (s.head_dim + padded_dim(s));
}
std::size_t local_backward_floats(const AttentionShape& s) {
  return padded_context(s) * (2 * s.head_dim + 4 * padded_dim(s) + 1);
}

// Whether the CPU kernels stage each head in local memory, a work-item per head in both passes:
// where the one-pass backward runs (heads enough to fill the cores), at contexts up to LT whose
// staged head (the backward's, the larger) fits the device's local memory.
bool stages_locally(OpEnv& env, const AttentionShape& s, const AttentionConfig& c) {
  return c.cpu() && c.pass == 1 && s.context <= c.lt &&
         local_backward_floats(s) * sizeof(float) <= env.device().local_mem_bytes;
}

std::string kernel_defines(const AttentionShape& s, DType dtype, const AttentionConfig& c) {
  std::string d = fmt::format("{} -DHEAD_DIM={} -DDP={}", dtype_define(dtype), s.head_dim, padded_dim(s));
  if (c.cpu()) return d + fmt::format(" -DRB={} -DQB={} -DKB={}", c.rb, c.qb, c.kb);
  if (c.family == Family::blocked || c.family == Family::gemm) return d;  // attention.cl's shared kernels only
  return d + fmt::format(" -DBQ={} -DBK={}", c.bq, c.bk);
}

// One of the blocked kernels built for its fitted tiles: the kernel, its work-group size and the rows
// (queries; keys for dk dv) a work-group takes.
struct BlockedBuild {
  cl::Kernel kernel;
  std::size_t group = 0, rows = 0;
};
BlockedBuild build_blocked(OpEnv& env, const AttentionShape& s, DType dtype, const AttentionConfig& c,
                           BlockedKernel which);

std::size_t elem_bytes(DType t) {
  return dtype_bytes(t);
}

// A tiled kernel runs work-groups of exactly BQ work-items (its loops stride by BQ), a blocked one
// of (TQ / 4) (TK / 4): refuse a kernel the device cannot run that wide instead of letting the
// enqueue fail.
void check_group(const cl::Kernel& k, OpEnv& env, std::size_t group, const char* name, const AttentionConfig& c) {
  const std::size_t limit = kernel_group_limit(k, env.device());
  if (limit < group) {
    throw std::invalid_argument(
        fmt::format("attention: {} runs work-groups of {} work-items, but {} allows {} for it; pick smaller tiles "
                    "(AttentionOptions::kernel, ferry-bench attention --kernel; this one: \"{}\")",
                    name, group, env.device().name, limit, c.text()));
  }
}

KernelLaunch grid(cl::Kernel k, std::size_t x, std::size_t y, std::size_t local_x) {
  KernelLaunch l;
  l.kernel = std::move(k);
  l.dims = 2;
  l.global = {x, y, 1};
  l.local = {local_x, 1, 1};
  return l;
}

BlockedBuild build_blocked(OpEnv& env, const AttentionShape& s, DType dtype, const AttentionConfig& c,
                           BlockedKernel which) {
  static constexpr const char* names[] = {"attention_forward_blocked", "attention_backward_q_blocked",
                                          "attention_backward_kv_blocked"};
  const char* name = names[static_cast<int>(which)];
  const auto tiles = blocked_tiles(env, s, c, which);
  // The family's shared defines (attention.clh), its fitted tiles, and the block loops unrolled on
  // GPUs (attention_blocked.cl's UNROLL).
  const std::string defines =
      fmt::format("{} -DTQ={} -DTK={} -DUNROLL_BLOCKS={}{}", kernel_defines(s, dtype, c), tiles.first, tiles.second,
                  int(!env.device().is_cpu()),
                  cl::register_cap_option(env.device(), int(c.rr), fmt::format("attention {}", c.text())));
  BlockedBuild b{env.kernels.kernel("attention_blocked", name, defines), (tiles.first / 4) * (tiles.second / 4),
                 which == BlockedKernel::dkv ? tiles.second : tiles.first};
  check_group(b.kernel, env, b.group, name, c);
  return b;
}

// A blocked kernel's launch over `heads` heads, its arguments set.
KernelLaunch blocked_grid(BlockedBuild b, const AttentionShape& s, std::size_t heads) {
  return grid(std::move(b.kernel), (s.context + b.rows - 1) / b.rows * b.group, heads, b.group);
}

// Stages x (k, v, q or do) per head as f32 rows [BH, Tp, DP] (rows) and/or transposed [BH, D, Tp] (trans); an
// operand without a buffer is not staged.
void stage(LaunchList& list, OpEnv& env, const AttentionShape& s, DType dtype, const AttentionConfig& c, DeviceSpan x,
           DeviceSpan rows, DeviceSpan trans) {
  const std::string defines = kernel_defines(s, dtype, c);
  const std::uint64_t x_off = x.elem_offset(elem_bytes(dtype));
  const cl_uint T = cl_uint(s.context), Tp = cl_uint(padded_context(s)), H = cl_uint(s.heads);
  // Work-groups of up to 16 rows (of 16-row blocks): PoCL pays a fixed cost per work-group, which
  // one row each made a large share of these short kernels at short contexts.
  if (rows.buffer) {
    cl::Kernel k = env.kernels.kernel("attention", "attention_stage", defines);
    cl::set_args(k.get(), x.buffer, x_off, rows.buffer, rows.elem_offset(), T, Tp, H);
    list.push_back(grid(std::move(k), Tp, s.batch * s.heads, 16));
  }
  if (trans.buffer) {
    cl::Kernel k = env.kernels.kernel("attention", "attention_stage_t", defines);
    cl::set_args(k.get(), x.buffer, x_off, trans.buffer, trans.elem_offset(), T, Tp, H);
    list.push_back(grid(std::move(k), Tp / 16, s.batch * s.heads, std::gcd<std::size_t>(Tp / 16, 16)));
  }
}

// A STAGE_LOCAL kernel's launch (attention.cl): a work-item per head, its arguments the operands
// given, then its local memory (`local_floats`), T, Tp, H, the scale and the dropout's five.
template <class... Operands>
KernelLaunch local_head_launch(OpEnv& env, const AttentionShape& s, const std::string& defines, const char* name,
                               std::size_t local_floats, float scale, const AttentionKernelDropout& dr,
                               const Operands&... operands) {
  cl::Kernel k = env.kernels.kernel("attention", name, defines + " -DSTAGE_LOCAL");
  cl::set_args(k.get(), operands..., cl::LocalBytes{local_floats * sizeof(float)}, cl_uint(s.context),
               cl_uint(padded_context(s)), cl_uint(s.heads), scale, dr.seed, dr.threshold, dr.inv_keep, cl_uint(0),
               cl_uint(0));
  KernelLaunch l = grid(std::move(k), s.batch * s.heads, 1, 1);
  // step_lo follows the local memory, T, Tp, H, the scale, the seed, the threshold and inv_keep.
  attention_step_args(l, cl_uint(sizeof...(operands) + 8), dr);
  return l;
}

}  // namespace

void check_attention_shape(const AttentionShape& s) {
  if (s.batch == 0 || s.context == 0 || s.heads == 0 || s.head_dim == 0) {
    throw std::invalid_argument(
        fmt::format("attention: batch ({}), context ({}), heads ({}) and head dimension ({}) "
                    "must be at least 1",
                    s.batch, s.context, s.heads, s.head_dim));
  }
  if (s.head_dim > attention_max_head_dim) {
    throw std::invalid_argument(fmt::format(
        "attention: head dimension {} is past the fused kernels' limit of {} (width / heads); use more heads, or the "
        "unfused attention (ferry train --attention unfused, models::GptConfig::fused_attention = false)",
        s.head_dim, attention_max_head_dim));
  }
  const double rows = double(s.batch) * s.heads * padded_context(s) * padded_dim(s);
  if (rows > double(std::numeric_limits<cl_uint>::max()) || s.context > (std::size_t(1) << 24)) {
    throw std::invalid_argument(fmt::format(
        "attention: batch {} x heads {} x context {} x head dimension {} is past 32-bit indexing (2^32-1 elements)",
        s.batch, s.heads, s.context, s.head_dim));
  }
}

AttentionKernelDropout attention_kernel_dropout(const AttentionDropout& d) {
  if (d.p == 0.0f) return {};
  return {d.seed, dropout_threshold(d.p), static_cast<float>(1.0 / (1.0 - double(d.p)))};
}

void attention_step_args(KernelLaunch& l, cl_uint step_arg, const AttentionKernelDropout& dr) {
  if (dr.threshold != 0) dropout_step_args(l, step_arg - 3, dr.seed);
}

std::string attention_kernel_description(OpEnv& env, const AttentionShape& s, const AttentionOptions& o) {
  return choose_config(env, s, o).text();
}

std::size_t attention_forward_scratch_elems(OpEnv& env, const AttentionShape& s, const AttentionOptions& o) {
  check_attention_shape(s);
  const AttentionConfig c = choose_config(env, s, o);
  if (c.family == Family::gemm) return attention_gemm_forward_scratch(env, s, c.mib);
  if (!c.cpu() || stages_locally(env, s, c)) return 0;
  const std::size_t heads = s.batch * s.heads, tp = padded_context(s);
  return heads * tp * s.head_dim + heads * tp * padded_dim(s);  // kᵀ, v rows
}

std::size_t attention_backward_scratch_elems(OpEnv& env, const AttentionShape& s, const AttentionOptions& o) {
  check_attention_shape(s);
  const std::size_t delta = round_up(s.rows(), 64);
  const AttentionConfig c = choose_config(env, s, o);
  if (stages_locally(env, s, c)) return 0;  // all of it in local memory
  if (c.family == Family::gemm) return delta + attention_gemm_backward_scratch(env, s, c.mib);
  if (!c.cpu()) return delta;
  const std::size_t heads = s.batch * s.heads, tp = padded_context(s);
  // delta, kᵀ, vᵀ, then rows of k, q and do; the one-pass backward's f32 dq rows
  return delta + 2 * heads * tp * s.head_dim + heads * tp * padded_dim(s) * (c.pass == 1 ? 4 : 3);
}

LaunchList attention_forward(OpEnv& env, const AttentionShape& s, DType dtype, float scale,
                             const AttentionDropout& dropout, DeviceSpan q, DeviceSpan k, DeviceSpan v, DeviceSpan o,
                             DeviceSpan lse, DeviceSpan scratch, const AttentionOptions& options) {
  check_attention_shape(s);
  const AttentionConfig c = choose_config(env, s, options);
  const AttentionKernelDropout dr = attention_kernel_dropout(dropout);
  const std::size_t eb = elem_bytes(dtype), heads = s.batch * s.heads, tp = padded_context(s);
  const std::string defines = kernel_defines(s, dtype, c);
  LaunchList list;
  if (stages_locally(env, s, c)) {
    list.push_back(local_head_launch(env, s, defines, "attention_forward_local_cpu", local_forward_floats(s), scale, dr,
                                     q.buffer, q.elem_offset(eb), k.buffer, k.elem_offset(eb), v.buffer,
                                     v.elem_offset(eb), o.buffer, o.elem_offset(eb), lse.buffer, lse.elem_offset()));
    return list;
  }
  if (c.cpu()) {
    const DeviceSpan kt = scratch, vr = scratch.advanced(heads * tp * s.head_dim * sizeof(float));
    stage(list, env, s, dtype, c, k, {}, kt);
    stage(list, env, s, dtype, c, v, vr, {});
    cl::Kernel kn = env.kernels.kernel("attention", "attention_forward_cpu", defines);
    cl::set_args(kn.get(), q.buffer, q.elem_offset(eb), kt.buffer, kt.elem_offset(), vr.buffer, vr.elem_offset(),
                 o.buffer, o.elem_offset(eb), lse.buffer, lse.elem_offset(), cl_uint(s.context), cl_uint(tp),
                 cl_uint(s.heads), scale, dr.seed, dr.threshold, dr.inv_keep, cl_uint(0), cl_uint(0));
    KernelLaunch l = grid(std::move(kn), (s.context + c.qb - 1) / c.qb, heads, 1);
    attention_step_args(l, 17, dr);
    list.push_back(std::move(l));
    return list;
  }
  if (c.family == Family::gemm) {
    attention_gemm_forward(list, env, s, dtype, c.mib, scale, dr, q, k, v, o, lse, scratch);
    return list;
  }
  if (c.family == Family::blocked) {
    BlockedBuild b = build_blocked(env, s, dtype, c, BlockedKernel::forward);
    cl::set_args(b.kernel.get(), q.buffer, q.elem_offset(eb), k.buffer, k.elem_offset(eb), v.buffer, v.elem_offset(eb),
                 o.buffer, o.elem_offset(eb), lse.buffer, lse.elem_offset(), cl_uint(s.context), cl_uint(s.heads),
                 scale, dr.seed, dr.threshold, dr.inv_keep, cl_uint(0), cl_uint(0));
    KernelLaunch l = blocked_grid(std::move(b), s, heads);
    attention_step_args(l, 16, dr);
    list.push_back(std::move(l));
    return list;
  }
  cl::Kernel kn = env.kernels.kernel("attention", "attention_forward_tiled", defines);
  check_group(kn, env, c.bq, "attention_forward_tiled", c);
  cl::set_args(kn.get(), q.buffer, q.elem_offset(eb), k.buffer, k.elem_offset(eb), v.buffer, v.elem_offset(eb),
               o.buffer, o.elem_offset(eb), lse.buffer, lse.elem_offset(), cl_uint(s.context), cl_uint(s.heads), scale,
               dr.seed, dr.threshold, dr.inv_keep, cl_uint(0), cl_uint(0));
  KernelLaunch l = grid(std::move(kn), round_up(s.context, c.bq), heads, c.bq);
  attention_step_args(l, 16, dr);
  list.push_back(std::move(l));
  return list;
}

LaunchList attention_backward(OpEnv& env, const AttentionShape& s, DType dtype, float scale,
                              const AttentionDropout& dropout, DeviceSpan q, DeviceSpan k, DeviceSpan v, DeviceSpan o,
                              DeviceSpan lse, DeviceSpan dout, DeviceSpan dq, DeviceSpan dk, DeviceSpan dv,
                              DeviceSpan scratch, const AttentionOptions& options) {
  check_attention_shape(s);
  const AttentionConfig c = choose_config(env, s, options);
  const AttentionKernelDropout dr = attention_kernel_dropout(dropout);
  const std::size_t eb = elem_bytes(dtype), heads = s.batch * s.heads, tp = padded_context(s);
  const std::string defines = kernel_defines(s, dtype, c);
  LaunchList list;
  if (stages_locally(env, s, c)) {
    list.push_back(local_head_launch(env, s, defines, "attention_backward_head_local_cpu", local_backward_floats(s),
                                     scale, dr, q.buffer, q.elem_offset(eb), k.buffer, k.elem_offset(eb), v.buffer,
                                     v.elem_offset(eb), o.buffer, o.elem_offset(eb), dout.buffer, dout.elem_offset(eb),
                                     lse.buffer, lse.elem_offset(), dq.buffer, dq.elem_offset(eb), dk.buffer,
                                     dk.elem_offset(eb), dv.buffer, dv.elem_offset(eb)));
    return list;
  }
  const DeviceSpan delta = scratch;
  {
    cl::Kernel kn = env.kernels.kernel("attention", "attention_delta", defines);
    cl::set_args(kn.get(), o.buffer, o.elem_offset(eb), dout.buffer, dout.elem_offset(eb), delta.buffer,
                 delta.elem_offset(), cl_uint(s.context), cl_uint(s.heads));
    // Rows in work-groups of 64, as elementwise_launch takes elements (the kernel skips rows past T).
    list.push_back(grid(std::move(kn), round_up(s.context, 64), heads, 64));
  }
  if (c.cpu()) {
    const std::size_t t_elems = heads * tp * s.head_dim;
    const DeviceSpan kt = scratch.advanced(round_up(s.rows(), 64) * sizeof(float));
    const std::size_t row_bytes = heads * tp * padded_dim(s) * sizeof(float);
    const DeviceSpan vt = kt.advanced(t_elems * sizeof(float)), kr = vt.advanced(t_elems * sizeof(float));
    const DeviceSpan qr = kr.advanced(row_bytes), dor = qr.advanced(row_bytes);
    stage(list, env, s, dtype, c, k, kr, kt);
    stage(list, env, s, dtype, c, v, {}, vt);
    // q and do as f32 rows: the key blocks read every later query's rows, contiguous in place
    // (copied out of the [B, T, H D] tensors per key block they missed the caches); the dq pass
    // reads them too.
    stage(list, env, s, dtype, c, q, qr, {});
    stage(list, env, s, dtype, c, dout, dor, {});
    if (c.pass == 1) {
      const DeviceSpan dq_acc = dor.advanced(row_bytes);
      cl::Kernel kh = env.kernels.kernel("attention", "attention_backward_head_cpu", defines);
      cl::set_args(kh.get(), qr.buffer, qr.elem_offset(), dor.buffer, dor.elem_offset(), kt.buffer, kt.elem_offset(),
                   vt.buffer, vt.elem_offset(), kr.buffer, kr.elem_offset(), lse.buffer, lse.elem_offset(),
                   delta.buffer, delta.elem_offset(), dq_acc.buffer, dq_acc.elem_offset(), dq.buffer,
                   dq.elem_offset(eb), dk.buffer, dk.elem_offset(eb), dv.buffer, dv.elem_offset(eb), cl_uint(s.context),
                   cl_uint(tp), cl_uint(s.heads), scale, dr.seed, dr.threshold, dr.inv_keep, cl_uint(0), cl_uint(0));
      KernelLaunch l = grid(std::move(kh), heads, 1, 1);
      attention_step_args(l, 29, dr);
      list.push_back(std::move(l));
      return list;
    }
    cl::Kernel kv = env.kernels.kernel("attention", "attention_backward_kv_cpu", defines);
    cl::set_args(kv.get(), qr.buffer, qr.elem_offset(), dor.buffer, dor.elem_offset(), kt.buffer, kt.elem_offset(),
                 vt.buffer, vt.elem_offset(), lse.buffer, lse.elem_offset(), delta.buffer, delta.elem_offset(),
                 dk.buffer, dk.elem_offset(eb), dv.buffer, dv.elem_offset(eb), cl_uint(s.context), cl_uint(tp),
                 cl_uint(s.heads), scale, dr.seed, dr.threshold, dr.inv_keep, cl_uint(0), cl_uint(0));
    KernelLaunch lkv = grid(std::move(kv), tp / 16, heads, 1);
    attention_step_args(lkv, 23, dr);
    list.push_back(std::move(lkv));
    cl::Kernel kq = env.kernels.kernel("attention", "attention_backward_q_cpu", defines);
    cl::set_args(kq.get(), qr.buffer, qr.elem_offset(), dor.buffer, dor.elem_offset(), kt.buffer, kt.elem_offset(),
                 vt.buffer, vt.elem_offset(), kr.buffer, kr.elem_offset(), lse.buffer, lse.elem_offset(), delta.buffer,
                 delta.elem_offset(), dq.buffer, dq.elem_offset(eb), cl_uint(s.context), cl_uint(tp), cl_uint(s.heads),
                 scale, dr.seed, dr.threshold, dr.inv_keep, cl_uint(0), cl_uint(0));
    KernelLaunch lq = grid(std::move(kq), (s.context + c.qb - 1) / c.qb, heads, 1);
    attention_step_args(lq, 23, dr);
    list.push_back(std::move(lq));
    return list;
  }
  if (c.family == Family::gemm) {
    attention_gemm_backward(list, env, s, dtype, c.mib, scale, dr, q, k, v, dout, lse, delta, dq, dk, dv,
                            scratch.advanced(round_up(s.rows(), 64) * sizeof(float)));
    return list;
  }
  if (c.family == Family::blocked) {
    BlockedBuild kv = build_blocked(env, s, dtype, c, BlockedKernel::dkv);
    cl::set_args(kv.kernel.get(), q.buffer, q.elem_offset(eb), k.buffer, k.elem_offset(eb), v.buffer, v.elem_offset(eb),
                 dout.buffer, dout.elem_offset(eb), lse.buffer, lse.elem_offset(), delta.buffer, delta.elem_offset(),
                 dk.buffer, dk.elem_offset(eb), dv.buffer, dv.elem_offset(eb), cl_uint(s.context), cl_uint(s.heads),
                 scale, dr.seed, dr.threshold, dr.inv_keep, cl_uint(0), cl_uint(0));
    KernelLaunch lkv = blocked_grid(std::move(kv), s, heads);
    attention_step_args(lkv, 22, dr);
    list.push_back(std::move(lkv));
    BlockedBuild dqk = build_blocked(env, s, dtype, c, BlockedKernel::dq);
    cl::set_args(dqk.kernel.get(), q.buffer, q.elem_offset(eb), k.buffer, k.elem_offset(eb), v.buffer,
                 v.elem_offset(eb), dout.buffer, dout.elem_offset(eb), lse.buffer, lse.elem_offset(), delta.buffer,
                 delta.elem_offset(), dq.buffer, dq.elem_offset(eb), cl_uint(s.context), cl_uint(s.heads), scale,
                 dr.seed, dr.threshold, dr.inv_keep, cl_uint(0), cl_uint(0));
    KernelLaunch lq = blocked_grid(std::move(dqk), s, heads);
    attention_step_args(lq, 20, dr);
    list.push_back(std::move(lq));
    return list;
  }
  cl::Kernel kv = env.kernels.kernel("attention", "attention_backward_kv_tiled", defines);
  check_group(kv, env, c.bq, "attention_backward_kv_tiled", c);
  cl::set_args(kv.get(), q.buffer, q.elem_offset(eb), k.buffer, k.elem_offset(eb), v.buffer, v.elem_offset(eb),
               dout.buffer, dout.elem_offset(eb), lse.buffer, lse.elem_offset(), delta.buffer, delta.elem_offset(),
               dk.buffer, dk.elem_offset(eb), dv.buffer, dv.elem_offset(eb), cl_uint(s.context), cl_uint(s.heads),
               scale, dr.seed, dr.threshold, dr.inv_keep, cl_uint(0), cl_uint(0));
  KernelLaunch lkv = grid(std::move(kv), round_up(s.context, c.bq), heads, c.bq);
  attention_step_args(lkv, 22, dr);
  list.push_back(std::move(lkv));
  cl::Kernel kq = env.kernels.kernel("attention", "attention_backward_q_tiled", defines);
  check_group(kq, env, c.bq, "attention_backward_q_tiled", c);
  cl::set_args(kq.get(), q.buffer, q.elem_offset(eb), k.buffer, k.elem_offset(eb), v.buffer, v.elem_offset(eb),
               dout.buffer, dout.elem_offset(eb), lse.buffer, lse.elem_offset(), delta.buffer, delta.elem_offset(),
               dq.buffer, dq.elem_offset(eb), cl_uint(s.context), cl_uint(s.heads), scale, dr.seed, dr.threshold,
               dr.inv_keep, cl_uint(0), cl_uint(0));
  KernelLaunch lq = grid(std::move(kq), round_up(s.context, c.bq), heads, c.bq);
  attention_step_args(lq, 20, dr);
  list.push_back(std::move(lq));
  return list;
}

}  // namespace ferry::ops
