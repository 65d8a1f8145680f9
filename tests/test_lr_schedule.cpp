// Learning-rate schedules: values, warm-up, validation; and the trainer refusing a bad rate.
#include <gtest/gtest.h>

#include <cmath>

#include "ferry/ferry.hpp"
#include "test_models.hpp"

namespace ferry::test {
namespace {

TEST(LrSchedule, CosineDecaysFromThePeakAsTheCliAlwaysDid) {
  LrSchedule s;
  s.peak = 0.01f;
  s.total_steps = 1000;
  s.validate();
  EXPECT_EQ(s.at(0), 0.01f);
  EXPECT_NEAR(s.at(500), 0.005f, 1e-7f);
  for (std::uint64_t step = 1; step < 1000; ++step) EXPECT_LT(s.at(step), s.at(step - 1)) << step;
  EXPECT_GT(s.at(999), 0.0f);
  EXPECT_EQ(s.at(5000), s.at(999)) << "past the end it keeps the last value";
  // Bit for bit the expression `ferry train` used before the schedule was a library type.
  for (std::uint64_t step : {0u, 1u, 17u, 333u, 998u, 999u}) {
    const float old = 0.01f * 0.5f * (1.0f + std::cos(static_cast<float>(M_PI) * step / 1000));
    EXPECT_EQ(s.at(step), old) << step;
  }
}

TEST(LrSchedule, WarmupConstantAndFloor) {
  LrSchedule s;
  s.kind = LrSchedule::Kind::constant;
  s.peak = 0.1f;
  s.warmup_steps = 4;
  s.validate();
  EXPECT_FLOAT_EQ(s.at(0), 0.025f);
  EXPECT_FLOAT_EQ(s.at(3), 0.1f);
  EXPECT_EQ(s.at(100), 0.1f);
  LrSchedule c;
  c.peak = 1.0f;
  c.min_lr = 0.1f;
  c.total_steps = 10;
  c.validate();
  EXPECT_EQ(c.at(0), 1.0f);
  EXPECT_GT(c.at(9), 0.1f);
  EXPECT_LT(c.at(9), 0.15f);
}

TEST(LrSchedule, BadSettingsAreClearErrors) {
  auto expect_bad = [](LrSchedule s, const char* what) {
    try {
      s.validate();
      ADD_FAILURE() << what;
    } catch (const std::invalid_argument& e) {
      EXPECT_FALSE(std::string(e.what()).empty());
    }
  };
  LrSchedule base;
  base.total_steps = 10;
  LrSchedule s = base;
  s.peak = std::nanf("");
  expect_bad(s, "NaN peak");
  s = base;
  s.peak = -1;
  expect_bad(s, "negative peak");
  s = base;
  s.total_steps = 0;
  expect_bad(s, "cosine without steps");
  s = base;
  s.min_lr = 1;
  expect_bad(s, "floor above the peak");
  s = base;
  s.warmup_steps = 10;
  expect_bad(s, "warm-up as long as the schedule");
  EXPECT_THROW(parse_schedule("linear"), std::invalid_argument);
  EXPECT_EQ(parse_schedule("constant"), LrSchedule::Kind::constant);
}

TEST(LrSchedule, TrainerRefusesANonFiniteOrNegativeRateAndKeepsItsOwn) {
  Runtime rt;
  TrainerOptions o;
  o.batch = 4;
  Trainer t(rt, small_mlp(), o);
  t.set_lr(0.0f);
  EXPECT_EQ(t.lr(), 0.0f);
  t.set_lr(0.5f);
  EXPECT_THROW(t.set_lr(std::nanf("")), std::invalid_argument);
  EXPECT_THROW(t.set_lr(-0.1f), std::invalid_argument);
  EXPECT_THROW(t.set_lr(INFINITY), std::invalid_argument);
  EXPECT_EQ(t.lr(), 0.5f);
}

}  // namespace
}  // namespace ferry::test
