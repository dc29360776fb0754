#include "ps_server/shard.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/protocol.h"
#include "common/transport/tensor_codec.h"
#include "common/transport/wire.h"
#include "gtest/gtest.h"
#include "ps_server/checkpoint.h"

namespace pstrain {
namespace {

// One tensor "w" of 6 elements in blocks of 4 ([0,4) and [4,6)), plus "b"
// of 2: three blocks in all.
ModelSchema TestSchema() {
  ModelSchema schema;
  schema.set_seed(3);
  schema.set_block_elements(4);
  DenseTensorSpec* w = schema.add_dense();
  w->set_name("w");
  w->add_shape(2);
  w->add_shape(3);
  w->mutable_init()->set_kind(InitSpec::CONSTANT);
  w->mutable_init()->set_value(1.0f);
  DenseTensorSpec* b = schema.add_dense();
  b->set_name("b");
  b->add_shape(2);
  return schema;
}

struct Fixture {
  std::unique_ptr<Shard> shard;
  ShardOptions options;
};

Fixture MakeShard(ConsistencyMode mode, int num_workers, int shard_id = 0,
                  int num_shards = 1) {
  Fixture f;
  f.options.mode = mode;
  f.options.num_workers = num_workers;
  f.options.shard_id = shard_id;
  f.options.num_shards = num_shards;
  f.options.optimizer.learning_rate = 0.5f;
  f.options.max_pull_wait = absl::Seconds(5);
  absl::StatusOr<std::unique_ptr<Shard>> shard = Shard::Create(f.options);
  EXPECT_TRUE(shard.ok()) << shard.status();
  f.shard = std::move(*shard);
  RegisterModelRequest request;
  request.set_protocol_version(kProtocolVersion);
  *request.mutable_schema() = TestSchema();
  request.set_num_shards(num_shards);
  request.set_num_workers(num_workers);
  absl::StatusOr<RegisterModelResponse> registered = f.shard->Register(request);
  EXPECT_TRUE(registered.ok()) << registered.status();
  return f;
}

// A push carrying `value` for every element of every block of shard 0 of 1,
// serialized and parsed back as the service does.
struct Push {
  std::string bytes;
  WirePushRequest wire;
};

std::unique_ptr<Push> Encode(const PushRequest& request) {
  auto push = std::make_unique<Push>();
  push->bytes = request.SerializeAsString();
  const absl::string_view view = push->bytes;
  absl::StatusOr<WirePushRequest> wire =
      ParsePushRequest(absl::MakeConstSpan(&view, 1));
  EXPECT_TRUE(wire.ok()) << wire.status();
  push->wire = std::move(*wire);
  return push;
}

PushRequest UniformPush(int worker, int64_t step, float value,
                        int64_t pulled_version = 0) {
  PushRequest push;
  push.set_protocol_version(kProtocolVersion);
  push.set_worker_id(worker);
  push.set_step(step);
  const std::vector<std::pair<std::string, int>> blocks = {
      {"w", 4}, {"w", 2}, {"b", 2}};
  int64_t index = 0;
  for (const auto& [name, length] : blocks) {
    TensorBlock* block = push.add_blocks();
    block->set_tensor(name);
    block->set_block(name == "w" ? index++ : 0);
    block->set_version(pulled_version);
    EncodeFloat32(std::vector<float>(length, value), block->mutable_data());
  }
  return push;
}

absl::StatusOr<PushResponse> DoPush(
    Shard& shard, const PushRequest& request,
    absl::Time hold_until = absl::InfinitePast()) {
  return shard.Push(Encode(request)->wire, hold_until);
}

PullRequest PullAt(int worker, int64_t step) {
  PullRequest pull;
  pull.set_protocol_version(kProtocolVersion);
  pull.set_worker_id(worker);
  pull.set_step(step);
  return pull;
}

// A pull's answer, which may arrive on another thread.
struct PullResult {
  absl::Notification done;
  absl::Status status;
  std::vector<PulledBlock> blocks;

  Shard::PullDone Callback() {
    return [this](absl::Status s, std::vector<PulledBlock> b) {
      status = std::move(s);
      blocks = std::move(b);
      done.Notify();
    };
  }
  // Element 0 of the first block ("w" block 0).
  float FirstWeight() const { return blocks.at(0).values->at(0); }
};

absl::Time Soon() { return absl::Now() + absl::Seconds(5); }

// Pulls and waits for the answer (bounded: the shard answers by `deadline`).
std::unique_ptr<PullResult> DoPull(Shard& shard, const PullRequest& request,
                                   absl::Time deadline) {
  auto result = std::make_unique<PullResult>();
  shard.Pull(request, deadline, result->Callback());
  EXPECT_TRUE(result->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  return result;
}

TEST(ShardSyncTest, AppliesTheMeanOnceWhenEveryWorkerHasPushed) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 2);
  absl::StatusOr<PushResponse> pushed = DoPush(*f.shard, UniformPush(0, 0, 1));
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(pushed->blocks_applied(), 3);
  EXPECT_EQ(f.shard->Stats().version(), 0);  // waiting for worker 1
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, 0, 3)).ok());
  EXPECT_EQ(f.shard->Stats().version(), 1);
  auto pulled = DoPull(*f.shard, PullAt(0, 1), Soon());
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  ASSERT_EQ(pulled->blocks.size(), 3u);
  EXPECT_EQ(pulled->blocks[0].version, 1);
  EXPECT_FLOAT_EQ(pulled->FirstWeight(), 0.0f);  // 1 - 0.5 * mean(1, 3)
}

TEST(ShardSyncTest, RepeatedPushIsAcknowledgedNotApplied) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 2);
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 0, 1)).ok());
  absl::StatusOr<PushResponse> repeat =
      DoPush(*f.shard, UniformPush(0, 0, 100));
  ASSERT_TRUE(repeat.ok());
  EXPECT_EQ(repeat->blocks_duplicate(), 3);
  EXPECT_EQ(repeat->blocks_applied(), 0);
  EXPECT_EQ(f.shard->Stats().version(), 0);  // a repeat must not complete it
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, 0, 3)).ok());
  // A retry of a finished step is a duplicate too.
  absl::StatusOr<PushResponse> late = DoPush(*f.shard, UniformPush(1, 0, 3));
  ASSERT_TRUE(late.ok());
  EXPECT_EQ(late->blocks_duplicate(), 3);
  auto pulled = DoPull(*f.shard, PullAt(1, 1), Soon());
  ASSERT_TRUE(pulled->status.ok());
  EXPECT_FLOAT_EQ(pulled->FirstWeight(), 0.0f);
  EXPECT_EQ(f.shard->Stats().blocks_duplicate(), 6);
  EXPECT_EQ(f.shard->Stats().blocks_applied(), 6);
}

TEST(ShardSyncTest, PullWaitsForTheStepAndIsReleasedByTheLastPush) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 2);
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 0, 1)).ok());
  PullResult result;
  f.shard->Pull(PullAt(0, 1), Soon(), result.Callback());
  EXPECT_FALSE(result.done.HasBeenNotified());  // waits: no thread held
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, 0, 3)).ok());
  ASSERT_TRUE(result.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(result.status.ok()) << result.status;
  EXPECT_EQ(result.blocks[0].version, 1);
  EXPECT_FLOAT_EQ(result.FirstWeight(), 0.0f);
}

TEST(ShardSyncTest, BlocksCompleteIndependently) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 2);
  // Both workers push only "b": that block moves on, "w" stays at step 0.
  for (int worker = 0; worker < 2; ++worker) {
    PushRequest push = UniformPush(worker, 0, 2);
    push.mutable_blocks()->DeleteSubrange(0, 2);
    ASSERT_TRUE(DoPush(*f.shard, push).ok());
  }
  PullRequest only_b = PullAt(0, 1);
  BlockRef* ref = only_b.add_blocks();
  ref->set_tensor("b");
  ref->set_block(0);
  auto pulled = DoPull(*f.shard, only_b, Soon());
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  EXPECT_FLOAT_EQ((*pulled->blocks[0].values)[0], -1.0f);  // 0 - 0.5 * 2
  EXPECT_EQ(f.shard->Stats().version(), 0);                // the slowest block
}

// What a checkpoint of `original` restores: its blocks, and (a file from
// before sparse checkpoints) no table rows.
RestoredShard RestoredFrom(const Shard& original) {
  absl::StatusOr<ShardSnapshot> snapshot = original.Snapshot(0);
  EXPECT_TRUE(snapshot.ok());
  RestoredShard restored;
  restored.schema = snapshot->schema;
  restored.mode = snapshot->mode;
  restored.optimizer = snapshot->optimizer;
  restored.blocks = snapshot->blocks;
  return restored;
}

// A member pulling step 1 must have pushed step 0. A restored shard that
// does not have the gradient lost it in its crash, and must not wait for it;
// any other shard must wait, or a client pulling before it pushes would
// complete a step without its gradient.
TEST(ShardSyncTest, OnlyARestoredShardAccountsForALostGradient) {
  Fixture original = MakeShard(ConsistencyMode::kSync, 2);
  auto shard = std::move(*Shard::Create(original.options));
  ASSERT_TRUE(shard->Restore(RestoredFrom(*original.shard)).ok());
  ASSERT_TRUE(DoPush(*shard, UniformPush(1, 0, 2)).ok());
  auto pulled = DoPull(*shard, PullAt(0, 1), Soon());
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  EXPECT_EQ(pulled->blocks[0].version, 1);
  EXPECT_FLOAT_EQ(pulled->FirstWeight(), 0.0f);   // 1 - 0.5 * 2 (worker 1's)
  EXPECT_EQ(shard->Stats().gradients_lost(), 3);  // one per block

  // The shard that never crashed waits for worker 0's gradient instead.
  ASSERT_TRUE(DoPush(*original.shard, UniformPush(1, 0, 2)).ok());
  auto waited = DoPull(*original.shard, PullAt(0, 1),
                       absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(waited->status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(original.shard->Stats().gradients_lost(), 0);
}

// The pull half of a PushPull vouches only for its own blocks: the
// worker's pushes to this shard's other blocks may still be on their way
// (another connection, or queued behind this pull), so a restored shard
// must not count them as lost and drop them when they come.
TEST(ShardSyncTest, APullThatFollowsItsOwnPushCreditsNoLostGradient) {
  Fixture original = MakeShard(ConsistencyMode::kSync, 2);
  auto shard = std::move(*Shard::Create(original.options));
  ASSERT_TRUE(shard->Restore(RestoredFrom(*original.shard)).ok());
  ASSERT_TRUE(DoPush(*shard, UniformPush(1, 0, 2)).ok());
  PullResult waiting;
  shard->Pull(PullAt(0, 1), absl::Now() + absl::Seconds(30), waiting.Callback(),
              /*follows_own_push=*/true);
  EXPECT_FALSE(waiting.done.HasBeenNotified());
  EXPECT_EQ(shard->Stats().gradients_lost(), 0);
  // Worker 0's gradient arrives after its pull: applied, and the step is
  // the mean of both.
  absl::StatusOr<PushResponse> pushed = DoPush(*shard, UniformPush(0, 0, 4));
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(pushed->blocks_applied(), 3);
  EXPECT_EQ(pushed->blocks_duplicate(), 0);
  ASSERT_TRUE(waiting.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(waiting.status.ok()) << waiting.status;
  EXPECT_FLOAT_EQ(waiting.FirstWeight(), -0.5f);  // 1 - 0.5 * mean(2, 4)
  EXPECT_EQ(shard->Stats().gradients_lost(), 0);
}

// A restored shard at step 0 whose previous life had completed step 0: a
// worker that pulled step 1 from that life pushes step 1 here. Its step 0
// gradient was lost with the crash, not missing.
std::unique_ptr<Shard> RestoredAtStepZero(const Fixture& original) {
  auto shard = std::move(*Shard::Create(original.options));
  EXPECT_TRUE(shard->Restore(RestoredFrom(*original.shard)).ok());
  return shard;
}

TEST(ShardSyncTest, PushFromAPreviousLifeCompletesTheRestoredStep) {
  Fixture original = MakeShard(ConsistencyMode::kSync, 2);
  std::unique_ptr<Shard> shard = RestoredAtStepZero(original);
  PullResult waiting;  // worker 1 asks first: it credits only itself
  shard->Pull(PullAt(1, 1), Soon(), waiting.Callback());
  EXPECT_FALSE(waiting.done.HasBeenNotified());
  absl::StatusOr<PushResponse> pushed =
      DoPush(*shard, UniformPush(0, 1, 2, /*pulled_version=*/1));
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(pushed->blocks_applied(), 3);
  ASSERT_TRUE(waiting.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(waiting.status.ok()) << waiting.status;
  EXPECT_EQ(waiting.blocks[0].version, 1);
  EXPECT_FLOAT_EQ(waiting.FirstWeight(), 1.0f);  // step 0 had no gradient left
  EXPECT_EQ(shard->Stats().gradients_lost(), 6);
}

// Step 0 also waits for a member that has not spoken since the restore: the
// early push is refused as retryable and goes through once step 0 is done.
TEST(ShardSyncTest, PushFromAPreviousLifeRetriesUntilTheStepCompletes) {
  Fixture original = MakeShard(ConsistencyMode::kSync, 3);
  std::unique_ptr<Shard> shard = RestoredAtStepZero(original);
  ASSERT_TRUE(DoPush(*shard, UniformPush(2, 0, 3)).ok());  // a laggard
  absl::StatusOr<PushResponse> early =
      DoPush(*shard, UniformPush(0, 1, 2, /*pulled_version=*/1));
  EXPECT_EQ(early.status().code(), absl::StatusCode::kUnavailable)
      << early.status();
  EXPECT_NE(early.status().message().find("workers [1]"), std::string::npos)
      << early.status();
  EXPECT_EQ(shard->Stats().blocks_applied(), 3);  // only the laggard's

  auto pulled = DoPull(*shard, PullAt(1, 1), Soon());
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  EXPECT_FLOAT_EQ(pulled->FirstWeight(), -0.5f);  // 1 - 0.5 * 3 (worker 2's)
  absl::StatusOr<PushResponse> retried =
      DoPush(*shard, UniformPush(0, 1, 2, /*pulled_version=*/1));
  ASSERT_TRUE(retried.ok()) << retried.status();
  EXPECT_EQ(retried->blocks_applied(), 3);
}

// The data plane's form of the case above: a connection answers in order,
// so worker 0's refused push would be retried only after its next calls
// there, which wait for worker 1's pushes queued behind worker 1's own
// wait. Held instead, the push goes through as soon as step 0 completes.
TEST(ShardSyncTest, AHeldPushFromAPreviousLifeWaitsForTheRestoredStep) {
  Fixture original = MakeShard(ConsistencyMode::kSync, 3);
  std::unique_ptr<Shard> shard = RestoredAtStepZero(original);
  ASSERT_TRUE(DoPush(*shard, UniformPush(2, 0, 3)).ok());  // a laggard
  // Until the hold runs out, then refused as without one.
  absl::StatusOr<PushResponse> early =
      DoPush(*shard, UniformPush(0, 1, 2, /*pulled_version=*/1),
             absl::Now() + absl::Milliseconds(30));
  EXPECT_EQ(early.status().code(), absl::StatusCode::kUnavailable)
      << early.status();
  absl::StatusOr<PushResponse> held;
  absl::Notification pushed;
  std::thread pusher([&] {
    held = DoPush(*shard, UniformPush(0, 1, 2, /*pulled_version=*/1),
                  absl::Now() + absl::Seconds(30));
    pushed.Notify();
  });
  EXPECT_FALSE(pushed.WaitForNotificationWithTimeout(absl::Milliseconds(50)));
  auto pulled = DoPull(*shard, PullAt(1, 1), Soon());  // worker 1 was ahead
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  ASSERT_TRUE(pushed.WaitForNotificationWithTimeout(absl::Seconds(10)));
  pusher.join();
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(held->blocks_applied(), 3);
}

HeartbeatRequest HeartbeatAt(int worker, int64_t pulled_step) {
  HeartbeatRequest request;
  request.set_worker_id(worker);
  request.set_step(pulled_step);
  return request;
}

// A worker that found another shard a step ahead of this one (its lease ran
// out there) skips that step everywhere: here the step completes with the
// other worker's gradient alone, short, and nothing counted as lost. Only a
// skip of the step this shard waits in, and only this worker's part.
TEST(ShardSyncTest, ASkippedStepCompletesShortWithTheOthersGradients) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 2);
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, 0, 2)).ok());
  HeartbeatRequest skip = HeartbeatAt(0, 1);
  ASSERT_TRUE(f.shard->Heartbeat(skip).ok());  // a heartbeat alone: waits
  EXPECT_EQ(f.shard->Stats().version(), 0);
  skip.set_skip_to_step(5);  // not the step it waits in: nothing
  ASSERT_TRUE(f.shard->Heartbeat(skip).ok());
  EXPECT_EQ(f.shard->Stats().version(), 0);
  skip.set_skip_to_step(1);
  ASSERT_TRUE(f.shard->Heartbeat(skip).ok());
  auto pulled = DoPull(*f.shard, PullAt(1, 1), Soon());
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  EXPECT_EQ(pulled->blocks[0].version, 1);
  EXPECT_FLOAT_EQ(pulled->FirstWeight(), 0.0f);  // 1 - 0.5 * 2 (worker 1's)
  const StatsResponse stats = f.shard->Stats();
  EXPECT_EQ(stats.steps_short(), 1);
  EXPECT_EQ(stats.gradients_lost(), 0);
  // Its push of the skipped step, should one come, is not applied.
  absl::StatusOr<PushResponse> late = DoPush(*f.shard, UniformPush(0, 0, 9));
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ(late->blocks_applied(), 0);
}

