// Device bytes by purpose (ferry/runtime/plan.hpp): the persistent parts equal the trainer's own
// counts, the total is the planned device peak, a Predict variant holds no gradients, and a
// streamed step keeps its weights off the device but their copies on it.
#include "classifier.hpp"
#include "ferry/ferry.hpp"
#include "ferry/runtime/plan.hpp"
#include "test_models.hpp"
#include "test_support.hpp"

namespace ferry::test {
namespace {

TEST(Plan, ResidentBreakdownMatchesTheTrainer) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 16;
  Trainer t(rt, small_cnn(), o);
  const DeviceBreakdown b = device_breakdown(t.train_step(), t.train_step());
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

TEST(Plan, PredictHoldsNoGradientsAndStreamingMovesWeightsOff) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 16;
  o.phases.hybrid = true;
  Trainer t(rt, small_mlp(), o);
  const DeviceBreakdown full = device_breakdown(t.train_step(), t.train_step());
  const DeviceBreakdown predict = device_breakdown(*t.predict_variant(), t.train_step());
  EXPECT_EQ(predict.gradients, 0u);
  EXPECT_GT(full.gradients, 0u);
  EXPECT_EQ(full.other_state, t.predictor_state_bytes());  // resident predictor state
  EXPECT_EQ(predict.optimizer_state, full.optimizer_state) << "resident state stays on the device in Predict";

  o.residency.mode = graph::ResidencyMode::stream;
  o.residency.budget_bytes = 64ull << 20;
  Trainer s(rt, small_mlp(), o);
  const DeviceBreakdown streamed = device_breakdown(s.train_step(), s.train_step());
  EXPECT_EQ(streamed.weights, 0u);
  EXPECT_EQ(streamed.optimizer_state, 0u);
  EXPECT_GT(streamed.streamed_copies, 0u);
}

}  // namespace
}  // namespace ferry::test
