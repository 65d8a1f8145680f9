// Device bytes by purpose (ferry/runtime/plan.hpp): the persistent parts equal the trainer's own
// counts, the total is the planned device peak, a Predict variant holds no gradients, and a
// streamed step keeps its weights off the device but their copies on it. The planner
// (plan_training) gives the figures a Trainer then allocates, and the host budget is checked
// before anything is allocated.
#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <stdexcept>

#include "classifier.hpp"
#include "ferry/ferry.hpp"
#include "ferry/runtime/plan.hpp"
#include "graph/schedule_estimate.hpp"
#include "idle_ranks.hpp"
#include "runtime/distributed/data_parallel.hpp"
#include "runtime/plan_search.hpp"
#include "runtime/trainer_internals.hpp"
#include "runtime/trainer_variants.hpp"
#include "test_models.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

TEST(Plan, ResidentBreakdownMatchesTheTrainer) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 16;
  Trainer t(rt, small_cnn(), o);
  const DeviceBreakdown b = device_breakdown(compiled_train_step(t), compiled_train_step(t));
  EXPECT_EQ(b.weights, t.weight_bytes());
  EXPECT_EQ(b.optimizer_state, t.optimizer_state_bytes());
  EXPECT_EQ(b.other_state, 0u);
  EXPECT_GT(b.gradients, 0u);
  EXPECT_GT(b.activations, 0u);
  EXPECT_EQ(b.streamed_copies, 0u);
  EXPECT_EQ(b.total, t.device_peak_bytes());
  // What is live at the peak fits in the step buffers.
  EXPECT_LE(b.gradients + b.activations + b.scratch, b.step_arena);
}

// A rate is a speed and a byte count a size: a negative or non-finite rate, and byte counts whose
// sum would wrap around, are refused rather than turned into a negative prediction or a plan that
// fits any budget.
TEST(Plan, RatesAndByteCountsOutOfRangeAreRefused) {
  Runtime rt;
  const std::pair<double PlanRates::*, const char*> fields[] = {
      {&PlanRates::host_gbps, "PlanRates::host_gbps"}, {&PlanRates::link_both_gbps, "PlanRates::link_both_gbps"}};
  for (const auto& [field, name] : fields) {
    for (const double bad : {-1.0, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
      PlanRates r;
      r.link_gbps = 10;
      r.*field = bad;
      try {
        plan_training(rt, small_mlp(), TrainerOptions{}, r);
        ADD_FAILURE() << "planned with " << name << " " << bad;
      } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
      }
    }
  }
  try {
    plan_training(rt, small_mlp(), TrainerOptions{}, {.link_gbps = 2, .link_d2h_gbps = 3, .link_both_gbps = 5.5});
    ADD_FAILURE() << "planned with both ways at once faster than each alone";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("PlanRates::link_both_gbps is 5.5"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("up to 5"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(
      plan_training(rt, small_mlp(), TrainerOptions{}, {.link_gbps = 2, .link_d2h_gbps = 3, .link_both_gbps = 5}));
  TrainingPlan p;
  p.host_bytes = std::numeric_limits<std::uint64_t>::max();
  p.host_compressed_bytes = 2;
  EXPECT_THROW(check_host_budget(p, 100, HostLimit::budget_if_given), HostBudgetError);
}

TEST(Plan, PredictHoldsNoGradientsAndStreamingMovesWeightsOff) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 16;
  o.phases.hybrid = true;
  Trainer t(rt, small_mlp(), o);
  const DeviceBreakdown full = device_breakdown(compiled_train_step(t), compiled_train_step(t));
  const DeviceBreakdown predict = device_breakdown(*compiled_predict_step(t), compiled_train_step(t));
  EXPECT_EQ(predict.gradients, 0u);
  EXPECT_GT(full.gradients, 0u);
  EXPECT_EQ(full.other_state, t.predictor_state_bytes());  // resident predictor state
  EXPECT_EQ(predict.optimizer_state, full.optimizer_state) << "resident state stays on the device in Predict";

  o.residency.mode = graph::ResidencyMode::stream;
  o.residency.budget_bytes = 64ull << 20;
  Trainer s(rt, small_mlp(), o);
  const DeviceBreakdown streamed = device_breakdown(compiled_train_step(s), compiled_train_step(s));
  EXPECT_EQ(streamed.weights, 0u);
  EXPECT_EQ(streamed.optimizer_state, 0u);
  EXPECT_GT(streamed.streamed_copies, 0u);
}

// The planner's figures against what a Trainer of the same options allocates: every phase's
// device breakdown, the device peak, the pinned host bytes and the bytes streamed per step.
void expect_plan_matches_trainer(Runtime& rt, const ModelSpec& model, const TrainerOptions& o) {
  const TrainingPlan plan = plan_training(rt, model, o);
  Trainer t(rt, model, o);
  // The plan's phases after the training step are the trainer's up-front variants, in order.
  const std::vector<detail::UpfrontVariant> upfront = detail::upfront_variants(t.options());
  std::vector<const graph::CompiledStep*> steps{&compiled_train_step(t)};
  for (const auto& [key, step] : compiled_variants(t)) steps.push_back(step.get());
  ASSERT_EQ(plan.phases.size(), steps.size());
  std::uint64_t peak = 0, host_step = 0;
  for (const auto* step : steps) {
    const auto it = std::find_if(plan.phases.begin(), plan.phases.end(), [&](const PhasePlan& p) {
      const auto i = static_cast<std::size_t>(&p - plan.phases.data());
      if (i == 0) return step == &compiled_train_step(t);
      const auto v = compiled_variants(t).find(upfront.at(i - 1).key);
      return v != compiled_variants(t).end() && v->second.get() == step;
    });
    ASSERT_NE(it, plan.phases.end());
    const DeviceBreakdown want = device_breakdown(*step, compiled_train_step(t)), got = it->device;
    EXPECT_EQ(got.weights, want.weights) << it->name;
    EXPECT_EQ(got.optimizer_state, want.optimizer_state) << it->name;
    EXPECT_EQ(got.other_state, want.other_state) << it->name;
    EXPECT_EQ(got.gradients, want.gradients) << it->name;
    EXPECT_EQ(got.activations, want.activations) << it->name;
    EXPECT_EQ(got.scratch, want.scratch) << it->name;
    EXPECT_EQ(got.streamed_copies, want.streamed_copies) << it->name;
    EXPECT_EQ(got.step_arena, want.step_arena) << it->name;
    EXPECT_EQ(got.total, step->device_bytes()) << it->name;
    // What the step allocated on the host: its pool and, when it runs ahead, the other slot's
    // batch mirrors (they were left out of the plan and the host budget).
    EXPECT_EQ(it->host_step_bytes, step->host_bytes()) << it->name;
    EXPECT_EQ(it->fetch_bytes, step->residency().fetch_bytes) << it->name;
    EXPECT_EQ(it->write_back_bytes, step->residency().write_back_bytes) << it->name;
    EXPECT_EQ(it->nodes, step->node_count()) << it->name;
    peak = std::max(peak, step->device_bytes());
    host_step += step->host_bytes();
  }
  EXPECT_EQ(plan.device_peak_bytes, peak);
  // Pinned host bytes: the stores' but the compressed home's chunks (ordinary memory, sized by the data).
  const auto& compressed = compiled_train_step(t).persistent()->homes[static_cast<int>(graph::Home::host_compressed)];
  const std::uint64_t pinned =
      compiled_train_step(t).persistent()->host_bytes() - (compressed ? compressed->host_bytes() : 0);
  EXPECT_EQ(plan.host_store_bytes, pinned);
  EXPECT_EQ(plan.host_step_bytes, host_step);
  EXPECT_EQ(plan.host_bytes, pinned + host_step);
  EXPECT_EQ(plan.host_restore_bytes, o.phases.hybrid ? t.weight_bytes() : 0u);
  EXPECT_EQ(plan.device_budget_bytes, t.device_budget_bytes());
  EXPECT_EQ(plan.mode, t.residency().mode);
}

TEST(Plan, PlannerAgreesWithTheTrainerResident) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 16;
  expect_plan_matches_trainer(rt, small_cnn(), o);
}

// The compressed home's chunks as planned hold what a run stores in them, whatever the chunk size:
// the plan had counted each tensor at its uncompressed size, which chunks of a few bytes exceed
// (each is a zstd frame with its header and checksum), so `--compress-chunk 1` held 4.25x the state
// under a host budget planned at 1x.
TEST(Plan, CompressedChunksAsPlannedHoldWhatTheRunStores) {
  Runtime rt;
  const ModelSpec m = small_mlp();
  const std::size_t sample = m.inputs[0].sample.elems();
  const std::vector<float> images = random_vector(8 * sample, 3, 0.0f, 1.0f);
  const std::vector<std::int32_t> labels = labels_for(8, 5);
  for (const std::size_t chunk : {std::size_t{16}, std::size_t{1} << 20}) {
    SCOPED_TRACE(fmt::format("{}-byte chunks", chunk));
    TrainerOptions o;
    o.batch = 8;
    o.optimizer.kind = ops::OptimizerConfig::Kind::adam;
    o.residency.state_home = graph::Home::host_compressed;
    o.residency.weights_home = graph::Home::host_compressed;  // random values: they hardly compress
    o.residency.homes.codec.chunk_bytes = chunk;
    const TrainingPlan plan = plan_training(rt, m, o);
    Trainer t(rt, m, o);
    for (int i = 0; i < 2; ++i) t.step(images, labels);
    const auto& store = compiled_train_step(t).persistent()->homes[static_cast<int>(graph::Home::host_compressed)];
    ASSERT_TRUE(store);
    EXPECT_GT(store->host_bytes(), 0u);
    EXPECT_LE(store->host_bytes(), plan.host_compressed_bytes);
    if (chunk == 16) {
      EXPECT_GT(store->host_bytes(), t.weight_bytes()) << "tiny chunks take more than the weights";
    }
  }
}

TEST(Plan, PlannerAgreesWithTheTrainerStreamedHybrid) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 16;
  o.phases.hybrid = true;
  o.phases.fit_every = 2;  // also the training variant without the predictor fit
  o.residency.mode = graph::ResidencyMode::stream;
  o.residency.budget_bytes = 64ull << 20;
  expect_plan_matches_trainer(rt, small_mlp(), o);
  const TrainingPlan plan = plan_training(rt, small_mlp(), o);
  EXPECT_GT(plan.host_store_bytes, 0u) << "streamed state lives in pinned host memory";
  EXPECT_GT(plan.phases.front().fetch_bytes, 0u);
  // One host copy of the state with hybrid phases too: the predictor's state is all they add to
  // the stores (each of its tensors placed at the plan's alignment; the restore point apart).
  TrainerOptions full = o;
  full.phases = {};
  const TrainingPlan full_plan = plan_training(rt, small_mlp(), full);
  EXPECT_EQ(full_plan.host_restore_bytes, 0u);
  Trainer t(rt, small_mlp(), o);
  const std::uint64_t added = plan.host_store_bytes - full_plan.host_store_bytes;
  const std::uint64_t predictor_tensors = 2 * t.parameter_names().size();  // d and the statistics
  EXPECT_GE(added, t.predictor_state_bytes());
  EXPECT_LE(added, t.predictor_state_bytes() + predictor_tensors * graph::MemoryPlanOptions{}.alignment);
}

TEST(Plan, PlannerAgreesWithTheTrainerAccumulatedCompressedState) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 8;
  o.accumulate = 2;  // the micro-batch variant too
  o.residency.mode = graph::ResidencyMode::stream;
  o.residency.state_home = graph::Home::host_compressed;  // staging in the host step pool
  o.residency.budget_bytes = 64ull << 20;
  expect_plan_matches_trainer(rt, small_residual(), o);
}

