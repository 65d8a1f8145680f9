// The op table: one row per op kind, the only place that knows what an op is.
//
// A row says everything the rest of ferry needs about an op: its name, the lane it runs on, the
// dtypes it accepts, its shape and dtype rule, its scratch bytes, how to bind its kernels to
// planned operands, its backward rule, its host implementation (for host-lane nodes), its CPU
// reference and its class in the memory profile. Passes, binding, lowering, the profiler and the
// test reference executor read rows; nothing switches on an op id.
//
// The rows speak through small context interfaces (ShapeView, GradContext, BindContext,
// HostContext, RefContext) that graph/ implements, so ops/ stays below graph/ and a user's op is
// a row added from outside with register_op().
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/ops/cast.hpp"
#include "ferry/ops/launch.hpp"
#include "ferry/ops/optimizer.hpp"
#include "ferry/ops/types.hpp"

namespace ferry::ops {

class CommRequest;  // ferry/ops/communicator.hpp

using OpId = std::uint16_t;
// A tensor of the step graph (graph::TensorId), as rows see it.
using TensorRef = std::uint32_t;
inline constexpr TensorRef no_ref = 0xffffffffu;

struct TensorDesc {
  Shape shape;
  DType dtype = DType::f32;
};

// Thrown by a shape rule for operands it cannot take; the builder adds the layer's name.
class ShapeError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// What part of a step a node belongs to (memory profile sections, transfer accounting).
enum class OpClass : std::uint8_t {
  batch_transfer,  // host batch in, results out (upload, download)
  state_transfer,  // a persistent tensor's fetch or write-back (streaming)
  forward,
  loss,      // the op that produces the loss; the backward section starts after it
  backward,  // gradient ops
  update,    // optimizer updates: the residency pass may move them early or to the host
  cast,      // precision changes
  // other updates of persistent state: the weight-update predictor (ops/predictor.hpp), gradient
  // accumulation (ops/accumulate.hpp); placed with the updates (moved early with them, in their
  // order), always on the device
  state_update,
  // data-parallel communication: a gradient's copy to host memory and back, and the reduction
  // over the ranks between them (graph::append_gradient_allreduce); bytes moved per step
  communication,
};
const char* op_class_name(OpClass c);

// The operands of a node as descriptors, and its attributes: what shape rules and scratch rules
// read.
class ShapeView {
 public:
  virtual ~ShapeView() = default;
  virtual std::string_view name() const = 0;  // the node's name, for messages
  virtual const NodeAttrs& attrs() const = 0;
  virtual std::size_t input_count() const = 0;
  virtual std::size_t output_count() const = 0;
  virtual TensorDesc input(std::size_t i) const = 0;
  virtual TensorDesc output(std::size_t i) const = 0;
};

// Shape and dtype inference: the output descriptors for the given inputs (the node has no
// outputs yet, so output_count() is 0). Throws ShapeError for operands the op cannot take.
using InferFn = std::function<std::vector<TensorDesc>(const ShapeView&)>;

// Reverse mode: a forward node appends the nodes that compute its inputs' gradients.
class GradContext {
 public:
  virtual ~GradContext() = default;
  virtual std::string_view name() const = 0;  // the forward node's
  virtual const NodeAttrs& attrs() const = 0;
  virtual std::span<const TensorRef> inputs() const = 0;
  virtual std::span<const TensorRef> outputs() const = 0;
  // Does anything need d(loss)/d(t)? (false for inputs, labels, paths without weights)
  virtual bool needs_grad(TensorRef t) const = 0;
  // The gradient flowing into tensor t (an output of this node), or no_ref if none does.
  virtual TensorRef grad(TensorRef t) const = 0;
  // t is the step's loss or a weighted term of it (loss_sum): its gradient is the implicit seed,
  // d(loss)/d(t) = loss_weight(t) (1 for the step's loss; 0 for a tensor that is neither).
  bool is_loss(TensorRef t) const { return loss_weight(t) != 0.0f; }
  virtual float loss_weight(TensorRef t) const = 0;
  // Makes t (the stats of a loss row, an input of this loss-combining node) a term of the loss with
  // d(loss)/d(t) = weight; the term's own backward rule, visited later, seeds from it.
  virtual void add_loss_term(TensorRef t, float weight) = 0;
  // A new gradient tensor shaped and typed like `of` (a tensor's gradient has its storage type).
  virtual TensorRef new_grad(TensorRef of) = 0;
  virtual DType dtype(TensorRef t) const = 0;
  // Appends a backward node named "<forward name><suffix>".
  virtual void emit(OpId op, std::string_view suffix, std::span<const TensorRef> in, std::span<const TensorRef> out,
                    const NodeAttrs& attrs) = 0;
  // g is (a contribution to) t's gradient; contributions to one tensor are summed.
  virtual void contribute(TensorRef t, TensorRef g) = 0;
};

// Host memory of a tensor that crosses the link, resolved when the copy is enqueued (a home may
// switch between two host copies from step to step).
using HostAddress = std::function<void*()>;

// Copies to the device through host staging a compiled step owns (staged host memory's chunked
// fetches: offload::FetchRing). `copy` returns once `src` has been read, with the event of the
// copy, the first part of which waits for `wait`; where it copies in several parts it sets *first
// (when not null) to the first part's event.
class StagedCopier {
 public:
  virtual ~StagedCopier() = default;
  virtual cl::Event copy(cl_command_queue queue, const std::byte* src, cl_mem dst, std::size_t offset,
                         std::size_t bytes, std::span<const cl_event> wait, cl::Event* first = nullptr) = 0;
};

// Binding: a device-lane node's kernels (or copies) for its planned operands.
class BindContext : public ShapeView {
 public:
  virtual DeviceSpan in(std::size_t i) const = 0;
  virtual DeviceSpan out(std::size_t i) const = 0;
  virtual DeviceSpan scratch() const = 0;  // empty unless the row asked for scratch bytes
  virtual OpEnv& env() const = 0;
  virtual const OptimizerConfig& optimizer() const = 0;
  // Transfer rows: where input i's current value is in host memory, and where output i's new
  // value goes. Throws for a tensor without host memory.
  virtual HostAddress host_in(std::size_t i) const = 0;
  virtual HostAddress host_out(std::size_t i) const = 0;
  // A u32 on the device that updates set to 1 when they make a weight not finite (the step
  // clears it before and reads it after its commands); empty outside a compiled step.
  virtual DeviceSpan step_status() const = 0;
  // The step's copier for chunked fetches (ops::FetchAttrs::chunk_kib); null when it has none.
  virtual StagedCopier* staged_copier() const { return nullptr; }
};

// A host-lane node: runs on a TBB worker once its device inputs are complete.
class HostContext : public ShapeView {
 public:
  virtual const std::byte* in(std::size_t i) const = 0;  // input i's current value
  virtual std::byte* out(std::size_t i) const = 0;       // where output i's new value goes
  virtual const StepInfo& step() const = 0;
  virtual const OptimizerConfig& optimizer() const = 0;
  // For nodes that move a persistent tensor between its home and staging memory (unpack, pack):
  // input i's value as its home gives it to this step, into `dst` (its size in bytes); output
  // i's next value, from `src`, into its home (current once the step succeeds).
  virtual void unpack_home(std::size_t input, std::byte* dst) const = 0;
  virtual void pack_home(std::size_t output, const std::byte* src) const = 0;
  // A host update made a weight not finite (the host side of BindContext::step_status).
  virtual void report_non_finite_weight() const = 0;
  // A communication node's collective, started: the node completes when `request` does, and its
  // successors wait for that while the worker that ran the node goes on. The default (a context
  // with nothing to hand the request to) waits for it here.
  virtual void complete_when(std::unique_ptr<CommRequest> request) const;
};

// The CPU reference: float operands as double, int32 operands as they are.
class RefContext : public ShapeView {
 public:
  virtual std::span<double> real(TensorRef t) = 0;
  virtual std::span<std::int32_t> ints(TensorRef t) = 0;
  virtual std::span<const TensorRef> inputs() const = 0;
  virtual std::span<const TensorRef> outputs() const = 0;
  virtual const StepInfo& step() const = 0;
  virtual const OptimizerConfig& optimizer() const = 0;
};

// One state tensor an optimizer's update keeps per weight: inputs 2.. and outputs 1.. of the update
// node, in order. graph::append_optimizer makes it, zero-initialised, named "<weight><suffix>".
struct OptimizerStateDecl {
  std::string suffix;
  DType dtype = DType::f32;
  std::optional<Shape> shape;  // nothing: the shape of the weight (or of its ZeRO share, 1-D)
  bool is_gradient = false;    // the gradient's own buffer serves (it dies at the update): nothing is kept
};

// How a node of an op takes in a ReLU beside it (graph/passes/fusion.cpp), marked fused by
// ops::set_relu_fused (ops/attrs.hpp): `reads_its_input` (relu -> op: the op reads the ReLU's input and applies
// the ReLU first; a max pool), `writes_its_output` (op -> relu: the op writes the ReLU's output, the ReLU in its
// epilogue; a convolution).
enum class ReluFusion : std::uint8_t { none, reads_its_input, writes_its_output };

// See OpInfo::update_bound.
enum class UpdateBound : std::uint8_t { memory, quantization };

struct OpInfo {
  std::string name;
  Lane lane = Lane::compute;
  OpClass op_class = OpClass::forward;
  // Storage dtypes this op's float operands may have (integer operands, e.g. labels, are the
  // row's own business). Checked for every node at compile time.
  DTypeSet float_dtypes{DType::f32};
  InferFn infer;  // null for ops only passes create (gradients, transfers): their outputs exist
  std::function<std::size_t(const ShapeView&, OpEnv&)> scratch_bytes;  // null: no scratch
  std::function<LaunchList(const BindContext&)> bind;                  // device lanes
  std::function<void(GradContext&)> backward;                          // null: not differentiable
  std::function<void(const HostContext&)> host;                        // null: cannot run on the host lane
  std::function<void(RefContext&)> reference;                          // null only for ops a test cannot run on the CPU
  // Floating-point operations of one run of the node, for the planner's step-time estimate
  // (ferry::plan_training): 2 M N K for the GEMM-like rows. Null: one per output element.
  std::function<std::uint64_t(const ShapeView&)> flops;
  // Mixed precision (graph::apply_mixed_precision): whether the op computes in the narrow dtype
  // (f16, bf16) when `float_dtypes` holds it. The layers do; losses, norms and softmax stay f32.
  bool computes_narrow = false;
  // With computes_narrow: how many of its outputs, from the first, take the narrow dtype; the rest
  // keep the dtype the row infers (attention's log-sum-exp statistics stay f32).
  std::uint32_t narrow_outputs = ~0u;
  // The op narrows its input 0 (a cast, an int8 quantization) and its host function can do it:
  // the residency pass runs it on the host before the fetch of a streamed weight only it reads on
  // the device, so the narrow value crosses the link instead (graph/residency.cpp).
  bool narrows_on_host = false;
  // int8 weights in the Predict phase (graph::apply_int8_weights): how the op's weight (input 1) of
  // this shape splits into per-output-channel scales, or nothing when the op's weight is not
  // quantized. Null: no op weight of this row is.
  std::function<std::optional<QuantLayout>(const Shape& weight)> int8_weight_layout;
  // An optimizer's update row (class update; graph::append_optimizer): the state it keeps for a
  // weight, or for its ZeRO share, of `elems` elements, and the node's attrs (UpdateAttrs; the share's first
  // element and count are set by the pass).
  std::function<std::vector<OptimizerStateDecl>(const OptimizerConfig&, std::size_t elems)> optimizer_state;
  std::function<NodeAttrs(const OptimizerConfig&)> update_attrs;  // null: none
  // What bounds an update row's run, on the device or on the host lane (the host optimizer), for
  // the planner's prediction (ferry::PlanRates): the bytes it streams (device_gbps, host_gbps),
  // or requantizing its state (device_8bit_gbps, host_8bit_gbps).
  UpdateBound update_bound = UpdateBound::memory;
  // The overflow guard in the node that makes gradients (graph::fuse_guard_checks): bit i set when
  // the row, given the guard as one more input and output (both last), sets it to NaN when an
  // element of its output i is not finite, as overflow_guard_check after the node would. 0: never.
  std::uint32_t checks_outputs = 0;
  // Fusion (graph::fuse_layers), exact rewrites a row allows: how it takes in a ReLU; whether a
  // node of it is a ReLU (the activation row); and the op a node of it becomes at the place of
  // the node that wrote its input 0 when that one is of op `producer` (layernorm after an add
  // becomes add_layernorm: inputs the producer's two then this node's 1.., outputs the producer's
  // then this node's).
  ReluFusion relu_fusion = ReluFusion::none;
  std::function<bool(const NodeAttrs&)> is_relu;
  struct MergeWithProducer {
    std::string producer, fused;
  } merge_with_producer;
};

// Adds a row; returns its id. Throws std::invalid_argument for an empty or taken name, or a row
// without a way to run (no bind and no host function).
OpId register_op(OpInfo row);
const OpInfo& op_info(OpId id);
// The id of the row named `name`; throws std::invalid_argument listing the known ops.
OpId find_op(std::string_view name);
std::size_t op_count();

// The rows ferry ships, with these ids, before any user row (ops/op_table.cpp); the library names
// its own rows only by these (ops::find_op is for users' rows and names read from text).
namespace builtin {
enum : OpId {
  upload,                // host batch -> device inputs (h2d)                 in: host mirrors   out: device tensors
  download,              // device results -> host (d2h)                      in: device tensors  out: host mirrors
  fetch,                 // a host-resident tensor -> its device copy (h2d)    in: host   out: copy
                         //   FetchAttrs: after this step's write-back of it (reads the value written)
  write_back,            // a device copy -> the host-resident tensor (d2h)    in: copy   out: host
  unpack,                // a staged home's tensor -> pinned staging (host)     in: home   out: staging
  pack,                  // pinned staging -> the tensor's next value in its home (host)  in: staging  out: home
  linear,                // y[B,out] = x[B,in] w[in,out] + b[out]             in: x w [b]  out: y
  linear_grad_input,     // dx = dy w^T                               in: dy w     out: dx
  linear_grad_param,     // dw = x^T dy, db = colsum(dy)               in: x dy [guard]  out: dw [db] [guard]
  activation,            // ActivationAttrs                            in: x        out: y
  activation_grad,       //                                            in: x dy     out: dx
  add,                   // y = a + b                                  in: a b      out: y
  layernorm,             // LayerNormAttrs                             in: x g b    out: y mean rstd
  layernorm_grad,        //                                  in: x g mean rstd dy [dres] [guard]   out: dx dg db [guard]
  conv2d,                // Conv2dAttrs                                in: x w [b]  out: y
  conv2d_grad_input,     //                                            in: dy w     out: dx
  conv2d_grad_param,     //                                            in: x dy     out: dw [db]
  maxpool2d,             // MaxPool2dAttrs                             in: x        out: y argmax
  maxpool2d_grad,        //                                            in: dy argmax out: dx
  softmax_xent,          //                                       in: logits labels out: lse stats
  softmax_xent_grad,     //                                   in: logits lse labels  out: dlogits
  sgd_update,            // in: w g v [loss]   out: w v (in place)
  adam_update,           // in: w g m v [loss] out: w m v (in place)
  cast,                  // CastAttrs                                  in: x        out: y
  quantize_i8,           // QuantAttrs                                 in: x        out: q scales
  dequantize_i8,         // QuantAttrs                                 in: q scales out: x
  matmul,                // MatmulAttrs: batched a[.., m, k] b[.., k, n]      in: a b      out: c
  matmul_grad_a,         //                                            in: dc b     out: da
  matmul_grad_b,         //                                            in: a dc     out: db
  softmax,               // SoftmaxAttrs (optionally causal)           in: x        out: y
  softmax_grad,          //                                            in: y dy     out: dx
  permute,               // the permutation in attrs.i                 in: x        out: y
  mul,                   // y = a * b                                  in: a b      out: y
  scale,                 // FactorAttrs: y = x * factor                in: x        out: y
  embedding,             //                                            in: ids table out: y
  embedding_grad,        //
  causal_mask,           //                                            in: x        out: y
  causal_mask_grad,      //
  dropout,               // DropoutAttrs                               in: x        out: y
  dropout_grad,          //
  add_bias,              // bias broadcast over leading axes           in: x b      out: y
  add_bias_grad,         //
  mse,                   // mean squared error loss                    in: p t      out: stats
  mse_grad,              //
  loss_sum,              // LossSumAttrs: two weighted losses
  adam8bit_update,       // 8-bit block-wise Adam/AdamW
  predictor_snapshot,    // the weight-update predictor (runtime/phases/): snapshot, fit, apply
  predictor_fit,         //
  predictor_apply,       //
  grad_accumulate,       // gradient accumulation: sum, mean
  grad_mean,             //
  overflow_guard_init,   // the overflow guard: init, per-gradient check
  overflow_guard_check,  //
  attention,             // AttentionAttrs: fused causal attention    in: q k v   out: o lse
  attention_grad,        //
  add_layernorm,         // residual add + LayerNorm (fusion of add -> layernorm)
  grad_send,             // data parallel (CollectiveAttrs): send, reduce, receive, ...
  grad_allreduce,        //
  grad_receive,          //
  weight_allgather,      //
  grad_reduce_scatter,   //
  share_send,            //
  others_receive,        //
  adam_update_group,     // adjacent Adam updates in one launch (graph::group_updates)
                         //   in: (w g m v) x k [guard]   out: (w m v) x k (in place), k <= 8
  builtin_count          // the number of rows above
};
}  // namespace builtin

// The row of each weight's update under this optimizer (builtin::sgd_update, adam_update,
// adam8bit_update); the row declares the state it keeps (OpInfo::optimizer_state).
OpId update_row(OptimizerConfig::Kind k);

}  // namespace ferry::ops
