// Replicated shards (ps_server --replicas, ps_server/replication.h) with real
// processes: a primary or a backup killed with SIGKILL in the middle of a job,
// the dead one restarted (it catches up from the primary while the job runs),
// the other then killed too, and what the job ends with. The probe model
// pushes a gradient of exactly 1 per element per step with SGD at rate 1, so
// the servers' final model says how many updates each block got: anything
// lost or applied twice shows as a value off by whole steps.
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "proto/ps.grpc.pb.h"
#include "tests/test_cluster.h"
#include "worker/client/ps_client.h"
#include "worker/model.h"

namespace pstrain {
namespace {

using testing::ClusterOptions;
using testing::Process;
using testing::TestCluster;

constexpr int kWorkers = 2;
constexpr int kShards = 2;
constexpr int kSteps = 300;
constexpr int64_t kElements = 1 << 16;
constexpr int64_t kBlock = 1 << 12;

struct ReplicationCase {
  std::string mode;
  // Which replica of shard 1 dies (0: the primary), and whether the dead
  // process is started again during the job (it catches up), and whether
  // the other one is then killed (the caught-up one carries the job on).
  int killed_replica;
  bool restarted;
  bool survivor_killed = false;
  // Every replica checkpoints (--checkpoint_dir): the restarted one reads
  // its own older checkpoint, and must catch up rather than keep it.
  bool checkpoints = false;
  // The workers read half the shards from their backups
  // (--pulls_from_backups).
  bool backup_reads = false;
};

// Every process's log, for whoever reads a failure: when the scope ends, so
// that an ASSERT that returns early still shows them.
class LogsOnFailure {
 public:
  explicit LogsOnFailure(const TestCluster& cluster) : cluster_(cluster) {}
  ~LogsOnFailure() {
    if (!::testing::Test::HasFailure()) return;
    for (const auto& entry :
         std::filesystem::directory_iterator(cluster_.dir())) {
      if (entry.path().extension() != ".log") continue;
      std::ifstream in(entry.path());
      std::stringstream text;
      text << in.rdbuf();
      ADD_FAILURE() << "=== " << entry.path() << "\n" << text.str();
    }
  }

