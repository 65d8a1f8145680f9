// ferry-bench compress: how small and how fast are real optimizer moments in the compressed home?
//
// Trains the reference MLP (784-1024-1024-10) on Fashion-MNIST for --steps steps (batch 256,
// lr 1e-3) with fp32 Adam and/or 8-bit AdamW, reads the optimizer state it ends with and
// concatenates the first moments (m) into one byte array and the second moments (v) into another
// (8-bit: the u8 codes with element size 1, and each moment's row of the fp32 block scales with
// element size 4). Each moment is then compressed by ferry's codec (byte-plane shuffle, then zstd
// per chunk with a content checksum) on one core (workers = 1), beside its baseline in the same
// run: plain zstd on the unshuffled bytes, the same level, chunk size and checksum. Reported: the
// ratios (raw / compressed) and the compress and decompress throughput per core (median over
// --repeat blocks of at least 5 calls each). Both round trips must be bit-exact, or the benchmark
// fails.
#include <fmt/format.h>

#include <algorithm>
#include <iostream>
#include <numeric>
#include <random>

#include "bench.hpp"
#include "ferry/ferry.hpp"
#include "ferry/offload/chunk_codec.hpp"
#include "runtime/cli/validators.hpp"

namespace ferry::bench {
namespace {

struct CompressBenchOptions {
  std::uint32_t steps = 300, batch = 256;
  std::string optimizer;  // adam, adamw8bit; empty: both
  int level = 1;
  std::string chunk = "1MiB";
  int inner = 5;           // calls per timed block
  std::uint64_t seed = 1;  // weight initialisation and the order of the training samples
};

// One run of bytes of a single element size; a moment is one or more of them.
struct Part {
  std::vector<std::byte> bytes;
  std::size_t elem_bytes = 4;
};

struct Moments {
  std::vector<Part> m, v;
};

void append(std::vector<std::byte>& to, std::span<const std::byte> from) {
  to.insert(to.end(), from.begin(), from.end());
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Trains and returns the optimizer's moments as stored, in tensor order.
Moments trained_moments(Runtime& rt, const Dataset& data, const CompressBenchOptions& o,
                        ops::OptimizerConfig::Kind kind) {
  TrainerOptions to;
  to.batch = o.batch;
  to.lr = 1e-3f;
  to.optimizer.kind = kind;
  to.seed = o.seed;
  Trainer trainer(rt, models::mlp(), to);
  ShuffledBatches batches(data, trainer.model(), o.batch, o.seed);  // a new order every epoch
  float loss = 0;
  for (std::uint32_t s = 0; s < o.steps; ++s) loss = trainer.step(batches.next()).loss;
  std::cerr << fmt::format("ferry-bench compress: {} trained {} steps, last loss {:.4f}\n", ops::optimizer_name(kind),
                           o.steps, loss);

  Part m{{}, 4}, v{{}, 4}, m_codes{{}, 1}, v_codes{{}, 1}, m_scales{{}, 4}, v_scales{{}, 4};
  for (const std::string& name : trainer.tensor_names()) {
    const bool fp32_m = ends_with(name, ".adam_m"), fp32_v = ends_with(name, ".adam_v");
    const bool codes_m = ends_with(name, ".adam8_m"), codes_v = ends_with(name, ".adam8_v");
    const bool scales = ends_with(name, ".adam8_scales");
    if (!(fp32_m || fp32_v || codes_m || codes_v || scales)) continue;
    const Trainer::HostTensor t = trainer.read_tensor(name);
    const std::span<const std::byte> b(t.bytes);
    if (fp32_m) append(m.bytes, b);
    if (fp32_v) append(v.bytes, b);
    if (codes_m) append(m_codes.bytes, b);
    if (codes_v) append(v_codes.bytes, b);
    if (scales) {  // [2, blocks]: row 0 scales m, row 1 scales v
      append(m_scales.bytes, b.first(b.size() / 2));
      append(v_scales.bytes, b.subspan(b.size() / 2));
    }
  }
  Moments out;
  for (Part* p : {&m, &m_codes, &m_scales}) {
    if (!p->bytes.empty()) out.m.push_back(std::move(*p));
  }
  for (Part* p : {&v, &v_codes, &v_scales}) {
    if (!p->bytes.empty()) out.v.push_back(std::move(*p));
  }
  if (out.m.empty() || out.v.empty()) {
    throw std::runtime_error(
        fmt::format("{} left no first and second moments among the persistent tensors", ops::optimizer_name(kind)));
  }
  return out;
}

struct Measured {
  std::uint64_t raw = 0, compressed = 0;
  double compress_s = 0, decompress_s = 0;  // one call over every part, median
};

// Compresses and decompresses every part of a moment with `codec`, `shuffle` choosing the parts'
// element sizes (true) or 1 (plain zstd on the bytes as they are); checks the round trip.
Measured measure(const offload::ChunkCodec& codec, const std::vector<Part>& parts, bool shuffle, int repeat, int inner,
                 const std::string& what) {
  Measured r;
  std::vector<offload::CompressedTensor> packed;
  std::vector<std::vector<std::byte>> back;
  auto compress_all = [&] {
    packed.clear();
    for (const Part& p : parts) packed.push_back(codec.compress(p.bytes, shuffle ? p.elem_bytes : 1, what));
  };
  auto decompress_all = [&] {
    for (std::size_t i = 0; i < parts.size(); ++i) codec.decompress(packed[i], back[i], what);
  };
  for (const Part& p : parts) {
    back.emplace_back(p.bytes.size());
    r.raw += p.bytes.size();
  }
  compress_all();  // warm-up: thread-local contexts and scratch
  decompress_all();
  std::vector<double> c_ms, d_ms;
  for (int k = 0; k < repeat; ++k) {
    c_ms.push_back(time_ms([&] {
                     for (int i = 0; i < inner; ++i) compress_all();
                   }) /
                   inner);
    d_ms.push_back(time_ms([&] {
                     for (int i = 0; i < inner; ++i) decompress_all();
                   }) /
                   inner);
  }
  for (std::size_t i = 0; i < parts.size(); ++i) {
    r.compressed += packed[i].compressed_bytes();
    std::fill(back[i].begin(), back[i].end(), std::byte{0x5a});
  }
  decompress_all();
  for (std::size_t i = 0; i < parts.size(); ++i) {
    if (back[i] != parts[i].bytes) {
      throw std::runtime_error(
          fmt::format("{}: the {} round trip is not bit-exact", what, shuffle ? "shuffled" : "plain zstd"));
    }
  }
  r.compress_s = median(c_ms) / 1e3;
  r.decompress_s = median(d_ms) / 1e3;
  return r;
}

const std::vector<std::string> optimizer_names = {"adam", "adamw8bit"};

double gbps(std::uint64_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
}

int run_compress(const BenchCommon& common, const CompressBenchOptions& o) {
  using Kind = ops::OptimizerConfig::Kind;
  std::vector<Kind> kinds;
  if (o.optimizer.empty() || o.optimizer == "adam") kinds.push_back(Kind::adam);
  if (o.optimizer.empty() || o.optimizer == "adamw8bit") kinds.push_back(Kind::adamw8bit);
  if (kinds.empty()) {
    throw std::invalid_argument(fmt::format("--optimizer {}: use adam or adamw8bit (default: both)", o.optimizer));
  }
  offload::CodecOptions co;
  co.chunk_bytes = parse_bytes(o.chunk);
  co.level = o.level;
  co.workers = 1;  // one core: throughput per core
  const offload::ChunkCodec codec(co);
  const int inner = std::max(o.inner, 5);

  Runtime rt({.device = common.device});
  const Dataset data = load_fashion_mnist(default_fashion_mnist_dir(), Split::train);
  for (Kind kind : kinds) {
    const std::string optimizer = ops::optimizer_name(kind);
    std::cerr << fmt::format("ferry-bench compress: training {} with {} on {}...\n", models::mlp().name, optimizer,
                             rt.device().name);
    const Moments moments = trained_moments(rt, data, o, kind);
    for (const auto& [moment, parts] : {std::pair{"m", &moments.m}, std::pair{"v", &moments.v}}) {
      const std::string what = fmt::format("{} {}", optimizer, moment);
      const Measured ours = measure(codec, *parts, true, common.repeat, inner, what);
      const Measured plain = measure(codec, *parts, false, common.repeat, inner, what);
      const double shuffled_ratio = double(ours.raw) / double(ours.compressed);
      const double plain_ratio = double(plain.raw) / double(plain.compressed);
      std::vector<std::size_t> elems;
      for (const Part& p : *parts) elems.push_back(p.elem_bytes);
      emit_json({{"name", "compress"},
                 {"device", rt.device().name},
                 {"model", models::mlp().name},
                 {"optimizer", optimizer},
                 {"moment", moment},
                 {"steps", o.steps},
                 {"seed", o.seed},
                 {"batch", o.batch},
                 {"bytes", ours.raw},
                 {"elem_bytes", elems},
                 {"level", co.level},
                 {"chunk_bytes", co.chunk_bytes},
                 {"workers", co.workers},
                 {"repeat", common.repeat},
                 {"inner", inner},
                 {"compressed_bytes", ours.compressed},
                 {"plain_compressed_bytes", plain.compressed},
                 {"shuffled_ratio", shuffled_ratio},
                 {"plain_ratio", plain_ratio},
                 {"compress_gbps_per_core", gbps(ours.raw, ours.compress_s)},
                 {"decompress_gbps_per_core", gbps(ours.raw, ours.decompress_s)},
                 {"plain_compress_gbps_per_core", gbps(plain.raw, plain.compress_s)},
                 {"plain_decompress_gbps_per_core", gbps(plain.raw, plain.decompress_s)},
                 {"baseline", "plain zstd: the same level, chunk size and content checksum, bytes unshuffled"},
                 {"round_trip", "bit-exact"}});
      std::cerr << fmt::format(
          "  {} {}: {} -> {} (ratio {:.3f}; plain zstd {:.3f}), compress {:.2f} GB/s, decompress {:.2f} GB/s "
          "per core (plain zstd {:.2f} / {:.2f})\n",
          optimizer, moment, format_bytes(ours.raw), format_bytes(ours.compressed), shuffled_ratio, plain_ratio,
          gbps(ours.raw, ours.compress_s), gbps(ours.raw, ours.decompress_s), gbps(plain.raw, plain.compress_s),
          gbps(plain.raw, plain.decompress_s));
    }
  }
  return 0;
}

BenchRun setup(CLI::App& sub, const BenchCommon& common) {
  auto o = std::make_shared<CompressBenchOptions>();
  sub.add_option("--steps", o->steps, "training steps before the moments are read")
      ->capture_default_str()
      ->check(ferry::cli::positive_number());
  sub.add_option("--batch", o->batch, "samples per step")->capture_default_str()->check(ferry::cli::positive_number());
  sub.add_option("--optimizer", o->optimizer, "adam or adamw8bit (default: both)")
      ->check(CLI::IsMember(optimizer_names));
  sub.add_option("--level", o->level, "zstd level")->capture_default_str();
  sub.add_option("--chunk", o->chunk, "uncompressed bytes per chunk (e.g. 1MiB, 65536)")->capture_default_str();
  sub.add_option("--inner", o->inner, "calls per timed block (at least 5)")
      ->capture_default_str()
      ->check(ferry::cli::whole_number())
      ->check(CLI::Range(5, 1 << 20));
  sub.add_option("--seed", o->seed, "weight initialisation and sample order")
      ->capture_default_str()
      ->check(ferry::cli::whole_number());  // "-1" would wrap around
  return [&common, o] { return run_compress(common, *o); };
}

FERRY_BENCH("compress", "real Adam / 8-bit AdamW moments: ratio and GB/s per core, shuffled codec vs plain zstd",
            setup);

}  // namespace
}  // namespace ferry::bench
