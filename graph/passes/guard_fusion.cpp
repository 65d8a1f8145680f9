// The overflow guard's checks folded into the nodes that make the gradients (see
// graph/autodiff.hpp, fuse_guard_checks).
//
// append_overflow_guard adds one check per weight gradient: a kernel that reads the whole gradient
// again after the node that made it. Where that node's row checks its own outputs
// (ops::OpInfo::checks_outputs: a Linear's weight and bias gradients, in its product's epilogue and
// its column sums; a LayerNorm's gain and shift gradients, as they are stored), the check is
// dropped and the node checks into a flag instead ("overflow_guard.products", one more input and
// output): one pass over each gradient and one launch per gradient fewer. The flag starts as the
// loss (an init before the first such node) and the guard's init, where it was, copies the flag
// instead of the loss: the guard's value is unchanged (the loss, or NaN when an element is not
// finite), and so is its last writer, the step's commit point (graph::CompiledStep): work that
// precedes it, such as unpacking compressed state, still fails before any state changes.
//
// The checks that stay (a gradient made by a node that does not check its outputs: the f32 copy of
// a narrow layer's gradient under mixed precision, a bias gradient divided by the loss scale) check
// into the flag too, each right after the node that made its gradient. Left after the guard's init
// they would follow the last product, at the end of the backward, and hold every such gradient on
// the device until then (a streamed 7B GPT in bf16 with the host optimizer needed a 24 GiB budget
// where f32 needs 2.4). A check only marks the flag NaN, so the order of the flag's writers does
// not change its value. Checks of sums written after the guard's init (over micro-batches or ranks)
// stay where they are.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ferry/ops/op_table.hpp"
#include "graph/autodiff.hpp"

namespace ferry::graph {

void fuse_guard_checks(Graph& g) {
  if (g.guard == no_tensor) return;
  const NodeTable& old = g.nodes;
  const TensorTable& t = g.tensors;
  const auto none = static_cast<NodeId>(old.size());
  NodeId init = none;
  for (NodeId n = 0; n < old.size() && init == none; ++n) {
    if (old.op[n] == ops::builtin::overflow_guard_init && old.outputs(n).size() == 1 && old.outputs(n)[0] == g.guard) {
      init = n;
    }
  }
  if (init == none) return;
  // The flag's init reads the loss: it can go just before any node after the loss's last writer.
  // The producers must come before the guard's init, which copies the flag.
  NodeId loss_written = none;
  for (NodeId n = 0; n < init; ++n) {
    for (TensorId o : old.outputs(n)) {
      if (t.storage(o) == t.storage(g.loss)) loss_written = n;
    }
  }

  // For each check of the guard: the node that last wrote its gradient before it (`writer_of`,
  // when that is between the loss and the guard's init), and its producer, if that node's row checks
  // its outputs and the gradient is one of them, whole and f32.
  std::vector<NodeId> last_write(t.size(), none);
  std::vector<NodeId> writer_of(old.size(), none), producer_of_check(old.size(), none);
  std::vector<std::uint32_t> checked_outputs(old.size(), 0);  // per producer: outputs whose checks go
  for (NodeId n = 0; n < old.size(); ++n) {
    const auto ins = old.inputs(n);
    if (old.op[n] == ops::builtin::overflow_guard_check && ins.size() == 2 && ins[0] == g.guard) {
      const TensorId grad = ins[1];
      const NodeId w = last_write[t.storage(grad)];
      if (w != none && w < init && (loss_written == none || w > loss_written)) writer_of[n] = w;
      if (writer_of[n] != none && t.alias_of[grad] == no_tensor && t.dtype[grad] == DType::f32) {
        const auto outs = old.outputs(w);
        for (std::size_t i = 0; i < outs.size() && i < 32; ++i) {
          if (outs[i] == grad && (ops::op_info(old.op[w]).checks_outputs >> i & 1u)) {
            producer_of_check[n] = w;
            checked_outputs[w] |= 1u << i;
            break;
          }
        }
      }
    }
    for (TensorId o : old.outputs(n)) last_write[t.storage(o)] = n;
  }
  // A producer takes the guard only when each output its row checks loses its check here: it then
  // checks exactly what they did (a check of an output that is summed further, over micro-batches
  // or ranks, must see the final sum instead).
  std::vector<bool> fuse(old.size(), false);
  bool any = false;
  for (NodeId n = 0; n < old.size(); ++n) {
    if (checked_outputs[n] == 0) continue;
    const std::size_t outs = std::min<std::size_t>(old.outputs(n).size(), 32);
    const std::uint32_t checkable = ops::op_info(old.op[n]).checks_outputs & (outs == 32 ? ~0u : (1u << outs) - 1u);
    if (checked_outputs[n] == checkable) fuse[n] = any = true;
  }
  if (!any) return;
  // The checks that stay, of gradients made between the loss and the guard's init: each goes right
  // after its gradient's writer and checks into the flag.
  std::vector<std::vector<NodeId>> checks_after(old.size());
  std::vector<bool> moved(old.size(), false);
  for (NodeId n = 0; n < old.size(); ++n) {
    if (writer_of[n] == none || (producer_of_check[n] != none && fuse[producer_of_check[n]])) continue;
    checks_after[writer_of[n]].push_back(n);
    moved[n] = true;
  }

  const std::string flag_name = fmt::format("{}.products", overflow_guard_name);
  const TensorId flag = g.tensors.add(flag_name, Shape{1}, DType::f32, Role::stats);
  NodeTable out;
  bool flag_made = false;
  const auto make_flag = [&] {
    if (flag_made) return;
    out.add(ops::builtin::overflow_guard_init, flag_name, std::span(&g.loss, 1), std::span(&flag, 1));
    flag_made = true;
  };
  for (NodeId n = 0; n < old.size(); ++n) {
    if ((producer_of_check[n] != none && fuse[producer_of_check[n]]) || moved[n]) continue;
    if (n == init) {  // the guard: the flag, which is the loss unless a product was not finite
      out.add_copy(old, n, std::span(&flag, 1), old.outputs(n), old.lane[n]);
      continue;
    }
    if (!fuse[n]) {
      out.add_copy(old, n);
    } else {
      make_flag();
      std::vector<TensorId> ins(old.inputs(n).begin(), old.inputs(n).end());
      std::vector<TensorId> outs(old.outputs(n).begin(), old.outputs(n).end());
      ins.push_back(flag);
      outs.push_back(flag);
      out.add_copy(old, n, ins, outs, old.lane[n]);
    }
    for (NodeId c : checks_after[n]) {
      make_flag();
      const TensorId ins[] = {flag, old.inputs(c)[1]};
      out.add_copy(old, c, ins, std::span(&flag, 1), old.lane[c]);
    }
  }
  g.nodes = std::move(out);
}

}  // namespace ferry::graph
