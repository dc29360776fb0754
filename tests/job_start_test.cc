// Issue 27, with real processes: a sync job starts only once every worker it
// was told to expect has registered. A worker that never comes fails the
// job at --startup_timeout_s, and every worker's exit names it; with
// --min_workers the job starts without it and counts its short steps.
#include <csignal>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/test_cluster.h"

namespace pstrain {
namespace {

constexpr int kSteps = 40;

std::vector<std::string> WorkerFlags() {
  return {"--model=mlp",          "--hidden=8",
          "--num_features=6",     "--num_classes=3",
          "--train_examples=300", "--test_examples=60",
          "--batch_size=10",      absl::StrCat("--steps=", kSteps),
          "--log_every=0",        "--heartbeat_interval_s=0.2",
          "--device=cpu"};
}

absl::StatusOr<std::unique_ptr<testing::TestCluster>> StartServers(
    int num_workers, std::vector<std::string> flags, const std::string& name) {
  testing::ClusterOptions options;
  options.num_shards = 2;
  options.num_workers = num_workers;
  options.mode = "sync";
  options.server_flags = std::move(flags);
  return testing::TestCluster::Start(options, name);
}

TEST(JobStartTest, AWorkerThatNeverComesFailsTheJobNamingIt) {
  // Long enough for two workers to start and register on a loaded 2-core
  // machine: the timeout runs from the servers' start.
  constexpr int kStartupTimeoutS = 10;
  const absl::Time servers_started = absl::Now();
  auto cluster = StartServers(
      3, {absl::StrCat("--startup_timeout_s=", kStartupTimeoutS)}, "never");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::unique_ptr<testing::Process>> workers;
  for (int k = 0; k < 2; ++k) {  // worker 2 never comes
    auto worker = (*cluster)->StartWorker(k, 3, WorkerFlags());
    ASSERT_TRUE(worker.ok()) << worker.status();
    workers.push_back(std::move(*worker));
  }
  for (int k = 0; k < 2; ++k) {
    absl::StatusOr<int> code = workers[k]->Wait(
        servers_started + absl::Seconds(kStartupTimeoutS + 5) - absl::Now());
    ASSERT_TRUE(code.ok()) << "worker " << k << " still running "
                           << kStartupTimeoutS + 5 << " s after the servers";
    EXPECT_NE(*code, 0);
    EXPECT_NE(workers[k]->Stderr().find("workers 2 did not register"),
              std::string::npos)
        << workers[k]->Stderr();
    EXPECT_EQ(workers[k]->Stdout().find("\"event\":\"final\""),
              std::string::npos);
  }
  // Nothing was applied, and a worker 2 that comes now hears why.
  absl::StatusOr<std::vector<StatsResponse>> stats = (*cluster)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  for (const StatsResponse& shard : *stats) {
    EXPECT_EQ(shard.version(), 0);
    EXPECT_FALSE(shard.job_start().started());
  }
  auto late = (*cluster)->StartWorker(2, 3, WorkerFlags());
  ASSERT_TRUE(late.ok());
  absl::StatusOr<int> code = (*late)->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok());
  EXPECT_NE(*code, 0);
  EXPECT_NE((*late)->Stderr().find("the job did not start"), std::string::npos)
      << (*late)->Stderr();
}

TEST(JobStartTest, WithMinWorkersTheJobRunsAndCountsItsShortSteps) {
  // As above, the two that come must register within the timeout.
  auto cluster = StartServers(3, {"--startup_timeout_s=10", "--min_workers=2"},
                              "min_workers");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  // Workers 0 and 1 only: each waits for the start, then runs every step,
  // each of them without worker 2's gradient.
  std::vector<std::unique_ptr<testing::Process>> workers;
  for (int k = 0; k < 2; ++k) {
    auto worker = (*cluster)->StartWorker(k, 3, WorkerFlags());
    ASSERT_TRUE(worker.ok()) << worker.status();
    workers.push_back(std::move(*worker));
  }
  for (int k = 0; k < 2; ++k) {
    absl::StatusOr<int> code = workers[k]->Wait(absl::Seconds(60));
    ASSERT_TRUE(code.ok()) << code.status();
    ASSERT_EQ(*code, 0) << workers[k]->Stderr();
    const std::string out = workers[k]->Stdout();
    EXPECT_EQ(*testing::FinalJsonNumber(out, "steps_run"), kSteps);
    EXPECT_EQ(*testing::FinalJsonNumber(out, "steps_short"), kSteps);
  }
  absl::StatusOr<std::vector<StatsResponse>> stats = (*cluster)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  for (const StatsResponse& shard : *stats) {
    EXPECT_EQ(shard.version(), kSteps);
    EXPECT_EQ(shard.steps_short(), kSteps);
    EXPECT_TRUE(shard.job_start().started());
    ASSERT_EQ(shard.job_start().missing_workers_size(), 1);
    EXPECT_EQ(shard.job_start().missing_workers(0), 2);
  }
  const std::string log = (*cluster)->server(0).Stderr();
  EXPECT_NE(log.find("the job starts with 2 of 3 workers"), std::string::npos)
      << log;
}

TEST(JobStartTest, ServersSayWhoTheyWaitFor) {
  auto cluster = StartServers(4, {"--startup_timeout_s=60"}, "waiting");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto worker = (*cluster)->StartWorker(1, 4, WorkerFlags());
  ASSERT_TRUE(worker.ok());
  // The servers log who is missing every few seconds; the waiting worker
  // says the same.
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  bool server_said = false, worker_said = false;
  while (absl::Now() < give_up && !(server_said && worker_said)) {
    server_said = (*cluster)->server(0).Stderr().find(
                      "waiting for workers 0, 2, 3 (3 of 4 missing)") !=
                  std::string::npos;
    worker_said = (*worker)->Stderr().find(
                      "waiting for workers 0, 2, 3 (3 of 4 missing)") !=
                  std::string::npos;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(server_said) << (*cluster)->server(0).Stderr();
  EXPECT_TRUE(worker_said) << (*worker)->Stderr();
  absl::StatusOr<std::vector<StatsResponse>> stats = (*cluster)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_FALSE((*stats)[0].job_start().started());
  EXPECT_EQ((*stats)[0].job_start().missing_workers_size(), 3);
  // SIGTERM ends the wait at once, with a line saying what it waited for.
  (*worker)->Signal(SIGTERM);
  absl::StatusOr<int> code = (*worker)->Wait(absl::Seconds(5));
  ASSERT_TRUE(code.ok()) << "the worker did not stop within 5 s of SIGTERM";
  EXPECT_NE(*code, 0);
  EXPECT_NE((*worker)->Stderr().find("interrupted while waiting for the job"),
            std::string::npos)
      << (*worker)->Stderr();
}

// Runs workers 0 and 1 of a 2-worker job on `cluster` to the end; their
// final losses, or empty when one failed.
std::vector<double> RunBothWorkers(testing::TestCluster& cluster) {
  std::vector<std::unique_ptr<testing::Process>> workers;
  for (int k = 0; k < 2; ++k) {
    auto worker = cluster.StartWorker(k, 2, WorkerFlags());
    EXPECT_TRUE(worker.ok()) << worker.status();
    if (!worker.ok()) return {};
    workers.push_back(std::move(*worker));
  }
  std::vector<double> losses;
  for (auto& worker : workers) {
    absl::StatusOr<int> code = worker->Wait(absl::Seconds(60));
    EXPECT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(code.value_or(-1), 0) << worker->Stderr();
    absl::StatusOr<double> loss =
        testing::FinalJsonNumber(worker->Stdout(), "final_loss");
    EXPECT_TRUE(loss.ok()) << worker->Stdout();
    if (!code.ok() || *code != 0 || !loss.ok()) return {};
    losses.push_back(*loss);
  }
  return losses;
}

// A worker Ctrl-C'd while it waits for the job's start (its first step may
// already be pushed: sync computes it meanwhile) and started again with
// the others: the job is the one an undisturbed run gives, to the bit.
TEST(JobStartTest, AWorkerInterruptedBeforeTheStartChangesNothing) {
  auto undisturbed = StartServers(2, {}, "undisturbed");
  ASSERT_TRUE(undisturbed.ok()) << undisturbed.status();
  const std::vector<double> expected = RunBothWorkers(**undisturbed);
  ASSERT_EQ(expected.size(), 2);

  auto cluster = StartServers(2, {}, "interrupted");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto first = (*cluster)->StartWorker(0, 2, WorkerFlags());
  ASSERT_TRUE(first.ok()) << first.status();
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while ((*first)->Stderr().find("waiting for workers 1") ==
             std::string::npos &&
         absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_NE((*first)->Stderr().find("waiting for workers 1"), std::string::npos)
      << (*first)->Stderr();
  (*first)->Signal(SIGINT);
  absl::StatusOr<int> code = (*first)->Wait(absl::Seconds(10));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 130) << (*first)->Stderr();
  EXPECT_EQ(RunBothWorkers(**cluster), expected);
  absl::StatusOr<std::vector<StatsResponse>> stats = (*cluster)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  for (const StatsResponse& shard : *stats) {
    EXPECT_EQ(shard.version(), kSteps);
    EXPECT_EQ(shard.steps_short(), 0);
  }
}

}  // namespace
}  // namespace pstrain
