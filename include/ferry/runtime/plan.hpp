// Planning a training run without running or allocating it: what each compiled variant holds on
// the device at its peak (the numbers `ferry plan` prints per phase), the pinned host bytes, the
// bytes that cross the link per step, the step's floating-point work and a predicted step time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "ferry/graph/residency.hpp"
#include "ferry/offload/host_memory.hpp"
#include "ferry/runtime/trainer.hpp"

namespace ferry {

struct DeviceBreakdown {
  // Persistent tensors whose home is the device.
  std::uint64_t weights = 0, optimizer_state = 0, other_state = 0;  // other: predictor state, gradient sums
  // Step tensors live at the peak node (the node with the most live step bytes).
  std::uint64_t gradients = 0;        // of weights and of activations
  std::uint64_t activations = 0;      // forward results, the batch, loss statistics
  std::uint64_t scratch = 0;          // op temporaries (im2col columns, packed GEMM panels)
  std::uint64_t streamed_copies = 0;  // device copies of host-homed weights and state
  // Pinned staging of staged host memory where the driver backs it with device memory (NVIDIA).
  std::uint64_t pinned_staging = 0;
  std::uint64_t step_arena = 0;  // the step buffers as allocated (>= the live bytes: fragmentation)
  std::uint64_t total = 0;       // what the variant needs on the device: persistent + step arena + pinned staging
};

// The rates a step-time prediction uses. 0: unknown (that term is left out).
struct PlanRates {
  double link_gbps = 0;      // host -> device copies, GB/s (1e9 bytes per second)
  double link_d2h_gbps = 0;  // device -> host copies, GB/s; 0: at link_gbps
  // Both directions' bytes per second while copies run each way at once, GB/s: how far the link is
  // duplex. About link_gbps + link_d2h_gbps where each direction keeps its rate (PCIe's copy
  // engines), about either alone where one waits for the other. 0: one direction at a time.
  double link_both_gbps = 0;
  double gemm_gflops = 0;  // the device's GEMM rate, GFLOP/s
  // The device's memory rate for the nodes that are not GEMM-like (element-wise, normalisation,
  // device optimizer updates): bytes they read and write per second, GB/s.
  double device_gbps = 0;
  // The same for device updates bound by requantizing their state rather than by memory
  // (ops::OpInfo::update_bound; 8-bit AdamW's: 16 bytes a parameter). 0: at device_gbps.
  double device_8bit_gbps = 0;
  // The host optimizer's updates (--host-optimizer): bytes they read and write per second, GB/s
  // (Adam reads a weight, its gradient and two moments and writes three: 28 bytes a parameter).
  double host_gbps = 0;
  // The same for host updates bound by requantizing their state rather than by memory
  // (ops::OpInfo::update_bound; 8-bit AdamW's: 16 bytes a parameter). 0: at host_gbps.
  double host_8bit_gbps = 0;
  // The compressed home's codec on the host's cores: uncompressed bytes packed and unpacked per
  // second, GB/s.
  double codec_gbps = 0;
  // What one kernel launch of the step costs, microseconds: the host's enqueue (on a GPU the step
  // cannot run faster than the host issues it) and, on a CPU device, the kernel's start on the
  // same cores.
  double launch_us = 0;
  // Data parallel: what a rank sends over the network per second, GB/s. Not measured (a plan runs
  // no rank): 0 leaves the network's time out of the prediction.
  double network_gbps = 0;

