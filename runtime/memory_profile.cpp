// Memory profiler.
#include "ferry/runtime/memory_profile.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <map>
#include <stdexcept>

#include "ferry/runtime/units.hpp"
#include "output_file.hpp"
#include "trainer_internals.hpp"

namespace ferry {
namespace {

using ops::OpClass;

OpClass class_of(const graph::Graph& g, graph::NodeId n) {
  return ops::op_info(g.nodes.op[n]).op_class;
}

// Which part of the step a node belongs to, from its row's class; gradient-summing adds and
// anything else after the loss count as backward.
std::vector<StepSection> sections(const graph::Graph& g) {
  std::vector<StepSection> out(g.nodes.size(), StepSection::forward);
  bool after_loss = false;
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    switch (class_of(g, n)) {
      case OpClass::batch_transfer:
        out[n] = StepSection::io;
        break;
      case OpClass::state_transfer:
      case OpClass::communication:
        out[n] = StepSection::transfer;
        break;
      case OpClass::update:
      case OpClass::state_update:
        out[n] = StepSection::update;
        break;
      case OpClass::loss:
        out[n] = StepSection::forward;
        after_loss = true;
        break;
      case OpClass::backward:
        out[n] = StepSection::backward;
        break;
      case OpClass::forward:
      case OpClass::cast:
        out[n] = after_loss ? StepSection::backward : StepSection::forward;
        break;
    }
  }
  return out;
}

// Bytes a transfer node moves (its inputs' bytes: a copy's input and output have one size).
std::uint64_t transfer_bytes(const graph::Graph& g, graph::NodeId n) {
  const OpClass c = class_of(g, n);
  if (c != OpClass::batch_transfer && c != OpClass::state_transfer) return 0;
  std::uint64_t b = 0;
  for (auto t : g.nodes.inputs(n)) b += g.tensors.bytes(t);
  return b;
}

// A CSV field (RFC 4180): quoted, with quotes doubled, when it holds a comma, quote or newline.
std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

}  // namespace

const char* section_name(StepSection s) {
  switch (s) {
    case StepSection::io:
      return "io";
    case StepSection::forward:
      return "forward";
    case StepSection::backward:
      return "backward";
    case StepSection::update:
      return "update";
    case StepSection::transfer:
      return "transfer";
  }
  return "?";
}

void MemoryProfiler::record_homes(const graph::CompiledStep& step) {
  // From the arena, which every variant shares (an evaluation graph has no optimizer state).
  std::array<std::uint64_t, offload::home_count> logical{};
  for (const auto& [name, e] : step.persistent()->placements) logical[static_cast<int>(e.home)] += e.bytes;
  homes_.clear();
  for (int h = 0; h < offload::home_count; ++h) {
    const auto& store = step.persistent()->homes[h];
    if (!store) continue;
    homes_.push_back({offload::home_name(static_cast<offload::Home>(h)), store->host_memory(), logical[h],
                      store->device_bytes(), store->host_bytes()});
  }
}

void MemoryProfiler::add_training_step(const Trainer& trainer) {
  add_variant("train", compiled_train_step(trainer));
}

namespace {

// A variant's name in the profiles, by the phase it serves (docs/phases.md): the Predict step, the
// micro-batch step and the training step without a fit have their own.
std::string variant_name(const graph::VariantKey& key) {
  if (key.apply_predictor) return "predict";
  if (key.micro) return "micro";
  if (key.training && !key.fit_predictor) return "train-nofit";
  return fmt::format("{}{}", key.training ? "train" : "eval", key.batch);
}

}  // namespace

void MemoryProfiler::add_last_step(const Trainer& trainer, std::uint64_t index) {
  // The step it ran: the training step, or a micro-batch, Predict or no-fit step.
  const graph::CompiledStep& ran = compiled_last_run_step(trainer);
  std::string name = "train";
  for (const auto& [key, step] : compiled_variants(trainer)) {
    if (step.get() == &ran) name = variant_name(key);
  }
  add_step(name, ran, index);
}

