// The tensor data plane inside TLS (common/transport/tls_stream.h), against
// real ps_server and worker processes with certificates from
// deploy/tls/make_certs.sh:
//  - a sync MLP job over the TLS data plane ends with exactly the model of
//    the same job in plaintext, and its tensors did take the data plane;
//    so does one whose records the kernel seals (kernel TLS), where the
//    kernel can (//tests:kernel_tls_vm_test runs it under one that can);
//  - every bad input (a plaintext client on the TLS port, a TLS client on a
//    plaintext port, no, expired or wrongly signed certificates either way,
//    a stalled handshake, garbage after the handshake, a wrong token) is
//    refused or closed, logged with the peer's address, and applies
//    nothing;
//  - mixed versions: a client without data-plane TLS and a server that
//    announces no TLS data port both still train, over gRPC.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/protocol.h"
#include "common/transport/data_plane.h"
#include "common/transport/socket.h"
#include "common/transport/tls.h"
#include "common/transport/tls_stream.h"
#include "gtest/gtest.h"
#include "proto/ps.grpc.pb.h"
#include "tests/test_cluster.h"
#include "worker/client/ps_client.h"

namespace pstrain {
namespace {

using data_plane::Method;
using testing::ClusterOptions;
using testing::TestCluster;

constexpr char kToken[] = "tls-data-plane-token";
constexpr int kElements = 8;

void MakeCerts(const std::string& dir) {
  const absl::Status made = testing::MakeTestCerts(dir);
  ASSERT_TRUE(made.ok()) << made;
}

// A client certificate and key signed by the CA in `ca_dir` (ca.pem,
// ca.key) whose validity ended a day ago: make_certs.sh cannot date one
// in the past.
void MakeExpiredClientCert(const std::string& ca_dir, const std::string& pem,
                           const std::string& key_path) {
  FILE* f = std::fopen((ca_dir + "/ca.pem").c_str(), "r");
  ASSERT_NE(f, nullptr);
  X509* ca = PEM_read_X509(f, nullptr, nullptr, nullptr);
  std::fclose(f);
  f = std::fopen((ca_dir + "/ca.key").c_str(), "r");
  ASSERT_NE(f, nullptr);
  EVP_PKEY* ca_key = PEM_read_PrivateKey(f, nullptr, nullptr, nullptr);
  std::fclose(f);
  ASSERT_NE(ca, nullptr);
  ASSERT_NE(ca_key, nullptr);
  EVP_PKEY* key = EVP_EC_gen("P-256");
  ASSERT_NE(key, nullptr);
  X509* cert = X509_new();
  X509_set_version(cert, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(cert), 4242);
  X509_gmtime_adj(X509_getm_notBefore(cert), -2 * 86400);
  X509_gmtime_adj(X509_getm_notAfter(cert), -86400);
  X509_set_pubkey(cert, key);
  X509_NAME_add_entry_by_txt(X509_get_subject_name(cert), "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>("expired"),
                             -1, -1, 0);
  X509_set_issuer_name(cert, X509_get_subject_name(ca));
  ASSERT_GT(X509_sign(cert, ca_key, EVP_sha256()), 0);
  f = std::fopen(pem.c_str(), "w");
  PEM_write_X509(f, cert);
  std::fclose(f);
  f = std::fopen(key_path.c_str(), "w");
  PEM_write_PrivateKey(f, key, nullptr, nullptr, 0, nullptr, nullptr);
  std::fclose(f);
  X509_free(cert);
  X509_free(ca);
  EVP_PKEY_free(key);
  EVP_PKEY_free(ca_key);
}

// "w": 8 elements of 1.5, in blocks of 4.
ModelSchema Schema() {
  ModelSchema schema;
  schema.set_seed(5);
  schema.set_block_elements(4);
  DenseTensorSpec* w = schema.add_dense();
  w->set_name("w");
  w->add_shape(kElements);
  w->mutable_init()->set_kind(InitSpec::CONSTANT);
  w->mutable_init()->set_value(1.5f);
  return schema;
}

// "127.0.0.1:port" of a connected socket's own end: what the server logs
// as its peer.
std::string LocalName(int fd) {
  sockaddr_in address = {};
  socklen_t bytes = sizeof(address);
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &bytes);
  return absl::StrCat("127.0.0.1:", ntohs(address.sin_port));
}

std::string Request(Method method, absl::string_view body) {
  char header[data_plane::kRequestHeaderBytes];
  data_plane::EncodeRequestHeader({method, 10000, body.size()}, header);
  return absl::StrCat(absl::string_view(header, sizeof(header)), body);
}

struct Answer {
  absl::StatusCode code;
  std::string body;
};

// One connection to a data port, plaintext or TLS; every read is bounded
// by SO_RCVTIMEO.
class Connection {
 public:
  explicit Connection(int port) {
    absl::StatusOr<ScopedFd> fd =
        ConnectTcp("127.0.0.1", port, 0, absl::Now() + absl::Seconds(10));
    EXPECT_TRUE(fd.ok()) << fd.status();
    if (fd.ok()) fd_ = std::move(*fd);
    TuneSocket(fd_.get(), 0, absl::Seconds(20)).IgnoreError();
    local_ = LocalName(fd_.get());
  }
  // The handshake as a client with `files`.
  absl::Status StartTls(const ClientTlsFiles& files) {
    absl::StatusOr<std::shared_ptr<const TlsContext>> context =
        TlsContext::ForClient(files, /*ktls=*/false);
    if (!context.ok()) return context.status();
    absl::StatusOr<std::unique_ptr<TlsSession>> session =
        TlsSession::Connect(*context, fd_.get(), "127.0.0.1", "server",
                            absl::Now() + absl::Seconds(10));
    if (!session.ok()) return session.status();
    tls_ = std::move(*session);
    return absl::OkStatus();
  }
  absl::Status Send(absl::string_view bytes) {
    if (tls_ != nullptr) return tls_->WriteAll({bytes});
    return SendAll(fd_.get(), bytes.data(), bytes.size());
  }
  // Raw bytes under the TLS layer.
  absl::Status SendRaw(absl::string_view bytes) {
    return SendAll(fd_.get(), bytes.data(), bytes.size());
  }
  absl::Status ReadExactly(char* data, size_t size) {
    if (tls_ == nullptr) return RecvAll(fd_.get(), data, size);
    return tls_->ReadAll(data, size);
  }
  absl::StatusOr<Answer> Read() {
    char header[data_plane::kResponseHeaderBytes];
    if (absl::Status s = ReadExactly(header, sizeof(header)); !s.ok()) {
      return s;
    }
    absl::StatusOr<data_plane::ResponseHeader> decoded =
        data_plane::DecodeResponseHeader(header, 1 << 20);
    if (!decoded.ok()) return decoded.status();
    Answer answer{decoded->code, std::string(decoded->body_bytes, '\0')};
    if (absl::Status s = ReadExactly(answer.body.data(), answer.body.size());
        !s.ok()) {
      return s;
    }
    return answer;
  }
  // The server closed (or reset) the connection: a read ends without a
  // byte, at the TLS layer or below.
  bool Closed() {
    char byte;
    if (tls_ != nullptr) {
      short want;
      absl::StatusOr<size_t> got = tls_->Read(&byte, 1, &want);
      return !got.ok();
    }
    const ssize_t got = recv(fd_.get(), &byte, 1, 0);
    return got == 0 || (got < 0 && errno == ECONNRESET);
  }
  const std::string& local() const { return local_; }

