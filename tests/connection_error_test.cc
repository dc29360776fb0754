// A worker that cannot reach its servers says why: nothing listening, a TLS
// server dialled in plaintext, a plaintext server dialled with TLS. gRPC
// itself only says "Deadline Exceeded" while it waits for the servers.
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

// Runs a worker against `ps_hosts` that gives up after a second; returns
// its stderr once it has exited non-zero.
std::string FailedWorkerStderr(const std::string& ps_hosts,
                               const std::vector<std::string>& extra_flags,
                               const std::string& name) {
  std::vector<std::string> argv = {testing::BinaryPath("worker/worker"),
                                   "--ps_hosts=" + ps_hosts,
                                   "--model=probe",
                                   "--steps=1",
                                   "--connect_timeout_s=1",
                                   "--retry_window_s=0"};
  argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
  absl::StatusOr<std::unique_ptr<testing::Process>> worker =
      testing::Process::Start(argv, testing::TestDir(), name);
  EXPECT_TRUE(worker.ok()) << worker.status();
  if (!worker.ok()) return "";
  absl::StatusOr<int> code = (*worker)->Wait(absl::Seconds(60));
  EXPECT_TRUE(code.ok()) << code.status();
  EXPECT_NE(code.value_or(0), 0);
  return (*worker)->Stderr();
}

void MakeCerts(const std::string& dir) {
  const absl::Status made = testing::MakeTestCerts(dir);
  ASSERT_TRUE(made.ok()) << made;
}

TEST(ConnectionErrorTest, NothingListening) {
  const std::string host = absl::StrCat("127.0.0.1:", testing::FreePort());
  const std::string err = FailedWorkerStderr(host, {}, "nothing");
  EXPECT_THAT(err, HasSubstr(host + ": cannot connect: Connection refused"));
  EXPECT_THAT(err, HasSubstr("is ps_server running there"));
}

TEST(ConnectionErrorTest, PlaintextWorkerAgainstTlsServers) {
  const std::string certs = testing::TestDir() + "/certs";
  MakeCerts(certs);
  testing::ClusterOptions options;
  options.server_flags = {"--tls_cert=" + certs + "/server.pem",
                          "--tls_key=" + certs + "/server.key"};
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start(options, "tls_servers");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string err =
      FailedWorkerStderr((*cluster)->PsHosts(), {}, "plaintext_worker");
  EXPECT_THAT(err, HasSubstr("likely expects TLS (give --tls_ca"));
}

TEST(ConnectionErrorTest, TlsWorkerAgainstPlaintextServers) {
  const std::string certs = testing::TestDir() + "/certs_plain";
  MakeCerts(certs);
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start(testing::ClusterOptions(), "plain_servers");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string err = FailedWorkerStderr(
      (*cluster)->PsHosts(), {"--tls_ca=" + certs + "/ca.pem"}, "tls_worker");
  EXPECT_THAT(err, HasSubstr("the server speaks plaintext gRPC but this "
                             "client dials TLS"));
}

// A server that goes away mid-job costs its workers --retry_window_s, not
// --connect_timeout_s: a worker's retries used to register again to learn
// the server's data port, and that registration waited for the server to
// come back for the whole connect timeout (60 s here), saying nothing.
TEST(ConnectionErrorTest, AServerGoneMidJobCostsTheRetryWindow) {
  testing::ClusterOptions options;
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
      testing::TestCluster::Start(options, "server_gone");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  absl::StatusOr<std::unique_ptr<testing::Process>> worker =
      (*cluster)->StartWorker(
          0, 1,
          {"--model=mlp", "--hidden=32", "--steps=100000000", "--log_every=0",
           "--retry_window_s=3", "--connect_timeout_s=60",
           "--rpc_timeout_s=60"});
  ASSERT_TRUE(worker.ok()) << worker.status();
  const absl::Status training = (*cluster)->WaitForStats(
      [](const StatsResponse& s) { return s.version() >= 5; },
      absl::Seconds(60));
  ASSERT_TRUE(training.ok()) << training;
  ASSERT_TRUE((*cluster)->StopServer(0).ok());
  const absl::Time stopped = absl::Now();
  absl::StatusOr<int> code = (*worker)->Wait(absl::Seconds(90));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_NE(*code, 0);
  // 3 s of retries and their last backoff, well under the 60 s a wait for
  // the connect timeout takes.
  EXPECT_LT(absl::Now() - stopped, absl::Seconds(20)) << (*worker)->Stderr();
  EXPECT_THAT((*worker)->Stderr(), HasSubstr("retry window"));
}

}  // namespace
}  // namespace pstrain
