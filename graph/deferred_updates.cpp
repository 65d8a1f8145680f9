// Deferred host updates on the compiled step's side (graph/passes/defer_updates.cpp places them in
// the graph): which step's update is pending, applying it outside a step, and the arena's hook
// through which reads, writes and other variants' steps apply it first.
#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

#include "compiled_step_impl.hpp"

namespace ferry::graph {

void CompiledStep::register_deferred_updates() {
  const auto& n = graph_.nodes;
  for (NodeId id = 0; id < n.size(); ++id) {
    if (n.deferred[id]) impl_->deferred.push_back(id);
  }
  if (impl_->deferred.empty()) return;
  impl_->deferred_pending.assign(n.size(), 0);
  if (persistent_->apply_deferred) {
    throw std::logic_error(
        "a second compiled step of this model defers its host updates into its next step: one variant may (the "
        "training step); compile the others without ResidencyOptions::overlap_host_updates");
  }
  persistent_->deferred_owner = this;
  persistent_->apply_deferred = [this] { apply_deferred_updates(); };
}

void CompiledStep::discard_deferred_updates() noexcept {
  std::fill(impl_->deferred_pending.begin(), impl_->deferred_pending.end(), 0);
  impl_->deferred_failure.clear();
}

void CompiledStep::abandon_deferred_updates(const std::string& what) {
  std::fill(impl_->deferred_pending.begin(), impl_->deferred_pending.end(), 0);
  impl_->deferred_failure = what;
}

void CompiledStep::refuse_after_deferred_failure() const {
  if (impl_->deferred_failure.empty()) return;
  throw std::runtime_error(fmt::format(
      "this step refuses to run: the optimizer update deferred into it failed part-way ({}), so the weights and "
      "optimizer state are inconsistent; write them whole again (a checkpoint's load) first",
      impl_->deferred_failure));
}

bool CompiledStep::has_deferred_updates() const noexcept {
  for (NodeId id : impl_->deferred) {
    if (impl_->deferred_pending[id]) return true;
  }
  return false;
}

void CompiledStep::defer_update_of(const ops::StepInfo& step) {
  Impl& im = *impl_;
  // The step ran every update pending before it (it succeeded), so nothing older is overwritten.
  for (NodeId id : im.deferred) im.deferred_pending[id] = 1;
  im.deferred_step = step;
}

bool CompiledStep::deferred_failed_part_way(const Submission& s, NodeId id) const {
  return graph_.nodes.deferred[id] && s.started[id] && impl_->deferred_pending[id];
}

bool CompiledStep::apply_deferred_updates() {
  Impl& im = *impl_;
  if (!has_deferred_updates()) return false;
  if (im.count > 0) {
    throw std::logic_error(
        "the host updates a step deferred cannot be applied while a step of the same variant is in flight: wait() for "
        "it first");
  }
  Submission run;  // host_non_finite only: a deferred node reads its step info from deferred_step
  const auto& n = graph_.nodes;
  for (NodeId id : im.deferred) {
    if (!im.deferred_pending[id]) continue;
    try {
      run_host_node(id, run);
    } catch (const std::exception& e) {
      if (ops::op_info(n.op[id]).op_class != ops::OpClass::update) throw;  // it changed no state: still pending
      std::vector<std::string> changed;
      for (TensorId x : n.outputs(id)) {
        if (is_persistent(graph_.tensors.role[graph_.tensors.storage(x)])) changed.push_back(graph_.tensors.name[x]);
      }
      abandon_deferred_updates(e.what());
      throw PartialUpdateError(
          fmt::format("{}; it was applying the update deferred from step {}, so {} may hold part of it", e.what(),
                      im.deferred_step.step, fmt::join(changed, ", ")),
          changed, std::current_exception());
    }
    im.deferred_pending[id] = 0;
  }
  return run.host_non_finite;
}

}  // namespace ferry::graph
