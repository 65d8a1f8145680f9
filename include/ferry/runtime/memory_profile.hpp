// Memory profiler: device bytes over the step (per variant and per section of the step), the
// spikes, and the transfers with their device times.
//
// Device bytes come from the memory plan, so they are exact and known before the step runs;
// transfer times come from the device timeline of recorded steps (a Runtime with profiling).
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/runtime/write_options.hpp"

namespace ferry::graph {
class CompiledStep;
}  // namespace ferry::graph

namespace ferry {

class Trainer;

// How the CSV files of MemoryProfiler::write_csv and write_phase_csv begin (their headers' first
// columns).
inline constexpr std::string_view profile_signature = "variant,step,node,kind,lane,section,";
inline constexpr std::string_view phase_profile_signature = "variant,section,peak_device_bytes,";

enum class StepSection : std::uint8_t { io, forward, backward, update, transfer };
const char* section_name(StepSection s);

struct MemoryPhaseSummary {
  std::string variant;  // "train", "eval256", with hybrid phases "predict", ...
  std::string section;  // "all", "forward", "backward", "update"
  std::uint64_t peak_bytes = 0, mean_bytes = 0, min_bytes = 0;
  std::string peak_node;
  std::size_t spikes = 0;  // nodes holding more than 1.25x the mean of their variant
};

struct MemorySpike {
  std::string variant, node;
  std::uint64_t bytes = 0;
  double over_mean = 0;  // bytes / mean of its variant
};

struct TransferSummary {
  std::uint64_t fetch_bytes = 0, write_back_bytes = 0;  // per recorded step, summed over steps
  double fetch_ms = 0, write_back_ms = 0;               // device time, from the timeline
  std::uint32_t steps = 0;
  double fetch_gbps() const { return fetch_ms > 0 ? fetch_bytes / fetch_ms / 1e6 : 0; }
  double write_back_gbps() const { return write_back_ms > 0 ? write_back_bytes / write_back_ms / 1e6 : 0; }
};

// What one home holds: its tensors' logical size, and the device and host bytes its store keeps
// for them (compressed chunks, two slots when streamed, nothing when dropped).
struct HomeSummary {
  std::string home;
  std::string host_memory;  // the kind its host bytes are (offload::host_memory_name), "" without any
  std::uint64_t tensor_bytes = 0, device_bytes = 0, host_bytes = 0;
};

class MemoryProfiler {
 public:
  // A trainer's training step's static profile, as the variant "train".
  void add_training_step(const Trainer& trainer);
  // The device timeline of the training step the trainer ran last, as step `index` of "train".
  void add_last_step(const Trainer& trainer, std::uint64_t index);
  // Every variant the trainer compiled besides its training step (so far), named by the phase it
  // serves: "eval<batch>", "predict", "micro", "train-nofit" (docs/phases.md).
  void add_variants(const Trainer& trainer);
  // The same for one compiled step (the CLI's and the benchmarks' internals).
  // Adds a compiled variant's static profile (once per variant).
  void add_variant(const std::string& variant, const graph::CompiledStep& step);
  // Adds the device timeline of a step just run (no-op without profiling).
  void add_step(const std::string& variant, const graph::CompiledStep& step, std::uint64_t index);

  std::vector<MemoryPhaseSummary> phases() const;
  std::vector<MemorySpike> spikes(std::size_t max_count = 5) const;
  TransferSummary transfers() const { return transfers_; }
  // Per home in use, as of the last variant or step added.
  const std::vector<HomeSummary>& homes() const { return homes_; }
  // One row per node of each variant, then one per node of each recorded step. Both writers
  // replace a file whole and only a profile ferry wrote, as Trace::write.
  void write_csv(const std::filesystem::path& path, WriteOptions options = {}) const;
  // One row per variant (each phase's compiled step) and section: variant, section,
  // peak_device_bytes, peak_node, mean_device_bytes, min_device_bytes, spikes.
  void write_phase_csv(const std::filesystem::path& path, WriteOptions options = {}) const;
  // A few human-readable lines.
  std::string summary() const;

 private:
  struct NodeRow {
    std::string variant, name, kind, lane;
    StepSection section;
    std::uint64_t live_bytes, transfer_bytes;
    std::int64_t step = -1;  // -1: static row
    double start_us = 0, end_us = 0;
  };
  void record_homes(const graph::CompiledStep& step);
  std::vector<NodeRow> rows_;
  std::vector<HomeSummary> homes_;
  std::vector<std::string> variants_;
  TransferSummary transfers_;
  std::uint64_t time_origin_ns_ = 0;
};

}  // namespace ferry
