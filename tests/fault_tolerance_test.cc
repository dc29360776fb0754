// Faults with real processes: workers killed, stragglers, retried pushes,
// bounded staleness, and workers joining and leaving a running job. Every
// wait is bounded; every process is killed when its owner goes away.
#include <signal.h>

#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/test_cluster.h"
#include "worker/client/ps_client.h"
#include "worker/model.h"

namespace pstrain {
namespace {

using testing::ClusterOptions;
using testing::FinalJsonNumber;
using testing::Process;
using testing::TestCluster;

std::vector<std::string> MlpFlags(int steps) {
  return {"--model=mlp",           "--hidden=16",
          "--num_features=12",     "--num_classes=3",
          "--train_examples=4096", "--test_examples=512",
          "--batch_size=16",       "--log_every=0",
          "--device=cpu",          "--heartbeat_interval_s=0.2",
          "--retry_window_s=60",   absl::StrCat("--steps=", steps)};
}

std::vector<std::string> With(std::vector<std::string> flags,
                              const std::vector<std::string>& more) {
  flags.insert(flags.end(), more.begin(), more.end());
  return flags;
}

// Waits for a worker and returns its stdout, failing the test if it failed.
std::string Finish(Process& worker,
                   absl::Duration timeout = absl::Seconds(120)) {
  absl::StatusOr<int> code = worker.Wait(timeout);
  EXPECT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(code.value_or(-1), 0) << worker.Stderr();
  return worker.Stdout();
}

double Number(const std::string& out, const std::string& key) {
  absl::StatusOr<double> value = FinalJsonNumber(out, key);
  EXPECT_TRUE(value.ok()) << value.status() << "\n" << out;
  return value.value_or(NAN);
}

std::unique_ptr<TestCluster> StartCluster(const ClusterOptions& options,
                                          const std::string& name) {
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(options, name);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  return cluster.ok() ? std::move(*cluster) : nullptr;
}

std::unique_ptr<Process> StartWorker(TestCluster& cluster, int id, int n,
                                     const std::vector<std::string>& flags) {
  absl::StatusOr<std::unique_ptr<Process>> worker =
      cluster.StartWorker(id, n, flags);
  EXPECT_TRUE(worker.ok()) << worker.status();
  return worker.ok() ? std::move(*worker) : nullptr;
}

TEST(FaultToleranceTest, SyncJobCompletesAfterAWorkerIsKilled) {
  ClusterOptions options;
  options.num_shards = 2;
  options.num_workers = 3;
  options.server_flags = {"--worker_lease_s=1", "--learning_rate=0.2"};
  auto cluster = StartCluster(options, "kill_worker");
  ASSERT_NE(cluster, nullptr);
  constexpr int kSteps = 80;
  auto w0 = StartWorker(*cluster, 0, 3, MlpFlags(kSteps));
  auto w1 = StartWorker(*cluster, 1, 3, MlpFlags(kSteps));
  // Never finishes on its own; slowed so it is mid-step when killed.
  auto w2 = StartWorker(*cluster, 2, 3,
                        With(MlpFlags(1000000), {"--inject_step_delay_ms=20"}));
  ASSERT_TRUE(w0 && w1 && w2);
  ASSERT_TRUE(cluster
                  ->WaitForStats(
                      [](const StatsResponse& s) { return s.version() >= 10; },
                      absl::Seconds(60))
                  .ok());
  w2->Signal(SIGKILL);
  for (Process* w : {w0.get(), w1.get()}) {
    const std::string out = Finish(*w);
    EXPECT_EQ(Number(out, "steps"), kSteps);
    EXPECT_GE(Number(out, "test_accuracy"), 0.6) << out;  // chance: 1/3
  }
  absl::StatusOr<std::vector<StatsResponse>> stats = cluster->Stats();
  ASSERT_TRUE(stats.ok());
  for (const StatsResponse& shard : *stats) {
    EXPECT_EQ(shard.version(), kSteps);
    EXPECT_EQ(shard.members(), 0);  // 0 and 1 left, 2's lease expired
  }
}

TEST(FaultToleranceTest, BackupWorkersDoNotWaitForAStraggler) {
  ClusterOptions options;
  options.num_shards = 1;
  options.num_workers = 3;
  options.server_flags = {"--replicas_to_aggregate=2", "--learning_rate=0.2"};
  auto cluster = StartCluster(options, "backup_workers");
  ASSERT_NE(cluster, nullptr);
  constexpr int kSteps = 60;
  auto w0 = StartWorker(*cluster, 0, 3, MlpFlags(kSteps));
  auto w1 = StartWorker(*cluster, 1, 3, MlpFlags(kSteps));
  auto w2 = StartWorker(*cluster, 2, 3,
                        With(MlpFlags(kSteps), {"--inject_step_delay_ms=100"}));
  ASSERT_TRUE(w0 && w1 && w2);
  const std::string out0 = Finish(*w0), out1 = Finish(*w1), out2 = Finish(*w2);
  // The steps did not wait for the straggler: it computed few of them (had
  // they waited, it would have computed every one), finding the job ahead
  // of it whenever it pulled. Depending on how late it started it joined
  // part-way or at the end; either way every step is accounted for.
  // (A fast worker may skip a step too when the other two completed it
  // first: that is the point of backup workers.)
  for (const std::string* out : {&out0, &out1, &out2}) {
    EXPECT_EQ(Number(*out, "start_step") + Number(*out, "steps_skipped") +
                  Number(*out, "steps_run"),
              kSteps)
        << *out;
  }
  EXPECT_GE(Number(out0, "steps_run") + Number(out1, "steps_run"),
            2 * kSteps - 10);
  EXPECT_LE(Number(out2, "steps_run"), kSteps / 2) << out2;
  absl::StatusOr<std::vector<StatsResponse>> stats = cluster->Stats();
  ASSERT_TRUE(stats.ok());
  // Gradients that arrived after their step completed were dropped, and
  // each worker was told so.
  const double late_reported = Number(out0, "late_blocks") +
                               Number(out1, "late_blocks") +
                               Number(out2, "late_blocks");
  EXPECT_EQ((*stats)[0].late_gradients_dropped(), late_reported);
  EXPECT_EQ((*stats)[0].version(), kSteps);
  EXPECT_GE(Number(out0, "test_accuracy"), 0.6) << out0;
}

// Integer gradients with a known total: every push is resent by the client
// 30% of the time and its response dropped by the server 20% of the time;
// any double apply (or lost push) moves the weights off the exact value.
class InjectedRetriesTest : public ::testing::TestWithParam<std::string> {};

TEST_P(InjectedRetriesTest, NeverApplyTwice) {
  // sync_pipelined: the pipelined step's streamed PushPull, whose resends
  // and dropped responses take another path; its forward checks that every
  // block it reads holds the same step's value. sync_pipelined_staged: the
  // same staged through host copies as on a GPU (--device=cpu_staged), each
  // block copied in as it lands and its gradient out before it leaves.
  const bool staged = GetParam() == "sync_pipelined_staged";
  const bool pipelined = staged || GetParam() == "sync_pipelined";
  const std::string mode = pipelined ? "sync" : GetParam();
  ClusterOptions options;
  options.num_shards = 2;
  options.num_workers = 2;
  options.mode = mode;
  options.server_flags = {"--optimizer=sgd", "--learning_rate=1",
                          "--inject_drop_push_response_probability=0.2"};
  auto cluster = StartCluster(options, "retries_" + mode);
  ASSERT_NE(cluster, nullptr);
  constexpr int kSteps = 40;
  constexpr int kElements = 1000;
  std::vector<std::string> flags = {
      "--model=probe",
      absl::StrCat("--probe_elements=", kElements),
      "--block_elements=100",  // 10 blocks, one RPC each
      "--inject_duplicate_push_probability=0.3",
      "--retry_window_s=60",
      "--log_every=0",
      staged ? "--device=cpu_staged" : "--device=cpu",
      absl::StrCat("--steps=", kSteps)};
  if (pipelined) {
    flags.insert(flags.end(),
                 {"--pipeline_step=always", "--probe_check_pulls"});
  }
  absl::StatusOr<std::vector<std::string>> outputs =
      cluster->RunWorkers({flags, flags}, absl::Seconds(120));
  ASSERT_TRUE(outputs.ok()) << outputs.status();
  double injected = 0;
  for (const std::string& out : *outputs) {
    injected += Number(out, "injected_duplicate_pushes");
    if (pipelined) {
      EXPECT_TRUE(absl::StrContains(out, "\"pipelined\":true")) << out;
    }
  }

  PsClientOptions client_options;
  client_options.hosts = cluster->HostList();
  auto client = std::move(*PsClient::Create(client_options));
  auto backend = std::move(*kernels::CreateBackend("cpu"));
  auto probe = std::move(*CreateProbeModel(backend.get(), kElements));
  ModelSchema schema;
  schema.set_seed(1);
  schema.set_block_elements(100);
  *schema.add_dense() = probe->Params()[0];
  absl::StatusOr<Registration> observer =
      client->Register(schema, 2, /*worker_id=*/-1);
  ASSERT_TRUE(observer.ok()) << observer.status();
  std::vector<float> w(kElements, NAN);
  ASSERT_TRUE(client->Pull(kSteps, {w.data()}).ok());
  // sync: one update of mean 1 per step; async: one per push.
  const float expected = mode == "sync" ? -kSteps : -2.0f * kSteps;
  for (int i = 0; i < kElements; ++i) {
    ASSERT_EQ(w[i], expected) << "element " << i;
  }
  absl::StatusOr<std::vector<StatsResponse>> stats = cluster->Stats();
  ASSERT_TRUE(stats.ok());
  int64_t duplicates = 0;
  for (const StatsResponse& shard : *stats) {
    duplicates += shard.blocks_duplicate();
  }
  // Both kinds of retry happened and were all recognised.
  EXPECT_GT(injected, 0);
  EXPECT_GT(duplicates, injected);  // resends plus dropped responses
  std::cout << "[ retries ] mode " << GetParam() << ": " << injected
            << " pushes resent by clients, " << duplicates
            << " duplicate block pushes recognised, 0 applied twice\n";
}

INSTANTIATE_TEST_SUITE_P(Modes, InjectedRetriesTest,
                         ::testing::Values("sync", "async", "sync_pipelined",
                                           "sync_pipelined_staged"));

TEST(FaultToleranceTest, SspKeepsWorkersWithinTheBound) {
  ClusterOptions options;
  options.num_shards = 2;
  options.num_workers = 2;
  options.mode = "ssp";
  options.server_flags = {"--staleness=2", "--learning_rate=0.2"};
  auto cluster = StartCluster(options, "ssp");
  ASSERT_NE(cluster, nullptr);
  constexpr int kSteps = 40;
  absl::StatusOr<std::vector<std::string>> outputs = cluster->RunWorkers(
      {MlpFlags(kSteps), With(MlpFlags(kSteps), {"--inject_step_delay_ms=30"})},
      absl::Seconds(120));
  ASSERT_TRUE(outputs.ok()) << outputs.status();
  absl::StatusOr<std::vector<StatsResponse>> stats = cluster->Stats();
  ASSERT_TRUE(stats.ok());
  for (const StatsResponse& shard : *stats) {
    // The fast worker ran ahead as far as allowed, and no further.
    EXPECT_EQ(shard.ssp_gap_max(), 2) << shard.ShortDebugString();
  }
  EXPECT_GE(Number((*outputs)[0], "test_accuracy"), 0.6);
}

TEST(ElasticTest, WorkersJoinAndLeaveARunningSyncJob) {
  ClusterOptions options;
  options.num_shards = 2;
  options.num_workers = 2;
  options.server_flags = {"--max_workers=3", "--worker_lease_s=2",
                          "--learning_rate=0.2"};
  auto cluster = StartCluster(options, "elastic");
  ASSERT_NE(cluster, nullptr);
  constexpr int kSteps = 300;
  const auto flags = With(MlpFlags(kSteps), {"--inject_step_delay_ms=10"});
  auto w0 = StartWorker(*cluster, 0, 2, flags);
  auto w1 = StartWorker(*cluster, 1, 2, flags);
  ASSERT_TRUE(w0 && w1);
  auto at_least = [&](int64_t version, int members) {
    return cluster->WaitForStats(
        [=](const StatsResponse& s) {
          return s.version() >= version && s.members() == members;
        },
        absl::Seconds(60));
  };
  ASSERT_TRUE(at_least(20, 2).ok());

  // 2 -> 3: a new worker joins at the step the job is at.
  auto w2 = StartWorker(*cluster, 2, 3, flags);
  ASSERT_TRUE(w2);
  ASSERT_TRUE(at_least(0, 3).ok());
  int64_t joined_at = cluster->Stats()->at(0).version();
  ASSERT_TRUE(at_least(joined_at + 10, 3).ok());  // steps go on with 3

  // 3 -> 1: two workers are told to stop; they finish a step and leave.
  w1->Signal(SIGTERM);
  w2->Signal(SIGTERM);
  const std::string out1 = Finish(*w1), out2 = Finish(*w2);
  EXPECT_NE(out1.find("\"stopped_early\":true"), std::string::npos) << out1;
  // Its final loss and accuracy average the last tenth of the steps it ran
  // (the job's last tenth, which it never reached, used to report zeros).
  EXPECT_GT(Number(out1, "final_loss"), 0) << out1;
  EXPECT_GT(Number(out1, "train_accuracy"), 0) << out1;
  EXPECT_GT(Number(out2, "start_step"), 0) << out2;
  ASSERT_TRUE(at_least(0, 1).ok());

  const std::string out0 = Finish(*w0);
  EXPECT_EQ(Number(out0, "steps_run"), kSteps);
  EXPECT_GE(Number(out0, "test_accuracy"), 0.6) << out0;
  absl::StatusOr<std::vector<StatsResponse>> stats = cluster->Stats();
  ASSERT_TRUE(stats.ok());
  for (const StatsResponse& shard : *stats) {
    EXPECT_EQ(shard.version(), kSteps);
  }
}

// A server that stops running (SIGSTOP here; a paused VM or a long stall
// in production) must not expire the leases of workers that kept
// heartbeating meanwhile: their heartbeats wait unread in its sockets.
// Before the lease clock, the server resumed, expired worker 1 at once,
// completed step 0 from worker 0's gradient alone, and answered worker 1's
// push "late" (issue 24).
TEST(FaultToleranceTest, AServerPauseExpiresNoHonestWorkersLease) {
  ClusterOptions options;
  options.num_workers = 2;
  options.server_flags = {"--worker_lease_s=1", "--optimizer=sgd",
                          "--learning_rate=1"};
  auto cluster = StartCluster(options, "server_pause");
  ASSERT_NE(cluster, nullptr);
  ModelSchema schema;
  schema.set_seed(5);
  schema.set_block_elements(4);
  DenseTensorSpec* w = schema.add_dense();
  w->set_name("w");
  w->add_shape(8);
  w->mutable_init()->set_kind(InitSpec::CONSTANT);
  w->mutable_init()->set_value(0.0f);
  std::vector<std::unique_ptr<PsClient>> clients;
  for (int id = 0; id < 2; ++id) {
    PsClientOptions client_options;
    client_options.hosts = cluster->HostList();
    client_options.heartbeat_interval = absl::Milliseconds(200);
    absl::StatusOr<std::unique_ptr<PsClient>> client =
        PsClient::Create(client_options);
    ASSERT_TRUE(client.ok()) << client.status();
    ASSERT_TRUE((*client)->Register(schema, 2, id).ok());
    clients.push_back(std::move(*client));
  }
  for (auto& client : clients) ASSERT_TRUE(client->AwaitJobStart().ok());
  const std::vector<float> g0(8, 1.0f), g1(8, 3.0f);
  absl::StatusOr<PsClient::PushResult> pushed =
      clients[0]->Push(0, {g0.data()});
  ASSERT_TRUE(pushed.ok()) << pushed.status();

  // The pause (the scenario, not a synchronisation): 2.5 leases long.
  cluster->server(0).Signal(SIGSTOP);
  absl::SleepFor(absl::Milliseconds(2500));
  cluster->server(0).Signal(SIGCONT);

  pushed = clients[1]->Push(0, {g1.data()});
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_EQ(pushed->blocks_late, 0);
  std::vector<float> model(8);
  absl::StatusOr<int64_t> at = clients[0]->Pull(1, {model.data()});
  ASSERT_TRUE(at.ok()) << at.status();
  // SGD at rate 1 from 0: minus the mean of both workers' gradients.
  for (float v : model) EXPECT_FLOAT_EQ(v, -2.0f);
  absl::StatusOr<std::vector<StatsResponse>> stats = cluster->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ((*stats)[0].members(), 2);
}

}  // namespace
}  // namespace pstrain
