// One check many suites share: a trainer's steps on the device against the same steps on the CPU
// reference executor, from the same initial weights.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "classifier.hpp"
#include "ferry/ferry.hpp"
#include "reference_executor.hpp"
#include "runtime/trainer_internals.hpp"
#include "test_support.hpp"

namespace ferry::test {

// A model's training step graph as the trainer builds it (builder, loss, the model passes), with
// no device.
inline graph::Graph training_graph(const ModelSpec& m, std::uint32_t batch, const ops::OptimizerConfig& opt) {
  const graph::VariantKey key{batch, true};
  return graph::prepare_step_graph(forward_graph(m, key), key, opt);
}

// ferry::min_stream_budget, which must exist for the test's model.
inline std::uint64_t stream_budget(Runtime& rt, const ModelSpec& m, const TrainerOptions& base) {
  const auto budget = min_stream_budget(rt, m, base);
  if (!budget) ADD_FAILURE() << "a 1-byte budget should not fit";
  return budget.value_or(0);
}

// Gives every weight of the executor's graph values uniform in [lo, hi), seeded per weight from
// `seed` upwards in creation order.
inline void randomize_weights(ReferenceExecutor& ref, const graph::Graph& g, std::uint32_t seed, float lo = -1.0f,
                              float hi = 1.0f) {
  for (TensorId id = 0; id < g.tensors.size(); ++id) {
    if (g.tensors.role[id] == graph::Role::weight) {
      ref.value(id) = to_double(random_vector(g.tensors.shape[id].elems(), seed++, lo, hi));
    }
  }
}

// Runs `steps` steps of random inputs in [lo, hi) (seeded from `seed`) and labels
// (i * label_stride + step) % classes on `trainer` and on the reference executor; expects the
// losses to agree to 1e-4 (relative) and every parameter afterwards to 1e-4.
// The trainer's parameters, as the reference executor's starting values.
inline void load_parameters(ReferenceExecutor& ref, const Trainer& trainer) {
  for (const auto& name : trainer.parameter_names())
    ref.value(ref.find(name)) = to_double(trainer.read_parameter(name));
}

// Every parameter of the trainer equals the reference's to `tol`.
inline void expect_parameters_match(const Trainer& trainer, ReferenceExecutor& ref, double tol) {
  for (const auto& name : trainer.parameter_names()) {
    const auto device = trainer.read_parameter(name);
    const auto& host = ref.value(ref.find(name));
    for (std::size_t i = 0; i < device.size(); ++i) ASSERT_NEAR(device[i], host[i], tol) << name << "[" << i << "]";
  }
}

inline void expect_training_matches_reference(Trainer& trainer, std::uint32_t steps, std::uint32_t seed,
                                              std::uint32_t label_stride = 7, float lo = -1.0f, float hi = 1.0f) {
  const auto& topt = trainer.options();
  const std::size_t sample = sample_elems(trainer.model());
  const std::uint32_t classes = classes_of(trainer.model());
  ReferenceExecutor ref(compiled_train_step(trainer).graph(), topt.optimizer);
  load_parameters(ref, trainer);
  for (std::uint32_t s = 0; s < steps; ++s) {
    const auto images = random_vector(topt.batch * sample, seed + s, lo, hi);
    std::vector<std::int32_t> labels(topt.batch);
    for (std::size_t i = 0; i < labels.size(); ++i)
      labels[i] = static_cast<std::int32_t>((i * label_stride + s) % classes);
    const auto r = trainer.step(images, labels);
    ref.value(ref.find("input")) = to_double(images);
    ref.ints(ref.find("labels")) = labels;
    ref.run(ops::StepInfo{s + 1, trainer.lr()});
    EXPECT_NEAR(r.loss, ref.loss(), 1e-4 * std::max(1.0, std::abs(ref.loss()))) << "step " << s;
  }
  expect_parameters_match(trainer, ref, 1e-4);
}

// After ref.run(...) computed `grad` = d(loss)/d(t): checks it against finite differences of the
// forward pass in t's values (up to `checks` of them), then restores t.
inline void expect_reference_gradient_matches_finite_differences(ReferenceExecutor& ref, TensorId t, TensorId grad,
                                                                 const std::string& what, std::size_t checks,
                                                                 const ops::StepInfo& step = {1, 0.0f},
                                                                 double eps = 1e-6, double tol = 1e-4) {
  const std::vector<double> g = ref.value(grad), x = ref.value(t);
  auto loss = [&](const std::vector<double>& values) {
    ref.value(t) = values;
    ref.run(step, /*forward_only=*/true);
    return ref.loss();
  };
  expect_gradient_matches_finite_differences(loss, x, g, what.c_str(), eps, tol, checks);
  ref.value(t) = x;
}

}  // namespace ferry::test
