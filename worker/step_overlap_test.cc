// The pieces the training loop overlaps with compute. OverlappedPush needs
// servers: the sync equivalence and real-data tests train through it (it is
// the default) and check the model a single process would reach.
#include "worker/step_overlap.h"

#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "worker/data.h"

namespace pstrain {
namespace {

TEST(SerialWorkerTest, RunsInOrderAndDrainWaitsForAll) {
  std::vector<int> ran;
  absl::Notification release;
  SerialWorker worker;
  // The first closure blocks until released: Drain must not return early.
  worker.Schedule([&] {
    ASSERT_TRUE(release.WaitForNotificationWithTimeout(absl::Seconds(30)));
    ran.push_back(0);
  });
  for (int i = 1; i < 5; ++i) worker.Schedule([&ran, i] { ran.push_back(i); });
  release.Notify();
  worker.Drain();
  EXPECT_EQ(ran, (std::vector<int>{0, 1, 2, 3, 4}));
}

TEST(SerialWorkerTest, DestructionRunsWhatIsQueued) {
  int ran = 0;
  {
    SerialWorker worker;
    for (int i = 0; i < 100; ++i) worker.Schedule([&ran] { ++ran; });
  }
  EXPECT_EQ(ran, 100);
}

// Example i has features {i, 10 i} and label i % 3.
InMemorySource MakeSource(int64_t size) {
  Dataset data;
  data.num_features = 2;
  data.num_classes = 3;
  for (int64_t i = 0; i < size; ++i) {
    data.features.push_back(static_cast<float>(i));
    data.features.push_back(static_cast<float>(10 * i));
    data.labels.push_back(static_cast<int32_t>(i % 3));
  }
  return InMemorySource(std::move(data));
}

EpochPlan MakePlan(int64_t size) {
  EpochPlan::Options options;
  options.num_examples = size;
  options.worker_batch = 4;
  options.num_workers = 2;
  options.worker_index = 1;
  options.seed = 7;
  absl::StatusOr<EpochPlan> plan = EpochPlan::Create(options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return *std::move(plan);
}

// Taken batches equal what a plain gather from the plan gives, step for
// step, whether the step was prefetched, prefetched wrongly (a worker that
// catches up skips steps), or not at all; across epoch boundaries.
TEST(BatchPrefetcherTest, TakesTheBatchOfTheAskedStep) {
  const int64_t size = 37;  // 4 steps an epoch, 5 examples left out
  InMemorySource source = MakeSource(size);
  EpochPlan reference_plan = MakePlan(size);
  EpochPlan plan = MakePlan(size);
  BatchPrefetcher prefetcher(plan, source, 4);
  std::vector<float> features(8), expected_features(8);
  std::vector<int32_t> labels(4), expected_labels(4);
  struct Case {
    int64_t prefetched;  // -1: none
    int64_t taken;
  };
  for (const Case& c : std::vector<Case>{
           {0, 0}, {1, 1}, {2, 5}, {-1, 6}, {7, 7}, {8, 8}, {9, 12}}) {
    if (c.prefetched >= 0) prefetcher.Prefetch(c.prefetched);
    ASSERT_TRUE(prefetcher.Take(c.taken, features, labels).ok());
    ASSERT_TRUE(source
                    .Gather(reference_plan.WorkerIndices(c.taken),
                            expected_features.data(), expected_labels.data())
                    .ok());
    EXPECT_EQ(features, expected_features) << "step " << c.taken;
    EXPECT_EQ(labels, expected_labels) << "step " << c.taken;
  }
}

// A source that tells when it has been gathered from.
class WatchedSource : public ExampleSource {
 public:
  explicit WatchedSource(InMemorySource source) : source_(std::move(source)) {}
  int64_t size() const override { return source_.size(); }
  int64_t num_features() const override { return source_.num_features(); }
  int64_t num_classes() const override { return source_.num_classes(); }
  absl::Status Gather(absl::Span<const int64_t> indices, float* features,
                      int32_t* labels) const override {
    absl::Status status = source_.Gather(indices, features, labels);
    if (!gathered_.HasBeenNotified()) gathered_.Notify();
    return status;
  }
  int64_t resident_bytes() const override { return source_.resident_bytes(); }
  bool WaitForGather(absl::Duration timeout) const {
    return gathered_.WaitForNotificationWithTimeout(timeout);
  }

 private:
  InMemorySource source_;
  mutable absl::Notification gathered_;
};

// The gather happens on the data thread as soon as it is asked for, not
// when the training thread takes the batch.
TEST(BatchPrefetcherTest, GathersBeforeTheBatchIsTaken) {
  WatchedSource source(MakeSource(37));
  EpochPlan plan = MakePlan(37);
  BatchPrefetcher prefetcher(plan, source, 4);
  prefetcher.Prefetch(2);
  EXPECT_TRUE(source.WaitForGather(absl::Seconds(30)))
      << "nothing gathered until Take";
  std::vector<float> features(8);
  std::vector<int32_t> labels(4);
  EXPECT_TRUE(prefetcher.Take(2, features, labels).ok());
}

}  // namespace
}  // namespace pstrain
