// Runs a step graph on the CPU with the ops' reference implementations, in any precision.
// The device step is checked against it, and autodiff is checked by finite differences on it.
#pragma once

#include <fmt/format.h>

#include <map>
#include <span>
#include <stdexcept>
#include <vector>

#include "ferry/graph/autodiff.hpp"
#include "ferry/graph/bind.hpp"
#include "ferry/ops/activation.hpp"
#include "ferry/ops/bias.hpp"
#include "ferry/ops/conv2d.hpp"
#include "ferry/ops/elementwise.hpp"
#include "ferry/ops/gemm.hpp"
#include "ferry/ops/layernorm.hpp"
#include "ferry/ops/optimizer.hpp"
#include "ferry/ops/pool.hpp"
#include "ferry/ops/softmax_xent.hpp"

namespace ferry::test {

template <class T>
class ReferenceExecutor {
 public:
  ReferenceExecutor(const graph::Graph& g, graph::OptimizerSpec optimizer) : g_(g), optimizer_(optimizer) {
    const auto& t = g_.tensors;
    values_.resize(t.size());
    ints_.resize(t.size());
    for (graph::TensorId id = 0; id < t.size(); ++id) {
      if (t.alias_of[id] != graph::no_tensor) continue;
      if (t.dtype[id] == graph::DType::i32) {
        ints_[id].assign(t.shape[id].elems(), 0);
      } else {
        values_[id].assign(t.shape[id].elems(), T(0));
      }
    }
  }

  std::vector<T>& value(graph::TensorId id) { return values_[g_.tensors.storage(id)]; }
  std::vector<std::int32_t>& ints(graph::TensorId id) { return ints_[g_.tensors.storage(id)]; }
  graph::TensorId find(const std::string& name) const {
    for (graph::TensorId id = 0; id < g_.tensors.size(); ++id) {
      if (g_.tensors.name[id] == name) return id;
    }
    throw std::invalid_argument("no tensor " + name);
  }

  // Runs nodes in order; stops before the first node of kind `stop_at` if given.
  void run(const ops::StepInfo& step, bool forward_only = false) {
    for (graph::NodeId n = 0; n < g_.nodes.size(); ++n) {
      const auto k = g_.nodes.kind[n];
      if (forward_only && k == graph::OpKind::softmax_xent) {
        exec(n, step);
        return;
      }
      exec(n, step);
    }
  }

  T loss() { return value(stats_id())[0]; }

 private:
  graph::TensorId stats_id() const {
    for (graph::TensorId id = 0; id < g_.tensors.size(); ++id) {
      if (g_.tensors.role[id] == graph::Role::stats) return id;
    }
    throw std::logic_error("no stats tensor");
  }
  std::span<const T> in(graph::TensorId id) { return value(id); }
  std::span<T> out(graph::TensorId id) { return value(id); }