 private:
  ScopedFd fd_;
  std::unique_ptr<TlsSession> tls_;
  std::string local_;
};

// Waits (bounded) until `process`'s log holds `text`: the server writes its
// line after the client already saw the connection end.
bool LogShows(testing::Process& process, const std::string& text) {
  const absl::Time deadline = absl::Now() + absl::Seconds(15);
  while (absl::Now() < deadline) {
    if (absl::StrContains(process.Stderr(), text)) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return false;
}

// What carries the tensors of a job: plaintext, TLS with records sealed in
// user space by OpenSSL, or TLS asked to hand its records to the kernel.
enum class Transport { kPlaintext, kTls, kKernelTls };

class TlsDataPlaneTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    certs_ = new std::string(testing::TestDir() + "/certs");
    other_ = new std::string(testing::TestDir() + "/other_ca");
    MakeCerts(*certs_);
    MakeCerts(*other_);
    MakeExpiredClientCert(*certs_, Cert("expired.pem"), Cert("expired.key"));
    token_file_ = new std::string(testing::TestDir() + "/token");
    std::ofstream(*token_file_) << kToken << "\n";
  }

  static std::string Cert(const std::string& name) {
    return *certs_ + "/" + name;
  }
  static std::string Other(const std::string& name) {
    return *other_ + "/" + name;
  }
  static ClientTlsFiles Good() {
    return {Cert("ca.pem"), Cert("client.pem"), Cert("client.key"), ""};
  }
  static std::vector<std::string> ServerTlsFlags() {
    return {"--tls_cert=" + Cert("server.pem"),
            "--tls_key=" + Cert("server.key"),
            "--tls_client_ca=" + Cert("ca.pem"),
            "--auth_token_file=" + *token_file_};
  }
  static std::vector<std::string> WorkerTlsFlags() {
    return {"--tls_ca=" + Cert("ca.pem"), "--tls_cert=" + Cert("client.pem"),
            "--tls_key=" + Cert("client.key"),
            "--auth_token_file=" + *token_file_};
  }