// The micro-batch step packs its host pool of step tensors into the update step's buffers (they
// never run at the same time): a streamed GPT with accumulation held two pools, each as large as
// the weight gradients, host memory 1.41x its training state instead of 1.21x. Staged host memory
// shares the pinned staging and the chunked fetches' ring the same way (on NVIDIA each variant's
// ring took device memory). The planner counts what each variant adds.
TEST(Plan, VariantsShareTheTrainingStepsHostPool) {
  Runtime rt;
  for (const bool staged : {false, true}) {
    SCOPED_TRACE(staged ? "staged host memory, fetched in chunks" : "pinned host memory");
    TrainerOptions o;
    o.batch = 8;
    o.accumulate = 2;
    o.residency.mode = graph::ResidencyMode::stream;
    o.residency.budget_bytes = 64ull << 20;
    o.residency.host_optimizer = true;  // the weight gradients in the host pool
    if (staged) {
      o.residency.homes.host_memory = offload::HostMemory::staged;
      o.residency.staging_chunk_bytes = 4096;
      o.residency.staging_min_bytes = 0;
    }
    expect_plan_matches_trainer(rt, small_residual(), o);
    const TrainingPlan plan = plan_training(rt, small_residual(), o);
    Trainer t(rt, small_residual(), o);
    const graph::CompiledStep& update = compiled_train_step(t);
    ASSERT_EQ(compiled_variants(t).size(), 1u);
    const graph::CompiledStep& micro = *compiled_variants(t).begin()->second;
    ASSERT_GT(update.host_step_bytes(), 0u);
    ASSERT_GT(micro.host_step_bytes(), 0u);
    EXPECT_LT(micro.host_bytes(), micro.host_step_bytes()) << "the micro-batch step's pool is in the update step's";
    if (staged) {
      ASSERT_GT(micro.plan().fetch_ring_chunk_bytes, 0u);
      EXPECT_TRUE(micro.plan().shared_fetch_ring);
      EXPECT_LE(micro.host_bytes(), micro.host_step_bytes() - micro.plan().host_staging_bytes)
          << "its staging and fetch ring are the update step's";
    }
    EXPECT_EQ(plan.phases.at(1).host_step_bytes, micro.host_bytes());
    EXPECT_EQ(t.host_state_bytes(), update.persistent()->host_bytes() + update.host_bytes() + micro.host_bytes());
  }
}

// `ferry plan --ranks 4 --zero S`: rank 0's step as its trainer builds it, its shares of the
// state, and the bytes its collectives take in and move across the link: the gradients (summed,
// or reduce-scattered with the guard's word), the weights gathered at stages 1 and 2 (this rank's
// shares up, the others' down).
TEST(Plan, PlannerAgreesWithTheTrainerDataParallel) {
  Runtime rt;
  for (const int stage : {0, 1, 2}) {
    for (const bool streamed : {false, true}) {
      SCOPED_TRACE(fmt::format("ZeRO stage {}{}", stage, streamed ? ", streamed with the host optimizer" : ""));
      TrainerOptions o;
      o.batch = 4;
      o.optimizer.kind = ops::OptimizerConfig::Kind::adamw;
      o.data_parallel = {.communicator = std::make_shared<IdleRanks>(0, 4), .global_batch = 16, .zero_stage = stage};
      if (streamed) {
        o.residency.mode = graph::ResidencyMode::stream;
        o.residency.host_optimizer = true;
      }
      expect_plan_matches_trainer(rt, small_residual(), o);
      const TrainingPlan plan = plan_training(rt, small_residual(), o);
      Trainer t(rt, small_residual(), o);
      const PhasePlan& step = plan.phases.front();
      const std::uint64_t weights = t.weight_bytes();
      const std::uint64_t reduced = t.allreduce_bytes_per_step();
      EXPECT_EQ(reduced, weights) << "every weight is trained, in f32";
      // (At stage 2 the ranks also agree on the overflow guard: one float.)
      EXPECT_EQ(step.collective_bytes, reduced + (stage > 0 ? weights : 0) + (stage == 2 ? 4 : 0));
      // The sums come back to the device but where the host optimizer reads them in host memory,
      // where the overflow guard checks them too.
      const std::uint64_t received_gradients = streamed ? 0 : stage == 2 ? t.gradient_bytes() : reduced;
      // The gather's copies of the weights (its share up, the others' down) but where it works on
      // the weights' host homes (the host optimizer's); the guard's word up and down at stage 2
      // (for the ranks' agreement) and where the host checks the sums (into its host copy).
      const std::uint64_t gathered_copies = stage > 0 && !streamed ? weights : 0;
      const std::uint64_t guard_words = stage == 2 || streamed ? 8 : 0;
      EXPECT_EQ(step.collective_link_bytes, reduced + received_gradients + gathered_copies + guard_words);
      // What rank 0 of 4 sends as ring collectives do: 2 x 3/4 of an all-reduce, 3/4 of a
      // reduce-scatter or an all-gather (the guard's float agreed at stage 2), at --network-gbps.
      const double sent = stage == 0   ? 1.5 * static_cast<double>(reduced)
                          : stage == 1 ? 1.5 * static_cast<double>(reduced) + 0.75 * static_cast<double>(weights)
                                       : 0.75 * static_cast<double>(reduced + weights) + 1.5 * 4;
      EXPECT_NEAR(static_cast<double>(step.network_bytes), sent, 4.0);
      EXPECT_EQ(step.network_ms, 0.0) << "no network rate, no network time";
      const PhasePlan timed = plan_training(rt, small_residual(), o, PlanRates{.network_gbps = 0.001}).phases.front();
      EXPECT_DOUBLE_EQ(timed.network_ms, static_cast<double>(step.network_bytes) / 1e3);
      EXPECT_GE(timed.predicted_step_ms, timed.network_ms);
      TrainerOptions alone = o;
      alone.data_parallel = {};
      alone.batch = 16;
      const TrainingPlan one = plan_training(rt, small_residual(), alone);
      if (stage > 0 && !streamed) {
        EXPECT_LT(plan.phases.front().device.optimizer_state, one.phases.front().device.optimizer_state);
      }
      // The reductions run where backward makes each gradient (in the node order the memory plan
      // follows), so a rank streams in what one rank alone at its share of the batch needs, and
      // moves no more over the link than that rank besides its collectives' copies (with the host
      // optimizer, ZeRO's gather works on the weights' host homes: no copy of a weight crosses).
      alone.batch = 4;
      const std::optional<std::uint64_t> ranked_min = min_stream_budget(rt, small_residual(), o),
                                         alone_min = min_stream_budget(rt, small_residual(), alone);
      ASSERT_TRUE(ranked_min && alone_min);
      EXPECT_LE(*ranked_min, *alone_min) << "at the minimum streamed budget";
      if (streamed) {
        const TrainingPlan mine = plan_training(rt, small_residual(), alone);
        const PhasePlan& mine_step = mine.phases.front();
        EXPECT_LE(step.fetch_bytes + step.write_back_bytes, mine_step.fetch_bytes + mine_step.write_back_bytes);
      }
    }
  }
}

// The GEMM work of small_mlp (20 -> 13 -> 10): each Linear's forward and weight gradient, and the
// input gradient of the second (the first layer's input needs none): 2 B (2 * 20 * 13 + 3 * 13 * 10).
// Copies overlap compute on a GPU; on a CPU device both run on the same cores.
TEST(Plan, FlopsCountEveryGemmAndTheStepTimeIsTheSlowerOfComputeAndTransfers) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 16;
  const TrainingPlan p =
      plan_training(rt, small_mlp(), o, PlanRates{.link_gbps = 2.0, .gemm_gflops = 1.0, .device_gbps = 4.0});
  const PhasePlan& t = p.phases.front();
  EXPECT_EQ(t.gemm_flops, 2u * 16u * (2u * 20u * 13u + 3u * 13u * 10u));
  EXPECT_GT(t.flops, t.gemm_flops) << "other compute nodes count one per output element";
  // The Adam updates alone read and write 28 bytes a parameter; the other nodes add their operands.
  EXPECT_GT(t.memory_bytes, 28u * 413u);
  EXPECT_DOUBLE_EQ(t.compute_ms, static_cast<double>(t.gemm_flops) / 1e6 + static_cast<double>(t.memory_bytes) / 4e6);
  EXPECT_DOUBLE_EQ(t.transfer_ms, static_cast<double>(t.fetch_bytes + t.write_back_bytes + t.batch_bytes) / 2e6);
  EXPECT_DOUBLE_EQ(p.predicted_step_ms,
                   rt.device().is_cpu() ? t.compute_ms + t.transfer_ms : std::max(t.compute_ms, t.transfer_ms));
  EXPECT_GT(t.batch_bytes, 16u * 20u * 4u) << "the batch goes up";
  const TrainingPlan unknown = plan_training(rt, small_mlp(), o);
  EXPECT_EQ(unknown.predicted_step_ms, 0.0) << "no rates, no prediction";
}

// link_ms: each direction at its own rate; both at once at their shares of the rate both reach together.
TEST(Plan, TheLinkCarriesTheTwoDirectionsAsItsRateBothWaysSays) {
  EXPECT_DOUBLE_EQ(link_ms({}, 4'000'000, 2'000'000), 0.0) << "no link rate, no time";
  EXPECT_DOUBLE_EQ(link_ms({.link_gbps = 2}, 4'000'000, 2'000'000), 3.0) << "one direction at a time, both at 2 GB/s";
  EXPECT_DOUBLE_EQ(link_ms({.link_gbps = 2, .link_d2h_gbps = 4}, 4'000'000, 2'000'000), 2.5)
      << "the way back at its own rate";
  EXPECT_DOUBLE_EQ(link_ms({.link_gbps = 2, .link_d2h_gbps = 4, .link_both_gbps = 6}, 4'000'000, 2'000'000), 2.0)
      << "full duplex: the longer direction's time";
  EXPECT_DOUBLE_EQ(link_ms({.link_gbps = 2, .link_both_gbps = 2}, 4'000'000, 2'000'000), 3.0)
      << "both ways at once no faster than one: the sum";
  // Between: 3 GB/s both ways, 1.5 each; the 2 MB down are through after 4/3 ms, with 2 MB up,
  // whose other 2 MB take 1 ms alone.
  EXPECT_NEAR(link_ms({.link_gbps = 2, .link_both_gbps = 3}, 4'000'000, 2'000'000), 4.0 / 3.0 + 1.0, 1e-12);
  EXPECT_DOUBLE_EQ(link_ms({.link_gbps = 2, .link_d2h_gbps = 4, .link_both_gbps = 6}, 4'000'000, 0), 2.0)
      << "one direction alone at its own rate";
  EXPECT_DOUBLE_EQ(link_ms({.link_gbps = 2, .link_d2h_gbps = 4, .link_both_gbps = 6}, 0, 2'000'000), 0.5);
}

