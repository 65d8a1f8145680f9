// Trainer: compiles a model's training step once and runs it batch by batch.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ferry/graph/residency.hpp"
#include "ferry/graph/step_report.hpp"
#include "ferry/ops/optimizer.hpp"
#include "ferry/runtime/checkpoint.hpp"
#include "ferry/runtime/data_source.hpp"
#include "ferry/runtime/distributed.hpp"
#include "ferry/runtime/loss_scale.hpp"
#include "ferry/runtime/model.hpp"
#include "ferry/runtime/one_thread_at_a_time.hpp"
#include "ferry/runtime/phases.hpp"
#include "ferry/runtime/runtime.hpp"
#include "ferry/runtime/write_options.hpp"

namespace ferry::graph {
class CompiledStep;
struct VariantKey;
}  // namespace ferry::graph

namespace ferry::ckpt {
struct TrainerRecord;
}  // namespace ferry::ckpt

namespace ferry {

struct TrainerOptions {
  std::uint32_t batch = 256;
  ops::OptimizerConfig optimizer;  // default: Adam
  float lr = 1e-3f;
  std::uint64_t seed = 1;  // weight initialisation
  // Where weights and optimizer state live and the device budget (graph/residency.hpp). A
  // budget of 0 means the device's memory less headroom (10%, at least 256 MiB).
  graph::ResidencyOptions residency;
  // Measurement only: no overlap between lanes (see graph::CompiledStep).
  bool serial_schedule = false;
  // Hybrid phases (Warmup/Full/Predict/Correct, ferry/runtime/phases.hpp); off by default. With
  // them on, optimizer.predictor is set from phases.predictor.
  PhaseConfig phases;
  // Gradient accumulation: each step() is one micro-batch of `batch` samples and the optimizer
  // updates every `accumulate` micro-batches with their mean gradient (ops/accumulate.hpp): the
  // same update as one batch of accumulate * batch samples. At least 1.
  std::uint32_t accumulate = 1;
  // Recomputation (gradient checkpointing): backward recomputes the activations of segments of
  // this many layers (nodes with weights) instead of keeping them; 0 keeps them all. Gradients are
  // bit-identical; the step costs about one more forward pass.
  std::uint32_t recompute = 0;
  // Choose `recompute` when the Trainer is made (ferry::choose_recompute): none if the step fits
  // the device budget, else the longest segments that fit. `ferry train`'s default. With
  // `recompute` left at 0 (both set is refused).
  bool recompute_auto = false;
  // Choose residency.host_optimizer when the Trainer is made (plan_training): on a device with
  // memory of its own (not CL_DEVICE_HOST_UNIFIED_MEMORY) whose step streams, the optimizer runs on
  // the host where its plan moves fewer bytes over the link than the device's updates do (which
  // fetch and write back every moment they update, after the backward) without recomputing more
  // or going over the host's memory where the device's plan does not, or where the device's
  // updates do not fit the budget at all; elsewhere on the device. With
  // overlap_host_updates, on the host. `ferry train`'s default. With residency.host_optimizer
  // false (both set is refused).
  bool host_optimizer_auto = false;
  // Fuse layer pairs the kernels take together (a ReLU into the max-pool that reads it or the
  // convolution or Linear that makes it, a residual add into the LayerNorm that reads its sum:
  // graph::fuse_layers; an activation's backward into the GEMM that makes its output gradient:
  // graph::fuse_activation_grads; a gradient's overflow check into the kernel that makes it:
  // graph::fuse_guard_checks; a resident step's adjacent Adam updates as one launch:
  // ResidencyOptions::group_updates). Exact: results are bit-identical either way; off only to
  // measure or to compare against the unfused graph.
  bool fuse = true;
  // Mixed precision (ferry/runtime/loss_scale.hpp): f16 or bf16 layers over f32 master weights,
  // with dynamic loss scaling for f16. Training, evaluation and Predict steps all run in it.
  PrecisionConfig precision;
  // Divergence guard beyond the loss. Every optimizer update checks each weight it writes (on the
  // device, in the update kernel; on the host, in the host update), and Adam's second moment, and
  // the step reads one status word back, so an update that made a weight inf or NaN (or a second
  // moment infinite, which would freeze its weight) while its loss was finite fails that step,
  // always, at no measurable cost. In addition, after every this many updates the trainer
  // reads every weight back and checks it (0: never, the default): one read of every weight, a
  // device-to-host copy when they live on the device. A step whose loss is not finite always
  // reads them, so its message never claims non-finite weights are good ones.
  std::uint32_t check_weights_every = 0;
  // Data-parallel training over ranks (ferry/runtime/distributed.hpp); one rank by default.
  DataParallelOptions data_parallel;
};

struct StepResult {
  float loss = 0;             // the batch's loss (mean cross-entropy, mean squared error, ...)
  std::uint32_t correct = 0;  // softmax cross-entropy: rows whose argmax is the label; else 0
  double step_ms = 0;         // wall time of the step, enqueue to device completion
  std::uint64_t device_peak_bytes = 0;
  Phase phase = Phase::full;  // what the step was (hybrid phases); Predict: no optimizer update
  bool updated = true;        // the optimizer ran (false: a Predict step, or a micro-batch before the last)
  // Predict: the divergence monitor ended the run (end) or put back the weights from before it
  // (restore, after which the weights are those of the last Full step).
  PhaseController::Verdict verdict = PhaseController::Verdict::go_on;
  // Loss scaling: the gradients overflowed at this step's scale, so nothing was updated and the
  // scale was halved (updated is false; with accumulation the micro-batch added nothing and the
  // group waits for another); loss_scale is the scale the step ran with.
  bool overflow = false;
  float loss_scale = 1.0f;
};

// A step submitted with Trainer::submit, whose result Trainer::result reads (once).
struct StepHandle {
  std::uint64_t id = 0;
};

struct EvalResult {
  double loss = 0;      // mean over samples
  double accuracy = 0;  // softmax cross-entropy: argmax hits over labels; else 0
  std::size_t samples = 0;
};

// A Trainer serves one thread at a time: a call while another thread is in one of its calls throws
// std::logic_error (hold a mutex around its calls to share one). Trainers made on one Runtime may
// run on threads of their own. Neither copied nor moved (hold one in a std::unique_ptr to pass it).
class Trainer {
 public:
  // The trainer keeps the device context and kernels of `runtime` alive (Runtime::Shared): the
  // runtime may be destroyed before it.
  Trainer(Runtime& runtime, ModelSpec model, TrainerOptions options = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // One step on a batch of exactly options().batch samples: an optimizer step, or with hybrid
  // phases whatever phase the controller chose (StepResult::phase). Details of the training step:
  // one optimizer step on a batch of exactly options().batch samples: a view per input and
  // target of the model, by name. Throws std::invalid_argument for a missing or unknown tensor, a
  // wrong dtype or size, an id out of its range (labels, tokens) or a non-finite f32 value, before
  // anything runs. Throws std::runtime_error naming the op if the step fails, and when the loss or
  // a weight gradient is not finite (the update was skipped); the weights and optimizer state are
  // then those from before the step and the trainer stays usable. The one exception: a failure
  // after the step had begun updating state kept on the device in place (its update phase; the
  // forward and backward all succeeded) throws graph::PartialUpdateError naming the tensors that
  // may hold this step's update. The state is then inconsistent, and step(), save_checkpoint(),
  // evaluate() and predict() refuse to run (saying why) until load_checkpoint() has restored it. A Predict step moves
  // the weights before its loss is known: when it fails after that, the weights are put back to those from before its
  // Predict run (the last training step's) and the trainer stays usable. step() is result(submit(batch)).
  StepResult step(const Batch& batch);
  // The same step in two halves, so that the host stages and enqueues the next step while the
  // device still runs this one: submit() checks and stages the batch and enqueues the step, and
  // result() waits for it and returns (or throws) what step() would have. Every failure step()
  // reports is reported by result() of the step it belongs to; a bad batch is thrown by submit().
  // A step that fails on the device or in a host node fails the step submitted after it too
  // (result() of that one says so); a diverged step (a non-finite loss or gradient, its update
  // skipped) fails alone, and the steps after it run on the weights from before it.
  //   auto h = trainer.submit(b0);
  //   for (...) { auto next = trainer.submit(b1); use(trainer.result(h)); h = next; }
  // The device runs step k+1 right after step k when runs_ahead(); otherwise submit() first
  // completes the step before it (its result is kept for result()), which is step()'s timing.
  // evaluate(), predict(), load_checkpoint() and write_tensor() complete every submitted step
  // first (its result() stays to be read); saving a checkpoint and reading a tensor or parameter
  // throw std::logic_error while a submitted step's result() has not been read.
  StepHandle submit(const Batch& batch);
  StepResult result(StepHandle handle);
  // Whether submit() enqueues while the step before it runs: the training step runs in one pass
  // (no host-lane nodes) with its state committed on the device (graph::CompiledStep::
  // can_run_ahead), and nothing about the next step depends on this one's result (no hybrid
  // phases, gradient accumulation, loss scaling or --check-weights-every).
  bool runs_ahead() const;
  // Steps submitted whose result() has not been read.
  std::size_t pending() const noexcept { return pending_.size(); }
  // A classifier's step (models::classifier): "input" and "labels".
  StepResult step(std::span<const float> images, std::span<const std::int32_t> labels);

  // Forward and loss over every sample of `data` (at least one), batched, no weight change. The last
  // partial batch runs through variants of power-of-two batch sizes, so any number of dataset
  // sizes compiles at most log2(batch) + 1 evaluation variants.
  // With int8_weights, every Linear and Conv2d layer but the head reads its weight quantized to
  // int8 per output channel, as a Predict step with PhaseConfig::predict_int8 does.
  EvalResult evaluate(const DataSource& data, bool int8_weights = false);

  // The model's prediction (its forward's result, e.g. logits) for every sample of `inputs`
  // (only the model's inputs are read), as [samples, ...] f32 on the host. No weight change.
  // Throws std::invalid_argument when `inputs` holds no samples.
  struct HostTensor;
  HostTensor predict(const DataSource& inputs);

  float lr() const noexcept { return lr_; }
  // Throws std::invalid_argument for a learning rate that is negative or not finite.
  void set_lr(float lr);
  // Optimizer updates so far (Predict steps are not updates).
  std::uint64_t steps_done() const noexcept { return steps_; }
  // The phase controller with hybrid phases, else nullptr.
  const PhaseController* phases() const noexcept { return phases_.get(); }
  PhaseController* phases() noexcept { return phases_.get(); }
  // Mean wall time of the steps of each phase so far (ms; 0 where none ran; with accumulation a
  // training phase's step is an update, all its micro-batches), and the predictor's state bytes
  // (0 without hybrid phases).
  double phase_step_ms(Phase p) const;
  // Loss scaling: the scale the next step runs with (1 without scaling), and the steps skipped
  // because their gradients overflowed.
  float loss_scale() const noexcept { return scaler_.scale(); }
  std::uint64_t overflow_steps() const noexcept { return scaler_.overflows(); }
  std::uint64_t predictor_state_bytes() const;
  const TrainerOptions& options() const noexcept { return options_; }
  const ModelSpec& model() const noexcept { return model_; }

  // Bytes of the training state as stored: weights and their gradients (fp32), and optimizer state
  // (fp32; adamw8bit: u8 codes and fp32 block scales).
  std::uint64_t weight_bytes() const;
  std::uint64_t optimizer_state_bytes() const;
  std::uint64_t training_state_bytes() const;
  std::uint64_t parameter_count() const;
  // Bytes of the weight gradients a training step keeps for its updates: every weight's whole
  // gradient, or under ZeRO stage 2 this rank's shares of them (the whole ones live only until
  // they are sent).
  std::uint64_t gradient_bytes() const;
  // Data-parallel training: this trainer's rank and the number of ranks (0 and 1 alone), and
  // the gradient bytes each step puts into its reductions over the ranks: every weight's whole
  // gradient, at every ZeRO stage (0 alone).
  int rank() const noexcept { return ranks_ ? ranks_->rank() : 0; }
  int world_size() const noexcept { return ranks_ ? ranks_->size() : 1; }
  std::uint64_t allreduce_bytes_per_step() const;
  // Peak device bytes of the training step, known from the memory plan before it runs.
  std::uint64_t device_peak_bytes() const;
  // The device memory the driver counts in use, as the runtime this trainer was made on reads it
  // (Runtime::driver_memory): beside device_peak_bytes(), whether the budget holds as the driver
  // counts it.
  const cl::DriverMemoryWatch& driver_memory() const noexcept { return *runtime_->driver_memory; }
  // Device budget the step was planned for, and the host bytes the training step holds: the
  // homes of weights and state, plus the step's pinned host pool (batch mirrors, gradients
  // spilled to the host or written back for the host optimizer, staging of compressed homes).
  std::uint64_t device_budget_bytes() const noexcept { return budget_; }
  // Whether that budget was taken from what the driver counts free (no budget given, and the
  // device's memory less headroom would have been more: other processes hold part of the device).
  bool budget_from_free_memory() const noexcept { return budget_from_free_memory_; }
  std::uint64_t host_state_bytes() const;
  // What the residency pass chose for the training step: the mode, the copies per step.
  const graph::ResidencyReport& residency() const;
  // The kind of memory of the host_pinned home and the step's host pool on this device: pinned,
  // pageable, or staged (pageable, copies through pinned staging; ResidencyOptions::homes.host_memory,
  // ferry/offload/host_memory.hpp). Where the driver's pinned buffers take device memory too,
  // `automatic` is staged in chunks under a budget that affords them, else pageable
  // (ferry::resolve_host_transfers; options() gives the chunk).
  offload::HostMemory host_memory() const;
  // Where the weights, and the optimizer state, live between steps (each role has one home:
  // device, host_pinned, host_mapped, host_compressed, ...; ferry/offload/home.hpp).
  offload::Home weights_home() const;
  offload::Home state_home() const;

  // A tensor on the host: its dtype, shape and raw bytes (persistent tensors as stored).
  struct HostTensor {
    graph::DType dtype = graph::DType::f32;
    graph::Shape shape;
    std::vector<std::byte> bytes;
  };
  HostTensor read_tensor(const std::string& name) const;
  // An f32 parameter's values (for tests, checkpoints and inspection). Throws for an unknown name
  // or a tensor stored in another dtype.
  std::vector<float> read_parameter(const std::string& name) const;
  std::vector<std::string> parameter_names() const;
  // Every persistent tensor: the weights, the optimizer state, then the predictor state (hybrid
  // phases), each in creation order.
  std::vector<std::string> tensor_names() const;
  // Replaces a persistent tensor's value (between steps; e.g. to load weights). Throws
  // std::invalid_argument for an unknown name, another dtype or shape, or a non-finite f32 value,
  // and then changes nothing.
  void write_tensor(const std::string& name, const HostTensor& value);

  // Checkpoints (ferry/runtime/checkpoint.hpp, docs/checkpoints.md), between steps.
  // save_checkpoint writes the whole training state and `caller` (opaque bytes: the caller's own
  // position, RNG state...) to `path` atomically: into a new file beside it, synced, then renamed
  // over `path`, so an earlier checkpoint there survives a crash mid-write. Tensors are written
  // one at a time. Throws std::runtime_error naming the path when it cannot be written, or when
  // `path` is a symbolic link, not a regular file, or a file that is not a ferry checkpoint
  // (unless `options.replace_foreign_file`): then nothing there changes.
  // Data parallel: at ZeRO stage 0 one file holds the state of every rank, and its gradient sums
  // (inside a group of --accumulate micro-batches) are the group's, every rank's weighted by its
  // share of the batch; the ranks add them up here, so then every rank calls this, or
  // contribute_to_checkpoint if it leaves the file to another (rank 0), at the same point. At
  // stages 1 and 2 every rank writes a file of its own (its shares and its own sums), and the call
  // is a collective too: no rank's file replaces its earlier one until every rank has written its
  // own, and when one rank's write fails every rank throws and keeps its earlier file.
  void save_checkpoint(const std::filesystem::path& path, std::span<const std::byte> caller = {},
                       WriteOptions options = {}) const;
  // The most bytes save_checkpoint's file takes in this run, `caller`'s section left out: every
  // tensor it holds with the sections around them, and in a hybrid run the weights saved within a
  // Predict run too. The file is written beside the one it replaces and renamed over it, so its
  // folder needs this much free space whether or not a checkpoint is there already.
  std::uint64_t checkpoint_bytes() const;
  // A rank's part in another rank's save_checkpoint at ZeRO stage 0 (above): its gradient sums,
  // inside a group of micro-batches; nothing to do otherwise. Writes nothing.
  void contribute_to_checkpoint() const;
  // Reads and verifies every byte of `path` (header, checksums, that it was written for this
  // model, optimizer and batch) before it changes anything, then replaces the training state
  // and returns the caller's bytes. A trainer built like the one that saved, given this, then
  // trains exactly as that one would have. Throws std::runtime_error for a missing, foreign,
  // newer, truncated or corrupt file and std::invalid_argument for one written for another
  // model, optimizer or batch; the message names the file, the problem and what to do, and the
  // trainer is unchanged.
  // A checkpoint trained with other settings (ferry/runtime/training_setting.hpp) is refused too
  // (std::invalid_argument), unless `options` accepts them.
  std::vector<std::byte> load_checkpoint(const std::filesystem::path& path, LoadOptions options = {});
  // The same for a checkpoint cut for other ranks: the files the ranks of a ZeRO stage 1 or 2 run
  // wrote (files[r]: rank r's, each with its shares of the optimizer state), or one whole-state
  // checkpoint, into this trainer whatever its number of ranks and ZeRO stage (alone included):
  // each weight's optimizer state is put together from the files' shares and cut for this
  // trainer's share. Inside a group of --accumulate micro-batches the files' gradient sums (each
  // rank's own) are added up, each weighted by its rank's share of the batch, and this trainer's
  // rank 0 takes them, the other ranks starting from zeros: the group's update is the one the
  // writers would have made, to f32 rounding. Every file is verified first; they must be of one
  // step and micro-batch, and each must hold the share that many ranks had, else
  // std::invalid_argument naming the file, and the trainer is unchanged.
  std::vector<std::byte> load_resharded_checkpoint(std::span<const std::filesystem::path> files,
                                                   LoadOptions options = {});
  // Why the training state is inconsistent (a step failed in its update phase, or left a weight or
  // optimizer state not finite, and load_checkpoint has not restored it since); empty when it is
  // not.
  const std::string& inconsistent_state() const noexcept { return inconsistent_; }

 private:
  graph::Graph build_graph(const graph::VariantKey& key) const;
  std::uint64_t bytes_of(graph::Role role) const;
  graph::ResidencyOptions residency_options() const;
  // The weight or optimizer-state tensor named `name`; throws std::invalid_argument if none.
  TensorId persistent_tensor(const std::string& name) const;
  void initialise_parameters();
  // load_checkpoint (one file) and load_resharded_checkpoint (reshard).
  std::vector<std::byte> load_checkpoint_files(std::span<const std::filesystem::path> files, bool reshard,
                                               LoadOptions options);
  // Samples of a global batch, and this rank's share of them (1 alone).
  std::uint32_t global_batch() const noexcept;
  double batch_share() const noexcept;
  // At ZeRO stage 0 over ranks, inside a group of micro-batches: the group's gradient sums (a
  // collective: every rank calls it at the same point), by tensor when `keep`; empty otherwise.
  std::map<TensorId, std::vector<std::byte>> group_sums_over_ranks(bool keep) const;
  // Copies a batch into `step`'s host inputs after checking it against the model.
  void stage_batch(graph::CompiledStep& step, const Batch& batch) const;
  StepResult predict_step(const Batch& batch);
  [[noreturn]] void put_back_weights_after_failed_predict(const graph::PartialUpdateError& e);
  // The training variant for a micro-batch before a group's last (micro) and with or without the
  // predictor's fit; train_ for the group's last micro-batch with the fit (or without phases).
  graph::CompiledStep& training_variant(bool micro, bool fit);
  graph::CompiledStep& predict_variant_mutable();
  // Runs `step` and reads what it measured: loss, hits, wall time, planned peak. A failure that
  // changed state in place marks the trainer inconsistent (inconsistent_) and is rethrown saying so.
  StepResult run_step(graph::CompiledStep& step, const ops::StepInfo& info);
  // A submitted training step, until result() reads it.
  struct Pending {
    std::uint64_t id = 0;
    graph::CompiledStep* step = nullptr;  // null once settled
    Phase phase = Phase::full;
    bool micro = false, fit = false;
    float loss_scale = 1.0f;
    std::chrono::steady_clock::time_point submitted;
    StepResult result;
    std::exception_ptr error;
  };
  // Waits for `p` (the oldest unsettled step) and does what step() does after the device:
  // checks, counters, the phase controller. Stores the result or the failure in `p`.
  void settle(Pending& p);
  // Settles every submitted step (before anything that reads or changes the training state).
  void settle_all();
  // wait() of `step`, marking the trainer inconsistent on a PartialUpdateError (as run_step).
  void wait_step(graph::CompiledStep& step);
  StepResult after_wait(graph::CompiledStep& step, std::chrono::steady_clock::time_point t0);
  StepResult finish_training_step(Pending& p);
  // Throws std::runtime_error saying why, if the training state is inconsistent; `what` is what
  // was refused ("step", "save a checkpoint").
  void refuse_if_inconsistent(const char* what) const;
  // Throws std::logic_error if a submitted step is still running (const readers of the state).
  void require_settled(const char* what) const;
  // The first weight with a non-finite element, as "'name' (element i is v)"; empty if none.
  std::string non_finite_weight() const;
  [[noreturn]] void throw_non_finite_state(double loss);
  // The fits of the last training step, summed over weights with the gains they predicted with.
  FitStats read_fit();
  graph::CompiledStep& variant(const graph::VariantKey& key);
  // Every persistent tensor a checkpoint holds: tensor_names(), then the gradient sums.
  std::vector<TensorId> checkpoint_tensors() const;
  // The counters, learning rate, loss scaler and gains a checkpoint's TRNR section holds.
  ckpt::TrainerRecord checkpoint_record() const;
  // save_checkpoint's work. `lock`: take the path's lock for the write (a file another process is
  // writing its checkpoints into is refused); false where the caller holds it (TrainingLoop, for
  // its whole run, through TrainerInternals).
  void write_checkpoint_file(const std::filesystem::path& path, std::span<const std::byte> caller, WriteOptions options,
                             bool lock) const;
  // Checks the host mirrors `step` will upload (dtype ranges, finiteness) for `count` samples
  // starting at sample `first` of the caller's data (for messages).
  void validate_staged(const graph::CompiledStep& step, std::span<const TensorSpec> specs, std::size_t first) const;
  // Runs `step` over data in chunks: full batches through `variant(full)`, the rest through
  // power-of-two variants; `after` reads each chunk's results.
  template <class After>
  void for_each_chunk(const DataSource& data, bool predict, bool int8_weights, After after);

  // Destroyed last: what every compiled step below uses, kept alive even when the Runtime the
  // trainer was made on is destroyed first.
  std::shared_ptr<Runtime::Shared> runtime_;
  ModelSpec model_;
  TrainerOptions options_;
  float lr_;
  std::uint64_t budget_ = 0;
  bool budget_from_free_memory_ = false;
  std::uint64_t steps_ = 0;
  std::uint64_t weights_checked_at_ = 0;  // the last update after which the weights were checked finite
  // The compiled steps (the training step and the variants compiled so far) and where the
  // weights and predictor statistics live in them; defined in runtime/trainer_internals.hpp,
  // which the CLI, benchmarks and tests use to reach them.
  struct Compiled;
  std::unique_ptr<Compiled> compiled_;
  friend struct TrainerInternals;
  std::uint32_t micro_ = 0;  // micro-batches of the current accumulation group done
  std::unique_ptr<PhaseController> phases_;
  std::vector<std::string> weight_names_;  // parallel to compiled_->weights (parameter_names())
  std::vector<float> gains_;               // per weight, the gain of d and the weight of r its last prediction used
  std::vector<std::vector<std::byte>> restore_point_;  // the weights before the Predict run in flight
  bool in_predict_run_ = false;
  std::string inconsistent_;     // see inconsistent_state()
  std::deque<Pending> pending_;  // submitted, in order; settled ones keep their result until read
  std::uint64_t handles_ = 0;
  std::chrono::steady_clock::time_point last_done_;  // when the last settled training step ended
  LossScaler scaler_;
  // Data parallel: the ranks the steps reduce gradients over, and a second communicator over the
  // same ranks for what the trainer reduces on the calling thread (the loss, start-up checks).
  std::shared_ptr<ops::Communicator> ranks_;
  std::unique_ptr<ops::Communicator> control_;
  // Sums the step's loss and hit count over the ranks (each rank's loss weighted by its share).
  void reduce_over_ranks(StepResult& r);
  double phase_ms_[phase_count] = {};
  std::uint64_t phase_steps_[phase_count] = {};
  OneThreadAtATime one_thread_;  // held by each public call that runs or reads the device
};

// The smallest device budget `options` trains in when streamed (residency stream, every layer
// fetched just in time), found by planning against a one-byte budget (ferry::plan_training:
// nothing is allocated); nullopt if that plan fits (nothing to stream).
std::optional<std::uint64_t> min_stream_budget(Runtime& runtime, const ModelSpec& model, TrainerOptions options);

}  // namespace ferry
