#include "worker/client/graceful_stop.h"

#include "gtest/gtest.h"

namespace pstrain {
namespace {

TEST(GracefulStopTest, TheGraceIsTwiceTheStepsWorkWithinBounds) {
  EXPECT_EQ(GracefulStop::GraceAfter(absl::ZeroDuration()),
            absl::Milliseconds(400));
  EXPECT_EQ(GracefulStop::GraceAfter(absl::Milliseconds(150)),
            absl::Milliseconds(400));
  EXPECT_EQ(GracefulStop::GraceAfter(absl::Milliseconds(700)),
            absl::Milliseconds(1400));
  EXPECT_EQ(GracefulStop::GraceAfter(absl::Minutes(2)), absl::Seconds(5));
  // A clock that went backwards counts as no work.
  EXPECT_EQ(GracefulStop::GraceAfter(absl::Seconds(-3)),
            absl::Milliseconds(400));
}

TEST(GracefulStopTest, EachStepSetsTheGraceOfALaterStop) {
  GracefulStop stop;
  // Before any step: nothing is pushed, a wait is cut soon.
  EXPECT_EQ(stop.grace(), absl::Milliseconds(400));
  // The first step's length is not known while it runs.
  stop.StepWorkBegins();
  EXPECT_EQ(stop.grace(), absl::Seconds(5));
  stop.StepWorkDone(absl::Seconds(1));
  EXPECT_EQ(stop.grace(), absl::Seconds(2));
  // Later steps keep the last one's measure until they tell theirs, and
  // the longer of the last two counts (a pipelined step's push is told by
  // the step after it).
  stop.StepWorkBegins();
  EXPECT_EQ(stop.grace(), absl::Seconds(2));
  stop.StepWorkDone(absl::Milliseconds(10));
  EXPECT_EQ(stop.grace(), absl::Seconds(2));
  stop.StepWorkDone(absl::Milliseconds(10));
  EXPECT_EQ(stop.grace(), absl::Milliseconds(400));
  stop.StepWorkDone(absl::Milliseconds(1500));
  EXPECT_EQ(stop.grace(), absl::Seconds(3));
  // A new job in the process: its first step is not known either.
  stop.NewJob();
  EXPECT_EQ(stop.grace(), absl::Milliseconds(400));
  stop.StepWorkBegins();
  EXPECT_EQ(stop.grace(), absl::Seconds(5));
}

}  // namespace
}  // namespace pstrain
