// Partitions and pauses in a sync job (issue 14): a ps_server, or one
// worker, stopped with SIGSTOP for longer than the lease at a controlled
// point of a step, then resumed. The job must go on and apply every step
// exactly once.
//
// The controlled points come from driving the protocol from the test: two
// PsClients act as workers 0 and 1 and push gradients of ones into a
// zero-initialised tensor under SGD at learning rate 1, so after v updates
// every element is exactly -v. A paused worker is a client that stays
// silent until the servers have dropped it (a condition on Stats, not a
// sleep). A paused server is SIGSTOPped for 2.5 leases (the length of the
// fault, not a wait for anything). The last two tests pause real worker
// binaries (--model=probe) in a running job.
#include <signal.h>

#include <cmath>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/test_cluster.h"
#include "worker/client/ps_client.h"
#include "worker/model.h"

namespace pstrain {
namespace {

using testing::ClusterOptions;
using testing::Process;
using testing::TestCluster;

constexpr int kElements = 600;
constexpr int kBlockElements = 100;
constexpr int kNumShards = 2;
constexpr absl::Duration kLease = absl::Seconds(1);

// Where in a step the fault happens.
enum class Point { kBeforeAnyPush, kAfterOneOfTwoPushes, kAfterAllPushes };
enum class Paused { kServer, kWorker };

std::string PointName(Point point) {
  switch (point) {
    case Point::kBeforeAnyPush:
      return "before any push";
    case Point::kAfterOneOfTwoPushes:
      return "after one of two pushes";
    case Point::kAfterAllPushes:
      return "after all pushes";
  }
  return "?";
}

ModelSchema OnesSchema() {
  ModelSchema schema;
  schema.set_seed(1);
  schema.set_block_elements(kBlockElements);
  DenseTensorSpec* w = schema.add_dense();
  w->set_name("w");
  w->add_shape(kElements);
  w->mutable_init()->set_kind(InitSpec::CONSTANT);
  w->mutable_init()->set_value(0.0f);
  return schema;
}

std::unique_ptr<TestCluster> StartSyncCluster(const std::string& name) {
  ClusterOptions options;
  options.num_shards = kNumShards;
  options.num_workers = 2;
  options.server_flags = {
      "--optimizer=sgd", "--learning_rate=1",
      absl::StrCat("--worker_lease_s=", absl::ToDoubleSeconds(kLease)),
      "--max_pull_wait_s=2"};
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(options, name);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  return cluster.ok() ? std::move(*cluster) : nullptr;
}

// A worker driven by the test. Worker 0 renews its lease in the
// background; worker 1 speaks only when the test makes it, so that it can
// fall silent at an exact point.
std::unique_ptr<PsClient> TestWorker(TestCluster& cluster, int worker_id) {
  PsClientOptions options;
  options.hosts = cluster.HostList();
  options.rpc_timeout = absl::Seconds(10);
  options.retry_window = absl::Seconds(30);
  options.heartbeat_interval =
      worker_id == 0 ? absl::Milliseconds(200) : absl::ZeroDuration();
  absl::StatusOr<std::unique_ptr<PsClient>> client = PsClient::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return nullptr;
  absl::StatusOr<Registration> registered =
      (*client)->Register(OnesSchema(), 2, worker_id);
  EXPECT_TRUE(registered.ok()) << registered.status();
  return registered.ok() ? std::move(*client) : nullptr;
}

// The whole tensor at `step`, as an observer pulls it.
std::vector<float> ModelAt(TestCluster& cluster, const ModelSchema& schema,
                           int num_workers, int64_t step) {
  PsClientOptions options;
  options.hosts = cluster.HostList();
  options.rpc_timeout = absl::Seconds(10);
  auto observer = PsClient::Create(options);
  EXPECT_TRUE(observer.ok()) << observer.status();
  if (!observer.ok()) return {};
  EXPECT_TRUE((*observer)->Register(schema, num_workers, -1).ok());
  std::vector<float> w(schema.dense(0).shape(0), NAN);
  absl::StatusOr<int64_t> pulled = (*observer)->Pull(step, {w.data()});
  EXPECT_TRUE(pulled.ok()) << pulled.status();
  return w;
}

// Every shard at version `steps` and every element at -steps: each step
// applied once, none lost, none twice.
void ExpectEveryStepAppliedOnce(TestCluster& cluster, const ModelSchema& schema,
                                int num_workers, int64_t steps) {
  absl::StatusOr<std::vector<StatsResponse>> stats = cluster.Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  for (const StatsResponse& shard : *stats) {
    EXPECT_EQ(shard.version(), steps) << shard.ShortDebugString();
  }
  const std::vector<float> w = ModelAt(cluster, schema, num_workers, steps);
  ASSERT_EQ(w.size(), static_cast<size_t>(schema.dense(0).shape(0)));
  for (size_t i = 0; i < w.size(); ++i) {
    ASSERT_EQ(w[i], -static_cast<float>(steps)) << "element " << i;
  }
}

class PartitionTest : public ::testing::TestWithParam<Paused> {};

TEST_P(PartitionTest, EveryStepIsAppliedOnceWhateverPointThePauseHits) {
  const Paused paused = GetParam();
  auto cluster = StartSyncCluster(paused == Paused::kServer ? "pause_server"
                                                            : "pause_worker");
  ASSERT_NE(cluster, nullptr);
  std::vector<std::unique_ptr<PsClient>> workers;
  for (int id = 0; id < 2; ++id) workers.push_back(TestWorker(*cluster, id));
  ASSERT_TRUE(workers[0] && workers[1]);

  const std::vector<float> ones(kElements, 1.0f);
  std::vector<float> w(kElements);
  // The fault: the server stopped for longer than the lease, or worker 1
  // silent until every shard has dropped it.
  auto fault = [&] {
    if (paused == Paused::kServer) {
      cluster->server(0).Signal(SIGSTOP);
      absl::SleepFor(2.5 * kLease);  // the pause itself
      cluster->server(0).Signal(SIGCONT);
    } else {
      ASSERT_TRUE(
          cluster
              ->WaitForStats(
                  [](const StatsResponse& s) { return s.members() == 1; },
                  absl::Seconds(30))
              .ok());
    }
  };
  auto push = [&](int worker, int64_t step) {
    absl::StatusOr<PsClient::PushResult> pushed =
        workers[worker]->Push(step, {ones.data()});
    ASSERT_TRUE(pushed.ok())
        << "worker " << worker << " step " << step << ": " << pushed.status();
  };

  const std::vector<Point> points = {Point::kBeforeAnyPush,
                                     Point::kAfterOneOfTwoPushes,
                                     Point::kAfterAllPushes};
  // One faulty step per point, each followed by a clean one.
  int64_t step = 0;
  for (Point point : points) {
    for (bool faulty : {true, false}) {
      SCOPED_TRACE(absl::StrCat("step ", step, faulty ? ": pause " : ": clean ",
                                PointName(point)));
      for (int id = 0; id < 2; ++id) {
        absl::StatusOr<int64_t> pulled = workers[id]->Pull(step, {w.data()});
        ASSERT_TRUE(pulled.ok()) << "worker " << id << ": " << pulled.status();
        ASSERT_EQ(*pulled, step) << "worker " << id;
        ASSERT_EQ(w[0], -static_cast<float>(step));
      }
      if (faulty && point == Point::kBeforeAnyPush) fault();
      push(0, step);
      if (faulty && point == Point::kAfterOneOfTwoPushes) fault();
      push(1, step);
      if (faulty && point == Point::kAfterAllPushes) fault();
      ++step;
    }
  }
  for (int id = 0; id < 2; ++id) {
    absl::StatusOr<int64_t> pulled = workers[id]->Pull(step, {w.data()});
    ASSERT_TRUE(pulled.ok()) << "worker " << id << ": " << pulled.status();
  }
  ExpectEveryStepAppliedOnce(*cluster, OnesSchema(), 2, step);
  std::cout << "[ partition ] "
            << (paused == Paused::kServer ? "server" : "worker 1")
            << " paused past its lease at 3 points of a sync step: " << step
            << " steps, each applied once\n";
}

INSTANTIATE_TEST_SUITE_P(ServerOrWorker, PartitionTest,
                         ::testing::Values(Paused::kServer, Paused::kWorker),
                         [](const ::testing::TestParamInfo<Paused>& info) {
                           return info.param == Paused::kServer ? "Server"
                                                                : "Worker";
                         });

// Real worker binaries: the probe model (gradients of ones, SGD lr 1), a
// pause somewhere in the middle of the job.
class ProbeJobPauseTest : public ::testing::TestWithParam<Paused> {};

TEST_P(ProbeJobPauseTest, TheJobFinishesWithEveryStepAppliedOnce) {
  const Paused paused = GetParam();
  auto cluster = StartSyncCluster(paused == Paused::kServer ? "probe_server"
                                                            : "probe_worker");
  ASSERT_NE(cluster, nullptr);
  constexpr int kSteps = 40;
  const std::vector<std::string> flags = {
      "--model=probe",
      absl::StrCat("--probe_elements=", kElements),
      absl::StrCat("--block_elements=", kBlockElements),
      "--heartbeat_interval_s=0.2",
      "--retry_window_s=60",
      "--inject_step_delay_ms=20",
      "--log_every=0",
      "--device=cpu",
      absl::StrCat("--steps=", kSteps)};
  std::vector<std::unique_ptr<Process>> workers;
  for (int id = 0; id < 2; ++id) {
    absl::StatusOr<std::unique_ptr<Process>> worker =
        cluster->StartWorker(id, 2, flags);
    ASSERT_TRUE(worker.ok()) << worker.status();
    workers.push_back(std::move(*worker));
  }
  ASSERT_TRUE(cluster
                  ->WaitForStats(
                      [](const StatsResponse& s) { return s.version() >= 10; },
                      absl::Seconds(60))
                  .ok());
  Process& target =
      paused == Paused::kServer ? cluster->server(0) : *workers[1];
  target.Signal(SIGSTOP);
  absl::SleepFor(2.5 * kLease);  // the pause itself
  target.Signal(SIGCONT);
  for (int id = 0; id < 2; ++id) {
    absl::StatusOr<int> code = workers[id]->Wait(absl::Seconds(120));
    ASSERT_TRUE(code.ok()) << code.status();
    ASSERT_EQ(*code, 0) << workers[id]->Stderr();
  }
  auto backend = std::move(*kernels::CreateBackend("cpu"));
  auto probe = std::move(*CreateProbeModel(backend.get(), kElements));
  ModelSchema schema;
  schema.set_seed(1);
  schema.set_block_elements(kBlockElements);
  *schema.add_dense() = probe->Params()[0];
  ExpectEveryStepAppliedOnce(*cluster, schema, 2, kSteps);
}

INSTANTIATE_TEST_SUITE_P(ServerOrWorker, ProbeJobPauseTest,
                         ::testing::Values(Paused::kServer, Paused::kWorker),
                         [](const ::testing::TestParamInfo<Paused>& info) {
                           return info.param == Paused::kServer ? "Server"
                                                                : "Worker";
                         });

}  // namespace
}  // namespace pstrain