  static std::unique_ptr<TestCluster> Start(const std::string& name,
                                            ClusterOptions options) {
    absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
        TestCluster::Start(options, name);
    EXPECT_TRUE(cluster.ok()) << cluster.status();
    return cluster.ok() ? std::move(*cluster) : nullptr;
  }
  // One shard, async SGD at 0.5: a push of ones takes "w" from 1.5 to 1.
  static std::unique_ptr<TestCluster> StartSmall(
      const std::string& name, bool tls, std::vector<std::string> extra = {}) {
    ClusterOptions options;
    options.mode = "async";
    options.server_flags = {"--optimizer=sgd", "--learning_rate=0.5",
                            "--data_plane_handshake_s=2"};
    if (tls) {
      for (const std::string& flag : ServerTlsFlags()) {
        options.server_flags.push_back(flag);
      }
    }
    options.server_flags.insert(options.server_flags.end(), extra.begin(),
                                extra.end());
    return Start(name, options);
  }

  // A PsClient with the TLS files (and the data plane's TLS unless
  // `old_client`: a client from before TLS on the data plane).
  static std::unique_ptr<PsClient> Client(const TestCluster& cluster,
                                          bool old_client = false) {
    PsClientOptions options;
    options.hosts = cluster.HostList();
    options.heartbeat_interval = absl::ZeroDuration();
    options.retry_window = absl::Seconds(30);
    options.rpc_timeout = absl::Seconds(30);
    options.credentials = *MakeChannelCredentials(Good());
    if (!old_client) {
      options.data_plane_tls = *TlsContext::ForClient(Good(), false);
    }
    options.auth_token = kToken;
    absl::StatusOr<std::unique_ptr<PsClient>> client =
        PsClient::Create(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::move(*client) : nullptr;
  }
  static std::unique_ptr<PsClient> Join(const TestCluster& cluster,
                                        bool old_client = false) {
    std::unique_ptr<PsClient> client = Client(cluster, old_client);
    if (client == nullptr) return nullptr;
    absl::StatusOr<Registration> registered = client->Register(Schema(), 1, 0);
    EXPECT_TRUE(registered.ok()) << registered.status();
    return registered.ok() ? std::move(client) : nullptr;
  }

  static absl::StatusOr<std::vector<float>> PushOnesAndPull(PsClient& client,
                                                            int64_t step) {
    const std::vector<float> ones(kElements, 1.0f);
    if (auto pushed = client.Push(step, {ones.data()}); !pushed.ok()) {
      return pushed.status();
    }
    std::vector<float> model(kElements, -1.0f);
    if (auto pulled = client.Pull(step + 1, {model.data()}); !pulled.ok()) {
      return pulled.status();
    }
    return model;
  }

  // What shard 0 announces at registration, asked over gRPC (with TLS and
  // the token when `tls`).
  static RegisterModelResponse Announcement(const TestCluster& cluster,
                                            bool tls) {
    auto stub = ParameterServer::NewStub(grpc::CreateChannel(
        cluster.HostList()[0], tls ? *MakeChannelCredentials(Good())
                                   : grpc::InsecureChannelCredentials()));
    RegisterModelRequest request;
    request.set_protocol_version(kProtocolVersion);
    *request.mutable_schema() = Schema();
    request.set_num_shards(1);
    request.set_num_workers(1);
    request.set_worker_id(-1);
    RegisterModelResponse response;
    grpc::ClientContext context;
    if (tls)
      context.AddMetadata("authorization", absl::StrCat("Bearer ", kToken));
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(30));
    const grpc::Status status =
        stub->RegisterModel(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }

  static std::vector<std::vector<float>> TrainSyncMlp(
      Transport transport, const std::vector<std::string>& model_flags = {});

  static std::string* certs_;
  static std::string* other_;
  static std::string* token_file_;
};

std::string* TlsDataPlaneTest::certs_ = nullptr;
std::string* TlsDataPlaneTest::other_ = nullptr;
std::string* TlsDataPlaneTest::token_file_ = nullptr;

// The final model of a finished job, bit for bit, pulled by an observer.
std::vector<std::vector<float>> FinalModel(PsClient& observer) {
  absl::StatusOr<std::vector<StatsResponse>> stats = observer.Stats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  if (!stats.ok()) return {};
  int64_t step = (*stats)[0].version();
  for (const StatsResponse& shard : *stats) {
    step = std::min(step, shard.version());
  }
  const ModelSchema schema = (*stats)[0].schema();
  EXPECT_TRUE(
      observer.Register(schema, (*stats)[0].num_workers(), /*worker_id=*/-1)
          .ok());
  std::vector<std::vector<float>> model;
  std::vector<float*> tensors;
  for (const DenseTensorSpec& spec : schema.dense()) {
    int64_t elements = 1;
    for (int64_t d : spec.shape()) elements *= d;
    model.emplace_back(elements);
  }
  for (auto& t : model) tensors.push_back(t.data());
  absl::StatusOr<int64_t> pulled = observer.Pull(step, tensors);
  EXPECT_TRUE(pulled.ok()) << pulled.status();
  return model;
}

// A 2-shard, 2-worker sync MLP job over `transport` (`model_flags` change
// the model's size and blocks); its final model, bit for bit. With TLS, also
// checks that the tensors took the TLS data plane on both shards with the
// record layer asked for.
std::vector<std::vector<float>> TlsDataPlaneTest::TrainSyncMlp(
    Transport transport, const std::vector<std::string>& model_flags) {
  const bool tls = transport != Transport::kPlaintext;
  const bool kernel = transport == Transport::kKernelTls;
  std::vector<std::string> job = {"--model=mlp",
                                  "--hidden=128",
                                  "--num_features=48",
                                  "--num_classes=4",
                                  "--train_examples=512",
                                  "--test_examples=64",
                                  "--block_elements=2048",
                                  "--seed=7",
                                  "--steps=25",
                                  "--global_batch_size=32",
                                  "--log_every=0",
                                  "--device=cpu",
                                  "--connect_timeout_s=30"};
  job.insert(job.end(), model_flags.begin(), model_flags.end());
  ClusterOptions options;
  options.num_shards = 2;
  options.num_workers = 2;
  if (tls) options.server_flags = ServerTlsFlags();
  options.server_flags.push_back("--learning_rate=0.1");
  if (tls) {
    for (const std::string& flag : WorkerTlsFlags()) job.push_back(flag);
  }
  if (kernel) {
    options.server_flags.push_back("--data_plane_ktls");
    job.push_back("--data_plane_ktls");
  }
  std::unique_ptr<TestCluster> cluster = Start(kernel ? "sync_ktls"
                                               : tls  ? "sync_tls"
                                                      : "sync_plain",
                                               options);
  EXPECT_NE(cluster, nullptr);
  if (cluster == nullptr) return {};
  // Generous: under tests/vm's emulated CPU the job runs ~10x slower.
  absl::StatusOr<std::vector<std::string>> outputs =
      cluster->RunWorkers({job, job}, absl::Seconds(300));
  EXPECT_TRUE(outputs.ok()) << outputs.status();
  if (!outputs.ok()) return {};
  std::unique_ptr<PsClient> observer;
  if (tls) {
    observer = Client(*cluster);
  } else {
    PsClientOptions plain;
    plain.hosts = cluster->HostList();
    plain.heartbeat_interval = absl::ZeroDuration();
    observer = std::move(*PsClient::Create(plain));
  }
  EXPECT_NE(observer, nullptr);
  if (observer == nullptr) return {};
  if (tls) {
    // The tensors took the TLS data plane on both shards, and its record
    // layer is reported.
    absl::StatusOr<std::vector<StatsResponse>> stats = observer->Stats();
    EXPECT_TRUE(stats.ok()) << stats.status();
    if (!stats.ok()) return {};
    for (const StatsResponse& shard : *stats) {
      EXPECT_TRUE(shard.data_port_tls());
      EXPECT_GT(shard.data_plane_requests(), 25);
      EXPECT_EQ(shard.data_plane_tls_refused(), 0);
      if (kernel) {
        // Every worker connection's records went to the kernel (the
        // observer's own connection asked for user space).
        EXPECT_GE(shard.data_plane_ktls_connections(), 2);
      } else {
        EXPECT_GT(shard.data_plane_user_tls_connections(), 0);
        EXPECT_EQ(shard.data_plane_ktls_connections(), 0);
      }
    }
    EXPECT_TRUE(LogShows(
        cluster->server(0),
        kernel ? "kernel TLS send" : "data plane: TLS connection from"));
  }
  return FinalModel(*observer);
}

void ExpectSameModel(const std::vector<std::vector<float>>& a,
                     const std::vector<std::vector<float>>& b) {
  ASSERT_EQ(a.size(), b.size());
  ASSERT_FALSE(a.empty());
  for (size_t t = 0; t < a.size(); ++t) {
    ASSERT_EQ(a[t].size(), b[t].size());
    EXPECT_EQ(
        std::memcmp(a[t].data(), b[t].data(), a[t].size() * sizeof(float)), 0)
        << "tensor " << t << " differs";
  }
}

TEST_F(TlsDataPlaneTest, SyncMlpOverTheTlsDataPlaneEqualsThePlaintextJob) {
  ExpectSameModel(TrainSyncMlp(Transport::kPlaintext),
                  TrainSyncMlp(Transport::kTls));
}

// Runs where the kernel can take TLS records (the `tls` module, and the
// AES-GCM it asks the crypto API for): on this project's VMs, under Debian's
// own kernel through //tests:kernel_tls_vm_test. OpenSSL 3.0 hands TLS 1.3
// records to the kernel on the sending side only, so that is what is
// checked; each end still reads in user space.
TEST_F(TlsDataPlaneTest, SyncMlpOverKernelTlsEqualsThePlaintextJob) {
  const std::string unavailable = KernelTlsUnavailableReason();
  if (!unavailable.empty()) {
    GTEST_SKIP() << "kernel TLS unavailable here: " << unavailable
                 << " (//tests:kernel_tls_vm_test runs this test under a "
                    "kernel that has it)";
  }
  // Blocks of 256 KiB: each answer is many records for the kernel to seal,
  // not one small write.
  const std::vector<std::string> larger = {"--num_features=784", "--hidden=256",
                                           "--block_elements=65536"};
  ExpectSameModel(TrainSyncMlp(Transport::kPlaintext, larger),
                  TrainSyncMlp(Transport::kKernelTls, larger));
}

TEST_F(TlsDataPlaneTest, BadInputIsRefusedNamingThePeerAndAppliesNothing) {
  std::unique_ptr<TestCluster> cluster = StartSmall("bad_input", true);
  ASSERT_NE(cluster, nullptr);
  std::unique_ptr<PsClient> client = Join(*cluster);
  ASSERT_NE(client, nullptr);
  absl::StatusOr<std::vector<float>> model = PushOnesAndPull(*client, 0);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(*model, std::vector<float>(kElements, 1.0f));
  const RegisterModelResponse announced = Announcement(*cluster, true);
  ASSERT_TRUE(announced.data_port_tls());
  const int port = announced.data_port();
  ASSERT_GT(port, 0);
  absl::StatusOr<std::vector<StatsResponse>> before = client->Stats();
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_GT((*before)[0].data_plane_requests(), 0);
  testing::Process& server = cluster->server(0);
  const std::string refused = "data plane: refused the TLS handshake of ";
  const std::string hello = Request(Method::kHello, kToken);

  {  // A plaintext data-plane client: told in its own framing, closed.
    Connection c(port);
    ASSERT_TRUE(c.Send(hello).ok());
    absl::StatusOr<Answer> answer = c.Read();
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(answer->code, absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(absl::StrContains(answer->body, "speaks TLS")) << answer->body;
    EXPECT_TRUE(c.Closed());
    EXPECT_TRUE(
        LogShows(server, "refused a plaintext client from " + c.local()))
        << server.Stderr();
  }
  // Certificates the server's --tls_client_ca rule refuses. TLS 1.3 ends
  // the client's handshake before the server has checked its certificate,
  // so the refusal may come at the first read instead.
  struct CertCase {
    const char* what;
    ClientTlsFiles files;
    const char* server_says;
  };
  const std::vector<CertCase> cert_cases = {
      {"no client certificate",
       {Cert("ca.pem"), "", "", ""},
       "did not return a certificate"},
      {"a client certificate of another CA",
       {Cert("ca.pem"), Other("client.pem"), Other("client.key"), ""},
       "certificate verify failed"},
      {"an expired client certificate",
       {Cert("ca.pem"), Cert("expired.pem"), Cert("expired.key"), ""},
       "certificate has expired"},
  };
  for (const CertCase& c : cert_cases) {
    Connection connection(port);
    absl::Status status = connection.StartTls(c.files);
    if (status.ok()) status = connection.Send(hello);
    if (status.ok()) status = connection.Read().status();
    EXPECT_FALSE(status.ok()) << c.what;
    EXPECT_TRUE(LogShows(server, refused + connection.local())) << c.what;
    EXPECT_TRUE(LogShows(server, c.server_says)) << c.what;
  }
  {  // The server's certificate is not signed by the CA this client trusts.
    Connection c(port);
    const absl::Status status = c.StartTls(
        {Other("ca.pem"), Cert("client.pem"), Cert("client.key"), ""});
    EXPECT_TRUE(absl::IsUnavailable(status)) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), "certificate")) << status;
    EXPECT_TRUE(LogShows(server, refused + c.local()));
  }
  {  // A handshake that stalls: closed at --data_plane_handshake_s (2 s).
    Connection c(port);
    const absl::Time start = absl::Now();
    EXPECT_TRUE(c.Closed());
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    EXPECT_TRUE(LogShows(server, refused + c.local()));
    EXPECT_TRUE(LogShows(server, "not finished by its deadline"));
  }
  {  // Garbage inside TLS after the handshake: "bad magic", closed.
    Connection c(port);
    ASSERT_TRUE(c.StartTls(Good()).ok());
    ASSERT_TRUE(c.Send("GET / HTTP/1.1\r\nHost: x\r\n\r\n").ok());
    absl::StatusOr<Answer> answer = c.Read();
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(answer->code, absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(answer->body, "bad magic")) << answer->body;
    EXPECT_TRUE(c.Closed());
    EXPECT_TRUE(LogShows(server, "closed the connection from " + c.local()));
  }
  {  // Garbage under TLS after the handshake (not a record): closed.
    Connection c(port);
    ASSERT_TRUE(c.StartTls(Good()).ok());
    ASSERT_TRUE(c.SendRaw(std::string(64, '\x17')).ok());
    EXPECT_TRUE(c.Closed());
    EXPECT_TRUE(LogShows(server, "closed the connection from " + c.local()));
  }
  {  // The right certificate and a wrong token: UNAUTHENTICATED, closed.
    Connection c(port);
    ASSERT_TRUE(c.StartTls(Good()).ok());
    ASSERT_TRUE(c.Send(Request(Method::kHello, "guess")).ok());
    absl::StatusOr<Answer> answer = c.Read();
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(answer->code, absl::StatusCode::kUnauthenticated);
    EXPECT_TRUE(c.Closed());
  }

  absl::StatusOr<std::vector<StatsResponse>> after = client->Stats();
  ASSERT_TRUE(after.ok()) << after.status();
  // Refused before a frame: plaintext, three client certificates, the
  // client that distrusts the server, the stalled handshake.
  EXPECT_EQ((*after)[0].data_plane_tls_refused() -
                (*before)[0].data_plane_tls_refused(),
            6);
  // Refused frames: the garbage request and the wrong token.
  EXPECT_EQ((*after)[0].requests_rejected() - (*before)[0].requests_rejected(),
            2);
  // Nothing applied: the model is where the good client left it.
  EXPECT_EQ((*after)[0].version(), (*before)[0].version());
  std::vector<float> now(kElements, -1.0f);
  ASSERT_TRUE(client->Pull(1, {now.data()}).ok());
  EXPECT_EQ(now, std::vector<float>(kElements, 1.0f));
  EXPECT_TRUE(server.running());
}