 private:
  const TestCluster& cluster_;
};

// A cluster of `shards` x `replicas` for the probe model (SGD at rate 1).
std::unique_ptr<TestCluster> StartProbeCluster(
    const std::string& name, const std::string& mode, int shards, int replicas,
    std::vector<std::string> extra_server_flags = {}) {
  ClusterOptions options;
  options.num_shards = shards;
  options.num_workers = kWorkers;
  options.mode = mode;
  options.replicas = replicas;
  options.server_flags = {"--optimizer=sgd", "--learning_rate=1",
                          "--worker_lease_s=5"};
  options.server_flags.insert(options.server_flags.end(),
                              extra_server_flags.begin(),
                              extra_server_flags.end());
  absl::StatusOr<std::unique_ptr<TestCluster>> started =
      TestCluster::Start(options, name);
  EXPECT_TRUE(started.ok()) << started.status();
  return started.ok() ? std::move(*started) : nullptr;
}

// Servers' flags for a checkpoint every `every_steps`, in a directory of
// the test's named after `name` (each replica writes under replica-<r>/).
std::vector<std::string> CheckpointFlags(const std::string& name,
                                         int every_steps) {
  return {absl::StrCat("--checkpoint_dir=", testing::TestDir(), "/", name,
                       "_checkpoints"),
          absl::StrCat("--checkpoint_every_steps=", every_steps)};
}

// The probe model's kWorkers workers, started on `cluster`.
std::vector<std::unique_ptr<Process>> StartProbeWorkers(
    TestCluster& cluster, int rpc_timeout_s = 30,
    std::vector<std::string> extra_flags = {}) {
  std::vector<std::string> flags = {
      "--model=probe",
      absl::StrCat("--probe_elements=", kElements),
      absl::StrCat("--block_elements=", kBlock),
      absl::StrCat("--steps=", kSteps),
      "--log_every=0",
      "--device=cpu",
      "--heartbeat_interval_s=0.2",
      "--retry_window_s=60",
      absl::StrCat("--rpc_timeout_s=", rpc_timeout_s),
      "--inject_step_delay_ms=5"};
  flags.insert(flags.end(), extra_flags.begin(), extra_flags.end());
  std::vector<std::unique_ptr<Process>> workers;
  for (int k = 0; k < kWorkers; ++k) {
    absl::StatusOr<std::unique_ptr<Process>> worker =
        cluster.StartWorker(k, kWorkers, flags);
    EXPECT_TRUE(worker.ok()) << worker.status();
    if (worker.ok()) workers.push_back(std::move(*worker));
  }
  return workers;
}

// Waits until replica `replica` of shard `shard` has role `role`.
bool WaitForRole(TestCluster& cluster, int shard, int replica,
                 const std::string& role) {
  const absl::Time give_up = absl::Now() + absl::Seconds(90);
  absl::StatusOr<StatsResponse> stats;
  do {
    stats = cluster.ReplicaStats(shard, replica);
  } while ((!stats.ok() || stats->replica_role() != role) &&
           absl::Now() < give_up);
  return stats.ok() && stats->replica_role() == role;
}

// Waits for every worker; each must exit 0.
void ExpectAllExitZero(std::vector<std::unique_ptr<Process>>& workers) {
  for (auto& worker : workers) {
    absl::StatusOr<int> code = worker->Wait(absl::Seconds(120));
    EXPECT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(code.value_or(-1), 0) << worker->Stderr();
  }
}

// The servers' probe model, read through the replica sets as an observer
// (empty when it cannot be read).
std::vector<float> ReadProbeModel(const TestCluster& cluster) {
  PsClientOptions client_options;
  client_options.hosts = cluster.HostList();
  absl::StatusOr<std::unique_ptr<PsClient>> observer =
      PsClient::Create(client_options);
  if (!observer.ok()) return {};
  auto backend = std::move(*kernels::CreateBackend("cpu"));
  ModelSchema schema;
  schema.set_seed(1);
  schema.set_block_elements(kBlock);
  *schema.add_dense() =
      (*CreateProbeModel(backend.get(), kElements))->Params()[0];
  if (!(*observer)->Register(schema, kWorkers, -1).ok()) return {};
  std::vector<float> w(kElements, NAN);
  if (!(*observer)->Pull(0, {w.data()}).ok()) return {};
  return w;
}

// How many elements of the probe model are not `expected`: every update
// pushes each element by exactly 1, so one lost or applied twice shows. -1
// when the model cannot be read.
int64_t ProbeElementsOff(const TestCluster& cluster, float expected) {
  const std::vector<float> w = ReadProbeModel(cluster);
  if (w.empty()) return -1;
  int64_t off = 0;
  for (float v : w) off += v != expected;
  return off;
}

// Waits until the (sync) job has made a third of its steps.
bool WaitForAThirdOfTheSteps(TestCluster& cluster) {
  return cluster
      .WaitForStats(
          [](const StatsResponse& s) { return s.version() >= kSteps / 3; },
          absl::Seconds(60))
      .ok();
}

class ReplicationTest : public ::testing::TestWithParam<ReplicationCase> {};

TEST_P(ReplicationTest, AKilledReplicaLosesAndDoublesNothing) {
  const ReplicationCase& c = GetParam();
  const std::string name =
      absl::StrCat("replicated_", c.mode, "_", c.killed_replica,
                   c.restarted ? "_restarted" : "",
                   c.survivor_killed ? "_then_survivor" : "",
                   c.checkpoints ? "_checkpoints" : "",
                   c.backup_reads ? "_backup_reads" : "");
  std::vector<std::string> server_flags =
      c.checkpoints ? CheckpointFlags(name, 10) : std::vector<std::string>{};
  if (c.survivor_killed) {
    // A block (16 KiB) a chunk: the catch-up sends several chunks at once,
    // in any order, and the caught-up replica then carries the job alone.
    server_flags.push_back("--replica_catchup_chunk_kib=16");
  }
  std::unique_ptr<TestCluster> cluster =
      StartProbeCluster(name, c.mode, kShards, /*replicas=*/2, server_flags);
  ASSERT_NE(cluster, nullptr);
  LogsOnFailure logs(*cluster);
  std::vector<std::unique_ptr<Process>> workers = StartProbeWorkers(
      *cluster, 30,
      c.backup_reads ? std::vector<std::string>{"--pulls_from_backups=always",
                                                "--probe_check_pulls"}
                     : std::vector<std::string>{});
  ASSERT_EQ(workers.size(), kWorkers);
  // A third of the way in, every shard's primary has applied updates and
  // forwarded them.
  const int64_t kill_at = c.mode == "sync" ? kSteps / 3 : kSteps * kWorkers / 3;
  ASSERT_TRUE(cluster
                  ->WaitForStats(
                      [kill_at](const StatsResponse& s) {
                        return s.version() >= kill_at;
                      },
                      absl::Seconds(60))
                  .ok());
  if (c.backup_reads) {
    // Worker 0 reads shard 1 from its backup (replica 1), which answers
    // pulls of nobody else.
    absl::StatusOr<StatsResponse> backup = cluster->ReplicaStats(1, 1);
    ASSERT_TRUE(backup.ok()) << backup.status();
    EXPECT_EQ(backup->replica_role(), "backup");
    EXPECT_GE(backup->pulls_served(), kill_at / 2);
  } else {
    // Unasked, the workers read from a backup only where its primary is on
    // another host (--pulls_from_backups=by_host): never here.
    absl::StatusOr<StatsResponse> backup = cluster->ReplicaStats(1, 1);
    ASSERT_TRUE(backup.ok()) << backup.status();
    EXPECT_EQ(backup->pulls_served(), 0);
  }
  if (c.checkpoints) {
    // The replica to kill has a checkpoint of its own to read when it
    // comes back.
    absl::StatusOr<StatsResponse> killed =
        cluster->ReplicaStats(1, c.killed_replica);
    ASSERT_TRUE(killed.ok()) << killed.status();
    ASSERT_GT(killed->checkpoint().written(), 0);
  }
  cluster->KillReplica(1, c.killed_replica);
  const int survivor = 1 - c.killed_replica;
  if (c.restarted) {
    ASSERT_TRUE(cluster->RestartReplica(1, c.killed_replica).ok());
    // It catches up from the survivor while the job runs.
    ASSERT_TRUE(WaitForRole(*cluster, 1, c.killed_replica, "backup"));
    // The joiner is a backup once the last chunk is in; the primary counts
    // the catch-up once that chunk is answered.
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    absl::StatusOr<StatsResponse> primary;
    do {
      primary = cluster->ReplicaStats(1, survivor);
    } while ((!primary.ok() || primary->replica_catchups() == 0) &&
             absl::Now() < give_up);
    ASSERT_TRUE(primary.ok()) << primary.status();
    EXPECT_EQ(primary->replica_role(), "primary");
    EXPECT_EQ(primary->replica_catchups(), 1);
    EXPECT_GT(primary->replica_catchup_bytes(), kElements / kShards * 4);
  }
  if (c.survivor_killed) {
    ASSERT_TRUE(cluster
                    ->WaitForStats(
                        [kill_at](const StatsResponse& s) {
                          return s.version() >= 2 * kill_at;
                        },
                        absl::Seconds(60))
                    .ok());
    cluster->KillReplica(1, survivor);
  }
  ExpectAllExitZero(workers);
  const float expected = c.mode == "sync" ? -kSteps : -kSteps * kWorkers;
  EXPECT_EQ(ProbeElementsOff(*cluster, expected), 0);
  if (c.survivor_killed) {
    // The caught-up replica carried the job to its end, exactly.
    absl::StatusOr<StatsResponse> last =
        cluster->ReplicaStats(1, c.killed_replica);
    ASSERT_TRUE(last.ok()) << last.status();
    EXPECT_EQ(last->replica_role(), "primary");
    EXPECT_EQ(last->replica_takeovers(), 1);
    EXPECT_EQ(last->updates_lost(), 0);
    EXPECT_EQ(last->steps_lost(), 0);
    return;
  }

  // Shard 1 ends with one replica serving, which took over if the primary
  // died, lost nothing by its count, and dropped the dead one if it was a
  // backup.
  absl::StatusOr<StatsResponse> stats = cluster->ReplicaStats(1, survivor);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->replica_role(), "primary");
  EXPECT_EQ(stats->replica_takeovers(), c.killed_replica == 0 ? 1 : 0);
  EXPECT_EQ(stats->updates_lost(), 0);
  EXPECT_EQ(stats->steps_lost(), 0);
  if (c.killed_replica == 1 && !c.restarted) {
    EXPECT_EQ(stats->replicas_dropped(), 1);
  } else if (c.killed_replica == 1) {
    // A backup back before its primary gave up on it (a forward it did not
    // confirm fails that request, which the client retries) is taken back
    // by the catch-up without being dropped first.
    EXPECT_LE(stats->replicas_dropped(), 1);
  }
  if (c.restarted) {
    // Caught up, it followed every change since: the survivor's step.
    absl::StatusOr<StatsResponse> back =
        cluster->ReplicaStats(1, c.killed_replica);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->replica_role(), "backup");
    EXPECT_EQ(back->version(), stats->version());
  }
  // Shard 0 was not disturbed: its backup holds what its primary holds.
  absl::StatusOr<StatsResponse> primary0 = cluster->ReplicaStats(0, 0);
  absl::StatusOr<StatsResponse> backup0 = cluster->ReplicaStats(0, 1);
  ASSERT_TRUE(primary0.ok() && backup0.ok());
  EXPECT_EQ(backup0->replica_role(), "backup");
  EXPECT_EQ(backup0->version(), primary0->version());
  EXPECT_GT(primary0->replica_forwards(), 0);
  if (c.mode == "sync") {
    // It followed the primary's step records: the pushes that came with
    // the next step's pull never reached it, only the plain pushes of the
    // first and last steps.
    const int64_t pushed_a_step = kWorkers * kElements / kShards / kBlock;
    EXPECT_EQ(primary0->blocks_applied(), kSteps * pushed_a_step);
    EXPECT_LE(backup0->blocks_applied(), 2 * pushed_a_step);
  }
}

