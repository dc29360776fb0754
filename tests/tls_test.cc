// TLS, mutual TLS and the shared bearer token on a real ps_server, with a CA
// and certificates made at test time by deploy/tls/make_certs.sh (openssl):
// a job with the right credentials trains; every client missing one piece
// is refused with the status a client would see (UNAVAILABLE for a failed
// handshake, UNAUTHENTICATED for the token) and the server keeps serving.
#include "common/transport/tls.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <fstream>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/ps.grpc.pb.h"
#include "tests/http_util.h"
#include "tests/proto/health.grpc.pb.h"
#include "tests/test_cluster.h"
#include "worker/client/ps_client.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

constexpr char kToken[] = "0123456789abcdef-pstrain";

// Runs make_certs.sh into `dir`: ca.pem, server.{pem,key}, client.{pem,key}.
void MakeCerts(const std::string& dir) {
  const absl::Status made = testing::MakeTestCerts(dir);
  ASSERT_TRUE(made.ok()) << made;
}

std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string path = testing::TestDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

// Runs `argv` (a binary given a bad flag): it must exit 2 with one line
// saying `expected`.
void ExpectOneLineAndExit2(const std::vector<std::string>& argv,
                           const std::string& expected) {
  absl::StatusOr<std::unique_ptr<testing::Process>> process =
      testing::Process::Start(argv, testing::TestDir(), "bad_flag");
  ASSERT_TRUE(process.ok()) << process.status();
  absl::StatusOr<int> code = (*process)->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 2) << expected;
  const std::string err = (*process)->Stderr();
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  EXPECT_THAT(err, HasSubstr(expected));
}

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    certs_ = new std::string(testing::TestDir() + "/certs");
    other_ = new std::string(testing::TestDir() + "/other_ca");
    MakeCerts(*certs_);
    MakeCerts(*other_);  // a second CA: its certificates must not pass
    token_file_ =
        new std::string(WriteFile("token", absl::StrCat(kToken, "\n")));
  }

  void SetUp() override {
    health_port_ = testing::FreePort();
    testing::ClusterOptions options;
    options.num_shards = 2;
    options.server_flags = {"--tls_cert=" + Cert("server.pem"),
                            "--tls_key=" + Cert("server.key"),
                            "--tls_client_ca=" + Cert("ca.pem"),
                            "--auth_token_file=" + *token_file_,
                            absl::StrCat("--health_port=", health_port_),
                            "--learning_rate=0.2"};
    absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
        testing::TestCluster::Start(options, "tls");
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
  }

  static std::string Cert(const std::string& name) {
    return *certs_ + "/" + name;
  }
  static std::string Other(const std::string& name) {
    return *other_ + "/" + name;
  }

  // The flags a worker needs for this cluster.
  std::vector<std::string> WorkerTlsFlags() const {
    return {"--tls_ca=" + Cert("ca.pem"), "--tls_cert=" + Cert("client.pem"),
            "--tls_key=" + Cert("client.key"),
            "--auth_token_file=" + *token_file_};
  }

  // One Stats call to shard 0 with these credentials (and token).
  grpc::Status CallStats(const ClientTlsFiles& files, const std::string& token,
                         const std::string& target = "",
                         StatsResponse* out = nullptr) {
    absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
        MakeChannelCredentials(files);
    EXPECT_TRUE(credentials.ok()) << credentials.status();
    if (!credentials.ok()) return grpc::Status::CANCELLED;
    std::shared_ptr<grpc::ChannelCredentials> channel_credentials =
        *credentials != nullptr ? *credentials
                                : grpc::InsecureChannelCredentials();
    auto stub = ParameterServer::NewStub(
        grpc::CreateChannel(target.empty() ? cluster_->HostList()[0] : target,
                            channel_credentials));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(10));
    if (!token.empty()) {
      context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    }
    StatsResponse response;
    return stub->Stats(&context, StatsRequest(), out ? out : &response);
  }

  ClientTlsFiles Good() const {
    return {Cert("ca.pem"), Cert("client.pem"), Cert("client.key"), ""};
  }

  // Whether PsClient (worker/client/ps_client.cc, not owned here) dials with
  // PsClientOptions::credentials: the worker's TLS depends on it. Empty when
  // it does; otherwise why not.
  std::string PsClientTlsGap() {
    PsClientOptions options;
    options.hosts = cluster_->HostList();
    options.rpc_timeout = absl::Seconds(5);
    options.retry_window = absl::ZeroDuration();
    options.credentials = *MakeChannelCredentials(Good());
    options.auth_token = kToken;
    absl::StatusOr<std::unique_ptr<PsClient>> client =
        PsClient::Create(options);
    if (!client.ok()) return std::string(client.status().message());
    absl::StatusOr<std::vector<StatsResponse>> stats = (*client)->Stats();
    if (stats.ok() || !CallStats(Good(), kToken).ok()) return "";
    return absl::StrCat(
        "PsClient does not use PsClientOptions::credentials yet (its channels "
        "are made with grpc::InsecureChannelCredentials() in "
        "worker/client/ps_client.cc), so the worker cannot speak TLS: ",
        stats.status().message());
  }

  static std::string* certs_;
  static std::string* other_;
  static std::string* token_file_;
  int health_port_ = 0;
  std::unique_ptr<testing::TestCluster> cluster_;
};

