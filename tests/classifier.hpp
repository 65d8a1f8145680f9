// Classifier graphs built by hand in tests: the batch tensors of models::classifier ("input" f32
// [batch, sample...], "labels" i32 [batch]) and its loss, on a plain graph::Builder.
#pragma once

#include "ferry/graph/builder.hpp"
#include "ferry/runtime/model.hpp"

namespace ferry::test {

class ClassifierBuilder : public graph::Builder {
 public:
  ClassifierBuilder(graph::Graph& g, std::uint32_t batch, graph::Shape sample, std::uint32_t classes)
      : Builder(g, batch),
        input_(Builder::input("input", sample)),
        labels_(Builder::input("labels", graph::Shape{}, graph::DType::i32, graph::Role::label)),
        classes_(classes) {}
  using Builder::input;
  TensorId input() const { return input_; }
  TensorId labels() const { return labels_; }
  std::uint32_t classes() const { return classes_; }
  using Builder::softmax_xent;
  TensorId softmax_xent(TensorId logits) { return Builder::softmax_xent(logits, labels_); }

 private:
  TensorId input_, labels_;
  std::uint32_t classes_;
};

// A classifier model's sample size and class count (models::classifier's batch tensors).
inline std::size_t sample_elems(const ModelSpec& m) {
  return m.inputs.at(0).sample.elems();
}
inline std::uint32_t classes_of(const ModelSpec& m) {
  return m.targets.at(0).id_limit;
}

}  // namespace ferry::test
