// The autodiff pass: reverse mode over the step IR, each forward node through its row's backward
// rule.
#include "graph/autodiff.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>
#include <unordered_map>

namespace ferry::graph {
namespace {

// Implements the rows' view of reverse mode over one forward node at a time.
class Differentiator final : public ops::GradContext {
 public:
  explicit Differentiator(Graph& g) : g_(g), t_(g.tensors), n_(g.nodes) {}

  void run() {
    if (g_.loss == no_tensor) {
      throw std::invalid_argument(
          "the step graph has no loss (end the forward pass with a loss layer such as softmax_xent): nothing to "
          "differentiate");
    }
    const std::size_t forward_count = n_.size();
    mark_needs_grad(forward_count);
    for (NodeId n = static_cast<NodeId>(forward_count); n-- > 0;) {
      const ops::OpInfo& row = ops::op_info(n_.op[n]);
      if (row.op_class == ops::OpClass::batch_transfer) continue;
      // Copies of this node's operands: emitting nodes below reallocates the tables.
      in_.assign(n_.inputs(n).begin(), n_.inputs(n).end());
      out_.assign(n_.outputs(n).begin(), n_.outputs(n).end());
      name_ = n_.name[n];
      attrs_ = n_.attrs[n];
      bool flows = false;
      for (TensorId o : out_) flows = flows || grad(o) != no_tensor || is_loss(o);
      if (!flows) continue;
      if (!row.backward) {
        bool wanted = false;
        for (TensorId i : in_) wanted = wanted || needs_grad(i);
        if (wanted) {
          throw std::invalid_argument(
              fmt::format("autodiff: node '{}' ({}) is not differentiable, but the loss depends on a weight through it",
                          name_, row.name));
        }
        continue;
      }
      contributed_.clear();
      row.backward(*this);
      check_every_input_got_a_gradient(row);
    }
  }

  // GradContext
  std::string_view name() const override { return name_; }
  const NodeAttrs& attrs() const override { return attrs_; }
  std::span<const ops::TensorRef> inputs() const override { return in_; }
  std::span<const ops::TensorRef> outputs() const override { return out_; }
  bool needs_grad(ops::TensorRef t) const override {
    if (t == no_tensor || t >= needs_.size()) return false;
    if (needs_[t]) return true;
    return t_.alias_of[t] != no_tensor && needs_grad(t_.alias_of[t]);
  }
  ops::TensorRef grad(ops::TensorRef t) const override {
    return t == no_tensor ? no_tensor : t_.grad[check(t, "grad()")];
  }
  float loss_weight(ops::TensorRef t) const override {
    if (t == g_.loss) return 1.0f;
    const auto it = loss_terms_.find(t);
    return it == loss_terms_.end() ? 0.0f : it->second;
  }
  void add_loss_term(ops::TensorRef t, float weight) override {
    contributed_.push_back(check(t, "add_loss_term()"));  // its gradient comes from the loss weight
    loss_terms_[t] += weight;
  }
  ops::DType dtype(ops::TensorRef t) const override { return t_.dtype[check(t, "dtype()")]; }
  ops::TensorRef new_grad(ops::TensorRef of) override {
    check(of, "new_grad()");
    TensorId g = t_.add("d" + t_.name[of], t_.shape[of], t_.dtype[of], Role::gradient);
    needs_.push_back(false);
    return g;
  }
  void emit(ops::OpId op, std::string_view suffix, std::span<const ops::TensorRef> in,
            std::span<const ops::TensorRef> out, const NodeAttrs& attrs) override {
    const ops::OpInfo& row = ops::op_info(op);
    if (ops::is_host_lane(row.lane)) {  // as Builder::emit refuses them in the forward
      throw std::invalid_argument(fmt::format(
          "autodiff: the gradient of node '{}' emits op '{}', which runs on the {} lane (OpInfo::lane); a gradient's "
          "ops run on the device: give its row Lane::compute and a bind",
          name_, row.name, ops::lane_name(row.lane)));
    }
    n_.add(op, name_ + std::string(suffix), in, out, attrs, row.lane);
  }
  // Adds `g` to the gradient of `t` (summing when t is used more than once).
  void contribute(ops::TensorRef t, ops::TensorRef g) override {
    check(t, "contribute()'s tensor");
    check(g, "contribute()'s gradient");
    contributed_.push_back(t);
    if (!needs_grad(t)) return;
    if (TensorId base = t_.alias_of[t]; base != no_tensor) {
      // The gradient of a view is a view of the base's gradient.
      TensorId gv = t_.add(t_.name[g] + ".view", t_.shape[base], t_.dtype[base], Role::gradient, g);
      needs_.push_back(false);
      contribute(base, gv);
      return;
    }
    if (t_.grad[t] == no_tensor) {
      t_.grad[t] = g;
      return;
    }
    TensorId sum = new_grad(t);
    const TensorId ins[] = {t_.grad[t], g};
    const TensorId outs[] = {sum};
    n_.add(builtin::add, fmt::format("{}.grad_sum", t_.name[t]), ins, outs);
    t_.grad[t] = sum;
  }

 private:
  // A rule's tensor id, checked: a rule (a user's row) naming a tensor that does not exist would
  // read past the tables.
  TensorId check(ops::TensorRef t, const char* where) const {
    if (t >= t_.size()) {
      throw std::invalid_argument(
          fmt::format("autodiff: the backward rule of node '{}' passed tensor id {} to {}, "
                      "which does not exist (the graph has {} tensors)",
                      name_, t, where, t_.size()));
    }
    return t;
  }

  // A rule that leaves out an input the loss depends on would leave its weights untrained.
  void check_every_input_got_a_gradient(const ops::OpInfo& row) const {
    for (std::size_t i = 0; i < in_.size(); ++i) {
      const TensorId x = in_[i];
      if (!needs_grad(x) || std::find(contributed_.begin(), contributed_.end(), x) != contributed_.end()) continue;
      throw std::invalid_argument(fmt::format(
          "autodiff: the backward rule of node '{}' ({}) gave no gradient for its input {} ('{}'), which the loss "
          "depends on through it: a backward rule must contribute() a gradient for every input that needs_grad()",
          name_, row.name, i, t_.name[x]));
    }
  }

  void mark_needs_grad(std::size_t forward_count) {
    needs_.assign(t_.size(), false);
    for (TensorId t = 0; t < t_.size(); ++t) needs_[t] = t_.role[t] == Role::weight;
    for (NodeId n = 0; n < forward_count; ++n) {
      bool any = false;
      for (TensorId in : n_.inputs(n)) any = any || needs_grad(in);
      for (TensorId out : n_.outputs(n)) needs_[out] = any;
    }
    // Views need a gradient when their base does.
    for (TensorId t = 0; t < t_.size(); ++t) {
      if (t_.alias_of[t] != no_tensor) needs_[t] = needs_[t] || needs_grad(t_.alias_of[t]);
    }
  }

  Graph& g_;
  TensorTable& t_;
  NodeTable& n_;
  std::vector<bool> needs_;
  std::unordered_map<TensorId, float> loss_terms_;  // terms of a loss_sum and their weights
  std::vector<TensorId> in_, out_;
  std::vector<TensorId> contributed_;  // what the node being differentiated contributed to
  std::string name_;
  NodeAttrs attrs_;
};

}  // namespace

void append_backward(Graph& g) {
  Differentiator(g).run();
}

}  // namespace ferry::graph
