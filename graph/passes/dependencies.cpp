// Cross-lane dependencies by byte range: one sweep over the nodes in their static order.
//
// Per space, an ordered map partitions the touched bytes into segments; each segment remembers,
// per lane, the latest node that wrote it and the latest node that accessed it (read or write).
// A node's access [begin, end) conflicts, on another lane, with the latest writer of any segment
// it overlaps, and if it writes, with the latest accessor. Taking the latest over the overlapped
// segments gives the latest conflicting node of that lane: any later node of that lane recorded
// at the same bytes conflicts too. Then the node records itself on its own lane over its ranges.
// Segments are split at range boundaries and adjacent segments with the same contents are merged
// again, so their count stays near the number of distinct live ranges. Accesses of the busiest
// lane to bytes that no other lane touches anywhere in the step are left out of the sweep. (The
// sweep works on doubled positions so that empty ranges conflict exactly as in the all-pairs scan
// it replaced; see cross_lane_dependencies.)
#include "graph/dependencies.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <iterator>
#include <limits>
#include <map>
#include <stdexcept>
#include <unordered_map>

namespace ferry::graph {
namespace {

constexpr int lanes_max = ops::lane_count;

// Node ids are stored plus one, so that 0 means "none" and the latest is the maximum.
struct Segment {
  std::uint64_t end = 0;
  std::array<std::uint32_t, lanes_max> writer{};    // latest writing node + 1, per lane
  std::array<std::uint32_t, lanes_max> accessor{};  // latest reading or writing node + 1, per lane
  bool same_marks(const Segment& o) const { return writer == o.writer && accessor == o.accessor; }
};

class Space {
 public:
  // Raises latest[lane] to the latest conflicting node (+1) of each lane over [begin, end).
  void query(std::uint64_t begin, std::uint64_t end, bool write, std::array<std::uint32_t, lanes_max>& latest) const {
    for (auto it = first_overlapping(begin); it != segments_.end() && it->first < end; ++it) {
      const auto& marks = write ? it->second.accessor : it->second.writer;
      for (int l = 0; l < lanes_max; ++l) latest[l] = std::max(latest[l], marks[l]);
    }
  }

  // Records node (+1) `mark` on `lane` as the latest accessor (and writer if `write`) of [begin, end).
  void record(std::uint64_t begin, std::uint64_t end, bool write, int lane, std::uint32_t mark) {
    split_at(begin);
    split_at(end);
    auto it = segments_.lower_bound(begin);
    std::uint64_t pos = begin;
    while (pos < end) {
      if (it == segments_.end() || it->first > pos) {
        // Untouched bytes: a new segment up to the next one (or the end of the range).
        const std::uint64_t stop = it == segments_.end() ? end : std::min(end, it->first);
        Segment s;
        s.end = stop;
        it = segments_.emplace_hint(it, pos, s);
      }
      Segment& s = it->second;
      s.accessor[lane] = mark;
      if (write) s.writer[lane] = mark;
      pos = s.end;
      ++it;
    }
    merge_around(begin, end);
  }

 private:
  using Map = std::map<std::uint64_t, Segment>;

  // The first segment that ends after `pos`: the one containing it, or the next one.
  Map::const_iterator first_overlapping(std::uint64_t pos) const {
    auto it = segments_.upper_bound(pos);
    if (it != segments_.begin()) {
      auto prev = std::prev(it);
      if (prev->second.end > pos) return prev;
    }
    return it;
  }

  // Splits the segment strictly containing `pos` (begin < pos < end) into two.
  void split_at(std::uint64_t pos) {
    auto it = segments_.upper_bound(pos);
    if (it == segments_.begin()) return;
    --it;
    if (it->first == pos || it->second.end <= pos) return;
    Segment tail = it->second;
    it->second.end = pos;
    segments_.emplace_hint(std::next(it), pos, tail);
  }

  // Merges adjacent segments with the same marks from the one before `begin` to the one at `end`.
  void merge_around(std::uint64_t begin, std::uint64_t end) {
    auto it = segments_.lower_bound(begin);
    if (it != segments_.begin()) --it;
    while (it != segments_.end() && it->first <= end) {
      auto next = std::next(it);
      if (next == segments_.end()) break;
      if (it->second.end == next->first && it->second.same_marks(next->second)) {
        it->second.end = next->second.end;
        segments_.erase(next);
      } else {
        it = next;
      }
    }
  }

  Map segments_;
};

// Merged [begin, end) blocks, sorted: bytes touched in one space over the whole step.
class ByteUnion {
 public:
  void add(std::uint64_t begin, std::uint64_t end) { blocks_.push_back({begin, end}); }
  void finish() {
    std::sort(blocks_.begin(), blocks_.end());
    std::size_t out = 0;
    for (const auto& b : blocks_) {
      if (out > 0 && b.first <= blocks_[out - 1].second) {
        blocks_[out - 1].second = std::max(blocks_[out - 1].second, b.second);
      } else {
        blocks_[out++] = b;
      }
    }
    blocks_.resize(out);
  }
  bool overlaps(std::uint64_t begin, std::uint64_t end) const {
    // The last block starting before `end` is the only candidate (blocks are disjoint).
    auto it =
        std::lower_bound(blocks_.begin(), blocks_.end(), end,
                         [](const std::pair<std::uint64_t, std::uint64_t>& b, std::uint64_t x) { return b.first < x; });
    return it != blocks_.begin() && std::prev(it)->second > begin;
  }