// A CI hang: the restored shard took step 0 and worker 0 pushed it; worker
// 1 had pushed step 0 to the previous life and pulled step 1, and now waits
// in another shard's step 1 for worker 0, who waits here. Worker 1 sends
// this shard nothing but heartbeats, which say it pulled step 1: its step 0
// gradient is lost, and the step completes.
TEST(ShardSyncTest, AHeartbeatFromAPreviousLifeCompletesTheRestoredStep) {
  Fixture original = MakeShard(ConsistencyMode::kSync, 2);
  std::unique_ptr<Shard> shard = RestoredAtStepZero(original);
  ASSERT_TRUE(DoPush(*shard, UniformPush(0, 0, 2)).ok());
  PullResult waiting;
  shard->Pull(PullAt(0, 1), Soon(), waiting.Callback(),
              /*follows_own_push=*/true);
  ASSERT_TRUE(shard->Heartbeat(HeartbeatAt(1, 0)).ok());  // says nothing
  EXPECT_FALSE(waiting.done.HasBeenNotified());
  ASSERT_TRUE(shard->Heartbeat(HeartbeatAt(1, 1)).ok());
  ASSERT_TRUE(waiting.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(waiting.status.ok()) << waiting.status;
  EXPECT_FLOAT_EQ(waiting.FirstWeight(), 0.0f);   // 1 - 0.5 * 2 (worker 0's)
  EXPECT_EQ(shard->Stats().gradients_lost(), 3);  // one per block
  // Worker 1 goes on with step 1, as in a shard that never crashed.
  ASSERT_TRUE(DoPush(*shard, UniformPush(1, 1, 2, /*pulled_version=*/1)).ok());
  EXPECT_EQ(shard->Stats().gradients_lost(), 3);
}

// A sync shard whose leases lapse after `lease` without a request.
Fixture MakeLeasedShard(int num_workers, absl::Duration lease) {
  Fixture f;
  f.options.num_workers = num_workers;
  f.options.optimizer.learning_rate = 0.5f;
  f.options.max_pull_wait = absl::Seconds(5);
  f.options.worker_lease = lease;
  absl::StatusOr<std::unique_ptr<Shard>> shard = Shard::Create(f.options);
  EXPECT_TRUE(shard.ok()) << shard.status();
  f.shard = std::move(*shard);
  RegisterModelRequest request;
  request.set_protocol_version(kProtocolVersion);
  *request.mutable_schema() = TestSchema();
  request.set_num_shards(1);
  request.set_num_workers(num_workers);
  request.set_worker_id(-1);
  EXPECT_TRUE(f.shard->Register(request).ok());
  return f;
}

// Waits (bounded) until every lease has lapsed and the reaper has acted.
void WaitUntilNoMembers(Shard& shard) {
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (shard.Stats().members() != 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(shard.Stats().members(), 0);
}

// Issue 14: after every lease lapsed, a step that already holds gradients
// has nobody left to wait for. It used to wait forever (its quorum was
// empty, and a returning worker rejoins at the next step), so every pull of
// the next step timed out for good.
TEST(ShardLeaseTest, AStepCompletesWhenEveryLeaseLapsedAfterAPush) {
  Fixture f = MakeLeasedShard(2, absl::Milliseconds(100));
  ASSERT_TRUE(DoPull(*f.shard, PullAt(0, 0), Soon())->status.ok());
  ASSERT_TRUE(DoPull(*f.shard, PullAt(1, 0), Soon())->status.ok());
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 0, 1)).ok());
  WaitUntilNoMembers(*f.shard);
  absl::StatusOr<PushResponse> pushed = DoPush(*f.shard, UniformPush(1, 0, 3));
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  // Applied with worker 0's, or late when the lapse already completed it
  // with worker 0's alone: either way step 0 is applied once.
  EXPECT_EQ(pushed->blocks_applied() + pushed->blocks_late(), 3);
  for (int worker = 0; worker < 2; ++worker) {
    auto pulled = DoPull(*f.shard, PullAt(worker, 1), Soon());
    ASSERT_TRUE(pulled->status.ok()) << pulled->status;
    EXPECT_EQ(pulled->blocks[0].version, 1);
  }
  // Both are members again, at step 1: it needs both gradients.
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 1, 1)).ok());
  EXPECT_EQ(f.shard->Stats().version(), 1);
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, 1, 1)).ok());
  EXPECT_EQ(f.shard->Stats().version(), 2);
}

TEST(ShardLeaseTest, AStepCompletesWhenEveryLeaseLapsedBeforeAnyPush) {
  Fixture f = MakeLeasedShard(2, absl::Milliseconds(100));
  ASSERT_TRUE(DoPull(*f.shard, PullAt(0, 0), Soon())->status.ok());
  ASSERT_TRUE(DoPull(*f.shard, PullAt(1, 0), Soon())->status.ok());
  WaitUntilNoMembers(*f.shard);
  EXPECT_EQ(f.shard->Stats().version(), 0);  // nothing to apply yet
  // The first gradient back completes the step (nobody else is a member),
  // and the second is late: step 0 is applied once, from worker 1's.
  absl::StatusOr<PushResponse> first = DoPush(*f.shard, UniformPush(1, 0, 3));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->blocks_applied(), 3);
  EXPECT_EQ(f.shard->Stats().version(), 1);
  absl::StatusOr<PushResponse> second = DoPush(*f.shard, UniformPush(0, 0, 1));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->blocks_late(), 3);
  auto pulled = DoPull(*f.shard, PullAt(0, 1), Soon());
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  EXPECT_FLOAT_EQ(pulled->FirstWeight(), -0.5f);  // 1 - 0.5 * 3
}

// A catch-up holds heartbeats with every other change while the state is
// sent; the lease clock stands still meanwhile, so a transfer longer than
// a lease costs no worker its membership. Released, leases lapse as before.
TEST(ShardLeaseTest, NoLeaseLapsesWhileTheClockIsHeld) {
  Fixture f = MakeLeasedShard(2, absl::Milliseconds(100));
  ASSERT_TRUE(DoPull(*f.shard, PullAt(0, 0), Soon())->status.ok());
  ASSERT_TRUE(DoPull(*f.shard, PullAt(1, 0), Soon())->status.ok());
  f.shard->HoldLeaseClock(true);
  // Five leases of wall time, the reaper ticking every 20 ms.
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_EQ(f.shard->Stats().members(), 2);
  f.shard->HoldLeaseClock(false);
  WaitUntilNoMembers(*f.shard);  // the clock runs again
}

TEST(ShardLeaseTest, ALoneWorkerSlowerThanItsLeaseStillCompletesItsStep) {
  Fixture f = MakeLeasedShard(1, absl::Milliseconds(100));
  for (int64_t step = 0; step < 3; ++step) {
    auto pulled = DoPull(*f.shard, PullAt(0, step), Soon());
    ASSERT_TRUE(pulled->status.ok()) << pulled->status;
    EXPECT_EQ(pulled->blocks[0].version, step);
    WaitUntilNoMembers(*f.shard);
    absl::StatusOr<PushResponse> pushed =
        DoPush(*f.shard, UniformPush(0, step, 1));
    ASSERT_TRUE(pushed.ok()) << pushed.status();
    EXPECT_EQ(pushed->blocks_applied(), 3);
    EXPECT_EQ(f.shard->Stats().version(), step + 1);
  }
}

// Gradients of a lapsed worker are in the sum, but they do not stand in
// for a member's: the step still waits for every member it counts.
TEST(ShardLeaseTest, ALapsedWorkersGradientDoesNotReplaceAMembers) {
  Fixture f = MakeLeasedShard(3, absl::Seconds(600));
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 0, 1)).ok());
  LeaveRequest leave;
  leave.set_worker_id(0);
  ASSERT_TRUE(f.shard->Leave(leave).ok());
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, 0, 1)).ok());
  EXPECT_EQ(f.shard->Stats().version(), 0);  // worker 2 is still a member
  auto waited =
      DoPull(*f.shard, PullAt(1, 1), absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(waited->status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(waited->status.message().find("workers [2]"), std::string::npos)
      << waited->status;
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(2, 0, 4)).ok());
  EXPECT_EQ(f.shard->Stats().version(), 1);
  auto pulled = DoPull(*f.shard, PullAt(1, 1), Soon());
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  EXPECT_FLOAT_EQ(pulled->FirstWeight(), 0.0f);  // 1 - 0.5 * mean(1, 1, 4)
}

absl::StatusOr<RegisterModelResponse> RegisterWorker(Shard& shard,
                                                     int num_workers,
                                                     int worker);

// A worker that stops on a signal leaves "stopping" (LeaveRequest.stopping),
// telling the grace its stop gave its step.
void LeaveStopping(Shard& shard, int worker,
                   absl::Duration grace = absl::ZeroDuration()) {
  LeaveRequest leave;
  leave.set_worker_id(worker);
  leave.set_stopping(true);
  leave.set_stopping_grace_s(absl::ToDoubleSeconds(grace));
  ASSERT_TRUE(shard.Leave(leave).ok());
}

// Two workers past step 0; worker 1 pushed step 1, worker 0 stopped before
// pushing it (left stopping).
void StopOneWorkerInStepOne(Shard& shard,
                            absl::Duration grace = absl::ZeroDuration()) {
  for (int worker : {0, 1}) {
    ASSERT_TRUE(DoPush(shard, UniformPush(worker, 0, 1)).ok());
  }
  ASSERT_TRUE(DoPush(shard, UniformPush(1, 1, 1, /*pulled_version=*/1)).ok());
  LeaveStopping(shard, 0, grace);
  EXPECT_EQ(shard.Stats().version(), 1);  // a plain leave completes it
}

// The whole job stopping: worker 1 pushed step 1, worker 0 stopped before
// pushing it. Neither's leave completes step 1 short, however long the
// servers stay up, and a late request of worker 0 (its data plane's, still
// on its way) does not bring it back. Resumed with the servers kept, worker
// 0 registers again and pushes step 1: the step completes whole.
TEST(ShardLeaseTest, WorkersThatLeaveStoppingHoldTheirStep) {
  Fixture f = MakeLeasedShard(2, absl::Milliseconds(300));
  ASSERT_NO_FATAL_FAILURE(StopOneWorkerInStepOne(*f.shard));
  LeaveStopping(*f.shard, 1);
  HeartbeatRequest late;
  late.set_worker_id(0);
  ASSERT_TRUE(f.shard->Heartbeat(late).ok());
  // Several holds and leases go by (the behaviour under test is that
  // nothing happens in them).
  absl::SleepFor(absl::Seconds(1));
  EXPECT_EQ(f.shard->Stats().version(), 1);
  EXPECT_EQ(f.shard->Stats().steps_short(), 0);
  EXPECT_EQ(f.shard->Stats().members(), 2);

  ASSERT_TRUE(RegisterWorker(*f.shard, 2, 0).ok());
  ASSERT_TRUE(
      DoPush(*f.shard, UniformPush(0, 1, 1, /*pulled_version=*/1)).ok());
  EXPECT_EQ(f.shard->Stats().version(), 2);
  EXPECT_EQ(f.shard->Stats().steps_short(), 0);
}

// One worker stopped (a scale-down by SIGTERM) while the other trains: the
// step waits for it only its hold, then completes without it.
TEST(ShardLeaseTest, AStoppingWorkerLapsesAfterItsHoldWhileAnotherTrains) {
  Fixture f = MakeLeasedShard(2, absl::Milliseconds(300));
  ASSERT_NO_FATAL_FAILURE(StopOneWorkerInStepOne(*f.shard));
  auto pulled = DoPull(*f.shard, PullAt(1, 2), Soon());
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  EXPECT_EQ(pulled->blocks[0].version, 2);
  EXPECT_EQ(f.shard->Stats().steps_short(), 1);
}

// The hold is 2 s beyond the grace the stopping worker's step had: the
// others, signalled with it, may take that long to end their steps (and
// then leave stopping too, holding the step for a resume).
TEST(ShardLeaseTest, AStoppingWorkersHoldFollowsItsGrace) {
  Fixture f = MakeLeasedShard(2, absl::Seconds(20));
  const absl::Time left = absl::Now();
  ASSERT_NO_FATAL_FAILURE(StopOneWorkerInStepOne(*f.shard, absl::Seconds(1)));
  auto pulled = DoPull(*f.shard, PullAt(1, 2), absl::Now() + absl::Seconds(8));
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  EXPECT_GE(absl::Now() - left, absl::Seconds(3));
  EXPECT_EQ(pulled->blocks[0].version, 2);
  EXPECT_EQ(f.shard->Stats().steps_short(), 1);
}

// The grace travels with the shard's state: a replica that caught up from
// it (between steps: worker 0 stopped after step 0) and then took over
// holds the stopped worker as long when worker 1 pushes step 1.
TEST(ShardLeaseTest, AStoppingWorkersGraceTravelsToAReplica) {
  Fixture f = MakeLeasedShard(2, absl::Seconds(20));
  for (int worker : {0, 1}) {
    ASSERT_TRUE(DoPush(*f.shard, UniformPush(worker, 0, 1)).ok());
  }
  LeaveStopping(*f.shard, 0, absl::Seconds(1));
  absl::StatusOr<ReplicaStateExport> state =
      f.shard->ExportReplicaState(/*chunk_bytes=*/24);
  ASSERT_TRUE(state.ok()) << state.status();
  absl::StatusOr<std::unique_ptr<Shard>> replica = Shard::Create(f.options);
  ASSERT_TRUE(replica.ok()) << replica.status();
  for (size_t c = 0; c < state->chunks.size(); ++c) {
    ASSERT_TRUE((*replica)
                    ->ImportReplicaChunk(state->chunks[c],
                                         absl::StrJoin(state->floats[c], ""))
                    .ok());
  }
  (*replica)->set_leads_steps([] { return true; });
  const absl::Time took_over = absl::Now();
  (*replica)->CompleteStepsNowLeading();
  ASSERT_TRUE(
      DoPush(**replica, UniformPush(1, 1, 1, /*pulled_version=*/1)).ok());
  auto pulled = DoPull(**replica, PullAt(1, 2), absl::Now() + absl::Seconds(8));
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  EXPECT_GE(absl::Now() - took_over, absl::Seconds(3));
  EXPECT_EQ((*replica)->Stats().steps_short(), 1);
}

TEST(ShardLeaseTest, AStoppingLeaveWithABadGraceIsRefused) {
  Fixture f = MakeLeasedShard(2, absl::Seconds(20));
  for (const double grace_s : {-1.0, std::nan(""), 1e9}) {
    LeaveRequest leave;
    leave.set_worker_id(0);
    leave.set_stopping(true);
    leave.set_stopping_grace_s(grace_s);
    const absl::Status left = f.shard->Leave(leave);
    EXPECT_TRUE(absl::IsInvalidArgument(left)) << grace_s << ": " << left;
    EXPECT_TRUE(absl::StrContains(left.message(), "stopping_grace_s")) << left;
  }
  EXPECT_EQ(f.shard->Stats().members(), 2);  // nothing changed
}

// ---------------------------------------------------------------------------
// The job's start (issue 27): sync and ssp steps wait for every expected
// worker; a worker never heard from is missing, not lapsed.

Fixture MakeStartingShard(ConsistencyMode mode, int num_workers,
                          absl::Duration lease, absl::Duration startup_timeout,
                          int min_workers = 0) {
  Fixture f;
  f.options.mode = mode;
  f.options.num_workers = num_workers;
  f.options.min_workers = min_workers;
  f.options.ssp_staleness = 1;
  f.options.optimizer.learning_rate = 0.5f;
  f.options.max_pull_wait = absl::Seconds(5);
  f.options.worker_lease = lease;
  f.options.startup_timeout = startup_timeout;
  absl::StatusOr<std::unique_ptr<Shard>> shard = Shard::Create(f.options);
  EXPECT_TRUE(shard.ok()) << shard.status();
  f.shard = std::move(*shard);
  return f;
}

absl::StatusOr<RegisterModelResponse> RegisterWorker(Shard& shard,
                                                     int num_workers,
                                                     int worker) {
  RegisterModelRequest request;
  request.set_protocol_version(kProtocolVersion);
  *request.mutable_schema() = TestSchema();
  request.set_num_shards(1);
  request.set_num_workers(num_workers);
  request.set_worker_id(worker);
  request.set_incarnation(1000 + worker);
  return shard.Register(request);
}

// An AwaitJobStart call's answer, which may arrive on another thread.
struct StartResult {
  absl::Notification done;
  absl::StatusOr<JobStart> start;
};

std::unique_ptr<StartResult> AwaitStart(Shard& shard, int worker,
                                        absl::Duration wait) {
  auto result = std::make_unique<StartResult>();
  AwaitJobStartRequest request;
  request.set_worker_id(worker);
  request.set_wait_ms(absl::ToInt64Milliseconds(wait));
  StartResult* r = result.get();
  shard.AwaitJobStart(request, absl::Now() + absl::Seconds(30),
                      [r](absl::StatusOr<JobStart> start) {
                        r->start = std::move(start);
                        r->done.Notify();
                      });
  return result;
}

TEST(ShardStartTest, AWorkerNeverHeardFromIsWaitedForNotLapsed) {
  // Leases of 50 ms: an unseen worker 1 used to be dropped after them, and
  // step 0 completed from worker 0's gradient alone.
  Fixture f = MakeStartingShard(ConsistencyMode::kSync, 2,
                                absl::Milliseconds(50), absl::Seconds(60));
  ASSERT_TRUE(RegisterWorker(*f.shard, 2, 0).ok());
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 0, 1)).ok());
  // An observer's wait ends at its own deadline: ten leases later, the
  // job has not started, and step 0 still waits for worker 1.
  auto waited = AwaitStart(*f.shard, -1, absl::Milliseconds(500));
  ASSERT_TRUE(waited->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(waited->start.ok()) << waited->start.status();
  EXPECT_FALSE(waited->start->started());
  ASSERT_EQ(waited->start->missing_workers_size(), 1);
  EXPECT_EQ(waited->start->missing_workers(0), 1);
  EXPECT_GE(waited->start->waited_s(), 0.5);
  EXPECT_EQ(f.shard->Stats().version(), 0);

  ASSERT_TRUE(RegisterWorker(*f.shard, 2, 1).ok());
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, 0, 3)).ok());
  auto pulled = DoPull(*f.shard, PullAt(1, 1), Soon());
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  EXPECT_FLOAT_EQ(pulled->FirstWeight(), 0.0f);  // 1 - 0.5 * mean(1, 3)
  const StatsResponse stats = f.shard->Stats();
  EXPECT_TRUE(stats.job_start().started());
  EXPECT_EQ(stats.steps_short(), 0);
}

