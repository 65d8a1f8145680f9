// Chrome trace writer (the format: docs/outputs.md).
#include "ferry/runtime/trace.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "output_file.hpp"
#include "trainer_internals.hpp"

namespace ferry {
namespace {

// The row of step markers, below the lanes, and the host thread's row below it.
constexpr int step_row = graph::lane_count;
constexpr int host_thread_row = graph::lane_count + 1;

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<unsigned>(static_cast<unsigned char>(c)));
    } else {
      out += c;
    }
  }
  return out;
}

std::string json_strings(const std::vector<std::string>& v) {
  std::string out = "[";
  for (std::size_t i = 0; i < v.size(); ++i) out += fmt::format("{}\"{}\"", i ? "," : "", json_escape(v[i]));
  return out + "]";
}

}  // namespace

void ChromeTrace::add_step(const Trainer& trainer, std::uint64_t step) {
  const graph::CompiledStep& s = compiled_last_run_step(trainer);  // the micro-batch or Predict step too
  add_step(s.timeline(), step, s.host_activity());
}

void ChromeTrace::add_step(const std::vector<graph::TimelineEntry>& timeline, std::uint64_t step,
                           const std::vector<graph::TimelineEntry>& host) {
  if (timeline.empty()) return;
  for (const auto& e : host) {
    events_.push_back({fmt::format("{} #{}", e.name, step), host_thread_row, e.start_ns, e.end_ns,
                       fmt::format(R"("step":{},"host":"{}")", step, json_escape(e.op))});
  }
  std::uint64_t first = UINT64_MAX, last = 0;
  for (const auto& e : timeline) {
    std::string args = fmt::format(R"("step":{},"op":"{}","bytes":{},"inputs":{},"outputs":{})", step,
                                   json_escape(e.op), e.bytes, json_strings(e.inputs), json_strings(e.outputs));
    // A host-lane node's wait: since it was ready, and since the driver reported its commands done.
    const auto ms_before_start = [&](std::uint64_t ns) {
      return e.start_ns > ns ? static_cast<double>(e.start_ns - ns) / 1e6 : 0.0;
    };
    if (e.ready_ns != 0) args += fmt::format(R"(,"waited_ms":{:.3f})", ms_before_start(e.ready_ns));
    if (e.events_done_ns != 0) args += fmt::format(R"(,"dispatch_ms":{:.3f})", ms_before_start(e.events_done_ns));
    if (!e.after.empty()) args += fmt::format(R"(,"after":"{} #{}")", json_escape(e.after), step);
    events_.push_back(
        {fmt::format("{} #{}", e.name, step), static_cast<int>(e.lane), e.start_ns, e.end_ns, std::move(args)});
    first = std::min(first, e.start_ns);
    last = std::max(last, e.end_ns);
  }
  events_.push_back({fmt::format("step {}", step), step_row, first, last,
                     fmt::format(R"("step":{},"nodes":{})", step, timeline.size())});
  ++steps_;
}

void ChromeTrace::add(std::string name, graph::Lane lane, std::uint64_t start_ns, std::uint64_t end_ns) {
  events_.push_back({std::move(name), static_cast<int>(lane), start_ns, end_ns, {}});
}

void ChromeTrace::write(const std::filesystem::path& path, WriteOptions options) const {
  std::uint64_t origin = UINT64_MAX;
  for (const auto& e : events_) origin = std::min(origin, e.start_ns);
  // Lane names as thread names, so the viewer shows compute / copy in / copy out / host / unpack
  // rows and the step markers; then the events. Entries are joined with commas, so any number of
  // events (none included) makes valid JSON.
  std::vector<std::string> entries;
  for (int lane = 0; lane <= host_thread_row; ++lane) {
    const char* name = lane == step_row          ? "steps"
                       : lane == host_thread_row ? "host thread"
                                                 : graph::lane_name(static_cast<graph::Lane>(lane));
    entries.push_back(
        fmt::format(R"({{"ph":"M","pid":1,"tid":{},"name":"thread_name","args":{{"name":"{}"}}}})", lane, name));
    entries.push_back(fmt::format(
        R"({{"ph":"M","pid":1,"tid":{},"name":"thread_sort_index","args":{{"sort_index":{}}}}})", lane, lane));
  }
  for (const auto& e : events_) {
    const std::uint64_t end = std::max(e.end_ns, e.start_ns);
    entries.push_back(fmt::format(R"({{"ph":"X","pid":1,"tid":{},"name":"{}","ts":{:.3f},"dur":{:.3f},"args":{{{}}}}})",
                                  e.tid, json_escape(e.name), (e.start_ns - origin) / 1e3, (end - e.start_ns) / 1e3,
                                  e.args));
  }
  write_output_file(path, "trace file", trace_signature, options, [&](std::ostream& out) {
    out << trace_signature << "\n";
    for (std::size_t i = 0; i < entries.size(); ++i) out << entries[i] << (i + 1 < entries.size() ? ",\n" : "\n");
    out << "],\"displayTimeUnit\":\"ms\",\"otherData\":{\"schema\":1,\"clock\":\"device\"}}\n";
  });
}

}  // namespace ferry
