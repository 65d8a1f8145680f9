// GEMM binding. Interim: the naive kernel for every shape (tuned kernels replace it).
#include "ferry/ops/gemm.hpp"

#include <fmt/format.h>

namespace ferry::ops {

std::size_t gemm_scratch_elems(OpEnv&, const GemmShape&, const GemmOptions&) { return 0; }

std::string gemm_kernel_description(OpEnv&, const GemmShape&, const GemmOptions&) { return "naive"; }

LaunchList gemm(OpEnv& env, const GemmShape& s, float alpha, DeviceSpan a, DeviceSpan b, float beta, DeviceSpan c,
                DeviceSpan, const GemmOptions& options) {
  const std::string defines = fmt::format("-DTRANS_A={} -DTRANS_B={}", int(s.trans_a), int(s.trans_b));
  cl::Kernel k = env.kernels.kernel("gemm_naive", "gemm_naive", defines);
  const cl_uint has_bias = options.bias.buffer != nullptr;
  cl_mem bias_buf = has_bias ? options.bias.buffer : c.buffer;
  cl::set_args(k.get(), cl_uint(s.M), cl_uint(s.N), cl_uint(s.K), alpha, a.buffer, a.offset, b.buffer, b.offset, beta,
               c.buffer, c.offset, bias_buf, options.bias.offset, has_bias);
  KernelLaunch l;
  l.kernel = std::move(k);
  l.dims = 2;
  l.global = {round_up(s.N, 8), round_up(s.M, 8), 1};
  l.local = {8, 8, 1};
  LaunchList list;
  list.push_back(std::move(l));
  return list;
}

}  // namespace ferry::ops
