// Reverse-mode autodiff and optimizer updates, as passes that append nodes to a step graph.
#pragma once

#include "ferry/graph/ir.hpp"
#include "ferry/ops/optimizer.hpp"

namespace ferry::graph {

using OptimizerSpec = ops::OptimizerConfig;
using ops::optimizer_name;

// Appends the backward nodes of every forward node, in reverse order, from the loss
// (softmax_xent) back to the weights. Gradients of tensors used more than once are summed;
// gradients nothing needs (of the input, of paths without weights) are not computed.
// Sets tensors.grad for every tensor that gets one.
void append_backward(Graph& g);

// Appends one update node per weight that has a gradient, creating its optimizer state tensors
// (role optimizer_state, zero-initialised).
void append_optimizer(Graph& g, const OptimizerSpec& spec);

// The weight-update predictor (ops/predictor.hpp). append_predictor_fit puts a snapshot of each
// weight before its optimizer update and a fit after it; append_predictor_apply adds one apply
// node per weight (a Predict step). Both create the predictor state of every weight they touch
// (role predictor_state): "<w>.pred_d" shaped like w and "<w>.pred_stats" [4], zero-initialised.
void append_predictor_fit(Graph& g, const ops::PredictorConfig& c);
void append_predictor_apply(Graph& g);

// Recomputation (gradient checkpointing), after autodiff: the forward nodes are cut into segments
// of `every` layers (nodes that read a weight); the activations backward reads from a segment
// other than the last come from copies of the segment's nodes placed just before its backward.
// Throws std::invalid_argument when `every` is 0 or leaves one segment (at least the layer count).
void apply_recompute(Graph& g, std::uint32_t every);

// int8 weights in a forward-only variant (Predict, int8 evaluation): every Linear and Conv2d layer
// but the head reads its weight through quantize_i8 -> dequantize_i8 (per output channel).
void apply_int8_weights(Graph& g);

// Gradient accumulation over key.accumulate > 1 micro-batches: with micro, one grad_accumulate
// node per weight gradient into "<w>.grad_sum" (role gradient_sum, zero-initialised); without,
// one grad_mean node per weight gradient (the gradient becomes the group's mean). Before the
// optimizer pass.
void append_accumulation(Graph& g, std::uint32_t accumulate, bool micro);

// Appends the node that copies the loss statistics to the host at the end of the step.
void append_stats_download(Graph& g);

}  // namespace ferry::graph
