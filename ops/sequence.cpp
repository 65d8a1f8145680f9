// Binding of the sequence kernels (ops/kernels/sequence.cl): embedding, causal mask, dropout.
#include "ops/sequence.hpp"

#include <limits>
#include <stdexcept>
#include <string>

#include "ferry/cl/error.hpp"

namespace ferry::ops {
namespace {

cl_uint checked(std::size_t n, const char* what) {
  if (n > std::numeric_limits<cl_uint>::max()) {
    throw std::invalid_argument(std::string(what) + ": more than 2^32-1 elements");
  }
  return static_cast<cl_uint>(n);
}

LaunchList one(KernelLaunch l) {
  LaunchList list;
  list.push_back(std::move(l));
  return list;
}

LaunchList causal_mask_launch(OpEnv& env, DeviceSpan x, DeviceSpan y, std::size_t matrices, std::size_t t, float fill) {
  if (t == 0) throw std::invalid_argument("causal_mask: matrices must be at least 1 x 1");
  const std::size_t n = matrices * t * t;
  cl::Kernel k = env.kernels.kernel("sequence", "causal_mask");
  cl::set_args(k.get(), x.buffer, x.elem_offset(), y.buffer, y.elem_offset(), checked(n, "causal_mask"), cl_uint(t),
               fill);
  return one(elementwise_launch(std::move(k), n));
}

constexpr cl_uint kDropoutSeedArg = 5;  // then threshold, scale, step_lo, step_hi

LaunchList dropout_launch(OpEnv& env, DeviceSpan x, DeviceSpan y, std::size_t n, float p, std::uint32_t seed) {
  const std::uint32_t threshold = dropout_threshold(p);  // throws for p outside [0, 1)
  const auto scale = static_cast<float>(1.0 / (1.0 - double(p)));
  // On CPU devices 16 elements a work-item, the draws as vector code (dropout16).
  const bool wide = env.device().is_cpu();
  cl::Kernel k = env.kernels.kernel("sequence", wide ? "dropout16" : "dropout");
  cl::set_args(k.get(), x.buffer, x.elem_offset(), y.buffer, y.elem_offset(), checked(n, "dropout"), cl_uint(seed),
               cl_uint(threshold), scale, cl_uint(0), cl_uint(0));
  KernelLaunch l = elementwise_launch(std::move(k), wide ? (n + 15) / 16 : n);
  dropout_step_args(l, kDropoutSeedArg, seed);
  return one(std::move(l));
}

}  // namespace

void dropout_step_args(KernelLaunch& l, cl_uint seed_arg, std::uint32_t seed) {
  l.per_step = [seed_arg, seed](cl_kernel kernel, const StepInfo& s) {
    const cl_uint key = dropout_key(seed, s);
    const auto lo = static_cast<cl_uint>(s.step), hi = static_cast<cl_uint>(s.step >> 32);
    FERRY_CL(clSetKernelArg(kernel, seed_arg, sizeof(cl_uint), &key));
    FERRY_CL(clSetKernelArg(kernel, seed_arg + 3, sizeof(cl_uint), &lo));
    FERRY_CL(clSetKernelArg(kernel, seed_arg + 4, sizeof(cl_uint), &hi));
  };
}

LaunchList embedding_forward(OpEnv& env, DeviceSpan ids, DeviceSpan table, DeviceSpan y, std::size_t positions,
                             std::size_t vocab, std::size_t dim) {
  if (vocab == 0 || dim == 0) throw std::invalid_argument("embedding: the table must have at least one row and column");
  checked(vocab * dim, "embedding table");
  const std::size_t n = positions * dim;
  checked(n, "embedding");
  // CPU devices: a work-item per position and 16 columns (embedding_forward16).
  const bool wide = env.device().is_cpu();
  cl::Kernel k = env.kernels.kernel("sequence", wide ? "embedding_forward16" : "embedding_forward");
  cl::set_args(k.get(), ids.buffer, ids.elem_offset(), table.buffer, table.elem_offset(), y.buffer, y.elem_offset(),
               cl_uint(positions), cl_uint(vocab), cl_uint(dim));
  return one(elementwise_launch(std::move(k), wide ? positions * ((dim + 15) / 16) : n));
}

LaunchList embedding_backward(OpEnv& env, DeviceSpan ids, DeviceSpan dy, DeviceSpan dtable, std::size_t positions,
                              std::size_t vocab, std::size_t dim) {
  if (vocab == 0 || dim == 0) throw std::invalid_argument("embedding: the table must have at least one row and column");
  checked(positions * dim, "embedding");
  if (env.device().is_cpu()) {
    cl::Kernel k = env.kernels.kernel("sequence", "embedding_backward16");
    cl::set_args(k.get(), ids.buffer, ids.elem_offset(), dy.buffer, dy.elem_offset(), dtable.buffer,
                 dtable.elem_offset(), cl_uint(positions), cl_uint(vocab), cl_uint(dim));
    return one(elementwise_launch(std::move(k), (dim + 15) / 16));
  }
  const std::size_t n = vocab * dim;
  cl::Kernel k = env.kernels.kernel("sequence", "embedding_backward");
  cl::set_args(k.get(), ids.buffer, ids.elem_offset(), dy.buffer, dy.elem_offset(), dtable.buffer, dtable.elem_offset(),
               cl_uint(positions), cl_uint(vocab), cl_uint(dim));
  return one(elementwise_launch(std::move(k), n));
}

LaunchList causal_mask_forward(OpEnv& env, DeviceSpan x, DeviceSpan y, std::size_t matrices, std::size_t t) {
  return causal_mask_launch(env, x, y, matrices, t, -std::numeric_limits<float>::infinity());
}

LaunchList causal_mask_backward(OpEnv& env, DeviceSpan dy, DeviceSpan dx, std::size_t matrices, std::size_t t) {
  return causal_mask_launch(env, dy, dx, matrices, t, 0.0f);
}

LaunchList dropout_forward(OpEnv& env, DeviceSpan x, DeviceSpan y, std::size_t n, float p, std::uint32_t seed) {
  return dropout_launch(env, x, y, n, p, seed);
}

LaunchList dropout_backward(OpEnv& env, DeviceSpan dy, DeviceSpan dx, std::size_t n, float p, std::uint32_t seed) {
  return dropout_launch(env, dy, dx, n, p, seed);
}

}  // namespace ferry::ops