INSTANTIATE_TEST_SUITE_P(
    KillOneReplica, ReplicationTest,
    ::testing::Values(ReplicationCase{"sync", 0, false},
                      ReplicationCase{"sync", 1, false},
                      ReplicationCase{"sync", 0, true},
                      ReplicationCase{"sync", 0, true, true},
                      ReplicationCase{"sync", 1, true, false, true},
                      ReplicationCase{"async", 0, false},
                      ReplicationCase{"async", 1, true},
                      ReplicationCase{"async", 0, true, true},
                      ReplicationCase{"async", 0, true, false, true},
                      ReplicationCase{"sync", 0, false, false, false, true},
                      ReplicationCase{"sync", 1, false, false, false, true},
                      ReplicationCase{"sync", 0, true, true, false, true}),
    [](const ::testing::TestParamInfo<ReplicationCase>& info) {
      return absl::StrCat(
          info.param.mode,
          info.param.killed_replica == 0 ? "_primary" : "_backup",
          info.param.restarted ? "_restarted" : "",
          info.param.survivor_killed ? "_then_survivor" : "",
          info.param.checkpoints ? "_checkpoints" : "",
          info.param.backup_reads ? "_backup_reads" : "");
    });

// Three replicas, the primary and then the one that replaced it killed in
// turn: the last one takes over at epoch 2, and nothing is lost.
TEST(ReplicationTest, ThreeReplicasSurviveTwoPrimariesKilledInTurn) {
  std::unique_ptr<TestCluster> started =
      StartProbeCluster("three_replicas", "sync", 1, /*replicas=*/3);
  ASSERT_NE(started, nullptr);
  TestCluster& cluster = *started;
  LogsOnFailure logs(cluster);
  std::vector<std::unique_ptr<Process>> workers = StartProbeWorkers(cluster);
  ASSERT_EQ(workers.size(), kWorkers);
  auto wait_for_version = [&cluster](int replica, int64_t version) {
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    absl::StatusOr<StatsResponse> stats;
    do {
      stats = cluster.ReplicaStats(0, replica);
    } while ((!stats.ok() || stats->replica_role() != "primary" ||
              stats->version() < version) &&
             absl::Now() < give_up);
    return stats.ok() && stats->replica_role() == "primary" &&
           stats->version() >= version;
  };
  ASSERT_TRUE(wait_for_version(0, kSteps / 4));
  cluster.KillReplica(0, 0);
  ASSERT_TRUE(wait_for_version(1, kSteps / 2));
  cluster.KillReplica(0, 1);
  ExpectAllExitZero(workers);
  absl::StatusOr<StatsResponse> last = cluster.ReplicaStats(0, 2);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->replica_role(), "primary");
  EXPECT_EQ(last->replica_epoch(), 2);
  EXPECT_EQ(last->version(), kSteps);
  EXPECT_EQ(last->steps_lost(), 0);
  EXPECT_EQ(last->updates_lost(), 0);
  // Every step's update is there once: the probe's elements are exact.
  EXPECT_EQ(ProbeElementsOff(cluster, -kSteps), 0);
}

