#include "worker/lr_schedule.h"

#include <cmath>

#include "gtest/gtest.h"

namespace pstrain {
namespace {

TEST(LrScheduleTest, WarmupThenStep) {
  LrSchedule s;
  s.kind = "step";
  s.warmup_steps = 4;
  s.step_size = 10;
  s.gamma = 0.5;
  EXPECT_DOUBLE_EQ(LrFactor(s, 0), 0.25);
  EXPECT_DOUBLE_EQ(LrFactor(s, 3), 1.0);
  EXPECT_DOUBLE_EQ(LrFactor(s, 4), 1.0);
  EXPECT_DOUBLE_EQ(LrFactor(s, 13), 1.0);
  EXPECT_DOUBLE_EQ(LrFactor(s, 14), 0.5);
  EXPECT_DOUBLE_EQ(LrFactor(s, 34), 0.125);
}

TEST(LrScheduleTest, CosineAsTorchsCosineAnnealing) {
  LrSchedule s;
  s.kind = "cosine";
  s.total_steps = 100;
  EXPECT_DOUBLE_EQ(LrFactor(s, 0), 1.0);
  EXPECT_NEAR(LrFactor(s, 50), 0.5, 1e-12);
  EXPECT_NEAR(LrFactor(s, 100), 0.0, 1e-12);
  // torch: eta_t = 0.5 * (1 + cos(pi * t / T_max)).
  EXPECT_NEAR(LrFactor(s, 30), 0.5 * (1 + std::cos(M_PI * 0.3)), 1e-12);
}

TEST(LrScheduleTest, ConstantIsNoSchedule) {
  LrSchedule s;
  EXPECT_FALSE(Scheduled(s));
  EXPECT_DOUBLE_EQ(LrFactor(s, 123), 1.0);
  s.warmup_steps = 2;
  EXPECT_TRUE(Scheduled(s));
}

TEST(LrScheduleTest, BadFlagsAreNamed) {
  LrSchedule s;
  s.kind = "linear";
  s.gamma = 2;
  const std::vector<absl::Status> problems = LrScheduleProblems(s);
  ASSERT_EQ(problems.size(), 2u);
  EXPECT_NE(problems[0].message().find("--lr_schedule must be"),
            std::string::npos);
  EXPECT_NE(problems[1].message().find("--lr_step_gamma"), std::string::npos);
  LrSchedule step;
  step.kind = "step";
  EXPECT_EQ(LrScheduleProblems(step).size(), 1u);  // no --lr_step_size
}

}  // namespace
}  // namespace pstrain
