// Chrome trace (Perfetto / chrome://tracing) of step timelines: one lane per queue, a row of
// step markers, and a row of the host thread's enqueues and waits; fields documented in
// docs/outputs.md.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/graph/step_report.hpp"
#include "ferry/runtime/write_options.hpp"

namespace ferry {

class Trainer;

// How every trace ChromeTrace::write writes begins.
inline constexpr std::string_view trace_signature = "{\"traceEvents\":[";

class ChromeTrace {
 public:
  // Adds one step's timeline (device clock) and a marker spanning it; steps are laid out in the
  // order added. An empty timeline adds nothing.
  // `host` is what the host thread did for the step (graph::CompiledStep::host_activity): its
  // enqueues and waits, on a row of their own ("host thread"), so a gap on a device lane can be
  // laid beside what the host was doing then.
  void add_step(const std::vector<graph::TimelineEntry>& timeline, std::uint64_t step,
                const std::vector<graph::TimelineEntry>& host = {});
  // The training step the trainer ran last (a Runtime with profiling), as step `step`.
  void add_step(const Trainer& trainer, std::uint64_t step);
  // Adds a span measured elsewhere (e.g. a benchmark's copy), times in device nanoseconds.
  void add(std::string name, graph::Lane lane, std::uint64_t start_ns, std::uint64_t end_ns);
  std::size_t size() const noexcept { return events_.size(); }
  // Steps added with add_step.
  std::size_t steps() const noexcept { return steps_; }
  // Writes {"traceEvents": [...]} whole (a new file renamed into place); throws
  // std::runtime_error naming the path if it cannot, or if `path` is a link, folder or device or a
  // file that is not a ferry trace (unless options.replace_foreign_file): nothing changes then.
  void write(const std::filesystem::path& path, WriteOptions options = {}) const;

 private:
  struct Event {
    std::string name;
    int tid;  // a lane, or the step-marker row
    std::uint64_t start_ns, end_ns;
    std::string args;  // a JSON object's members, or empty
  };
  std::vector<Event> events_;
  std::size_t steps_ = 0;
};

}  // namespace ferry
