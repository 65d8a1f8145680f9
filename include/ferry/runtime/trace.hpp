// Chrome trace (Perfetto / chrome://tracing) of step timelines: one lane per queue.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "ferry/graph/compiled_step.hpp"

namespace ferry {

class ChromeTrace {
 public:
  // Adds one step's timeline (device clock); steps are laid out in the order added.
  void add_step(const std::vector<graph::TimelineEntry>& timeline, std::uint64_t step);
  // Adds a span measured elsewhere (e.g. a benchmark's copy), times in device nanoseconds.
  void add(std::string name, graph::Lane lane, std::uint64_t start_ns, std::uint64_t end_ns);
  std::size_t size() const noexcept { return events_.size(); }
  // Writes {"traceEvents": [...]}; throws std::runtime_error naming the path if it cannot.
  void write(const std::filesystem::path& path) const;

 private:
  struct Event {
    std::string name;
    graph::Lane lane;
    std::uint64_t start_ns, end_ns;
  };
  std::vector<Event> events_;
};

}  // namespace ferry
