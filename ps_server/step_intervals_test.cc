#include "ps_server/step_intervals.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace pstrain {
namespace {

const absl::Time kStart = absl::FromUnixSeconds(1000);

// One step seen alone.
void SawOne(StepIntervals& steps, int64_t step, absl::Time made) {
  steps.Saw({step}, {made});
}

TEST(StepIntervalsTest, NothingIsKnownBeforeTwoSteps) {
  StepIntervals steps;
  EXPECT_EQ(steps.Median(), absl::ZeroDuration());
  SawOne(steps, 0, kStart);
  EXPECT_EQ(steps.Median(), absl::ZeroDuration());
  SawOne(steps, 1, kStart + absl::Milliseconds(2));
  EXPECT_EQ(steps.Median(), absl::Milliseconds(2));
}

TEST(StepIntervalsTest, APauseAmongStepsMovesNothing) {
  StepIntervals steps;
  absl::Time t = kStart;
  for (int step = 0; step < 10; ++step) {
    // Step 2 comes after a 2 s evaluation: the second interval of two.
    t += step == 2 ? absl::Seconds(2) : absl::Milliseconds(3);
    SawOne(steps, step, t);
    EXPECT_EQ(steps.Median(),
              step == 0 ? absl::ZeroDuration() : absl::Milliseconds(3))
        << "after step " << step;
  }
}

TEST(StepIntervalsTest, AJobThatSlowsForGoodIsFollowedWithinAFewSteps) {
  StepIntervals steps;
  absl::Time t = kStart;
  int step = 0;
  for (; step < 10; ++step) SawOne(steps, step, t += absl::Milliseconds(2));
  for (int slow = 0; slow < 2; ++slow) {
    SawOne(steps, step++, t += absl::Milliseconds(20));
    EXPECT_EQ(steps.Median(), absl::Milliseconds(2));
  }
  SawOne(steps, step++, t += absl::Milliseconds(20));
  EXPECT_EQ(steps.Median(), absl::Milliseconds(20));
}

TEST(StepIntervalsTest, AGapGivesItsMeanStepAndOldStepsAreIgnored) {
  StepIntervals steps;
  SawOne(steps, 10, kStart);
  SawOne(steps, 14, kStart + absl::Milliseconds(8));  // four steps in 8 ms
  EXPECT_EQ(steps.Median(), absl::Milliseconds(2));
  // A step seen again later (a second sender's take), or an older one.
  SawOne(steps, 14, kStart + absl::Seconds(5));
  SawOne(steps, 12, kStart + absl::Seconds(6));
  EXPECT_EQ(steps.Median(), absl::Milliseconds(2));
  SawOne(steps, 15, kStart + absl::Milliseconds(14));  // 6 ms after 14
  SawOne(steps, 16, kStart + absl::Milliseconds(20));
  EXPECT_EQ(steps.Median(), absl::Milliseconds(6));
}

TEST(StepIntervalsTest, TheNewestOfStepsSeenTogetherCounts) {
  StepIntervals steps;
  SawOne(steps, 0, kStart);
  // Steps 1 and 2 in one send, in any order: step 2, made at 6 ms.
  steps.Saw({2, 1, 2},
            {kStart + absl::Milliseconds(6), kStart + absl::Milliseconds(3),
             kStart + absl::Milliseconds(7)});
  EXPECT_EQ(steps.Median(), absl::Milliseconds(3));
}

TEST(StepIntervalsTest, HalfTheStepWithinItsBounds) {
  const absl::Duration shortest = absl::Microseconds(500);
  const absl::Duration longest = absl::Milliseconds(10);
  StepIntervals steps;
  EXPECT_EQ(steps.HalfStep(shortest, longest), shortest);  // not known
  SawOne(steps, 0, kStart);
  SawOne(steps, 1, kStart + absl::Milliseconds(4));
  EXPECT_EQ(steps.HalfStep(shortest, longest), absl::Milliseconds(2));
  StepIntervals fast;
  SawOne(fast, 0, kStart);
  SawOne(fast, 1, kStart + absl::Microseconds(600));
  EXPECT_EQ(fast.HalfStep(shortest, longest), shortest);
  StepIntervals slow;
  SawOne(slow, 0, kStart);
  SawOne(slow, 1, kStart + absl::Seconds(1));
  EXPECT_EQ(slow.HalfStep(shortest, longest), longest);
}

}  // namespace
}  // namespace pstrain
