// Binding of gemm_tiled.cl: the GPU GEMM, strided-batched (see gemm_tiled.hpp).
#include "gemm_tiled.hpp"

#include <fmt/format.h>

#include <stdexcept>

namespace ferry::ops {
namespace {

const char* dtype_macro(DType t) {
  return t == DType::f32 ? "F32" : t == DType::f16 ? "F16" : "BF16";
}

}  // namespace

std::size_t tiled_local_bytes(const GemmKernelConfig& c) {
  // Rows padded by 4 floats (see the kernel), two tiles each of A and B.
  const std::size_t tsk = c.param("TSK");
  return 2 * tsk * (c.param("TSM") + 4 + c.param("TSN") + 4) * sizeof(float);
}

LaunchList bind_tiled(OpEnv& env, const GemmShape& s, const GemmKernelConfig& cfg, float alpha, DeviceSpan a,
                      DeviceSpan b, float beta, DeviceSpan c, DeviceSpan bias, const GemmOptions& options) {
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
      fmt::format(
          "{} -DTRANS_A={} -DTRANS_B={} -DA_NAME={} -DB_NAME={} -DC_NAME={} -DC_IS_F32={} -DC_RELU={} -DC_DACT={}",
          cfg.defines(), int(s.trans_a), int(s.trans_b), dtype_macro(s.a), dtype_macro(s.b), dtype_macro(s.c),
          int(s.c == DType::f32), int(options.relu), dact ? 1 + int(options.dact == Activation::gelu) : 0));
  if (rtsm * rtsn > kernel_group_limit(k, device)) {
    throw std::runtime_error(fmt::format("gemm {}: work-group {}x{} exceeds what the kernel can run with here ({})",
                                         cfg.text(), rtsn, rtsm, kernel_group_limit(k, device)));
  }
  const cl_uint has_bias = bias.buffer != nullptr;
  cl::set_args(k.get(), cl_uint(s.M), cl_uint(s.N), cl_uint(s.K), alpha, a.buffer, a.elem_offset(dtype_bytes(s.a)),
               b.buffer, b.elem_offset(dtype_bytes(s.b)), beta, c.buffer, c.elem_offset(dtype_bytes(s.c)),
               has_bias ? bias.buffer : c.buffer, bias.elem_offset(), has_bias, cl_ulong(s.M * s.K),
               cl_ulong(s.K * s.N), cl_ulong(s.M * s.N), dact ? options.dact_input.buffer : c.buffer,
               dact ? options.dact_input.elem_offset(dtype_bytes(s.c)) : std::uint64_t{0});
  KernelLaunch l;
  l.kernel = std::move(k);
  l.dims = 3;
  l.global = {(s.N + tsn - 1) / tsn * rtsn, (s.M + tsm - 1) / tsm * rtsm, s.batch};
  l.local = {rtsn, rtsm, 1};
  LaunchList list;
  list.push_back(std::move(l));
  return list;
}

}  // namespace ferry::ops
