// The tensor data plane against real ps_server processes: pushes and pulls
// (and PushPull, both in one round trip) take it when the server offers it
// and give the same model as gRPC; bad
// bytes on the data port are refused by name without harming the server; a
// worker follows a restarted server to its new data port.
//
// The model is one tensor "w" of 8 elements, CONSTANT 1.5, in blocks of 4,
// trained with SGD at learning rate 0.5 on gradients of 1, so every expected
// value is exact.
#include "common/transport/data_plane.h"

#include <grpcpp/grpcpp.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/protocol.h"
#include "common/transport/socket.h"
#include "gtest/gtest.h"
#include "proto/ps.grpc.pb.h"
#include "tests/test_cluster.h"
#include "worker/client/ps_client.h"

namespace pstrain {
namespace {

using data_plane::Method;
using testing::ClusterOptions;
using testing::TestCluster;

constexpr int kElements = 8;

// "w": `elements` of 1.5, in blocks of `block_elements`.
ModelSchema Schema(int elements = kElements, int block_elements = 4) {
  ModelSchema schema;
  schema.set_seed(5);
  schema.set_block_elements(block_elements);
  DenseTensorSpec* w = schema.add_dense();
  w->set_name("w");
  w->add_shape(elements);
  w->mutable_init()->set_kind(InitSpec::CONSTANT);
  w->mutable_init()->set_value(1.5f);
  return schema;
}

std::unique_ptr<TestCluster> StartCluster(
    const std::string& name, std::vector<std::string> extra_flags = {}) {
  ClusterOptions options;
  options.mode = "async";
  options.server_flags = {"--optimizer=sgd", "--learning_rate=0.5"};
  options.server_flags.insert(options.server_flags.end(), extra_flags.begin(),
                              extra_flags.end());
  absl::StatusOr<std::unique_ptr<TestCluster>> cluster =
      TestCluster::Start(options, name);
  EXPECT_TRUE(cluster.ok()) << cluster.status();
  return cluster.ok() ? std::move(*cluster) : nullptr;
}

std::unique_ptr<PsClient> Join(const TestCluster& cluster,
                               PsClientOptions options = {},
                               const ModelSchema& schema = Schema()) {
  options.hosts = cluster.HostList();
  options.heartbeat_interval = absl::ZeroDuration();
  options.retry_window = absl::Seconds(30);
  absl::StatusOr<std::unique_ptr<PsClient>> client = PsClient::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return nullptr;
  absl::StatusOr<Registration> registered =
      (*client)->Register(schema, /*num_workers=*/1, /*worker_id=*/0);
  EXPECT_TRUE(registered.ok()) << registered.status();
  return std::move(*client);
}

// Pushes a gradient of ones as `step` and pulls the model back.
absl::StatusOr<std::vector<float>> PushOnesAndPull(PsClient& client,
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

int64_t DataPlaneRequests(TestCluster& cluster) {
  absl::StatusOr<std::vector<StatsResponse>> stats = cluster.Stats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  return stats.ok() ? (*stats)[0].data_plane_requests() : -1;
}

TEST(DataPlaneTest, PushAndPullTakeTheDataPlaneWhenTheServerOffersIt) {
  std::unique_ptr<TestCluster> cluster = StartCluster("offered");
  ASSERT_NE(cluster, nullptr);
  std::unique_ptr<PsClient> client = Join(*cluster);
  ASSERT_NE(client, nullptr);
  absl::StatusOr<std::vector<float>> model = PushOnesAndPull(*client, 0);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(*model, std::vector<float>(kElements, 1.0f));  // 1.5 - 0.5 * 1
  // A push and a pull of each of the two blocks (a request carries about
  // one block's bytes).
  EXPECT_EQ(DataPlaneRequests(*cluster), 4);
}

TEST(DataPlaneTest, WithoutADataPortTheSameModelComesOverGrpc) {
  std::unique_ptr<TestCluster> cluster =
      StartCluster("not_offered", {"--data_port=-1"});
  ASSERT_NE(cluster, nullptr);
  std::unique_ptr<PsClient> client = Join(*cluster);
  ASSERT_NE(client, nullptr);
  absl::StatusOr<std::vector<float>> model = PushOnesAndPull(*client, 0);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(*model, std::vector<float>(kElements, 1.0f));
  EXPECT_EQ(DataPlaneRequests(*cluster), 0);
}

TEST(DataPlaneTest, AClientWithTheDataPlaneOffUsesGrpc) {
  std::unique_ptr<TestCluster> cluster = StartCluster("client_off");
  ASSERT_NE(cluster, nullptr);
  PsClientOptions options;
  options.data_plane = false;
  std::unique_ptr<PsClient> client = Join(*cluster, options);
  ASSERT_NE(client, nullptr);
  absl::StatusOr<std::vector<float>> model = PushOnesAndPull(*client, 0);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(*model, std::vector<float>(kElements, 1.0f));
  EXPECT_EQ(DataPlaneRequests(*cluster), 0);
}

// PushPull of a gradient of ones as `push_step`, pulling `push_step` + 1.
absl::StatusOr<std::vector<float>> PushPullOnes(
    PsClient& client, int64_t push_step, int elements,
    PsClient::PushPullResult* result = nullptr) {
  const std::vector<float> ones(elements, 1.0f);
  std::vector<float> model(elements, -1.0f);
  absl::StatusOr<PsClient::PushPullResult> done =
      client.PushPull(push_step, {ones.data()}, push_step + 1, {model.data()});
  if (!done.ok()) return done.status();
  if (result != nullptr) *result = *done;
  return model;
}

TEST(DataPlaneTest, PushPullGivesThePushThenPullModelOnBothTransports) {
  for (const bool offered : {true, false}) {
    SCOPED_TRACE(offered ? "data plane" : "gRPC");
    std::unique_ptr<TestCluster> cluster =
        offered ? StartCluster("pushpull")
                : StartCluster("pushpull_grpc", {"--data_port=-1"});
    ASSERT_NE(cluster, nullptr);
    std::unique_ptr<PsClient> client = Join(*cluster);
    ASSERT_NE(client, nullptr);
    PsClient::PushPullResult result;
    absl::StatusOr<std::vector<float>> model =
        PushPullOnes(*client, 0, kElements, &result);
    ASSERT_TRUE(model.ok()) << model.status();
    EXPECT_EQ(*model, std::vector<float>(kElements, 1.0f));  // 1.5 - 0.5
    EXPECT_EQ(result.pushed.blocks_duplicate, 0);
    EXPECT_EQ(result.pulled_step, 1);
    // The same step again, as a retry after a lost answer sends it: both
    // blocks are acknowledged as duplicates and nothing is applied twice.
    model = PushPullOnes(*client, 0, kElements, &result);
    ASSERT_TRUE(model.ok()) << model.status();
    EXPECT_EQ(*model, std::vector<float>(kElements, 1.0f));
    EXPECT_EQ(result.pushed.blocks_duplicate, 2);
    model = PushPullOnes(*client, 1, kElements);
    ASSERT_TRUE(model.ok()) << model.status();
    EXPECT_EQ(*model, std::vector<float>(kElements, 0.5f));
    // A push and a pull per block and call when the data plane carries them
    // (one round trip each), none otherwise.
    EXPECT_EQ(DataPlaneRequests(*cluster), offered ? 12 : 0);
  }
}

TEST(DataPlaneTest, PushPullOfLargeBlocksReadsThePayloadsIntoPlace) {
  // Two blocks of 64 KiB: their pull asks for the payloads apart.
  constexpr int kLarge = 32768;
  std::unique_ptr<TestCluster> cluster = StartCluster("pushpull_large");
  ASSERT_NE(cluster, nullptr);
  std::unique_ptr<PsClient> client =
      Join(*cluster, {}, Schema(kLarge, kLarge / 2));
  ASSERT_NE(client, nullptr);
  PsClient::PushPullResult result;
  absl::StatusOr<std::vector<float>> model =
      PushPullOnes(*client, 0, kLarge, &result);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(*model, std::vector<float>(kLarge, 1.0f));
  EXPECT_EQ(result.pulled_step, 1);
  EXPECT_EQ(DataPlaneRequests(*cluster), 4);
}

// ---------------------------------------------------------------------------
// Raw bytes on the data port.

// What RegisterModel announces (as an observer): the data port and whether
// it takes PushPull.
RegisterModelResponse Announcement(const TestCluster& cluster,
                                   const std::string& token = "") {
  auto channel = grpc::CreateChannel(cluster.HostList()[0],
                                     grpc::InsecureChannelCredentials());
  auto stub = ParameterServer::NewStub(channel);
  RegisterModelRequest request;
  request.set_protocol_version(kProtocolVersion);
  *request.mutable_schema() = Schema();
  request.set_num_shards(1);
  request.set_num_workers(1);
  request.set_worker_id(-1);
  RegisterModelResponse response;
  grpc::ClientContext context;
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(30));
  grpc::Status status = stub->RegisterModel(&context, request, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return response;
}

int DataPort(const TestCluster& cluster, const std::string& token = "") {
  return Announcement(cluster, token).data_port();
}

std::string Request(Method method, absl::string_view body,
                    uint64_t claimed_bytes = UINT64_MAX) {
  char header[data_plane::kRequestHeaderBytes];
  data_plane::EncodeRequestHeader(
      {method, 10000,
       claimed_bytes == UINT64_MAX ? body.size() : claimed_bytes},
      header);
  return absl::StrCat(absl::string_view(header, sizeof(header)), body);
}

struct Answer {
  absl::StatusCode code;
  std::string body;
};

class RawConnection {
 public:
  explicit RawConnection(int port) {
    absl::StatusOr<ScopedFd> fd =
        ConnectTcp("127.0.0.1", port, 0, absl::Now() + absl::Seconds(10));
    EXPECT_TRUE(fd.ok()) << fd.status();
    if (fd.ok()) fd_ = std::move(*fd);
    // Every read below is bounded.
    TuneSocket(fd_.get(), 0, absl::Seconds(30)).IgnoreError();
  }
  void Send(absl::string_view bytes) {
    EXPECT_TRUE(SendAll(fd_.get(), bytes.data(), bytes.size()).ok());
  }
  absl::StatusOr<Answer> Read() {
    char header[data_plane::kResponseHeaderBytes];
    if (absl::Status s = RecvAll(fd_.get(), header, sizeof(header)); !s.ok()) {
      return s;
    }
    absl::StatusOr<data_plane::ResponseHeader> decoded =
        data_plane::DecodeResponseHeader(header, 1 << 20);
    if (!decoded.ok()) return decoded.status();
    Answer answer{decoded->code, std::string(decoded->body_bytes, '\0')};
    if (absl::Status s =
            RecvAll(fd_.get(), answer.body.data(), answer.body.size());
        !s.ok()) {
      return s;
    }
    return answer;
  }
  // True when the server closed the connection: a read ends with no bytes,
  // or is reset (the server closed with bytes of ours still unread).
  bool Closed() {
    char byte;
    const ssize_t got = recv(fd_.get(), &byte, 1, 0);
    return got == 0 || (got < 0 && errno == ECONNRESET);
  }

 private:
  ScopedFd fd_;
};

void ExpectRefused(RawConnection& connection, absl::StatusCode code,
                   absl::string_view fragment) {
  absl::StatusOr<Answer> answer = connection.Read();
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->code, code) << answer->body;
  EXPECT_TRUE(absl::StrContains(answer->body, fragment)) << answer->body;
}

TEST(DataPlaneTest, BadBytesOnTheDataPortAreRefusedByNameAndHarmNothing) {
  std::unique_ptr<TestCluster> cluster = StartCluster("hostile");
  ASSERT_NE(cluster, nullptr);
  std::unique_ptr<PsClient> client = Join(*cluster);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(PushOnesAndPull(*client, 0).ok());
  const int port = DataPort(*cluster);
  ASSERT_GT(port, 0);
  absl::StatusOr<std::vector<StatsResponse>> before = cluster->Stats();
  ASSERT_TRUE(before.ok()) << before.status();

  {  // An HTTP client on the wrong port.
    RawConnection c(port);
    c.Send("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    ExpectRefused(c, absl::StatusCode::kInvalidArgument, "bad magic");
    EXPECT_TRUE(c.Closed());
  }
  {  // A push before the Hello.
    RawConnection c(port);
    c.Send(Request(Method::kPush, "x"));
    ExpectRefused(c, absl::StatusCode::kFailedPrecondition, "Hello");
    EXPECT_TRUE(c.Closed());
  }
  {  // A body far over --max_message_mb, refused before it is read.
    RawConnection c(port);
    c.Send(Request(Method::kHello, ""));
    ExpectRefused(c, absl::StatusCode::kOk, "");
    c.Send(Request(Method::kPush, "", uint64_t{1} << 40));
    ExpectRefused(c, absl::StatusCode::kInvalidArgument, "over the limit");
    EXPECT_TRUE(c.Closed());
  }
  {  // An unknown method.
    RawConnection c(port);
    std::string bytes = Request(Method::kPull, "");
    bytes[4] = 77;
    c.Send(bytes);
    ExpectRefused(c, absl::StatusCode::kInvalidArgument, "unknown");
    EXPECT_TRUE(c.Closed());
  }
  {  // Bytes that are no PushRequest; the connection stays usable.
    RawConnection c(port);
    c.Send(Request(Method::kHello, ""));
    ExpectRefused(c, absl::StatusCode::kOk, "");
    c.Send(Request(Method::kPush, "\xff\xff\xff"));
    ExpectRefused(c, absl::StatusCode::kInvalidArgument,
                  "malformed PushRequest");
    PullRequest pull;
    pull.set_protocol_version(kProtocolVersion);
    pull.set_worker_id(0);
    BlockRef* ref = pull.add_blocks();
    ref->set_tensor("w");
    ref->set_block(1);
    c.Send(Request(Method::kPull, pull.SerializeAsString()));
    absl::StatusOr<Answer> answer = c.Read();
    ASSERT_TRUE(answer.ok()) << answer.status();
    ASSERT_EQ(answer->code, absl::StatusCode::kOk) << answer->body;
    PullResponse response;
    ASSERT_TRUE(response.ParseFromString(answer->body));
    ASSERT_EQ(response.blocks_size(), 1);
    EXPECT_EQ(response.blocks(0).data().size(), 4 * sizeof(float));
  }
  {  // Half a header, then gone.
    RawConnection c(port);
    c.Send(Request(Method::kHello, "").substr(0, 7));
  }

  absl::StatusOr<std::vector<StatsResponse>> after = cluster->Stats();
  ASSERT_TRUE(after.ok()) << after.status();
  // Refused: bad magic, no Hello, oversized, unknown method, bad PushRequest.
  EXPECT_EQ((*after)[0].requests_rejected() - (*before)[0].requests_rejected(),
            5);
  EXPECT_EQ((*after)[0].version(), (*before)[0].version());
  std::vector<float> model(kElements, -1.0f);
  ASSERT_TRUE(client->Pull(1, {model.data()}).ok());
  EXPECT_EQ(model, std::vector<float>(kElements, 1.0f));
}

TEST(DataPlaneTest, TheBearerTokenGuardsTheDataPortToo) {
  const std::string token_file = testing::TestDir() + "/bearer_token.txt";
  std::ofstream(token_file) << "s3cret\n";
  std::unique_ptr<TestCluster> cluster =
      StartCluster("token", {"--auth_token_file=" + token_file});
  ASSERT_NE(cluster, nullptr);
  PsClientOptions options;
  options.auth_token = "s3cret";
  std::unique_ptr<PsClient> client = Join(*cluster, options);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(PushOnesAndPull(*client, 0).ok());
  // The cluster's observer has no token: ask with the client's.
  absl::StatusOr<std::vector<StatsResponse>> stats = client->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ((*stats)[0].data_plane_requests(), 4);

  const int port = DataPort(*cluster, "s3cret");
  ASSERT_GT(port, 0);
  RawConnection c(port);
  c.Send(Request(Method::kHello, "guess"));
  ExpectRefused(c, absl::StatusCode::kUnauthenticated, "bearer token");
  EXPECT_TRUE(c.Closed());
}

TEST(DataPlaneTest, AWorkerFollowsARestartedServerToItsNewDataPort) {
  std::unique_ptr<TestCluster> cluster = StartCluster("restart");
  ASSERT_NE(cluster, nullptr);
  std::unique_ptr<PsClient> client = Join(*cluster);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(PushOnesAndPull(*client, 0).ok());

  cluster->KillServer(0);
  ASSERT_TRUE(cluster->RestartServer(0).ok());
  // The restarted server lost the model (no checkpoint); the client
  // registers again, learns the new data port and carries on there.
  absl::StatusOr<std::vector<float>> model = PushOnesAndPull(*client, 0);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(*model, std::vector<float>(kElements, 1.0f));
  ASSERT_TRUE(PushOnesAndPull(*client, 1).ok());
  // Counted by the new process: at least the last push and pull.
  EXPECT_GE(DataPlaneRequests(*cluster), 2);
}

// Forwards TCP connections from listen_host:port() to a target, byte for
// byte, each direction on its own thread: the gRPC port reached through
// another address than the one the servers bind (a firewall or a
// NetworkPolicy that opens only the gRPC port looks the same to a worker).
class TcpForwarder {
 public:
  TcpForwarder(const std::string& listen_host, const std::string& target_host,
               int target_port)
      : target_host_(target_host), target_port_(target_port) {
    absl::StatusOr<ScopedFd> listener = ListenTcp(listen_host, 0, 0, &port_);
    EXPECT_TRUE(listener.ok()) << listener.status();
    if (!listener.ok()) return;
    listener_ = std::move(*listener);
    accepter_ = std::thread([this] { AcceptLoop(); });
  }
  ~TcpForwarder() {
    stop_ = true;
    if (listener_.valid()) ::shutdown(listener_.get(), SHUT_RDWR);
    if (accepter_.joinable()) accepter_.join();
    {
      absl::MutexLock lock(&mu_);
      for (const auto& fd : open_) ::shutdown(fd->get(), SHUT_RDWR);
    }
    for (std::thread& t : pumps_) t.join();
  }
  int port() const { return port_; }

 private:
  void AcceptLoop() {
    while (!stop_) {
      const int fd = ::accept(listener_.get(), nullptr, nullptr);
      if (fd < 0) return;  // shut down
      absl::StatusOr<ScopedFd> upstream = ConnectTcp(
          target_host_, target_port_, 0, absl::Now() + absl::Seconds(5));
      if (!upstream.ok()) {
        ::close(fd);
        continue;
      }
      auto down = std::make_shared<ScopedFd>(fd);
      auto up = std::make_shared<ScopedFd>(std::move(*upstream));
      absl::MutexLock lock(&mu_);
      open_.push_back(down);
      open_.push_back(up);
      pumps_.emplace_back([down, up] { Pump(down->get(), up->get()); });
      pumps_.emplace_back([down, up] { Pump(up->get(), down->get()); });
    }
  }
  static void Pump(int from, int to) {
    char buffer[64 << 10];
    while (true) {
      const ssize_t n = ::recv(from, buffer, sizeof(buffer), 0);
      if (n <= 0 || !SendAll(to, buffer, static_cast<size_t>(n)).ok()) break;
    }
    ::shutdown(to, SHUT_WR);
  }

  const std::string target_host_;
  const int target_port_;
  int port_ = 0;
  ScopedFd listener_;
  std::atomic<bool> stop_{false};
  std::thread accepter_;
  absl::Mutex mu_;
  // Kept open until the forwarder goes, so a shutdown never hits an fd
  // number the process has reused.
  std::vector<std::shared_ptr<ScopedFd>> open_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> pumps_;  // joined after accepter_ stops adding
};

// A data port the worker cannot reach while the gRPC port works (only gRPC
// forwarded to another address, as a firewall opening one port would): the
// worker says so once and carries on over gRPC at once, never waiting out
// a deadline; the model is the same (README, "two ports").
TEST(DataPlaneTest, AnUnreachableDataPortFallsBackToGrpcAtOnce) {
  std::unique_ptr<TestCluster> cluster = StartCluster("unreachable_data");
  ASSERT_NE(cluster, nullptr);
  const std::string host = cluster->HostList()[0];
  const int grpc_port = std::stoi(host.substr(host.rfind(':') + 1));
  // The servers bind 127.0.0.1 only: at 127.0.0.2 the gRPC port is
  // forwarded and the data port is not.
  TcpForwarder forwarder("127.0.0.2", "127.0.0.1", grpc_port);
  ASSERT_GT(forwarder.port(), 0);
  PsClientOptions options;
  options.hosts = {absl::StrCat("127.0.0.2:", forwarder.port())};
  options.heartbeat_interval = absl::ZeroDuration();
  options.retry_window = absl::Seconds(30);
  absl::StatusOr<std::unique_ptr<PsClient>> client = PsClient::Create(options);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->Register(Schema(), 1, 0).ok());
  const absl::Time start = absl::Now();
  for (int64_t step = 0; step < 3; ++step) {
    absl::StatusOr<std::vector<float>> model = PushOnesAndPull(**client, step);
    ASSERT_TRUE(model.ok()) << model.status();
    // SGD 0.5 from 1.5 with gradients of ones.
    EXPECT_EQ(*model, std::vector<float>(kElements, 1.5f - 0.5f * (step + 1)));
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(DataPlaneRequests(*cluster), 0);  // all of it went over gRPC
  (*client)->Leave().IgnoreError();
}

// A PushPull frame as common/transport/data_plane.h lays it out.
std::string PushPullBody(absl::string_view push, absl::string_view pull) {
  char length[data_plane::kLengthPrefixBytes];
  data_plane::EncodeLengthPrefix(static_cast<uint32_t>(push.size()), length);
  return absl::StrCat(absl::string_view(length, sizeof(length)), push, pull);
}

PullRequest PullOfBlock(int block) {
  PullRequest pull;
  pull.set_protocol_version(kProtocolVersion);
  pull.set_worker_id(0);
  BlockRef* ref = pull.add_blocks();
  ref->set_tensor("w");
  ref->set_block(block);
  return pull;
}

TEST(DataPlaneTest, APushPullFrameAppliesThePushThenAnswersThePull) {
  std::unique_ptr<TestCluster> cluster = StartCluster("pushpull_raw");
  ASSERT_NE(cluster, nullptr);
  std::unique_ptr<PsClient> client = Join(*cluster);  // registers the model
  ASSERT_NE(client, nullptr);
  const RegisterModelResponse announced = Announcement(*cluster);
  ASSERT_GT(announced.data_port(), 0);
  EXPECT_TRUE(announced.data_push_pull());
  RawConnection c(announced.data_port());
  c.Send(Request(Method::kHello, ""));
  ExpectRefused(c, absl::StatusCode::kOk, "");

  PushRequest push;
  push.set_protocol_version(kProtocolVersion);
  push.set_worker_id(0);
  push.set_step(0);
  TensorBlock* block = push.add_blocks();
  block->set_tensor("w");
  block->set_block(0);
  block->set_dtype(FLOAT32);
  const std::vector<float> ones(4, 1.0f);
  block->set_data(ones.data(), ones.size() * sizeof(float));
  c.Send(Request(Method::kPushPull,
                 PushPullBody(push.SerializeAsString(),
                              PullOfBlock(0).SerializeAsString())));
  absl::StatusOr<Answer> answer = c.Read();
  ASSERT_TRUE(answer.ok()) << answer.status();
  ASSERT_EQ(answer->code, absl::StatusCode::kOk) << answer->body;
  absl::StatusOr<data_plane::LengthPrefixed> parts =
      data_plane::SplitLengthPrefixed(answer->body, "answer");
  ASSERT_TRUE(parts.ok()) << parts.status();
  PushResponse pushed;
  ASSERT_TRUE(pushed.ParseFromString(std::string(parts->head)));
  EXPECT_EQ(pushed.blocks_applied(), 1);
  PullResponse pulled;
  ASSERT_TRUE(pulled.ParseFromString(std::string(parts->rest)));
  ASSERT_EQ(pulled.blocks_size(), 1);
  std::vector<float> values(4);
  ASSERT_EQ(pulled.blocks(0).data().size(), sizeof(float) * values.size());
  std::memcpy(values.data(), pulled.blocks(0).data().data(),
              pulled.blocks(0).data().size());
  EXPECT_EQ(values, std::vector<float>(4, 1.0f));  // the push is in

  // Refused PushPulls: the pull is not run and the connection stays usable.
  absl::StatusOr<std::vector<StatsResponse>> before = cluster->Stats();
  ASSERT_TRUE(before.ok()) << before.status();
  std::string overlong = PushPullBody("", PullOfBlock(1).SerializeAsString());
  data_plane::EncodeLengthPrefix(1000, overlong.data());
  c.Send(Request(Method::kPushPull, overlong));
  ExpectRefused(c, absl::StatusCode::kInvalidArgument,
                "PushPull request says its first part is 1000 bytes");
  c.Send(Request(
      Method::kPushPull,
      PushPullBody("\xff\xff\xff", PullOfBlock(1).SerializeAsString())));
  ExpectRefused(c, absl::StatusCode::kInvalidArgument, "malformed PushRequest");
  c.Send(Request(Method::kPull, PullOfBlock(1).SerializeAsString()));
  answer = c.Read();
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->code, absl::StatusCode::kOk) << answer->body;
  absl::StatusOr<std::vector<StatsResponse>> after = cluster->Stats();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ((*after)[0].requests_rejected() - (*before)[0].requests_rejected(),
            2);
  std::vector<float> model(kElements, -1.0f);
  ASSERT_TRUE(client->Pull(1, {model.data()}).ok());
  EXPECT_EQ(model, std::vector<float>({1, 1, 1, 1, 1.5, 1.5, 1.5, 1.5}));
}

// A client sends PushPull only where it is announced: a server without a
// data plane announces neither.
TEST(DataPlaneTest, OnlyAServerWithADataPlaneAnnouncesPushPull) {
  std::unique_ptr<TestCluster> cluster =
      StartCluster("no_push_pull", {"--data_port=-1"});
  ASSERT_NE(cluster, nullptr);
  const RegisterModelResponse announced = Announcement(*cluster);
  EXPECT_EQ(announced.data_port(), 0);
  EXPECT_FALSE(announced.data_push_pull());
}

}  // namespace
}  // namespace pstrain
