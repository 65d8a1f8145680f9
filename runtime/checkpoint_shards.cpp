// A ZeRO checkpoint's optimizer state cut anew for another number of ranks or another stage
// (runtime/checkpoint_shards.hpp).
#include "checkpoint_shards.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>

#include "ferry/ops/op_table.hpp"
#include "ferry/runtime/distributed.hpp"
#include "graph/autodiff.hpp"

namespace ferry::detail {

namespace {

// How a state tensor lies along its weight's elements: `rows` rows of units of `per` elements
// each (1: one state element per weight element; the 8-bit optimizer's scales: one per block).
struct Layout {
  std::size_t rows = 1, per = 1;
};

// The units of weight elements [first, first + count): whole units, since shares are cut on
// multiples of the granule, itself a multiple of every unit.
std::size_t units_of(std::size_t count, std::size_t per) {
  return (count + per - 1) / per;
}

// The layout of the state `decl` declares, found from the declaration for one granule.
Layout layout_of(const ops::OpInfo& row, const ops::OptimizerConfig& optimizer, std::size_t decl_index,
                 std::size_t granule) {
  const ops::OptimizerStateDecl d = row.optimizer_state(optimizer, granule)[decl_index];
  if (!d.shape) return {};
  const std::uint32_t last = d.shape->dims[d.shape->rank - 1];
  if (last == 0 || granule % last != 0) {
    throw std::logic_error(fmt::format("optimizer state '{}' is not cut along its weight's elements", d.suffix));
  }
  return {d.shape->elems() / last, granule / last};
}

// Why file `file` holds `found` elements of a state where it should hold another count: a lone
// file may be rank 0's share of a checkpoint k ranks wrote, whose other files are missing.
std::string wrong_share_hint(graph::VariantKey written, const ops::OptimizerConfig& optimizer, const Layout& layout,
                             std::size_t elems, std::size_t ordinal, std::size_t found,
                             const std::filesystem::path& file, std::size_t files) {
  for (std::uint32_t k = 2; files == 1 && k <= 1024; ++k) {
    written.rank = 0;
    written.ranks = k;
    written.zero_stage = 1;
    const graph::ZeroSharding z = graph::zero_sharding(written, optimizer);
    const ops::ShardRange r0 = ops::zero_shard(elems, ordinal, 0, k, z.granule);
    if (r0.count == 0 || layout.rows * units_of(r0.count, layout.per) != found) continue;
    const std::string others = k == 2 ? fmt::format("file '{}.rank1' is", file.string())
                                      : fmt::format("files '{0}.rank1' to '{0}.rank{1}' are", file.string(), k - 1);
    return fmt::format(
        ": it holds rank 0's share of a checkpoint {} ranks wrote at ZeRO stage 1 or 2, whose other {} missing: "
        "restore {}",
        k, others, k == 2 ? "it" : "them");
  }
  return fmt::format(
      ": the files given are not the {} of one checkpoint (a file missing, or one left from another run?)",
      files > 1 ? fmt::format("{} shares", files) : std::string("whole state"));
}

}  // namespace

ReshardedState::ReshardedState(const graph::Graph& training, const graph::VariantKey& key,
                               const ops::OptimizerConfig& optimizer, std::uint32_t global_batch,
                               std::span<const std::filesystem::path> files, std::span<const ckpt::Contents> contents)
    : training_(training), sources_(training.tensors.size()) {
  const auto& t = training.tensors;
  const std::size_t n = files.size();
  // Each file's tensors by name.
  std::vector<std::map<std::string, std::size_t>> by_name(n);
  for (std::size_t f = 0; f < n; ++f) {
    const auto& tensors = contents[f].fingerprint.tensors;
    for (std::size_t i = 0; i < tensors.size(); ++i) by_name[f][tensors[i].name] = i;
  }
  const auto find = [&](std::size_t f, const std::string& name, std::uint8_t dtype) {
    const auto it = by_name[f].find(name);
    if (it == by_name[f].end()) {
      throw std::invalid_argument(fmt::format(
          "checkpoint file '{}' has no tensor '{}': it is not {} of a checkpoint of this model and optimizer; the "
          "trainer was not changed",
          files[f].string(), name, n > 1 ? fmt::format("rank {}'s share", f) : std::string("the whole state")));
    }
    if (contents[f].fingerprint.tensors[it->second].dtype != dtype) {
      throw std::invalid_argument(
          fmt::format("checkpoint file '{}' holds '{}' as {}, this trainer as {}; the "
                      "trainer was not changed",
                      files[f].string(), name,
                      graph::dtype_name(static_cast<graph::DType>(contents[f].fingerprint.tensors[it->second].dtype)),
                      graph::dtype_name(static_cast<graph::DType>(dtype))));
    }
    return it->second;
  };
  // Whole tensors, the same shape in every file they come from: weights and predictor state from
  // the first, gradient sums from each (its rank's, weighted by that rank's share of the batch).
  const auto whole = [&](std::size_t f, graph::TensorId id) {
    const std::size_t i = find(f, t.name[id], static_cast<std::uint8_t>(t.dtype[id]));
    if (!(contents[f].fingerprint.tensors[i].shape == t.shape[id])) {
      throw std::invalid_argument(fmt::format(
          "checkpoint file '{}' holds '{}' as {}, this trainer as {}; the trainer "
          "was not changed: load it into the model that wrote it",
          files[f].string(), t.name[id], contents[f].fingerprint.tensors[i].shape.str(), t.shape[id].str()));
    }
    return i;
  };
  for (graph::TensorId id = 0; id < t.size(); ++id) {
    const graph::Role role = t.role[id];
    if (role != graph::Role::weight && role != graph::Role::predictor_state && role != graph::Role::gradient_sum) {
      continue;
    }
    if (t.alias_of[id] != graph::no_tensor) continue;
    Source& s = sources_[id];
    s.units = t.shape[id].elems();
    if (role != graph::Role::gradient_sum) {
      s.pieces.push_back({0, whole(0, id), 0, s.units});
      continue;
    }
    if (t.dtype[id] != graph::DType::f32)
      throw std::logic_error(fmt::format("gradient sum '{}' is not f32", t.name[id]));
    s.weighted_sum = true;
    for (std::size_t f = 0; f < n; ++f) {
      const Shard rows = shard_of(global_batch, static_cast<int>(f), static_cast<int>(n));
      const double weight = n == 1 ? 1.0 : static_cast<double>(rows.count) / global_batch;
      s.pieces.push_back({f, whole(f, id), 0, s.units, weight});
    }
  }
  // The optimizer state: this trainer's share of each weight from the files' shares.
  const ops::OpInfo& row = ops::op_info(ops::update_row(optimizer.kind));
  const graph::ZeroSharding mine = graph::zero_sharding(key, optimizer);
  graph::VariantKey written = key;
  written.ranks = static_cast<std::uint32_t>(n);
  written.zero_stage = n > 1 ? 1 : 0;
  const std::vector<graph::ZeroShare> my_shares = graph::zero_shares(training, mine);
  std::map<std::string, graph::TensorId> states;  // this trainer's optimizer state by name
  for (graph::TensorId x = 0; x < t.size(); ++x) {
    if (t.role[x] == graph::Role::optimizer_state) states[t.name[x]] = x;
  }
  for (std::size_t ordinal = 0; ordinal < my_shares.size(); ++ordinal) {
    const graph::TensorId w = my_shares[ordinal].weight;
    const ops::ShardRange my = my_shares[ordinal].range;
    if (my.count == 0) continue;  // another rank's: this trainer keeps no state of it
    const std::size_t elems = t.shape[w].elems();
    const auto decls = row.optimizer_state(optimizer, my.count);
    for (std::size_t d = 0; d < decls.size(); ++d) {
      if (decls[d].is_gradient) continue;
      const std::string name = t.name[w] + decls[d].suffix;
      const auto it = states.find(name);
      if (it == states.end()) throw std::logic_error(fmt::format("no optimizer state tensor '{}'", name));
      const graph::TensorId id = it->second;
      const Layout layout = layout_of(row, optimizer, d, graph::zero_sharding(written, optimizer).granule);
      Source& s = sources_[id];
      s.rows = layout.rows;
      s.first = my.first / layout.per;
      s.units = units_of(my.count, layout.per);
      for (std::size_t f = 0; f < n; ++f) {
        written.rank = static_cast<std::uint32_t>(f);
        const graph::ZeroSharding theirs = graph::zero_sharding(written, optimizer);
        const ops::ShardRange r = theirs.sharded()
                                      ? ops::zero_shard(elems, ordinal, theirs.rank, theirs.ranks, theirs.granule)
                                      : ops::ShardRange{0, elems};
        if (r.count == 0) continue;
        const std::size_t i = find(f, name, static_cast<std::uint8_t>(decls[d].dtype));
        const std::size_t units = units_of(r.count, layout.per);
        const auto& ft = contents[f].fingerprint.tensors[i];
        if (ft.shape.elems() != layout.rows * units) {
          const std::string hint =
              wrong_share_hint(written, optimizer, layout, elems, ordinal, ft.shape.elems(), files[f], n);
          throw std::invalid_argument(fmt::format(
              "checkpoint file '{}' holds {} elements of '{}', where {} would hold {}{}; the trainer was not changed",
              files[f].string(), ft.shape.elems(), name,
              n > 1 ? fmt::format("rank {} of {}", f, n) : std::string("a whole-state checkpoint"), layout.rows * units,
              hint));
        }
        s.pieces.push_back({f, i, r.first / layout.per, units});
      }
    }
  }
}

std::vector<std::byte> ReshardedState::value(graph::TensorId id, const Read& read) const {
  const Source& s = sources_[id];
  if (s.weighted_sum) return weighted_sum(id, s, read);
  const auto& t = training_.tensors;
  const std::size_t size = graph::dtype_bytes(t.dtype[id]);
  std::vector<std::byte> out(t.bytes(id));
  if (s.pieces.empty() || out.size() != s.rows * s.units * size) {
    throw std::logic_error(fmt::format("no way to load tensor '{}' from the checkpoint's files", t.name[id]));
  }
  std::size_t covered = 0;
  for (const Piece& p : s.pieces) {
    const std::size_t from = std::max(p.first, s.first), to = std::min(p.first + p.units, s.first + s.units);
    if (from >= to) continue;
    const std::span<const std::byte> bytes = read(p.file, p.index);
    for (std::size_t row = 0; row < s.rows; ++row) {
      std::memcpy(out.data() + (row * s.units + from - s.first) * size,
                  bytes.data() + (row * p.units + from - p.first) * size, (to - from) * size);
    }
    covered += to - from;
  }
  if (covered != s.units) {
    throw std::logic_error(
        fmt::format("the checkpoint's shares cover {} of the {} units of '{}'", covered, s.units, t.name[id]));
  }
  return out;
}

std::vector<std::byte> ReshardedState::weighted_sum(graph::TensorId id, const Source& s, const Read& read) const {
  std::vector<double> sum(s.units, 0.0);
  std::vector<float> values(s.units);
  for (const Piece& p : s.pieces) {
    const std::span<const std::byte> bytes = read(p.file, p.index);
    if (bytes.size() != s.units * sizeof(float)) {
      throw std::logic_error(fmt::format("gradient sum '{}' of file {} has {} bytes, not {}",
                                         training_.tensors.name[id], p.file, bytes.size(), s.units * sizeof(float)));
    }
    std::memcpy(values.data(), bytes.data(), bytes.size());
    for (std::size_t i = 0; i < s.units; ++i) sum[i] += p.weight * static_cast<double>(values[i]);
  }
  for (std::size_t i = 0; i < s.units; ++i) values[i] = static_cast<float>(sum[i]);
  std::vector<std::byte> out(s.units * sizeof(float));
  std::memcpy(out.data(), values.data(), out.size());
  return out;
}

void group_sums_for_rank(std::span<std::byte> sums, int rank, double share) {
  if (sums.size() % sizeof(float) != 0) throw std::logic_error("gradient sums that are not whole floats");
  std::vector<float> values(sums.size() / sizeof(float));
  std::memcpy(values.data(), sums.data(), sums.size());
  for (float& v : values) v = rank == 0 ? static_cast<float>(static_cast<double>(v) / share) : 0.0f;
  std::memcpy(sums.data(), values.data(), sums.size());
}

}  // namespace ferry::detail
