// GEMM through CLBlast. CLBlast enqueues its own kernels and takes no wait list, so the launch is
// a deferred call: a barrier on the (in-order) queue waits for the inputs, then clblast::Gemm.
// CLBlast enqueues all its kernels (direct and indirect paths, temporaries included) on the queue
// it is given and never blocks, so the barrier holds them back (GemmBackend.ClblastWaitsForItsInputs,
// on PoCL and Oclgrind).
#include "gemm_clblast.hpp"

#include <fmt/format.h>

#include <stdexcept>

#include "ferry/cl/error.hpp"

#ifdef FERRY_HAVE_CLBLAST
#include <clblast.h>
#endif

namespace ferry::ops {

bool gemm_have_clblast() {
#ifdef FERRY_HAVE_CLBLAST
  return true;
#else
  return false;
#endif
}

#ifdef FERRY_HAVE_CLBLAST

LaunchList bind_clblast_gemm(OpEnv& env, const GemmShape& s, float alpha, DeviceSpan a, DeviceSpan b, float beta,
                             DeviceSpan c, DeviceSpan bias) {
  LaunchList list;
  KernelLaunch l;
  // Row-major leading dimensions of the stored matrices.
  const std::size_t lda = s.trans_a ? s.M : s.K, ldb = s.trans_b ? s.K : s.N, ldc = s.N;
  l.custom = [s, alpha, a, b, beta, c, lda, ldb, ldc](cl_command_queue queue, std::span<const cl_event> wait,
                                                      cl::Event*) -> cl::Event {
    cl::OpScope scope("gemm (clblast)");
    if (!wait.empty()) {
      FERRY_CL(clEnqueueBarrierWithWaitList(queue, static_cast<cl_uint>(wait.size()), wait.data(), nullptr));
    }
    cl::Event ev;
    cl_command_queue q = queue;
    const auto ta = s.trans_a ? clblast::Transpose::kYes : clblast::Transpose::kNo;
    const auto tb = s.trans_b ? clblast::Transpose::kYes : clblast::Transpose::kNo;
    // A strided batch: product z's operands z matrices past their offsets.
    const clblast::StatusCode status =
        s.batch == 1 ? clblast::Gemm<float>(clblast::Layout::kRowMajor, ta, tb, s.M, s.N, s.K, alpha, a.buffer,
                                            a.elem_offset(), lda, b.buffer, b.elem_offset(), ldb, beta, c.buffer,
                                            c.elem_offset(), ldc, &q, ev.out())
                     : clblast::GemmStridedBatched<float>(clblast::Layout::kRowMajor, ta, tb, s.M, s.N, s.K, alpha,
                                                          a.buffer, a.elem_offset(), lda, s.M * s.K, b.buffer,
                                                          b.elem_offset(), ldb, s.K * s.N, beta, c.buffer,
                                                          c.elem_offset(), ldc, s.M * s.N, s.batch, &q, ev.out());
    if (status != clblast::StatusCode::kSuccess) {
      throw std::runtime_error(fmt::format("clblast::Gemm{} {} x {}x{}x{} failed with status {}",
                                           s.batch == 1 ? "" : "StridedBatched", s.batch, s.M, s.N, s.K,
                                           static_cast<int>(status)));
    }
    return ev;
  };
  list.push_back(std::move(l));
  if (bias.buffer != nullptr) {
    cl::Kernel k = env.kernels.kernel("gemm_bias", "gemm_add_bias");
    // The batch's C matrices follow each other: one matrix of batch M rows.
    const std::size_t rows = s.batch * s.M;
    cl::set_args(k.get(), cl_uint(rows), cl_uint(s.N), c.buffer, c.elem_offset(), bias.buffer, bias.elem_offset());
    KernelLaunch add;
    add.kernel = std::move(k);
    add.dims = 2;
    add.global = {round_up(s.N, 16), round_up(rows, 4), 1};
    add.local = {16, 4, 1};
    list.push_back(std::move(add));
  }
  return list;
}

#else

LaunchList bind_clblast_gemm(OpEnv&, const GemmShape&, float, DeviceSpan, DeviceSpan, float, DeviceSpan, DeviceSpan) {
  throw std::runtime_error("gemm: ferry was built without CLBlast");
}

#endif

}  // namespace ferry::ops