// A streamed step with its updates on the device moves bytes both ways: its transfer time is their
// sum on a half-duplex link and the longer direction on a full-duplex one.
TEST(Plan, StreamedStepsTransferTimeFollowsTheLinksDuplex) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 16;
  o.residency.mode = graph::ResidencyMode::stream;
  o.residency.host_optimizer = false;
  PlanRates rates{.link_gbps = 2.0, .link_d2h_gbps = 1.0, .gemm_gflops = 1.0, .device_gbps = 4.0};
  const PhasePlan half = plan_training(rt, small_mlp(), o, rates).phases.front();
  ASSERT_GT(half.fetch_bytes, 0u);
  ASSERT_GT(half.write_back_bytes, 0u);
  EXPECT_NEAR(half.to_host_ms, static_cast<double>(half.write_back_bytes) / 1e6, 1e-3)
      << "written back at the way back's rate (and the loss's few bytes)";
  EXPECT_GT(half.to_device_ms, static_cast<double>(half.fetch_bytes + 16u * 20u * 4u) / 2e6)
      << "the fetches and the batch at the way there's rate";
  EXPECT_DOUBLE_EQ(half.transfer_ms, half.to_device_ms + half.to_host_ms);
  rates.link_both_gbps = 3.0;
  const PhasePlan full = plan_training(rt, small_mlp(), o, rates).phases.front();
  EXPECT_DOUBLE_EQ(full.to_device_ms, half.to_device_ms);
  EXPECT_DOUBLE_EQ(full.to_host_ms, half.to_host_ms);
  EXPECT_NEAR(full.transfer_ms, std::max(full.to_device_ms, full.to_host_ms), 1e-9);
  EXPECT_GT(full.tail_transfer_ms, 0.0);
  EXPECT_LT(full.tail_transfer_ms, half.tail_transfer_ms) << "the updates' fetches and write-backs overlap too";
  if (!rt.device().is_cpu()) {
    EXPECT_LT(full.predicted_step_ms, half.predicted_step_ms);
  }
}

TEST(Plan, RatesAreMeasuredOnTheDevice) {
  Runtime rt;
  const LinkRates link = measure_link(rt);
  EXPECT_GT(link.h2d_gbps, 0.0);
  EXPECT_GT(link.d2h_gbps, 0.0);
  EXPECT_GT(link.both_gbps, 0.0);
  EXPECT_LE(link.both_gbps, link.h2d_gbps + link.d2h_gbps);
  EXPECT_GT(measure_gemm_gflops(rt), 0.0);
  EXPECT_GT(measure_device_gbps(rt), 0.0);
  EXPECT_GT(measure_device_8bit_gbps(rt), 0.0);
  EXPECT_GT(measure_launch_us(rt), 0.0);
  EXPECT_GT(measure_host_update_gbps(), 0.0);
  EXPECT_GT(measure_host_update_gbps(true), 0.0);
  EXPECT_GT(measure_codec_gbps(), 0.0);
}

// The GEMM rate of a prediction is measured at the step's own products: small_mlp's step has five
// kinds (each layer's forward and weight gradient, and the second layer's input gradient: the
// first layer's input is the batch), each probed on buffers of its own; the rate is their FLOPs
// over their time.
StepGemmRate probe_small_mlp(const StepGemmProbe& probe) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 16;
  return measure_step_gemm_gflops(rt, small_mlp(), o, probe);
}

TEST(Plan, GemmRateIsMeasuredAtTheStepsOwnProducts) {
  const StepGemmRate r = probe_small_mlp({.budget_seconds = 60});
  EXPECT_EQ(r.batch, 16u);
  EXPECT_EQ(r.distinct, 5u);
  ASSERT_EQ(r.products(), 5u);
  ASSERT_EQ(r.probes.size(), 5u);
  EXPECT_DOUBLE_EQ(r.probed_share, 1.0);
  std::vector<std::string> ops;
  double flops = 0, seconds = 0;
  for (std::size_t i = 0; i < r.probes.size(); ++i) {
    const auto& p = r.probes[i];
    ops.push_back(p.op);
    EXPECT_EQ(p.nodes, 1u) << p.node;
    ASSERT_GT(p.gflops, 0.0) << p.node;
    if (i > 0) {
      EXPECT_LE(p.flops * p.nodes, r.probes[i - 1].flops * r.probes[i - 1].nodes) << "largest first";
    }
    flops += static_cast<double>(p.flops * p.nodes);
    seconds += static_cast<double>(p.flops * p.nodes) / (p.gflops * 1e9);
  }
  std::ranges::sort(ops);
  EXPECT_EQ(ops, (std::vector<std::string>{"linear", "linear", "linear_grad_input", "linear_grad_param",
                                           "linear_grad_param"}));
  // 16 x 20 x 13: the first layer's forward and weight gradient, 2 * 4,160 flops each.
  EXPECT_EQ(r.probes.front().flops, 2u * 16u * 20u * 13u);
  EXPECT_NEAR(r.gflops, flops / seconds * 1e-9, 1e-9 * r.gflops);
}

// Without time left, the largest product alone is probed (and stands for the rest); a step whose
// products take longer than a probe may is probed at a smaller batch, down to one sample.
TEST(Plan, GemmProbeKeepsToItsBudget) {
  const StepGemmRate largest = probe_small_mlp({.budget_seconds = 0});
  ASSERT_EQ(largest.products(), 1u);
  EXPECT_EQ(largest.probes.front().flops, 2u * 16u * 20u * 13u);
  EXPECT_LT(largest.probed_share, 1.0);
  EXPECT_GT(largest.probed_share, 0.2);
  EXPECT_GT(largest.gflops, 0.0);
  const StepGemmRate halved = probe_small_mlp({.budget_seconds = 60, .product_seconds = 0});
  EXPECT_EQ(halved.batch, 1u);
  EXPECT_EQ(halved.products(), 5u);
  EXPECT_EQ(halved.probes.front().flops, 2u * 20u * 13u);
}

// small_mlp's 413 parameters (20 x 13 + 13, 13 x 10 + 10) updated by Adam on the host: each reads
// the weight, its gradient and two moments and writes three, 28 bytes a parameter. With one copy of
// the state (the default) they change it in place, so they wait for the end of the backward and
// the next forward waits for them: the step is at least compute + host (on a GPU; on a CPU device
// everything adds up on the same cores).
TEST(Plan, HostUpdatesArePredictedFromTheHostRate) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 16;
  o.residency.mode = graph::ResidencyMode::stream;
  o.residency.host_optimizer = true;
  const PlanRates rates{.link_gbps = 1e6, .gemm_gflops = 1.0, .host_gbps = 1e-3};
  const TrainingPlan p = plan_training(rt, small_mlp(), o, rates);
  const PhasePlan& t = p.phases.front();
  EXPECT_EQ(t.host_update_bytes, 28u * 413u);
  EXPECT_DOUBLE_EQ(t.host_update_ms, 28.0 * 413.0 / 1e3);
  EXPECT_GT(t.forward_gemm_flops, 0u);
  EXPECT_LT(t.forward_gemm_flops, t.gemm_flops);
  EXPECT_GT(t.forward_memory_bytes, 0u);
  EXPECT_LT(t.forward_memory_bytes, t.memory_bytes);
  EXPECT_DOUBLE_EQ(t.forward_ms, static_cast<double>(t.forward_gemm_flops) / 1e6) << "no device memory rate given";
  EXPECT_TRUE(t.host_updates_after_backward) << "one copy of the state: the updates change it in place";
  const double expected =
      rt.device().is_cpu() ? t.compute_ms + t.transfer_ms + t.host_update_ms : t.compute_ms + t.host_update_ms;
  EXPECT_DOUBLE_EQ(p.predicted_step_ms, expected) << "the host's updates are the slowest part at these rates";
  EXPECT_DOUBLE_EQ(p.predicted_step_ms, predict_step_ms(t, rt.device().is_cpu()));
  EXPECT_EQ(t.codec_bytes, 0u);
  // Two copies: the updates write the other copy, so they start as their gradients land.
  TrainerOptions two = o;
  two.residency.homes.pinned_copies = 2;
  const TrainingPlan p2 = plan_training(rt, small_mlp(), two, rates);
  const PhasePlan& t2 = p2.phases.front();
  EXPECT_FALSE(t2.host_updates_after_backward);
  EXPECT_EQ(t2.host_update_bytes, t.host_update_bytes);
  // Deferred into the next step's forward: they wait for nothing, and the same bytes move.
  TrainerOptions overlapped = o;
  overlapped.residency.overlap_host_updates = true;
  const TrainingPlan po = plan_training(rt, small_mlp(), overlapped, rates);
  const PhasePlan& to = po.phases.front();
  EXPECT_TRUE(to.host_updates_deferred);
  EXPECT_FALSE(to.host_updates_after_backward);
  EXPECT_FALSE(t.host_updates_deferred);
  EXPECT_EQ(to.host_update_bytes, t.host_update_bytes);
  EXPECT_DOUBLE_EQ(po.predicted_step_ms, predict_step_ms(to, rt.device().is_cpu()));
  if (!rt.device().is_cpu()) {
    EXPECT_LT(po.predicted_step_ms, p.predicted_step_ms);
  }

  // 8-bit AdamW on the host: 16 bytes a parameter (u8 moments) and each tensor's two block scales
  // read and written (4 tensors of one block each), at the 8-bit rate.
  TrainerOptions eight = o;
  eight.optimizer.kind = ops::OptimizerConfig::Kind::adamw8bit;
  const PlanRates rates8{.link_gbps = 1e6, .gemm_gflops = 1.0, .host_gbps = 1e6, .host_8bit_gbps = 1e-3};
  const TrainingPlan p8 = plan_training(rt, small_mlp(), eight, rates8);
  const PhasePlan& t8 = p8.phases.front();
  EXPECT_EQ(t8.host_update_bytes, 16u * 413u + 4u * 2u * 2u * 4u);
  EXPECT_EQ(t8.host_update_8bit_bytes, t8.host_update_bytes);
  EXPECT_DOUBLE_EQ(t8.host_update_ms, static_cast<double>(t8.host_update_bytes) / 1e3);

  o.residency.host_optimizer = false;  // updates on the device: nothing on the host's cores
  const TrainingPlan device = plan_training(rt, small_mlp(), o, rates);
  EXPECT_EQ(device.phases.front().host_update_bytes, 0u);
  EXPECT_LT(device.predicted_step_ms, p.predicted_step_ms);
}

// 8-bit AdamW's updates on the device are bound by requantizing, not by memory: their bytes (as on
// the host: 16 a parameter and the scales; on the device also the loss each reads) at the device's 8-bit rate, the
// other nodes' at its memory rate; without an 8-bit rate, at the memory rate.
TEST(Plan, DeviceEightBitUpdatesArePredictedFromTheirOwnRate) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 16;
  o.optimizer.kind = ops::OptimizerConfig::Kind::adamw8bit;
  const PlanRates rates{.gemm_gflops = 1.0, .device_gbps = 1e6, .device_8bit_gbps = 1e-3};
  const PhasePlan t = plan_training(rt, small_mlp(), o, rates).phases.front();
  EXPECT_EQ(t.memory_8bit_bytes, 16u * 413u + 4u * 2u * 2u * 4u + 4u * 4u) << "and each reads the loss, its guard";
  EXPECT_GT(t.memory_bytes, t.memory_8bit_bytes);
  EXPECT_DOUBLE_EQ(t.compute_ms, static_cast<double>(t.gemm_flops) / 1e6 +
                                     static_cast<double>(t.memory_bytes - t.memory_8bit_bytes) / 1e12 +
                                     static_cast<double>(t.memory_8bit_bytes) / 1e3);
  PlanRates no_8bit_rate = rates;
  no_8bit_rate.device_8bit_gbps = 0;
  const PhasePlan u = plan_training(rt, small_mlp(), o, no_8bit_rate).phases.front();
  EXPECT_DOUBLE_EQ(u.compute_ms, static_cast<double>(u.gemm_flops) / 1e6 + static_cast<double>(u.memory_bytes) / 1e12);
  o.optimizer.kind = ops::OptimizerConfig::Kind::adam;
  EXPECT_EQ(plan_training(rt, small_mlp(), o, rates).phases.front().memory_8bit_bytes, 0u);
}

