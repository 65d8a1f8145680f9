// ferry-bench allreduce: what data-parallel training moves and how much of it backward hides.
//
// Run alone (N = 1) or under `mpirun -np N ferry-bench allreduce`: each rank trains the MLP
// (784-1024-1024-10 by default, or --hidden) on its share of random global batches, with profiling
// on, and rank 0 prints one JSON line per run with
//   - the gradient bytes each rank sums per step and the bytes a ring all-reduce (and, at ZeRO
//     stage 1, the all-gather of the weights) sends per rank, against ZeRO's published volume;
//   - from the step's timeline: the host-lane time of the collectives (`comm_ms`), the part of it
//     during which the compute lane was busy (`hidden_ms`: communication hidden behind backward)
//     and the compute lane's busy time;
//   - a model for N = 1 ... --max-ranks at --link-gbps: each rank's bytes over the link rate
//     against the measured backward time, so the exposed time at larger N is
//     max(0, communication - backward).
// Alone, there is nothing to reduce: the line says so (comm_ms 0) and the model still prints.
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <random>
#include <vector>

#include "bench.hpp"
#include "ferry/ferry.hpp"
#include "runtime/cli/validators.hpp"
#include "runtime/trainer_internals.hpp"

namespace ferry::bench {
namespace {

struct AllreduceOptions {
  std::vector<std::uint32_t> hidden{1024, 1024};
  std::uint32_t batch = 256;  // the global batch
  int steps = 10;
  int zero = 0;
  std::string bucket = "25MiB";
  double link_gbps = 12.5;  // 100 Gb/s
  int max_ranks = 64;
};

struct Interval {
  std::uint64_t begin, end;
};

// Total length of the union of `v`.
std::uint64_t union_length(std::vector<Interval> v) {
  std::sort(v.begin(), v.end(), [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  std::uint64_t total = 0, open = 0, close = 0;
  bool any = false;
  for (const Interval& i : v) {
    if (!any || i.begin > close) {
      if (any) total += close - open;
      open = i.begin;
      close = i.end;
      any = true;
    } else {
      close = std::max(close, i.end);
    }
  }
  if (any) total += close - open;
  return total;
}

// Length of `x` covered by the union of `busy`.
std::uint64_t covered(const Interval& x, const std::vector<Interval>& busy) {
  std::vector<Interval> parts;
  for (const Interval& b : busy) {
    const std::uint64_t lo = std::max(x.begin, b.begin), hi = std::min(x.end, b.end);
    if (lo < hi) parts.push_back({lo, hi});
  }
  return union_length(std::move(parts));
}

bool is_collective(const graph::TimelineEntry& e) {
  return e.op == "grad_allreduce" || e.op == "grad_reduce_scatter" || e.op == "weight_allgather";
}

int run_allreduce(const BenchCommon& common, const AllreduceOptions& o) {
  std::shared_ptr<ops::Communicator> world;
  if (launched_by_mpi()) world = mpi_world();
  const int n = world ? world->size() : 1, rank = world ? world->rank() : 0;
  try {
    Runtime runtime({.device = common.device, .local_rank = world ? local_rank() : 0, .profiling = true});
    const Shard shard = shard_of(o.batch, rank, n);
    TrainerOptions opt;
    opt.batch = shard.count;
    if (n > 1) opt.data_parallel = {world, o.batch, parse_bytes(o.bucket), o.zero};
    const ModelSpec model = models::mlp(o.hidden);
    Trainer trainer(runtime, model, opt);
    const std::size_t sample = model.inputs[0].sample.elems();
    std::vector<double> step_ms, comm_ms, hidden_ms, compute_ms;
    for (int s = 0; s < o.steps + 1; ++s) {
      // The same global batch on every rank, each taking its rows (as ferry train does).
      std::vector<float> images(std::size_t(o.batch) * sample);
      std::mt19937 rng(static_cast<std::uint32_t>(7 + s));
      std::normal_distribution<float> normal;
      for (float& x : images) x = normal(rng);
      std::vector<std::int32_t> labels(o.batch);
      for (std::uint32_t i = 0; i < o.batch; ++i) labels[i] = static_cast<std::int32_t>((i * 7 + s) % 10);
      const auto mine = std::span(images).subspan(std::size_t(shard.first) * sample, std::size_t(shard.count) * sample);
      const auto my_labels = std::span(labels).subspan(shard.first, shard.count);
      const StepResult r = trainer.step(Batch{{"input", HostView(mine)}, {"labels", HostView(my_labels)}});
      if (s == 0) continue;  // program builds, first touch
      std::vector<Interval> compute;
      std::vector<Interval> comm;
      for (const auto& e : compiled_train_step(trainer).timeline()) {
        if (e.end_ns <= e.start_ns) continue;
        if (e.lane == ops::Lane::compute) compute.push_back({e.start_ns, e.end_ns});
        if (is_collective(e)) comm.push_back({e.start_ns, e.end_ns});
      }
      std::uint64_t hidden = 0;
      for (const Interval& c : comm) hidden += covered(c, compute);
      step_ms.push_back(r.step_ms);
      comm_ms.push_back(static_cast<double>(union_length(comm)) * 1e-6);
      hidden_ms.push_back(static_cast<double>(hidden) * 1e-6);
      compute_ms.push_back(static_cast<double>(union_length(compute)) * 1e-6);
    }
    if (rank != 0) return 0;
    const double psi = static_cast<double>(trainer.weight_bytes());  // Ψ: fp32 gradient (= weight) bytes
    // Per rank and step: a ring all-reduce sends 2 (N-1)/N Ψ; ZeRO stage 1 here adds the
    // all-gather of the weights, (N-1)/N Ψ; stage 2 reduce-scatters the gradients instead of
    // all-reducing them, (N-1)/N Ψ, then all-gathers. ZeRO's paper: stages 1 and 2 move 2Ψ
    // (reduce-scatter plus all-gather), stage 3 3Ψ.
    const auto ferry_bytes = [&](int ranks) {
      const double f = ranks > 1 ? static_cast<double>(ranks - 1) / ranks : 0.0;
      return f * psi * (o.zero == 1 ? 3.0 : 2.0);
    };
    const auto zero_bytes = [&](int ranks) {
      return (ranks > 1 ? static_cast<double>(ranks - 1) / ranks : 0.0) * psi * 2.0;
    };
    const double compute = median(compute_ms);
    nlohmann::json model_rows = nlohmann::json::array();
    for (int ranks = 1; ranks <= o.max_ranks; ranks *= 2) {
      const double ms = ferry_bytes(ranks) / (o.link_gbps * 1e6);
      model_rows.push_back({{"ranks", ranks},
                            {"bytes_sent_per_rank", ferry_bytes(ranks)},
                            {"zero_paper_bytes_per_rank", zero_bytes(ranks)},
                            {"comm_ms_at_link", ms},
                            {"exposed_ms_behind_compute", std::max(0.0, ms - compute)}});
    }
    const double comm = median(comm_ms), hidden = median(hidden_ms);
    emit_json({{"bench", "allreduce"},
               {"device", runtime.device().name},
               {"transport", world ? world->name() : "none (one rank)"},
               {"world_size", n},
               {"zero_stage", o.zero},
               {"batch", o.batch},
               {"bucket_size", o.bucket},
               {"parameters", trainer.parameter_count()},
               {"gradient_bytes", trainer.gradient_bytes()},
               {"allreduce_bytes_per_step", trainer.allreduce_bytes_per_step()},
               {"bytes_sent_per_rank_per_step", ferry_bytes(n)},
               {"zero_paper_bytes_per_rank_per_step", zero_bytes(n)},
               {"step_ms", median(step_ms)},
               {"compute_ms", compute},
               {"comm_ms", comm},
               {"hidden_ms", hidden},
               {"hidden_fraction", comm > 0 ? hidden / comm : 0.0},
               {"steps", o.steps},
               {"link_gbps", o.link_gbps},
               {"model", model_rows}});
    return 0;
  } catch (const std::exception& e) {
    if (!world || n < 2) throw;
    fmt::print(stderr, "ferry-bench allreduce: error on rank {} of {}: {}\n", rank, n, e.what());
    world->abort(1);
  }
  return 1;  // (abort does not return)
}

BenchRun setup(CLI::App& sub, const BenchCommon& common) {
  auto o = std::make_shared<AllreduceOptions>();
  sub.add_option("--hidden", o->hidden, "hidden widths of the MLP (784-...-10)")->check(CLI::PositiveNumber);
  sub.add_option("--batch", o->batch, "global batch over all ranks")->capture_default_str()->check(CLI::PositiveNumber);
  sub.add_option("--steps", o->steps, "timed steps (after one untimed)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub.add_option("--zero", o->zero, "ZeRO stage (0, 1 or 2)")->capture_default_str()->check(CLI::Range(0, 2));
  sub.add_option("--bucket-size", o->bucket, "gradient bytes reduced together")->capture_default_str();
  sub.add_option("--link-gbps", o->link_gbps, "link rate of the model for larger N, GB/s")
      ->capture_default_str()
      ->check(ferry::cli::positive_number());
  sub.add_option("--max-ranks", o->max_ranks, "largest N of the model (powers of two)")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  return [o, &common] { return run_allreduce(common, *o); };
}

FERRY_BENCH("allreduce",
            "data parallel (run under mpirun -np N): bytes per rank and step, communication hidden behind backward, "
            "and a model of N up to 64",
            setup);

}  // namespace
}  // namespace ferry::bench