std::string* TlsTest::certs_ = nullptr;
std::string* TlsTest::other_ = nullptr;
std::string* TlsTest::token_file_ = nullptr;

TEST_F(TlsTest, ClientsMissingAPieceAreRefused) {
  ASSERT_TRUE(CallStats(Good(), kToken).ok());

  struct Case {
    const char* what;
    ClientTlsFiles files;
    std::string token;
    grpc::StatusCode expected;
  };
  const std::vector<Case> cases = {
      {"plaintext", {}, kToken, grpc::StatusCode::UNAVAILABLE},
      {"no CA (system roots)",
       {"", Cert("client.pem"), Cert("client.key"), ""},
       kToken,
       grpc::StatusCode::UNAVAILABLE},
      {"another CA",
       {Other("ca.pem"), Cert("client.pem"), Cert("client.key"), ""},
       kToken,
       grpc::StatusCode::UNAVAILABLE},
      {"no client certificate (mTLS)",
       {Cert("ca.pem"), "", "", ""},
       kToken,
       grpc::StatusCode::UNAVAILABLE},
      {"client certificate of another CA",
       {Cert("ca.pem"), Other("client.pem"), Other("client.key"), ""},
       kToken,
       grpc::StatusCode::UNAVAILABLE},
      {"server name not in the certificate",
       {Cert("ca.pem"), Cert("client.pem"), Cert("client.key"),
        "wrong.example"},
       kToken,
       grpc::StatusCode::UNAVAILABLE},
      {"no token", Good(), "", grpc::StatusCode::UNAUTHENTICATED},
      {"wrong token", Good(), "not-the-token",
       grpc::StatusCode::UNAUTHENTICATED},
  };
  for (const Case& c : cases) {
    const grpc::Status status = CallStats(c.files, c.token);
    EXPECT_EQ(status.error_code(), c.expected)
        << c.what << ": " << status.error_message();
    // Whatever a client did, the server is still there for the others.
    EXPECT_TRUE(CallStats(Good(), kToken).ok()) << "after: " << c.what;
  }
  // --tls_server_name: dial an address, check the certificate for a name.
  ClientTlsFiles named = Good();
  named.server_name = "localhost";
  EXPECT_TRUE(CallStats(named, kToken).ok());
  // The certificate names localhost as well as 127.0.0.1.
  const std::string host = cluster_->HostList()[0];
  EXPECT_TRUE(
      CallStats(Good(), kToken, "localhost" + host.substr(host.rfind(':')))
          .ok());
  for (int shard = 0; shard < 2; ++shard) {
    EXPECT_TRUE(cluster_->server(shard).running());
  }
}