// Both replicas of a sync shard killed while the workers are stopped at a
// step past the last checkpoint, and started again together from their
// checkpoints, replica 1 first: it waits for replica 0, which installs its
// checkpoint, and catches up from it rather than keeping its own (once the
// workers come back and the primary has taken their step: a state that may
// still skip is not sent). The backup stays in the set and holds the
// primary's model exactly (read through it after the primary is killed at
// the end); the steps since the checkpoint are lost and counted alike on
// both.
TEST(ReplicationTest, AWholeSetRestartedFromCheckpointsKeepsItsBackup) {
  std::unique_ptr<TestCluster> started =
      StartProbeCluster("whole_set_restarted", "sync", kShards,
                        /*replicas=*/2, CheckpointFlags("whole_set", 100));
  ASSERT_NE(started, nullptr);
  TestCluster& cluster = *started;
  LogsOnFailure logs(cluster);
  std::vector<std::unique_ptr<Process>> workers = StartProbeWorkers(cluster);
  ASSERT_EQ(workers.size(), kWorkers);
  // Past the checkpoint of step 100, well before the one of step 200 (the
  // workers take 5 ms a step).
  ASSERT_TRUE(cluster
                  .WaitForStats(
                      [](const StatsResponse& s) { return s.version() >= 110; },
                      absl::Seconds(60))
                  .ok());
  for (auto& worker : workers) worker->Signal(SIGSTOP);
  cluster.KillReplica(1, 0);
  cluster.KillReplica(1, 1);
  ASSERT_TRUE(cluster.RestartReplicas(1, {1, 0}).ok());
  for (auto& worker : workers) worker->Signal(SIGCONT);
  ASSERT_TRUE(WaitForRole(cluster, 1, 1, "backup"));
  ExpectAllExitZero(workers);

  absl::StatusOr<StatsResponse> primary = cluster.ReplicaStats(1, 0);
  absl::StatusOr<StatsResponse> backup = cluster.ReplicaStats(1, 1);
  ASSERT_TRUE(primary.ok() && backup.ok());
  EXPECT_EQ(primary->replica_role(), "primary");
  // It came in by a catch-up, not by keeping its own checkpoint.
  EXPECT_EQ(primary->replica_catchups(), 1);
  EXPECT_NE(cluster.replica(1, 1).Stderr().find("is not installed"),
            std::string::npos);
  EXPECT_EQ(backup->replica_role(), "backup");
  EXPECT_EQ(backup->version(), primary->version());
  EXPECT_GT(primary->steps_lost(), 0);
  EXPECT_EQ(backup->steps_lost(), primary->steps_lost());
  EXPECT_EQ(backup->updates_lost(), primary->updates_lost());
  const std::vector<float> before = ReadProbeModel(cluster);
  ASSERT_FALSE(before.empty());
  cluster.KillReplica(1, 0);
  ASSERT_TRUE(WaitForRole(cluster, 1, 1, "primary"));
  EXPECT_EQ(ReadProbeModel(cluster), before);
}

