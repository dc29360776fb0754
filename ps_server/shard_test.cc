#include "ps_server/shard.h"

#include <atomic>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "common/protocol.h"
#include "common/tensor_codec.h"
#include "gtest/gtest.h"

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

// A push carrying `value` for every element of every block of shard 0 of 1.
PushRequest UniformPush(int worker, int64_t step, float value,
                        int64_t pulled_version = 0) {
  PushRequest push;
  push.set_protocol_version(kProtocolVersion);
  push.set_worker_id(worker);
  push.set_step(step);
  push.set_pulled_version(pulled_version);
  const std::vector<std::pair<std::string, int>> blocks = {
      {"w", 4}, {"w", 2}, {"b", 2}};
  int64_t index = 0;
  for (const auto& [name, length] : blocks) {
    TensorBlock* block = push.add_blocks();
    block->set_tensor(name);
    block->set_block(name == "w" ? index++ : 0);
    EncodeFloat32(std::vector<float>(length, value), block->mutable_data());
  }
  return push;
}

PullRequest PullAt(int worker, int64_t step) {
  PullRequest pull;
  pull.set_protocol_version(kProtocolVersion);
  pull.set_worker_id(worker);
  pull.set_step(step);
  return pull;
}

// Element 0 of "w" after a pull.
float FirstWeight(const PullResponse& response) {
  std::vector<float> values(4);
  EXPECT_TRUE(DecodeToFloat32(FLOAT32, response.blocks(0).data(),
                              absl::MakeSpan(values))
                  .ok());
  return values[0];
}

absl::Time Soon() { return absl::Now() + absl::Seconds(5); }

TEST(ShardSyncTest, AppliesTheMeanOnceWhenEveryWorkerHasPushed) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 2);
  PushResponse response;
  ASSERT_TRUE(f.shard->Push(UniformPush(0, 0, 1.0f), &response).ok());
  EXPECT_EQ(response.version(), 0);  // waiting for worker 1
  ASSERT_TRUE(f.shard->Push(UniformPush(1, 0, 3.0f), &response).ok());
  EXPECT_EQ(response.version(), 1);
  PullResponse pulled;
  ASSERT_TRUE(f.shard->Pull(PullAt(0, 1), Soon(), &pulled).ok());
  EXPECT_EQ(pulled.version(), 1);
  // w = 1 - 0.5 * mean(1, 3) = 0
  EXPECT_FLOAT_EQ(FirstWeight(pulled), 0.0f);
}

TEST(ShardSyncTest, RepeatedPushIsAcknowledgedNotApplied) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 2);
  PushResponse response;
  ASSERT_TRUE(f.shard->Push(UniformPush(0, 0, 1.0f), &response).ok());
  ASSERT_TRUE(f.shard->Push(UniformPush(0, 0, 100.0f), &response).ok());
  EXPECT_TRUE(response.duplicate());
  EXPECT_EQ(response.version(), 0);  // a repeat must not complete the step
  ASSERT_TRUE(f.shard->Push(UniformPush(1, 0, 3.0f), &response).ok());
  EXPECT_FALSE(response.duplicate());
  // A retry of a finished step is a duplicate too.
  ASSERT_TRUE(f.shard->Push(UniformPush(1, 0, 3.0f), &response).ok());
  EXPECT_TRUE(response.duplicate());
  PullResponse pulled;
  ASSERT_TRUE(f.shard->Pull(PullAt(1, 1), Soon(), &pulled).ok());
  EXPECT_FLOAT_EQ(FirstWeight(pulled), 0.0f);
  EXPECT_EQ(f.shard->Stats().pushes_duplicate(), 2);
  EXPECT_EQ(f.shard->Stats().pushes_applied(), 2);
}

TEST(ShardSyncTest, PullWaitsForTheStepAndIsReleasedByTheLastPush) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 2);
  PushResponse response;
  ASSERT_TRUE(f.shard->Push(UniformPush(0, 0, 1.0f), &response).ok());
  absl::Status pull_status;
  PullResponse pulled;
  std::thread puller(
      [&] { pull_status = f.shard->Pull(PullAt(0, 1), Soon(), &pulled); });
  ASSERT_TRUE(f.shard->Push(UniformPush(1, 0, 3.0f), &response).ok());
  puller.join();
  ASSERT_TRUE(pull_status.ok()) << pull_status;
  EXPECT_EQ(pulled.version(), 1);
  EXPECT_FLOAT_EQ(FirstWeight(pulled), 0.0f);
}

TEST(ShardSyncTest, PullTimesOutNamingTheMissingWorkers) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 3);
  PushResponse response;
  ASSERT_TRUE(f.shard->Push(UniformPush(1, 0, 1.0f), &response).ok());
  PullResponse pulled;
  const absl::Status status = f.shard->Pull(
      PullAt(1, 1), absl::Now() + absl::Milliseconds(50), &pulled);
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(status.message().find("workers [0, 2]"), std::string::npos)
      << status;
}

