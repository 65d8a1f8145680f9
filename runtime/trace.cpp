// Chrome trace writer.
#include "ferry/runtime/trace.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace ferry {
namespace {
std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out;
}
}  // namespace

void ChromeTrace::add_step(const std::vector<graph::TimelineEntry>& timeline, std::uint64_t step) {
  for (const auto& e : timeline) events_.push_back({fmt::format("{} #{}", e.name, step), e.lane, e.start_ns, e.end_ns});
}

void ChromeTrace::add(std::string name, graph::Lane lane, std::uint64_t start_ns, std::uint64_t end_ns) {
  events_.push_back({std::move(name), lane, start_ns, end_ns});
}

void ChromeTrace::write(const std::filesystem::path& path) const {
  std::ofstream out(path);
  if (!out) throw std::runtime_error(fmt::format("cannot write trace file '{}'", path.string()));
  std::uint64_t origin = UINT64_MAX;
  for (const auto& e : events_) origin = std::min(origin, e.start_ns);
  // Lane names as thread names, so the viewer shows compute / copy in / copy out / host rows;
  // then the events. Entries are joined with commas, so any number of events (none included)
  // makes valid JSON.
  std::vector<std::string> entries;
  for (int lane = 0; lane < graph::lane_count; ++lane) {
    entries.push_back(fmt::format(R"({{"ph":"M","pid":1,"tid":{},"name":"thread_name","args":{{"name":"{}"}}}})", lane,
                                  graph::lane_name(static_cast<graph::Lane>(lane))));
  }
  for (const auto& e : events_) {
    entries.push_back(fmt::format(R"({{"ph":"X","pid":1,"tid":{},"name":"{}","ts":{:.3f},"dur":{:.3f}}})",
                                  static_cast<int>(e.lane), json_escape(e.name), (e.start_ns - origin) / 1e3,
                                  (e.end_ns - e.start_ns) / 1e3));
  }
  out << "{\"traceEvents\":[\n";
  for (std::size_t i = 0; i < entries.size(); ++i) out << entries[i] << (i + 1 < entries.size() ? ",\n" : "\n");
  out << "]}\n";
  if (!out) throw std::runtime_error(fmt::format("failed writing trace file '{}'", path.string()));
}

}  // namespace ferry
