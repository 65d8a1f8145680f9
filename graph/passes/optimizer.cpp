// The optimizer pass: one in-place update node per weight that has a gradient, with its state.
#include <fmt/format.h>

#include <optional>
#include <stdexcept>

#include "ferry/graph/autodiff.hpp"
#include "ferry/ops/communicator.hpp"
#include "ferry/ops/op_table.hpp"

namespace ferry::graph {

void append_optimizer(Graph& g, const OptimizerSpec& spec, const ZeroSharding& zero) {
  auto& t = g.tensors;
  Shape state_shape;  // the weight's, or its share's
  auto state = [&](TensorId w, const char* suffix, std::optional<Shape> shape = {}, DType dtype = DType::f32) {
    TensorId s = t.add(t.name[w] + suffix, shape.value_or(state_shape), dtype, Role::optimizer_state);
    t.init[s] = {WeightInit::Kind::zeros, 0};
    return s;
  };
  const ops::OpId adam8bit_op = spec.kind == OptimizerSpec::Kind::adamw8bit ? ops::find_op("adam8bit_update") : 0;
  // Every update reads the step's loss (or the overflow guard) and skips itself when it is not
  // finite.
  const TensorId stats = g.update_guard();
  for (const ZeroShare& mine : zero_shares(g, zero)) {
    const TensorId w = mine.weight;
    const ops::ShardRange share = mine.range;
    if (share.count == 0) continue;  // another rank's
    // The gradient of the whole weight, or (ZeRO stage 2) of this rank's share alone: the update
    // reads a tensor of the share's size from its first element.
    const TensorId grad = t.grad[w];
    const std::size_t elems = t.shape[w].elems();
    if (share.first + share.count > 0x7fffffffu) {
      throw std::invalid_argument(
          fmt::format("ZeRO sharding: weight '{}' has {} elements, more than 2^31 - 1", t.name[w], elems));
    }
    state_shape = zero.sharded() ? Shape{static_cast<std::uint32_t>(share.count)} : t.shape[w];
    NodeAttrs slice;
    if (zero.sharded()) {
      slice.i[2] = static_cast<std::int32_t>(share.first);
      slice.i[3] = static_cast<std::int32_t>(share.count);
    }
    if (spec.kind == OptimizerSpec::Kind::sgd) {
      // Without momentum the velocity is the gradient itself, which dies at this update: use its
      // buffer rather than keeping (and, when streaming, moving) a state tensor.
      TensorId v = spec.sgd.momentum == 0.0f ? grad : state(w, ".momentum");
      const TensorId ins[] = {w, grad, v, stats};
      const TensorId outs[] = {w, v};
      g.nodes.add(builtin::sgd_update, t.name[w] + ".update", std::span(ins, stats == no_tensor ? 3 : 4), outs, slice);
    } else if (spec.kind == OptimizerSpec::Kind::adamw8bit) {
      // 8-bit moments (u8 codes) and their block scales [2, blocks]; zero scales make every code 0.
      ops::check_adam8bit_block(spec.block8bit);
      const auto blocks = static_cast<std::uint32_t>(ops::adam8bit_blocks(share.count, spec.block8bit));
      const TensorId m = state(w, ".adam8_m", state_shape, DType::u8);
      const TensorId v = state(w, ".adam8_v", state_shape, DType::u8);
      const TensorId scales = state(w, ".adam8_scales", Shape{2, blocks}, DType::f32);
      NodeAttrs attrs = slice;
      attrs.i[0] = static_cast<std::int32_t>(spec.block8bit);
      const TensorId ins[] = {w, grad, m, v, scales, stats};
      const TensorId outs[] = {w, m, v, scales};
      g.nodes.add(adam8bit_op, t.name[w] + ".update", std::span(ins, stats == no_tensor ? 5 : 6), outs, attrs);
    } else {
      TensorId m = state(w, ".adam_m");
      TensorId v = state(w, ".adam_v");
      const TensorId ins[] = {w, grad, m, v, stats};
      const TensorId outs[] = {w, m, v};
      g.nodes.add(builtin::adam_update, t.name[w] + ".update", std::span(ins, stats == no_tensor ? 4 : 5), outs, slice);
    }
  }
}

}  // namespace ferry::graph