TEST(ShardStartTest, AWaitEndsWhenTheLastWorkerRegisters) {
  Fixture f = MakeStartingShard(ConsistencyMode::kSync, 3, absl::Seconds(60),
                                absl::Seconds(60));
  ASSERT_TRUE(RegisterWorker(*f.shard, 3, 0).ok());
  ASSERT_TRUE(RegisterWorker(*f.shard, 3, 1).ok());
  // Held for up to 10 s (the server's cap), unless the start ends it.
  auto waiting = AwaitStart(*f.shard, 0, absl::Seconds(30));
  EXPECT_FALSE(waiting->done.HasBeenNotified());
  ASSERT_TRUE(RegisterWorker(*f.shard, 3, 2).ok());
  ASSERT_TRUE(waiting->done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(waiting->start.ok()) << waiting->start.status();
  EXPECT_TRUE(waiting->start->started());
  EXPECT_EQ(waiting->start->missing_workers_size(), 0);
  // A worker asking afterwards is answered at once.
  auto late = AwaitStart(*f.shard, 1, absl::Seconds(30));
  EXPECT_TRUE(late->done.HasBeenNotified());
  EXPECT_TRUE(late->start.ok() && late->start->started());
}

TEST(ShardStartTest, AWorkerThatLeftBeforeTheStartIsWaitedForAgain) {
  // Worker 0 registers and leaves (Ctrl-C while it waits for worker 1):
  // the job used to start when worker 1 came, and worker 1 trained alone.
  Fixture f = MakeStartingShard(ConsistencyMode::kSync, 2, absl::Seconds(60),
                                absl::Seconds(60));
  ASSERT_TRUE(RegisterWorker(*f.shard, 2, 0).ok());
  LeaveRequest leave;
  leave.set_worker_id(0);
  ASSERT_TRUE(f.shard->Leave(leave).ok());
  ASSERT_TRUE(RegisterWorker(*f.shard, 2, 1).ok());
  JobStart start = f.shard->Stats().job_start();
  EXPECT_FALSE(start.started());
  ASSERT_EQ(start.missing_workers_size(), 1);
  EXPECT_EQ(start.missing_workers(0), 0);
  // It comes back: the job starts.
  ASSERT_TRUE(RegisterWorker(*f.shard, 2, 0).ok());
  EXPECT_TRUE(f.shard->Stats().job_start().started());
}

TEST(ShardStartTest, TooFewWorkersByTheStartupTimeoutFailsTheJob) {
  Fixture f = MakeStartingShard(ConsistencyMode::kSync, 3, absl::Seconds(60),
                                absl::Milliseconds(200));
  ASSERT_TRUE(RegisterWorker(*f.shard, 3, 0).ok());
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 0, 1)).ok());
  PullResult pull;  // waits for step 0, which waits for workers 1 and 2
  f.shard->Pull(PullAt(0, 1), Soon(), pull.Callback());
  auto waiting = AwaitStart(*f.shard, 0, absl::Seconds(5));
  ASSERT_TRUE(waiting->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(waiting->start.status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(
      waiting->start.status().message().find("workers 1, 2 did not register"),
      std::string::npos)
      << waiting->start.status();
  // The waiting pull, and every later request, hear the same.
  ASSERT_TRUE(pull.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(pull.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(RegisterWorker(*f.shard, 3, 2).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(DoPush(*f.shard, UniformPush(0, 0, 1)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(f.shard->Stats().version(), 0);  // nothing applied
}

TEST(ShardStartTest, WithMinWorkersTheJobStartsWithoutTheMissingOnes) {
  Fixture f = MakeStartingShard(ConsistencyMode::kSync, 3, absl::Seconds(60),
                                absl::Milliseconds(200), /*min_workers=*/2);
  ASSERT_TRUE(RegisterWorker(*f.shard, 3, 0).ok());
  ASSERT_TRUE(RegisterWorker(*f.shard, 3, 1).ok());
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 0, 1)).ok());
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, 0, 3)).ok());
  EXPECT_EQ(f.shard->Stats().version(), 0);  // before the timeout: waits
  auto started = AwaitStart(*f.shard, 0, absl::Seconds(5));
  ASSERT_TRUE(started->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(started->start.ok()) << started->start.status();
  EXPECT_TRUE(started->start->started());
  ASSERT_EQ(started->start->missing_workers_size(), 1);
  EXPECT_EQ(started->start->missing_workers(0), 2);
  // The start completed step 0 from the two gradients it had.
  auto pulled = DoPull(*f.shard, PullAt(0, 1), Soon());
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  EXPECT_FLOAT_EQ(pulled->FirstWeight(), 0.0f);  // 1 - 0.5 * mean(1, 3)
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 1, 1)).ok());
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, 1, 1)).ok());
  EXPECT_EQ(f.shard->Stats().version(), 2);
  EXPECT_EQ(f.shard->Stats().steps_short(), 2);
  // Worker 2 comes after all: it joins at the job's step, and the steps
  // with all three are not short.
  absl::StatusOr<RegisterModelResponse> late = RegisterWorker(*f.shard, 3, 2);
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ(late->step(), 2);
  for (int worker = 0; worker < 3; ++worker) {
    ASSERT_TRUE(DoPull(*f.shard, PullAt(worker, 2), Soon())->status.ok());
  }
  for (int worker = 0; worker < 3; ++worker) {
    ASSERT_TRUE(DoPush(*f.shard, UniformPush(worker, 2, 1)).ok());
  }
  const StatsResponse stats = f.shard->Stats();
  EXPECT_EQ(stats.version(), 3);
  EXPECT_EQ(stats.steps_short(), 2);
  EXPECT_EQ(stats.job_start().missing_workers_size(), 0);
}

TEST(ShardStartTest, SspHoldsAWorkerAheadOfOneNeverHeardFrom) {
  Fixture f = MakeStartingShard(ConsistencyMode::kSsp, 2,
                                absl::Milliseconds(50), absl::Seconds(60));
  ASSERT_TRUE(RegisterWorker(*f.shard, 2, 0).ok());
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 0, 1)).ok());
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 1, 1)).ok());
  // Step 2 is two ahead of worker 1's clock 0 (staleness 1): it waits,
  // through many of the leases that used to drop the unseen worker.
  auto held =
      DoPull(*f.shard, PullAt(0, 2), absl::Now() + absl::Milliseconds(400));
  EXPECT_EQ(held->status.code(), absl::StatusCode::kDeadlineExceeded)
      << held->status;
  ASSERT_TRUE(RegisterWorker(*f.shard, 2, 1).ok());
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, 0, 1)).ok());
  auto pulled = DoPull(*f.shard, PullAt(0, 2), Soon());
  EXPECT_TRUE(pulled->status.ok()) << pulled->status;
}

TEST(ShardStartTest, AsyncAndRestoredShardsHaveStarted) {
  Fixture async = MakeStartingShard(ConsistencyMode::kAsync, 2,
                                    absl::Seconds(60), absl::Seconds(60));
  auto answer = AwaitStart(*async.shard, 0, absl::Seconds(5));
  ASSERT_TRUE(answer->done.HasBeenNotified());
  EXPECT_TRUE(answer->start.ok() && answer->start->started());

  // A restored shard's workers are coming back, not starting: each holds a
  // lease from the restore, as before this rule.
  Fixture original = MakeShard(ConsistencyMode::kSync, 2);
  ASSERT_TRUE(DoPush(*original.shard, UniformPush(0, 0, 1)).ok());
  ASSERT_TRUE(DoPush(*original.shard, UniformPush(1, 0, 1)).ok());
  original.options.startup_timeout = absl::Seconds(60);
  auto restored = std::move(*Shard::Create(original.options));
  ASSERT_TRUE(restored->Restore(RestoredFrom(*original.shard)).ok());
  answer = AwaitStart(*restored, 0, absl::Seconds(5));
  ASSERT_TRUE(answer->done.HasBeenNotified());
  EXPECT_TRUE(answer->start.ok() && answer->start->started());
}

TEST(ShardStartTest, StepsWithFewerGradientsThanWorkersAreCountedAsShort) {
  // Backup workers: 2 of 3 gradients complete a step.
  Fixture f = MakeShard(ConsistencyMode::kSync, 3);
  ShardOptions options = f.options;
  options.replicas_to_aggregate = 2;
  f.shard = std::move(*Shard::Create(options));
  for (int worker = 0; worker < 3; ++worker) {
    ASSERT_TRUE(RegisterWorker(*f.shard, 3, worker).ok());
  }
  for (int64_t step = 0; step < 3; ++step) {
    ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, step, 1)).ok());
    ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, step, 1)).ok());
  }
  EXPECT_EQ(f.shard->Stats().version(), 3);
  EXPECT_EQ(f.shard->Stats().steps_short(), 3);  // once per step, not block
}

// ---------------------------------------------------------------------------
// Tensors whose values come from a worker (issue 23): init PROVIDED is set
// once by Assign; a STATE tensor's pushes are values, averaged in sync.

// TestSchema with "w" PROVIDED and "b" STATE (and PROVIDED).
ModelSchema ProvidedSchema() {
  ModelSchema schema = TestSchema();
  schema.mutable_dense(0)->mutable_init()->set_kind(InitSpec::PROVIDED);
  schema.mutable_dense(1)->mutable_init()->set_kind(InitSpec::PROVIDED);
  schema.mutable_dense(1)->set_role(DenseTensorSpec::STATE);
  return schema;
}

Fixture MakeProvidedShard(ConsistencyMode mode, int num_workers) {
  Fixture f;
  f.options.mode = mode;
  f.options.num_workers = num_workers;
  f.options.optimizer.learning_rate = 0.5f;
  f.options.max_pull_wait = absl::Seconds(5);
  f.shard = std::move(*Shard::Create(f.options));
  for (int worker = 0; worker < num_workers; ++worker) {
    RegisterModelRequest request;
    request.set_protocol_version(kProtocolVersion);
    *request.mutable_schema() = ProvidedSchema();
    request.set_num_shards(1);
    request.set_num_workers(num_workers);
    request.set_worker_id(worker);
    EXPECT_TRUE(f.shard->Register(request).ok());
  }
  return f;
}

// "w" = 2 and "b" = 7 everywhere; or the whole push as `value`.
absl::StatusOr<PushResponse> DoAssign(Shard& shard, float value,
                                      int worker = 0) {
  return shard.Assign(Encode(UniformPush(worker, 0, value))->wire);
}

TEST(ShardProvidedTest, PullsWaitForTheAssignedValuesWhichAreSetOnce) {
  Fixture f = MakeProvidedShard(ConsistencyMode::kSync, 2);
  PullResult early;  // before any values: waits
  f.shard->Pull(PullAt(1, 0), Soon(), early.Callback());
  EXPECT_FALSE(early.done.HasBeenNotified());
  // Nothing may be pushed onto values that are not there yet.
  EXPECT_EQ(DoPush(*f.shard, UniformPush(1, 0, 1)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(f.shard->Snapshot(1).status().code(),
            absl::StatusCode::kFailedPrecondition);

  absl::StatusOr<PushResponse> assigned = DoAssign(*f.shard, 2.0f);
  ASSERT_TRUE(assigned.ok()) << assigned.status();
  EXPECT_EQ(assigned->blocks_applied(), 3);
  ASSERT_TRUE(early.done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  ASSERT_TRUE(early.status.ok()) << early.status;
  EXPECT_FLOAT_EQ(early.FirstWeight(), 2.0f);
  // A second Assign (a retry, a restarted worker 0) changes nothing.
  absl::StatusOr<PushResponse> again = DoAssign(*f.shard, 5.0f, 1);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->blocks_duplicate(), 3);
  auto pulled = DoPull(*f.shard, PullAt(0, 0), Soon());
  ASSERT_TRUE(pulled->status.ok());
  EXPECT_FLOAT_EQ(pulled->FirstWeight(), 2.0f);
  EXPECT_TRUE(f.shard->Snapshot(1).ok());
}

TEST(ShardProvidedTest, AssignTakesFiniteFloat32Only) {
  Fixture f = MakeProvidedShard(ConsistencyMode::kSync, 1);
  PushRequest half = UniformPush(0, 0, 1);
  for (TensorBlock& block : *half.mutable_blocks()) {
    block.set_dtype(FLOAT16);
    std::string bytes;
    EncodeFromFloat32(
        FLOAT16, std::vector<float>(block.data().size() / 4, 1.0f), &bytes);
    block.set_data(bytes);
  }
  EXPECT_EQ(f.shard->Assign(Encode(half)->wire).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DoAssign(*f.shard, std::nanf("")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(DoAssign(*f.shard, 1.0f).ok());  // nothing was set by those
}

TEST(ShardProvidedTest, SyncStateTensorsTakeTheMeanOfThePushedValues) {
  Fixture f = MakeProvidedShard(ConsistencyMode::kSync, 2);
  ASSERT_TRUE(DoAssign(*f.shard, 1.0f).ok());
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 0, 2)).ok());
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, 0, 6)).ok());
  auto pulled = DoPull(*f.shard, PullAt(0, 1), Soon());
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  ASSERT_EQ(pulled->blocks.size(), 3u);
  EXPECT_FLOAT_EQ(pulled->FirstWeight(), -1.0f);  // 1 - 0.5 * mean(2, 6)
  const PulledBlock& b = pulled->blocks[2];
  ASSERT_EQ(*b.tensor, "b");
  EXPECT_FLOAT_EQ(b.values->at(0), 4.0f);  // the mean of the values
}

TEST(ShardProvidedTest, AsyncStateTensorsTakeEachPushedValue) {
  Fixture f = MakeProvidedShard(ConsistencyMode::kAsync, 2);
  ASSERT_TRUE(DoAssign(*f.shard, 1.0f).ok());
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 0, 2)).ok());
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, 0, 6)).ok());
  auto pulled = DoPull(*f.shard, PullAt(0, 1), Soon());
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  EXPECT_FLOAT_EQ(pulled->FirstWeight(), -3.0f);  // 1 - 0.5 * 2 - 0.5 * 6
  EXPECT_FLOAT_EQ(pulled->blocks[2].values->at(0), 6.0f);  // the last one
}

TEST(ShardProvidedTest, ARestoredShardHasItsValues) {
  Fixture original = MakeProvidedShard(ConsistencyMode::kSync, 1);
  ASSERT_TRUE(DoAssign(*original.shard, 3.0f).ok());
  auto restored = std::move(*Shard::Create(original.options));
  ASSERT_TRUE(restored->Restore(RestoredFrom(*original.shard)).ok());
  auto pulled = DoPull(*restored, PullAt(0, 0), Soon());
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  EXPECT_FLOAT_EQ(pulled->FirstWeight(), 3.0f);
}

// Issue 12: a restore loses the updates applied after its checkpoint; in
// async mode Stats said nothing of them. Each worker's first push after the
// restore shows how many of its pushes the previous life had applied.
TEST(ShardRestoreTest, AsyncCountsTheUpdatesARestoreLost) {
  Fixture original = MakeShard(ConsistencyMode::kAsync, 2);
  for (int64_t step = 0; step < 2; ++step) {
    ASSERT_TRUE(DoPush(*original.shard, UniformPush(0, step, 1)).ok());
  }
  const RestoredShard checkpoint = RestoredFrom(*original.shard);
  for (int64_t step = 2; step < 5; ++step) {  // applied, then lost
    ASSERT_TRUE(DoPush(*original.shard, UniformPush(0, step, 1)).ok());
  }
  ASSERT_TRUE(DoPush(*original.shard, UniformPush(1, 0, 1)).ok());  // lost
  auto shard = std::move(*Shard::Create(original.options));
  ASSERT_TRUE(shard->Restore(checkpoint).ok());
  EXPECT_EQ(shard->Stats().updates_lost(), 0);  // nobody has come back yet

  ASSERT_TRUE(DoPush(*shard, UniformPush(0, 5, 1)).ok());
  StatsResponse stats = shard->Stats();
  EXPECT_EQ(stats.updates_lost(), 3 * 3);  // steps 2, 3, 4 on 3 blocks
  EXPECT_EQ(stats.steps_lost(), 3);        // the most one block lost
  ASSERT_TRUE(DoPush(*shard, UniformPush(0, 6, 1)).ok());  // counted once
  ASSERT_TRUE(DoPush(*shard, UniformPush(1, 1, 1)).ok());
  stats = shard->Stats();
  EXPECT_EQ(stats.updates_lost(), 3 * 3 + 3);  // and worker 1's step 0
  EXPECT_EQ(stats.steps_lost(), 4);
  EXPECT_EQ(stats.internal_errors(), 0);
}

TEST(ShardRestoreTest, SyncCountsTheUpdatesARestoreLost) {
  Fixture original = MakeShard(ConsistencyMode::kSync, 1);
  ASSERT_TRUE(DoPush(*original.shard, UniformPush(0, 0, 1)).ok());
  auto shard = std::move(*Shard::Create(original.options));
  ASSERT_TRUE(shard->Restore(RestoredFrom(*original.shard)).ok());
  // The worker was at step 3 when the shard died: steps 1 and 2 are lost.
  auto pulled = DoPull(*shard, PullAt(0, 3), Soon());
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  const StatsResponse stats = shard->Stats();
  EXPECT_EQ(stats.steps_lost(), 2);
  EXPECT_EQ(stats.updates_lost(), 2 * 3);
}

TEST(ShardSyncTest, PullTimesOutNamingTheMissingWorkers) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 3);
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, 0, 1)).ok());
  auto pulled =
      DoPull(*f.shard, PullAt(1, 1), absl::Now() + absl::Milliseconds(50));
  EXPECT_EQ(pulled->status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(pulled->status.message().find("workers [0, 2]"), std::string::npos)
      << pulled->status;
}