// Each of the device's compute nodes costs a launch the host issues: with only the launch cost
// known, the step is the launches at it (on any device: nothing else has a time).
TEST(Plan, LaunchesArePredictedFromTheLaunchCost) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 16;
  const TrainingPlan p = plan_training(rt, small_mlp(), o, PlanRates{.launch_us = 10.0});
  const PhasePlan& t = p.phases.front();
  EXPECT_GT(t.launches, 6u) << "two linears forward and backward, the loss, the updates";
  EXPECT_LT(t.launches, t.nodes) << "transfers and host nodes launch no kernel";
  EXPECT_DOUBLE_EQ(t.launch_ms, static_cast<double>(t.launches) * 0.01);
  EXPECT_DOUBLE_EQ(p.predicted_step_ms, t.launch_ms);
}

// Compressed state is unpacked before its update and packed after: its bytes at the codec's rate.
TEST(Plan, CompressedStateIsPredictedFromTheCodecRate) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 16;
  o.residency.mode = graph::ResidencyMode::stream;
  o.residency.state_home = graph::Home::host_compressed;
  const TrainingPlan p = plan_training(rt, small_mlp(), o, PlanRates{.codec_gbps = 1e-3});
  const PhasePlan& t = p.phases.front();
  EXPECT_EQ(t.codec_bytes, 2u * 2u * 4u * 413u) << "both moments unpacked and packed once";
  EXPECT_DOUBLE_EQ(p.predicted_step_ms, t.codec_ms);
}

const Configuration& chosen(const ConfigurationSearch& s) {
  if (!s.chosen) throw std::logic_error("no configuration was chosen");
  return s.tried.at(*s.chosen);
}

// Searched as for a discrete device (no mapped candidate) under a budget everything resident does
// not fit: a slow link makes the host optimizer (weights in, gradients out) the fastest, a slow
// host keeps the updates on the device, and without rates the leanest change that fits wins. (The
// plans are this unified-memory device's, where compressed state is unpacked in place and crosses
// no link: a slow codec rules it out.)
TEST(Plan, TheSearchChoosesTheFastestPredictedConfiguration) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 16;
  const ModelSpec model = small_residual();
  TrainerOptions resident = o;
  resident.residency.mode = graph::ResidencyMode::resident;
  const std::uint64_t all_resident = plan_training(rt, model, resident).device_peak_bytes;
  o.residency.budget_bytes = all_resident - 1;

  const auto search = [&](PlanRates rates) { return detail::search_configurations(rt, model, o, rates, false); };
  const ConfigurationSearch slow_link =
      search({.link_gbps = 1e-3, .gemm_gflops = 1e3, .host_gbps = 1e3, .codec_gbps = 1e-6});
  EXPECT_EQ(chosen(slow_link).flags, "--residency stream --host-optimizer");
  EXPECT_TRUE(chosen(slow_link).same_numerics);
  for (const Configuration& c : slow_link.tried) {
    EXPECT_EQ(c.flags.find("mapped"), std::string::npos) << "a discrete device has no mapped residency";
    if (c.flags.find("resident") != std::string::npos && c.flags.find("bf16") == std::string::npos) {
      EXPECT_FALSE(c.fits()) << c.flags;
      EXPECT_NE(c.error.find("budget"), std::string::npos) << c.error;
    }
  }
  const ConfigurationSearch slow_host =
      search({.link_gbps = 1e3, .gemm_gflops = 1e3, .host_gbps = 1e-6, .codec_gbps = 1e-6});
  EXPECT_EQ(chosen(slow_host).flags, "--residency stream");
  const ConfigurationSearch unknown = search({});
  EXPECT_EQ(chosen(unknown).flags, "--residency stream") << "no rates: the leanest change that fits";

  // Overlapped host updates are a candidate of their own, planned deferred into the next step; on
  // this CPU device, whose lanes share its cores, they cost what the host optimizer's do, so the
  // leaner of the two is chosen. A step that cannot defer them (accumulation) has no such candidate.
  const auto overlapped = [](const ConfigurationSearch& s) {
    return std::find_if(s.tried.begin(), s.tried.end(),
                        [](const Configuration& c) { return c.flags == "--residency stream --overlap-host-updates"; });
  };
  const auto deferred = overlapped(slow_link);
  ASSERT_NE(deferred, slow_link.tried.end());
  ASSERT_TRUE(deferred->fits()) << deferred->error;
  EXPECT_TRUE(deferred->options.residency.overlap_host_updates && deferred->options.residency.host_optimizer);
  EXPECT_TRUE(deferred->plan->phases[0].host_updates_deferred);
  EXPECT_TRUE(deferred->same_numerics);
  EXPECT_DOUBLE_EQ(deferred->plan->predicted_step_ms, chosen(slow_link).plan->predicted_step_ms);
  o.accumulate = 2;
  const ConfigurationSearch accumulating = search({.link_gbps = 1e-3, .gemm_gflops = 1e3, .host_gbps = 1e3});
  EXPECT_EQ(overlapped(accumulating), accumulating.tried.end());
  for (const Configuration& c : accumulating.tried) EXPECT_EQ(c.flags.find("overlap"), std::string::npos) << c.flags;
  o.accumulate = 1;

  // 8-bit state asked for: a device slow at requantizing sends the updates to the host, a fast one
  // keeps them; no candidate repeats the 8-bit state already asked for.
  o.optimizer.kind = ops::OptimizerConfig::Kind::adamw8bit;
  const PlanRates eight_bit{.link_gbps = 1e3,
                            .gemm_gflops = 1e3,
                            .device_gbps = 1e3,
                            .host_gbps = 1e3,
                            .host_8bit_gbps = 1.0,
                            .codec_gbps = 1e-6};
  PlanRates slow_device = eight_bit;
  slow_device.device_8bit_gbps = 1e-3;
  const ConfigurationSearch eight_slow = search(slow_device);
  EXPECT_EQ(chosen(eight_slow).flags, "--residency stream --host-optimizer");
  for (const Configuration& c : eight_slow.tried) EXPECT_EQ(c.flags.find("adamw8bit"), std::string::npos) << c.flags;
  PlanRates fast_device = eight_bit;
  fast_device.device_8bit_gbps = 1e3;
  EXPECT_EQ(chosen(search(fast_device)).flags, "--residency stream");
  o.optimizer.kind = ops::OptimizerConfig::Kind::adam;

  o.residency.budget_bytes = all_resident;
  EXPECT_EQ(chosen(search({.link_gbps = 1e-3, .gemm_gflops = 1e3, .host_gbps = 1e3})).flags, "--residency resident");

  // Options that leave the place to the plan (ferry plan's default): each candidate is planned with the place its
  // flags give, and a streamed one planned with the device's updates says --no-host-optimizer on a discrete device,
  // where ferry train given its other flags alone would choose the place again; on a unified one nothing changes.
  o.residency.budget_bytes = all_resident - 1;
  o.host_optimizer_auto = true;
  std::size_t said = 0;
  for (const Configuration& c : search({}).tried) {
    EXPECT_FALSE(c.options.host_optimizer_auto) << c.flags;
    const bool streamed = c.options.residency.mode == graph::ResidencyMode::stream;
    const bool device_updates = streamed && !c.options.residency.host_optimizer;
    EXPECT_EQ(c.flags.find("--no-host-optimizer") != std::string::npos, device_updates) << c.flags;
    if (c.plan) {
      EXPECT_EQ(c.plan->host_optimizer, c.options.residency.host_optimizer) << c.flags;
    }
    said += device_updates;
  }
  EXPECT_GT(said, 0u);
  for (const Configuration& c : detail::search_configurations(rt, model, o, {}, true).tried)
    EXPECT_EQ(c.flags.find("--no-host-optimizer"), std::string::npos) << c.flags;
}

// A split into micro-batches can shrink the step's buffers, never the weights' and optimizer
// state's host stores (gradient sums join them): once those alone are over the host limit at one
// batch, the search does not plan the same configuration at smaller micro-batches (it says why);
// where the step buffers are what is over, it still plans them.
TEST(Plan, TheSearchSkipsSplitsThatCannotFitTheHost) {
  Runtime rt;
  // Weights larger than the activations of one sample: a device budget below everything resident
  // at a batch of one leaves no resident candidate at any split, and the streamed ones fit it.
  const ModelSpec model = models::classifier("wide-mlp", graph::Shape{64}, 10, [](graph::Builder& b, TensorId x) {
    return b.linear(b.relu(b.linear(b.relu(b.linear(x, 256)), 256)), 10);
  });
  TrainerOptions o;
  o.optimizer.kind = ops::OptimizerConfig::Kind::adamw8bit;  // no candidate with leaner state than given
  o.batch = 1;
  o.residency.mode = graph::ResidencyMode::resident;
  o.residency.budget_bytes = plan_training(rt, model, o).device_peak_bytes - 1;
  o.batch = 16;
  o.residency.mode = graph::ResidencyMode::stream;
  const TrainingPlan whole = plan_training(rt, model, o);
  TrainerOptions halves = o;
  halves.batch = 8;
  halves.accumulate = 2;
  const TrainingPlan half = plan_training(rt, model, halves);
  ASSERT_GE(detail::host_bytes_at_any_batch(half), detail::host_bytes_at_any_batch(whole)) << "a split lowered them";
  ASSERT_GT(whole.host_step_bytes, 0u);
  const auto split = [](const Configuration& c) { return c.flags.find("--accumulate") != std::string::npos; };

  o.residency.host_budget_bytes = detail::host_bytes_at_any_batch(whole) - 1;
  const ConfigurationSearch none = detail::search_configurations(rt, model, o, {}, false);
  EXPECT_FALSE(none.chosen);
  std::size_t skipped = 0;
  for (const Configuration& c : none.tried) {
    EXPECT_FALSE(c.fits()) << c.flags;
    if (!split(c) || c.flags.find("resident") != std::string::npos) continue;  // resident: over the device budget
    EXPECT_FALSE(c.plan) << c.flags << " was planned";
    EXPECT_NE(c.error.find("not planned: at --batch 16"), std::string::npos) << c.flags << ": " << c.error;
    ++skipped;
  }
  EXPECT_GT(skipped, 0u);

  // Streamed as given, the stores fit and the step buffers do not: its splits are still planned.
  // (The host limit is below every unsplit candidate's host bytes, so that the search splits.)
  o.residency.host_budget_bytes = 0;
  std::uint64_t least = std::numeric_limits<std::uint64_t>::max();
  for (const Configuration& c : detail::search_configurations(rt, model, o, {}, false).tried)
    if (c.plan) least = std::min(least, c.plan->host_bytes + c.plan->host_compressed_bytes);
  ASSERT_LT(detail::host_bytes_at_any_batch(whole), least);
  o.residency.host_budget_bytes = least - 1;
  const ConfigurationSearch planned = detail::search_configurations(rt, model, o, {}, false);
  const auto halved = std::find_if(planned.tried.begin(), planned.tried.end(), [](const Configuration& c) {
    return c.flags == "--batch 8 --accumulate 2 --residency stream";
  });
  ASSERT_NE(halved, planned.tried.end());
  EXPECT_TRUE(halved->plan) << halved->error;
}