void MemoryProfiler::add_variants(const Trainer& trainer) {
  for (const auto& [key, step] : compiled_variants(trainer)) add_variant(variant_name(key), *step);
}

void MemoryProfiler::add_variant(const std::string& variant, const graph::CompiledStep& step) {
  record_homes(step);
  if (std::find(variants_.begin(), variants_.end(), variant) != variants_.end()) return;
  variants_.push_back(variant);
  const auto& g = step.graph();
  const auto sec = sections(g);
  const std::uint64_t resident = step.persistent()->device_bytes();
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) {
    rows_.push_back({variant, g.nodes.name[n], graph::op_name(g.nodes.op[n]), graph::lane_name(g.nodes.lane[n]), sec[n],
                     resident + step.plan().live_bytes[n], transfer_bytes(g, n)});
  }
}

void MemoryProfiler::add_step(const std::string& variant, const graph::CompiledStep& step, std::uint64_t index) {
  record_homes(step);
  const auto timeline = step.timeline();
  if (timeline.empty()) return;
  const auto& g = step.graph();
  const auto sec = sections(g);
  const std::uint64_t resident = step.persistent()->device_bytes();
  if (time_origin_ns_ == 0) {
    time_origin_ns_ = UINT64_MAX;
    for (const auto& e : timeline) time_origin_ns_ = std::min(time_origin_ns_, e.start_ns);
  }
  std::map<std::string, graph::NodeId> by_name;
  for (graph::NodeId n = 0; n < g.nodes.size(); ++n) by_name[g.nodes.name[n]] = n;
  bool counted = false;
  for (const auto& e : timeline) {
    const graph::NodeId n = by_name.at(e.name);
    const double ms = (e.end_ns - e.start_ns) / 1e6;
    const std::uint64_t bytes = transfer_bytes(g, n);
    const bool state = class_of(g, n) == OpClass::state_transfer;
    if (state && g.nodes.lane[n] == graph::Lane::h2d) {
      transfers_.fetch_bytes += bytes;
      transfers_.fetch_ms += ms;
      counted = true;
    } else if (state) {
      transfers_.write_back_bytes += bytes;
      transfers_.write_back_ms += ms;
      counted = true;
    }
    rows_.push_back({variant, e.name, graph::op_name(g.nodes.op[n]), graph::lane_name(e.lane), sec[n],
                     resident + step.plan().live_bytes[n], bytes, static_cast<std::int64_t>(index),
                     (static_cast<double>(e.start_ns) - time_origin_ns_) / 1e3,
                     (static_cast<double>(e.end_ns) - time_origin_ns_) / 1e3});
  }
  if (counted) ++transfers_.steps;
}

std::vector<MemoryPhaseSummary> MemoryProfiler::phases() const {
  std::vector<MemoryPhaseSummary> out;
  for (const auto& v : variants_) {
    for (const char* section : {"all", "forward", "backward", "update"}) {
      MemoryPhaseSummary s{v, section};
      s.min_bytes = ~std::uint64_t{0};
      double sum = 0;
      std::size_t count = 0;
      for (const auto& r : rows_) {
        if (r.step >= 0 || r.variant != v) continue;
        if (std::string(section) != "all" && section_name(r.section) != std::string(section)) continue;
        sum += static_cast<double>(r.live_bytes);
        ++count;
        s.min_bytes = std::min(s.min_bytes, r.live_bytes);
        if (r.live_bytes > s.peak_bytes) {
          s.peak_bytes = r.live_bytes;
          s.peak_node = r.name;
        }
      }
      if (count == 0) continue;
      s.mean_bytes = static_cast<std::uint64_t>(sum / count);
      for (const auto& r : rows_) {
        if (r.step >= 0 || r.variant != v) continue;
        if (std::string(section) != "all" && section_name(r.section) != std::string(section)) continue;
        s.spikes += static_cast<double>(r.live_bytes) > 1.25 * static_cast<double>(s.mean_bytes);
      }
      out.push_back(std::move(s));
    }
  }
  return out;
}