// Held pushes end with the server too, fresh or restored, refused as
// retryable: a SIGTERM does not wait out their hold.
TEST(ShardSyncTest, ShutdownReleasesHeldPushes) {
  Fixture fresh = MakeShard(ConsistencyMode::kSync, 2);
  Fixture original = MakeShard(ConsistencyMode::kSync, 3);
  std::unique_ptr<Shard> restored = RestoredAtStepZero(original);
  ASSERT_TRUE(DoPush(*restored, UniformPush(2, 0, 3)).ok());
  absl::StatusOr<PushResponse> held_fresh, held_restored;
  absl::Notification fresh_done, restored_done;
  std::thread fresh_pusher([&] {
    held_fresh = DoPush(*fresh.shard, UniformPush(0, 7, 1),
                        absl::Now() + absl::Seconds(60));
    fresh_done.Notify();
  });
  std::thread restored_pusher([&] {
    held_restored =
        DoPush(*restored, UniformPush(0, 1, 2, /*pulled_version=*/1),
               absl::Now() + absl::Seconds(60));
    restored_done.Notify();
  });
  EXPECT_FALSE(
      fresh_done.WaitForNotificationWithTimeout(absl::Milliseconds(50)));
  EXPECT_FALSE(restored_done.HasBeenNotified());
  fresh.shard->BeginShutdown();
  restored->BeginShutdown();
  ASSERT_TRUE(fresh_done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(restored_done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  fresh_pusher.join();
  restored_pusher.join();
  EXPECT_EQ(held_fresh.status().code(), absl::StatusCode::kUnavailable)
      << held_fresh.status();
  EXPECT_EQ(held_restored.status().code(), absl::StatusCode::kUnavailable)
      << held_restored.status();
}

TEST(ShardSyncTest, ShutdownReleasesWaitingPulls) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 2);
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 0, 1)).ok());
  PullResult result;
  f.shard->Pull(PullAt(0, 1), absl::InfiniteFuture(), result.Callback());
  f.shard->BeginShutdown();
  ASSERT_TRUE(result.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(result.status.code(), absl::StatusCode::kUnavailable)
      << result.status;
}

TEST(ShardSyncTest, StepsOutOfOrderAreRefused) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 2);
  // The job is under way here: worker 0 met the shard at its step.
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 0, 1)).ok());
  EXPECT_EQ(DoPush(*f.shard, UniformPush(0, 2, 1)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(DoPull(*f.shard, PullAt(1, 3), Soon())->status.code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(f.shard->Stats().version(), 0);
}

// A shard that starts with nothing restored and meets workers past its step
// may have restarted without a checkpoint: one worker (or one bad client)
// alone is refused as retryable and moves nothing; once every expected
// worker has come ahead, it takes their step and counts what it skipped.
TEST(ShardSyncTest, AFreshShardTakesTheJobsStepOnlyWhenEveryWorkerIsAhead) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 2);
  const absl::Status alone = DoPush(*f.shard, UniformPush(0, 7, 1)).status();
  EXPECT_EQ(alone.code(), absl::StatusCode::kUnavailable) << alone;
  EXPECT_NE(alone.message().find("(1 so far)"), std::string::npos) << alone;
  EXPECT_EQ(f.shard->Stats().version(), 0);
  EXPECT_EQ(f.shard->Stats().steps_lost(), 0);
  // The second worker, ahead too: the shard takes step 7.
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, 7, 3)).ok());
  EXPECT_EQ(f.shard->Stats().steps_lost(), 7);
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 7, 1)).ok());
  EXPECT_EQ(f.shard->Stats().version(), 8);
}

// On the data plane the first worker's push waits for the others instead:
// refused, it would be retried only after that worker's next calls on the
// connection, which wait for the other workers' pushes held behind theirs.
TEST(ShardSyncTest, AHeldPushToAFreshShardWaitsForTheOtherWorkers) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 2);
  absl::StatusOr<PushResponse> held;
  absl::Notification pushed;
  std::thread pusher([&] {
    held =
        DoPush(*f.shard, UniformPush(0, 7, 1), absl::Now() + absl::Seconds(30));
    pushed.Notify();
  });
  EXPECT_FALSE(pushed.WaitForNotificationWithTimeout(absl::Milliseconds(50)));
  // Held too: on a loaded machine the first push may not have arrived yet,
  // and this one then waits for it.
  ASSERT_TRUE(
      DoPush(*f.shard, UniformPush(1, 7, 3), absl::Now() + absl::Seconds(30))
          .ok());
  ASSERT_TRUE(pushed.WaitForNotificationWithTimeout(absl::Seconds(10)));
  pusher.join();
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(held->blocks_applied(), 3);
  EXPECT_EQ(f.shard->Stats().version(), 8);
  EXPECT_EQ(f.shard->Stats().steps_lost(), 7);
}

// The fused PushPull deadlock (a CI hang): worker 0's push of step 7 to the
// restarted shard is refused, and workers 1 and 2 wait in a live shard's
// step 8 for worker 0, so they never come to this shard with a request.
// Their heartbeats say they pulled step 8: the shard takes it, and worker
// 0's push of step 7 (given to the previous life) is counted late.
TEST(ShardSyncTest,
     AFreshShardTakesTheJobsStepFromHeartbeatsOfWorkersHeldElsewhere) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 3);
  EXPECT_EQ(DoPush(*f.shard, UniformPush(0, 7, 1)).status().code(),
            absl::StatusCode::kUnavailable);
  // A heartbeat of a worker at the shard's step, or from an older worker
  // (no step), says nothing.
  ASSERT_TRUE(f.shard->Heartbeat(HeartbeatAt(1, 0)).ok());
  ASSERT_TRUE(f.shard->Heartbeat(HeartbeatAt(2, 0)).ok());
  EXPECT_EQ(f.shard->Stats().version(), 0);
  ASSERT_TRUE(f.shard->Heartbeat(HeartbeatAt(1, 8)).ok());
  EXPECT_EQ(f.shard->Stats().version(), 0);  // worker 2 has not come ahead
  ASSERT_TRUE(f.shard->Heartbeat(HeartbeatAt(2, 8)).ok());
  EXPECT_EQ(f.shard->Stats().version(), 8);
  EXPECT_EQ(f.shard->Stats().steps_lost(), 8);
  absl::StatusOr<PushResponse> retried = DoPush(*f.shard, UniformPush(0, 7, 1));
  ASSERT_TRUE(retried.ok()) << retried.status();
  EXPECT_EQ(retried->blocks_late(), 3);
  auto pulled = DoPull(*f.shard, PullAt(0, 8), Soon());
  EXPECT_TRUE(pulled->status.ok()) << pulled->status;
}

// A worker id that claims a step far past the others' (a bug, or a bad
// client) does not send the shard there: sync workers are at most a step
// apart, so the shard goes no further than one past the nearest.
TEST(ShardSyncTest, AFreshShardGoesAtMostOneStepPastTheNearestWorker) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 3);
  EXPECT_EQ(DoPush(*f.shard, UniformPush(0, 7, 1)).status().code(),
            absl::StatusCode::kUnavailable);
  ASSERT_TRUE(f.shard->Heartbeat(HeartbeatAt(1, int64_t{1} << 40)).ok());
  ASSERT_TRUE(f.shard->Heartbeat(HeartbeatAt(2, 8)).ok());
  EXPECT_EQ(f.shard->Stats().version(), 8);
  EXPECT_EQ(f.shard->Stats().steps_lost(), 8);
}

// One client alone, by heartbeats too, cannot move a new job's shard.
TEST(ShardSyncTest, OneWorkersHeartbeatsDoNotMoveAFreshShard) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 2);
  ASSERT_TRUE(f.shard->Heartbeat(HeartbeatAt(1, 500)).ok());
  ASSERT_TRUE(f.shard->Heartbeat(HeartbeatAt(1, 501)).ok());
  EXPECT_EQ(f.shard->Stats().version(), 0);
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 0, 1)).ok());  // the job's step
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, 0, 1)).ok());
  EXPECT_EQ(f.shard->Stats().version(), 1);
  EXPECT_EQ(f.shard->Stats().steps_lost(), 0);
}

TEST(ShardSyncTest, SkippedNonFiniteGradientStillCountsTowardQuorum) {
  ShardOptions options;
  options.num_workers = 2;
  options.skip_nonfinite_gradients = true;
  options.optimizer.learning_rate = 0.5f;
  auto shard = std::move(*Shard::Create(options));
  RegisterModelRequest request;
  request.set_protocol_version(kProtocolVersion);
  *request.mutable_schema() = TestSchema();
  request.set_num_shards(1);
  request.set_num_workers(2);
  ASSERT_TRUE(shard->Register(request).ok());
  ASSERT_TRUE(DoPush(*shard, UniformPush(0, 0, NAN)).ok());
  ASSERT_TRUE(DoPush(*shard, UniformPush(1, 0, 2)).ok());
  EXPECT_EQ(shard->Stats().version(), 1);
  auto pulled = DoPull(*shard, PullAt(0, 1), Soon());
  ASSERT_TRUE(pulled->status.ok());
  EXPECT_FLOAT_EQ(pulled->FirstWeight(), 0.0f);  // 1 - 0.5 * 2: NaN left out
  EXPECT_EQ(shard->Stats().nonfinite_gradients_skipped(), 3);  // per block
}

TEST(ShardAsyncTest, AppliesEachPushAndRecordsStaleness) {
  Fixture f = MakeShard(ConsistencyMode::kAsync, 2);
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 0, 1, 0)).ok());
  EXPECT_EQ(f.shard->Stats().version(), 1);
  // Worker 1 computed against version 0 while worker 0's push landed.
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, 0, 1, 0)).ok());
  auto pulled = DoPull(*f.shard, PullAt(0, 7), Soon());
  ASSERT_TRUE(pulled->status.ok());
  EXPECT_EQ(pulled->blocks[0].version, 2);
  EXPECT_FLOAT_EQ(pulled->FirstWeight(), 0.0f);  // 1 - 0.5 - 0.5
  const StatsResponse stats = f.shard->Stats();
  EXPECT_EQ(stats.staleness_max(), 1);
  EXPECT_DOUBLE_EQ(stats.staleness_mean(), 0.5);
}

// A pull's answer references the block's memory (no copy per pull); an
// update while it is still held (being sent) goes to the other buffer.
TEST(ShardAsyncTest, AnUpdateLeavesTheValuesAPullHoldsAlone) {
  Fixture f = MakeShard(ConsistencyMode::kAsync, 2);
  auto held = DoPull(*f.shard, PullAt(0, 0), Soon());
  ASSERT_TRUE(held->status.ok());
  const std::vector<float> before = *held->blocks[0].values;
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 0, 1, 0)).ok());
  EXPECT_EQ(*held->blocks[0].values, before);
  // One copy per block of the model (the pull holds all three).
  EXPECT_EQ(f.shard->Stats().values_copied_for_pulls(), 3);
  auto after = DoPull(*f.shard, PullAt(0, 1), Soon());
  ASSERT_TRUE(after->status.ok());
  EXPECT_FLOAT_EQ(after->FirstWeight(), before[0] - 0.5f);
  // Once no pull holds them, updates write in place again.
  held.reset();
  after.reset();
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 1, 1, 1)).ok());
  EXPECT_EQ(f.shard->Stats().values_copied_for_pulls(), 3);
}

TEST(ShardSyncTest, AStepLeavesTheValuesAPullHoldsAlone) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 2);
  auto held = DoPull(*f.shard, PullAt(0, 0), Soon());
  ASSERT_TRUE(held->status.ok());
  const float before = held->FirstWeight();
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 0, 1)).ok());
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, 0, 3)).ok());
  EXPECT_FLOAT_EQ(held->FirstWeight(), before);
  auto after = DoPull(*f.shard, PullAt(0, 1), Soon());
  ASSERT_TRUE(after->status.ok());
  EXPECT_FLOAT_EQ(after->FirstWeight(), before - 0.5f * 2);
  EXPECT_EQ(f.shard->Stats().values_copied_for_pulls(), 3);
}

TEST(ShardAsyncTest, NegativePulledVersionIsRefused) {
  Fixture f = MakeShard(ConsistencyMode::kAsync, 1);
  absl::StatusOr<PushResponse> pushed =
      DoPush(*f.shard, UniformPush(0, 0, 1, /*pulled_version=*/-5));
  EXPECT_EQ(pushed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(pushed.status().message().find("pulled version"), std::string::npos)
      << pushed.status();
}

TEST(ShardAsyncTest, RetriedStepIsNotAppliedTwice) {
  Fixture f = MakeShard(ConsistencyMode::kAsync, 1);
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 5, 1)).ok());
  absl::StatusOr<PushResponse> repeat = DoPush(*f.shard, UniformPush(0, 5, 1));
  ASSERT_TRUE(repeat.ok());
  EXPECT_EQ(repeat->blocks_duplicate(), 3);
  absl::StatusOr<PushResponse> older = DoPush(*f.shard, UniformPush(0, 4, 1));
  ASSERT_TRUE(older.ok());
  EXPECT_EQ(older->blocks_duplicate(), 3);
  EXPECT_EQ(f.shard->Stats().version(), 1);
}

TEST(ShardAsyncTest, ConcurrentPushesAreAllApplied) {
  Fixture f = MakeShard(ConsistencyMode::kAsync, 4);
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w) {
    threads.emplace_back([&, w] {
      for (int step = 0; step < 50; ++step) {
        EXPECT_TRUE(DoPush(*f.shard, UniformPush(w, step, 0.01f)).ok());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  auto pulled = DoPull(*f.shard, PullAt(0, 0), Soon());
  ASSERT_TRUE(pulled->status.ok());
  EXPECT_EQ(pulled->blocks[0].version, 200);
  EXPECT_NEAR(pulled->FirstWeight(), 1.0f - 200 * 0.5f * 0.01f, 1e-4);
}

// Each bad request gets its code and leaves the shard unchanged.
TEST(ShardValidationTest, BadRequestsAreRefusedAndChangeNothing) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 2);
  struct Case {
    std::string name;
    PushRequest push;
    absl::StatusCode code;
    std::string message;
  };
  std::vector<Case> cases;
  {
    PushRequest p = UniformPush(0, 0, 1);
    p.mutable_blocks(0)->set_tensor("nope");
    cases.push_back({"unknown tensor", p, absl::StatusCode::kInvalidArgument,
                     "unknown tensor 'nope'"});
  }
  {
    PushRequest p = UniformPush(0, 0, 1);
    p.mutable_blocks(0)->mutable_data()->resize(12);
    cases.push_back({"wrong length", p, absl::StatusCode::kInvalidArgument,
                     "payload has 12 bytes, expected 16"});
  }
  {
    PushRequest p = UniformPush(0, 0, 1);
    p.mutable_blocks(1)->set_block(7);
    cases.push_back({"block out of range", p,
                     absl::StatusCode::kInvalidArgument, "got block 7"});
  }
  cases.push_back({"worker id", UniformPush(2, 0, 1),
                   absl::StatusCode::kInvalidArgument,
                   "worker_id must be in [0, 2)"});
  cases.push_back({"negative step", UniformPush(0, -1, 1),
                   absl::StatusCode::kInvalidArgument,
                   "step must be in [0, 2^53)"});
  // A shard no worker has met at its step yet may have lost its state: a
  // lone worker ahead is asked to retry, and nothing moves.
  cases.push_back({"future step", UniformPush(0, 9, 1),
                   absl::StatusCode::kUnavailable, "push for step 9"});
  {
    PushRequest p = UniformPush(0, 0, 1);
    EncodeFloat32(std::vector<float>{1, 2, INFINITY, 4},
                  p.mutable_blocks(0)->mutable_data());
    cases.push_back({"non-finite", p, absl::StatusCode::kInvalidArgument,
                     "element 2 is NaN or infinite"});
  }
  {
    PushRequest p = UniformPush(0, 0, 1);
    *p.add_blocks() = p.blocks(0);
    cases.push_back({"duplicate block", p, absl::StatusCode::kInvalidArgument,
                     "appears twice"});
  }
  {
    PushRequest p = UniformPush(0, 0, 1);
    p.mutable_blocks(0)->set_dtype(static_cast<DataType>(9));
    cases.push_back(
        {"wire type", p, absl::StatusCode::kInvalidArgument, "wire type 9"});
  }
  {
    PushRequest p = UniformPush(0, 0, 1);
    p.mutable_blocks(0)->set_dtype(BFLOAT16);  // 16 bytes = 8 bf16, not 4
    cases.push_back({"wire type length", p, absl::StatusCode::kInvalidArgument,
                     "expected 8 (4 BFLOAT16 elements)"});
  }
  {
    PushRequest p = UniformPush(0, 0, 1);
    p.set_protocol_version(99);
    cases.push_back({"protocol", p, absl::StatusCode::kFailedPrecondition,
                     "protocol version 99"});
  }
  for (const Case& c : cases) {
    const absl::Status status = DoPush(*f.shard, c.push).status();
    EXPECT_EQ(status.code(), c.code) << c.name << ": " << status;
    EXPECT_NE(status.message().find(c.message), std::string::npos)
        << c.name << ": " << status;
  }
  // Nothing was accumulated: one good push from each worker gives exactly
  // one update with the mean of the good gradients.
  absl::StatusOr<PushResponse> good = DoPush(*f.shard, UniformPush(0, 0, 2));
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(good->blocks_applied(), 3);
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, 0, 2)).ok());
  auto pulled = DoPull(*f.shard, PullAt(0, 1), Soon());
  ASSERT_TRUE(pulled->status.ok());
  EXPECT_FLOAT_EQ(pulled->FirstWeight(), 0.0f);
  EXPECT_EQ(f.shard->Stats().requests_rejected(),
            static_cast<int64_t>(cases.size()));
}

// A schema with one sparse table "emb" of dim 2, zeros, SGD at rate 1 (or
// `optimizer`: adam for the dense blocks, adagrad for the table).
Fixture MakeSparseShard(ConsistencyMode mode, int num_workers, int64_t dim = 2,
                        const std::string& optimizer = "sgd",
                        int admit_after = 0,
                        const std::string& table_mode = "") {
  Fixture f;
  f.options.mode = mode;
  f.options.sparse_admit_after = admit_after;
  if (optimizer != "sgd") f.options.optimizer.name = "adam";
  f.options.num_workers = num_workers;
  f.options.max_pull_wait = absl::Seconds(5);
  f.shard = std::move(*Shard::Create(f.options));
  RegisterModelRequest request;
  request.set_protocol_version(kProtocolVersion);
  *request.mutable_schema() = TestSchema();
  SparseTableSpec* table = request.mutable_schema()->add_sparse();
  table->set_name("emb");
  table->set_dim(dim);
  table->mutable_optimizer()->set_name(optimizer == "sgd" ? "sgd" : "adagrad");
  table->mutable_optimizer()->set_learning_rate(1.0f);
  if (optimizer != "sgd") table->mutable_optimizer()->set_epsilon(1e-10f);
  table->set_mode(table_mode);
  request.set_num_shards(1);
  request.set_num_workers(num_workers);
  absl::StatusOr<RegisterModelResponse> registered = f.shard->Register(request);
  EXPECT_TRUE(registered.ok()) << registered.status();
  return f;
}