// The host budget holds the training steps' buffers and evaluation's, compiled at its first use:
// one byte short is refused before anything is allocated; exactly enough holds after an
// evaluation whose tail takes smaller batches (before evaluation counted, such a run ended at
// nearly twice its budget).
TEST(Plan, HostBudgetTooSmallIsAnErrorBeforeAnythingIsAllocated) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 16;
  o.residency.mode = graph::ResidencyMode::stream;
  o.residency.budget_bytes = 64ull << 20;
  const TrainingPlan plan = plan_training(rt, small_mlp(), o);
  ASSERT_GT(plan.host_eval_bytes, 0u);
  const std::uint64_t needed = detail::host_bytes_needed(plan);
  EXPECT_EQ(needed, plan.host_bytes + plan.host_eval_bytes);
  o.residency.host_budget_bytes = needed - 1;
  try {
    Trainer t(rt, small_mlp(), o);
    FAIL() << "a host budget one byte short was accepted";
  } catch (const HostBudgetError& e) {
    EXPECT_EQ(e.needed_bytes(), needed);
    EXPECT_EQ(e.budget_bytes(), needed - 1);
    const std::string m = e.what();
    EXPECT_NE(m.find(fmt::format("needs {} of host memory", format_bytes_up(needed))), std::string::npos) << m;
    EXPECT_NE(m.find("for evaluation batches"), std::string::npos) << m;
    EXPECT_NE(m.find("--host-budget"), std::string::npos) << m;
    EXPECT_NE(m.find("--optimizer adamw8bit"), std::string::npos) << m;
    EXPECT_NE(m.find("--device-budget"), std::string::npos) << m;
    EXPECT_NE(m.find("--state-home compressed"), std::string::npos) << m;
  }
  {  // A budget a byte short of a need that rounds alike: both figures in bytes.
    TrainingPlan p;
    p.host_bytes = p.host_store_bytes = 10ull << 20;
    try {
      check_host_budget(p, (10ull << 20) - 1);
      ADD_FAILURE() << "a host budget one byte short was accepted";
    } catch (const HostBudgetError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("needs 10485760 bytes of host memory"), std::string::npos) << m;
      EXPECT_NE(m.find("more than the host budget of 10485759 bytes"), std::string::npos) << m;
    }
  }
  {  // What the run already does is not offered again.
    TrainerOptions compressed = o;
    compressed.residency.state_home = graph::Home::host_compressed;
    compressed.optimizer.kind = ops::OptimizerConfig::Kind::adamw8bit;
    const TrainingPlan p = plan_training(rt, small_mlp(), compressed);
    try {
      check_host_budget(p, detail::host_bytes_needed(p) - 1);
      ADD_FAILURE() << "a host budget one byte short was accepted";
    } catch (const HostBudgetError& e) {
      const std::string m = e.what();
      EXPECT_EQ(m.find("--state-home compressed"), std::string::npos) << m;
      EXPECT_EQ(m.find("--optimizer adamw8bit"), std::string::npos) << m;
      EXPECT_NE(m.find("--device-budget"), std::string::npos) << m;
    }
  }
  o.residency.host_budget_bytes = needed;  // exactly enough
  Trainer fits(rt, small_mlp(), o);
  EXPECT_EQ(compiled_train_step(fits).persistent()->host_bytes(), plan.host_store_bytes);
  EXPECT_LE(fits.host_state_bytes(), plan.host_bytes);
  Dataset d;
  d.rows = 4;
  d.cols = 5;
  d.count = 16 + 8 + 4 + 2 + 1;  // the batch, then every smaller power of two
  d.images = random_vector(d.count * 20, 7, 0.0f, 1.0f);
  d.labels = labels_for(d.count, 9);
  EXPECT_EQ(fits.evaluate(d).samples, d.count);
  EXPECT_GT(fits.host_state_bytes(), plan.host_bytes) << "evaluation's variants hold host buffers";
  EXPECT_LE(fits.host_state_bytes(), needed);
}

// Evaluation packs its pool of step tensors into the training step's where that one is pinned and
// evaluation's kind is another: with mapped homes in pageable memory the training step's pool is
// pinned (its kernels address it), and evaluation's variants, whose kernels address no host tensor,
// had each held a pageable pool of their own, one per batch size (the deep model's host memory 1.5x
// what pinned homes took, and --host-budget refusing runs that fit).
TEST(Plan, EvaluationPacksIntoATrainingPoolOfAnotherKind) {
  Runtime rt;
  if (!rt.device().host_unified_memory) GTEST_SKIP() << "mapped homes need a device whose memory is the host's";
  TrainerOptions o;
  o.batch = 16;
  o.residency.mode = graph::ResidencyMode::mapped;
  Dataset d;
  d.rows = 4;
  d.cols = 5;
  d.count = 16 + 8 + 4 + 2 + 1;  // the batch, then every smaller power of two
  d.images = random_vector(d.count * 20, 7, 0.0f, 1.0f);
  d.labels = labels_for(d.count, 9);
  std::uint64_t pinned_eval = 0, pinned_held = 0;
  for (const auto memory : {offload::HostMemory::pinned, offload::HostMemory::pageable}) {
    SCOPED_TRACE(offload::host_memory_name(memory));
    o.residency.homes.host_memory = memory;
    const TrainingPlan plan = plan_training(rt, small_mlp(), o);
    ASSERT_GT(plan.host_eval_bytes, 0u) << "the tail's smaller batches need more than the training step's pool";
    Trainer t(rt, small_mlp(), o);
    EXPECT_EQ(t.evaluate(d).samples, d.count);
    EXPECT_LE(t.host_state_bytes(), plan.host_bytes + plan.host_eval_bytes);
    if (memory == offload::HostMemory::pinned) {
      pinned_eval = plan.host_eval_bytes;
      pinned_held = t.host_state_bytes();
    } else {
      EXPECT_EQ(plan.host_eval_bytes, pinned_eval) << "planned as with pinned homes";
      EXPECT_EQ(t.host_state_bytes(), pinned_held) << "held as with pinned homes";
    }
  }
}

// The step from its parts: on a device of its own the largest of them, the host updates counted
// after what they wait for; on a CPU device their sum.
TEST(Plan, StepTimeCombinesItsParts) {
  PhasePlan p;
  p.compute_ms = 10, p.forward_ms = 3, p.transfer_ms = 4, p.launch_ms = 1, p.codec_ms = 0.5;
  EXPECT_DOUBLE_EQ(predict_step_ms(p, false), 10) << "compute is the largest part";
  EXPECT_DOUBLE_EQ(predict_step_ms(p, true), 15.5) << "a CPU device adds them up";
  p.host_update_bytes = 1, p.host_update_ms = 8;
  EXPECT_DOUBLE_EQ(predict_step_ms(p, false), 11) << "updates start in the backward: forward + updates";
  p.host_updates_after_backward = true;
  EXPECT_DOUBLE_EQ(predict_step_ms(p, false), 18) << "updates in place wait for the backward: compute + updates";
  EXPECT_DOUBLE_EQ(predict_step_ms(p, true), 23.5);
  p.host_updates_deferred = true;  // (after_backward stays as it was: deferral overrides it)
  EXPECT_DOUBLE_EQ(predict_step_ms(p, false), 15) << "deferred into the next forward: updates + backward";
  p.host_update_ms = 2;
  EXPECT_DOUBLE_EQ(predict_step_ms(p, false), 10) << "deferred updates shorter than the forward: the compute";
  EXPECT_DOUBLE_EQ(predict_step_ms(p, true), 17.5) << "a CPU device still adds them up";
  p.host_updates_deferred = false, p.host_update_ms = 8;
  p.transfer_ms = 30;
  EXPECT_DOUBLE_EQ(predict_step_ms(p, false), 30) << "the link is the largest part";

  // The device's updates after the verdict: what overlaps before them, then their kernels or their transfers.
  PhasePlan d;
  d.compute_ms = 10, d.transfer_ms = 12;
  d.tail_compute_ms = 1, d.tail_transfer_ms = 8;
  EXPECT_DOUBLE_EQ(predict_step_ms(d, false), 9 + 8) << "the forward and backward, then the updates' transfers";
  d.tail_transfer_ms = 0.5;
  EXPECT_DOUBLE_EQ(predict_step_ms(d, false), 11.5 + 1) << "the transfers before them, then the updates' kernels";
  d.tail_transfer_ms = 0;
  EXPECT_DOUBLE_EQ(predict_step_ms(d, false), 12) << "resident: the updates' kernels end the compute";
  d.tail_transfer_ms = 8, d.transfer_ms = 12;
  EXPECT_DOUBLE_EQ(predict_step_ms(d, true), 22) << "a CPU device adds up compute and transfers as before";
}

// Streamed state updated on the device: its moments and weights cross the link after the backward,
// when the updates may run (one host copy, changed in place). Resident, the updates' kernels are
// the tail and nothing crosses.
TEST(Plan, DeviceUpdatesOfStreamedStateFollowTheBackward) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 16;
  o.residency.mode = graph::ResidencyMode::stream;
  // Products slow and the memory fast: the forward and backward outlast their transfers, and the
  // updates' transfers outlast their kernels.
  const PlanRates rates{.link_gbps = 1.0, .gemm_gflops = 1e-3, .device_gbps = 1e6};
  const PhasePlan t = plan_training(rt, small_mlp(), o, rates).phases.front();
  // At least the weights and both moments written back (413 parameters of 4 bytes, three times).
  EXPECT_GE(t.tail_transfer_bytes, 3u * 413u * 4u);
  EXPECT_LE(t.tail_transfer_bytes, t.fetch_bytes + t.write_back_bytes);
  EXPECT_DOUBLE_EQ(t.tail_transfer_ms, static_cast<double>(t.tail_transfer_bytes) / 1e6);
  EXPECT_GT(t.tail_memory_bytes, 0u) << "the updates' kernels";
  EXPECT_LT(t.tail_compute_ms, t.compute_ms);
  EXPECT_LT(t.tail_compute_ms, t.tail_transfer_ms);
  EXPECT_EQ(t.tail_gemm_flops, 0u) << "no product follows the updates";
  EXPECT_GT(t.compute_ms, t.transfer_ms);
  const double tail_bound = t.compute_ms - t.tail_compute_ms + t.tail_transfer_ms;
  EXPECT_DOUBLE_EQ(predict_step_ms(t, false), std::max(tail_bound, t.scheduled_step_ms))
      << "the tail does not overlap the backward";
  // The nodes in their order say the same, give or take the batch's upload before the first node.
  EXPECT_NEAR(t.scheduled_step_ms, tail_bound, 0.01 * tail_bound);

  o.residency.mode = graph::ResidencyMode::resident;
  const PhasePlan r = plan_training(rt, small_mlp(), o, rates).phases.front();
  EXPECT_EQ(r.tail_transfer_bytes, 0u);
  EXPECT_GT(r.tail_memory_bytes, 0u);
  EXPECT_DOUBLE_EQ(predict_step_ms(r, false), std::max({r.compute_ms, r.transfer_ms, r.scheduled_step_ms}));
  EXPECT_NEAR(r.scheduled_step_ms, r.compute_ms, 0.01 * r.compute_ms);

  o.residency.mode = graph::ResidencyMode::stream;
  o.residency.host_optimizer = true;  // no updates on the device: no tail
  const PhasePlan h = plan_training(rt, small_mlp(), o, rates).phases.front();
  EXPECT_EQ(h.tail_transfer_bytes, 0u);
  EXPECT_EQ(h.tail_memory_bytes, 0u);
}

// A step of hand-placed tensors (1 KiB each, in one transient buffer at `slots`): the estimate
// follows each lane's order, the bytes a node shares with another lane, the commit point and the
// host's issuing.
struct TinyStep {
  graph::Graph g;
  std::vector<graph::Pool> pools;
  graph::TensorId tensor(int slot) {
    const graph::TensorId x =
        g.tensors.add(fmt::format("t{}", slot), graph::Shape{256}, graph::DType::f32, graph::Role::activation);
    g.tensors.placement.resize(g.tensors.size());
    g.tensors.placement[x] = {0, static_cast<std::uint64_t>(slot) * 1024};
    pools.push_back(graph::Pool::transient);
    return x;
  }
  void node(const char* name, std::vector<graph::TensorId> in, std::vector<graph::TensorId> out, graph::Lane lane) {
    g.nodes.add(graph::builtin::fetch, name, in, out, {}, lane);
  }
};

