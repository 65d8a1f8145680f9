// Binding of the batched matmul kernels (ops/kernels/matmul.cl): the kernel and its parameters
// come from the device's GEMM tuning data (packed panels on CPUs, local-memory tiles on GPUs).
#include "ferry/ops/matmul.hpp"

#include <fmt/format.h>

#include <limits>
#include <stdexcept>

#include "ferry/cl/error.hpp"
#include "gemm_tiled.hpp"
#include "gemm_tuning.hpp"

namespace ferry::ops {
namespace {

struct MatmulPlan {
  GemmKernelConfig config;
  std::string origin;  // where the choice came from, for the description
};

MatmulPlan plan(OpEnv& env, const MatmulOptions& options) {
  MatmulPlan p;
  if (!options.kernel.empty()) {
    p.config = parse_gemm_kernel_spec(options.kernel, "MatmulOptions::kernel");
    p.origin = "MatmulOptions::kernel";
  } else {
    // The GEMM row's ferry kernel, whatever backend it names: CLBlast's batched GEMM is not bound.
    GemmTuningRow row = gemm_tuning_for(env);
    p.config = std::move(row.config);
    p.origin = fmt::format("{}:{}", row.source, row.line);
  }
  return p;
}

// The panel width 16 nv, nv <= NV, that pads N least (the widest on a tie): N = 48 takes 48, not 64.
std::size_t panel_width(const MatmulShape& s, const GemmKernelConfig& c) {
  const std::size_t max_nv = static_cast<std::size_t>(c.param("NV"));
  std::size_t best = 1, best_pad = std::numeric_limits<std::size_t>::max();
  for (std::size_t nv = 1; nv <= max_nv; ++nv) {
    const std::size_t nb = 16 * nv;
    const std::size_t pad = (s.N + nb - 1) / nb * nb;
    if (pad <= best_pad) {
      best = nv;
      best_pad = pad;
    }
  }
  return 16 * best;
}

// B not transposed and at most this many floats per batch is read in place (no packing): its
// rows stay in cache while a panel walks down them.
constexpr std::size_t direct_b_max_elems = 64 * 1024;

bool direct_b(const MatmulShape& s) {
  return !s.trans_b && s.K * s.N <= direct_b_max_elems;
}

std::size_t packed_elems(const MatmulShape& s, const GemmKernelConfig& c) {
  if (s.K == 0 || s.M == 0 || s.N == 0 || direct_b(s)) return 0;
  const std::size_t nb = panel_width(s, c);
  return s.batch * ((s.N + nb - 1) / nb * nb) * s.K;
}

std::string transpose_defines(const MatmulShape& s) {
  return fmt::format("-DTRANS_A={} -DTRANS_B={}", int(s.trans_a), int(s.trans_b));
}

void check(const MatmulShape& s) {
  constexpr std::size_t max = std::numeric_limits<cl_uint>::max();
  if (s.M > max || s.N > max || s.K > max) {
    throw std::invalid_argument(fmt::format("matmul {}x{}x{}: a dimension beyond 2^32-1", s.M, s.N, s.K));
  }
}

LaunchList bind_packed(OpEnv& env, const MatmulShape& s, const GemmKernelConfig& cfg, float alpha, DeviceSpan a,
                       DeviceSpan b, DeviceSpan c, DeviceSpan scratch) {
  const std::size_t nb = panel_width(s, cfg);
  const std::size_t rb = static_cast<std::size_t>(cfg.param("RB"));
  const std::size_t panels = (s.N + nb - 1) / nb;
  const bool direct = direct_b(s);
  const std::string defines =
      fmt::format("-DRB={} -DNV={} -DDIRECT_B={} {}", rb, nb / 16, int(direct), transpose_defines(s));
  LaunchList list;
  if (s.K > 0 && !direct) {
    if (scratch.buffer == nullptr) {
      throw std::invalid_argument(
          fmt::format("matmul {}x{}x{}x{} ({}): needs {} floats of scratch for packed B, got none", s.batch, s.M, s.N,
                      s.K, cfg.text(), packed_elems(s, cfg)));
    }
    cl::Kernel pack = env.kernels.kernel("matmul", "matmul_pack_b", defines);
    cl::set_args(pack.get(), cl_uint(s.N), cl_uint(s.K), b.buffer, b.elem_offset(), scratch.buffer,
                 scratch.elem_offset());
    KernelLaunch l;
    l.kernel = std::move(pack);
    l.dims = 3;
    // 16 k rows per work-item (PACK_ROWS); transposed B also splits the padded columns into
    // blocks of 16, one per work-item.
    l.global = {(s.K + 15) / 16, s.trans_b ? panels * nb / 16 : 1, s.batch};
    l.local = {1, 1, 1};
    list.push_back(std::move(l));
  }
  cl::Kernel k = env.kernels.kernel("matmul", "matmul_packed", defines);
  // B itself when read in place; with K = 0 nothing is read.
  const DeviceSpan panels_of_b = direct ? b : s.K > 0 ? scratch : c;
  cl_mem packed = panels_of_b.buffer;
  const std::uint64_t packed_off = panels_of_b.elem_offset();
  cl::set_args(k.get(), cl_uint(s.M), cl_uint(s.N), cl_uint(s.K), alpha, a.buffer, a.elem_offset(), packed, packed_off,
               c.buffer, c.elem_offset());
  KernelLaunch l;
  l.kernel = std::move(k);
  l.dims = 3;
  l.global = {(s.M + rb - 1) / rb, panels, s.batch};  // row blocks on dimension 0: neighbours share a panel
  l.local = {1, 1, 1};
  list.push_back(std::move(l));
  return list;
}

// The GEMM's GPU kernel, batched by strides (each product's operands follow the previous one's).
LaunchList bind_tiled(OpEnv& env, const MatmulShape& s, const GemmKernelConfig& cfg, float alpha, DeviceSpan a,
                      DeviceSpan b, DeviceSpan c) {
  const GemmShape g{s.M, s.N, s.K, s.trans_a, s.trans_b};
  return bind_tiled_batched(env, g, s.batch, {s.M * s.K, s.K * s.N, s.M * s.N}, cfg, alpha, a, b, 0.0f, c, {});
}

LaunchList bind_naive(OpEnv& env, const MatmulShape& s, float alpha, DeviceSpan a, DeviceSpan b, DeviceSpan c) {
  cl::Kernel k = env.kernels.kernel("matmul", "matmul_naive", transpose_defines(s));
  cl::set_args(k.get(), cl_uint(s.M), cl_uint(s.N), cl_uint(s.K), alpha, a.buffer, a.elem_offset(), b.buffer,
               b.elem_offset(), c.buffer, c.elem_offset());
  KernelLaunch l;
  l.kernel = std::move(k);
  l.dims = 3;
  l.global = {round_up(s.N, 8), round_up(s.M, 8), s.batch};
  l.local = {8, 8, 1};
  LaunchList list;
  list.push_back(std::move(l));
  return list;
}

// The operands of a backward product in its order.
std::pair<DeviceSpan, DeviceSpan> operands(const MatmulProduct& p, DeviceSpan dy, DeviceSpan other) {
  return p.dy_first ? std::pair{dy, other} : std::pair{other, dy};
}

}  // namespace

MatmulShape matmul_shape(const Shape& a, const Shape& b, bool trans_a, bool trans_b) {
  if (a.rank < 2 || a.rank > 4 || b.rank < 2 || b.rank > 4) {
    throw std::invalid_argument(fmt::format(
        "matmul takes operands of rank 2 to 4 ([..., M, K] and [..., K, N]), got {} and {}", a.str(), b.str()));
  }
  if (a.rank != b.rank) {
    throw std::invalid_argument(
        fmt::format("matmul operands {} and {} have different ranks (the batch dims must match)", a.str(), b.str()));
  }
  MatmulShape s;
  s.trans_a = trans_a;
  s.trans_b = trans_b;
  const std::size_t r = a.rank;
  for (std::size_t i = 0; i + 2 < r; ++i) {
    if (a[i] != b[i]) {
      throw std::invalid_argument(fmt::format("matmul operands {} and {} have different batch dims (dim {}: {} vs {})",
                                              a.str(), b.str(), i, a[i], b[i]));
    }
    s.batch *= a[i];
  }
  s.M = trans_a ? a[r - 1] : a[r - 2];
  const std::size_t ka = trans_a ? a[r - 2] : a[r - 1];
  const std::size_t kb = trans_b ? b[r - 1] : b[r - 2];
  s.N = trans_b ? b[r - 2] : b[r - 1];
  if (ka != kb) {
    throw std::invalid_argument(fmt::format("matmul: {}{} times {}{}: inner dims {} and {} differ", a.str(),
                                            trans_a ? "^T" : "", b.str(), trans_b ? "^T" : "", ka, kb));
  }
  s.K = ka;
  return s;
}

Shape matmul_output_shape(const Shape& a, const Shape& b, bool trans_a, bool trans_b) {
  const MatmulShape s = matmul_shape(a, b, trans_a, trans_b);
  Shape out = a;
  out.dims[a.rank - 2] = static_cast<std::uint32_t>(s.M);
  out.dims[a.rank - 1] = static_cast<std::uint32_t>(s.N);
  return out;
}

std::size_t matmul_scratch_elems(OpEnv& env, const MatmulShape& s, const MatmulOptions& options) {
  const MatmulPlan p = plan(env, options);
  if (p.config.kernel != GemmKernel::packed || s.batch == 0) return 0;
  return packed_elems(s, p.config);
}

std::string matmul_kernel_description(OpEnv& env, const MatmulShape& s, const MatmulOptions& options) {
  const MatmulPlan p = plan(env, options);
  const std::string trans = fmt::format("{}{}", s.trans_a ? "T" : "N", s.trans_b ? "T" : "N");
  std::string kernel = p.config.text();
  if (p.config.kernel == GemmKernel::packed) {
    kernel += fmt::format(" (panel {}{})", panel_width(s, p.config), direct_b(s) ? ", B read in place" : "");
  }
  return fmt::format("ferry matmul {} {} ({})", kernel, trans, p.origin);
}

LaunchList matmul(OpEnv& env, const MatmulShape& s, float alpha, DeviceSpan a, DeviceSpan b, DeviceSpan c,
                  DeviceSpan scratch, const MatmulOptions& options) {
  cl::OpScope scope("matmul");
  check(s);
  if (s.batch == 0 || s.M == 0 || s.N == 0) return {};
  const MatmulPlan p = plan(env, options);
  switch (p.config.kernel) {
    case GemmKernel::packed:
      return bind_packed(env, s, p.config, alpha, a, b, c, scratch);
    case GemmKernel::tiled:
      return bind_tiled(env, s, p.config, alpha, a, b, c);
    case GemmKernel::naive:
      return bind_naive(env, s, alpha, a, b, c);
  }
  return {};
}

std::size_t matmul_grad_a_scratch_elems(OpEnv& env, const MatmulShape& forward, const MatmulOptions& options) {
  return matmul_scratch_elems(env, matmul_grad_a_product(forward).shape, options);
}

std::size_t matmul_grad_b_scratch_elems(OpEnv& env, const MatmulShape& forward, const MatmulOptions& options) {
  return matmul_scratch_elems(env, matmul_grad_b_product(forward).shape, options);
}

LaunchList matmul_grad_a(OpEnv& env, const MatmulShape& forward, float alpha, DeviceSpan dy, DeviceSpan b,
                         DeviceSpan da, DeviceSpan scratch, const MatmulOptions& options) {
  const MatmulProduct p = matmul_grad_a_product(forward);
  const auto [x, y] = operands(p, dy, b);
  return matmul(env, p.shape, alpha, x, y, da, scratch, options);
}

LaunchList matmul_grad_b(OpEnv& env, const MatmulShape& forward, float alpha, DeviceSpan a, DeviceSpan dy,
                         DeviceSpan db, DeviceSpan scratch, const MatmulOptions& options) {
  const MatmulProduct p = matmul_grad_b_product(forward);
  const auto [x, y] = operands(p, dy, a);
  return matmul(env, p.shape, alpha, x, y, db, scratch, options);
}

}  // namespace ferry::ops