SparsePushRequest SparsePushOf(int worker, int64_t step,
                               std::vector<uint64_t> ids,
                               std::vector<float> grads) {
  SparsePushRequest push;
  push.set_protocol_version(kProtocolVersion);
  push.set_worker_id(worker);
  push.set_step(step);
  push.set_table("emb");
  for (uint64_t id : ids) push.add_ids(id);
  EncodeFloat32(grads, push.mutable_gradients());
  return push;
}

std::vector<float> SparseRows(Shard& shard, int64_t step,
                              std::vector<uint64_t> ids,
                              const std::string& table = "emb") {
  SparsePullRequest pull;
  pull.set_protocol_version(kProtocolVersion);
  pull.set_worker_id(-1);
  pull.set_step(step);
  pull.set_table(table);
  for (uint64_t id : ids) pull.add_ids(id);
  absl::Notification done;
  std::vector<float> rows;
  shard.SparsePull(pull, Soon(),
                   [&](absl::Status status, SparsePullResponse response) {
                     EXPECT_TRUE(status.ok()) << status;
                     rows.resize(response.values().size() / sizeof(float));
                     std::memcpy(rows.data(), response.values().data(),
                                 response.values().size());
                     done.Notify();
                   });
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  return rows;
}

TEST(ShardSparseTest, SyncAppliesTheMeanOfEveryWorkersRowsOnce) {
  Fixture f = MakeSparseShard(ConsistencyMode::kSync, 2);
  ASSERT_TRUE(f.shard->SparsePush(SparsePushOf(0, 0, {7}, {2, 2})).ok());
  // A retry is acknowledged, not added.
  absl::StatusOr<SparsePushResponse> again =
      f.shard->SparsePush(SparsePushOf(0, 0, {7}, {2, 2}));
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->duplicate());
  ASSERT_TRUE(
      f.shard->SparsePush(SparsePushOf(1, 0, {7, 9}, {4, 4, 6, 6})).ok());
  // Untouched rows count as zero from a worker, as in the dense path:
  // row 7 = -(2 + 4) / 2, row 9 = -(0 + 6) / 2, row 11 untouched.
  EXPECT_EQ(SparseRows(*f.shard, 1, {7, 9, 11}),
            (std::vector<float>{-3, -3, -3, -3, 0, 0}));
  EXPECT_EQ(f.shard->Stats().sparse(0).version(), 1);
}

// Replica catch-up: a shard built from another's exported state (in many
// small chunks) holds the same model, and the next steps' pushes, given to
// both, leave both with the same values and rows.
TEST(ShardReplicaStateTest, AnImportedStateGoesOnAsTheOriginalDoes) {
  for (ConsistencyMode mode :
       {ConsistencyMode::kSync, ConsistencyMode::kAsync}) {
    // Optimizers with state: it must travel too.
    Fixture primary = MakeSparseShard(mode, 2, /*dim=*/2, "adam");
    for (int step = 0; step < 3; ++step) {
      for (int worker = 0; worker < 2; ++worker) {
        ASSERT_TRUE(
            DoPush(*primary.shard, UniformPush(worker, step, step + worker))
                .ok());
        ASSERT_TRUE(
            primary.shard
                ->SparsePush(SparsePushOf(
                    worker, step, {uint64_t(7 + step), 100}, {1, 2, 3, 4}))
                .ok());
      }
    }
    ASSERT_TRUE(primary.shard->QuietForTransfer());
    absl::StatusOr<ReplicaStateExport> state =
        primary.shard->ExportReplicaState(/*chunk_bytes=*/24);
    ASSERT_TRUE(state.ok()) << state.status();
    const std::vector<ReplicaStateChunk>& chunks = state->chunks;
    EXPECT_GT(chunks.size(), 2u);  // the chunk size is honoured
    ASSERT_EQ(state->floats.size(), chunks.size());
    // The first chunk only installs the model, and the last only ends the
    // transfer.
    EXPECT_EQ(chunks.front().blocks_size(), 0);
    EXPECT_EQ(chunks.back().blocks_size() + chunks.back().sparse_size(), 0);
    // A transfer that ends with blocks missing is refused.
    {
      auto joiner = std::move(*Shard::Create(primary.options));
      ASSERT_TRUE(joiner->ImportReplicaChunk(chunks.front()).ok());
      absl::Status ended = joiner->ImportReplicaChunk(chunks.back());
      EXPECT_EQ(ended.code(), absl::StatusCode::kInvalidArgument) << ended;
      EXPECT_TRUE(absl::StrContains(ended.message(), "ended without block"))
          << ended;
    }
    // The dense blocks' chunks may come in any order (ReplicaSet::SendState
    // has several in flight): here in reverse.
    size_t first_in_order = 1;
    while (first_in_order + 1 < chunks.size() &&
           chunks[first_in_order].sparse_size() == 0) {
      ++first_in_order;
    }
    ASSERT_GT(first_in_order, 2u);
    std::vector<size_t> order = {0};
    for (size_t c = first_in_order - 1; c >= 1; --c) order.push_back(c);
    for (size_t c = first_in_order; c < chunks.size(); ++c) order.push_back(c);
    auto joiner = std::move(*Shard::Create(primary.options));
    for (size_t c : order) {
      const std::string floats = absl::StrJoin(state->floats[c], "");
      if (c == 1) {  // floats that do not fit the blocks are refused
        EXPECT_FALSE(joiner->ImportReplicaChunk(chunks[c], floats + "x").ok());
      }
      ASSERT_TRUE(joiner->ImportReplicaChunk(chunks[c], floats).ok());
    }
    // A chunk of a second transfer finds a model there.
    EXPECT_FALSE(joiner->ImportReplicaChunk(chunks[0]).ok());
    for (Shard* shard : {primary.shard.get(), joiner.get()}) {
      // A resend of an old step is a duplicate on both.
      absl::StatusOr<PushResponse> resent =
          DoPush(*shard, UniformPush(0, 2, 9));
      ASSERT_TRUE(resent.ok()) << resent.status();
      EXPECT_EQ(resent->blocks_applied(), 0);
      for (int worker = 0; worker < 2; ++worker) {
        ASSERT_TRUE(DoPush(*shard, UniformPush(worker, 3, 5)).ok());
        ASSERT_TRUE(
            shard->SparsePush(SparsePushOf(worker, 3, {7, 8}, {1, 1, 1, 1}))
                .ok());
      }
    }
    const int64_t step = mode == ConsistencyMode::kSync ? 4 : 8;
    auto a = DoPull(*primary.shard, PullAt(-1, step), Soon());
    auto b = DoPull(*joiner, PullAt(-1, step), Soon());
    ASSERT_TRUE(a->status.ok() && b->status.ok()) << a->status << b->status;
    ASSERT_EQ(a->blocks.size(), b->blocks.size());
    for (size_t i = 0; i < a->blocks.size(); ++i) {
      EXPECT_EQ(a->blocks[i].version, b->blocks[i].version);
      EXPECT_EQ(*a->blocks[i].values, *b->blocks[i].values);
    }
    EXPECT_EQ(SparseRows(*primary.shard, 4, {7, 8, 9, 100}),
              SparseRows(*joiner, 4, {7, 8, 9, 100}));
    EXPECT_EQ(primary.shard->Stats().version(), joiner->Stats().version());
  }
}

// One worker's registration of TestSchema() plus table "emb" of `dim`
// (SGD at 0.1), for the tests of what registration refuses.
RegisterModelRequest OneTableRequest(int64_t dim) {
  RegisterModelRequest request;
  request.set_protocol_version(kProtocolVersion);
  *request.mutable_schema() = TestSchema();
  request.set_num_shards(1);
  request.set_num_workers(1);
  SparseTableSpec* table = request.mutable_schema()->add_sparse();
  table->set_name("emb");
  table->set_dim(dim);
  table->mutable_optimizer()->set_name("sgd");
  table->mutable_optimizer()->set_learning_rate(0.1f);
  return request;
}

// A table's byte budget counts toward --max_shard_memory_gb at
// registration: over it, the registration is refused naming the table and
// the numbers, and nothing is installed; a budget below one row is refused.
// SparseChanges pages through several tables: each page at most about
// max_bytes, resumed at table boundaries and inside a table, every changed
// row once, nothing before the mark.
// An async shard of one worker whose model has the tables `names`, each of
// dim 2, zeros, SGD at rate 1.
Fixture MakeAsyncTablesShard(const std::vector<std::string>& names) {
  Fixture f;
  f.options.mode = ConsistencyMode::kAsync;
  f.options.num_workers = 1;
  f.shard = std::move(*Shard::Create(f.options));
  RegisterModelRequest request;
  request.set_protocol_version(kProtocolVersion);
  *request.mutable_schema() = TestSchema();
  for (const std::string& name : names) {
    SparseTableSpec* table = request.mutable_schema()->add_sparse();
    table->set_name(name);
    table->set_dim(2);
    table->mutable_optimizer()->set_name("sgd");
    table->mutable_optimizer()->set_learning_rate(1.0f);
  }
  request.set_num_shards(1);
  request.set_num_workers(1);
  absl::StatusOr<RegisterModelResponse> registered = f.shard->Register(request);
  EXPECT_TRUE(registered.ok()) << registered.status();
  return f;
}

// One SparsePush may carry several tables (SparsePushRequest.more): all are
// checked before any is applied, and each is then applied, and a resend
// recognised, as if it had come alone.
TEST(ShardSparseTest, APushOfSeveralTablesIsAllOrNothingThenEachOnce) {
  Fixture f = MakeAsyncTablesShard({"ta", "tb"});
  auto part = [](const std::string& table, std::vector<uint64_t> ids,
                 std::vector<float> grads) {
    SparsePushRequest p = SparsePushOf(0, 0, std::move(ids), std::move(grads));
    p.set_table(table);
    return p;
  };
  auto rows = [&](const std::string& table, std::vector<uint64_t> ids) {
    return SparseRows(*f.shard, 0, std::move(ids), table);
  };

  // A bad second part refuses the whole push: the first is not applied.
  SparsePushRequest bad = part("ta", {1}, {1, 1});
  *bad.add_more() = part("tb", {2}, {NAN, 1});
  absl::StatusOr<SparsePushResponse> refused = f.shard->SparsePush(bad);
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  EXPECT_EQ(rows("ta", {1}), (std::vector<float>{0, 0}));
  SparsePushRequest twice = part("ta", {1}, {1, 1});
  *twice.add_more() = part("ta", {3}, {1, 1});
  EXPECT_TRUE(absl::IsInvalidArgument(f.shard->SparsePush(twice).status()));
  EXPECT_EQ(rows("ta", {1, 3}), (std::vector<float>{0, 0, 0, 0}));

  SparsePushRequest both = part("ta", {1}, {1, 1});
  *both.add_more() = part("tb", {2}, {2, 2});
  absl::StatusOr<SparsePushResponse> pushed = f.shard->SparsePush(both);
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  ASSERT_EQ(pushed->more_size(), 1);
  EXPECT_FALSE(pushed->duplicate() || pushed->more(0).duplicate());
  absl::StatusOr<SparsePushResponse> resent = f.shard->SparsePush(both);
  ASSERT_TRUE(resent.ok()) << resent.status();
  ASSERT_EQ(resent->more_size(), 1);
  EXPECT_TRUE(resent->duplicate() && resent->more(0).duplicate());
  EXPECT_EQ(rows("ta", {1}), (std::vector<float>{-1, -1}));
  EXPECT_EQ(rows("tb", {2}), (std::vector<float>{-2, -2}));
}

TEST(ShardSparseTest, ChangesPageThroughEveryTableSinceTheMarks) {
  const std::vector<std::string> names = {"ta", "tb", "tc"};
  Fixture f = MakeAsyncTablesShard(names);
  auto push = [&](const std::string& table, int64_t step,
                  std::vector<uint64_t> ids) {
    SparsePushRequest p =
        SparsePushOf(0, step, ids, std::vector<float>(ids.size() * 2, 1));
    p.set_table(table);
    absl::StatusOr<SparsePushResponse> pushed = f.shard->SparsePush(p);
    ASSERT_TRUE(pushed.ok()) << pushed.status();
  };
  push("ta", 0, {1, 2, 3});  // before the mark: not a change since
  SparseChangesRequest mark;
  mark.set_protocol_version(kProtocolVersion);
  mark.set_mark(true);
  absl::StatusOr<SparseChangesResponse> marked = f.shard->SparseChanges(mark);
  ASSERT_TRUE(marked.ok()) << marked.status();
  ASSERT_EQ(marked->marks_size(), 3);
  std::map<std::string, std::set<uint64_t>> expected;
  for (uint64_t i = 0; i < 40; ++i) {
    expected["ta"].insert(100 + i);
    expected["tc"].insert(300 + i);
  }
  push("ta", 1, {expected["ta"].begin(), expected["ta"].end()});
  push("tc", 2, {expected["tc"].begin(), expected["tc"].end()});  // tb: none

  for (int64_t page_bytes : {16, 100, 1000, 0}) {
    SparseChangesRequest request;
    request.set_protocol_version(kProtocolVersion);
    *request.mutable_since() = marked->marks();
    request.set_max_bytes(page_bytes);
    std::map<std::string, std::multiset<uint64_t>> got;
    int pages = 0;
    for (bool done = false; !done && pages < 1000; ++pages) {
      absl::StatusOr<SparseChangesResponse> page =
          f.shard->SparseChanges(request);
      ASSERT_TRUE(page.ok()) << page.status();
      int64_t bytes = 0;
      for (const TableChanges& table : page->tables()) {
        got[table.table()].insert(table.ids().begin(), table.ids().end());
        bytes += table.values().size() + 8 * table.ids_size();
      }
      if (page_bytes > 0) {
        EXPECT_LE(bytes, std::max<int64_t>(page_bytes, 16));
      }
      request.set_table_index(page->next_table_index());
      request.set_stripe(page->next_stripe());
      request.set_slot(page->next_slot());
      done = page->done();
    }
    for (const std::string& name : names) {
      EXPECT_EQ(std::set<uint64_t>(got[name].begin(), got[name].end()),
                expected[name])
          << name << ", pages of " << page_bytes << " bytes";
      EXPECT_EQ(got[name].size(), expected[name].size()) << "a row twice";
    }
    if (page_bytes == 16) {
      EXPECT_GE(pages, 80);  // a row a page
    } else if (page_bytes == 0) {
      EXPECT_EQ(pages, 1);
    }
  }
}

// --sparse_memory_gb: tables without their own max_bytes share what the
// others leave of it, and are bounded by that share.
TEST(ShardSparseTest, TablesWithoutABudgetShareTheServersSparseMemory) {
  ShardOptions options;
  options.sparse_memory_bytes = int64_t{1} << 20;
  auto shard = std::move(*Shard::Create(options));
  RegisterModelRequest request = OneTableRequest(/*dim=*/16);
  SparseTableSpec* own = request.mutable_schema()->add_sparse();
  *own = request.schema().sparse(0);
  own->set_name("own");
  own->set_max_bytes(int64_t{2} << 20);  // more than the whole
  absl::StatusOr<RegisterModelResponse> over = shard->Register(request);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find(
                "--sparse_memory_gb allows 1.0 MiB for the embedding tables"),
            absl::string_view::npos)
      << over.status();

  own->set_max_bytes(int64_t{1} << 19);  // emb gets the other half
  absl::StatusOr<RegisterModelResponse> fits = shard->Register(request);
  ASSERT_TRUE(fits.ok()) << fits.status();
  std::vector<uint64_t> ids(20000);
  for (uint64_t i = 0; i < ids.size(); ++i) ids[i] = i;
  EXPECT_EQ(SparseRows(*shard, 0, ids).size(), ids.size() * 16);
  const StatsResponse stats = shard->Stats();
  ASSERT_EQ(stats.sparse(0).name(), "emb");
  SparseTableOptions emb;
  emb.dim = 16;
  emb.optimizer.name = "sgd";
  EXPECT_EQ(stats.sparse(0).rows(),
            (int64_t{1} << 19) / SparseTable::RowBytes(emb));
  EXPECT_GT(stats.sparse(0).rows_evicted(), 0);
  EXPECT_LE(stats.sparse(0).memory_bytes(), (int64_t{1} << 19) + (64 << 10));
}

TEST(ShardSparseTest, TableBudgetsAreCheckedAtRegistration) {
  ShardOptions options;
  options.max_shard_bytes = int64_t{4} << 20;
  auto shard = std::move(*Shard::Create(options));
  RegisterModelRequest request = OneTableRequest(/*dim=*/16);
  SparseTableSpec* table = request.mutable_schema()->mutable_sparse(0);
  table->set_max_bytes(int64_t{8} << 20);
  absl::StatusOr<RegisterModelResponse> over = shard->Register(request);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("table 'emb' up to 8.0 MiB"),
            absl::string_view::npos)
      << over.status();
  EXPECT_NE(over.status().message().find("allows 4.0 MiB"),
            absl::string_view::npos)
      << over.status();

  table->set_max_bytes(10);
  absl::StatusOr<RegisterModelResponse> tiny = shard->Register(request);
  ASSERT_FALSE(tiny.ok());
  EXPECT_NE(tiny.status().message().find("holds no row"),
            absl::string_view::npos)
      << tiny.status();

  table->set_max_bytes(int64_t{2} << 20);
  absl::StatusOr<RegisterModelResponse> fits = shard->Register(request);
  EXPECT_TRUE(fits.ok()) << fits.status();
}

