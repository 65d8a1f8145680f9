// The model passes of the compile pipeline, in order.
#include "graph/pipeline.hpp"

#include <algorithm>

namespace ferry::graph {

ZeroSharding zero_sharding(const VariantKey& key, const OptimizerConfig& optimizer) {
  if (key.zero_stage < 1 || key.ranks < 2) return {};
  return {static_cast<int>(key.rank), static_cast<int>(key.ranks), std::max<std::size_t>(2048, optimizer.block8bit)};
}

const std::vector<ModelPass>& model_passes() {
  static const std::vector<ModelPass> passes = {
      {"fusion",
       [](Graph& g, const VariantKey& key, const OptimizerConfig&) {
         if (key.fuse) fuse_layers(g);
       }},
      {"mixed precision",
       [](Graph& g, const VariantKey& key, const OptimizerConfig&) {
         if (key.precision != DType::f32 && !key.int8_weights) apply_mixed_precision(g, key.precision);
       }},
      {"autodiff",
       [](Graph& g, const VariantKey& key, const OptimizerConfig&) {
         if (!key.training) return;
         append_backward(g);
         if (key.precision != DType::f32 && !key.int8_weights) unscale_f32_weight_gradients(g);
       }},
      {"backward fusion",
       [](Graph& g, const VariantKey& key, const OptimizerConfig&) {
         if (key.training && key.fuse) fuse_activation_grads(g);
       }},
      {"narrowing fusion",
       [](Graph& g, const VariantKey& key, const OptimizerConfig&) {
         if (key.fuse && key.precision != DType::f32 && !key.int8_weights) fuse_narrowing_casts(g);
       }},
      {"recompute",
       [](Graph& g, const VariantKey& key, const OptimizerConfig&) {
         if (key.training && key.recompute > 0) apply_recompute(g, key.recompute);
       }},
      // Every training variant: what its state updates (optimizer, gradient sums, predictor fits)
      // check, and the point after which a step may change state kept on the device in place
      // (graph::CompiledStep's commit gate).
      {"overflow guard",
       [](Graph& g, const VariantKey& key, const OptimizerConfig&) {
         if (key.training) append_overflow_guard(g);
       }},
      {"accumulate",
       [](Graph& g, const VariantKey& key, const OptimizerConfig&) {
         if (key.training && key.accumulate > 1) append_accumulation(g, key.accumulate, key.micro);
       }},
      {"data parallel",
       [](Graph& g, const VariantKey& key, const OptimizerConfig& optimizer) {
         if (!key.training || key.ranks < 2) return;
         if (key.micro) {
           // Micro-batches reduce nothing; with loss scaling the ranks agree on dropping one.
           if (key.loss_scaling) append_micro_batch_guard_agreement(g);
           return;
         }
         if (key.zero_stage == 2) {
           append_gradient_reduce_scatter(g, key.rank_share, key.bucket_bytes, zero_sharding(key, optimizer));
         } else {
           append_gradient_allreduce(g, key.rank_share, key.bucket_bytes);
         }
       }},
      {"optimizer",
       [](Graph& g, const VariantKey& key, const OptimizerConfig& optimizer) {
         if (key.training && !key.micro) append_optimizer(g, optimizer, zero_sharding(key, optimizer));
       }},
      {"zero gather",
       [](Graph& g, const VariantKey& key, const OptimizerConfig& optimizer) {
         const ZeroSharding zero = zero_sharding(key, optimizer);
         if (key.training && !key.micro && zero.sharded()) append_weight_allgather(g, zero, key.bucket_bytes);
       }},
      {"predictor",
       [](Graph& g, const VariantKey& key, const OptimizerConfig& optimizer) {
         if (key.training && !key.micro && key.fit_predictor) append_predictor_fit(g, optimizer.predictor);
         if (!key.training && key.apply_predictor) append_predictor_apply(g, optimizer.predictor);
       }},
      {"int8 weights",
       [](Graph& g, const VariantKey& key, const OptimizerConfig&) {
         if (!key.training && key.int8_weights) apply_int8_weights(g);
       }},
      {"download", [](Graph& g, const VariantKey&, const OptimizerConfig&) { append_stats_download(g); }},
      // Last: the checks' gradients have their final writers by now (sums over micro-batches and
      // ranks included).
      {"guard fusion",
       [](Graph& g, const VariantKey& key, const OptimizerConfig&) {
         if (key.training && key.fuse) fuse_guard_checks(g);
       }},
  };
  return passes;
}

Graph prepare_step_graph(Graph forward, const VariantKey& key, const OptimizerConfig& optimizer) {
  for (const ModelPass& pass : model_passes()) pass.run(forward, key, optimizer);
  return forward;
}

}  // namespace ferry::graph
