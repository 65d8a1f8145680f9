// The optimizer pass: one in-place update node per weight that has a gradient, with its state.
#include <fmt/format.h>

#include <stdexcept>

#include "ferry/ops/communicator.hpp"
#include "ferry/ops/op_table.hpp"
#include "graph/autodiff.hpp"
#include "ops/attrs.hpp"

namespace ferry::graph {

void append_optimizer(Graph& g, const OptimizerConfig& spec, const ZeroSharding& zero) {
  auto& t = g.tensors;
  const ops::OpId op = ops::update_row(spec.kind);
  const ops::OpInfo& row = ops::op_info(op);
  if (!row.optimizer_state) {
    throw std::logic_error(fmt::format("op '{}' declares no optimizer state: not an update row", row.name));
  }
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
          fmt::format("weight '{}' has {} elements, more than the 2^31 - 1 an optimizer update addresses (kernels "
                      "index with 32-bit integers): make the layer smaller",
                      t.name[w], elems));
    }
    const Shape state_shape = zero.sharded() ? Shape{static_cast<std::uint32_t>(share.count)} : t.shape[w];
    std::vector<TensorId> ins{w, grad}, outs{w};
    for (const ops::OptimizerStateDecl& d : row.optimizer_state(spec, share.count)) {
      TensorId s = grad;
      if (!d.is_gradient) {
        s = t.add(t.name[w] + d.suffix, d.shape.value_or(state_shape), d.dtype, Role::optimizer_state);
        t.init[s] = {WeightInit::Kind::zeros, 0};
      }
      ins.push_back(s);
      outs.push_back(s);
    }
    if (stats != no_tensor) ins.push_back(stats);
    ops::UpdateAttrs attrs = ops::UpdateAttrs::of(row.update_attrs ? row.update_attrs(spec) : NodeAttrs{});
    attrs.no_weight_decay = spec.decay_on == OptimizerConfig::DecayOn::matrices && t.shape[w].rank < 2;
    if (zero.sharded()) {
      attrs.share_first = static_cast<std::int32_t>(share.first);
      attrs.share_count = static_cast<std::int32_t>(share.count);
    }
    g.nodes.add(op, t.name[w] + ".update", ins, outs, attrs.pack());
  }
}

}  // namespace ferry::graph
