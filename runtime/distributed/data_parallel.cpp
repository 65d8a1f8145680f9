// The trainer's side of data-parallel training (docs/distributed.md): which options it takes, and
// the start-up check that every rank trains the same model the same way.
#include "data_parallel.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
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
  if (!data_parallel(options)) {
    // One rank trains the whole batch: another global batch would be silently ignored.
    if (dp.global_batch != 0 && dp.global_batch != options.batch) {
      throw std::invalid_argument(fmt::format(
          "a global batch of {} with a batch of {} on one rank (no communicator of 2 or more ranks): alone the batch "
          "is the global batch; set DataParallelOptions::global_batch to 0 or {}",
          dp.global_batch, options.batch, options.batch));
    }
    return;
  }
  const int ranks = dp.communicator->size();
  if (dp.global_batch == 0) dp.global_batch = options.batch * static_cast<std::uint32_t>(ranks);
  if (dp.global_batch < static_cast<std::uint32_t>(ranks) || options.batch == 0 || options.batch > dp.global_batch) {
    throw std::invalid_argument(fmt::format("rank {} of {}: a batch of {} cannot be its share of a global batch of {}",
                                            dp.communicator->rank(), ranks, options.batch, dp.global_batch));
  }
  if (dp.bucket_bytes == 0) throw std::invalid_argument("data parallel: the gradient bucket size must be > 0 bytes");
}

namespace {

std::uint64_t hash_of(const std::string& s) {
  return checkpoint_checksum(s.data(), s.size());
}

// What every rank of a data-parallel run must agree on: the trained tensors (names, shapes,
// types) and every training setting (ferry/runtime/training_setting.hpp), each a hash. Not the
// batch (ranks' shares may differ by one) nor where tensors live (ranks may have different
// devices).
struct RunPrint {
  std::uint64_t weights = 0;
  std::vector<TrainingSetting> settings;
  std::vector<std::uint64_t> setting_hashes;
  std::uint64_t whole = 0;
};

RunPrint run_print(const graph::Graph& g, const ModelSpec& model, const TrainerOptions& o) {
  RunPrint p;
  std::string s;
  const auto& t = g.tensors;
  for (TensorId x = 0; x < t.size(); ++x) {
    if (t.role[x] != graph::Role::weight) continue;  // (sharded optimizer state differs by rank)
    s += fmt::format("{}:{}:{};", t.name[x], t.shape[x].str(), graph::dtype_name(t.dtype[x]));
  }
  p.weights = hash_of(s);
  p.settings = training_settings(model, o);
  for (const TrainingSetting& ts : p.settings) {
    p.setting_hashes.push_back(hash_of(ts.name + '=' + ts.value));
    s += fmt::format("{}={};", ts.name, ts.value);
  }
  p.whole = hash_of(s);
  return p;
}

// The ranks disagree: which of them, and on what (a collective: every rank calls it). A list of
// another length is another set of options; the first setting whose hash differs is named.
std::string disagreement(ops::Communicator& control, const RunPrint& p, const std::vector<std::uint64_t>& wholes) {
  std::vector<int> differ;
  for (std::size_t r = 0; r < wholes.size(); ++r) {
    if (wholes[r] != wholes[0]) differ.push_back(static_cast<int>(r));
  }
  const auto of_all = [&](std::uint64_t v) {
    const std::vector<std::uint64_t> all = control.allgather(v);
    return std::any_of(all.begin(), all.end(), [&](std::uint64_t x) { return x != all[0]; });
  };
  std::string what = "their options";
  if (of_all(p.weights)) {
    what = "the model's weights (names, shapes or types)";
  } else {
    // The lists may differ in length (a setting such as hybrid phases brings others): the first
    // difference among the settings every rank has, else the length.
    const std::vector<std::uint64_t> sizes = control.allgather(p.settings.size());
    const std::size_t common = *std::min_element(sizes.begin(), sizes.end());
    bool named = false;
    for (std::size_t i = 0; i < common && !named; ++i) {
      if (!of_all(p.setting_hashes[i])) continue;
      what = fmt::format("{}, which is {} on this rank", p.settings[i].name,
                         setting_text(p.settings[i], p.settings[i].value));
      named = true;
    }
    if (!named && common < p.settings.size()) {
      what = fmt::format("the settings they have: this rank has {} that another lacks, from {}",
                         p.settings.size() - common, p.settings[common].name);
    } else if (!named) {
      what = fmt::format("the settings they have: this rank has {}, another more", p.settings.size());
    }
  }
  return fmt::format("rank(s) {} differ from rank 0 in {}", fmt::join(differ, ", "), what);
}

}  // namespace

void check_ranks_agree(ops::Communicator& control, const graph::Graph& training, const ModelSpec& model,
                       const TrainerOptions& o) {
  const RunPrint p = run_print(training, model, o);
  const std::vector<std::uint64_t> wholes = control.allgather(p.whole);
  const std::vector<std::uint64_t> batches = control.allgather(o.batch);
  if (std::any_of(wholes.begin(), wholes.end(), [&](std::uint64_t w) { return w != wholes[0]; })) {
    throw std::invalid_argument(
        fmt::format("the {} ranks of this data-parallel run disagree on the model or the training options: {}: start "
                    "every rank with the same command and data",
                    wholes.size(), disagreement(control, p, wholes)));
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

void check_ranks_place_optimizer_alike(ops::Communicator& control, bool on_host) {
  const std::vector<std::uint64_t> places = control.allgather(on_host ? 1 : 0);
  if (std::all_of(places.begin(), places.end(), [&](std::uint64_t p) { return p == places[0]; })) return;
  std::vector<std::size_t> host;
  for (std::size_t r = 0; r < places.size(); ++r) {
    if (places[r] != 0) host.push_back(r);
  }
  throw std::invalid_argument(fmt::format(
      "the {} ranks of this data-parallel run would run the optimizer in different places: rank(s) {} on the host, "
      "the others on the device, whose arithmetic differs in the last bits, so the replicas would drift apart (where "
      "ranks chose the place, host_optimizer_auto, their devices differ in kind or memory). Give every rank the same "
      "place: --host-optimizer or "
      "--no-host-optimizer (ResidencyOptions::host_optimizer with host_optimizer_auto false)",
      places.size(), fmt::join(host, ", ")));
}

}  // namespace ferry::detail
