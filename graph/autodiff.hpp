// Reverse-mode autodiff and optimizer updates, as passes that append nodes to a step graph.
#pragma once

#include <string_view>
#include <vector>

#include "ferry/graph/ir.hpp"
#include "ferry/ops/communicator.hpp"
#include "ferry/ops/optimizer.hpp"

namespace ferry::graph {

using ops::optimizer_name;
using ops::OptimizerConfig;

// Appends the backward nodes of every forward node, in reverse order, from the loss
// (softmax_xent) back to the weights. Gradients of tensors used more than once are summed;
// gradients nothing needs (of the input, of paths without weights) are not computed.
// Sets tensors.grad for every tensor that gets one.
void append_backward(Graph& g);

// ZeRO stages 1 and 2 over `ranks` ranks: this rank keeps the optimizer state of, and updates, only
// its share of each trainable weight (ops::zero_shard; ordinals count the weights with gradients in
// tensor order), and the weights are all-gathered after the updates. One rank: no sharding.
struct ZeroSharding {
  int rank = 0, ranks = 1;
  std::size_t granule = 2048;  // elements; a multiple of the 8-bit optimizer's block
  bool sharded() const { return ranks > 1; }
};

// This rank's share of every trainable weight (role weight, with a gradient), in tensor order:
// element k's ordinal is k. Shares of other ranks' small weights are empty.
struct ZeroShare {
  TensorId weight;
  ops::ShardRange range;
};
std::vector<ZeroShare> zero_shares(const Graph& g, const ZeroSharding& zero);

// Appends one update node per weight that has a gradient, creating its optimizer state tensors
// (role optimizer_state, zero-initialised). Sharded: state and update for this rank's share of
// each weight only (a 1-D state tensor of the share's size; the update's UpdateAttrs say
// which elements), none for a weight with no share here.
void append_optimizer(Graph& g, const OptimizerConfig& spec, const ZeroSharding& zero = {});

// The weight-update predictor (ops/predictor.hpp). append_predictor_fit puts a snapshot of each
// weight before the first node that writes it (its optimizer update) and a fit after the last
// (with ZeRO, the copy of the other ranks' shares); append_predictor_apply adds one apply
// node per weight (a Predict step). Both create the predictor state of every weight they touch
// (role predictor_state): "<w>.pred_d" shaped like w, "<w>.pred_stats" [8] and, with residual
// correction, "<w>.pred_r" shaped like w, zero-initialised.
void append_predictor_fit(Graph& g, const ops::PredictorConfig& c);
void append_predictor_apply(Graph& g, const ops::PredictorConfig& c);

// Recomputation (gradient checkpointing), after autodiff: the forward nodes are cut into segments
// of `every` layers (nodes that read a weight); the activations backward reads from a segment
// other than the last come from copies of the segment's nodes placed just before its backward.
// Throws std::invalid_argument when `every` is 0 or leaves one segment (at least the layer count).
void apply_recompute(Graph& g, std::uint32_t every);

// The head: the last node before the loss that reads a weight (precision passes keep it f32).
NodeId head_layer(const Graph& g);

// Fusion, first of the model passes: a ReLU whose output only a max-pool reads becomes part of
// that pool (ops::Pool2dShape::relu: max(0, max over the window), argmax -1 where that is 0), so
// the ReLU's forward pass and its backward mask disappear and the pool's backward routes gradient
// only where the ReLU let it through. Exact: max and ReLU commute, values and gradients are
// bit-identical to the unfused graph. See graph/passes/fusion.cpp.
void fuse_relu_maxpool(Graph& g);
// Every fusion of the pass: fuse_relu_maxpool, then each remaining ReLU whose input only it reads
// and a convolution or a Linear makes joins that layer's epilogue (ops::Conv2dShape::relu,
// GemmOptions::relu; backward masks dy with y > 0 before the layer's gradients), then each add whose sum a LayerNorm
// reads becomes, with that LayerNorm, one add_layernorm node (a residual stream: the sum is written and normalised in
// one pass; backward adds the sum's other gradient into dx in the same kernel). All exact.
void fuse_layers(Graph& g);
// After autodiff: each activation's backward whose output gradient only the next Linear's input
// gradient makes joins that GEMM's epilogue (ops::GemmOptions::dact), which then reads z and writes
// dx where it wrote dy. Exact (ops::GemmOptions::dact gives the activation kernel's bits).
void fuse_activation_grads(Graph& g);
// After mixed precision and autodiff: each LayerNorm whose output only a cast to f16 or bf16 reads
// stores that narrow output itself (ops::LayerNormAttrs::y), the cast left out. Exact.
void fuse_narrowing_casts(Graph& g);

// Mixed precision, before autodiff: Linear, Conv2d, activation and max-pool nodes but the head
// compute from and store `narrow` (f16 or bf16), reading narrow casts of their float inputs
// (weights cast from their f32 masters once per step; biases stay f32); every other node reads
// f32 (casts back where needed). See graph/passes/mixed_precision.cpp.
void apply_mixed_precision(Graph& g, DType narrow);
// Mixed precision, after autodiff: the f32 weights a narrow node reads as they are (its bias) get
// their gradients from its loss-scaled narrow gradient, so each is divided by the loss scale (a
// cast f32 -> f32 by StepInfo::loss_scale's inverse, right after its last writer), as the casts
// back to f32 do for the narrow weights' gradients.
void unscale_f32_weight_gradients(Graph& g);
// The f16 or bf16 device tensor node `n` of `nodes` widens whole into `out` (a storage tensor), if
// `n` is such a cast on a device lane: the narrow gradient a mixed-precision step copies to the
// host in place of its f32 widening (the host optimizer's write-backs, data-parallel sends).
TensorId widened_narrow_tensor(const TensorTable& t, const NodeTable& nodes, NodeId n, TensorId out);

// Every training variant, after autodiff and before the state updates: a node "overflow_guard"
// over the loss and every weight gradient makes g.guard (role stats, downloaded as
// overflow_guard_name), which the optimizer updates, gradient accumulation and predictor fits
// check in place of the loss (ops/overflow_guard.hpp): a step whose loss or any gradient is not
// finite (with fp16 loss scaling: whose scaled gradients overflowed) updates nothing. It is also
// the step's commit point: nodes that change state homed on the device in place come after it,
// and graph::CompiledStep enqueues them only once everything before it has succeeded.
inline constexpr std::string_view overflow_guard_name = "overflow_guard";
// The one-element host tensor that chains a data-parallel step's collectives (every rank issues
// them in the same order; graph/passes/data_parallel.cpp).
inline constexpr std::string_view collective_order_name = "collective.order";
// The weights with gradients, in the order the nodes that last write their gradients come (the
// order backward finishes them): the guard's checks and the data-parallel buckets follow it.
std::vector<TensorId> weights_in_gradient_order(const Graph& g);
void append_overflow_guard(Graph& g);
// The guard's checks folded into the nodes that make the gradients, where their rows check their
// own outputs (ops::OpInfo::checks_outputs: a Linear's weight gradient in its product's epilogue,
// its bias and a LayerNorm's gain and shift gradients as they are stored) and no later node sums
// into the gradient: such a node checks into a flag ("overflow_guard.products", one more input and
// output), its checks go, the flag starts as the loss before the first such node and the guard's
// init copies the flag instead of the loss. The guard's value and its last writer (the commit
// point) are unchanged. See graph/passes/guard_fusion.cpp.
void fuse_guard_checks(Graph& g);

// int8 weights in a forward-only variant (Predict, int8 evaluation): every Linear and Conv2d layer
// but the head reads its weight through quantize_i8 -> dequantize_i8 (per output channel).
void apply_int8_weights(Graph& g);

// Gradient accumulation over key.accumulate > 1 micro-batches: with micro, one grad_accumulate
// node per weight gradient into "<w>.grad_sum" (role gradient_sum, zero-initialised); without,
// one grad_mean node per weight gradient (the gradient becomes the group's mean). Before the
// optimizer pass.
void append_accumulation(Graph& g, std::uint32_t accumulate, bool micro);

// Data-parallel training: every weight gradient summed over the ranks, each rank's scaled by
// `share` (its samples / the global batch's), in buckets of about `bucket_bytes` issued in the
// order backward finishes them (graph/passes/data_parallel.cpp; rows in ops/table/collective.cpp),
// then checked by the overflow guard. After the accumulation pass, before the optimizer's.
void append_gradient_allreduce(Graph& g, float share, std::uint64_t bucket_bytes);

// ZeRO stage 2, in place of append_gradient_allreduce: every weight gradient reduce-scattered over
// the ranks (scaled by `share`), so that this rank receives the sum of its share of each weight
// only, into a device tensor "<gradient>.shard" of the share's size, which becomes the weight's
// gradient for the optimizer pass (the whole gradient dies once it is sent). The overflow guard
// checks the shards, then the ranks sum their guards (non-finite on every rank when it is on one).
void append_gradient_reduce_scatter(Graph& g, float share, std::uint64_t bucket_bytes, const ZeroSharding& zero);

// ZeRO stages 1 and 2, after the optimizer pass: every trainable weight copied to pinned host memory
// after its update, all-gathered from the ranks that own its shares (host-lane nodes in buckets
// of about `bucket_bytes`, in the same chain as the gradient reductions), and copied back.
void append_weight_allgather(Graph& g, const ZeroSharding& zero, std::uint64_t bucket_bytes);

// A micro-batch of data-parallel training with loss scaling: the ranks sum their overflow guards
// before the gradients go into their sums (inserted before the first grad_accumulate node), so a
// micro-batch that overflowed on one rank is dropped on all of them and every rank's group waits
// for another one together. After the accumulation pass.
void append_micro_batch_guard_agreement(Graph& g);

// Appends the node that copies the loss statistics to the host at the end of the step.
void append_stats_download(Graph& g);

}  // namespace ferry::graph