TEST_F(TlsTest, HealthPortStaysPlaintextForProbes) {
  // Kubernetes grpc probes cannot do TLS: the separate health port answers
  // in plaintext while the main port requires mutual TLS.
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", health_port_),
                          grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_F(TlsTest, WorkerWithoutTokenIsRefused) {
  if (const std::string gap = PsClientTlsGap(); !gap.empty()) {
    GTEST_SKIP() << gap;
  }
  std::vector<std::string> flags = {"--tls_ca=" + Cert("ca.pem"),
                                    "--tls_cert=" + Cert("client.pem"),
                                    "--tls_key=" + Cert("client.key"),
                                    "--connect_timeout_s=5",
                                    "--retry_window_s=5",
                                    "--steps=5"};
  absl::StatusOr<std::unique_ptr<testing::Process>> worker =
      cluster_->StartWorker(0, 1, flags);
  ASSERT_TRUE(worker.ok()) << worker.status();
  absl::StatusOr<int> code = (*worker)->Wait(absl::Seconds(60));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_NE(*code, 0);
  EXPECT_THAT((*worker)->Stderr(), HasSubstr("UNAUTHENTICATED"));
}

// A refused handshake is not a server still starting: the worker ends in
// seconds, not at --connect_timeout_s, with one line that names TLS, the
// shard and the likely cause (issue 30).
TEST_F(TlsTest, RefusedHandshakesEndTheWorkerFastNamingTheCause) {
  const std::string token = "--auth_token_file=" + *token_file_;
  struct Case {
    const char* what;
    std::vector<std::string> flags;
    const char* cause;
  };
  const std::vector<Case> cases = {
      {"no client certificate",
       {"--tls_ca=" + Cert("ca.pem"), token},
       "it wants a client certificate signed by its --tls_client_ca"},
      {"plaintext",
       {token},
       "the server does not answer plaintext gRPC; it likely expects TLS"},
      {"another CA",
       {"--tls_ca=" + Other("ca.pem"), "--tls_cert=" + Cert("client.pem"),
        "--tls_key=" + Cert("client.key"), token},
       "the server's certificate is not signed by the CA in --tls_ca"},
      {"a client certificate of another CA",
       {"--tls_ca=" + Cert("ca.pem"), "--tls_cert=" + Other("client.pem"),
        "--tls_key=" + Other("client.key"), token},
       "it wants a client certificate signed by its --tls_client_ca"},
      {"a server name the certificate lacks",
       {"--tls_ca=" + Cert("ca.pem"), "--tls_cert=" + Cert("client.pem"),
        "--tls_key=" + Cert("client.key"), "--tls_server_name=wrong.example",
        token},
       "does not name the address dialled"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> flags = c.flags;
    flags.insert(flags.end(), {"--connect_timeout_s=60", "--steps=5"});
    const absl::Time start = absl::Now();
    absl::StatusOr<std::unique_ptr<testing::Process>> worker =
        cluster_->StartWorker(0, 1, flags);
    ASSERT_TRUE(worker.ok()) << worker.status();
    absl::StatusOr<int> code = (*worker)->Wait(absl::Seconds(90));
    ASSERT_TRUE(code.ok()) << c.what << ": " << code.status();
    EXPECT_EQ(*code, 1) << c.what;
    // A few quick tries, then out: far from the 60 s connect timeout.
    EXPECT_LT(absl::Now() - start, absl::Seconds(15)) << c.what;
    const std::string err = (*worker)->Stderr();
    EXPECT_THAT(err,
                HasSubstr(c.flags.size() > 1 ? "TLS handshake with shard"
                                             : "plaintext gRPC with shard"))
        << c.what;
    EXPECT_THAT(err, HasSubstr(c.cause)) << c.what;
  }
  // The server refused three of the five itself (no certificate,
  // plaintext, a certificate of another CA), each tried more than once:
  // counted, and in its log.
  StatsResponse stats;
  EXPECT_TRUE(CallStats(Good(), kToken, "", &stats).ok());
  EXPECT_GE(stats.grpc_tls_refused(), 3) << stats.ShortDebugString();
  EXPECT_THAT(cluster_->server(0).Stderr(),
              HasSubstr("gRPC port: refused a TLS handshake"));
}

// deploy/grpc/grpc_check.py reaches the main port of a mutual-TLS server
// with a client certificate, and is refused without one.
TEST_F(TlsTest, GrpcCheckTakesAClientCertificate) {
  auto check = [&](const std::vector<std::string>& flags) -> int {
    std::vector<std::string> argv = {
        "/usr/bin/python3", testing::BinaryPath("deploy/grpc/grpc_check.py")};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back(cluster_->HostList()[0]);
    absl::StatusOr<std::unique_ptr<testing::Process>> process =
        testing::Process::Start(argv, testing::TestDir(), "grpc_check");
    EXPECT_TRUE(process.ok()) << process.status();
    if (!process.ok()) return -1;
    absl::StatusOr<int> code = (*process)->Wait(absl::Seconds(30));
    EXPECT_TRUE(code.ok()) << code.status();
    return code.value_or(-1);
  };
  EXPECT_EQ(
      check({"--tls_ca=" + Cert("ca.pem"), "--tls_cert=" + Cert("client.pem"),
             "--tls_key=" + Cert("client.key")}),
      0);
  EXPECT_EQ(check({"--tls_ca=" + Cert("ca.pem")}), 2);
}

TEST_F(TlsTest, MutualTlsJobTrainsEndToEnd) {
  if (const std::string gap = PsClientTlsGap(); !gap.empty()) {
    GTEST_SKIP() << gap;
  }
  std::vector<std::string> flags = WorkerTlsFlags();
  flags.insert(flags.end(),
               {"--model=softmax", "--steps=150", "--connect_timeout_s=20"});
  absl::StatusOr<std::vector<std::string>> outputs =
      cluster_->RunWorkers({flags}, absl::Seconds(120));
  ASSERT_TRUE(outputs.ok()) << outputs.status();
  absl::StatusOr<double> accuracy =
      testing::FinalJsonNumber((*outputs)[0], "test_accuracy");
  ASSERT_TRUE(accuracy.ok()) << accuracy.status();
  EXPECT_GE(*accuracy, 0.6);  // chance is 0.25
  EXPECT_TRUE(CallStats(Good(), kToken).ok());
}

// A replicated shard under TLS: the replicas call each other over TLS with
// their server certificates (gRPC and the data plane, where the step
// records go), a worker without TLS gets nowhere, and when the primary dies
// the backup carries the job to its end with every update there once.
TEST(ReplicatedTlsTest, ReplicasForwardOverTlsAndFailOverUnderIt) {
  const std::string certs = testing::TestDir() + "/replica_certs";
  MakeCerts(certs);
  const std::string token_file =
      WriteFile("replica_token", absl::StrCat(kToken, "\n"));
  constexpr int kSteps = 300;
  constexpr int64_t kElements = 1 << 14;
  testing::ClusterOptions options;
  options.num_shards = 1;
  options.num_workers = 2;
  options.replicas = 2;
  options.server_flags = {"--tls_cert=" + certs + "/server.pem",
                          "--tls_key=" + certs + "/server.key",
                          "--tls_client_ca=" + certs + "/ca.pem",
                          "--auth_token_file=" + token_file,
                          "--optimizer=sgd",
                          "--learning_rate=1",
                          "--worker_lease_s=5"};
  absl::StatusOr<std::unique_ptr<testing::TestCluster>> started =
      testing::TestCluster::Start(options, "replicated_tls");
  ASSERT_TRUE(started.ok()) << started.status();
  testing::TestCluster& cluster = **started;
  const std::vector<std::string> replicas =
      absl::StrSplit(cluster.HostList()[0], '|');
  ASSERT_EQ(replicas.size(), 2u);
  auto stats_of = [&](int replica) -> absl::StatusOr<StatsResponse> {
    auto stub = ParameterServer::NewStub(grpc::CreateChannel(
        replicas[replica],
        *MakeChannelCredentials({certs + "/ca.pem", certs + "/client.pem",
                                 certs + "/client.key", ""})));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(5));
    context.AddMetadata("authorization", absl::StrCat("Bearer ", kToken));
    StatsResponse response;
    const grpc::Status status =
        stub->Stats(&context, StatsRequest(), &response);
    if (!status.ok()) return absl::UnavailableError(status.error_message());
    return response;
  };
  std::vector<std::unique_ptr<testing::Process>> workers;
  for (int k = 0; k < 2; ++k) {
    absl::StatusOr<std::unique_ptr<testing::Process>> worker =
        cluster.StartWorker(
            k, 2,
            {"--tls_ca=" + certs + "/ca.pem",
             "--tls_cert=" + certs + "/client.pem",
             "--tls_key=" + certs + "/client.key",
             "--auth_token_file=" + token_file, "--model=probe",
             absl::StrCat("--probe_elements=", kElements),
             "--block_elements=4096", absl::StrCat("--steps=", kSteps),
             "--log_every=0", "--device=cpu", "--heartbeat_interval_s=0.2",
             "--retry_window_s=60", "--rpc_timeout_s=30",
             "--inject_step_delay_ms=5"});
    ASSERT_TRUE(worker.ok()) << worker.status();
    workers.push_back(std::move(*worker));
  }
  // A third of the way in, the backup follows over TLS.
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  absl::StatusOr<StatsResponse> primary;
  do {
    primary = stats_of(0);
  } while ((!primary.ok() || primary->version() < kSteps / 3) &&
           absl::Now() < give_up);
  ASSERT_TRUE(primary.ok()) << primary.status();
  ASSERT_GE(primary->version(), kSteps / 3);
  absl::StatusOr<StatsResponse> backup = stats_of(1);
  ASSERT_TRUE(backup.ok()) << backup.status();
  EXPECT_EQ(backup->replica_role(), "backup");
  EXPECT_GE(backup->version(), kSteps / 3 - 1);
  // The primary's data-plane links to it (its step records) are TLS.
  EXPECT_GT(backup->data_plane_ktls_connections() +
                backup->data_plane_user_tls_connections(),
            0);
  cluster.KillReplica(0, 0);
  for (auto& worker : workers) {
    absl::StatusOr<int> code = worker->Wait(absl::Seconds(120));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0) << worker->Stderr();
  }
  absl::StatusOr<StatsResponse> last = stats_of(1);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->replica_role(), "primary");
  EXPECT_EQ(last->version(), kSteps);
  EXPECT_EQ(last->updates_lost(), 0);
  EXPECT_EQ(last->steps_lost(), 0);
}

