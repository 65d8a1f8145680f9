// The trainer's side of data-parallel training (docs/distributed.md): which options it takes, and
// the start-up check that every rank trains the same model the same way.
#include "data_parallel.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "ferry/runtime/checkpoint.hpp"

namespace ferry::detail {

bool data_parallel(const TrainerOptions& o) {
  return o.data_parallel.communicator && o.data_parallel.communicator->size() > 1;
}

void validate_data_parallel(TrainerOptions& options) {
  auto& dp = options.data_parallel;
  if (dp.zero_stage < 0 || dp.zero_stage > 2) {
    throw std::invalid_argument(fmt::format("ZeRO stage {}: the stages are 0, 1 and 2", dp.zero_stage));
  }
  if (!data_parallel(options)) return;
  const int ranks = dp.communicator->size();
  if (dp.global_batch == 0) dp.global_batch = options.batch * static_cast<std::uint32_t>(ranks);
  if (dp.global_batch < static_cast<std::uint32_t>(ranks) || options.batch == 0 || options.batch > dp.global_batch) {
    throw std::invalid_argument(fmt::format("rank {} of {}: a batch of {} cannot be its share of a global batch of {}",
                                            dp.communicator->rank(), ranks, options.batch, dp.global_batch));
  }
  if (dp.bucket_bytes == 0) throw std::invalid_argument("data parallel: the gradient bucket size must be > 0 bytes");
}

namespace {

// What every rank of a data-parallel run must agree on: the trained tensors (names, shapes,
// types) and the options that decide the update. Not the batch (ranks' shares may differ by one)
// nor where tensors live (ranks may have different devices).
std::uint64_t run_fingerprint(const graph::Graph& g, const TrainerOptions& o) {
  std::string s;
  const auto& t = g.tensors;
  for (TensorId x = 0; x < t.size(); ++x) {
    if (t.role[x] != graph::Role::weight) continue;  // (sharded optimizer state differs by rank)
    s += fmt::format("{}:{}:{}:{};", t.name[x], t.shape[x].str(), graph::dtype_name(t.dtype[x]),
                     graph::role_name(t.role[x]));
  }
  const auto& opt = o.optimizer;
  const auto& dp = o.data_parallel;
  // Which weights decay matters only where some weight decay is set.
  const bool decays = opt.sgd.weight_decay > 0.0f || opt.adam.weight_decay > 0.0f;
  const char* const decay_on = decays ? ops::decay_on_name(opt.decay_on) : "none";
  s += fmt::format(
      "lr {} seed {} accumulate {} precision {} optimizer {} {} {} {} {} {} {} {} {} {} {} global {} zero {}", o.lr,
      o.seed, o.accumulate, graph::dtype_name(o.precision.compute), ops::optimizer_name(opt.kind), opt.sgd.momentum,
      opt.sgd.weight_decay, opt.sgd.nesterov, opt.adam.beta1, opt.adam.beta2, opt.adam.eps, opt.adam.weight_decay,
      decay_on, opt.block8bit, dp.bucket_bytes, dp.global_batch, dp.zero_stage);
  // Hybrid phases and loss scaling: every rank's controller and scaler must make the same choices
  // from the same (reduced) losses and guards.
  const auto& ph = o.phases;
  const auto& pr = o.precision;
  s += fmt::format(" phases {} {} {} {} {} {} {} {} {} {} {} {} {} {} {} scaling {} {} {}", ph.hybrid,
                   ops::predictor_name(ph.predictor.kind), ph.predictor.beta, ph.predictor.max_gain,
                   ph.predictor.residual, ph.warmup_steps, ph.min_full_steps, ph.max_predict_steps, ph.confidence,
                   ph.max_loss_gap, ph.sigma_limit, ph.loss_window, ph.predict_decay, ph.predict_int8, ph.fit_every,
                   pr.scaled(), pr.initial_scale, pr.growth_interval);
  return checkpoint_checksum(s.data(), s.size());
}

}  // namespace

void check_ranks_agree(ops::Communicator& control, const graph::Graph& training, const TrainerOptions& o) {
  const std::vector<std::uint64_t> prints = control.allgather(run_fingerprint(training, o));
  const std::vector<std::uint64_t> batches = control.allgather(o.batch);
  std::vector<int> differ;
  for (std::size_t r = 0; r < prints.size(); ++r) {
    if (prints[r] != prints[0]) differ.push_back(static_cast<int>(r));
  }
  if (!differ.empty()) {
    throw std::invalid_argument(fmt::format(
        "the {} ranks of this data-parallel run disagree on the model or the training options: rank(s) {} differ from "
        "rank 0 (a hash of the weights' names and shapes, optimizer, learning rate, seed, accumulation, precision, "
        "loss scaling, phases, global batch, bucket size and ZeRO stage): start every rank with the same command and "
        "data",
        prints.size(), fmt::join(differ, ", ")));
  }
  std::uint64_t sum = 0;
  for (std::uint64_t b : batches) sum += b;
  if (sum != o.data_parallel.global_batch) {
    throw std::invalid_argument(fmt::format(
        "the ranks' batches ({}) add up to {} samples, not the global batch of {}: give each rank its share "
        "(ferry::shard_of)",
        fmt::join(batches, ", "), sum, o.data_parallel.global_batch));
  }
}

}  // namespace ferry::detail
