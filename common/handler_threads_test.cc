#include "common/handler_threads.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

// The point of the pool: a handler that waits does not hold up the next.
TEST(HandlerThreadsTest, AWaitingHandlerHoldsUpNoOther) {
  HandlerThreads threads;
  absl::Notification release;
  constexpr int kWaiting = 8;
  for (int i = 0; i < kWaiting; ++i) {
    threads.Run([&release] { release.WaitForNotification(); });
  }
  absl::Notification ran;
  threads.Run([&ran] { ran.Notify(); });
  EXPECT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_GE(threads.threads(), kWaiting + 1);
  release.Notify();
}

TEST(HandlerThreadsTest, IdleThreadsEnd) {
  HandlerThreads threads(/*max_threads=*/16,
                         /*idle_exit=*/absl::Milliseconds(100));
  for (int i = 0; i < 20; ++i) {
    absl::Notification ran;
    threads.Run([&ran] { ran.Notify(); });
    ASSERT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(10)));
  }
  EXPECT_GE(threads.peak_threads(), 1);
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (threads.threads() > 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(threads.threads(), 0);
}

// Past max_threads handlers queue; the destructor runs what is queued.
TEST(HandlerThreadsTest, PastTheCapHandlersQueueAndAllRun) {
  std::atomic<int> ran{0};
  absl::Notification release;
  {
    HandlerThreads threads(/*max_threads=*/2);
    for (int i = 0; i < 2; ++i) {
      threads.Run([&] {
        release.WaitForNotification();
        ran.fetch_add(1);
      });
    }
    for (int i = 0; i < 10; ++i) threads.Run([&] { ran.fetch_add(1); });
    EXPECT_EQ(threads.threads(), 2);
    EXPECT_EQ(ran.load(), 0);
    release.Notify();
  }
  EXPECT_EQ(ran.load(), 12);
}

// TryRun never queues: with max_threads busy it declines (the caller does
// the work itself), and once one is idle again it runs there.
TEST(HandlerThreadsTest, TryRunDeclinesWhenEveryThreadIsBusy) {
  HandlerThreads threads(/*max_threads=*/2);
  absl::Notification release;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(threads.TryRun([&] { release.WaitForNotification(); }));
  }
  std::atomic<bool> ran_third{false};
  EXPECT_FALSE(threads.TryRun([&] { ran_third = true; }));
  EXPECT_EQ(threads.threads(), 2);
  release.Notify();
  // The released threads go idle; one of them takes the next at once.
  absl::Notification ran;
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  bool taken = false;
  while (!taken && absl::Now() < give_up) {
    taken = threads.TryRun([&ran] { ran.Notify(); });
    if (!taken) absl::SleepFor(absl::Milliseconds(1));  // until one is idle
  }
  ASSERT_TRUE(taken);
  EXPECT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(threads.threads(), 2);  // no third thread
  EXPECT_FALSE(ran_third.load());
}

}  // namespace
}  // namespace pstrain
