// Recomputation (gradient checkpointing): training with segments recomputed gives bit-identical
// losses, weights and optimizer state to keeping every activation (residual MLP, CNN with pooling
// indices, GPT with dropout), lowers the planned device peak when activations dominate, places
// each segment's copies before its backward, and refuses settings with nothing to recompute.
#include <random>

#include "classifier.hpp"
#include "ferry/ferry.hpp"
#include "runtime/trainer_internals.hpp"
#include "test_models.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

// Steps both trainers on the same batches and expects every loss and persistent tensor equal.
void expect_bit_identical(
    Trainer& a, Trainer& b,
    const std::function<Batch(int, std::vector<std::vector<float>>&, std::vector<std::vector<std::int32_t>>&)>& batch) {
  for (int s = 0; s < 3; ++s) {
    std::vector<std::vector<float>> floats;
    std::vector<std::vector<std::int32_t>> ints;
    const Batch in = batch(s, floats, ints);
    ASSERT_EQ(a.step(in).loss, b.step(in).loss) << "step " << s;
  }
  for (const auto& name : a.tensor_names()) EXPECT_EQ(a.read_tensor(name).bytes, b.read_tensor(name).bytes) << name;
}

TrainerOptions with_recompute(std::uint32_t batch, std::uint32_t every) {
  TrainerOptions o;
  o.batch = batch;
  o.lr = 0.01f;
  o.recompute = every;
  return o;
}

TEST(Recompute, ClassifiersTrainBitIdentically) {
  Runtime rt;
  for (const ModelSpec& m : {small_residual(), small_cnn(), models::deep(32, 4)}) {
    SCOPED_TRACE(m.name);
    Trainer kept(rt, m, with_recompute(8, 0)), recomputed(rt, m, with_recompute(8, 2));
    const std::size_t sample = sample_elems(m);
    expect_bit_identical(kept, recomputed, [&](int s, auto& floats, auto& ints) {
      floats.push_back(random_vector(8 * sample, 30 + s));
      ints.push_back(labels_for(8, 40 + s));
      return Batch{{"input", HostView(floats.back())}, {"labels", HostView(ints.back())}};
    });
    EXPECT_GT(compiled_train_step(recomputed).node_count(), compiled_train_step(kept).node_count());
  }
}

TEST(Recompute, GptWithDropoutTrainsBitIdentically) {
  Runtime rt;
  models::GptConfig c;
  c.vocab = 11;
  c.width = 16;
  c.depth = 3;
  c.heads = 2;
  c.context = 8;
  c.dropout = 0.2f;
  const ModelSpec m = models::gpt(c);
  Trainer kept(rt, m, with_recompute(4, 0)), recomputed(rt, m, with_recompute(4, 3));
  expect_bit_identical(kept, recomputed, [&](int s, auto&, auto& ints) {
    ints.push_back(labels_for(4 * c.context, 50 + s, c.vocab));
    ints.push_back(labels_for(4 * c.context, 60 + s, c.vocab));
    return Batch{{"tokens", HostView(ints[0])}, {"next", HostView(ints[1])}};
  });
}

TEST(Recompute, LowersThePeakWhenActivationsDominate) {
  Runtime rt;
  const ModelSpec m = models::deep(64, 8);
  const Trainer kept(rt, m, with_recompute(512, 0)), recomputed(rt, m, with_recompute(512, 4));
  EXPECT_LT(recomputed.device_peak_bytes(), kept.device_peak_bytes() * 3 / 4)
      << recomputed.device_peak_bytes() << " vs " << kept.device_peak_bytes();
}

TEST(Recompute, CopiesComeBeforeTheirSegmentsBackward) {
  const ModelSpec m = models::deep(16, 4);
  graph::VariantKey key{4, true};
  key.recompute = 2;
  const graph::Graph g = graph::prepare_step_graph(forward_graph(m, key), key, {});
  // Every recomputed tensor is written before anything reads it, and something reads it.
  std::map<TensorId, graph::NodeId> written;
  std::size_t copies = 0;
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    for (TensorId x : g.nodes.inputs(n)) {
      const TensorId s = g.tensors.storage(x);
      if (g.tensors.name[s].find(".recomputed") == std::string::npos) continue;
      ASSERT_TRUE(written.count(s)) << g.tensors.name[s] << " read by " << g.nodes.name[n] << " before written";
    }
    for (TensorId x : g.nodes.outputs(n)) written.emplace(g.tensors.storage(x), n);
    copies += g.nodes.name[n].find(".recompute") != std::string::npos;
  }
  EXPECT_GT(copies, 0u);
}

TEST(Recompute, NothingToRecomputeIsAClearError) {
  Runtime rt;
  try {
    Trainer t(rt, models::deep(16, 2), with_recompute(4, 100));
    ADD_FAILURE() << "accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("nothing to recompute"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace ferry::test
