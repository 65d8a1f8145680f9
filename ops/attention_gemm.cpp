// The fused attention's gemm family (ops/attention_gemm.hpp).
#include "ops/attention_gemm.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "ferry/cl/error.hpp"
#include "ops/gemm.hpp"

namespace ferry::ops {

namespace {

// The sizes every part of the family shares: Tp and DP (context and head dimension rounded up to
// 16, as the staged rows of the other families), the staged rows of one operand, and one head's
// score matrix.
struct Sizes {
  std::size_t heads, tp, dp, rows, scores;
  explicit Sizes(const AttentionShape& s)
      : heads(s.batch * s.heads),
        tp(round_up(s.context, 16)),
        dp(round_up(s.head_dim, 16)),
        rows(heads * tp * dp),
        scores(tp * tp) {}
};

// The products of a chunk of `n` heads, each per head: the scores q kᵀ [Tp, Tp] (and do vᵀ),
// o = p v and dq = ds k [Tp, DP], dv = (p keep)ᵀ do and dk = dsᵀ q [Tp, DP].
GemmShape scores_shape(const Sizes& z, std::size_t n) {
  GemmShape g{z.tp, z.tp, z.dp, false, true};
  g.batch = n;
  return g;
}
GemmShape rows_shape(const Sizes& z, std::size_t n, bool trans_a) {
  GemmShape g{z.tp, z.dp, z.tp, trans_a, false};
  g.batch = n;
  return g;
}

std::string defines(const AttentionShape& s, DType dtype) {
  return fmt::format("{} -DHEAD_DIM={} -DDP={}", dtype_define(dtype), s.head_dim, round_up(s.head_dim, 16));
}

KernelLaunch over_rows(cl::Kernel k, std::size_t x, std::size_t y, std::size_t z) {
  KernelLaunch l;
  l.kernel = std::move(k);
  l.dims = 3;
  l.global = {x, y, z};
  return l;
}

// x [B, T, H D] -> rows [BH, Tp, DP] (f32, zero-padded), and back.
void stage(LaunchList& list, OpEnv& env, const AttentionShape& s, DType dtype, DeviceSpan x, DeviceSpan rows) {
  const Sizes z(s);
  cl::Kernel k = env.kernels.kernel("attention_gemm", "attention_gemm_stage", defines(s, dtype));
  cl::set_args(k.get(), x.buffer, x.elem_offset(dtype_bytes(dtype)), rows.buffer, rows.elem_offset(),
               cl_uint(s.context), cl_uint(z.tp), cl_uint(s.heads));
  list.push_back(over_rows(std::move(k), z.dp, z.tp, z.heads));
}
void unstage(LaunchList& list, OpEnv& env, const AttentionShape& s, DType dtype, DeviceSpan rows, DeviceSpan x) {
  const Sizes z(s);
  cl::Kernel k = env.kernels.kernel("attention_gemm", "attention_gemm_unstage", defines(s, dtype));
  cl::set_args(k.get(), rows.buffer, rows.elem_offset(), x.buffer, x.elem_offset(dtype_bytes(dtype)),
               cl_uint(s.context), cl_uint(z.tp), cl_uint(s.heads));
  list.push_back(over_rows(std::move(k), s.head_dim, s.context, z.heads));
}

// The batches the chunks run: `chunk` heads, and the rest in a last, smaller one. Each may split K
// differently (fewer products, fewer tiles), so the GEMMs' scratch is sized for both.
std::vector<std::size_t> chunk_sizes(const Sizes& z, std::size_t chunk) {
  std::vector<std::size_t> sizes{chunk};
  if (z.heads % chunk != 0) sizes.push_back(z.heads % chunk);
  return sizes;
}

// The GEMMs' scratch: the most any of the chunks' products takes (the backward's transposed ones too).
std::size_t products_scratch(OpEnv& env, const Sizes& z, std::size_t chunk, bool backward) {
  std::size_t most = 0;
  for (const std::size_t heads : chunk_sizes(z, chunk)) {
    most = std::max(
        {most, gemm_scratch_elems(env, scores_shape(z, heads)), gemm_scratch_elems(env, rows_shape(z, heads, false))});
    if (backward) most = std::max(most, gemm_scratch_elems(env, rows_shape(z, heads, true)));
  }
  return most;
}

void append(LaunchList& list, LaunchList more) {
  for (KernelLaunch& l : more) list.push_back(std::move(l));
}

std::size_t at(std::size_t floats) {
  return floats * sizeof(float);
}

}  // namespace

std::size_t attention_gemm_chunk_heads(const AttentionShape& s, std::size_t mib, std::size_t buffers) {
  const Sizes z(s);
  const std::size_t per_head = buffers * z.scores * sizeof(float);
  return std::min(z.heads, (mib << 20) / per_head);
}

std::size_t attention_gemm_forward_scratch(OpEnv& env, const AttentionShape& s, std::size_t mib) {
  const Sizes z(s);
  const std::size_t n = attention_gemm_chunk_heads(s, mib, 1);
  if (n == 0) return 0;
  return 4 * z.rows + n * z.scores + products_scratch(env, z, n, false);
}

std::size_t attention_gemm_backward_scratch(OpEnv& env, const AttentionShape& s, std::size_t mib) {
  const Sizes z(s);
  const std::size_t n = attention_gemm_chunk_heads(s, mib, 2);
  if (n == 0) return 0;
  return 7 * z.rows + 2 * n * z.scores + products_scratch(env, z, n, true);
}

void attention_gemm_forward(LaunchList& list, OpEnv& env, const AttentionShape& s, DType dtype, std::size_t mib,
                            float scale, const AttentionKernelDropout& dr, DeviceSpan q, DeviceSpan k, DeviceSpan v,
                            DeviceSpan o, DeviceSpan lse, DeviceSpan scratch) {
  const Sizes z(s);
  const std::size_t chunk = attention_gemm_chunk_heads(s, mib, 1);
  const DeviceSpan qr = scratch, kr = qr.advanced(at(z.rows)), vr = kr.advanced(at(z.rows)),
                   orows = vr.advanced(at(z.rows)), sc = orows.advanced(at(z.rows)),
                   gemm_scratch = sc.advanced(at(chunk * z.scores));
  stage(list, env, s, dtype, q, qr);
  stage(list, env, s, dtype, k, kr);
  stage(list, env, s, dtype, v, vr);
  const std::string d = defines(s, dtype);
  for (std::size_t h0 = 0; h0 < z.heads; h0 += chunk) {
    const std::size_t n = std::min(chunk, z.heads - h0);
    const std::size_t head_rows = at(h0 * z.tp * z.dp);
    append(list, gemm(env, scores_shape(z, n), scale, qr.advanced(head_rows), kr.advanced(head_rows), 0.0f, sc,
                      gemm_scratch));
    cl::Kernel sm = env.kernels.kernel("attention_gemm", "attention_gemm_softmax", d);
    const std::size_t group = row_group_size(sm, env.device(), z.tp);
    cl::set_args(sm.get(), sc.buffer, sc.elem_offset(), lse.buffer, lse.elem_offset(), cl_uint(s.context),
                 cl_uint(z.tp), cl_uint(h0), dr.seed, dr.threshold, dr.inv_keep, cl_uint(0), cl_uint(0),
                 cl::LocalBytes{group * sizeof(float)});
    KernelLaunch l;
    l.kernel = std::move(sm);
    l.global[0] = n * z.tp * group;
    l.local[0] = group;
    attention_step_args(l, 10, dr);
    list.push_back(std::move(l));
    append(list, gemm(env, rows_shape(z, n, false), 1.0f, sc, vr.advanced(head_rows), 0.0f, orows.advanced(head_rows),
                      gemm_scratch));
  }
  unstage(list, env, s, dtype, orows, o);
}

void attention_gemm_backward(LaunchList& list, OpEnv& env, const AttentionShape& s, DType dtype, std::size_t mib,
                             float scale, const AttentionKernelDropout& dr, DeviceSpan q, DeviceSpan k, DeviceSpan v,
                             DeviceSpan dout, DeviceSpan lse, DeviceSpan delta, DeviceSpan dq, DeviceSpan dk,
                             DeviceSpan dv, DeviceSpan scratch) {
  const Sizes z(s);
  const std::size_t chunk = attention_gemm_chunk_heads(s, mib, 2);
  DeviceSpan r[7];  // staged q, k, v, do; dq, dk, dv
  r[0] = scratch;
  for (int i = 1; i < 7; ++i) r[i] = r[i - 1].advanced(at(z.rows));
  const DeviceSpan sc = r[6].advanced(at(z.rows)), dp = sc.advanced(at(chunk * z.scores)),
                   gemm_scratch = dp.advanced(at(chunk * z.scores));
  const DeviceSpan inputs[] = {q, k, v, dout};
  for (int i = 0; i < 4; ++i) stage(list, env, s, dtype, inputs[i], r[i]);
  const std::string d = defines(s, dtype);
  for (std::size_t h0 = 0; h0 < z.heads; h0 += chunk) {
    const std::size_t n = std::min(chunk, z.heads - h0);
    const std::size_t head_rows = at(h0 * z.tp * z.dp);
    auto rows = [&](int i) { return r[i].advanced(head_rows); };
    append(list, gemm(env, scores_shape(z, n), scale, rows(0), rows(1), 0.0f, sc, gemm_scratch));  // s = scale q kᵀ
    append(list, gemm(env, scores_shape(z, n), 1.0f, rows(3), rows(2), 0.0f, dp, gemm_scratch));   // dp = do vᵀ
    cl::Kernel kd = env.kernels.kernel("attention_gemm", "attention_gemm_ds", d);
    cl::set_args(kd.get(), sc.buffer, sc.elem_offset(), dp.buffer, dp.elem_offset(), lse.buffer, lse.elem_offset(),
                 delta.buffer, delta.elem_offset(), cl_uint(s.context), cl_uint(z.tp), cl_uint(h0), dr.seed,
                 dr.threshold, dr.inv_keep, cl_uint(0), cl_uint(0));
    KernelLaunch l;
    l.kernel = std::move(kd);
    l.dims = 2;
    l.global = {z.tp, n * z.tp, 1};
    attention_step_args(l, 14, dr);
    list.push_back(std::move(l));
    append(list, gemm(env, rows_shape(z, n, true), 1.0f, sc, rows(3), 0.0f, rows(6), gemm_scratch));    // dv = pᵀ do
    append(list, gemm(env, rows_shape(z, n, false), scale, dp, rows(1), 0.0f, rows(4), gemm_scratch));  // dq = ds k
    append(list, gemm(env, rows_shape(z, n, true), scale, dp, rows(0), 0.0f, rows(5), gemm_scratch));   // dk = dsᵀ q
  }
  unstage(list, env, s, dtype, r[4], dq);
  unstage(list, env, s, dtype, r[5], dk);
  unstage(list, env, s, dtype, r[6], dv);
}

}  // namespace ferry::ops
