// SiLU, y = x * sigmoid(x), as a user adds an op to ferry from outside its tree: its own OpenCL
// kernels, and rows of the op table with a shape rule, a backward rule and CPU references. Used by
// examples/custom_op.cpp and by tests/test_op_table.cpp.
#pragma once

#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

#include "ferry/ferry.hpp"

namespace silu_op {

inline constexpr const char* silu_source = R"CL(
__kernel void silu(__global const float* x, ulong xo, __global float* y, ulong yo, uint n) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  const float v = x[xo + i];
  y[yo + i] = v / (1.0f + exp(-v));
}
__kernel void silu_grad(__global const float* x, ulong xo, __global const float* dy, ulong dyo,
                        __global float* dx, ulong dxo, uint n) {
  const size_t i = get_global_id(0);
  if (i >= n) return;
  const float v = x[xo + i];
  const float s = 1.0f / (1.0f + exp(-v));
  dx[dxo + i] = dy[dyo + i] * (s + v * s * (1.0f - s));
}
)CL";

// One launch of `kernel` over n elements: `args` in order (a tensor as its buffer and element
// offset), then n.
template <class... Args>
ferry::ops::LaunchList silu_launch(ferry::ops::OpEnv& env, const char* kernel, std::size_t n, const Args&... args) {
  cl_program program = env.kernels.program_from_source("silu_op", silu_source);
  cl_int rc = CL_SUCCESS;
  ferry::cl::Kernel k(clCreateKernel(program, kernel, &rc));
  ferry::cl::check(rc, "clCreateKernel(silu)");
  ferry::cl::set_args(k.get(), args..., static_cast<cl_uint>(n));
  ferry::ops::LaunchList list;
  list.push_back(ferry::ops::elementwise_launch(std::move(k), n));
  return list;
}

inline double sigmoid(double v) {
  return 1.0 / (1.0 + std::exp(-v));
}

// Registers the op `name` and its gradient row `name`_grad; returns the forward row's id.
inline ferry::ops::OpId register_silu(const std::string& name) {
  namespace ops = ferry::ops;
  ops::OpInfo grad;
  grad.name = name + "_grad";
  grad.op_class = ops::OpClass::backward;
  grad.bind = [](const ops::BindContext& c) {
    const ops::DeviceSpan x = c.in(0), dy = c.in(1), dx = c.out(0);
    return silu_launch(c.env(), "silu_grad", c.input(0).shape.elems(), x.buffer, x.elem_offset(), dy.buffer,
                       dy.elem_offset(), dx.buffer, dx.elem_offset());
  };
  grad.reference = [](ops::RefContext& c) {
    auto x = c.real(c.inputs()[0]), dy = c.real(c.inputs()[1]), dx = c.real(c.outputs()[0]);
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double s = sigmoid(x[i]);
      dx[i] = dy[i] * (s + x[i] * s * (1 - s));
    }
  };
  const ops::OpId grad_id = ops::register_op(grad);

  ops::OpInfo row;
  row.name = name;
  row.infer = [](const ops::ShapeView& v) {
    if (v.input_count() != 1 || v.input(0).dtype != ferry::graph::DType::f32) {
      throw ops::ShapeError(std::string(v.name()) + ": SiLU takes one f32 input");
    }
    return std::vector<ops::TensorDesc>{v.input(0)};
  };
  row.bind = [](const ops::BindContext& c) {
    const ferry::ops::DeviceSpan x = c.in(0), y = c.out(0);
    return silu_launch(c.env(), "silu", c.input(0).shape.elems(), x.buffer, x.elem_offset(), y.buffer, y.elem_offset());
  };
  row.backward = [grad_id](ops::GradContext& g) {  // dx = dy * silu'(x)
    const ops::TensorRef x = g.inputs()[0], dy = g.grad(g.outputs()[0]);
    if (dy == ops::no_ref || !g.needs_grad(x)) return;
    const ops::TensorRef dx = g.new_grad(x);
    const ops::TensorRef ins[] = {x, dy};
    const ops::TensorRef outs[] = {dx};
    g.emit(grad_id, ".grad", ins, outs, g.attrs());
    g.contribute(x, dx);
  };
  row.reference = [](ops::RefContext& c) {
    auto x = c.real(c.inputs()[0]), y = c.real(c.outputs()[0]);
    for (std::size_t i = 0; i < x.size(); ++i) y[i] = x[i] * sigmoid(x[i]);
  };
  return ops::register_op(row);
}

}  // namespace silu_op
