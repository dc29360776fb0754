#include "worker/last_tenth.h"

#include "gtest/gtest.h"

namespace pstrain {
namespace {

BatchResult Batch(double loss, int64_t correct) {
  return BatchResult{loss * 10, correct, 10};
}

TEST(LastTenthTest, AFinishedJobAveragesItsLastTenth) {
  LastTenth tail(100);
  for (int64_t step = 1; step <= 100; ++step) {
    tail.Add(step, Batch(step <= 90 ? 5.0 : 1.0, step <= 90 ? 0 : 10));
  }
  const BatchResult sums = tail.Sums(100);
  EXPECT_EQ(sums.rows, 100);
  EXPECT_DOUBLE_EQ(sums.loss_sum / sums.rows, 1.0);
  EXPECT_EQ(sums.num_correct, 100);
}

TEST(LastTenthTest, AJobStoppedEarlyAveragesTheLastTenthItRan) {
  // A job of 1e8 steps stopped after 640: the last 64 it ran, not zeros.
  LastTenth tail(100000000);
  for (int64_t step = 1; step <= 640; ++step) {
    tail.Add(step, Batch(step <= 576 ? 5.0 : 2.0, 3));
  }
  const BatchResult sums = tail.Sums(640);
  EXPECT_EQ(sums.rows, 640);
  EXPECT_DOUBLE_EQ(sums.loss_sum / sums.rows, 2.0);
  EXPECT_EQ(sums.num_correct, 64 * 3);
}

TEST(LastTenthTest, AtMostKMaxKeptStepsAndAtLeastOne) {
  LastTenth tail(100000000);
  for (int64_t step = 1; step <= 20000; ++step) tail.Add(step, Batch(1.0, 1));
  EXPECT_EQ(tail.Sums(20000).rows, LastTenth::kMaxKept * 10);
  LastTenth short_job(100000000);
  short_job.Add(1, Batch(4.0, 2));
  short_job.Add(2, Batch(3.0, 1));
  EXPECT_EQ(short_job.Sums(2).rows, 10);
  EXPECT_DOUBLE_EQ(short_job.Sums(2).loss_sum, 30.0);
  EXPECT_EQ(LastTenth(10).Sums(0).rows, 0);
}

}  // namespace
}  // namespace pstrain
