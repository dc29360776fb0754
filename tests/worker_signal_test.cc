// A worker waiting on its servers shows the wait and stops on Ctrl-C or
// SIGTERM within a second (issue 29): while it waits to reach a server, for
// the job's other workers to register, in a retry window after a server
// died, and in a sync pull held for a slow peer. Each time it leaves the
// job if it had joined and exits non-zero (128 + the signal) with one line
// saying what it waited for.
#include <signal.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/http_util.h"
#include "tests/test_cluster.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;
using testing::Process;

// "Within a second" of the signal, plus room for a loaded 2-core machine
// to schedule the process and reap it.
constexpr absl::Duration kStopWithin = absl::Seconds(2);

// Polls the worker's log until it holds `text`; fails after `timeout`.
bool WaitForLog(Process& worker, const std::string& text,
                absl::Duration timeout) {
  const absl::Time give_up = absl::Now() + timeout;
  while (absl::Now() < give_up) {
    if (worker.Stderr().find(text) != std::string::npos) return true;
    if (!worker.running()) return false;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return false;
}

// Sends `signal_number` and checks the worker ends quickly, non-zero, with
// the one line naming what it waited for; returns its log.
std::string SignalAndCheck(Process& worker, int signal_number,
                           const std::string& waiting_for) {
  const absl::Time sent = absl::Now();
  worker.Signal(signal_number);
  absl::StatusOr<int> code = worker.Wait(absl::Seconds(30));
  const absl::Duration took = absl::Now() - sent;
  const std::string log = worker.Stderr();
  EXPECT_TRUE(code.ok()) << code.status() << "\n" << log;
  EXPECT_LT(took, kStopWithin) << log;
  EXPECT_EQ(code.value_or(0), 128 + signal_number) << log;
  const std::string name = signal_number == SIGINT ? "SIGINT" : "SIGTERM";
  EXPECT_THAT(log, HasSubstr(absl::StrCat("stopped by ", name,
                                          " while waiting ", waiting_for)));
  return log;
}

TEST(WorkerSignalTest, WaitingToReachAServer) {
  const std::string host = absl::StrCat("127.0.0.1:", testing::FreePort());
  absl::StatusOr<std::unique_ptr<Process>> worker = Process::Start(
      {testing::BinaryPath("worker/worker"), "--ps_hosts=" + host,
       "--model=probe", "--steps=5", "--connect_timeout_s=60"},
      testing::TestDir(), "connect_wait");
  ASSERT_TRUE(worker.ok()) << worker.status();
  // The wait shows itself: shard, address, last error, time left.
  const std::string line =
      absl::StrCat("waiting to reach shard 0 (", host, ") to register, ");
  ASSERT_TRUE(WaitForLog(**worker, line, absl::Seconds(20)))
      << (*worker)->Stderr();
  EXPECT_THAT((*worker)->Stderr(),
              HasSubstr(absl::StrCat(" s left (--connect_timeout_s): ", host,
                                     ": cannot connect: Connection refused")));
  SignalAndCheck(**worker, SIGINT,
                 "to reach the servers and register the model");
}

// The CTR worker (sparse tables) waits the same way.
TEST(WorkerSignalTest, CtrWorkerWaitingToReachAServer) {
  const std::string host = absl::StrCat("127.0.0.1:", testing::FreePort());
  absl::StatusOr<std::unique_ptr<Process>> worker = Process::Start(
      {testing::BinaryPath("worker/worker"), "--ps_hosts=" + host,
       "--model=ctr", "--ctr_train_examples=1024", "--ctr_test_examples=256",
       "--steps=5", "--connect_timeout_s=60"},
      testing::TestDir(), "ctr_connect_wait");
  ASSERT_TRUE(worker.ok()) << worker.status();
  ASSERT_TRUE(WaitForLog(**worker,
                         absl::StrCat("waiting to reach shard 0 (", host, ")"),
                         absl::Seconds(20)))
      << (*worker)->Stderr();
  SignalAndCheck(**worker, SIGTERM,
                 "to reach the servers and register the model");
}

TEST(WorkerSignalTest, WaitingForTheJobsOtherWorkers) {
  testing::ClusterOptions options;
  options.num_workers = 2;
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start(options, "start_wait");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto worker = (*cluster)->StartWorker(0, 2, {"--model=probe", "--steps=5"});
  ASSERT_TRUE(worker.ok()) << worker.status();
  // Sync: worker 0 computes and pushes its first step, then waits for
  // worker 1 to register.
  ASSERT_TRUE((*cluster)
                  ->WaitForStats(
                      [](const StatsResponse& s) {
                        return s.blocks_applied() >= 1 &&
                               !s.job_start().started();
                      },
                      absl::Seconds(30))
                  .ok());
  SignalAndCheck(**worker, SIGTERM, "for the job's other workers to register");
}

TEST(WorkerSignalTest, RetryingAfterAServerDied) {
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start(testing::ClusterOptions(), "retry_wait");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto worker = (*cluster)->StartWorker(
      0, 1,
      {"--model=probe", "--steps=1000000", "--log_every=0",
       "--inject_step_delay_ms=2", "--retry_window_s=60"});
  ASSERT_TRUE(worker.ok()) << worker.status();
  ASSERT_TRUE((*cluster)
                  ->WaitForStats(
                      [](const StatsResponse& s) { return s.version() >= 5; },
                      absl::Seconds(30))
                  .ok());
  (*cluster)->KillServer(0);
  // Each retry says the shard, its address, the error and the time left.
  ASSERT_TRUE(
      WaitForLog(**worker, "s left of the retry window", absl::Seconds(20)))
      << (*worker)->Stderr();
  EXPECT_THAT(
      (*worker)->Stderr(),
      HasSubstr(absl::StrCat("shard 0 (", (*cluster)->HostList()[0], ")")));
  const std::string log =
      SignalAndCheck(**worker, SIGINT, "on the servers after step");
  EXPECT_THAT(log, HasSubstr("interrupted while retrying after"));
}

// Worker 0 of a 2-worker sync job (`flags`) is sent SIGTERM while its pull
// of step 1 waits for worker 1, which takes a minute over its first step;
// checks it stops as SignalAndCheck says and leaves (the step then waits for
// worker 1 alone). Returns worker 0's log.
std::string SignalInASyncPullHeldForASlowPeer(
    const std::vector<std::string>& flags, const std::string& name) {
  testing::ClusterOptions options;
  options.num_workers = 2;
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start(options, name);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  if (!cluster.ok()) return "";
  std::vector<std::string> slow = flags;
  slow.push_back("--inject_step_delay_ms=60000");
  auto w1 = (*cluster)->StartWorker(1, 2, slow);
  auto w0 = (*cluster)->StartWorker(0, 2, flags);
  EXPECT_TRUE(w0.ok() && w1.ok());
  if (!w0.ok() || !w1.ok()) return "";
  EXPECT_TRUE((*cluster)
                  ->WaitForStats(
                      [](const StatsResponse& s) {
                        return s.job_start().started() &&
                               s.waiting_pulls() >= 1;
                      },
                      absl::Seconds(30))
                  .ok());
  const std::string log =
      SignalAndCheck(**w0, SIGTERM, "on the servers after step");
  EXPECT_TRUE((*cluster)
                  ->WaitForStats(
                      [](const StatsResponse& s) { return s.members() == 1; },
                      absl::Seconds(10))
                  .ok());
  return log;
}

TEST(WorkerSignalTest, InASyncPullHeldForASlowPeer) {
  const std::string log = SignalInASyncPullHeldForASlowPeer(
      {"--model=probe", "--steps=50", "--log_every=0"}, "pull_wait");
  EXPECT_THAT(log, HasSubstr("interrupted while waiting for shard 0"));
}

// A CTR worker with async tables waits at the dense step's barrier while
// its table lane (--embedding_prefetch) has the next batch's rows: SIGTERM
// still ends it within the bound, the lane's work drained or cut.
TEST(WorkerSignalTest, CtrWorkerWithItsTableLaneInASyncPullHeldForASlowPeer) {
  SignalInASyncPullHeldForASlowPeer(
      {"--model=ctr", "--ctr_train_examples=4096", "--ctr_test_examples=256",
       "--batch_size=64", "--steps=50", "--embedding_mode=async",
       "--log_every=0"},
      "ctr_lane_pull_wait");
}

// A first step's time is not known until it has pushed, and a big model's
// push takes a while: a signal during that step must still let the push go
// in whole. Worker 0 of a 2-worker sync job over 2 shards, on a 200 MB
// probe model (its push takes about 0.2 s here), SIGTERMs itself in step
// 0's backward, which then pauses 600 ms. It pushes step 0 whole and
// stops; worker 1 (registered first) pushes step 1 and waits for it until
// the test's SIGTERM.
// Every shard must stop at step 1 with none short. With a 0.4 s grace in
// the first step, the interrupts cut worker 0's push and the shards' blocks
// stopped a step apart.
TEST(WorkerSignalTest, ASignalDuringABigModelsFirstStepLetsItsPushGoInWhole) {
  testing::ClusterOptions options;
  options.num_shards = 2;
  options.num_workers = 2;
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start(options, "first_step_push");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::vector<std::string> flags = {"--model=probe",
                                          "--probe_elements=50000000",
                                          "--steps=20", "--log_every=0"};
  std::vector<std::string> first = flags;
  first.push_back("--inject_sigterm_in_backward_step=0");
  first.push_back("--inject_backward_pause_ms=600");
  // Worker 1 first, so that worker 0's step is not followed by a wait for
  // the job to start (cut short: not what this tests).
  auto w1 = (*cluster)->StartWorker(1, 2, flags);
  ASSERT_TRUE(w1.ok());
  ASSERT_TRUE((*cluster)
                  ->WaitForStats(
                      [](const StatsResponse& s) {
                        return s.model_registered() &&
                               s.job_start().missing_workers_size() == 1 &&
                               s.job_start().missing_workers(0) == 0;
                      },
                      absl::Seconds(30))
                  .ok());
  auto w0 = (*cluster)->StartWorker(0, 2, first);
  ASSERT_TRUE(w0.ok());
  absl::StatusOr<int> code0 = (*w0)->Wait(absl::Seconds(60));
  ASSERT_TRUE(code0.ok()) << code0.status();
  (*w1)->Signal(SIGTERM);
  ASSERT_TRUE((*w1)->Wait(absl::Seconds(60)).ok());
  absl::StatusOr<std::vector<StatsResponse>> stats = (*cluster)->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  for (const StatsResponse& shard : *stats) {
    EXPECT_EQ(shard.version(), 1) << shard.ShortDebugString();
    EXPECT_EQ(shard.steps_short(), 0) << shard.ShortDebugString();
  }
}

}  // namespace
}  // namespace pstrain
