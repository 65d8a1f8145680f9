// The named, typed attributes of the built-in ops. A node stores its attributes in NodeAttrs (four
// ints, two floats: compact, comparable, hashed into program keys); which slot holds what is this
// file's business alone. Builders write `XAttrs{...}.pack()`, rows and passes read `XAttrs::of(a)`.
// A user's row may keep its own struct the same way. (permute's attribute is its permutation, the
// whole of i[]: ops/table/permute.cpp.)
#pragma once

#include <cstddef>
#include <cstdint>

#include "ferry/ops/activation.hpp"
#include "ferry/ops/cast.hpp"
#include "ferry/ops/predictor.hpp"
#include "ferry/ops/types.hpp"

namespace ferry::ops {

// Rows with a ReluFusion (conv2d, linear, maxpool2d) say in slot i[2] whether a ReLU was fused in; the
// fusion pass sets it without knowing the op.
inline bool relu_fused(const NodeAttrs& a) {
  return a.i[2] != 0;
}
inline void set_relu_fused(NodeAttrs& a) {
  a.i[2] = 1;
}

// fetch: after_write_back (the stream transform: the fetch follows this step's write-back of its
// tensor); chunk_kib > 0: a chunked fetch (staged host memory, graph/passes/staging.cpp), copied
// through the step's ring of pinned chunks of that many KiB (BindContext::staged_copier).
struct FetchAttrs {
  bool after_write_back = false;
  std::int32_t chunk_kib = 0;
  NodeAttrs pack() const { return {{after_write_back ? 1 : 0, chunk_kib, 0, 0}, {}}; }
  static FetchAttrs of(const NodeAttrs& a) { return {a.i[0] != 0, a.i[1]}; }
};

// activation: which one.
struct ActivationAttrs {
  Activation kind = Activation::relu;
  NodeAttrs pack() const { return {{static_cast<std::int32_t>(kind), 0, 0, 0}, {}}; }
  static ActivationAttrs of(const NodeAttrs& a) { return {static_cast<Activation>(a.i[0])}; }
};

// linear_grad_input: an activation's backward fused in (the fusion pass), dx = act'(z) (dy w^T) with
// z its third input. Slot i[3], clear of the ReLU flag the forward's attributes carry in i[2].
struct LinearGradInputAttrs {
  bool fused = false;
  Activation act = Activation::relu;
  NodeAttrs pack() const { return {{0, 0, 0, fused ? 1 + static_cast<std::int32_t>(act) : 0}, {}}; }
  static LinearGradInputAttrs of(const NodeAttrs& a) {
    return {a.i[3] != 0, a.i[3] != 0 ? static_cast<Activation>(a.i[3] - 1) : Activation::relu};
  }
  static void set(NodeAttrs& a, Activation act) { a.i[3] = 1 + static_cast<std::int32_t>(act); }
};

// layernorm (and its fusions): the variance's epsilon.
// layernorm, add_layernorm: y stored as `y` (graph::fuse_narrowing_casts sets f16 or bf16 where
// only a cast to that type read an f32 y); x, the statistics and the gradients stay f32.
struct LayerNormAttrs {
  float eps = 1e-5f;
  DType y = DType::f32;
  NodeAttrs pack() const { return {{static_cast<std::int32_t>(y), 0, 0, 0}, {eps, 0.0f}}; }
  static LayerNormAttrs of(const NodeAttrs& a) { return {a.f[0], static_cast<DType>(a.i[0])}; }
};

// conv2d: stride and zero padding of both spatial axes; a ReLU fused into the epilogue.
struct Conv2dAttrs {
  std::int32_t stride = 1, pad = 0;
  bool relu = false;
  NodeAttrs pack() const { return {{stride, pad, relu ? 1 : 0, 0}, {}}; }
  static Conv2dAttrs of(const NodeAttrs& a) { return {a.i[0], a.i[1], relu_fused(a)}; }
};

// maxpool2d: window and stride of both spatial axes; a ReLU fused in (it reads the ReLU's input).
struct MaxPool2dAttrs {
  std::int32_t window = 2, stride = 2;
  bool relu = false;
  NodeAttrs pack() const { return {{window, stride, relu ? 1 : 0, 0}, {}}; }
  static MaxPool2dAttrs of(const NodeAttrs& a) { return {a.i[0], a.i[1], relu_fused(a)}; }
};

// cast: the target dtype and the loss-scale factor applied on the way. The raw numbers stay
// readable (to_code, scale_code) so that a row can refuse values outside the enums.
struct CastAttrs {
  DType to = DType::f32;
  CastScale scale = CastScale::none;
  NodeAttrs pack() const { return {{static_cast<std::int32_t>(to), static_cast<std::int32_t>(scale), 0, 0}, {}}; }
  static CastAttrs of(const NodeAttrs& a) { return {static_cast<DType>(a.i[0]), static_cast<CastScale>(a.i[1])}; }
  static std::int32_t to_code(const NodeAttrs& a) { return a.i[0]; }
  static std::int32_t scale_code(const NodeAttrs& a) { return a.i[1]; }
};

// quantize_i8, dequantize_i8: the [outer, channels, inner] view with one scale per channel.
struct QuantAttrs {
  QuantLayout layout;
  NodeAttrs pack() const {
    return {{static_cast<std::int32_t>(layout.outer), static_cast<std::int32_t>(layout.channels),
             static_cast<std::int32_t>(layout.inner), 0},
            {}};
  }
  static QuantAttrs of(const NodeAttrs& a) {
    return {{static_cast<std::size_t>(a.i[0]), static_cast<std::size_t>(a.i[1]), static_cast<std::size_t>(a.i[2])}};
  }
};

// matmul: a stored as [..., K, M] and/or b as [..., N, K]; alpha scales the product (0 means 1).
struct MatmulAttrs {
  bool transpose_a = false, transpose_b = false;
  float alpha = 0.0f;
  NodeAttrs pack() const { return {{transpose_a ? 1 : 0, transpose_b ? 1 : 0, 0, 0}, {alpha, 0.0f}}; }
  static MatmulAttrs of(const NodeAttrs& a) { return {a.i[0] != 0, a.i[1] != 0, a.f[0]}; }
  float product_scale() const { return alpha == 0.0f ? 1.0f : alpha; }
  // The raw flag of operand 0 (a) or 1 (b), for a row that refuses values other than 0 and 1.
  static std::int32_t transpose_code(const NodeAttrs& a, int operand) { return a.i[operand]; }
};

// softmax: causal (square [..., T, T] scores, entries past the diagonal masked).
struct SoftmaxAttrs {
  bool causal = false;
  NodeAttrs pack() const { return {{causal ? 1 : 0, 0, 0, 0}, {}}; }
  static SoftmaxAttrs of(const NodeAttrs& a) { return {a.i[0] != 0}; }
};

// attention (fused causal): heads, the scale of q kᵀ (0: 1 / sqrt(head dim)), dropout of the
// probabilities and its seed.
struct AttentionAttrs {
  std::int32_t heads = 1;
  float scale = 0.0f;
  float dropout = 0.0f;
  std::uint32_t seed = 0;
  NodeAttrs pack() const { return {{heads, static_cast<std::int32_t>(seed), 0, 0}, {scale, dropout}}; }
  static AttentionAttrs of(const NodeAttrs& a) { return {a.i[0], a.f[0], a.f[1], static_cast<std::uint32_t>(a.i[1])}; }
};

// dropout: the probability of zeroing an element, and the seed of the counter RNG.
struct DropoutAttrs {
  float p = 0.0f;
  std::uint32_t seed = 0;
  NodeAttrs pack() const { return {{static_cast<std::int32_t>(seed), 0, 0, 0}, {p, 0.0f}}; }
  static DropoutAttrs of(const NodeAttrs& a) { return {a.f[0], static_cast<std::uint32_t>(a.i[0])}; }
};

// scale (y = x * factor) and grad_mean (the mean of accumulated gradients: factor 1 / micro-batches).
struct FactorAttrs {
  float factor = 1.0f;
  NodeAttrs pack() const { return {{}, {factor, 0.0f}}; }
  static FactorAttrs of(const NodeAttrs& a) { return {a.f[0]}; }
};

// loss_sum: loss = weight_a a + weight_b b.
struct LossSumAttrs {
  float weight_a = 1.0f, weight_b = 1.0f;
  NodeAttrs pack() const { return {{}, {weight_a, weight_b}}; }
  static LossSumAttrs of(const NodeAttrs& a) { return {a.f[0], a.f[1]}; }
};

// The gradient rows of losses (softmax_xent_grad, mse_grad): d(step loss)/d(this loss), 1 or a
// loss_sum's weight. Kept beside the forward's attributes, which the gradient node copies.
struct LossGradAttrs {
  static float weight(const NodeAttrs& a) { return a.f[1]; }
  static NodeAttrs with_weight(NodeAttrs a, float weight) {
    a.f[1] = weight;
    return a;
  }
};

// Optimizer updates: the block of the 8-bit state, and the ZeRO share of the weight the update
// covers, elements [share_first, share_first + share_count) (share_count 0: the whole weight).
// grad_scale: a host update reading a narrow gradient (the f16 or bf16 copy a mixed-precision step
// writes back) widens it by this factor, as the cast it replaces did (graph::move_updates_to_host).
struct UpdateAttrs {
  std::int32_t block8bit = 0;
  std::int32_t share_first = 0, share_count = 0;
  CastScale grad_scale = CastScale::none;
  bool no_weight_decay = false;  // a weight OptimizerConfig::decay_on exempts (f[0] = 1)
  NodeAttrs pack() const {
    return {{block8bit, static_cast<std::int32_t>(grad_scale), share_first, share_count},
            {no_weight_decay ? 1.0f : 0.0f, 0.0f}};
  }
  static UpdateAttrs of(const NodeAttrs& a) {
    return {a.i[0], a.i[2], a.i[3], static_cast<CastScale>(a.i[1]), a.f[0] != 0.0f};
  }
};

// predictor_fit, predictor_apply: the predictor's configuration.
struct PredictorAttrs {
  PredictorConfig config;
  NodeAttrs pack() const {
    return {{static_cast<std::int32_t>(config.kind), config.residual ? 1 : 0, 0, 0}, {config.beta, config.max_gain}};
  }
  static PredictorAttrs of(const NodeAttrs& a) {
    return {{static_cast<PredictorConfig::Kind>(a.i[0]), a.f[0], a.f[1], a.i[1] != 0}};
  }
};

// The collectives of data parallelism (grad_allreduce, grad_reduce_scatter, weight_allgather, the
// guard agreement): the tensors are inputs first_tensor.. (1 when the node reads the order tensor
// before them); the sum weights each rank's tensors by share (its part of the global batch);
// ordinal is the first tensor's among the trainable weights, ordinal_step the step from one tensor
// to the next (+1 or -1) and granule the ZeRO granule (ops::zero_shard).
struct CollectiveAttrs {
  std::int32_t first_tensor = 0;
  float share = 0.0f;
  std::int32_t ordinal = 0, granule = 0, ordinal_step = 0;
  NodeAttrs pack() const { return {{first_tensor, ordinal, granule, ordinal_step}, {share, 0.0f}}; }
  static CollectiveAttrs of(const NodeAttrs& a) { return {a.i[0], a.f[0], a.i[1], a.i[2], a.i[3]}; }
};

// share_send, others_receive: this rank's ZeRO share of a weight, elements [first, first + count).
struct ShareAttrs {
  std::int32_t first = 0, count = 0;
  NodeAttrs pack() const { return {{first, count, 0, 0}, {}}; }
  static ShareAttrs of(const NodeAttrs& a) { return {a.i[0], a.i[1]}; }
};

}  // namespace ferry::ops
