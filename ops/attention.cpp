// Binding of the fused attention kernels (ops/kernels/attention.cl).
#include "ops/attention.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "ferry/cl/error.hpp"

namespace ferry::ops {
namespace {

// The kernel family and its parameters: cpu (RB) or tiled (BQ, BK).
struct AttentionConfig {
  bool cpu = true;
  std::size_t rb = 6, qb = 48;   // cpu: query rows per register tile (at most 8), per work-item
  std::size_t kb = 64;           // cpu forward: keys per online-softmax block (a multiple of 16)
  std::size_t pass = 0;          // cpu backward: 1 (a work-item per head) or 2 (dk dv, then dq); 0: by heads
  std::size_t bq = 64, bk = 32;  // tiled: queries (keys) per work-group, keys (queries) per local tile

  std::string text() const {
    return cpu ? fmt::format("cpu RB={} QB={} KB={} PASS={}", rb, qb, kb, pass)
               : fmt::format("tiled BQ={} BK={}", bq, bk);
  }
};

std::size_t padded_dim(const AttentionShape& s) {
  return round_up(s.head_dim, 16);
}
std::size_t padded_context(const AttentionShape& s) {
  return round_up(s.context, 16);
}

AttentionConfig parse_config(const std::string& spec) {
  std::istringstream in(spec);
  std::string family;
  in >> family;
  AttentionConfig c;
  if (family == "cpu") {
    c.cpu = true;
  } else if (family == "tiled") {
    c.cpu = false;
  } else {
    throw std::invalid_argument(fmt::format(
        "attention: unknown kernel '{}' (expected \"cpu RB=n QB=n KB=n PASS=1|2\" or \"tiled BQ=n BK=n\")", spec));
  }
  for (std::string kv; in >> kv;) {
    const auto eq = kv.find('=');
    std::size_t value = 0;
    try {
      value = eq == std::string::npos ? 0 : std::stoul(kv.substr(eq + 1));
    } catch (const std::exception&) {
      value = 0;
    }
    const std::string key = kv.substr(0, eq);
    if (value == 0 || value > 256) {
      throw std::invalid_argument(
          fmt::format("attention: kernel parameter '{}' in '{}' needs a value in 1..256", kv, spec));
    }
    if (c.cpu && key == "RB") {
      c.rb = value;
    } else if (c.cpu && key == "QB") {
      c.qb = value;
    } else if (c.cpu && key == "KB") {
      c.kb = value;
    } else if (c.cpu && key == "PASS" && value <= 2) {
      c.pass = value;
    } else if (!c.cpu && key == "BQ") {
      c.bq = value;
    } else if (!c.cpu && key == "BK") {
      c.bk = value;
    } else {
      throw std::invalid_argument(fmt::format("attention: '{}' is not a parameter of the {} kernel", key, family));
    }
  }
  if (c.cpu && (c.rb > 8 || c.qb % c.rb != 0 || c.kb % 16 != 0)) {
    throw std::invalid_argument(fmt::format(
        "attention: '{}': RB (rows per register tile) is at most 8, QB a multiple of it and KB a multiple of 16",
        spec));
  }
  return c;
}

// Defaults: on CPU devices register tiles of 6 query rows (the most whose scores fit AVX2's sixteen
// vector registers: 8 spilled), 48 rows per work-item and softmax blocks of 64 keys (measured on
// PoCL's pthread device against RB 2, 4 and 8, QB 30 and 48, KB 16 and 128: bench/RESULTS.md,
// "Attention's CPU kernels fitted to AVX2"); elsewhere 64 queries
// per work-group and 32 keys per tile, fewer where the device's work-group limit or its local
// memory asks.
AttentionConfig choose_config(OpEnv& env, const AttentionShape& s, const AttentionOptions& o) {
  AttentionConfig c = o.kernel.empty() ? AttentionConfig{env.device().is_cpu()} : parse_config(o.kernel);
  // The one-pass backward runs a work-item per head: it takes over once there are four heads per
  // compute unit (fewer would leave cores idle), and computes five products instead of seven.
  if (c.cpu && c.pass == 0)
    c.pass = s.batch * s.heads >= 4 * std::max<std::size_t>(env.device().compute_units, 1) ? 1 : 2;
  if (!c.cpu && o.kernel.empty()) {
    c.bq = std::min<std::size_t>(c.bq, std::max<std::size_t>(env.device().max_work_group_size, 1));
    const std::uint64_t local = env.device().local_mem_bytes;
    while (c.bk > 8 && (2 * c.bk * s.head_dim + 2 * c.bk) * sizeof(float) > local) c.bk /= 2;
  }
  return c;
}

std::string kernel_defines(const AttentionShape& s, DType dtype, const AttentionConfig& c) {
  std::string d = fmt::format("{} -DHEAD_DIM={} -DDP={}", dtype_define(dtype), s.head_dim, padded_dim(s));
  if (c.cpu) return d + fmt::format(" -DRB={} -DQB={} -DKB={}", c.rb, c.qb, c.kb);
  return d + fmt::format(" -DBQ={} -DBK={}", c.bq, c.bk);
}

std::size_t elem_bytes(DType t) {
  return dtype_bytes(t);
}

// The dropout arguments every main kernel ends with: seed, threshold, inv_keep, step_lo, step_hi;
// the last two set per step.
struct DropoutArgs {
  cl_uint seed = 0, threshold = 0;
  float inv_keep = 1.0f;
};
DropoutArgs dropout_args(const AttentionDropout& d) {
  if (d.p == 0.0f) return {};
  return {d.seed, dropout_threshold(d.p), static_cast<float>(1.0 / (1.0 - double(d.p)))};
}
void set_step_args(KernelLaunch& l, cl_uint step_arg, bool dropout) {
  if (!dropout) return;
  l.per_step = [step_arg](cl_kernel kernel, const StepInfo& s) {
    const auto lo = static_cast<cl_uint>(s.step), hi = static_cast<cl_uint>(s.step >> 32);
    FERRY_CL(clSetKernelArg(kernel, step_arg, sizeof(cl_uint), &lo));
    FERRY_CL(clSetKernelArg(kernel, step_arg + 1, sizeof(cl_uint), &hi));
  };
}

// A tiled kernel runs work-groups of exactly BQ work-items (its loops stride by BQ): refuse a
// kernel the device cannot run that wide instead of letting the enqueue fail.
void check_group(const cl::Kernel& k, OpEnv& env, const AttentionConfig& c, const char* name) {
  const std::size_t limit = kernel_group_limit(k, env.device());
  if (limit < c.bq) {
    throw std::invalid_argument(
        fmt::format("attention: {} runs work-groups of BQ = {} work-items, but {} allows {} for it; pick a smaller BQ "
                    "(AttentionOptions::kernel, ferry-bench attention --kernel \"tiled BQ={} BK={}\")",
                    name, c.bq, env.device().name, limit, limit, c.bk));
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

// Stages x (k, v, q or do) per head as f32 rows [BH, Tp, DP] (rows) and/or transposed [BH, D, Tp] (trans); an
// operand without a buffer is not staged.
void stage(LaunchList& list, OpEnv& env, const AttentionShape& s, DType dtype, const AttentionConfig& c, DeviceSpan x,
           DeviceSpan rows, DeviceSpan trans) {
  const std::string defines = kernel_defines(s, dtype, c);
  const std::uint64_t x_off = x.elem_offset(elem_bytes(dtype));
  const cl_uint T = cl_uint(s.context), Tp = cl_uint(padded_context(s)), H = cl_uint(s.heads);
  if (rows.buffer) {
    cl::Kernel k = env.kernels.kernel("attention", "attention_stage", defines);
    cl::set_args(k.get(), x.buffer, x_off, rows.buffer, rows.elem_offset(), T, Tp, H);
    list.push_back(grid(std::move(k), padded_context(s), s.batch * s.heads, 1));
  }
  if (trans.buffer) {
    cl::Kernel k = env.kernels.kernel("attention", "attention_stage_t", defines);
    cl::set_args(k.get(), x.buffer, x_off, trans.buffer, trans.elem_offset(), T, Tp, H);
    list.push_back(grid(std::move(k), padded_context(s) / 16, s.batch * s.heads, 1));
  }
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

std::string attention_kernel_description(OpEnv& env, const AttentionShape& s, const AttentionOptions& o) {
  return choose_config(env, s, o).text();
}

std::size_t attention_forward_scratch_elems(OpEnv& env, const AttentionShape& s, const AttentionOptions& o) {
  check_attention_shape(s);
  if (!choose_config(env, s, o).cpu) return 0;
  const std::size_t heads = s.batch * s.heads, tp = padded_context(s);
  return heads * tp * s.head_dim + heads * tp * padded_dim(s);  // kᵀ, v rows
}

std::size_t attention_backward_scratch_elems(OpEnv& env, const AttentionShape& s, const AttentionOptions& o) {
  check_attention_shape(s);
  const std::size_t delta = round_up(s.rows(), 64);
  const AttentionConfig c = choose_config(env, s, o);
  if (!c.cpu) return delta;
  const std::size_t heads = s.batch * s.heads, tp = padded_context(s);
  // delta, kᵀ, vᵀ, then rows of k, q and do; the one-pass backward's f32 dq rows
  return delta + 2 * heads * tp * s.head_dim + heads * tp * padded_dim(s) * (c.pass == 1 ? 4 : 3);
}

LaunchList attention_forward(OpEnv& env, const AttentionShape& s, DType dtype, float scale,
                             const AttentionDropout& dropout, DeviceSpan q, DeviceSpan k, DeviceSpan v, DeviceSpan o,
                             DeviceSpan lse, DeviceSpan scratch, const AttentionOptions& options) {
  check_attention_shape(s);
  const AttentionConfig c = choose_config(env, s, options);
  const DropoutArgs dr = dropout_args(dropout);
  const std::size_t eb = elem_bytes(dtype), heads = s.batch * s.heads, tp = padded_context(s);
  const std::string defines = kernel_defines(s, dtype, c);
  LaunchList list;
  if (c.cpu) {
    const DeviceSpan kt = scratch, vr = scratch.advanced(heads * tp * s.head_dim * sizeof(float));
    stage(list, env, s, dtype, c, k, {}, kt);
    stage(list, env, s, dtype, c, v, vr, {});
    cl::Kernel kn = env.kernels.kernel("attention", "attention_forward_cpu", defines);
    cl::set_args(kn.get(), q.buffer, q.elem_offset(eb), kt.buffer, kt.elem_offset(), vr.buffer, vr.elem_offset(),
                 o.buffer, o.elem_offset(eb), lse.buffer, lse.elem_offset(), cl_uint(s.context), cl_uint(tp),
                 cl_uint(s.heads), scale, dr.seed, dr.threshold, dr.inv_keep, cl_uint(0), cl_uint(0));
    KernelLaunch l = grid(std::move(kn), (s.context + c.qb - 1) / c.qb, heads, 1);
    set_step_args(l, 17, dr.threshold != 0);
    list.push_back(std::move(l));
    return list;
  }
  cl::Kernel kn = env.kernels.kernel("attention", "attention_forward_tiled", defines);
  check_group(kn, env, c, "attention_forward_tiled");
  cl::set_args(kn.get(), q.buffer, q.elem_offset(eb), k.buffer, k.elem_offset(eb), v.buffer, v.elem_offset(eb),
               o.buffer, o.elem_offset(eb), lse.buffer, lse.elem_offset(), cl_uint(s.context), cl_uint(s.heads), scale,
               dr.seed, dr.threshold, dr.inv_keep, cl_uint(0), cl_uint(0));
  KernelLaunch l = grid(std::move(kn), round_up(s.context, c.bq), heads, c.bq);
  set_step_args(l, 16, dr.threshold != 0);
  list.push_back(std::move(l));
  return list;
}

LaunchList attention_backward(OpEnv& env, const AttentionShape& s, DType dtype, float scale,
                              const AttentionDropout& dropout, DeviceSpan q, DeviceSpan k, DeviceSpan v, DeviceSpan o,
                              DeviceSpan lse, DeviceSpan dout, DeviceSpan dq, DeviceSpan dk, DeviceSpan dv,
                              DeviceSpan scratch, const AttentionOptions& options) {
  check_attention_shape(s);
  const AttentionConfig c = choose_config(env, s, options);
  const DropoutArgs dr = dropout_args(dropout);
  const std::size_t eb = elem_bytes(dtype), heads = s.batch * s.heads, tp = padded_context(s);
  const std::string defines = kernel_defines(s, dtype, c);
  const DeviceSpan delta = scratch;
  LaunchList list;
  {
    cl::Kernel kn = env.kernels.kernel("attention", "attention_delta", defines);
    cl::set_args(kn.get(), o.buffer, o.elem_offset(eb), dout.buffer, dout.elem_offset(eb), delta.buffer,
                 delta.elem_offset(), cl_uint(s.context), cl_uint(s.heads));
    list.push_back(grid(std::move(kn), s.context, heads, 0));
    list.back().local = {0, 0, 0};
  }
  if (c.cpu) {
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
      set_step_args(l, 29, dr.threshold != 0);
      list.push_back(std::move(l));
      return list;
    }
    cl::Kernel kv = env.kernels.kernel("attention", "attention_backward_kv_cpu", defines);
    cl::set_args(kv.get(), qr.buffer, qr.elem_offset(), dor.buffer, dor.elem_offset(), kt.buffer, kt.elem_offset(),
                 vt.buffer, vt.elem_offset(), lse.buffer, lse.elem_offset(), delta.buffer, delta.elem_offset(),
                 dk.buffer, dk.elem_offset(eb), dv.buffer, dv.elem_offset(eb), cl_uint(s.context), cl_uint(tp),
                 cl_uint(s.heads), scale, dr.seed, dr.threshold, dr.inv_keep, cl_uint(0), cl_uint(0));
    KernelLaunch lkv = grid(std::move(kv), tp / 16, heads, 1);
    set_step_args(lkv, 23, dr.threshold != 0);
    list.push_back(std::move(lkv));
    cl::Kernel kq = env.kernels.kernel("attention", "attention_backward_q_cpu", defines);
    cl::set_args(kq.get(), qr.buffer, qr.elem_offset(), dor.buffer, dor.elem_offset(), kt.buffer, kt.elem_offset(),
                 vt.buffer, vt.elem_offset(), kr.buffer, kr.elem_offset(), lse.buffer, lse.elem_offset(), delta.buffer,
                 delta.elem_offset(), dq.buffer, dq.elem_offset(eb), cl_uint(s.context), cl_uint(tp), cl_uint(s.heads),
                 scale, dr.seed, dr.threshold, dr.inv_keep, cl_uint(0), cl_uint(0));
    KernelLaunch lq = grid(std::move(kq), (s.context + c.qb - 1) / c.qb, heads, 1);
    set_step_args(lq, 23, dr.threshold != 0);
    list.push_back(std::move(lq));
    return list;
  }
  cl::Kernel kv = env.kernels.kernel("attention", "attention_backward_kv_tiled", defines);
  check_group(kv, env, c, "attention_backward_kv_tiled");
  cl::set_args(kv.get(), q.buffer, q.elem_offset(eb), k.buffer, k.elem_offset(eb), v.buffer, v.elem_offset(eb),
               dout.buffer, dout.elem_offset(eb), lse.buffer, lse.elem_offset(), delta.buffer, delta.elem_offset(),
               dk.buffer, dk.elem_offset(eb), dv.buffer, dv.elem_offset(eb), cl_uint(s.context), cl_uint(s.heads),
               scale, dr.seed, dr.threshold, dr.inv_keep, cl_uint(0), cl_uint(0));
  KernelLaunch lkv = grid(std::move(kv), round_up(s.context, c.bq), heads, c.bq);
  set_step_args(lkv, 22, dr.threshold != 0);
  list.push_back(std::move(lkv));
  cl::Kernel kq = env.kernels.kernel("attention", "attention_backward_q_tiled", defines);
  check_group(kq, env, c, "attention_backward_q_tiled");
  cl::set_args(kq.get(), q.buffer, q.elem_offset(eb), k.buffer, k.elem_offset(eb), v.buffer, v.elem_offset(eb),
               dout.buffer, dout.elem_offset(eb), lse.buffer, lse.elem_offset(), delta.buffer, delta.elem_offset(),
               dq.buffer, dq.elem_offset(eb), cl_uint(s.context), cl_uint(s.heads), scale, dr.seed, dr.threshold,
               dr.inv_keep, cl_uint(0), cl_uint(0));
  KernelLaunch lq = grid(std::move(kq), round_up(s.context, c.bq), heads, c.bq);
  set_step_args(lq, 20, dr.threshold != 0);
  list.push_back(std::move(lq));
  return list;
}

}  // namespace ferry::ops