TEST(ScheduleEstimate, NodesWaitForTheirLaneAndTheBytesOtherLanesWrite) {
  TinyStep s;
  const auto a = s.tensor(0), b = s.tensor(1), c = s.tensor(2), d = s.tensor(3);
  s.node("fetch a", {}, {a}, graph::Lane::h2d);        // 5 ms
  s.node("other", {}, {c}, graph::Lane::compute);      // 2 ms, needs nothing fetched
  s.node("use a", {a}, {b}, graph::Lane::compute);     // 1 ms, after the fetch
  s.node("write back b", {b}, {d}, graph::Lane::d2h);  // 3 ms, after its use
  const std::vector<double> ms{5, 2, 1, 3};
  const std::vector<char> in_place(4, 0);
  const auto e = graph::estimate_schedule(s.g, s.pools, ms, in_place, 0.0);
  EXPECT_DOUBLE_EQ(e.step_ms, 5 + 1 + 3);
  EXPECT_DOUBLE_EQ(e.busy_ms[static_cast<std::size_t>(graph::Lane::compute)], 3);
  EXPECT_DOUBLE_EQ(e.compute_idle_ms, 9 - 3);
  EXPECT_DOUBLE_EQ(e.longest_compute_wait_ms, 5 - 2) << "the use waited for the fetch after the other node";
  EXPECT_EQ(e.resumed_with, 2u);
  // Issued 4 ms apart, the device's nodes start no sooner: the fetch at 4, the other node at 8.
  const auto issued = graph::estimate_schedule(s.g, s.pools, ms, in_place, 4.0);
  EXPECT_DOUBLE_EQ(issued.step_ms, 16 + 3) << "the write-back issued at 16";
  EXPECT_THROW(graph::estimate_schedule(s.g, s.pools, std::vector<double>{1, 2}, in_place, 0.0), std::invalid_argument);
}

TEST(ScheduleEstimate, InPlaceNodesWaitForTheCommitPoint) {
  TinyStep s;
  const auto a = s.tensor(0), guard = s.tensor(1), w = s.tensor(2), x = s.tensor(3);
  s.g.guard = guard;
  s.node("slow copy", {}, {a}, graph::Lane::h2d);      // 6 ms, before the commit point
  s.node("guard", {}, {guard}, graph::Lane::compute);  // 1 ms: the commit point
  s.node("update", {}, {w}, graph::Lane::host);        // 2 ms, in place
  s.node("not in place", {}, {x}, graph::Lane::host);  // 2 ms
  const std::vector<double> ms{6, 1, 2, 2};
  const auto free = graph::estimate_schedule(s.g, s.pools, ms, std::vector<char>{0, 0, 0, 0}, 0.0);
  EXPECT_DOUBLE_EQ(free.step_ms, 6) << "the host lane's nodes run from the start";
  const auto held = graph::estimate_schedule(s.g, s.pools, ms, std::vector<char>{0, 0, 1, 0}, 0.0);
  EXPECT_DOUBLE_EQ(held.step_ms, 6 + 2 + 2) << "the update after everything up to the commit point, then its lane";
}

// The planned step's schedule at given rates: no shorter than any lane's work or the aggregate
// bounds it orders, no longer than all its work end to end. Its copy lanes run both ways at once
// (PCIe is full duplex), so the bound on transfers is each direction's bytes over the link, not
// their sum (transfer_ms, the plan's pessimistic aggregate).
TEST(Plan, ScheduledStepLiesBetweenItsLanesAndTheirSum) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 16;
  o.residency.mode = graph::ResidencyMode::stream;
  // 1 GB/s: every fetch of this small model ends before the host has issued the first product
  // (1 us a launch). 0.02 GB/s: the second weight's fetch, queued behind the first's, outlasts the
  // first product, so a product waits for its weight whatever the memory plan's packing (at 1 GB/s
  // only the loss waited, 64 ns, for labels whose bytes the packing had given to a product: on one
  // device's alignment, not on another's).
  for (double link_gbps : {1.0, 0.02})
    for (bool host_optimizer : {false, true}) {
      SCOPED_TRACE(fmt::format("link {} GB/s, host optimizer {}", link_gbps, host_optimizer));
      o.residency.host_optimizer = host_optimizer;
      const PlanRates rates{
          .link_gbps = link_gbps, .gemm_gflops = 1.0, .device_gbps = 1.0, .host_gbps = 1.0, .launch_us = 1};
      const PhasePlan t = plan_training(rt, small_mlp(), o, rates).phases.front();
      const double to_device_ms = static_cast<double>(t.fetch_bytes) / (link_gbps * 1e6);
      const double to_host_ms = static_cast<double>(t.write_back_bytes) / (link_gbps * 1e6);
      EXPECT_GE(t.scheduled_step_ms, t.compute_ms);
      EXPECT_GE(t.scheduled_step_ms, std::max(to_device_ms, to_host_ms));
      EXPECT_GE(t.scheduled_step_ms, t.launch_ms);
      EXPECT_LE(t.scheduled_step_ms, t.compute_ms + t.transfer_ms + t.host_update_ms + t.launch_ms + 1e-9);
      EXPECT_GE(t.predicted_step_ms, std::max(t.scheduled_step_ms, t.transfer_ms));
      EXPECT_NEAR(t.scheduled_compute_idle_ms, t.scheduled_step_ms - t.compute_ms, 1e-9);
      EXPECT_GE(t.scheduled_compute_idle_ms, t.scheduled_longest_wait_ms);
      if (link_gbps < 1.0) {
        EXPECT_FALSE(t.scheduled_longest_wait_before.empty()) << "streamed: a product waits for its weight";
        EXPECT_GT(t.scheduled_longest_wait_ms, 0.0);
      }
      if (host_optimizer) {
        EXPECT_GT(t.scheduled_step_ms, t.compute_ms) << "the updates follow the backward";
      }
    }
}

TEST(Plan, StateLargerThanPhysicalMemoryIsAnError) {
  TrainingPlan plan;
  plan.host_store_bytes = physical_memory_bytes() + 1;
  plan.host_bytes = plan.host_store_bytes;
  EXPECT_NO_THROW(check_host_budget(TrainingPlan{}, 0));
  try {
    check_host_budget(plan, 0);
    FAIL() << "a state larger than the machine's memory was accepted";
  } catch (const HostBudgetError& e) {
    EXPECT_EQ(e.budget_bytes(), physical_memory_bytes());
    EXPECT_NE(std::string(e.what()).find("physical memory"), std::string::npos) << e.what();
  }
  // A budget above physical memory does not lift the machine's limit for what runs here, but it is
  // the limit of a plan for a larger host.
  EXPECT_THROW(check_host_budget(plan, plan.host_bytes * 2), HostBudgetError);
  EXPECT_NO_THROW(check_host_budget(plan, plan.host_bytes * 2, HostLimit::budget_if_given));
  EXPECT_THROW(check_host_budget(plan, plan.host_bytes - 1, HostLimit::budget_if_given), HostBudgetError);
  try {
    check_host_budget(plan, 0, HostLimit::budget_if_given);
    FAIL() << "with no budget given, physical memory is the limit of a plan too";
  } catch (const HostBudgetError& e) {
    EXPECT_EQ(e.budget_bytes(), physical_memory_bytes());
  }
}

}  // namespace
}  // namespace ferry::test

