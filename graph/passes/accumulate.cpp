// The accumulation pass: a micro variant sums each weight's gradient into its persistent sum; the
// group's last variant turns the gradient into the mean over the group before the optimizer.
#include <fmt/format.h>

#include <stdexcept>

#include "ferry/ops/op_table.hpp"
#include "graph/autodiff.hpp"
#include "ops/attrs.hpp"

namespace ferry::graph {

void append_accumulation(Graph& g, std::uint32_t accumulate, bool micro) {
  if (accumulate < 2) throw std::logic_error("append_accumulation needs 2 or more micro-batches");
  auto& t = g.tensors;
  const ops::OpId op = micro ? ops::builtin::grad_accumulate : ops::builtin::grad_mean;
  const NodeAttrs attrs = ops::FactorAttrs{1.0f / static_cast<float>(accumulate)}.pack();
  const std::size_t count = t.size();
  for (TensorId w = 0; w < count; ++w) {
    if (t.role[w] != Role::weight || t.grad[w] == no_tensor) continue;
    const TensorId grad = t.grad[w];
    if (t.dtype[grad] != DType::f32) {
      throw std::invalid_argument(
          fmt::format("gradient accumulation sums f32 gradients; '{}' is {}", t.name[grad], dtype_name(t.dtype[grad])));
    }
    const TensorId sum = t.add(t.name[w] + ".grad_sum", t.shape[w], DType::f32, Role::gradient_sum);
    t.init[sum] = {WeightInit::Kind::zeros, 0};
    if (micro) {
      const TensorId ins[] = {sum, grad, g.update_guard()};
      g.nodes.add(op, t.name[w] + ".accumulate", std::span(ins, g.update_guard() == no_tensor ? 2 : 3),
                  std::span(&sum, 1));
    } else {
      const TensorId ins[] = {sum, grad};
      g.nodes.add(op, t.name[w] + ".grad_mean", ins, std::span(&grad, 1), attrs);
    }
  }
}

}  // namespace ferry::graph
