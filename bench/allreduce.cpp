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
//     against the window a reduction can hide in, the compute lane's busy time from the moment
//     the first bucket's gradients are final to the end of backward (the forward before it and
//     the updates after it cannot hide a reduction: the updates read its sums), so the exposed
//     time at larger N is max(last bucket's reduction, reduction - window) (the last bucket is
//     final when backward ends), plus ZeRO's all-gather of the weights, which runs after the
//     updates with nothing left to hide behind.
// Alone, there is nothing to reduce: the line says so (comm_ms 0) and the model still prints.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <map>
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

// Where a reduction could hide in one step, from its timeline: the compute lane's busy time over
// backward (from its first node that writes a gradient to its last), and over the part of it
// after the first bucket is ready, and the last bucket's share of the gradient bytes (reduced after
// backward, so never hidden). Weight gradients are the tensors autodiff names "d<weight>"
// (f32 bytes, as data parallelism moves them), final at the end of the last compute node that
// writes one; buckets are consecutive runs of about `bucket_bytes` in the order they become
// final, as graph/passes/data_parallel.cpp forms them. Alone (N = 1) the same is the model's.
struct BackwardWindow {
  double backward_ms = 0, after_first_bucket_ms = 0, last_bucket_share = 1;
};

BackwardWindow backward_window(const graph::Graph& g, const std::vector<graph::TimelineEntry>& timeline,
                               std::uint64_t bucket_bytes) {
  const auto& t = g.tensors;
  std::map<std::string, graph::Role> role;
  std::map<std::string, std::uint64_t> weight_grad_bytes;
  for (graph::TensorId x = 0; x < t.size(); ++x) {
    role.emplace(t.name[x], t.role[x]);
    if (t.role[x] == graph::Role::weight && t.grad[x] != graph::no_tensor)
      weight_grad_bytes["d" + t.name[x]] = t.shape[x].elems() * sizeof(float);
  }
  std::vector<Interval> compute;
  std::uint64_t begin = UINT64_MAX, end = 0;
  std::map<std::string, std::uint64_t> final_at;  // weight gradient -> end of its last writer
  for (const auto& e : timeline) {
    if (e.lane != ops::Lane::compute || e.end_ns <= e.start_ns) continue;
    compute.push_back({e.start_ns, e.end_ns});
    for (const std::string& out : e.outputs) {
      const auto r = role.find(out);
      if (r == role.end() || r->second != graph::Role::gradient) continue;
      begin = std::min(begin, e.start_ns);
      end = std::max(end, e.end_ns);
      if (weight_grad_bytes.contains(out)) final_at[out] = std::max(final_at[out], e.end_ns);
    }
  }
  if (end <= begin || final_at.empty()) return {};
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ready;  // (final at, bytes), in that order
  for (const auto& [name, at] : final_at) ready.emplace_back(at, weight_grad_bytes[name]);
  std::sort(ready.begin(), ready.end());
  std::uint64_t first_bucket_ready = 0, bucket = 0, total = 0;  // bucket: the bytes of the one being filled
  for (std::size_t i = 0; i < ready.size(); ++i) {
    if (i > 0 && bucket + ready[i].second > bucket_bytes) {
      if (first_bucket_ready == 0) first_bucket_ready = ready[i - 1].first;
      bucket = 0;
    }
    bucket += ready[i].second;
    total += ready[i].second;
  }
  if (first_bucket_ready == 0) first_bucket_ready = ready.back().first;  // one bucket
  return {static_cast<double>(covered({begin, end}, compute)) * 1e-6,
          first_bucket_ready < end ? static_cast<double>(covered({first_bucket_ready, end}, compute)) * 1e-6 : 0.0,
          static_cast<double>(bucket) / static_cast<double>(total)};
}

int run_allreduce(const BenchCommon& common, const AllreduceOptions& o) {
  if (parse_bytes(o.bucket) == 0) {
    throw std::invalid_argument("--bucket-size 0: gradient buckets need at least one byte (default 25MiB)");
  }
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
    std::vector<double> step_ms, comm_ms, hidden_ms, compute_ms, backward_ms, window_ms;
    double last_bucket_share = 1;
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
      const auto timeline = compiled_train_step(trainer).timeline();
      for (const auto& e : timeline) {
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
      const BackwardWindow w = backward_window(compiled_train_step(trainer).graph(), timeline, parse_bytes(o.bucket));
      backward_ms.push_back(w.backward_ms);
      window_ms.push_back(w.after_first_bucket_ms);
      last_bucket_share = w.last_bucket_share;
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
    // The all-gather of ZeRO stages 1 and 2, (N-1)/N Ψ, after the updates: never hidden.
    const auto gather_bytes = [&](int ranks) {
      return o.zero == 0 || ranks < 2 ? 0.0 : static_cast<double>(ranks - 1) / ranks * psi;
    };
    const double compute = median(compute_ms), window = median(window_ms);
    nlohmann::json model_rows = nlohmann::json::array();
    for (int ranks = 1; ranks <= o.max_ranks; ranks *= 2) {
      const double ms = ferry_bytes(ranks) / (o.link_gbps * 1e6), gather = gather_bytes(ranks) / (o.link_gbps * 1e6);
      model_rows.push_back(
          {{"ranks", ranks},
           {"bytes_sent_per_rank", ferry_bytes(ranks)},
           {"zero_paper_bytes_per_rank", zero_bytes(ranks)},
           {"comm_ms_at_link", ms},
           {"exposed_ms_behind_compute", std::max((ms - gather) * last_bucket_share, ms - gather - window) + gather}});
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
               {"backward_ms", median(backward_ms)},
               {"backward_after_first_bucket_ms", window},
               {"last_bucket_share", last_bucket_share},
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
  sub.add_option("--hidden", o->hidden, "hidden widths of the MLP (784-...-10), comma-separated")
      ->delimiter(',')
      ->check(ferry::cli::positive_number());
  sub.add_option("--batch", o->batch, "global batch over all ranks")
      ->capture_default_str()
      ->check(ferry::cli::positive_number());
  sub.add_option("--steps", o->steps, "timed steps (after one untimed)")
      ->capture_default_str()
      ->check(ferry::cli::positive_number());
  sub.add_option("--zero", o->zero, "ZeRO stage (0, 1 or 2)")
      ->capture_default_str()
      ->check(ferry::cli::whole_number())
      ->check(CLI::Range(0, 2));
  sub.add_option("--bucket-size", o->bucket, "gradient bytes reduced together")->capture_default_str();
  sub.add_option("--link-gbps", o->link_gbps, "link rate of the model for larger N, GB/s")
      ->capture_default_str()
      ->check(ferry::cli::positive_number());
  sub.add_option("--max-ranks", o->max_ranks, "largest N of the model (powers of two)")
      ->capture_default_str()
      ->check(ferry::cli::whole_number())
      ->check(CLI::Range(1, 4096));
  return [o, &common] { return run_allreduce(common, *o); };
}

FERRY_BENCH("allreduce",
            "data parallel (run under mpirun -np N): bytes per rank and step, communication hidden behind backward, "
            "and a model of N up to 64",
            setup);

}  // namespace
}  // namespace ferry::bench
