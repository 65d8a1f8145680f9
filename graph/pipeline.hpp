// Compiling a step is an ordered list of passes over the IR.
//
//   model passes (device-independent, here):    fusion -> mixed precision -> autodiff -> recompute ->
//                                               overflow guard -> accumulate -> optimizer ->
//                                               predictor -> int8 weights -> download
//   device passes (graph::CompiledStep, in order): check dtypes -> scratch -> residency and memory
//                                                  plan -> arena -> bind -> lower
//
// Each pass is a plain function of the graph, tested on its own (tests/test_pipeline.cpp). A
// compiled variant of a model is keyed by what differs between variants (VariantKey); the
// precision and recompute passes of the phase work slot in before residency.
#pragma once

#include <compare>
#include <cstdint>
#include <string>
#include <vector>

#include "ferry/graph/ir.hpp"
#include "graph/autodiff.hpp"

namespace ferry::graph {

// What differs between the compiled variants of one model.
struct VariantKey {
  std::uint32_t batch = 0;
  bool training = true;  // false: forward, loss and download only (evaluation, prediction)
  bool predict = false;  // forward only, the prediction downloaded, no targets or loss
  // Hybrid phases (runtime/phases/): a training variant that also fits the weight-update
  // predictor after each update (Warmup, Full, Correct), or a forward-and-loss variant that
  // advances the weights by the predictor instead of an optimizer (Predict).
  bool fit_predictor = false;
  bool apply_predictor = false;
  // Gradient accumulation over `accumulate` micro-batches (ops/accumulate.hpp): a micro variant
  // adds the gradients into their sums and has no optimizer; the other training variant takes
  // the mean of the sums and updates.
  std::uint32_t accumulate = 1;
  bool micro = false;
  // Recompute the activations of segments of this many layers in backward (0: keep them all).
  std::uint32_t recompute = 0;
  // Forward-only variants: the layers (all but the head) read int8 weights (apply_int8_weights).
  bool int8_weights = false;
  // Mixed precision (apply_mixed_precision): f16 or bf16 layers over f32 master weights; f32
  // is none. Ignored in int8 variants.
  DType precision = DType::f32;
  // Loss scaling (training variants that update): the scale multiplies the narrow gradients. (The
  // updates of every training variant check the overflow guard.)
  bool loss_scaling = false;
  // Fuse layer pairs (fuse_layers, fuse_activation_grads) and gradients' overflow checks into the
  // kernels that make them (fuse_guard_checks); off only to compare against the unfused graph.
  bool fuse = true;
  // Data-parallel training over `ranks` ranks (graph::append_gradient_allreduce): this rank's
  // share of the global batch, and the bytes of gradients reduced together.
  std::uint32_t ranks = 1;
  float rank_share = 1.0f;
  std::uint64_t bucket_bytes = 0;
  // ZeRO stage 1: this rank (of `ranks`) keeps and updates its share of the optimizer state
  // (graph::ZeroSharding), and the weights are all-gathered after the updates; stage 2 also
  // reduce-scatters the gradients (graph::append_gradient_reduce_scatter).
  std::uint32_t rank = 0;
  std::uint8_t zero_stage = 0;
  auto operator<=>(const VariantKey&) const = default;
};

// The ZeRO sharding of a variant: none below stage 1 or alone; cuts on multiples of the 8-bit
// optimizer's block (at least 2048 elements), so that its blocks stay whole.
ZeroSharding zero_sharding(const VariantKey& key, const OptimizerConfig& optimizer);

struct ModelPass {
  const char* name;
  void (*run)(Graph&, const VariantKey&, const OptimizerConfig&);
};

// The model passes in the order above; each does nothing in variants it does not apply to.
const std::vector<ModelPass>& model_passes();

// Runs the model passes on a forward graph (built with graph::Builder up to its loss).
Graph prepare_step_graph(Graph forward, const VariantKey& key, const OptimizerConfig& optimizer);

// Wall time of one pass of a compile, for compile-time reports.
struct PassTiming {
  std::string name;
  double ms = 0;
};

}  // namespace ferry::graph