TEST_F(TlsDataPlaneTest, ATlsClientOnAPlaintextDataPortIsRefusedByName) {
  std::unique_ptr<TestCluster> cluster = StartSmall("tls_on_plain", false);
  ASSERT_NE(cluster, nullptr);
  const RegisterModelResponse announced = Announcement(*cluster, false);
  EXPECT_FALSE(announced.data_port_tls());
  ASSERT_GT(announced.data_port(), 0);
  Connection c(announced.data_port());
  const absl::Status status = c.StartTls(Good());
  EXPECT_FALSE(status.ok());
  EXPECT_TRUE(LogShows(cluster->server(0),
                       "closed the connection from " + c.local() +
                           ": INVALID_ARGUMENT: not a data-plane request (bad "
                           "magic): a TLS client on a plaintext data port"))
      << cluster->server(0).Stderr();
  EXPECT_TRUE(cluster->server(0).running());
}

// A client from before TLS on the data plane (credentials, no data-plane
// TLS) against a new server: its tensors go over gRPC, as before.
TEST_F(TlsDataPlaneTest, AnOldClientTrainsOverGrpcWithANewServer) {
  std::unique_ptr<TestCluster> cluster = StartSmall("old_client", true);
  ASSERT_NE(cluster, nullptr);
  std::unique_ptr<PsClient> client = Join(*cluster, /*old_client=*/true);
  ASSERT_NE(client, nullptr);
  absl::StatusOr<std::vector<float>> model = PushOnesAndPull(*client, 0);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(*model, std::vector<float>(kElements, 1.0f));
  absl::StatusOr<std::vector<StatsResponse>> stats = client->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_TRUE((*stats)[0].data_port_tls());
  EXPECT_EQ((*stats)[0].data_plane_requests(), 0);
  EXPECT_EQ((*stats)[0].data_plane_tls_refused(), 0);
}