  void exec(graph::NodeId n, const ops::StepInfo& step) {
    using graph::OpKind;
    const auto& shape = g_.tensors.shape;
    const auto i = g_.nodes.inputs(n);
    const auto o = g_.nodes.outputs(n);
    const auto& a = g_.nodes.attrs[n];
    switch (g_.nodes.kind[n]) {
      case OpKind::upload:
      case OpKind::download:
        return;
      case OpKind::fetch:
      case OpKind::write_back:
        value(o[0]) = value(i[0]);
        return;
      case OpKind::linear: {
        std::span<const T> bias = i.size() > 2 ? in(i[2]) : std::span<const T>{};
        ops::ref::gemm<T>(graph::linear_gemms(shape[i[0]], shape[i[1]]).forward, 1, in(i[0]), in(i[1]), 0, out(o[0]),
                          bias);
        return;
      }
      case OpKind::linear_grad_input:
        ops::ref::gemm<T>(graph::linear_gemms(shape[o[0]], shape[i[1]]).grad_input, 1, in(i[0]), in(i[1]), 0,
                          out(o[0]));
        return;
      case OpKind::linear_grad_param:
        ops::ref::gemm<T>(graph::linear_gemms(shape[i[0]], shape[o[0]]).grad_param, 1, in(i[0]), in(i[1]), 0,
                          out(o[0]));
        if (o.size() > 1) ops::ref::bias_backward<T>(in(i[1]), out(o[1]), shape[i[1]][0], shape[i[1]][1]);
        return;
      case OpKind::activation:
        ops::ref::activation_forward<T>(static_cast<ops::Activation>(a.i[0]), in(i[0]), out(o[0]));
        return;
      case OpKind::activation_grad:
        ops::ref::activation_backward<T>(static_cast<ops::Activation>(a.i[0]), in(i[0]), in(i[1]), out(o[0]));
        return;
      case OpKind::add:
        ops::ref::add<T>(in(i[0]), in(i[1]), out(o[0]));
        return;
      case OpKind::layernorm:
        ops::ref::layernorm_forward<T>(in(i[0]), in(i[1]), in(i[2]), out(o[0]), out(o[1]), out(o[2]), shape[i[0]][0],
                                       shape[i[0]][1], T(a.f[0]));
        return;
      case OpKind::layernorm_grad:
        ops::ref::layernorm_backward<T>(in(i[0]), in(i[1]), in(i[2]), in(i[3]), in(i[4]), out(o[0]), out(o[1]),
                                        out(o[2]), shape[i[0]][0], shape[i[0]][1]);
        return;
      case OpKind::conv2d: {
        std::span<const T> bias = i.size() > 2 ? in(i[2]) : std::span<const T>{};
        ops::ref::conv2d_forward<T>(graph::conv_shape(shape[i[0]], shape[i[1]], a), in(i[0]), in(i[1]), bias,
                                    out(o[0]));
        return;
      }
      case OpKind::conv2d_grad_input:
        ops::ref::conv2d_backward_data<T>(graph::conv_shape(shape[o[0]], shape[i[1]], a), in(i[0]), in(i[1]),
                                          out(o[0]));
        return;
      case OpKind::conv2d_grad_param: {
        std::span<T> dbias = o.size() > 1 ? out(o[1]) : std::span<T>{};
        ops::ref::conv2d_backward_weights<T>(graph::conv_shape(shape[i[0]], shape[o[0]], a), in(i[0]), in(i[1]),
                                             out(o[0]), dbias);
        return;
      }
      case OpKind::maxpool2d:
        ops::ref::maxpool2d_forward<T>(graph::pool_shape(shape[i[0]], a), in(i[0]), out(o[0]), ints(o[1]));
        return;
      case OpKind::maxpool2d_grad:
        ops::ref::maxpool2d_backward<T>(graph::pool_shape(shape[o[0]], a), in(i[0]), ints(i[1]), out(o[0]));
        return;
      case OpKind::softmax_xent:
        ops::ref::softmax_xent_forward<T>(in(i[0]), ints(i[1]), out(o[0]), out(o[1]), shape[i[0]][0], shape[i[0]][1]);
        return;
      case OpKind::softmax_xent_grad:
        ops::ref::softmax_xent_backward<T>(in(i[0]), ints(i[1]), out(o[0]), shape[i[0]][0], shape[i[0]][1]);
        return;
      case OpKind::sgd_update:
        ops::ref::sgd_update<T>(optimizer_.sgd, step, out(i[0]), in(i[1]), out(i[2]));
        return;
      case OpKind::adam_update: {
        ops::AdamConfig c = optimizer_.adam;
        c.decoupled_weight_decay = optimizer_.kind == graph::OptimizerSpec::Kind::adamw;
        ops::ref::adam_update<T>(c, step, out(i[0]), in(i[1]), out(i[2]), out(i[3]));
        return;
      }
    }
    throw std::logic_error(fmt::format("reference executor: no rule for {}", graph::op_name(g_.nodes.kind[n])));
  }

  const graph::Graph& g_;
  graph::OptimizerSpec optimizer_;
  std::vector<std::vector<T>> values_;
  std::vector<std::vector<std::int32_t>> ints_;
};

}  // namespace ferry::test