  // Copies back to the host: link_d2h_gbps, or link_gbps where that is not known.
  double to_host_gbps() const { return link_d2h_gbps > 0 ? link_d2h_gbps : link_gbps; }
};

// The rates measured on the runtime's device, quickly (well under a second each on a CPU device,
// a GEMM kernel build aside, which the program cache keeps): the link as the best of three
// 64 MiB copies to the device from host memory of the kind streamed homes will use (`memory`,
// resolved for the device; pinned for staged memory, whose copies leave from pinned staging), after
// one that warms up, the same back to the host, and both at once from two host threads (each
// direction on its own queue, as a step's copy lanes); the GEMM rate as the best of three
// 1024 x 1024 x 1024 f32 products of ops::gemm (after one that builds it).
struct LinkRates {
  double h2d_gbps = 0, d2h_gbps = 0;
  double both_gbps = 0;  // both directions' bytes over the time both took at once (<= h2d + d2h)
};
LinkRates measure_link(Runtime& runtime, offload::HostMemory memory = offload::HostMemory::automatic);
// The time of `to_device` and `to_host` bytes over a link of `rates` (link_gbps, link_d2h_gbps,
// link_both_gbps), ms: both directions at once at their shares of link_both_gbps (in proportion to
// their own rates) until the shorter is done, then the rest at its own rate. A full-duplex link gives
// the longer direction's time, a half-duplex one (or link_both_gbps 0) the sum. 0 without link_gbps.
double link_ms(const PlanRates& rates, std::uint64_t to_device, std::uint64_t to_host);
double measure_gemm_gflops(Runtime& runtime);
// The GEMM rate at the training step's own products (runtime/plan_gemm_probe.cpp): the step graph
// `options` configure is built (nothing of the model is allocated), its product nodes (rows with a
// FLOP count: linear and its gradients, matmul, attention, convolution) grouped by kernel and
// sizes, and each group's node bound as a compiled step binds it (same dtypes, epilogues, K
// splits) and run on zeroed buffers of its own, largest group first, until `budget_seconds` are
// spent (the largest always). The rate is the probed groups' FLOPs over their time; the groups not
// probed are taken to run at it. A step whose largest product would take longer than
// `product_seconds` at measure_gemm_gflops's rate (a 7B GPT on a CPU) is probed at a smaller batch,
// halved until it would not or one sample is left. What `ferry plan` measures unless --gemm-gflops
// is given; the plan search's other candidates (smaller batches, 16-bit layers) are predicted at
// the same rate.
struct StepGemmRate {
  double gflops = 0;
  std::uint32_t batch = 0;   // the batch probed (the options' unless the products were too long)
  std::size_t distinct = 0;  // groups in the step (the same node kind and sizes: one group)
  double probed_share = 0;   // of the step's product FLOPs, the part probed at its own sizes
  double seconds = 0;        // the probe's wall time, kernel builds included
  struct Product {
    std::string node;  // one node of the group, e.g. "linear2.grad_param"
    std::string op;    // its row's name
    std::size_t nodes = 0;
    std::uint64_t flops = 0;  // of one node
    double gflops = 0;
  };
  std::vector<Product> probes;                            // the groups probed, largest first
  std::size_t products() const { return probes.size(); }  // groups probed
};
struct StepGemmProbe {
  double budget_seconds = 2.0;
  double product_seconds = 0.1;
};
StepGemmRate measure_step_gemm_gflops(Runtime& runtime, const ModelSpec& model, const TrainerOptions& options,
                                      const StepGemmProbe& probe = {});
// The device's memory rate: the best of three element-wise additions of 16M f32 values (ops::add:
// two operands read, one written, 192 MiB) after one that builds it.
double measure_device_gbps(Runtime& runtime);
// The device's 8-bit AdamW rate: the best of three ops::adam8bit_update launches over 8M
// parameters in blocks of 2048 after one that builds it (bytes read and written over the time, as
// measure_host_update_gbps(true) counts them).
double measure_device_8bit_gbps(Runtime& runtime);
// The host optimizer's rate: the best of three Adam updates of 8M fp32 parameters on the TBB
// workers, as host_adam_update runs them in a step (bytes read and written over the time); with
// `eight_bit`, of 8-bit AdamW updates (host_adam8bit_update, blocks of 2048). The gradients are
// spread over three decades, as a layer's are, so 8-bit codes spread over their tables.
double measure_host_update_gbps(bool eight_bit = false);
// The codec's rate: the best of three rounds compressing and decompressing 64 MiB of values like
// Adam's second moments with the compressed home's default settings, on the TBB workers.
double measure_codec_gbps();
// The launch cost: 256 dependent additions of 64 values enqueued on the compute queue and
// finished, the best of three after one that builds the kernel, per launch.
double measure_launch_us(Runtime& runtime);

// One compiled variant of the plan: the phase it serves and what it costs per step.
struct PhasePlan {
  std::string name;  // "full" ("warmup/full/correct" with hybrid phases), "predict", "micro-batch", "full (no fit)"
  DeviceBreakdown device;
  std::uint64_t host_step_bytes = 0;       // the plan's host pool of step tensors (batch mirrors, gradients, staging)
  std::uint64_t pinned_staging_bytes = 0;  // of which the pinned staging of staged transfers
  std::uint64_t fetch_bytes = 0, write_back_bytes = 0;  // persistent tensors over the link, per step
  std::uint64_t batch_bytes = 0;                        // the batch up and the results down, per step
  // Floating-point operations per step: 2 M N K for every GEMM-like node (linear, matmul,
  // convolution and their gradients), one per output element for every other compute node
  // (ops::OpInfo::flops).
  std::uint64_t flops = 0, gemm_flops = 0;
  // Bytes the nodes that are not GEMM-like read and write on the device, and the part of them
  // updates bound by quantization (8-bit AdamW) read and write.
  std::uint64_t memory_bytes = 0, memory_8bit_bytes = 0;
  // Of the nodes before the backward (forward and loss ops): the GEMM flops and the memory bytes.
  std::uint64_t forward_gemm_flops = 0, forward_memory_bytes = 0;
  std::uint64_t host_update_bytes = 0;       // operands the host optimizer's updates read and write
  std::uint64_t host_update_8bit_bytes = 0;  // the part of them updates bound by quantization (8-bit AdamW) move
  std::uint64_t codec_bytes = 0;             // compressed homes' tensors unpacked and packed (uncompressed bytes)
  // Data parallel: what the step's collectives take in on this rank (gradients summed or
  // reduce-scattered, weight shares gathered, the guard agreed; what the network carries depends
  // on the collective's algorithm and is not predicted), and the copies to and from pinned host
  // memory around them, which cross the link (in transfer_ms).
  std::uint64_t collective_bytes = 0, collective_link_bytes = 0;
  // What this rank sends over the network a step, as ring collectives do: 2 (N - 1) / N of an
  // all-reduce's bytes, (N - 1) / N of a reduce-scatter's or an all-gather's; its time at
  // PlanRates::network_gbps (network_ms, 0 without that rate), which overlaps compute like the
  // link's on a GPU and adds to it on a CPU device.
  std::uint64_t network_bytes = 0;
  double network_ms = 0;
  std::size_t nodes = 0;
  std::size_t launches = 0;  // the device's compute nodes (a node of several kernels counts once)
  // With the rates: GEMM flops at the GEMM rate plus the other nodes' memory bytes at the device's
  // memory rates (fp32 and 8-bit updates; compute_ms), the bytes moved at the link rate, the host
  // updates at the host rates (fp32 and 8-bit), the codec's bytes at its rate, the launches at the
  // launch cost, and the step time predicted from them (predict_step_ms). 0 when a rate is unknown.
  double compute_ms = 0, transfer_ms = 0, host_update_ms = 0, codec_ms = 0, predicted_step_ms = 0;
  // transfer_ms's two directions alone, each at its own rate; transfer_ms is them over the link
  // together (link_ms: their sum on a half-duplex link, the longer on a full-duplex one).
  double to_device_ms = 0, to_host_ms = 0;
  double forward_ms = 0;  // the part of compute_ms before the backward
  // The device's updates when they wait for the step's verdict (the first after the backward's last node): the GEMM
  // flops and memory bytes (fp32 and 8-bit) of the nodes from the first update on, the bytes fetched and written back
  // from there, and their times. Streamed state's updates move their weights and moments over the link only then.
  std::uint64_t tail_gemm_flops = 0, tail_memory_bytes = 0, tail_memory_8bit_bytes = 0, tail_transfer_bytes = 0;
  double tail_compute_ms = 0, tail_transfer_ms = 0;
  double launch_ms = 0;  // launches at the launch cost
  // The step's nodes in their order at these rates (graph::estimate_schedule): each lane runs its
  // nodes one after another, each node after the other lanes' nodes whose bytes it depends on and,
  // where it changes state in place, after the commit point; the device's nodes no faster than the
  // host issues them at the launch cost. The step's length, the compute lane's idle time in it, and
  // its longest wait with the node that ended it. On a device of its own the prediction is at least
  // scheduled_step_ms; on a CPU device, whose lanes share its cores, these say what the order alone
  // would cost if each lane had an engine of its own.
  double scheduled_step_ms = 0, scheduled_compute_idle_ms = 0, scheduled_longest_wait_ms = 0;
  std::string scheduled_longest_wait_before;
  // The host updates change state in place (one copy: offload::changes_in_place), so they wait for
  // the step's commit point, the end of the backward, rather than starting as gradients land.
  bool host_updates_after_backward = false;
  // The host updates run in the next step from its start, each before its weight's fetch
  // (ResidencyOptions::overlap_host_updates): they wait for nothing and the forward waits for them.
  bool host_updates_deferred = false;
};

// A phase's step time from its parts (the terms above, computed): on a device of its own, the
// largest of compute, transfers, launches, the host's work (updates and codec) and the host
// updates after what they wait for (the forward, or the whole compute when they change state in
// place: host_updates_after_backward; nothing when deferred into the next step, whose backward
// then follows them), the next step's forward waiting for them, and the device's updates after
// the verdict (their kernels or their transfers, whichever is longer) after the rest, and the
// step's nodes in their order (scheduled_step_ms); with `shares_host_cores` (a CPU device:
// kernels, copies and host work on the same cores) their sum.
double predict_step_ms(const PhasePlan& p, bool shares_host_cores);

struct TrainingPlan {
  graph::ResidencyMode mode = graph::ResidencyMode::resident;  // the one the residency pass chose
  std::uint64_t device_budget_bytes = 0;  // as resolved (0 in the options: the device's less headroom)
  std::uint64_t min_budget_bytes = 0;     // the training step's smallest (stream mode)
  std::vector<PhasePlan> phases;          // the training step first
  std::uint64_t device_peak_bytes = 0;    // the largest phase's device total
  // Host bytes (pinned, or pageable for pageable and staged memory but the staging: host_memory): the persistent
  // tensors' stores (offload::host_copies() full copies per home) and every variant's host step pool. Excluded: the
  // compressed home's chunks (not pinned, their size depends on the data: host_compressed_bytes bounds them) and the
  // second batch mirrors of a step that runs ahead (the batch once more).
  std::uint64_t host_store_bytes = 0, host_step_bytes = 0, host_bytes = 0;
  // The compressed home's chunks (ordinary memory) at their bound, each tensor's at most its
  // uncompressed bytes: one set, and a tensor's new chunks while they are made; with two copies
  // (HomeStoreOptions::pinned_copies), two sets, since the new chunks replace the current ones only at commit.
  std::uint64_t host_compressed_bytes = 0;
  // With hybrid phases: the weights once more, in ordinary memory (the restore point the Trainer
  // reads at the start of each Predict run and puts back when the run diverges or a step of it
  // fails). 0 otherwise.
  std::uint64_t host_restore_bytes = 0;
  // The host pools of evaluation (Trainer::evaluate, each variant compiled at its first use): its
  // variant at the batch and those a data set's tail may take, the batch halved until one sample.
  // Not in host_bytes (the training steps'); check_host_budget counts it.
  std::uint64_t host_eval_bytes = 0;
  // The memory of the streamed homes and the step pools on this device (pinned, pageable, staged),
  // and staged memory's chunk (ResidencyOptions::staging_chunk_bytes; 0: fetches unchunked): as
  // given, or what `automatic` chose (resolve_host_transfers).
  offload::HostMemory host_memory = offload::HostMemory::pinned;
  std::uint64_t staging_chunk_bytes = 0;
  PlanRates rates;
  double predicted_step_ms = 0;  // the training step's (phases[0])
  std::uint32_t recompute = 0;   // layers per recomputed segment planned (chosen when recompute_auto)
  // The optimizer on the host (ResidencyOptions::host_optimizer), as given or chosen by
  // TrainerOptions::host_optimizer_auto; with the choice, what the other place's plan would move
  // over the link a step (fetches and write-backs; 0 when it was not planned or did not fit).
  bool host_optimizer = false;
  bool host_optimizer_chosen = false;
  std::uint64_t other_place_moved_bytes = 0;
  bool eight_bit_state = false;  // the optimizer keeps 8-bit state already (adamw8bit)
};

// What a Trainer and ferry plan make of host memory `automatic` (ResidencyOptions::homes.host_memory)
// on `device` (runtime/host_transfers.cpp has the measurements behind it): pinned where pinned
// buffers are host memory alone; where the driver backs each pinned buffer with device memory too
// (NVIDIA's), staged memory with chunked fetches of auto_staging_chunk_bytes(the device budget)
// when that is not 0 and something may stream (not resident by request with no role homed in
// host memory; a chunk already in the options is kept), else pageable. Other kinds come
// back as given. plan_training plans the staged choice first and takes pageable memory (no chunk)
// where that one does not fit the device budget; a CompiledStep given `automatic` directly takes
// offload::resolve_host_memory's (pageable there).
graph::ResidencyOptions resolve_host_transfers(graph::ResidencyOptions options, const cl::DeviceInfo& device);
// The staging chunk `automatic` host memory takes under a device budget where it stages: the
// budget / 128 rounded down to a power of two, at most 64 MiB; 0 below 16 MiB (a 2 GiB budget),
// where chunks are too small to beat the driver's own staging.
std::uint64_t auto_staging_chunk_bytes(std::uint64_t device_budget_bytes);

// The device budget a Trainer made now on `runtime` with `options` plans in, as the driver's count
// of free device memory allows (cl::DriverMemory; the count is read when this is called).
// `budget_bytes` is what the Trainer keeps in its options: the budget given, or 0 for the device's
// memory less headroom, or, with no budget given where other processes hold so much of the device
// that less is free, the free memory less the same headroom (`from_free_memory`). Throws
// std::invalid_argument, naming both figures, where a budget given is above what the driver counts
// free, and where a rank of a data-parallel run is given none on such a device (the ranks must plan
// alike). Without a count (PoCL, a driver that keeps none) the budget as given. `ferry plan` plans
// in it, so that its plan is the one `ferry train` would run.
struct TrainerBudget {
  std::uint64_t budget_bytes = 0;
  bool from_free_memory = false;
};
TrainerBudget trainer_budget_now(Runtime& runtime, const TrainerOptions& options);

// What check_host_budget holds a plan's host bytes to: the budget and this machine's physical
// memory (what runs here: the Trainer), or the budget alone where one is given, else physical
// memory (planning for a host the budget describes, which may be larger than this one).
enum class HostLimit { budget_and_physical_memory, budget_if_given };

// Plans the step variants a Trainer(runtime, model, options) would compile up front (the same
// graphs, model passes and planning passes: graph::plan_step), allocating nothing: no weights,
// optimizer state, step arena or kernels. Throws what the Trainer would for bad options, and
// graph::BudgetError when the device budget cannot hold the step; it does not check the host
// budget (check_host_budget does). With TrainerOptions::host_optimizer_auto, the host's updates
// are not chosen where their plan is over `host_limit` and the device's is not: the Trainer's
// limit by default, the budget alone for a plan of another host (plan_within_budgets).
TrainingPlan plan_training(Runtime& runtime, const ModelSpec& model, const TrainerOptions& options,
                           const PlanRates& rates = {}, HostLimit host_limit = HostLimit::budget_and_physical_memory);

// The bytes a plan's training step moves over the link between host and device: its fetches and
// write-backs (phases[0]).
std::uint64_t link_bytes_per_step(const TrainingPlan& plan);

// Where the optimizer's updates run and why, in ferry train's words, for a plan whose place
// TrainerOptions::host_optimizer_auto chose (TrainingPlan::host_optimizer_chosen): the link bytes
// of the step with the updates where they are and where they are not, and the flag that moves them.
std::string optimizer_place_reason(const TrainingPlan& plan);

// TrainerOptions::recompute_auto: the recomputation the step needs to fit its device budget. 0
// when it fits without; else the longest segment (in layers, of 64, 48, 32, 24, 16, 12, 8, 6, 4,
// 3, 2, 1) whose plan fits: the fewest recomputed layers' checkpoints. Plans only. Throws
// graph::BudgetError when none fits, naming the smallest budget any of them needs.
std::uint32_t choose_recompute(Runtime& runtime, const ModelSpec& model, const TrainerOptions& options);

// A plan and whether it fits its budgets: none, with the device budget's error, when the device
// budget cannot hold the step; the host budget's error (check_host_budget) when its host bytes
// are too many. `error` is empty when it fits.
struct PlanOutcome {
  std::optional<TrainingPlan> plan;
  std::string error;
  bool fits() const { return plan.has_value() && error.empty(); }
};

// plan_training, then check_host_budget against options.residency.host_budget_bytes, the budget
// errors (graph::BudgetError, HostBudgetError) caught into the outcome; bad options throw as in
// plan_training. A host budget given is the limit even above this machine's physical memory (a
// plan for a larger host: HostLimit::budget_if_given); a Trainer on this machine would refuse it.
PlanOutcome plan_within_budgets(Runtime& runtime, const ModelSpec& model, const TrainerOptions& options,
                                const PlanRates& rates = {});

// A configuration the planner may recommend instead of the options given: the flags that make it
// (as `ferry train` spells them, e.g. "--residency stream --host-optimizer"), the options, whether
// it trains the same numbers as the given options up to fp32 rounding order (no bf16 layers, no
// 8-bit state where they had none), and its plan, or why it does not fit the budgets or cannot
// be run with these options.
struct Configuration : PlanOutcome {
  std::string flags;
  TrainerOptions options;
  bool same_numerics = true;
};

struct ConfigurationSearch {
  std::vector<Configuration> tried;   // in the order tried (leanest change first)
  std::optional<std::size_t> chosen;  // index into `tried`; none: nothing fits
};

// The configuration to run `model` with under a device budget (options.residency.budget_bytes; 0:
// the device's memory less headroom) and a host budget (options.residency.host_budget_bytes):
// everything resident, mapped (unified-memory devices only), streamed, streamed with compressed
// optimizer state, with the optimizer on the host, each as given and with bf16 layers, and with
// 8-bit optimizer state (Adam; on the device, compressed, or on the host); with the batch split into micro-batches
// (gradient accumulation, the same samples per update) only when nothing fits at the given batch, and over
// data-parallel ranks with higher ZeRO stages only when nothing fits at the given stage. Among those that fit, the
// fastest predicted (`rates`) that trains the same numbers, else the fastest predicted of the rest; within 2% of the
// fastest, the leanest change. With no rates every prediction is 0, so the leanest change that fits is chosen. Plans
// only: nothing is allocated.
ConfigurationSearch search_configurations(Runtime& runtime, const ModelSpec& model, const TrainerOptions& options,
                                          const PlanRates& rates);

// The machine's physical memory in bytes (sysconf).
std::uint64_t physical_memory_bytes();

// A plan's pinned host bytes are more than the host budget, or than the machine's memory.
class HostBudgetError : public std::runtime_error {
 public:
  HostBudgetError(const std::string& what, std::uint64_t needed, std::uint64_t budget)
      : std::runtime_error(what), needed_(needed), budget_(budget) {}
  std::uint64_t needed_bytes() const noexcept { return needed_; }
  std::uint64_t budget_bytes() const noexcept { return budget_; }

 private:
  std::uint64_t needed_, budget_;
};

// Throws HostBudgetError when `plan.host_bytes` plus `plan.host_compressed_bytes` and
// `plan.host_restore_bytes` exceeds `host_budget_bytes` (0: no budget) or, as `limit_by` says,
// the machine's physical memory, naming the figure, the limit and what to change.
void check_host_budget(const TrainingPlan& plan, std::uint64_t host_budget_bytes,
                       HostLimit limit_by = HostLimit::budget_and_physical_memory);

}  // namespace ferry