TEST(ShardSyncTest, ShutdownReleasesWaitingPulls) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 2);
  PushResponse response;
  ASSERT_TRUE(f.shard->Push(UniformPush(0, 0, 1.0f), &response).ok());
  absl::Status pull_status;
  std::thread puller([&] {
    PullResponse pulled;
    pull_status = f.shard->Pull(PullAt(0, 1), absl::InfiniteFuture(), &pulled);
  });
  f.shard->BeginShutdown();
  puller.join();
  EXPECT_EQ(pull_status.code(), absl::StatusCode::kUnavailable) << pull_status;
}

TEST(ShardSyncTest, CancelledCallerStopsWaiting) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 2);
  std::atomic<bool> cancelled{false};
  absl::Status pull_status;
  std::thread puller([&] {
    PullResponse pulled;
    pull_status = f.shard->Pull(PullAt(0, 1), absl::InfiniteFuture(), &pulled,
                                [&] { return cancelled.load(); });
  });
  PushResponse response;
  ASSERT_TRUE(f.shard->Push(UniformPush(1, 0, 1.0f), &response).ok());
  cancelled = true;
  puller.join();
  EXPECT_EQ(pull_status.code(), absl::StatusCode::kCancelled) << pull_status;
}

TEST(ShardSyncTest, StepsOutOfOrderAreRefused) {
  Fixture f = MakeShard(ConsistencyMode::kSync, 2);
  PushResponse response;
  EXPECT_EQ(f.shard->Push(UniformPush(0, 1, 1.0f), &response).code(),
            absl::StatusCode::kFailedPrecondition);
  PullResponse pulled;
  EXPECT_EQ(f.shard->Pull(PullAt(0, 2), Soon(), &pulled).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(f.shard->Stats().version(), 0);
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
  PushResponse response;
  ASSERT_TRUE(shard->Push(UniformPush(0, 0, NAN), &response).ok());
  ASSERT_TRUE(shard->Push(UniformPush(1, 0, 2.0f), &response).ok());
  EXPECT_EQ(response.version(), 1);
  PullResponse pulled;
  ASSERT_TRUE(shard->Pull(PullAt(0, 1), Soon(), &pulled).ok());
  EXPECT_FLOAT_EQ(FirstWeight(pulled), 0.0f);  // 1 - 0.5 * 2: NaN left out
  EXPECT_EQ(shard->Stats().nonfinite_gradients_skipped(), 1);
}

TEST(ShardAsyncTest, AppliesEachPushAndRecordsStaleness) {
  Fixture f = MakeShard(ConsistencyMode::kAsync, 2);
  PushResponse response;
  ASSERT_TRUE(f.shard->Push(UniformPush(0, 0, 1.0f, 0), &response).ok());
  EXPECT_EQ(response.version(), 1);
  // Worker 1 computed against version 0 while worker 0's push landed.
  ASSERT_TRUE(f.shard->Push(UniformPush(1, 0, 1.0f, 0), &response).ok());
  EXPECT_EQ(response.version(), 2);
  PullResponse pulled;
  ASSERT_TRUE(f.shard->Pull(PullAt(0, 7), Soon(), &pulled).ok());
  EXPECT_EQ(pulled.version(), 2);
  EXPECT_FLOAT_EQ(FirstWeight(pulled), 0.0f);  // 1 - 0.5 - 0.5
  const StatsResponse stats = f.shard->Stats();
  EXPECT_EQ(stats.staleness_max(), 1);
  EXPECT_DOUBLE_EQ(stats.staleness_mean(), 0.5);
}

TEST(ShardAsyncTest, RetriedStepIsNotAppliedTwice) {
  Fixture f = MakeShard(ConsistencyMode::kAsync, 1);
  PushResponse response;
  ASSERT_TRUE(f.shard->Push(UniformPush(0, 5, 1.0f), &response).ok());
  ASSERT_TRUE(f.shard->Push(UniformPush(0, 5, 1.0f), &response).ok());
  EXPECT_TRUE(response.duplicate());
  ASSERT_TRUE(f.shard->Push(UniformPush(0, 4, 1.0f), &response).ok());
  EXPECT_TRUE(response.duplicate());
  EXPECT_EQ(f.shard->Stats().version(), 1);
}

TEST(ShardAsyncTest, ConcurrentPushesAreAllApplied) {
  Fixture f = MakeShard(ConsistencyMode::kAsync, 4);
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w) {
    threads.emplace_back([&, w] {
      for (int step = 0; step < 50; ++step) {
        PushResponse response;
        EXPECT_TRUE(f.shard->Push(UniformPush(w, step, 0.01f), &response).ok());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  PullResponse pulled;
  ASSERT_TRUE(f.shard->Pull(PullAt(0, 0), Soon(), &pulled).ok());
  EXPECT_EQ(pulled.version(), 200);
  EXPECT_NEAR(FirstWeight(pulled), 1.0f - 200 * 0.5f * 0.01f, 1e-4);
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
    PushRequest p = UniformPush(0, 0, 1.0f);
    p.mutable_blocks(0)->set_tensor("nope");
    cases.push_back({"unknown tensor", p, absl::StatusCode::kInvalidArgument,
                     "unknown tensor 'nope'"});
  }
  {
    PushRequest p = UniformPush(0, 0, 1.0f);
    p.mutable_blocks(0)->mutable_data()->resize(12);
    cases.push_back({"wrong length", p, absl::StatusCode::kInvalidArgument,
                     "payload has 12 bytes, expected 16"});
  }
  {
    PushRequest p = UniformPush(0, 0, 1.0f);
    p.mutable_blocks(1)->set_block(7);
    cases.push_back({"block out of range", p,
                     absl::StatusCode::kInvalidArgument, "got block 7"});
  }
  {
    PushRequest p = UniformPush(2, 0, 1.0f);
    cases.push_back({"worker id", p, absl::StatusCode::kInvalidArgument,
                     "worker_id must be in [0, 2)"});
  }
  {
    PushRequest p = UniformPush(0, -1, 1.0f);
    cases.push_back({"negative step", p, absl::StatusCode::kInvalidArgument,
                     "step must be >= 0"});
  }
  {
    PushRequest p = UniformPush(0, 9, 1.0f);
    cases.push_back({"future step", p, absl::StatusCode::kFailedPrecondition,
                     "push for step 9"});
  }
  {
    PushRequest p = UniformPush(0, 0, 1.0f);
    std::vector<float> values = {1, 2, INFINITY, 4};
    EncodeFloat32(values, p.mutable_blocks(0)->mutable_data());
    cases.push_back({"non-finite", p, absl::StatusCode::kInvalidArgument,
                     "element 2 is NaN or infinite"});
  }
  {
    PushRequest p = UniformPush(0, 0, 1.0f);
    p.mutable_blocks()->RemoveLast();
    cases.push_back({"missing block", p, absl::StatusCode::kInvalidArgument,
                     "must carry all 3 blocks"});
  }
  {
    PushRequest p = UniformPush(0, 0, 1.0f);
    *p.add_blocks() = p.blocks(0);
    cases.push_back({"duplicate block", p, absl::StatusCode::kInvalidArgument,
                     "appears twice"});
  }
  {
    PushRequest p = UniformPush(0, 0, 1.0f);
    p.mutable_blocks(0)->set_dtype(BFLOAT16);
    cases.push_back(
        {"wire type", p, absl::StatusCode::kInvalidArgument, "BFLOAT16"});
  }
  {
    PushRequest p = UniformPush(0, 0, 1.0f);
    p.set_protocol_version(99);
    cases.push_back({"protocol", p, absl::StatusCode::kFailedPrecondition,
                     "protocol version 99"});
  }
  for (const Case& c : cases) {
    PushResponse response;
    const absl::Status status = f.shard->Push(c.push, &response);
    EXPECT_EQ(status.code(), c.code) << c.name << ": " << status;
    EXPECT_NE(status.message().find(c.message), std::string::npos)
        << c.name << ": " << status;
  }
  // Nothing was accumulated: one good push from each worker gives exactly
  // one update with the mean of the good gradients.
  PushResponse response;
  ASSERT_TRUE(f.shard->Push(UniformPush(0, 0, 2.0f), &response).ok());
  EXPECT_FALSE(response.duplicate());
  ASSERT_TRUE(f.shard->Push(UniformPush(1, 0, 2.0f), &response).ok());
  PullResponse pulled;
  ASSERT_TRUE(f.shard->Pull(PullAt(0, 1), Soon(), &pulled).ok());
  EXPECT_FLOAT_EQ(FirstWeight(pulled), 0.0f);
  EXPECT_EQ(f.shard->Stats().requests_rejected(),
            static_cast<int64_t>(cases.size()));
}

TEST(ShardValidationTest, BlocksOfAnotherShardAreRefused) {
  Fixture f = MakeShard(ConsistencyMode::kAsync, 1, /*shard_id=*/1,
                        /*num_shards=*/2);
  PullRequest pull = PullAt(0, 0);
  BlockRef* ref = pull.add_blocks();
  ref->set_tensor("w");
  ref->set_block(0);  // global block 0 lives on shard 0
  PullResponse pulled;
  const absl::Status status = f.shard->Pull(pull, Soon(), &pulled);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("lives on shard 0, this is shard 1"),
            std::string::npos)
      << status;
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
  PullResponse pulled;
  const absl::Status status = shard->Pull(PullAt(0, 0), Soon(), &pulled);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("RegisterModel"), std::string::npos);
}

}  // namespace
}  // namespace pstrain