namespace ferry::test {
namespace {

// Fused attention keeps no [T, T] tensor: the GPT's planned device peak grows with the context
// like its other activations (linearly), while the unfused path's grows with its square, so at a
// long context the fused step needs a fraction of the memory.
TEST(Plan, FusedAttentionNeedsNoContextSquaredMemory) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 2;
  auto peak = [&](std::uint32_t context, bool fused) {
    models::GptConfig c;
    c.vocab = 64;
    c.width = 64;
    c.depth = 2;
    c.heads = 4;
    c.context = context;
    c.fused_attention = fused;
    return plan_training(rt, models::gpt(c), o).device_peak_bytes;
  };
  const double fused_256 = double(peak(256, true)), fused_1024 = double(peak(1024, true));
  const double unfused_256 = double(peak(256, false)), unfused_1024 = double(peak(1024, false));
  EXPECT_LT(fused_1024 / fused_256, 4.5) << "fused: about linear in the context";
  EXPECT_GT(unfused_1024 / unfused_256, 8.0) << "unfused: the [T, T] scores dominate";
  EXPECT_LT(fused_1024 * 4, unfused_1024);
}

// --recompute auto: none when the step fits; under a budget that activations break, the longest
// recomputed segments that fit, whose training is bit-identical to keeping every activation; below
// what any segment length needs, a BudgetError naming that figure.
TEST(Plan, RecomputeAutoChoosesTheSegmentsTheBudgetNeeds) {
  Runtime rt;
  const ModelSpec m = models::deep(64, 12);
  TrainerOptions o;
  o.batch = 256;  // activations, not weights, set the minimum budget
  o.residency.mode = graph::ResidencyMode::stream;
  o.recompute_auto = true;
  o.residency.budget_bytes = 1ull << 30;
  EXPECT_EQ(choose_recompute(rt, m, o), 0u) << "room for every activation: no recomputation";

  TrainerOptions keep = o;
  keep.recompute_auto = false;
  keep.residency.budget_bytes = 1;
  std::uint64_t without = 0;
  try {
    plan_training(rt, m, keep);
  } catch (const graph::BudgetError& e) {
    without = e.min_budget();
  }
  ASSERT_GT(without, 0u);
  o.residency.budget_bytes = without - 1;
  const std::uint32_t every = choose_recompute(rt, m, o);
  EXPECT_GT(every, 0u) << "the step does not fit without recomputation";
  Trainer chosen(rt, m, o);
  EXPECT_EQ(chosen.options().recompute, every);
  EXPECT_LE(chosen.device_peak_bytes(), without - 1);
  EXPECT_EQ(plan_training(rt, m, o).recompute, every);

  // Asked for no recomputation under that budget, the Trainer's error names the segments that fit.
  TrainerOptions none_asked = o;
  none_asked.recompute_auto = false;
  none_asked.recompute = 0;
  try {
    Trainer refused(rt, m, none_asked);
    ADD_FAILURE() << "the step fitted without recomputation";
  } catch (const graph::BudgetError& e) {
    EXPECT_NE(std::string(e.what()).find(fmt::format("fits it: --recompute {}, or auto", every)), std::string::npos)
        << e.what();
    EXPECT_EQ(e.min_budget(), without);
  }

  // Recomputation changes no result: the same steps as a trainer keeping every activation.
  keep.residency.budget_bytes = 1ull << 30;
  Trainer reference(rt, m, keep);
  const std::size_t sample = sample_elems(m);
  for (int s = 0; s < 2; ++s) {
    auto x = random_vector(o.batch * sample, 80 + s);
    auto y = labels_for(o.batch, 90 + s);
    EXPECT_EQ(chosen.step(x, y).loss, reference.step(x, y).loss) << s;
  }
  for (const auto& name : chosen.parameter_names()) {
    EXPECT_EQ(chosen.read_parameter(name), reference.read_parameter(name)) << name;
  }

  o.residency.budget_bytes = 4096;
  try {
    choose_recompute(rt, m, o);
    FAIL() << "a 4 KiB budget should not fit";
  } catch (const graph::BudgetError& e) {
    EXPECT_GT(e.min_budget(), 4096u);
    EXPECT_LT(e.min_budget(), without);
    EXPECT_NE(std::string(e.what()).find("even with recomputation"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(format_bytes_up(e.min_budget())), std::string::npos) << e.what();
    // The minimum it names, given back as the budget, is enough.
    o.residency.budget_bytes = parse_bytes(format_bytes_up(e.min_budget()));
    EXPECT_GE(o.residency.budget_bytes, e.min_budget());
  }
}

// A budget no plan meets: the error lists what else lowers the step's bytes, leaving out what the
// run already uses (it once told a bf16 run with 8-bit state on the host to use both), and what
// does not lower this step's minimum (each setting is planned; a step whose minimum the layer's
// weights, gradients and state set was told to take a smaller batch and bf16 layers, and a CNN
// whose activations set it 8-bit state and streaming).
TEST(Plan, TooSmallABudgetSuggestsOnlyWhatIsNotInUse) {
  Runtime rt;
  const ModelSpec m = models::deep(64, 4);
  const auto message = [&](const TrainerOptions& o) {
    try {
      plan_training(rt, m, o);
    } catch (const graph::BudgetError& e) {
      return std::string(e.what());
    }
    ADD_FAILURE() << "a 4 KiB budget should not fit";
    return std::string();
  };
  TrainerOptions o;
  o.batch = 64;
  o.residency.mode = graph::ResidencyMode::stream;
  o.recompute_auto = true;
  o.residency.budget_bytes = 4096;
  const std::string plain = message(o);
  // The streamed minimum of 64 x 64 layers at batch 64 is the layer's weights, gradients and state:
  // less state lowers it, a smaller batch or narrower activations do not.
  for (const char* way : {"--optimizer adamw8bit; OptimizerConfig::Kind::adamw8bit) (needs at least",
                          "--host-optimizer; ResidencyOptions::host_optimizer) (needs at least"}) {
    EXPECT_NE(plain.find(way), std::string::npos) << way << " is not suggested: " << plain;
  }
  for (const char* way : {"a smaller batch", "--precision bf16"}) {
    EXPECT_EQ(plain.find(way), std::string::npos) << way << " does not lower this minimum: " << plain;
  }
  TrainerOptions half = o;
  half.batch = 32;
  const std::string half_batch = message(half);
  const auto minimum = [](const std::string& m) { return m.substr(0, m.find("; raise")); };
  EXPECT_EQ(minimum(half_batch), minimum(plain)) << "half the batch changed the minimum, and was not suggested";
  // Wide activations (a large batch) set the minimum: a smaller batch lowers it.
  TrainerOptions large = o;
  large.batch = 4096;
  const std::string large_batch = message(large);
  EXPECT_NE(large_batch.find("a smaller batch (--batch; TrainerOptions::batch), half of it (needs at least"),
            std::string::npos)
      << large_batch;
  o.precision.compute = graph::DType::bf16;
  o.optimizer.kind = ops::OptimizerConfig::Kind::adamw8bit;
  o.residency.host_optimizer = true;
  const std::string lean = message(o);
  for (const char* way : {"--precision bf16", "--optimizer adamw8bit", "--host-optimizer"}) {
    EXPECT_EQ(lean.find(way), std::string::npos) << way << " is in use but suggested: " << lean;
  }
  EXPECT_EQ(plain.find("--residency stream"), std::string::npos) << "it streams already: " << plain;
  // Resident by request, or state homed on the device: streaming is the way out.
  TrainerOptions resident = o;
  resident.residency.mode = graph::ResidencyMode::resident;
  resident.residency.host_optimizer = false;
  EXPECT_NE(message(resident).find("--residency stream"), std::string::npos) << message(resident);
  TrainerOptions state_on_device = o;
  state_on_device.residency.host_optimizer = false;
  state_on_device.residency.state_home = graph::Home::device;
  EXPECT_NE(message(state_on_device).find("--residency stream"), std::string::npos) << message(state_on_device);
}

// With the optimizer on the host and accumulation, a micro-batch step has no updates to write its
// gradients back: they were summed on the device after its overflow check, all of them held there
// until then (a deep MLP's micro-batch step needed 1.6 GiB where its training step needed 28.2 MiB).
// They spill to pinned host memory as the device optimizer's do: the step needs no more than with
// the optimizer on the device, the figure named fits, one byte under it fails naming the same.
TEST(Plan, HostOptimizerMicroBatchesSpillTheirGradients) {
  Runtime rt;
  const ModelSpec m = models::deep(256, 16);  // gradients of 9.7 MiB beside 3.1 MiB streamed
  TrainerOptions o;
  o.batch = 16;
  o.accumulate = 4;
  o.residency.mode = graph::ResidencyMode::stream;
  o.recompute = 0;
  const auto minimum_at = [&](bool host_optimizer, std::uint64_t budget) -> std::optional<std::uint64_t> {
    TrainerOptions t = o;
    t.residency.host_optimizer = host_optimizer;
    t.residency.budget_bytes = budget;
    try {
      (void)plan_training(rt, m, t);
    } catch (const graph::BudgetError& e) {
      return e.min_budget();
    }
    return std::nullopt;
  };
  const auto host = minimum_at(true, 4096), device = minimum_at(false, 4096);
  ASSERT_TRUE(host.has_value() && device.has_value()) << "a 4 KiB budget fitted";
  EXPECT_LE(*host, *device) << "the host optimizer's step needs more device memory than the device optimizer's";
  EXPECT_LT(*host, 8u << 20) << "the gradients are held on the device";
  EXPECT_FALSE(minimum_at(true, *host).has_value()) << "the minimum named, " << *host << " bytes, does not fit";
  const auto below = minimum_at(true, *host - 1);
  ASSERT_TRUE(below.has_value()) << "one byte under the minimum fitted";
  EXPECT_EQ(*below, *host);
}

// Host memory `automatic`: pinned where pinned buffers are host memory alone; on a driver whose
// pinned buffers take device memory too (NVIDIA's), staged in chunks of the budget / 128 (a power
// of two, 16 to 64 MiB) and pageable below a 2 GiB budget. Given kinds and chunks are kept.
TEST(Plan, AutomaticHostMemoryStagesInChunksWherePinnedBuffersTakeDeviceMemory) {
  using offload::HostMemory;
  constexpr std::uint64_t mib = 1ull << 20, gib = 1ull << 30;
  EXPECT_EQ(auto_staging_chunk_bytes(8 * gib), 64 * mib);
  EXPECT_EQ(auto_staging_chunk_bytes(24 * gib), 64 * mib);
  EXPECT_EQ(auto_staging_chunk_bytes(4 * gib), 32 * mib);
  EXPECT_EQ(auto_staging_chunk_bytes(3 * gib), 16 * mib);  // 24 MiB rounded down
  EXPECT_EQ(auto_staging_chunk_bytes(2 * gib), 16 * mib);
  EXPECT_EQ(auto_staging_chunk_bytes(2 * gib - 1), 0u);
  EXPECT_EQ(auto_staging_chunk_bytes(0), 0u);

  cl::DeviceInfo nvidia;
  nvidia.platform_name = "NVIDIA CUDA";
  nvidia.platform_vendor = nvidia.vendor = "NVIDIA Corporation";
  nvidia.name = "NVIDIA H200";
  nvidia.type = CL_DEVICE_TYPE_GPU;
  nvidia.global_mem_bytes = 140 * gib;
  cl::DeviceInfo amd = nvidia;
  amd.platform_name = "AMD Accelerated Parallel Processing";
  amd.platform_vendor = amd.vendor = "Advanced Micro Devices, Inc.";
  amd.name = "gfx90a";
  graph::ResidencyOptions r;
  const auto resolved = [&](const cl::DeviceInfo& d) { return resolve_host_transfers(r, d); };
  r.budget_bytes = 8 * gib;
  EXPECT_EQ(resolved(nvidia).homes.host_memory, HostMemory::staged);
  EXPECT_EQ(resolved(nvidia).staging_chunk_bytes, 64 * mib);
  EXPECT_EQ(resolved(amd).homes.host_memory, HostMemory::pinned);
  EXPECT_EQ(resolved(amd).staging_chunk_bytes, 0u);
  r.budget_bytes = 1 * gib;
  EXPECT_EQ(resolved(nvidia).homes.host_memory, HostMemory::pageable);
  EXPECT_EQ(resolved(nvidia).staging_chunk_bytes, 0u);
  r.budget_bytes = 0;  // the device's memory less headroom
  EXPECT_EQ(resolved(nvidia).staging_chunk_bytes, 64 * mib);
  r.mode = graph::ResidencyMode::resident;  // nothing fetched: no chunk (it would be refused as unused)
  EXPECT_EQ(resolved(nvidia).homes.host_memory, HostMemory::pageable);
  EXPECT_EQ(resolved(nvidia).staging_chunk_bytes, 0u);
  r.state_home = graph::Home::host_pinned;  // resident weights, streamed state
  EXPECT_EQ(resolved(nvidia).homes.host_memory, HostMemory::staged);
  r.state_home.reset();
  r.mode = graph::ResidencyMode::automatic;
  r.staging_chunk_bytes = 4 * mib;  // a chunk given is kept
  EXPECT_EQ(resolved(nvidia).homes.host_memory, HostMemory::staged);
  EXPECT_EQ(resolved(nvidia).staging_chunk_bytes, 4 * mib);
  r.staging_chunk_bytes = 0;
  for (const HostMemory m : {HostMemory::pinned, HostMemory::pageable, HostMemory::staged, HostMemory::registered}) {
    r.homes.host_memory = m;
    EXPECT_EQ(resolved(nvidia).homes.host_memory, m);
    EXPECT_EQ(resolved(nvidia).staging_chunk_bytes, 0u);
  }
  nvidia.host_unified_memory = true;  // an integrated one: its pinned buffers are host memory
  r.homes.host_memory = HostMemory::automatic;
  EXPECT_EQ(resolved(nvidia).homes.host_memory, HostMemory::pinned);

  // Planning takes pageable memory where staging's buffers do not fit the budget, or fit only
  // with recomputation that pageable memory does not need.
  nvidia.host_unified_memory = false;
  TrainerOptions o;
  o.residency.budget_bytes = 8 * gib;
  std::vector<HostMemory> planned;
  const auto plan_needing = [&](std::optional<std::uint32_t> staged_recompute, std::uint32_t pageable_recompute) {
    planned.clear();
    return detail::plan_with_host_transfers(o, nvidia, [&](const TrainerOptions& t) {
      planned.push_back(t.residency.homes.host_memory);
      const bool staged = t.residency.homes.host_memory == HostMemory::staged;
      if (o.residency.homes.host_memory == HostMemory::automatic) {
        EXPECT_EQ(t.residency.staging_chunk_bytes, staged ? 64 * mib : 0u);
      }
      if (staged && !staged_recompute) throw graph::BudgetError("staging does not fit", 9 * gib);
      TrainingPlan p;
      p.host_memory = t.residency.homes.host_memory;
      p.staging_chunk_bytes = t.residency.staging_chunk_bytes;
      p.recompute = staged ? *staged_recompute : pageable_recompute;
      return p;
    });
  };
  o.recompute_auto = true;
  EXPECT_EQ(plan_needing(0, 0).host_memory, HostMemory::staged);
  EXPECT_EQ(planned, std::vector<HostMemory>{HostMemory::staged});
  EXPECT_EQ(plan_needing(std::nullopt, 0).host_memory, HostMemory::pageable);
  EXPECT_EQ(planned, (std::vector<HostMemory>{HostMemory::staged, HostMemory::pageable}));
  EXPECT_EQ(plan_needing(4, 0).host_memory, HostMemory::pageable);
  EXPECT_EQ(plan_needing(4, 8).host_memory, HostMemory::staged);  // both recompute: staged's transfers
  o.recompute_auto = false;
  EXPECT_EQ(plan_needing(4, 0).host_memory, HostMemory::staged);  // the recomputation was asked for
  EXPECT_EQ(planned.size(), 1u);
  o.residency.homes.host_memory = HostMemory::staged;  // staged by request: no second plan
  EXPECT_THROW(plan_needing(std::nullopt, 0), graph::BudgetError);
  EXPECT_EQ(planned.size(), 1u);
  o.residency.homes.host_memory = HostMemory::automatic;
  EXPECT_EQ(detail::plan_with_host_transfers(o, amd,
                                             [](const TrainerOptions& t) {
                                               TrainingPlan p;
                                               p.host_memory = t.residency.homes.host_memory;
                                               return p;
                                             })
                .host_memory,
            HostMemory::pinned);
}

// host_optimizer_auto: on a device with memory of its own whose step streams, the host's updates
// where they move fewer bytes over the link without recomputing more, or where the device's do not
// fit; the device's where nothing streams, on a unified-memory device, or where the host optimizer
// cannot run with the other settings.
TEST(Plan, AutomaticHostOptimizerWhereItMovesFewerBytes) {
  constexpr std::uint64_t gib = 1ull << 30;
  cl::DeviceInfo gpu;
  gpu.type = CL_DEVICE_TYPE_GPU;
  gpu.global_mem_bytes = 24 * gib;
  struct Place {
    std::uint64_t moved = 0;
    std::uint32_t recompute = 0;
    bool fits = true, refused = false;
    std::uint64_t min_budget = 9 * gib;
    std::uint64_t host_bytes = 16 * gib;
  };
  Place device, host;
  graph::ResidencyMode mode = graph::ResidencyMode::stream;
  std::vector<bool> planned;  // host_optimizer of each plan made
  TrainerOptions o;
  o.host_optimizer_auto = true;
  HostLimit limit_by = HostLimit::budget_and_physical_memory;
  const auto choose = [&] {
    planned.clear();
    return detail::plan_with_host_optimizer(o, gpu, limit_by, [&](const TrainerOptions& t) {
      EXPECT_FALSE(t.host_optimizer_auto) << "each plan is of one place";
      planned.push_back(t.residency.host_optimizer);
      const Place& at = t.residency.host_optimizer ? host : device;
      if (at.refused) throw std::invalid_argument("the host optimizer does not take compressed state");
      if (!at.fits) throw graph::BudgetError("does not fit", at.min_budget);
      TrainingPlan p;
      p.mode = mode;
      p.host_optimizer = t.residency.host_optimizer;
      p.recompute = at.recompute;
      p.host_bytes = at.host_bytes;
      p.phases.resize(1);
      p.phases.front().fetch_bytes = at.moved / 2;
      p.phases.front().write_back_bytes = at.moved - at.moved / 2;
      return p;
    });
  };
  device.moved = 32 * gib, host.moved = 9 * gib;  // the 1.0B GPT on the H200
  TrainingPlan p = choose();
  EXPECT_TRUE(p.host_optimizer);
  EXPECT_TRUE(p.host_optimizer_chosen);
  EXPECT_EQ(p.other_place_moved_bytes, 32 * gib);
  EXPECT_EQ(planned, (std::vector<bool>{false, true}));
  host.recompute = 4;  // fewer bytes, but it would recompute where the device's plan does not
  p = choose();
  EXPECT_FALSE(p.host_optimizer);
  EXPECT_TRUE(p.host_optimizer_chosen);
  EXPECT_EQ(p.other_place_moved_bytes, 9 * gib);
  EXPECT_EQ(optimizer_place_reason(p),
            "optimizer updates on the device: the step moves 32.0 GiB over the link, 9.0 GiB with them on the host, "
            "whose plan recomputes more or needs more host memory than there is (--host-optimizer runs them on the "
            "host)");
  host.recompute = 0, host.moved = 40 * gib;  // a model nearly resident: the device's caches keep its state
  EXPECT_FALSE(choose().host_optimizer);
  host.moved = 9 * gib;
  o.residency.host_budget_bytes = 17 * gib;  // the host's gradients over the host budget, the device's plan within
  host.host_bytes = 18 * gib;
  EXPECT_FALSE(choose().host_optimizer);
  device.host_bytes = 18 * gib;  // both over it: the bytes over the link decide (the Trainer then says what is over)
  EXPECT_TRUE(choose().host_optimizer);
  // A host budget above this machine's memory: the Trainer holds plans to the machine's memory too, so the
  // host's plan over it is not chosen here; planning for the host the budget describes (ferry plan) takes it.
  const std::uint64_t physical = physical_memory_bytes();
  ASSERT_GT(physical, 2 * gib);
  o.residency.host_budget_bytes = 4 * physical;
  host.host_bytes = 2 * physical, device.host_bytes = physical / 2;
  EXPECT_FALSE(choose().host_optimizer);
  limit_by = HostLimit::budget_if_given;
  EXPECT_TRUE(choose().host_optimizer);
  limit_by = HostLimit::budget_and_physical_memory;
  o.residency.host_budget_bytes = 0, host.host_bytes = device.host_bytes = 16 * gib;
  host.moved = 9 * gib, device.fits = false;  // only the host's updates fit the budget
  p = choose();
  EXPECT_TRUE(p.host_optimizer);
  EXPECT_EQ(p.other_place_moved_bytes, 0u);
  EXPECT_EQ(optimizer_place_reason(p),
            "optimizer updates on the host: the step moves 9.0 GiB over the link, with them on the device the step "
            "does not fit the device budget (--no-host-optimizer keeps them on the device)");
  host.fits = false, host.min_budget = 6 * gib;  // neither: the error of the smaller minimum
  try {
    choose();
    ADD_FAILURE() << "nothing fits";
  } catch (const graph::BudgetError& e) {
    EXPECT_EQ(e.min_budget(), 6 * gib);
  }
  host.min_budget = 12 * gib;
  try {
    choose();
    ADD_FAILURE() << "nothing fits";
  } catch (const graph::BudgetError& e) {
    EXPECT_EQ(e.min_budget(), 9 * gib);
  }
  host.fits = true, host.refused = true, device.fits = true;  // a setting the host optimizer refuses
  p = choose();
  EXPECT_FALSE(p.host_optimizer);
  EXPECT_FALSE(p.host_optimizer_chosen);
  host.refused = false;
  mode = graph::ResidencyMode::resident;  // nothing streams: one plan, the device's
  EXPECT_FALSE(choose().host_optimizer);
  EXPECT_EQ(planned, std::vector<bool>{false});
  mode = graph::ResidencyMode::stream;
  gpu.host_unified_memory = true;  // no link to spare
  EXPECT_FALSE(choose().host_optimizer);
  EXPECT_EQ(planned, std::vector<bool>{false});
  o.residency.overlap_host_updates = true;  // the host optimizer's, asked for
  EXPECT_TRUE(choose().host_optimizer);
  EXPECT_EQ(planned, std::vector<bool>{true});
  o.residency.overlap_host_updates = false;
  o.host_optimizer_auto = false;  // not asked to choose: as given
  EXPECT_FALSE(choose().host_optimizer);
  EXPECT_EQ(planned, std::vector<bool>{false});
}

// The Trainer takes the choice (options() says where the optimizer runs), and refuses both asked for.
TEST(Plan, TrainerRunsTheOptimizerWhereHostOptimizerAutoChose) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 16;
  o.residency.mode = graph::ResidencyMode::stream;
  o.host_optimizer_auto = true;
  Trainer t(rt, small_mlp(), o);
  EXPECT_FALSE(t.options().host_optimizer_auto);
  // Where the device's memory is the host's (PoCL), the updates stay on the device.
  EXPECT_EQ(t.options().residency.host_optimizer, !rt.device().host_unified_memory);
  EXPECT_EQ(t.residency().host_updates > 0, t.options().residency.host_optimizer);
  o.residency.host_optimizer = true;
  EXPECT_THROW(Trainer(rt, small_mlp(), o), std::invalid_argument);

  // This device's real plans of both places, chosen between as on a GPU: streamed Adam state
  // updated on the device crosses the link both ways; on the host only weights and gradients do.
  o.residency.host_optimizer = false;
  cl::DeviceInfo gpu = rt.device();
  gpu.host_unified_memory = false;
  const auto plan = [&](const TrainerOptions& t) { return plan_training(rt, small_mlp(), t); };
  const TrainingPlan chosen = detail::plan_with_host_optimizer(o, gpu, HostLimit::budget_and_physical_memory, plan);
  EXPECT_TRUE(chosen.host_optimizer);
  EXPECT_TRUE(chosen.host_optimizer_chosen);
  TrainerOptions on_device = o;
  on_device.host_optimizer_auto = false;
  const PhasePlan device_step = plan_training(rt, small_mlp(), on_device).phases.front();
  EXPECT_EQ(chosen.other_place_moved_bytes, device_step.fetch_bytes + device_step.write_back_bytes);
  const PhasePlan& host_step = chosen.phases.front();
  // 413 parameters of 4 bytes: on the device the weight and both moments in and out; on the host the
  // weight in and its gradient out.
  EXPECT_EQ(chosen.other_place_moved_bytes, 6u * 413u * 4u);
  EXPECT_EQ(host_step.fetch_bytes + host_step.write_back_bytes, 2u * 413u * 4u);
  EXPECT_EQ(link_bytes_per_step(chosen), 2u * 413u * 4u);
  EXPECT_EQ(optimizer_place_reason(chosen),
            fmt::format("optimizer updates on the host: the step moves {} over the link, {} with them on the device "
                        "(--no-host-optimizer keeps them on the device)",
                        format_bytes(2u * 413u * 4u), format_bytes(6u * 413u * 4u)));
}

// Data-parallel ranks must put the optimizer in one place: the host's arithmetic differs from the
// device kernels' in the last bits, and the replicas would drift apart.
TEST(Plan, RanksThatPlaceTheOptimizerApartAreRefused) {
  IdleRanks ranks(0, 3);
  EXPECT_NO_THROW(detail::check_ranks_place_optimizer_alike(ranks, true));
  EXPECT_NO_THROW(detail::check_ranks_place_optimizer_alike(ranks, false));
  ranks.fail_rank(2);  // rank 2 answers 0: its plan kept the device's updates
  EXPECT_NO_THROW(detail::check_ranks_place_optimizer_alike(ranks, false));
  try {
    detail::check_ranks_place_optimizer_alike(ranks, true);
    ADD_FAILURE() << "ranks 0 and 1 on the host, rank 2 on the device";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank(s) 0, 1 on the host"), std::string::npos) << what;
    EXPECT_NE(what.find("--host-optimizer or --no-host-optimizer"), std::string::npos) << what;
  }
}

// A minimum is printed rounded up, so that the figure an error names is a budget that fits.
TEST(Units, MinimumsAreRoundedUpAtTheDigitShown) {
  EXPECT_EQ(format_bytes(16u << 20), "16.0 MiB");
  EXPECT_EQ(format_bytes_up(16u << 20), "16.0 MiB");
  EXPECT_EQ(format_bytes((16u << 20) + 1), "16.0 MiB");
  EXPECT_EQ(format_bytes_up((16u << 20) + 1), "16.1 MiB");
  EXPECT_EQ(format_bytes_up(1536), "1.5 KiB");
  EXPECT_EQ(format_bytes_up(100), "100.0 B");
}

}  // namespace
}  // namespace ferry::test