// The job's start-up race: shard 1's backup comes up after its primary took
// the model, and the primary is killed while the backup catches up, before
// the first step, so no replica holds the shard. The primary had
// acknowledged nothing but the registrations, and promised the backup so
// (start_afresh_ms): the backup starts the shard afresh, the workers
// register again, and the job ends with every update applied once. (The
// backup used to wait for a primary that never came back, and the workers
// gave up after their retry window.)
TEST(ReplicationTest, APrimaryKilledBeforeItsLateBackupCaughtUpLosesNothing) {
  ClusterOptions options;
  options.num_shards = kShards;
  options.num_workers = kWorkers;
  options.replicas = 2;
  options.server_flags = {"--optimizer=sgd", "--learning_rate=1",
                          "--worker_lease_s=5"};
  options.started_later = {{1, 1}};
  absl::StatusOr<std::unique_ptr<TestCluster>> started =
      TestCluster::Start(options, "late_backup_primary_killed");
  ASSERT_TRUE(started.ok()) << started.status();
  TestCluster& cluster = **started;
  LogsOnFailure logs(cluster);
  std::vector<std::unique_ptr<Process>> workers = StartProbeWorkers(cluster);
  ASSERT_EQ(workers.size(), kWorkers);
  // Shard 1's primary holds the model and both workers; their
  // registrations wait there for the backup, which is not up. Stopped, the
  // workers begin no step: the backup's catch-up waits for their first
  // request, so it cannot finish before the kill.
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  absl::StatusOr<StatsResponse> primary;
  do {
    primary = cluster.ReplicaStats(1, 0);
  } while ((!primary.ok() || !primary->job_start().started()) &&
           absl::Now() < give_up);
  ASSERT_TRUE(primary.ok() && primary->job_start().started());
  for (auto& worker : workers) worker->Signal(SIGSTOP);
  ASSERT_TRUE(cluster.RestartReplica(1, 1).ok());
  ASSERT_TRUE(WaitForRole(cluster, 1, 1, "catching_up"));
  cluster.KillReplica(1, 0);
  for (auto& worker : workers) worker->Signal(SIGCONT);

  ASSERT_TRUE(WaitForRole(cluster, 1, 1, "primary"));
  ExpectAllExitZero(workers);
  absl::StatusOr<StatsResponse> survivor = cluster.ReplicaStats(1, 1);
  ASSERT_TRUE(survivor.ok()) << survivor.status();
  EXPECT_EQ(survivor->replica_epoch(), 1);
  EXPECT_EQ(survivor->replica_takeovers(), 1);
  EXPECT_NE(cluster.replica(1, 1).Stderr().find("a fresh start"),
            std::string::npos);
  EXPECT_EQ(ProbeElementsOff(cluster, -kSteps), 0);
}