// --replica_tls_ca without TLS, replicated TLS with no CA to check the other
// replicas by, or a certificate they cannot present to each other: one
// line, exit 2.
TEST(ReplicatedTlsTest, ReplicasUnderTlsNeedACaForEachOther) {
  const std::string certs = testing::TestDir() + "/replica_flag_certs";
  MakeCerts(certs);
  // A server certificate for servers only (as make_certs.sh made them
  // before replicas spoke TLS): a replica cannot present it to the others.
  absl::StatusOr<std::unique_ptr<testing::Process>> openssl =
      testing::Process::Start(
          {"/usr/bin/openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
           "ec_paramgen_curve:P-256", "-nodes", "-keyout",
           certs + "/server_only.key", "-out", certs + "/server_only.pem",
           "-subj", "/CN=localhost", "-days", "1", "-addext",
           "extendedKeyUsage=serverAuth"},
          testing::TestDir(), "openssl_server_only");
  ASSERT_TRUE(openssl.ok()) << openssl.status();
  ASSERT_EQ((*openssl)->Wait(absl::Seconds(30)).value_or(-1), 0)
      << (*openssl)->Stderr();
  for (const auto& [flags, expected] :
       std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--tls_cert=" + certs + "/server_only.pem",
             "--tls_key=" + certs + "/server_only.key",
             "--tls_client_ca=" + certs + "/ca.pem"},
            "is not good for client authentication"},
           {{"--tls_cert=" + certs + "/server.pem",
             "--tls_key=" + certs + "/server.key"},
            "--replicas > 1 with --tls_cert needs --replica_tls_ca"},
           {{"--replica_tls_ca=" + certs + "/ca.pem"},
            "--replica_tls_ca needs --tls_cert"}}) {
    std::vector<std::string> argv = {
        testing::BinaryPath("ps_server/ps_server"), "--port=0", "--replicas=2",
        "--replica_index=0", "--replica_hosts=127.0.0.1:1,127.0.0.1:2"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    ExpectOneLineAndExit2(argv, expected);
  }
}

TEST(TlsFlagsTest, BadTlsFlagIsOneLineAndExit2) {
  for (const auto& [binary, flags, expected] : std::vector<
           std::tuple<std::string, std::vector<std::string>, std::string>>{
           {"ps_server/ps_server",
            {"--tls_cert=/nonexistent.pem", "--tls_key=/nonexistent.key"},
            "--tls_cert=/nonexistent.pem: cannot read"},
           {"ps_server/ps_server",
            {"--tls_client_ca=/x.pem"},
            "--tls_client_ca needs --tls_cert"},
           {"worker/worker",
            {"--ps_hosts=a:1", "--tls_cert=/c.pem"},
            "--tls_cert and --tls_key must be given together"},
           {"worker/worker",
            {"--ps_hosts=a:1", "--auth_token_file=/nonexistent"},
            "--auth_token_file=/nonexistent: cannot read"}}) {
    std::vector<std::string> argv = {testing::BinaryPath(binary)};
    argv.insert(argv.end(), flags.begin(), flags.end());
    ExpectOneLineAndExit2(argv, expected);
  }
}

}  // namespace
}  // namespace pstrain