// Replicated servers refuse a table's own budget: a backup, seeing no
// pulls, would evict other rows than its primary.
TEST(ShardSparseTest, ReplicatedServersRefuseATableBudget) {
  ShardOptions options;
  options.replicated = true;
  auto shard = std::move(*Shard::Create(options));
  RegisterModelRequest request = OneTableRequest(/*dim=*/16);
  request.mutable_schema()->mutable_sparse(0)->set_max_bytes(int64_t{2} << 20);
  absl::StatusOr<RegisterModelResponse> refused = shard->Register(request);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find(
                "table 'emb' has a budget (max_bytes 2097152)"),
            absl::string_view::npos)
      << refused.status();
  EXPECT_EQ(shard->Stats().sparse_size(), 0);  // nothing registered

  request.mutable_schema()->mutable_sparse(0)->set_max_bytes(0);
  absl::StatusOr<RegisterModelResponse> unbounded = shard->Register(request);
  EXPECT_TRUE(unbounded.ok()) << unbounded.status();
}

// A row TTL in steps counts the steps the servers complete: an async table
// has none (its steps are each worker's own count), and is refused.
TEST(ShardSparseTest, ATtlInStepsRefusesAnAsyncTable) {
  ShardOptions options;
  options.sparse_row_ttl_steps = 100;
  auto shard = std::move(*Shard::Create(options));
  RegisterModelRequest request = OneTableRequest(/*dim=*/16);
  request.mutable_schema()->mutable_sparse(0)->set_mode("async");
  absl::StatusOr<RegisterModelResponse> refused = shard->Register(request);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find(
                "table 'emb' is async: --sparse_row_ttl_steps counts"),
            absl::string_view::npos)
      << refused.status();
  EXPECT_EQ(shard->Stats().sparse_size(), 0);  // nothing registered
  request.mutable_schema()->mutable_sparse(0)->set_mode("sync");
  EXPECT_TRUE(shard->Register(request).ok());
}

// Ids counted toward admission travel too: a caught-up replica admits an id
// at the same pull as the primary, so a push to it is applied on both (a
// joiner that started counting afresh would drop it).
TEST(ShardReplicaStateTest, AdmissionCountsTravel) {
  Fixture primary = MakeSparseShard(ConsistencyMode::kAsync, 1, /*dim=*/2,
                                    "sgd", /*admit_after=*/3);
  // Id 7 seen twice, id 9 once: neither admitted yet.
  const std::vector<float> initial = SparseRows(*primary.shard, 0, {7, 7, 9});
  absl::StatusOr<ReplicaStateExport> state =
      primary.shard->ExportReplicaState(/*chunk_bytes=*/24);
  ASSERT_TRUE(state.ok()) << state.status();
  auto joiner = std::move(*Shard::Create(primary.options));
  for (size_t c = 0; c < state->chunks.size(); ++c) {
    ASSERT_TRUE(joiner
                    ->ImportReplicaChunk(state->chunks[c],
                                         absl::StrJoin(state->floats[c], ""))
                    .ok());
  }
  for (Shard* shard : {primary.shard.get(), joiner.get()}) {
    SparseRows(*shard, 0, {7});  // the third sighting admits it
    ASSERT_TRUE(
        shard->SparsePush(SparsePushOf(0, 0, {7, 9}, {1, 1, 1, 1})).ok());
  }
  const std::vector<float> rows = SparseRows(*primary.shard, 1, {7, 9});
  EXPECT_EQ(SparseRows(*joiner, 1, {7, 9}), rows);
  EXPECT_NE(rows[0], initial[0]);  // id 7's push applied
  EXPECT_EQ(rows[2], initial[4]);  // id 9's dropped: 2 sightings of 3
}

// Step records (ShardOptions::record_steps): a leader and a follower of one
// replicated sync shard, Adam (state that must follow too).
struct LeaderAndFollower {
  std::unique_ptr<Shard> leader, follower;
};

// Both registered afresh, or both restored from `checkpoint`.
LeaderAndFollower MakeLeaderAndFollower(
    const RestoredShard* checkpoint = nullptr) {
  ShardOptions options;
  options.mode = ConsistencyMode::kSync;
  options.num_workers = 2;
  options.optimizer.name = "adam";
  options.optimizer.learning_rate = 0.1f;
  options.max_pull_wait = absl::Seconds(5);
  options.record_steps = true;
  LeaderAndFollower f;
  f.leader = std::move(*Shard::Create(options));
  f.follower = std::move(*Shard::Create(options));
  f.leader->set_leads_steps([] { return true; });
  f.follower->set_leads_steps([] { return false; });
  if (checkpoint != nullptr) {
    for (Shard* shard : {f.leader.get(), f.follower.get()}) {
      EXPECT_TRUE(shard->Restore(*checkpoint).ok());
    }
    return f;
  }
  RegisterModelRequest request;
  request.set_protocol_version(kProtocolVersion);
  *request.mutable_schema() = TestSchema();
  request.set_num_shards(1);
  request.set_num_workers(2);
  for (Shard* shard : {f.leader.get(), f.follower.get()}) {
    EXPECT_TRUE(shard->Register(request).ok());
  }
  return f;
}

// What the service sends: the records, and their sums one after another.
struct SentRecords {
  StepRecords records;
  std::string sums;
};

SentRecords Serialized(const Shard::TakenStepRecords& taken) {
  SentRecords sent{taken.records, ""};
  for (const std::vector<float>& sum : taken.sums) {
    sent.sums.append(reinterpret_cast<const char*>(sum.data()),
                     sum.size() * sizeof(float));
  }
  return sent;
}

SentRecords Take(Shard& shard) {
  Shard::TakenStepRecords taken = shard.TakeStepRecords(int64_t{1} << 30);
  SentRecords sent = Serialized(taken);
  shard.ConfirmStepRecords(std::move(taken));
  return sent;
}

// A worker's ClipNorm of `step`, answered within 10 s.
absl::StatusOr<ClipNormResponse> AskClipNorm(Shard& shard, int worker,
                                             int64_t step) {
  ClipNormRequest clip;
  clip.set_protocol_version(kProtocolVersion);
  clip.set_worker_id(worker);
  clip.set_step(step);
  // Shared with the callback, which may still come after a timeout.
  struct Answer {
    absl::Notification done;
    absl::StatusOr<ClipNormResponse> value;
  };
  auto answer = std::make_shared<Answer>();
  shard.ClipNorm(clip, Soon(), [answer](absl::StatusOr<ClipNormResponse> r) {
    answer->value = std::move(r);
    answer->done.Notify();
  });
  if (!answer->done.WaitForNotificationWithTimeout(absl::Seconds(10))) {
    return absl::DeadlineExceededError("no ClipNorm answer within 10 s");
  }
  return answer->value;
}

void ExpectSameModel(Shard& a, Shard& b, int64_t step) {
  auto x = DoPull(a, PullAt(-1, step), Soon());
  auto y = DoPull(b, PullAt(-1, step), Soon());
  ASSERT_TRUE(x->status.ok() && y->status.ok()) << x->status << y->status;
  ASSERT_EQ(x->blocks.size(), y->blocks.size());
  for (size_t i = 0; i < x->blocks.size(); ++i) {
    EXPECT_EQ(x->blocks[i].version, step);
    EXPECT_EQ(y->blocks[i].version, step);
    EXPECT_EQ(*x->blocks[i].values, *y->blocks[i].values) << "block " << i;
  }
}