// A sync job on 2 shards x 2 replicas whose shard 1 loses its primary
// (after `kill_after_step` steps; 0: never), which is restarted, catches up,
// and takes over when the other is killed after twice as many steps;
// worker 0's final JSON line.
std::string RunSyncJob(
    const std::string& name, const std::vector<std::string>& flags,
    int64_t kill_after_step, const std::vector<std::string>& server_flags = {},
    const std::function<void(TestCluster&)>& after_job = nullptr) {
  ClusterOptions options;
  options.num_shards = kShards;
  options.num_workers = kWorkers;
  options.replicas = 2;
  options.server_flags = {"--worker_lease_s=5"};
  options.server_flags.insert(options.server_flags.end(), server_flags.begin(),
                              server_flags.end());
  absl::StatusOr<std::unique_ptr<TestCluster>> started =
      TestCluster::Start(options, name);
  EXPECT_TRUE(started.ok()) << started.status();
  if (!started.ok()) return "";
  TestCluster& cluster = **started;
  LogsOnFailure logs(cluster);
  std::vector<std::unique_ptr<Process>> workers;
  for (int k = 0; k < kWorkers; ++k) {
    absl::StatusOr<std::unique_ptr<Process>> worker =
        cluster.StartWorker(k, kWorkers, flags);
    EXPECT_TRUE(worker.ok()) << worker.status();
    if (!worker.ok()) return "";
    workers.push_back(std::move(*worker));
  }
  if (kill_after_step > 0) {
    EXPECT_TRUE(cluster
                    .WaitForStats(
                        [kill_after_step](const StatsResponse& s) {
                          return s.version() >= kill_after_step;
                        },
                        absl::Seconds(60))
                    .ok());
    cluster.KillReplica(1, 0);
    EXPECT_TRUE(cluster.RestartReplica(1, 0).ok());
    EXPECT_TRUE(WaitForRole(cluster, 1, 0, "backup"));
    EXPECT_TRUE(cluster
                    .WaitForStats(
                        [kill_after_step](const StatsResponse& s) {
                          return s.version() >= 2 * kill_after_step;
                        },
                        absl::Seconds(60))
                    .ok());
    cluster.KillReplica(1, 1);
  }
  std::string out;
  for (auto& worker : workers) {
    absl::StatusOr<int> code = worker->Wait(absl::Seconds(120));
    EXPECT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(code.value_or(-1), 0) << worker->Stderr();
    if (out.empty()) out = worker->Stdout();
  }
  if (kill_after_step > 0) {
    absl::StatusOr<StatsResponse> survivor = cluster.ReplicaStats(1, 0);
    EXPECT_TRUE(survivor.ok()) << survivor.status();
    if (survivor.ok()) {
      EXPECT_EQ(survivor->replica_role(), "primary");
      EXPECT_EQ(survivor->replica_takeovers(), 1);
      EXPECT_EQ(survivor->replica_epoch(), 2);
    }
  }
  if (after_job) after_job(cluster);
  return out;
}

// The small MLP of the sync jobs here, `steps` long.
std::vector<std::string> SmallMlpFlags(int steps) {
  return {"--model=mlp",
          "--hidden=16",
          "--num_features=12",
          "--num_classes=3",
          "--train_examples=4096",
          "--test_examples=512",
          "--batch_size=16",
          "--block_elements=64",
          absl::StrCat("--steps=", steps)};
}

// The figures both jobs' worker 0 printed are the same, to the last digit.
void ExpectSameFinal(const std::string& calm, const std::string& killed,
                     const std::vector<const char*>& keys,
                     const std::string& what) {
  for (const char* key : keys) {
    absl::StatusOr<double> a = testing::FinalJsonNumber(calm, key);
    absl::StatusOr<double> b = testing::FinalJsonNumber(killed, key);
    ASSERT_TRUE(a.ok() && b.ok()) << what << " " << key << "\n"
                                  << calm << "\n"
                                  << killed;
    EXPECT_EQ(*a, *b) << what << " " << key;
  }
}

