#include "ps_server/step_intervals.h"

#include "gtest/gtest.h"

namespace pstrain {
namespace {

const absl::Time kStart = absl::FromUnixSeconds(1000);

TEST(StepIntervalsTest, NothingIsKnownBeforeTwoSteps) {
  StepIntervals steps;
  EXPECT_EQ(steps.Median(), absl::ZeroDuration());
  steps.Saw(0, kStart);
  EXPECT_EQ(steps.Median(), absl::ZeroDuration());
  steps.Saw(1, kStart + absl::Milliseconds(2));
  EXPECT_EQ(steps.Median(), absl::Milliseconds(2));
}

TEST(StepIntervalsTest, APauseAmongStepsMovesNothing) {
  StepIntervals steps;
  absl::Time t = kStart;
  for (int step = 0; step < 10; ++step) {
    // Step 6 comes after a 2 s evaluation.
    t += step == 6 ? absl::Seconds(2) : absl::Milliseconds(3);
    steps.Saw(step, t);
    EXPECT_EQ(steps.Median(),
              step == 0 ? absl::ZeroDuration() : absl::Milliseconds(3))
        << "after step " << step;
  }
}

TEST(StepIntervalsTest, AJobThatSlowsForGoodIsFollowedWithinAFewSteps) {
  StepIntervals steps;
  absl::Time t = kStart;
  int step = 0;
  for (; step < 10; ++step) steps.Saw(step, t += absl::Milliseconds(2));
  for (int slow = 0; slow < 2; ++slow) {
    steps.Saw(step++, t += absl::Milliseconds(20));
    EXPECT_EQ(steps.Median(), absl::Milliseconds(2));
  }
  steps.Saw(step++, t += absl::Milliseconds(20));
  EXPECT_EQ(steps.Median(), absl::Milliseconds(20));
}

TEST(StepIntervalsTest, AGapCountsAsItsStepsAndOldStepsAreIgnored) {
  StepIntervals steps;
  steps.Saw(10, kStart);
  steps.Saw(14, kStart + absl::Milliseconds(8));  // four steps in 8 ms
  EXPECT_EQ(steps.Median(), absl::Milliseconds(2));
  // A step seen again later (a second sender's take), or an older one.
  steps.Saw(14, kStart + absl::Seconds(5));
  steps.Saw(12, kStart + absl::Seconds(6));
  steps.Saw(15, kStart + absl::Milliseconds(10));
  EXPECT_EQ(steps.Median(), absl::Milliseconds(2));
}

}  // namespace
}  // namespace pstrain