// A new client against a server that offers no TLS data port (servers from
// before it announce none when they have TLS): gRPC, and it trains.
TEST_F(TlsDataPlaneTest, ANewClientTrainsOverGrpcWithAnOldServer) {
  std::unique_ptr<TestCluster> cluster =
      StartSmall("old_server", true, {"--data_port=-1"});
  ASSERT_NE(cluster, nullptr);
  std::unique_ptr<PsClient> client = Join(*cluster);
  ASSERT_NE(client, nullptr);
  absl::StatusOr<std::vector<float>> model = PushOnesAndPull(*client, 0);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(*model, std::vector<float>(kElements, 1.0f));
  absl::StatusOr<std::vector<StatsResponse>> stats = client->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_FALSE((*stats)[0].data_port_tls());
  EXPECT_EQ((*stats)[0].data_plane_requests(), 0);
}

// The same client against a new TLS server does take the data plane: the
// two tests above pass for the right reason.
TEST_F(TlsDataPlaneTest, ANewClientTakesTheTlsDataPlaneOfANewServer) {
  std::unique_ptr<TestCluster> cluster = StartSmall("new_both", true);
  ASSERT_NE(cluster, nullptr);
  std::unique_ptr<PsClient> client = Join(*cluster);
  ASSERT_NE(client, nullptr);
  absl::StatusOr<std::vector<float>> model = PushOnesAndPull(*client, 0);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(*model, std::vector<float>(kElements, 1.0f));
  // PushPull, one round trip, on the TLS data plane.
  const std::vector<float> ones(kElements, 1.0f);
  std::vector<float> pulled(kElements, -1.0f);
  ASSERT_TRUE(client->PushPull(1, {ones.data()}, 2, {pulled.data()}).ok());
  EXPECT_EQ(pulled, std::vector<float>(kElements, 0.5f));
  absl::StatusOr<std::vector<StatsResponse>> stats = client->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  // Push and pull of two blocks each, twice.
  EXPECT_EQ((*stats)[0].data_plane_requests(), 8);
}

}  // namespace
}  // namespace pstrain