// In sync mode the new primary holds exactly the model the old one did, and
// a replica that caught up holds exactly the primary's, so the job ends as an
// undisturbed one does, to the last digit printed.
TEST(ReplicatedSyncTest, AJobThatLostAPrimaryEndsAsAnUndisturbedOne) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> models = {
      {"mlp", SmallMlpFlags(240)},
      // The pipelined step: a PushPull that fails at the kill goes again
      // as a plain one, and the next forward starts over on its values.
      {"mlp_pipelined",
       [] {
         std::vector<std::string> flags = SmallMlpFlags(240);
         flags.push_back("--pipeline_step=always");
         return flags;
       }()},
      {"ctr",
       {"--model=ctr", "--ctr_fields=4", "--ctr_dense=2", "--ctr_vocab=2000",
        "--batch_size=128", "--steps=240"}}};
  for (const auto& [model, model_flags] : models) {
    std::vector<std::string> flags = model_flags;
    flags.insert(flags.end(),
                 {"--log_every=0", "--device=cpu", "--heartbeat_interval_s=0.2",
                  "--retry_window_s=60", "--rpc_timeout_s=30",
                  "--inject_step_delay_ms=5"});
    const std::string calm =
        RunSyncJob(absl::StrCat("calm_", model), flags, /*kill_after=*/0);
    const std::string killed =
        RunSyncJob(absl::StrCat("killed_", model), flags, /*kill_after=*/80);
    ExpectSameFinal(
        calm, killed,
        model != "ctr"
            ? std::vector<const char*>{"final_loss", "test_loss",
                                       "test_accuracy"}
            : std::vector<const char*>{"final_loss", "auc", "logloss"},
        model);
  }
}

// A primary answers a step's pulls before its backup holds the step (the
// pulls wait for the step before it only): here every shard's primary keeps
// step 5's records and dies at the first push of step 6, so each backup
// takes over a step behind what the workers read. The workers send their
// step-5 pushes again (PsClient keeps the last one), the new primaries make
// step 5 from them as the old ones did, and the job ends as an undisturbed
// one does, to the last digit printed.
TEST(ReplicatedSyncTest, ABackupAStepBehindTheWorkersTakesOverWithNothingLost) {
  std::vector<std::string> flags = SmallMlpFlags(40);
  flags.insert(flags.end(),
               {"--log_every=0", "--device=cpu", "--heartbeat_interval_s=0.2",
                "--retry_window_s=60", "--rpc_timeout_s=30"});
  const std::string calm = RunSyncJob("calm_window", flags, /*kill_after=*/0);
  const std::string killed =
      RunSyncJob("killed_window", flags, /*kill_after=*/0,
                 {"--inject_crash_at=record_window"}, [](TestCluster& cluster) {
                   for (int shard = 0; shard < kShards; ++shard) {
                     absl::StatusOr<StatsResponse> survivor =
                         cluster.ReplicaStats(shard, 1);
                     ASSERT_TRUE(survivor.ok()) << survivor.status();
                     EXPECT_EQ(survivor->replica_role(), "primary") << shard;
                     EXPECT_EQ(survivor->replica_takeovers(), 1) << shard;
                     EXPECT_EQ(survivor->version(), 40) << shard;
                     EXPECT_NE(cluster.replica(shard, 0).Stderr().find(
                                   "--inject_crash_at=record_window"),
                               std::string::npos)
                         << shard;
                   }
                 });
  ExpectSameFinal(calm, killed, {"final_loss", "test_loss", "test_accuracy"},
                  "mlp");
}

// A primary that stops answering without dying (SIGSTOP: a host cut off, or
// frozen) is replaced once it has been silent for --replica_takeover_s; when
// it wakes it still believes it is the primary, but it cannot get anything
// acknowledged: its forwards are refused by the new primary's higher epoch,
// and it steps down.
TEST(ReplicationFencingTest, AFrozenPrimaryIsReplacedAndFencedWhenItWakes) {
  // Leases outlast the workers' 3 s calls to the frozen primary.
  std::unique_ptr<TestCluster> started =
      StartProbeCluster("frozen_primary", "sync", 1, /*replicas=*/2,
                        {"--worker_lease_s=20", "--replica_takeover_s=1"});
  ASSERT_NE(started, nullptr);
  TestCluster& cluster = *started;
  LogsOnFailure logs(cluster);
  std::vector<std::unique_ptr<Process>> workers =
      StartProbeWorkers(cluster, /*rpc_timeout_s=*/3);
  ASSERT_EQ(workers.size(), kWorkers);
  ASSERT_TRUE(WaitForAThirdOfTheSteps(cluster));
  cluster.replica(0, 0).Signal(SIGSTOP);
  // The backup takes over once the primary has been silent for 1 s.
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  absl::StatusOr<StatsResponse> backup;
  do {
    backup = cluster.ReplicaStats(0, 1);
  } while ((!backup.ok() || backup->replica_role() != "primary") &&
           absl::Now() < give_up);
  ASSERT_TRUE(backup.ok()) << backup.status();
  ASSERT_EQ(backup->replica_role(), "primary");
  EXPECT_EQ(backup->replica_epoch(), 1);
  cluster.replica(0, 0).Signal(SIGCONT);
  ExpectAllExitZero(workers);

  // Whatever the woken primary applied was never acknowledged: the job's
  // model (on the new primary) is exact.
  absl::StatusOr<StatsResponse> final_stats = cluster.ReplicaStats(0, 1);
  ASSERT_TRUE(final_stats.ok()) << final_stats.status();
  EXPECT_EQ(final_stats->version(), kSteps);
  EXPECT_EQ(ProbeElementsOff(cluster, -kSteps), 0);

  // A request that changes the shard, sent to the old primary, is not
  // acknowledged (its forward is fenced, or it is gone already), and it
  // steps down: stale, it exits 75 so that a restart catches it up.
  auto stub = ParameterServer::NewStub(grpc::CreateChannel(
      cluster.HostList()[0].substr(0, cluster.HostList()[0].find('|')),
      grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
  HeartbeatRequest heartbeat;
  heartbeat.set_worker_id(0);
  HeartbeatResponse answer;
  const grpc::Status status = stub->Heartbeat(&context, heartbeat, &answer);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << status.error_message();
  absl::StatusOr<int> code = cluster.replica(0, 0).Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 75);
  EXPECT_NE(cluster.replica(0, 0).Stderr().find("steps down (stale)"),
            std::string::npos);
  // Started again, it catches up from the new primary and is its backup.
  ASSERT_TRUE(cluster.RestartReplica(0, 0).ok());
  ASSERT_TRUE(WaitForRole(cluster, 0, 0, "backup"));
  absl::StatusOr<StatsResponse> back = cluster.ReplicaStats(0, 0);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->version(), kSteps);
}