 private:
  std::vector<std::pair<std::uint64_t, std::uint64_t>> blocks_;
};

}  // namespace

std::vector<std::vector<NodeId>> cross_lane_dependencies(std::span<const Lane> lanes,
                                                         const std::vector<std::vector<ByteAccess>>& accesses) {
  if (accesses.size() != lanes.size()) {
    throw std::invalid_argument(
        fmt::format("cross_lane_dependencies: {} nodes but {} access lists", lanes.size(), accesses.size()));
  }
  for (Lane l : lanes) {
    if (static_cast<int>(l) >= lanes_max) {
      throw std::invalid_argument("cross_lane_dependencies: unknown lane");
    }
  }
  // Positions are doubled so that empty ranges behave as in the scan this replaced: a range
  // [b, e) becomes [2b + 1, 2e) and an empty range [x, x) the unit [2x, 2x + 1), which meets a
  // range exactly when b < x < e. Two empty ranges never conflict, so they are recorded apart
  // (`points`), where only non-empty ranges look.
  struct Span {
    std::uint64_t lo, hi;
    bool point;
  };
  auto span_of = [](const ByteAccess& a) {
    return a.begin < a.end ? Span{2 * a.begin + 1, 2 * a.end, false} : Span{2 * a.begin, 2 * a.begin + 1, true};
  };
  for (const auto& acc : accesses) {
    for (const ByteAccess& a : acc) {
      if (a.begin > a.end || a.end > std::numeric_limits<std::uint64_t>::max() / 2 - 1) {
        throw std::invalid_argument(fmt::format("cross_lane_dependencies: bad byte range [{}, {})", a.begin, a.end));
      }
    }
  }

  // Only accesses that can meet another lane's take part in the sweep. Every access of a lane
  // other than the busiest one does; an access of the busiest lane (compute) does only if its
  // bytes meet what some other lane touches anywhere in the step. In a resident step that
  // leaves out nearly everything: only the batch, the statistics and what reuses their bytes
  // meet the copy lanes. (Sweeping more accesses than needed would give the same result.)
  std::array<std::size_t, lanes_max> per_lane{};
  for (std::size_t id = 0; id < lanes.size(); ++id) per_lane[static_cast<int>(lanes[id])] += accesses[id].size();
  const int busiest = static_cast<int>(std::max_element(per_lane.begin(), per_lane.end()) - per_lane.begin());
  std::unordered_map<std::uint32_t, std::uint32_t> dense;  // space -> index
  std::uint32_t last_space = 0, last_index = 0;
  bool cached = false;
  auto index_of = [&](std::uint32_t space) {
    if (cached && space == last_space) return last_index;
    auto [it, fresh] = dense.try_emplace(space, static_cast<std::uint32_t>(dense.size()));
    cached = true;
    last_space = space;
    last_index = it->second;
    return last_index;
  };
  std::vector<ByteUnion> others;  // per space: what the lanes other than the busiest touch
  for (std::size_t id = 0; id < lanes.size(); ++id) {
    if (static_cast<int>(lanes[id]) == busiest) continue;
    for (const ByteAccess& a : accesses[id]) {
      const std::uint32_t s = index_of(a.space);
      if (s >= others.size()) others.resize(s + 1);
      const Span x = span_of(a);
      others[s].add(x.lo, x.hi);
    }
  }
  for (auto& u : others) u.finish();
  auto takes_part = [&](int lane, std::uint32_t s, const Span& x) {
    return lane != busiest || (s < others.size() && others[s].overlaps(x.lo, x.hi));
  };

  struct Marks {
    Space ranges, points;
  };
  std::vector<Marks> spaces;
  std::vector<std::vector<NodeId>> deps(lanes.size());
  struct Part {
    std::uint32_t space;
    Span span;
    bool write;
  };
  std::vector<Part> part;  // this node's accesses that take part
  for (std::size_t id = 0; id < lanes.size(); ++id) {
    const int lane = static_cast<int>(lanes[id]);
    part.clear();
    for (const ByteAccess& a : accesses[id]) {
      const std::uint32_t s = index_of(a.space);
      const Span x = span_of(a);
      if (!takes_part(lane, s, x)) continue;
      if (s >= spaces.size()) spaces.resize(s + 1);
      part.push_back({s, x, a.write});
    }
    if (part.empty()) continue;
    std::array<std::uint32_t, lanes_max> latest{};
    for (const Part& p : part) {
      spaces[p.space].ranges.query(p.span.lo, p.span.hi, p.write, latest);
      if (!p.span.point) spaces[p.space].points.query(p.span.lo, p.span.hi, p.write, latest);
    }
    for (int other = 0; other < lanes_max; ++other) {
      if (other != lane && latest[other] != 0) deps[id].push_back(latest[other] - 1);
    }
    const auto mark = static_cast<std::uint32_t>(id + 1);
    for (const Part& p : part) {
      Marks& m = spaces[p.space];
      (p.span.point ? m.points : m.ranges).record(p.span.lo, p.span.hi, p.write, lane, mark);
    }
  }
  return deps;
}

}  // namespace ferry::graph
