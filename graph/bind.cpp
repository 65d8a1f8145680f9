// OpKind -> ops/ launches, with operand shapes read from the tensor table.
#include "ferry/graph/bind.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

#include "ferry/ops/activation.hpp"
#include "ferry/ops/bias.hpp"
#include "ferry/ops/conv2d.hpp"
#include "ferry/ops/elementwise.hpp"
#include "ferry/ops/gemm.hpp"
#include "ferry/ops/layernorm.hpp"
#include "ferry/ops/optimizer.hpp"
#include "ferry/ops/pool.hpp"
#include "ferry/ops/softmax_xent.hpp"

namespace ferry::graph {
namespace {

std::size_t scratch_elems(const Graph& g, NodeId n, ops::OpEnv& env) {
  const auto& shape = g.tensors.shape;
  const auto in = g.nodes.inputs(n);
  const auto out = g.nodes.outputs(n);
  switch (g.nodes.kind[n]) {
    case OpKind::linear:
      return ops::gemm_scratch_elems(env, linear_gemms(shape[in[0]], shape[in[1]]).forward);
    case OpKind::linear_grad_input:  // in: dy w ; out: dx
      return ops::gemm_scratch_elems(env, linear_gemms(shape[out[0]], shape[in[1]]).grad_input);
    case OpKind::linear_grad_param:  // in: x dy ; out: dw
      return ops::gemm_scratch_elems(env, linear_gemms(shape[in[0]], shape[out[0]]).grad_param);
    case OpKind::conv2d:
      return ops::conv2d_scratch_elems(env, conv_shape(shape[in[0]], shape[in[1]], g.nodes.attrs[n]));
    case OpKind::conv2d_grad_input:  // in: dy w ; out: dx
      return ops::conv2d_scratch_elems(env, conv_shape(shape[out[0]], shape[in[1]], g.nodes.attrs[n]));
    case OpKind::conv2d_grad_param:  // in: x dy ; out: dw
      return ops::conv2d_scratch_elems(env, conv_shape(shape[in[0]], shape[out[0]], g.nodes.attrs[n]));
    default:
      return 0;
  }
}

}  // namespace

// x [B, in], w [in, out]:  y = x w;  dx = dy w^T;  dw = x^T dy.
LinearGemms linear_gemms(const Shape& x, const Shape& w) {
  const std::size_t batch = x[0], in = w[0], out = w[1];
  return {{batch, out, in, false, false}, {batch, in, out, false, true}, {in, out, batch, true, false}};
}

ops::Conv2dShape conv_shape(const Shape& x, const Shape& w, const NodeAttrs& a) {
  ops::Conv2dShape s;
  s.N = x[0];
  s.C = x[1];
  s.H = x[2];
  s.W = x[3];
  s.K = w[0];
  s.R = w[2];
  s.S = w[3];
  s.stride = static_cast<std::size_t>(a.i[0]);
  s.pad = static_cast<std::size_t>(a.i[1]);
  return s;
}

ops::Pool2dShape pool_shape(const Shape& x, const NodeAttrs& a) {
  ops::Pool2dShape s;
  s.N = x[0];
  s.C = x[1];
  s.H = x[2];
  s.W = x[3];
  s.window = static_cast<std::size_t>(a.i[0]);
  s.stride = static_cast<std::size_t>(a.i[1]);
  return s;
}

void assign_scratch(Graph& g, ops::OpEnv& env) {
  for (NodeId n = 0; n < g.nodes.size(); ++n) {
    const std::size_t elems = scratch_elems(g, n, env);
    if (elems == 0) continue;
    g.nodes.scratch[n] = g.tensors.add(g.nodes.name[n] + ".scratch", Shape{static_cast<std::uint32_t>(elems)},
                                       DType::f32, Role::scratch);
  }
}

ops::LaunchList bind_node(const Graph& g, NodeId n, const TensorResolver& at, ops::OpEnv& env,
                          const OptimizerSpec& optimizer) {
  const auto& shape = g.tensors.shape;
  const auto in = g.nodes.inputs(n);
  const auto out = g.nodes.outputs(n);
  const NodeAttrs& a = g.nodes.attrs[n];
  const TensorId scratch_id = g.nodes.scratch[n];
  const ops::DeviceSpan scratch = scratch_id == no_tensor ? ops::DeviceSpan{} : at(scratch_id);
  auto elems = [&](TensorId t) { return shape[t].elems(); };

  switch (g.nodes.kind[n]) {
    case OpKind::linear: {
      ops::GemmOptions opt;
      if (in.size() > 2) opt.bias = at(in[2]);
      return ops::gemm(env, linear_gemms(shape[in[0]], shape[in[1]]).forward, 1.0f, at(in[0]), at(in[1]), 0.0f,
                       at(out[0]), scratch, opt);
    }
    case OpKind::linear_grad_input:
      return ops::gemm(env, linear_gemms(shape[out[0]], shape[in[1]]).grad_input, 1.0f, at(in[0]), at(in[1]), 0.0f,
                       at(out[0]), scratch);
    case OpKind::linear_grad_param: {
      const Shape& dy = shape[in[1]];
      auto list = ops::gemm(env, linear_gemms(shape[in[0]], shape[out[0]]).grad_param, 1.0f, at(in[0]), at(in[1]), 0.0f,
                            at(out[0]), scratch);
      if (out.size() > 1) {
        auto bias = ops::bias_backward(env, at(in[1]), at(out[1]), dy[0], dy[1]);
        std::move(bias.begin(), bias.end(), std::back_inserter(list));
      }
      return list;
    }
    case OpKind::activation:
      return ops::activation_forward(env, static_cast<ops::Activation>(a.i[0]), at(in[0]), at(out[0]), elems(in[0]));
    case OpKind::activation_grad:
      return ops::activation_backward(env, static_cast<ops::Activation>(a.i[0]), at(in[0]), at(in[1]), at(out[0]),
                                      elems(in[0]));
    case OpKind::add:
      return ops::add(env, at(in[0]), at(in[1]), at(out[0]), elems(out[0]));
    case OpKind::layernorm: {
      const Shape& x = shape[in[0]];
      return ops::layernorm_forward(env, at(in[0]), at(in[1]), at(in[2]), at(out[0]), at(out[1]), at(out[2]), x[0],
                                    x[1], a.f[0]);
    }
    case OpKind::layernorm_grad: {
      const Shape& x = shape[in[0]];
      return ops::layernorm_backward(env, at(in[0]), at(in[1]), at(in[2]), at(in[3]), at(in[4]), at(out[0]), at(out[1]),
                                     at(out[2]), x[0], x[1]);
    }
    case OpKind::conv2d: {
      const ops::DeviceSpan bias = in.size() > 2 ? at(in[2]) : ops::DeviceSpan{};
      return ops::conv2d_forward(env, conv_shape(shape[in[0]], shape[in[1]], a), at(in[0]), at(in[1]), bias, at(out[0]),
                                 scratch);
    }
    case OpKind::conv2d_grad_input:
      return ops::conv2d_backward_data(env, conv_shape(shape[out[0]], shape[in[1]], a), at(in[0]), at(in[1]),
                                       at(out[0]), scratch);
    case OpKind::conv2d_grad_param: {
      const ops::DeviceSpan dbias = out.size() > 1 ? at(out[1]) : ops::DeviceSpan{};
      return ops::conv2d_backward_weights(env, conv_shape(shape[in[0]], shape[out[0]], a), at(in[0]), at(in[1]),
                                          at(out[0]), dbias, scratch);
    }
    case OpKind::maxpool2d:
      return ops::maxpool2d_forward(env, pool_shape(shape[in[0]], a), at(in[0]), at(out[0]), at(out[1]));
    case OpKind::maxpool2d_grad:
      return ops::maxpool2d_backward(env, pool_shape(shape[out[0]], a), at(in[0]), at(in[1]), at(out[0]));
    case OpKind::softmax_xent: {
      const Shape& l = shape[in[0]];
      return ops::softmax_xent_forward(env, at(in[0]), at(in[1]), at(out[0]), at(out[1]), l[0], l[1]);
    }
    case OpKind::softmax_xent_grad: {
      const Shape& l = shape[in[0]];
      return ops::softmax_xent_backward(env, at(in[0]), at(in[1]), at(out[0]), l[0], l[1]);
    }
    case OpKind::sgd_update:
      return ops::sgd_update(env, optimizer.sgd, at(in[0]), at(in[1]), at(in[2]), elems(in[0]),
                             in.size() > 3 ? at(in[3]) : ops::DeviceSpan{});
    case OpKind::adam_update: {
      ops::AdamConfig c = optimizer.adam;
      c.decoupled_weight_decay = optimizer.kind == OptimizerSpec::Kind::adamw;
      return ops::adam_update(env, c, at(in[0]), at(in[1]), at(in[2]), at(in[3]), elems(in[0]),
                              in.size() > 4 ? at(in[4]) : ops::DeviceSpan{});
    }
    case OpKind::upload:
    case OpKind::download:
    case OpKind::fetch:
    case OpKind::write_back:
      break;  // copies, enqueued by the compiled step itself
  }
  throw std::logic_error(
      fmt::format("node '{}' ({}) has no kernel binding", g.nodes.name[n], op_name(g.nodes.kind[n])));
}

}  // namespace ferry::graph