// A backup that stops answering without dying holds the primary's answers
// (README: with two replicas the job waits rather than diverge), but not
// the primary itself: its forwards wait off the threads that serve the
// workers' heartbeats and Stats, so no worker's lease lapses while the
// backup is frozen for longer than a lease, and the job ends exact, with
// no step short.
TEST(ReplicationTest, AFrozenBackupHoldsTheJobButDropsNoWorker) {
  std::unique_ptr<TestCluster> started = StartProbeCluster(
      "frozen_backup", "sync", 1, /*replicas=*/2, {"--worker_lease_s=2"});
  ASSERT_NE(started, nullptr);
  TestCluster& cluster = *started;
  LogsOnFailure logs(cluster);
  std::vector<std::unique_ptr<Process>> workers = StartProbeWorkers(cluster);
  ASSERT_EQ(workers.size(), kWorkers);
  ASSERT_TRUE(WaitForAThirdOfTheSteps(cluster));
  cluster.replica(0, 1).Signal(SIGSTOP);
  // Twice the lease, the primary's heartbeats and forwards piling up.
  const absl::Time wake_at = absl::Now() + absl::Seconds(4);
  absl::Duration slowest_stats;
  int stats_calls = 0;
  while (absl::Now() < wake_at) {
    const absl::Time asked = absl::Now();
    absl::StatusOr<StatsResponse> primary = cluster.ReplicaStats(0, 0);
    ASSERT_TRUE(primary.ok()) << primary.status();
    slowest_stats = std::max(slowest_stats, absl::Now() - asked);
    ++stats_calls;
    EXPECT_EQ(primary->members(), kWorkers) << "a worker's lease lapsed";
  }
  cluster.replica(0, 1).Signal(SIGCONT);
  EXPECT_LT(slowest_stats, absl::Seconds(1))
      << "the primary's Stats waited behind its forwards (" << stats_calls
      << " calls)";
  ExpectAllExitZero(workers);
  absl::StatusOr<StatsResponse> final_stats = cluster.ReplicaStats(0, 0);
  ASSERT_TRUE(final_stats.ok()) << final_stats.status();
  EXPECT_EQ(final_stats->replica_role(), "primary");
  EXPECT_EQ(final_stats->version(), kSteps);
  EXPECT_EQ(final_stats->steps_short(), 0);
  EXPECT_EQ(ProbeElementsOff(cluster, -kSteps), 0);
}

// Flags a replica set cannot start with: one line, exit 2.
TEST(ReplicationFlagsTest, AReplicaSetWithoutItsAddressesIsRefused) {
  const std::string dir = testing::TestDir();
  absl::StatusOr<std::unique_ptr<Process>> server = Process::Start(
      {testing::BinaryPath("ps_server/ps_server"), "--port=0", "--replicas=2",
       "--replica_index=1", "--replica_hosts=127.0.0.1:1"},
      dir, "bad_replica_flags");
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<int> code = (*server)->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 2);
  EXPECT_NE((*server)->Stderr().find(
                "--replica_hosts must list the gRPC address of each of the "
                "shard's 2 replicas"),
            std::string::npos)
      << (*server)->Stderr();
}

}  // namespace
}  // namespace pstrain