std::vector<MemorySpike> MemoryProfiler::spikes(std::size_t max_count) const {
  // A spike: a node whose live bytes stand more than 25% above its variant's mean.
  std::vector<MemorySpike> out;
  for (const auto& p : phases()) {
    if (p.section != "all" || p.mean_bytes == 0) continue;
    for (const auto& r : rows_) {
      if (r.step >= 0 || r.variant != p.variant) continue;
      const double ratio = static_cast<double>(r.live_bytes) / static_cast<double>(p.mean_bytes);
      if (ratio > 1.25) out.push_back({r.variant, r.name, r.live_bytes, ratio});
    }
  }
  std::sort(out.begin(), out.end(), [](const MemorySpike& a, const MemorySpike& b) { return a.bytes > b.bytes; });
  if (out.size() > max_count) out.resize(max_count);
  return out;
}

void MemoryProfiler::write_csv(const std::filesystem::path& path, WriteOptions options) const {
  write_output_file(path, "memory profile", profile_signature, options, [&](std::ostream& out) {
    // RFC 4180: every row has the header's ten fields; plan rows leave start_us and end_us empty.
    out << profile_signature << "live_device_bytes,transfer_bytes,start_us,end_us\n";
    for (const auto& r : rows_) {
      out << fmt::format("{},{},{},{},{},{},{},{},", csv_field(r.variant),
                         r.step < 0 ? std::string("plan") : std::to_string(r.step), csv_field(r.name),
                         csv_field(r.kind), csv_field(r.lane), section_name(r.section), r.live_bytes, r.transfer_bytes);
      if (r.step >= 0) {
        out << fmt::format("{:.3f},{:.3f}\n", r.start_us, r.end_us);
      } else {
        out << ",\n";
      }
    }
  });
}

void MemoryProfiler::write_phase_csv(const std::filesystem::path& path, WriteOptions options) const {
  write_output_file(path, "phase memory profile", phase_profile_signature, options, [&](std::ostream& out) {
    out << phase_profile_signature << "peak_node,mean_device_bytes,min_device_bytes,spikes\n";
    for (const auto& p : phases()) {
      out << fmt::format("{},{},{},{},{},{},{}\n", csv_field(p.variant), p.section, p.peak_bytes,
                         csv_field(p.peak_node), p.mean_bytes, p.min_bytes, p.spikes);
    }
  });
}

std::string MemoryProfiler::summary() const {
  std::string s;
  const std::vector<MemoryPhaseSummary> rows = phases();
  // One column for every variant's name ("train", "eval16", "micro-batch", ...).
  std::size_t name_width = 5;
  for (const auto& p : rows) name_width = std::max(name_width, p.variant.size());
  for (const auto& p : rows) {
    s += fmt::format("  {:<{}} {:<8} device peak {:>10} (at {}), mean {:>10}\n", p.variant, name_width, p.section,
                     format_bytes(p.peak_bytes), p.peak_node, format_bytes(p.mean_bytes));
  }
  for (const auto& sp : spikes(3)) {
    s += fmt::format("  spike: {} {} holds {} ({:.2f}x the mean)\n", sp.variant, sp.node, format_bytes(sp.bytes),
                     sp.over_mean);
  }
  for (const auto& h : homes_) {
    s += fmt::format("  home {:<15} holds {:>10} of tensors in {:>10} of device and {:>10} of host memory{}\n", h.home,
                     format_bytes(h.tensor_bytes), format_bytes(h.device_bytes), format_bytes(h.host_bytes),
                     h.host_memory.empty() ? "" : fmt::format(" ({})", h.host_memory));
  }
  if (transfers_.steps > 0) {
    s += fmt::format(
        "  transfers over {} traced steps: fetched {} in {:.1f} ms ({:.2f} GB/s), wrote back {} in {:.1f} "
        "ms ({:.2f} GB/s)\n",
        transfers_.steps, format_bytes(transfers_.fetch_bytes), transfers_.fetch_ms, transfers_.fetch_gbps(),
        format_bytes(transfers_.write_back_bytes), transfers_.write_back_ms, transfers_.write_back_gbps());
  }
  return s;
}

}  // namespace ferry