TEST(ShardStepRecordsTest, AFollowerAppliesEachStepAsTheLeaderDid) {
  LeaderAndFollower f = MakeLeaderAndFollower();
  // Steps 0-2 reach only the leader, as PushPulls do; step 1 of worker 1
  // also reaches the follower, as a plain push's forward does: the record
  // replaces what it summed. Step 2 carries a rate, as a scheduler's push.
  SentRecords sent;
  for (int64_t step = 0; step < 3; ++step) {
    for (int worker : {1, 0}) {
      PushRequest push = UniformPush(worker, step, 0.5f * (worker + 1) + step);
      if (step == 2) push.add_group_lr(0.01);
      ASSERT_TRUE(DoPush(*f.leader, push).ok());
      if (step == 1 && worker == 1) {
        ASSERT_TRUE(DoPush(*f.follower, push).ok());
        // It completes nothing itself, whatever it holds.
        ASSERT_TRUE(DoPush(*f.follower, UniformPush(0, step, 9)).ok());
        EXPECT_EQ(f.follower->Stats().version(), 1);
      }
    }
    EXPECT_EQ(f.leader->StepRecordsMade(), 3 * (step + 1));  // 3 blocks
    sent = Take(*f.leader);
    EXPECT_FALSE(f.leader->HasStepRecords());
    ASSERT_TRUE(f.follower->ApplyStepRecords(sent.records, sent.sums).ok());
    ExpectSameModel(*f.leader, *f.follower, step + 1);
  }
  // Sent again (an answer lost): a repeat, nothing changes.
  ASSERT_TRUE(f.follower->ApplyStepRecords(sent.records, sent.sums).ok());
  ExpectSameModel(*f.leader, *f.follower, 3);
  // A forwarded push ahead of the records is refused as retryable: only a
  // record moves the follower's blocks.
  EXPECT_EQ(DoPush(*f.follower, UniformPush(0, 4, 1)).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(f.follower->Stats().version(), 3);
  // A worker counted in a recorded step resends it: a duplicate there too.
  absl::StatusOr<PushResponse> resent =
      DoPush(*f.follower, UniformPush(0, 2, 7));
  ASSERT_TRUE(resent.ok()) << resent.status();
  EXPECT_EQ(resent->blocks_duplicate(), 3);
  // Taking over, the follower completes a step whose gradients it holds.
  for (int worker : {0, 1}) {
    ASSERT_TRUE(DoPush(*f.follower, UniformPush(worker, 3, 1)).ok());
    ASSERT_TRUE(DoPush(*f.leader, UniformPush(worker, 3, 1)).ok());
  }
  EXPECT_EQ(f.follower->Stats().version(), 3);
  f.follower->set_leads_steps([] { return true; });
  f.follower->CompleteStepsNowLeading();
  ExpectSameModel(*f.leader, *f.follower, 4);
}

// A backup answers a worker's read of step 1 once it applied that step's
// record, with the leader's values, and changes nothing else; once it took
// over, a waiting read ends UNAVAILABLE (the worker sends its step to it
// again) and so does every later one.
TEST(ShardStepRecordsTest, ABackupAnswersAReadOnceItHoldsTheStep) {
  LeaderAndFollower f = MakeLeaderAndFollower();
  PullResult read;
  f.follower->PullOnBackup(PullAt(0, 1), Soon(), read.Callback());
  EXPECT_FALSE(read.done.HasBeenNotified());
  for (int worker : {0, 1}) {
    ASSERT_TRUE(DoPush(*f.leader, UniformPush(worker, 0, 1.0f + worker)).ok());
  }
  EXPECT_FALSE(read.done.HasBeenNotified());  // the leader has it, not yet here
  const SentRecords sent = Take(*f.leader);
  ASSERT_TRUE(f.follower->ApplyStepRecords(sent.records, sent.sums).ok());
  ASSERT_TRUE(read.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(read.status.ok()) << read.status;
  auto led = DoPull(*f.leader, PullAt(-1, 1), Soon());
  ASSERT_TRUE(led->status.ok());
  ASSERT_EQ(read.blocks.size(), led->blocks.size());
  for (size_t i = 0; i < read.blocks.size(); ++i) {
    EXPECT_EQ(read.blocks[i].version, 1);
    EXPECT_EQ(*read.blocks[i].values, *led->blocks[i].values) << "block " << i;
  }
  // A read of the next step waits; the takeover ends it, and later reads.
  PullResult waiting;
  f.follower->PullOnBackup(PullAt(1, 2), Soon(), waiting.Callback());
  EXPECT_FALSE(waiting.done.HasBeenNotified());
  f.follower->FailReplicaReads(absl::UnavailableError("took over"));
  ASSERT_TRUE(waiting.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(waiting.status.code(), absl::StatusCode::kUnavailable);
  PullResult late;
  f.follower->PullOnBackup(PullAt(0, 1), Soon(), late.Callback());
  ASSERT_TRUE(late.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(late.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(f.follower->Stats().version(), 1);
}

// A take holds no more sums than asked (past its first record); records
// not sent go back in the order they were made.
TEST(ShardStepRecordsTest, ATakeIsBoundedAndReturnsKeepTheOrder) {
  LeaderAndFollower f = MakeLeaderAndFollower();
  for (int worker : {0, 1}) {
    ASSERT_TRUE(DoPush(*f.leader, UniformPush(worker, 0, 1)).ok());
  }
  ASSERT_EQ(f.leader->StepRecordsMade(), 3);  // blocks of 4, 2 and 2 floats
  Shard::TakenStepRecords first = f.leader->TakeStepRecords(/*max=*/1);
  EXPECT_EQ(first.records.records_size(), 1);
  EXPECT_EQ(first.places, std::vector<int64_t>{0});
  Shard::TakenStepRecords rest = f.leader->TakeStepRecords(/*max=*/16);
  EXPECT_EQ(rest.records.records_size(), 2);
  EXPECT_EQ(rest.places, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(f.leader->StepRecordsConfirmed(), 0);
  // Not sent: back in the queue, in order, whichever comes back first.
  f.leader->ReturnStepRecords(std::move(rest));
  f.leader->ReturnStepRecords(std::move(first));
  Shard::TakenStepRecords all = f.leader->TakeStepRecords(int64_t{1} << 20);
  ASSERT_EQ(all.records.records_size(), 3);
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(all.records.records(i).local_block(), i);
  f.leader->ConfirmStepRecords(std::move(all));
  EXPECT_EQ(f.leader->StepRecordsConfirmed(), 3);
}

// Two messages may be on their way at once (the service's two senders): a
// block's next record waits until its last one is confirmed or back, so a
// backup gets each block's steps in order, while the other blocks' records
// go on; and the records confirmed count only up to the first that is not,
// whatever order the messages finish in.
TEST(ShardStepRecordsTest, ABlocksRecordsLeaveOneAtATimeInStepOrder) {
  LeaderAndFollower f = MakeLeaderAndFollower();
  // Steps 0 and 1 of every block (plain pushes: the shard does not wait for
  // the records), made in the order b0s0 b1s0 b2s0 b0s1 b1s1 b2s1.
  for (int64_t step : {0, 1}) {
    for (int worker : {0, 1}) {
      ASSERT_TRUE(
          DoPush(*f.leader, UniformPush(worker, step, 1.0f + step)).ok());
    }
  }
  ASSERT_EQ(f.leader->StepRecordsMade(), 6);
  Shard::TakenStepRecords a = f.leader->TakeStepRecords(/*max=*/1);  // b0s0
  // b1s0 and b2s0; each block's step 1 waits for its step 0.
  Shard::TakenStepRecords b = f.leader->TakeStepRecords(int64_t{1} << 20);
  ASSERT_EQ(b.places, (std::vector<int64_t>{1, 2}));
  EXPECT_FALSE(f.leader->HasStepRecords());
  EXPECT_EQ(f.leader->TakeStepRecords(int64_t{1} << 20).records.records_size(),
            0);
  // b confirmed before a: nothing counts past a, but blocks 1 and 2 go on
  // (b0s1, queued before them, still waits for a).
  const SentRecords b_sent = Serialized(b);
  f.leader->ConfirmStepRecords(std::move(b));
  EXPECT_EQ(f.leader->StepRecordsConfirmed(), 0);
  ASSERT_TRUE(f.leader->HasStepRecords());
  Shard::TakenStepRecords c = f.leader->TakeStepRecords(int64_t{1} << 20);
  ASSERT_EQ(c.places, (std::vector<int64_t>{4, 5}));
  // a did not reach the backup: back in front of b0s1.
  f.leader->ReturnStepRecords(std::move(a));
  EXPECT_EQ(f.leader->StepRecordsConfirmed(), 0);
  Shard::TakenStepRecords again = f.leader->TakeStepRecords(int64_t{1} << 20);
  ASSERT_EQ(again.places, std::vector<int64_t>{0});
  const SentRecords again_sent = Serialized(again);
  f.leader->ConfirmStepRecords(std::move(again));
  EXPECT_EQ(f.leader->StepRecordsConfirmed(), 3);  // b0s1 is queued
  const SentRecords c_sent = Serialized(c);
  f.leader->ConfirmStepRecords(std::move(c));
  EXPECT_EQ(f.leader->StepRecordsConfirmed(), 3);
  Shard::TakenStepRecords last = f.leader->TakeStepRecords(int64_t{1} << 20);
  ASSERT_EQ(last.places, std::vector<int64_t>{3});
  EXPECT_EQ(last.records.records(0).local_block(), 0);
  EXPECT_EQ(last.records.records(0).step(), 1);
  const SentRecords last_sent = Serialized(last);
  f.leader->ConfirmStepRecords(std::move(last));
  EXPECT_EQ(f.leader->StepRecordsConfirmed(), 6);
  // A backup that got the messages in the order they were confirmed holds
  // the leader's model: blocks apply independently of each other.
  for (const SentRecords* sent : {&b_sent, &again_sent, &c_sent, &last_sent}) {
    ASSERT_TRUE(f.follower->ApplyStepRecords(sent->records, sent->sums).ok());
  }
  ExpectSameModel(*f.leader, *f.follower, 2);
}

// What a pull of the record window waits for (the service's pulls showing
// step s + 1 wait until it is s or later): the lowest step of a record
// queued or on its way, whatever order messages are confirmed in.
TEST(ShardStepRecordsTest,
     TheOldestUnconfirmedStepIsOfRecordsQueuedOrOnTheirWay) {
  LeaderAndFollower f = MakeLeaderAndFollower();
  EXPECT_EQ(f.leader->OldestUnconfirmedStep(),
            std::numeric_limits<int64_t>::max());
  for (int64_t step : {0, 1}) {
    for (int worker : {0, 1}) {
      ASSERT_TRUE(
          DoPush(*f.leader, UniformPush(worker, step, 1.0f + step)).ok());
    }
  }
  EXPECT_EQ(f.leader->OldestUnconfirmedStep(), 0);
  Shard::TakenStepRecords a = f.leader->TakeStepRecords(/*max=*/1);  // b0s0
  Shard::TakenStepRecords b = f.leader->TakeStepRecords(int64_t{1} << 20);
  // Every step-0 record is on its way, b0s0 in a.
  EXPECT_EQ(f.leader->OldestUnconfirmedStep(), 0);
  f.leader->ConfirmStepRecords(std::move(b));
  EXPECT_EQ(f.leader->OldestUnconfirmedStep(), 0);  // a is still out
  Shard::TakenStepRecords c = f.leader->TakeStepRecords(int64_t{1} << 20);
  f.leader->ConfirmStepRecords(std::move(a));
  EXPECT_EQ(f.leader->OldestUnconfirmedStep(), 1);  // b0s1 queued, c out
  f.leader->ConfirmStepRecords(std::move(c));
  EXPECT_EQ(f.leader->OldestUnconfirmedStep(), 1);  // b0s1 queued
  f.leader->ConfirmStepRecords(f.leader->TakeStepRecords(int64_t{1} << 20));
  EXPECT_EQ(f.leader->OldestUnconfirmedStep(),
            std::numeric_limits<int64_t>::max());
}

// Records reach only a replicated sync shard; others refuse them.
TEST(ShardStepRecordsTest, AShardThatTakesNoRecordsRefusesThem) {
  Fixture f = MakeShard(ConsistencyMode::kAsync, 2);
  StepRecords records;
  records.add_records()->set_local_block(0);
  EXPECT_EQ(f.shard->ApplyStepRecords(records, "").code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(ShardStepRecordsTest, RecordsThatDoNotFitAreRefusedWhole) {
  LeaderAndFollower f = MakeLeaderAndFollower();
  for (int64_t step = 0; step < 2; ++step) {
    for (int worker : {0, 1}) {
      ASSERT_TRUE(DoPush(*f.leader, UniformPush(worker, step, 1)).ok());
    }
  }
  // Both steps in one message (a take holds one step of a block: two).
  SentRecords sent = Take(*f.leader);
  const SentRecords step1 = Take(*f.leader);
  sent.records.MergeFrom(step1.records);
  sent.sums += step1.sums;
  ASSERT_EQ(sent.records.records_size(), 6);
  // Step 1 without step 0 (a record missed): refused, nothing applied.
  StepRecords ahead;
  std::string ahead_sums;
  for (int i = 3; i < 6; ++i) *ahead.add_records() = sent.records.records(i);
  ahead_sums = sent.sums.substr(sent.sums.size() / 2);
  absl::Status refused = f.follower->ApplyStepRecords(ahead, ahead_sums);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_EQ(f.follower->Stats().version(), 0);
  // Sums short by a byte, a block the shard lacks, a worker out of range.
  EXPECT_EQ(
      f.follower->ApplyStepRecords(sent.records, sent.sums.substr(1)).code(),
      absl::StatusCode::kInvalidArgument);
  StepRecords bad = sent.records;
  bad.mutable_records(0)->set_local_block(3);
  EXPECT_EQ(f.follower->ApplyStepRecords(bad, sent.sums).code(),
            absl::StatusCode::kInvalidArgument);
  bad = sent.records;
  bad.mutable_records(0)->add_workers(2);
  EXPECT_EQ(f.follower->ApplyStepRecords(bad, sent.sums).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(f.follower->Stats().version(), 0);
  ASSERT_TRUE(f.follower->ApplyStepRecords(sent.records, sent.sums).ok());
  ExpectSameModel(*f.leader, *f.follower, 2);
}

// A restored leader that takes the workers' step (a fast-forward) records
// the skip: its follower, restored from the same step, skips with it, and
// the next step's records then follow on (before, they were refused as
// "a record before it is missing", and the follower dropped).
// A clipped step's record carries the norm the applier gathered: a worker
// that asks ClipNorm after the step, of a backup that took over since,
// reads it there as it would have on the primary (ps.last_grad_norm).
TEST(ShardStepRecordsTest, AClippedStepsNormTravelsWithItsRecord) {
  LeaderAndFollower f = MakeLeaderAndFollower();
  for (int worker = 0; worker < 2; ++worker) {
    PushRequest push = UniformPush(worker, 0, worker == 0 ? 1 : 3);
    push.set_clip_max_norm(0.5);
    ASSERT_TRUE(DoPush(*f.leader, push).ok());
  }
  ApplyClipRequest apply;
  apply.set_protocol_version(kProtocolVersion);
  apply.set_step(0);
  apply.set_coefficient(0.25);
  apply.set_norm(5.5);
  ASSERT_TRUE(f.leader->ApplyClip(apply).ok());
  SentRecords sent = Take(*f.leader);
  ASSERT_EQ(sent.records.records_size(), 3);
  for (const StepRecord& r : sent.records.records()) {
    EXPECT_TRUE(r.clipped());
    EXPECT_DOUBLE_EQ(r.clip_norm(), 5.5);
  }
  ASSERT_TRUE(f.follower->ApplyStepRecords(sent.records, sent.sums).ok());
  ExpectSameModel(*f.leader, *f.follower, 1);

  f.follower->set_leads_steps([] { return true; });
  absl::StatusOr<ClipNormResponse> late = AskClipNorm(*f.follower, 1, 0);
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_TRUE(late->applied());
  EXPECT_DOUBLE_EQ(late->applied_norm(), 5.5);

  // A norm that is no norm is refused with the record, before any change.
  StepRecords bad = sent.records;
  bad.mutable_records(0)->set_step(1);
  bad.mutable_records(0)->set_clip_norm(-1);
  absl::Status refused = f.follower->ApplyStepRecords(bad, sent.sums);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_EQ(f.follower->Stats().version(), 1);
}

TEST(ShardStepRecordsTest, ARestoredLeadersSkipIsRecordedAndFollowed) {
  LeaderAndFollower before = MakeLeaderAndFollower();
  for (int worker : {0, 1}) {
    ASSERT_TRUE(DoPush(*before.leader, UniformPush(worker, 0, 1)).ok());
  }
  const RestoredShard checkpoint = RestoredFrom(*before.leader);
  LeaderAndFollower f = MakeLeaderAndFollower(&checkpoint);
  // The workers were at step 4 when the set went down: steps 1-3 are lost.
  auto pulled = DoPull(*f.leader, PullAt(0, 4), Soon());
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  EXPECT_EQ(f.leader->Stats().steps_lost(), 3);
  SentRecords skips = Take(*f.leader);
  ASSERT_EQ(skips.records.records_size(), 3);  // one a block
  EXPECT_EQ(skips.records.records(0).step(), 1);
  EXPECT_EQ(skips.records.records(0).skip_to(), 4);
  EXPECT_TRUE(skips.sums.empty());
  ASSERT_TRUE(f.follower->ApplyStepRecords(skips.records, skips.sums).ok());
  EXPECT_EQ(f.follower->Stats().version(), 4);
  EXPECT_EQ(f.follower->Stats().steps_lost(), 3);
  EXPECT_EQ(f.follower->Stats().updates_lost(),
            f.leader->Stats().updates_lost());
  // Again (an answer lost): a repeat.
  ASSERT_TRUE(f.follower->ApplyStepRecords(skips.records, skips.sums).ok());
  EXPECT_EQ(f.follower->Stats().steps_lost(), 3);
  for (int worker : {0, 1}) {
    ASSERT_TRUE(DoPush(*f.leader, UniformPush(worker, 4, 2)).ok());
  }
  SentRecords step = Take(*f.leader);
  ASSERT_TRUE(f.follower->ApplyStepRecords(step.records, step.sums).ok());
  ExpectSameModel(*f.leader, *f.follower, 5);

  // A skip that goes backwards, or carries a sum, is refused.
  StepRecords bad = skips.records;
  bad.mutable_records(0)->set_skip_to(1);
  EXPECT_EQ(f.follower->ApplyStepRecords(bad, "").code(),
            absl::StatusCode::kInvalidArgument);
}

// Half a sync step is not a state to send: the step must finish first. Nor
// is the state of a shard its workers have not met yet: it may skip to
// their step at any request, a pull too.
TEST(ShardReplicaStateTest, APartStepIsNotQuiet) {
  Fixture f = MakeSparseShard(ConsistencyMode::kSync, 2);
  EXPECT_FALSE(f.shard->QuietForTransfer());                 // not met yet
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, 0, 1)).ok());  // held early
  EXPECT_FALSE(f.shard->QuietForTransfer());
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 0, 1)).ok());
  EXPECT_TRUE(f.shard->QuietForTransfer());
  ASSERT_TRUE(f.shard->SparsePush(SparsePushOf(0, 0, {7}, {1, 1})).ok());
  EXPECT_FALSE(f.shard->QuietForTransfer());
  ASSERT_TRUE(f.shard->SparsePush(SparsePushOf(1, 0, {7}, {1, 1})).ok());
  EXPECT_TRUE(f.shard->QuietForTransfer());

  // Restored: quiet once a worker's pull has taken it to the job's step.
  auto restored = std::move(*Shard::Create(f.options));
  ASSERT_TRUE(restored->Restore(RestoredFrom(*f.shard)).ok());
  EXPECT_FALSE(restored->QuietForTransfer());
  auto pulled = DoPull(*restored, PullAt(0, 4), Soon());
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  EXPECT_TRUE(restored->QuietForTransfer());
}

// A table restored behind the workers (here from a checkpoint without sparse
// rows, as an older ps_server wrote) catches up with the step they bring,
// instead of refusing them.
TEST(ShardSparseTest, RestoredShardCatchesItsTablesUp) {
  Fixture original = MakeSparseShard(ConsistencyMode::kSync, 1);
  auto shard = std::move(*Shard::Create(original.options));
  ASSERT_TRUE(shard->Restore(RestoredFrom(*original.shard)).ok());
  ASSERT_TRUE(shard->SparsePush(SparsePushOf(0, 5, {7}, {2, 2})).ok());
  EXPECT_EQ(SparseRows(*shard, 6, {7}), (std::vector<float>{-2, -2}));
  const StatsResponse stats = shard->Stats();
  EXPECT_EQ(stats.sparse(0).version(), 6);
  EXPECT_EQ(stats.steps_lost(), 5);
}

// The first request after a restore may be a dense one that needs no
// catching up; the tables must then already be at the dense step.
TEST(ShardSparseTest, RestoredTablesStartAtTheDenseStep) {
  Fixture original = MakeSparseShard(ConsistencyMode::kSync, 1);
  for (int step = 0; step < 2; ++step) {
    ASSERT_TRUE(DoPush(*original.shard, UniformPush(0, step, 1)).ok());
  }
  auto shard = std::move(*Shard::Create(original.options));
  ASSERT_TRUE(shard->Restore(RestoredFrom(*original.shard)).ok());
  EXPECT_EQ(shard->Stats().sparse(0).version(), 2);
  ASSERT_TRUE(DoPull(*shard, PullAt(0, 2), Soon())->status.ok());
  absl::StatusOr<SparsePushResponse> pushed =
      shard->SparsePush(SparsePushOf(0, 2, {7}, {2, 2}));
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(shard->Stats().sparse(0).version(), 3);
}

TEST(ShardSparseTest, PushFromAPreviousLifeCompletesTheRestoredStep) {
  Fixture original = MakeSparseShard(ConsistencyMode::kSync, 2);
  auto shard = std::move(*Shard::Create(original.options));
  ASSERT_TRUE(shard->Restore(RestoredFrom(*original.shard)).ok());
  ASSERT_TRUE(DoPull(*shard, PullAt(1, 0), Soon())->status.ok());  // no news
  SparsePullRequest pull;  // worker 1 pulled step 0 from the previous life
  pull.set_protocol_version(kProtocolVersion);
  pull.set_worker_id(1);
  pull.set_step(1);
  pull.set_table("emb");
  pull.add_ids(7);
  absl::Notification pulled;
  shard->SparsePull(pull, Soon(), [&](absl::Status s, SparsePullResponse) {
    EXPECT_TRUE(s.ok()) << s;
    pulled.Notify();
  });
  EXPECT_FALSE(pulled.HasBeenNotified());  // worker 0's step 0 is not in
  absl::StatusOr<SparsePushResponse> pushed =
      shard->SparsePush(SparsePushOf(0, 1, {7}, {2, 2}));
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_FALSE(pushed->duplicate());
  EXPECT_TRUE(pulled.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(shard->Stats().gradients_lost(), 8);  // 3 blocks + 1 table each
}

// Worker 1 pulled the table at step 1 from the previous life and now asks
// for the dense blocks; worker 0 asks for the table. Each request vouches
// for its worker's whole step 0, or each would wait for the other forever.
TEST(ShardSparseTest, ARequestOfAStepCreditsEveryTableAndBlock) {
  Fixture original = MakeSparseShard(ConsistencyMode::kSync, 2);
  auto shard = std::move(*Shard::Create(original.options));
  ASSERT_TRUE(shard->Restore(RestoredFrom(*original.shard)).ok());
  ASSERT_TRUE(DoPull(*shard, PullAt(1, 0), Soon())->status.ok());  // no news
  SparsePullRequest pull;
  pull.set_protocol_version(kProtocolVersion);
  pull.set_worker_id(0);
  pull.set_step(1);
  pull.set_table("emb");
  pull.add_ids(7);
  absl::Notification table_pulled;
  shard->SparsePull(pull, Soon(), [&](absl::Status s, SparsePullResponse) {
    EXPECT_TRUE(s.ok()) << s;
    table_pulled.Notify();
  });
  EXPECT_FALSE(table_pulled.HasBeenNotified());
  auto dense = DoPull(*shard, PullAt(1, 1), Soon());
  ASSERT_TRUE(dense->status.ok()) << dense->status;
  EXPECT_EQ(dense->blocks[0].version, 1);
  EXPECT_TRUE(table_pulled.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(shard->Stats().sparse(0).version(), 1);
}

// A checkpoint carries the tables' rows and steps: a restored shard answers
// pulls with the trained rows, not fresh ones.
TEST(ShardSparseTest, RestoredShardKeepsItsRows) {
  Fixture original = MakeSparseShard(ConsistencyMode::kSync, 1);
  ASSERT_TRUE(
      original.shard->SparsePush(SparsePushOf(0, 0, {7, 9}, {2, 2, 4, 4}))
          .ok());
  const std::vector<float> trained = SparseRows(*original.shard, 1, {7, 9, 11});
  ASSERT_EQ(trained, (std::vector<float>{-2, -2, -4, -4, 0, 0}));
  absl::StatusOr<ShardSnapshot> snapshot = original.shard->Snapshot(0);
  ASSERT_TRUE(snapshot.ok());
  ASSERT_EQ(snapshot->sparse.size(), 1u);
  EXPECT_EQ(snapshot->sparse[0].version, 1);
  RestoredShard restored = RestoredFrom(*original.shard);
  restored.sparse = snapshot->sparse;
  auto shard = std::move(*Shard::Create(original.options));
  ASSERT_TRUE(shard->Restore(restored).ok());
  EXPECT_EQ(shard->Stats().sparse(0).version(), 1);
  EXPECT_EQ(SparseRows(*shard, 1, {7, 9, 11}), trained);
}

// A checkpoint copies objects one by one, so a table can be saved steps
// behind its blocks; restored, it skips to their step, keeping its rows.
TEST(ShardSparseTest, ATableSavedBehindItsBlocksSkipsToTheirStep) {
  Fixture original = MakeSparseShard(ConsistencyMode::kSync, 1);
  ASSERT_TRUE(original.shard->SparsePush(SparsePushOf(0, 0, {7}, {2, 2})).ok());
  absl::StatusOr<ShardSnapshot> table_at_1 = original.shard->Snapshot(0);
  ASSERT_TRUE(table_at_1.ok());
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE(DoPush(*original.shard, UniformPush(0, step, 1)).ok());
  }
  RestoredShard restored = RestoredFrom(*original.shard);  // blocks at 3
  restored.sparse = table_at_1->sparse;                    // table at 1
  auto shard = std::move(*Shard::Create(original.options));
  ASSERT_TRUE(shard->Restore(restored).ok());
  const StatsResponse stats = shard->Stats();
  EXPECT_EQ(stats.sparse(0).version(), 3);
  EXPECT_EQ(stats.steps_lost(), 2);
  EXPECT_EQ(SparseRows(*shard, 3, {7}), (std::vector<float>{-2, -2}));
}

// A refused push from a previous life can still complete another object
// with its credit; that object's waiting pulls are answered at once.
TEST(ShardSparseTest, ARefusedPushStillReleasesWhatItsCreditCompleted) {
  Fixture original = MakeSparseShard(ConsistencyMode::kSync, 2);
  auto shard = std::move(*Shard::Create(original.options));
  ASSERT_TRUE(shard->Restore(RestoredFrom(*original.shard)).ok());
  ASSERT_TRUE(DoPull(*shard, PullAt(1, 0), Soon())->status.ok());  // no news
  ASSERT_TRUE(shard->SparsePush(SparsePushOf(1, 0, {7}, {2, 2})).ok());
  SparsePullRequest pull;  // an observer waiting for the table's step 1
  pull.set_protocol_version(kProtocolVersion);
  pull.set_worker_id(-1);
  pull.set_step(1);
  pull.set_table("emb");
  pull.add_ids(7);
  absl::Notification pulled;
  shard->SparsePull(pull, absl::Now() + absl::Seconds(60),
                    [&](absl::Status s, SparsePullResponse) {
                      EXPECT_TRUE(s.ok()) << s;
                      pulled.Notify();
                    });
  ASSERT_FALSE(pulled.HasBeenNotified());
  // Worker 0 pulled step 1 from the previous life: its credit completes the
  // table's step 0 (worker 1 had pushed), not the blocks' (worker 1's dense
  // gradient is missing), so the push itself waits.
  absl::StatusOr<PushResponse> pushed =
      DoPush(*shard, UniformPush(0, 1, 2, /*pulled_version=*/1));
  EXPECT_EQ(pushed.status().code(), absl::StatusCode::kUnavailable)
      << pushed.status();
  EXPECT_TRUE(pulled.HasBeenNotified());
  EXPECT_EQ(shard->Stats().sparse(0).version(), 1);
  EXPECT_TRUE(pulled.WaitForNotificationWithTimeout(absl::Seconds(60)));
}

// Issue 24: a CTR job hung after a shard restored. Worker 0 asks the
// restored shard for the table at step 1 (one past its step 0): nothing to
// skip, so the pull waits. Then worker 1, which got further with the shard's
// previous life, brings a later step and the shard fast-forwards to it. The
// step worker 0 waits for is then done, but nobody told it: its pull
// waited out its deadline while every other worker waited on worker 0.
// Whatever request moves the shard forward answers the pulls it completed.
TEST(ShardSparseTest, AFastForwardAnswersThePullsWaitingForTheStepsItSkips) {
  struct Trigger {
    const char* name;
    std::function<absl::Status(Shard&)> request;
  };
  const std::vector<Trigger> triggers = {
      {"sparse push of step 1",
       [](Shard& shard) {
         return shard.SparsePush(SparsePushOf(1, 1, {9}, {2, 2})).status();
       }},
      {"dense push of step 1",
       [](Shard& shard) {
         return DoPush(shard, UniformPush(1, 1, 2, /*pulled_version=*/1))
             .status();
       }},
      {"sparse pull of step 2",
       [](Shard& shard) {
         SparsePullRequest pull;
         pull.set_protocol_version(kProtocolVersion);
         pull.set_worker_id(1);
         pull.set_step(2);
         pull.set_table("emb");
         pull.add_ids(9);
         absl::Notification done;
         absl::Status status;
         shard.SparsePull(pull, Soon(),
                          [&](absl::Status s, SparsePullResponse) {
                            status = std::move(s);
                            done.Notify();
                          });
         done.WaitForNotificationWithTimeout(absl::Seconds(10));
         return status;
       }},
      {"dense pull of step 2",
       [](Shard& shard) {
         return DoPull(shard, PullAt(1, 2), Soon())->status;
       }},
  };
  for (const Trigger& trigger : triggers) {
    SCOPED_TRACE(trigger.name);
    Fixture original = MakeSparseShard(ConsistencyMode::kSync, 2);
    auto shard = std::move(*Shard::Create(original.options));
    ASSERT_TRUE(shard->Restore(RestoredFrom(*original.shard)).ok());
    SparsePullRequest pull;
    pull.set_protocol_version(kProtocolVersion);
    pull.set_worker_id(0);
    pull.set_step(1);
    pull.set_table("emb");
    pull.add_ids(7);
    absl::Notification pulled;
    absl::Status pull_status;
    shard->SparsePull(pull, Soon(), [&](absl::Status s, SparsePullResponse) {
      pull_status = std::move(s);
      pulled.Notify();
    });
    ASSERT_FALSE(pulled.HasBeenNotified());  // worker 1's step 0 is not in
    const absl::Status moved = trigger.request(*shard);
    EXPECT_TRUE(moved.ok()) << moved;
    EXPECT_GE(shard->Stats().sparse(0).version(), 1);
    // Answered by the request that moved the shard, not by the deadline.
    EXPECT_TRUE(pulled.HasBeenNotified());
    ASSERT_TRUE(pulled.WaitForNotificationWithTimeout(absl::Seconds(10)));
    EXPECT_TRUE(pull_status.ok()) << pull_status;
    EXPECT_EQ(shard->Stats().waiting_pulls(), 0);
    EXPECT_GE(shard->Stats().steps_lost(), 1);
  }
}

TEST(ShardSparseTest, AsyncAppliesEachPushOnArrival) {
  Fixture f = MakeSparseShard(ConsistencyMode::kAsync, 2);
  ASSERT_TRUE(f.shard->SparsePush(SparsePushOf(0, 0, {7}, {2, 2})).ok());
  ASSERT_TRUE(f.shard->SparsePush(SparsePushOf(1, 0, {7}, {4, 4})).ok());
  EXPECT_EQ(SparseRows(*f.shard, 0, {7}), (std::vector<float>{-6, -6}));
}

// Sync dense layers with an async table (SparseTableSpec.mode): the table's
// pushes are applied on arrival, exactly once, and its pulls never wait,
// while the dense step still waits for every worker and is their mean.
TEST(ShardSparseTest, AnAsyncTableUnderSyncServersNeverWaitsForTheStep) {
  Fixture f = MakeSparseShard(ConsistencyMode::kSync, 2, /*dim=*/2, "sgd",
                              /*admit_after=*/0, "async");
  ASSERT_TRUE(f.shard->SparsePush(SparsePushOf(0, 0, {7}, {2, 2})).ok());
  // Worker 1 has pushed nothing, yet the row has worker 0's update.
  EXPECT_EQ(SparseRows(*f.shard, 1, {7}), (std::vector<float>{-2, -2}));
  absl::StatusOr<SparsePushResponse> again =
      f.shard->SparsePush(SparsePushOf(0, 0, {7}, {2, 2}));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->duplicate());
  ASSERT_TRUE(f.shard->SparsePush(SparsePushOf(1, 0, {7}, {4, 4})).ok());
  EXPECT_EQ(SparseRows(*f.shard, 1, {7}), (std::vector<float>{-6, -6}));

  ASSERT_TRUE(DoPush(*f.shard, UniformPush(0, 0, 1)).ok());
  PullResult dense;
  f.shard->Pull(PullAt(0, 1), Soon(), dense.Callback());
  EXPECT_FALSE(dense.done.HasBeenNotified());  // the dense step waits
  ASSERT_TRUE(DoPush(*f.shard, UniformPush(1, 0, 3)).ok());
  ASSERT_TRUE(dense.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(dense.status.ok()) << dense.status;
  EXPECT_EQ(dense.blocks[0].version, 1);
  const StatsResponse stats = f.shard->Stats();
  EXPECT_EQ(stats.version(), 1);
  EXPECT_EQ(stats.sparse(0).mode(), "async");
  EXPECT_EQ(stats.sparse(0).rows_pushed(), 2);
  EXPECT_EQ(stats.gradients_lost(), 0);

  // Restored, the table keeps its rows and counts no step lost.
  absl::StatusOr<ShardSnapshot> snapshot = f.shard->Snapshot(0);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();
  RestoredShard saved = RestoredFrom(*f.shard);
  saved.sparse = snapshot->sparse;
  auto restored = std::move(*Shard::Create(f.options));
  ASSERT_TRUE(restored->Restore(saved).ok());
  EXPECT_EQ(SparseRows(*restored, 1, {7}), (std::vector<float>{-6, -6}));
  EXPECT_EQ(restored->Stats().steps_lost(), 0);
  EXPECT_EQ(restored->Stats().updates_lost(), 0);
}

TEST(ShardSparseTest, ATableModeTheServersDoNotRunIsRefusedAtRegistration) {
  ShardOptions options;
  options.mode = ConsistencyMode::kAsync;
  auto shard = std::move(*Shard::Create(options));
  RegisterModelRequest request = OneTableRequest(/*dim=*/4);
  SparseTableSpec* table = request.mutable_schema()->mutable_sparse(0);
  table->set_mode("sync");
  absl::StatusOr<RegisterModelResponse> refused = shard->Register(request);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find(
                "sparse table 'emb' asks for mode 'sync' but the servers "
                "run --mode=async"),
            absl::string_view::npos)
      << refused.status();
  table->set_mode("bsp");
  refused = shard->Register(request);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("mode must be empty"),
            absl::string_view::npos)
      << refused.status();
  EXPECT_FALSE(shard->Stats().model_registered());
  table->set_mode("async");
  EXPECT_TRUE(shard->Register(request).ok());
}

TEST(ShardSparseTest, BadSparsePushesAreRefusedAndChangeNothing) {
  Fixture f = MakeSparseShard(ConsistencyMode::kAsync, 1);
  struct Case {
    std::string name;
    SparsePushRequest push;
    std::string message;
  };
  std::vector<Case> cases = {
      {"duplicate id", SparsePushOf(0, 0, {7, 7}, {1, 1, 1, 1}),
       "appears twice"},
      {"wrong length", SparsePushOf(0, 0, {7}, {1, 1, 1}), "expected 8"},
      {"nan", SparsePushOf(0, 0, {7}, {1, NAN}), "NaN"},
  };
  SparsePushRequest unknown = SparsePushOf(0, 0, {7}, {1, 1});
  unknown.set_table("nope");
  cases.push_back({"unknown table", unknown, "unknown sparse table 'nope'"});
  for (const Case& c : cases) {
    const absl::Status status = f.shard->SparsePush(c.push).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_NE(status.message().find(c.message), std::string::npos)
        << c.name << ": " << status;
  }
  EXPECT_EQ(SparseRows(*f.shard, 0, {7}), (std::vector<float>{0, 0}));
}

// The answer is sized from the request: ids times the table's dim. It is
// bounded before anything is allocated (16,385 rows of dim 65,536 would be
// 4 GiB).
TEST(ShardSparseTest, APullTooLargeToAnswerIsRefusedBeforeAllocating) {
  Fixture f = MakeSparseShard(ConsistencyMode::kAsync, 1, /*dim=*/65536);
  SparsePullRequest pull;
  pull.set_protocol_version(kProtocolVersion);
  pull.set_worker_id(-1);
  pull.set_table("emb");
  for (uint64_t id = 0; id < 16385; ++id) pull.add_ids(id);
  absl::Notification done;
  absl::Status answer;
  f.shard->SparsePull(pull, Soon(),
                      [&](absl::Status status, SparsePullResponse) {
                        answer = std::move(status);
                        done.Notify();
                      });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(answer.code(), absl::StatusCode::kInvalidArgument) << answer;
  EXPECT_NE(answer.message().find("pull fewer ids"), std::string::npos)
      << answer;
  EXPECT_EQ(f.shard->Stats().sparse(0).rows(), 0);
}

// The sparse path equals the dense path on a small vocabulary: the same row
// gradients from two workers, sent as sparse rows to a table and as a full
// dense tensor (zeros for untouched rows), give the same model under sync
// SGD, step after step.
TEST(ShardSparseTest, SparsePathEqualsDensePath) {
  constexpr int kVocab = 50, kDim = 4, kSteps = 20;
  ShardOptions options;
  options.num_workers = 2;
  options.optimizer.learning_rate = 0.3f;
  options.max_pull_wait = absl::Seconds(5);
  auto shard = std::move(*Shard::Create(options));
  RegisterModelRequest request;
  request.set_protocol_version(kProtocolVersion);
  ModelSchema& schema = *request.mutable_schema();
  schema.set_block_elements(64);  // several blocks
  DenseTensorSpec* dense = schema.add_dense();
  dense->set_name("emb_dense");
  dense->add_shape(kVocab);
  dense->add_shape(kDim);  // ZEROS init
  SparseTableSpec* table = schema.add_sparse();
  table->set_name("emb");
  table->set_dim(kDim);  // ZEROS init
  table->mutable_optimizer()->set_name("sgd");
  table->mutable_optimizer()->set_learning_rate(0.3f);
  request.set_num_shards(1);
  request.set_num_workers(2);
  ASSERT_TRUE(shard->Register(request).ok());
  absl::StatusOr<Partition> partition = Partition::Create(schema, 1);
  ASSERT_TRUE(partition.ok());

  std::mt19937 random(7);
  std::uniform_real_distribution<float> value(-1, 1);
  for (int step = 0; step < kSteps; ++step) {
    for (int worker = 0; worker < 2; ++worker) {
      // A random subset of rows with random gradients.
      std::vector<uint64_t> ids;
      std::vector<float> rows;
      std::vector<float> full(kVocab * kDim, 0.0f);
      for (int id = 0; id < kVocab; ++id) {
        if (random() % 3 != 0) continue;
        ids.push_back(id);
        for (int j = 0; j < kDim; ++j) {
          const float g = value(random);
          rows.push_back(g);
          full[id * kDim + j] = g;
        }
      }
      ASSERT_TRUE(
          shard->SparsePush(SparsePushOf(worker, step, ids, rows)).ok());
      PushRequest push;
      push.set_protocol_version(kProtocolVersion);
      push.set_worker_id(worker);
      push.set_step(step);
      for (const BlockLocation& loc : partition->blocks()) {
        TensorBlock* block = push.add_blocks();
        block->set_tensor("emb_dense");
        block->set_block(loc.block);
        EncodeFloat32(absl::MakeConstSpan(full).subspan(loc.offset, loc.length),
                      block->mutable_data());
      }
      ASSERT_TRUE(DoPush(*shard, push).ok());
    }
  }
  std::vector<uint64_t> all(kVocab);
  for (int id = 0; id < kVocab; ++id) all[id] = id;
  const std::vector<float> sparse = SparseRows(*shard, kSteps, all);
  auto pulled = DoPull(*shard, PullAt(0, kSteps), Soon());
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  std::vector<float> dense_values;
  for (const PulledBlock& block : pulled->blocks) {
    dense_values.insert(dense_values.end(), block.values->begin(),
                        block.values->end());
  }
  ASSERT_EQ(sparse.size(), dense_values.size());
  double max_difference = 0;
  for (size_t i = 0; i < sparse.size(); ++i) {
    max_difference =
        std::max<double>(max_difference, std::abs(sparse[i] - dense_values[i]));
  }
  EXPECT_LE(max_difference, 1e-6);
  EXPECT_GT(std::abs(sparse[0]) + std::abs(sparse[kDim]), 0.1);  // it moved
}

TEST(ShardValidationTest, BlocksOfAnotherShardAreRefused) {
  Fixture f = MakeShard(ConsistencyMode::kAsync, 1, /*shard_id=*/1,
                        /*num_shards=*/2);
  PullRequest pull = PullAt(0, 0);
  BlockRef* ref = pull.add_blocks();
  ref->set_tensor("w");
  ref->set_block(0);  // global block 0 lives on shard 0
  auto pulled = DoPull(*f.shard, pull, Soon());
  EXPECT_EQ(pulled->status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(pulled->status.message().find("lives on shard 0, this is shard 1"),
            std::string::npos)
      << pulled->status;
}

TEST(ShardRegisterTest, IdempotentAndRefusesADifferentSchema) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 1);
  RegisterModelRequest request;
  request.set_protocol_version(kProtocolVersion);
  *request.mutable_schema() = TestSchema();
  request.set_num_shards(1);
  request.set_num_workers(1);
  absl::StatusOr<RegisterModelResponse> again = f.shard->Register(request);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->created());
  request.mutable_schema()->mutable_dense(1)->set_shape(0, 3);
  absl::StatusOr<RegisterModelResponse> different = f.shard->Register(request);
  EXPECT_EQ(different.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(
      different.status().message().find("tensor 1 ('b'): shape [2] vs [3]"),
      std::string::npos)
      << different.status();
  request.mutable_schema()->mutable_dense(1)->set_shape(0, 2);
  request.set_num_workers(5);
  EXPECT_EQ(f.shard->Register(request).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(ShardRegisterTest, RequestsBeforeRegistrationAreRefused) {
  ShardOptions options;
  auto shard = std::move(*Shard::Create(options));
  auto pulled = DoPull(*shard, PullAt(0, 0), Soon());
  EXPECT_EQ(pulled->status.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(pulled->status.message().find("RegisterModel"), std::string::npos);
}

}  // namespace
}  // namespace pstrain

namespace pstrain {
namespace {

// A clipped sync step (shard_clip.cc): held once every gradient is in,
// its share of the norm answered, applied once with the coefficient.
TEST(ShardClipTest, HoldsTheStepUntilItsCoefficientComesOnce) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 2);
  for (int worker = 0; worker < 2; ++worker) {
    PushRequest push = UniformPush(worker, 0, worker == 0 ? 1 : 3);
    push.set_clip_max_norm(0.5);
    ASSERT_TRUE(DoPush(*f.shard, push).ok());
  }
  EXPECT_EQ(f.shard->Stats().version(), 0);  // held: no coefficient yet
  EXPECT_EQ(f.shard->PendingClipStep(), std::optional<int64_t>(0));
  absl::StatusOr<ClipNormResponse> share = AskClipNorm(*f.shard, 0, 0);
  ASSERT_TRUE(share.ok()) << share.status();
  // The mean gradient is 2 in each of the model's 8 elements.
  EXPECT_DOUBLE_EQ(share->sum_of_squares(), 8 * 2.0 * 2.0);
  EXPECT_DOUBLE_EQ(share->max_norm(), 0.5);
  EXPECT_FALSE(share->applied());

  ApplyClipRequest apply;
  apply.set_protocol_version(kProtocolVersion);
  apply.set_step(0);
  apply.set_coefficient(0.25);
  apply.set_norm(std::sqrt(share->sum_of_squares()));
  absl::StatusOr<ApplyClipResponse> applied = f.shard->ApplyClip(apply);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(applied->blocks_applied(), 3);
  EXPECT_EQ(f.shard->Stats().version(), 1);
  // Once only: a second worker's coefficient changes nothing.
  applied = f.shard->ApplyClip(apply);
  ASSERT_TRUE(applied.ok());
  EXPECT_EQ(applied->blocks_applied(), 0);
  // A worker that asks after the apply learns the norm the applier
  // gathered (its ps.last_grad_norm), not nothing.
  absl::StatusOr<ClipNormResponse> late = AskClipNorm(*f.shard, 1, 0);
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_TRUE(late->applied());
  EXPECT_DOUBLE_EQ(late->applied_norm(), std::sqrt(8 * 2.0 * 2.0));
  auto pulled = DoPull(*f.shard, PullAt(0, 1), Soon());
  ASSERT_TRUE(pulled->status.ok()) << pulled->status;
  EXPECT_FLOAT_EQ(pulled->FirstWeight(), 1 - 0.5f * 0.25f * 2);
}

TEST(ShardClipTest, RefusesBadCoefficientsAndAsyncJobs) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 1);
  ApplyClipRequest apply;
  apply.set_protocol_version(kProtocolVersion);
  for (double bad : {0.0, 1.5, -1.0, std::nan("")}) {
    apply.set_coefficient(bad);
    EXPECT_EQ(f.shard->ApplyClip(apply).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  apply.set_coefficient(0.5);
  for (double bad : {-1.0, std::nan(""), HUGE_VAL}) {
    apply.set_norm(bad);
    EXPECT_EQ(f.shard->ApplyClip(apply).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  apply.set_norm(0);
  Fixture async = MakeShard(ConsistencyMode::kAsync, 1);
  PushRequest push = UniformPush(0, 0, 1);
  push.set_clip_max_norm(1.0);
  EXPECT_EQ(DoPush(*async.shard, push).status().code(),
            absl::StatusCode::kInvalidArgument);
  apply.set_coefficient(0.5);
  EXPECT_EQ(async.shard->ApplyClip(apply).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace pstrain
