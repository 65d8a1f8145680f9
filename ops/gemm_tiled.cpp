// Binding of gemm_tiled.cl: the GPU GEMM, strided-batched (see gemm_tiled.hpp).
#include "gemm_tiled.hpp"

#include <fmt/format.h>

#include <stdexcept>

namespace ferry::ops {
std::size_t tiled_local_bytes(const GemmKernelConfig& c) {
  // Rows padded by 4 floats (see the kernel), two tiles each of A and B.
  const std::size_t tsk = c.param("TSK");
  return 2 * tsk * (c.param("TSM") + 4 + c.param("TSN") + 4) * sizeof(float);
}

std::size_t tiled_splits(const GemmShape& s, const GemmKernelConfig& c, std::uint32_t compute_units) {
  if (c.param("SK") == 0 || compute_units == 0 || s.K == 0) return 1;
  const std::size_t tsm = c.param("TSM"), tsn = c.param("TSN"), tsk = c.param("TSK");
  const std::size_t groups = s.batch * ((s.M + tsm - 1) / tsm) * ((s.N + tsn - 1) / tsn);
  if (groups >= 4 * std::size_t{compute_units}) return 1;
  auto waves = [&](std::size_t n) {  // the length of n splits' waves, in unsplit products
    return double((groups * n + compute_units - 1) / compute_units) / double(n);
  };
  const std::size_t most = std::min<std::size_t>(16, s.K / (8 * tsk));
  double least = waves(1);
  for (std::size_t n = 2; n <= most; ++n) least = std::min(least, waves(n));
  if (least > 0.9 * waves(1)) return 1;
  // The fewest splits within 5% of the shortest waves: each split writes and reads back an M x N
  // block, which the wave count does not see.
  for (std::size_t n = 2; n <= most; ++n) {
    if (waves(n) <= 1.05 * least) return n;
  }
  return 1;
}

namespace {
// K rows per split: a multiple of TSK.
std::size_t chunk_rows(const GemmShape& s, const GemmKernelConfig& c, std::size_t splits) {
  const std::size_t tsk = c.param("TSK");
  return ((s.K + splits - 1) / splits + tsk - 1) / tsk * tsk;
}
}  // namespace

std::size_t tiled_scratch_elems(const GemmShape& s, const GemmKernelConfig& c, std::uint32_t compute_units) {
  const std::size_t splits = tiled_splits(s, c, compute_units);
  return splits > 1 ? s.batch * splits * s.M * s.N : 0;
}

namespace {

// Bit 0 (A), bit 1 (B): the operand may be read as float4s (VG=4): f32, its offset and leading
// dimension multiples of 4 elements, so every float4 the kernel reads is 16-byte aligned (buffers
// and sub-buffers start aligned far beyond that).
cl_uint vector_load_flags(const GemmShape& s, DeviceSpan a, DeviceSpan b) {
  const bool a_ok = s.a == DType::f32 && a.elem_offset(4) % 4 == 0 && (s.trans_a ? s.M : s.K) % 4 == 0;
  const bool b_ok = s.b == DType::f32 && b.elem_offset(4) % 4 == 0 && (s.trans_b ? s.K : s.N) % 4 == 0;
  return cl_uint(a_ok) | cl_uint(b_ok) << 1;
}

// The tiled kernel itself: one launch, `splits` splits of K per product (C then holds their raw
// partial products when split).
LaunchList bind_tiled_kernel(OpEnv& env, const GemmShape& s, const GemmKernelConfig& cfg, float alpha, DeviceSpan a,
                             DeviceSpan b, float beta, DeviceSpan c, DeviceSpan bias, const GemmOptions& options,
                             std::size_t splits) {
  const bool dact = options.dact_input.buffer != nullptr;
  const std::size_t tsm = cfg.param("TSM"), tsn = cfg.param("TSN");
  const std::size_t rtsm = tsm / cfg.param("WPTM"), rtsn = tsn / cfg.param("WPTN");
  const cl::DeviceInfo& device = env.device();
  if (tiled_local_bytes(cfg) > device.local_mem_bytes) {
    throw std::runtime_error(fmt::format("gemm {}: its tiles take {} bytes of local memory, the device has {}",
                                         cfg.text(), tiled_local_bytes(cfg), device.local_mem_bytes));
  }
  cl::Kernel k = env.kernels.kernel(
      "gemm_tiled", "gemm_tiled",
      fmt::format("{} -DTRANS_A={} -DTRANS_B={} {} {}{}", cfg.defines(), int(s.trans_a), int(s.trans_b),
                  gemm_storage_defines(s.a, s.b, s.c), gemm_epilogue_defines(options, 0),
                  cl::register_cap_option(device, cfg.param("RR"), fmt::format("gemm {}", cfg.text()))));
  if (rtsm * rtsn > kernel_group_limit(k, device)) {
    throw std::runtime_error(fmt::format("gemm {}: work-group {}x{} exceeds what the kernel can run with here ({})",
                                         cfg.text(), rtsn, rtsm, kernel_group_limit(k, device)));
  }
  const cl_uint has_bias = bias.buffer != nullptr;
  cl::set_args(k.get(), cl_uint(s.M), cl_uint(s.N), cl_uint(s.K), alpha, a.buffer, a.elem_offset(dtype_bytes(s.a)),
               b.buffer, b.elem_offset(dtype_bytes(s.b)), beta, c.buffer, c.elem_offset(dtype_bytes(s.c)),
               has_bias ? bias.buffer : c.buffer, bias.elem_offset(), has_bias, cl_ulong(s.M * s.K),
               cl_ulong(s.K * s.N), cl_ulong(s.M * s.N), dact ? options.dact_input.buffer : c.buffer,
               dact ? options.dact_input.elem_offset(dtype_bytes(s.c)) : std::uint64_t{0},
               cl_uint(splits > 1 ? chunk_rows(s, cfg, splits) : s.K), cl_uint(splits), vector_load_flags(s, a, b),
               guard_buffer(options, c), options.guard.elem_offset());
  KernelLaunch l;
  l.kernel = std::move(k);
  l.dims = 3;
  l.global = {(s.N + tsn - 1) / tsn * rtsn, (s.M + tsm - 1) / tsm * rtsm, s.batch * splits};
  l.local = {rtsn, rtsm, 1};
  LaunchList list;
  list.push_back(std::move(l));
  return list;
}

}  // namespace

LaunchList bind_tiled(OpEnv& env, const GemmShape& s, const GemmKernelConfig& cfg, float alpha, DeviceSpan a,
                      DeviceSpan b, float beta, DeviceSpan c, DeviceSpan scratch, const GemmOptions& options) {
  const std::size_t splits = tiled_splits(s, cfg, env.device().compute_units);
  if (splits > 1) {
    require_scratch(scratch, s, fmt::format("({})", cfg.text()),
                    tiled_scratch_elems(s, cfg, env.device().compute_units));
    // The splits' raw f32 products into scratch, then one pass adds them with alpha, beta, the bias
    // and the epilogue.
    GemmShape parts = s;
    parts.c = DType::f32;
    LaunchList list = bind_tiled_kernel(env, parts, cfg, 1.0f, a, b, 0.0f, scratch, {}, {}, splits);
    list.push_back(sum_splits_launch(env, s, splits, scratch, alpha, beta, c, options, 0));
    return list;
  }
  return bind_tiled_kernel(env, s, cfg, alpha, a, b, beta, c, options.bias, options, 1);
}

}  // namespace ferry::ops
