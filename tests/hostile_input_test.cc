// Hostile input against a real ps_server process: a table of bad requests,
// sent over gRPC (Push and Pull as raw bytes through a GenericStub, exactly
// as a broken or malicious client could send them; the other RPCs through
// the typed stub). Each row names the status code and a piece of the
// message it must get. After every row the server must still serve a good
// client, and its state must be unchanged: the model pulled back bit for bit,
// the step (Stats.version), the applied-gradient count, and
// requests_rejected moved by exactly the row's own count.
//
// The model is one tensor "w" of 8 elements, CONSTANT 1.5, in blocks of 4,
// trained with SGD at learning rate 0.5 on integer gradients, so every
// expected value is exact.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/sync_stream.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/protocol.h"
#include "common/transport/tensor_codec.h"
#include "gtest/gtest.h"
#include "proto/ps.grpc.pb.h"
#include "tests/test_cluster.h"

namespace pstrain {
namespace {

using testing::ClusterOptions;
using testing::TestCluster;

constexpr char kPushMethod[] = "/pstrain.ParameterServer/Push";
constexpr char kPullMethod[] = "/pstrain.ParameterServer/Pull";
constexpr int kElements = 8;
constexpr int kBlockElements = 4;
constexpr int kNumWorkers = 2;
constexpr int64_t kInt64Min = std::numeric_limits<int64_t>::min();
constexpr int32_t kInt32Max = std::numeric_limits<int32_t>::max();

ModelSchema Schema() {
  ModelSchema schema;
  schema.set_seed(5);
  schema.set_block_elements(kBlockElements);
  DenseTensorSpec* w = schema.add_dense();
  w->set_name("w");
  w->add_shape(kElements);
  w->mutable_init()->set_kind(InitSpec::CONSTANT);
  w->mutable_init()->set_value(1.5f);
  return schema;
}

// Protobuf encoding by hand, for bytes no protobuf library would write.
std::string Varint(uint64_t value) {
  std::string out;
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7f) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
  return out;
}
std::string Tag(int field, int wire_type) {
  return Varint(static_cast<uint64_t>(field) << 3 | wire_type);
}

std::string Floats(const std::vector<float>& values) {
  std::string bytes;
  EncodeFloat32(values, &bytes);
  return bytes;
}

// A push of `value` to every element of the blocks named (default: both).
PushRequest Push(int worker, int64_t step, float value,
                 std::vector<int64_t> blocks = {0, 1}) {
  PushRequest push;
  push.set_protocol_version(kProtocolVersion);
  push.set_worker_id(worker);
  push.set_step(step);
  for (int64_t b : blocks) {
    TensorBlock* block = push.add_blocks();
    block->set_tensor("w");
    block->set_block(b);
    block->set_data(Floats(std::vector<float>(kBlockElements, value)));
  }
  return push;
}

PullRequest Pull(int worker, int64_t step) {
  PullRequest pull;
  pull.set_protocol_version(kProtocolVersion);
  pull.set_worker_id(worker);
  pull.set_step(step);
  return pull;
}

std::string Bits(const std::vector<float>& values) {
  std::string out;
  for (float v : values) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    absl::StrAppend(&out, v, "(0x", absl::Hex(bits), ") ");
  }
  return out;
}

// One row of the table: sends its request and returns the status.
struct Case {
  std::string name;
  std::function<grpc::Status()> send;
  grpc::StatusCode code;
  std::string message;  // a substring of the status message
  // How much requests_rejected moves (0: refused by gRPC before the server's
  // code, or not an error), and how many block pushes are duplicates.
  int rejected = 1;
  int duplicates = 0;
};

class HostileInputTest : public ::testing::Test {
 protected:
  // Starts `num_shards` servers (SGD, lr 0.5, 1 MiB messages, leases long
  // enough that no member drops out during the test) and registers the
  // schema on each as an observer.
  void Start(int num_shards, const std::string& mode,
             std::vector<std::string> extra_flags = {},
             bool register_model = true) {
    ClusterOptions options;
    options.num_shards = num_shards;
    options.num_workers = kNumWorkers;
    options.mode = mode;
    options.server_flags = {"--optimizer=sgd", "--learning_rate=0.5",
                            "--max_message_mb=1", "--worker_lease_s=600",
                            "--max_pull_wait_s=5"};
    options.server_flags.insert(options.server_flags.end(), extra_flags.begin(),
                                extra_flags.end());
    absl::StatusOr<std::unique_ptr<TestCluster>> cluster = TestCluster::Start(
        options, absl::StrCat("hostile_", mode, "_", num_shards));
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
    num_shards_ = num_shards;
    for (const std::string& host : cluster_->HostList()) {
      grpc::ChannelArguments args;
      // Lets oversized requests leave the client, so the server refuses them.
      args.SetMaxSendMessageSize(64 << 20);
      std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(
          host, grpc::InsecureChannelCredentials(), args);
      stubs_.push_back(ParameterServer::NewStub(channel));
      channels_.push_back(channel);
      generic_.push_back(std::make_unique<grpc::GenericStub>(channel));
    }
    for (int s = 0; s < num_shards && register_model; ++s) {
      ASSERT_TRUE(Register(s, Schema(), -1).ok());
    }
  }

  static std::unique_ptr<grpc::ClientContext> Context() {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() +
                          std::chrono::seconds(10));
    return context;
  }

  // Sends `bytes` as the whole request of `method` with the given deadline;
  // the reply's bytes go to *reply when given.
  grpc::Status Raw(int shard, const std::string& method,
                   const std::string& bytes, std::string* reply = nullptr,
                   absl::Duration deadline = absl::Seconds(10)) {
    // Shared with the callback, so that giving up on a call that never
    // completes leaves nothing dangling.
    struct Call {
      grpc::ClientContext context;
      grpc::ByteBuffer request, response;
      grpc::Status status;
      absl::Notification done;
    };
    auto call = std::make_shared<Call>();
    call->context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    grpc::Slice slice(bytes.data(), bytes.size());
    call->request = grpc::ByteBuffer(&slice, 1);
    generic_[shard]->UnaryCall(&call->context, method, grpc::StubOptions(),
                               &call->request, &call->response,
                               [call](grpc::Status s) {
                                 call->status = std::move(s);
                                 call->done.Notify();
                               });
    // The call has its own deadline; this bound only guards the test.
    if (!call->done.WaitForNotificationWithTimeout(deadline +
                                                   absl::Seconds(20))) {
      call->context.TryCancel();
      return grpc::Status(grpc::StatusCode::INTERNAL, "call never completed");
    }
    if (call->status.ok() && reply != nullptr) {
      std::vector<grpc::Slice> slices;
      EXPECT_TRUE(call->response.Dump(&slices).ok());
      reply->clear();
      for (const grpc::Slice& s : slices) {
        reply->append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
    }
    return call->status;
  }

  // A PushStream or PullStream to `shard`, carrying raw request bytes.
  using CallStream =
      grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>;
  std::unique_ptr<CallStream> OpenCallStream(int shard,
                                             grpc::ClientContext* context,
                                             const char* method) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    return std::unique_ptr<CallStream>(
        grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer,
                                                  grpc::ByteBuffer>::
            Create(channels_[shard].get(),
                   grpc::internal::RpcMethod(
                       method, grpc::internal::RpcMethod::BIDI_STREAMING),
                   context));
  }

  grpc::Status RawPush(int shard, const PushRequest& push,
                       PushResponse* response = nullptr) {
    std::string reply;
    grpc::Status status =
        Raw(shard, kPushMethod, push.SerializeAsString(), &reply);
    if (status.ok() && response != nullptr) {
      EXPECT_TRUE(response->ParseFromString(reply));
    }
    return status;
  }
  grpc::Status RawPull(int shard, const PullRequest& pull) {
    return Raw(shard, kPullMethod, pull.SerializeAsString());
  }

  grpc::Status Register(int shard, const ModelSchema& schema, int worker,
                        uint32_t protocol_version = kProtocolVersion,
                        int num_shards = -1, int num_workers = kNumWorkers) {
    RegisterModelRequest request;
    request.set_protocol_version(protocol_version);
    *request.mutable_schema() = schema;
    request.set_num_shards(num_shards < 0 ? num_shards_ : num_shards);
    request.set_num_workers(num_workers);
    request.set_worker_id(worker);
    request.set_incarnation(77);
    RegisterModelResponse response;
    return stubs_[shard]->RegisterModel(Context().get(), request, &response);
  }
  grpc::Status Heartbeat(int shard, int worker) {
    HeartbeatRequest request;
    request.set_worker_id(worker);
    HeartbeatResponse response;
    return stubs_[shard]->Heartbeat(Context().get(), request, &response);
  }
  grpc::Status Leave(int shard, int worker) {
    LeaveRequest request;
    request.set_worker_id(worker);
    LeaveResponse response;
    return stubs_[shard]->Leave(Context().get(), request, &response);
  }
  StatsResponse Stats(int shard) {
    StatsResponse stats;
    grpc::Status status =
        stubs_[shard]->Stats(Context().get(), StatsRequest(), &stats);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return stats;
  }

  // The whole tensor as the shards hold it (an observer's pull at `step`,
  // raw, decoded by hand), or an empty vector on error.
  std::vector<float> PullModel(int64_t step) {
    std::vector<float> w(kElements, NAN);
    for (int s = 0; s < num_shards_; ++s) {
      std::string reply;
      grpc::Status status =
          Raw(s, kPullMethod, Pull(-1, step).SerializeAsString(), &reply);
      EXPECT_TRUE(status.ok()) << status.error_message();
      PullResponse response;
      if (!status.ok() || !response.ParseFromString(reply)) return {};
      for (const TensorBlock& block : response.blocks()) {
        EXPECT_EQ(block.tensor(), "w");
        EXPECT_EQ(block.version(), step);
        if (block.block() < 0 || block.block() >= kElements / kBlockElements) {
          ADD_FAILURE() << "block " << block.block();
          return {};
        }
        EXPECT_TRUE(
            DecodeToFloat32(FLOAT32, block.data(),
                            absl::MakeSpan(w).subspan(
                                block.block() * kBlockElements, kBlockElements))
                .ok());
      }
    }
    return w;
  }

  // Runs every row, checking after each that the server still serves and
  // nothing changed but the counters the row names. `expected` is the model
  // at `step`.
  void RunTable(const std::vector<Case>& cases, int64_t step,
                const std::vector<float>& expected) {
    for (const Case& c : cases) {
      SCOPED_TRACE(c.name);
      std::vector<StatsResponse> before;
      for (int s = 0; s < num_shards_; ++s) before.push_back(Stats(s));
      const grpc::Status status = c.send();
      EXPECT_EQ(status.error_code(), c.code) << status.error_message();
      EXPECT_NE(status.error_message().find(c.message), std::string::npos)
          << "message: '" << status.error_message()
          << "', expected to contain '" << c.message << "'";
      // Still serving a good client, state unchanged.
      for (int s = 0; s < num_shards_; ++s) {
        ASSERT_TRUE(cluster_->server(s).running())
            << cluster_->server(s).Stderr();
        EXPECT_TRUE(Heartbeat(s, 1).ok());
        const StatsResponse after = Stats(s);
        EXPECT_EQ(after.version(), step);
        EXPECT_EQ(after.blocks_applied(), before[s].blocks_applied());
        EXPECT_EQ(after.late_gradients_dropped(),
                  before[s].late_gradients_dropped());
        // Only shard 0 is sent the bad requests.
        EXPECT_EQ(after.requests_rejected(),
                  before[s].requests_rejected() + (s == 0 ? c.rejected : 0));
        EXPECT_EQ(after.blocks_duplicate(),
                  before[s].blocks_duplicate() + (s == 0 ? c.duplicates : 0));
      }
      const std::vector<float> model = PullModel(step);
      ASSERT_EQ(model.size(), expected.size());
      EXPECT_EQ(std::memcmp(model.data(), expected.data(),
                            expected.size() * sizeof(float)),
                0)
          << "model " << Bits(model) << "\nexpected " << Bits(expected);
    }
    std::cout << "[ hostile ] " << cases.size()
              << " bad requests, each answered with its status; the server "
                 "kept serving and its state was unchanged after each\n";
  }

  std::unique_ptr<TestCluster> cluster_;
  int num_shards_ = 0;
  std::vector<std::unique_ptr<ParameterServer::Stub>> stubs_;
  std::vector<std::unique_ptr<grpc::GenericStub>> generic_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
};

// Builds a push whose block 0 carries `data` as it is (any length, dtype).
// A TOPK_FLOAT32 payload: the indices, then the values.
std::string TopK(const std::vector<std::pair<uint32_t, float>>& entries) {
  std::string out;
  for (const auto& [index, value] : entries) {
    out.append(reinterpret_cast<const char*>(&index), 4);
  }
  for (const auto& [index, value] : entries) {
    out.append(reinterpret_cast<const char*>(&value), 4);
  }
  return out;
}

PushRequest PushBlock0(const std::string& data, DataType dtype = FLOAT32) {
  PushRequest push = Push(0, 1, 1.0f, {0});
  push.mutable_blocks(0)->set_dtype(dtype);
  push.mutable_blocks(0)->set_data(data);
  return push;
}

TEST_F(HostileInputTest, SyncServerRefusesEachBadRequestAndKeepsItsState) {
  Start(1, "sync");
  // State to protect: step 0 applied (mean gradient 2: w = 1.5 - 0.5 * 2),
  // and worker 0's step-1 gradient already in, waiting for worker 1's.
  PushResponse pushed;
  ASSERT_TRUE(RawPush(0, Push(0, 0, 1.0f), &pushed).ok());
  ASSERT_TRUE(RawPush(0, Push(1, 0, 3.0f), &pushed).ok());
  ASSERT_TRUE(RawPush(0, Push(0, 1, 1.0f), &pushed).ok());
  ASSERT_EQ(pushed.blocks_applied(), 2);
  const std::vector<float> after_step0(kElements, 0.5f);
  ASSERT_EQ(PullModel(1), after_step0);

  std::mt19937 random(12345);
  std::string garbage(64, '\0');
  for (char& c : garbage) c = static_cast<char>(random());
  garbage[0] = '\x07';  // field 0, wire type 7: never valid protobuf
  const std::string valid_push = Push(0, 1, 1.0f).SerializeAsString();
  const std::string oversized_payload(2 << 20, '\0');
  const std::string long_name(70000, 'n');

  const auto push = [this](PushRequest request) {
    return [this, request] { return RawPush(0, request); };
  };
  const auto raw = [this](const char* method, std::string bytes) {
    return [this, method, bytes] { return Raw(0, method, bytes); };
  };
  const auto pull = [this](PullRequest request) {
    return [this, request] { return RawPull(0, request); };
  };
  const grpc::StatusCode kInvalid = grpc::StatusCode::INVALID_ARGUMENT;
  const grpc::StatusCode kPrecondition = grpc::StatusCode::FAILED_PRECONDITION;

  std::vector<Case> cases = {
      // Malformed protobuf.
      {"push: random garbage", raw(kPushMethod, garbage), kInvalid,
       "malformed PushRequest"},
      {"push: truncated varint", raw(kPushMethod, Tag(1, 0) + "\x01" +
                                                     Tag(3, 0) + "\xff\xff"),
       kInvalid, "truncated varint"},
      {"push: a valid push cut in its last block",
       raw(kPushMethod, valid_push.substr(0, valid_push.size() - 5)), kInvalid,
       "exceeds remaining"},
      {"push: block length prefix claiming 2^60 bytes",
       raw(kPushMethod, Tag(5, 2) + Varint(uint64_t{1} << 60) + "w"), kInvalid,
       "longer than 5 bytes"},
      {"push: block length prefix claiming 4 GiB",
       raw(kPushMethod, Tag(5, 2) + Varint(0xffffffffu) + "w"), kInvalid,
       "length 4294967295 exceeds remaining 1 bytes"},
      {"push: data length claiming 2^31 bytes",
       raw(kPushMethod,
           [] {
             const std::string block = Tag(1, 2) + Varint(1) + "w" +
                                       Tag(4, 2) + Varint(uint64_t{1} << 31) +
                                       "ab";
             return Tag(1, 0) + Varint(1) + Tag(5, 2) + Varint(block.size()) +
                    block;
           }()),
       kInvalid, "blocks[0]: field 4 length 2147483648 exceeds remaining 2"},
      {"push: step sent as a string (wrong wire type)",
       raw(kPushMethod, Tag(1, 0) + Varint(1) + Tag(3, 2) + Varint(1) + "x"),
       kInvalid, "expected 0 (varint)"},
      {"push: a block sent as a varint (wrong wire type)",
       raw(kPushMethod, Tag(5, 0) + Varint(3)), kInvalid,
       "expected 2 (length-delimited)"},
      {"push: a group", raw(kPushMethod, Tag(5, 3) + Tag(5, 4)), kInvalid,
       "is a group"},
      {"push: field number 0", raw(kPushMethod, std::string("\x00\x01", 2)),
       kInvalid, "invalid tag 0"},
      {"push: empty message (protocol version 0)", raw(kPushMethod, ""),
       kPrecondition, "protocol version 0 is not supported"},
      {"pull: random garbage", raw(kPullMethod, garbage), kInvalid,
       "malformed PullRequest"},
      {"pull: truncated varint", raw(kPullMethod, Tag(3, 0) + "\xff"), kInvalid,
       "malformed PullRequest"},
      {"pull: length prefix claiming 2^60 bytes",
       raw(kPullMethod, Tag(4, 2) + Varint(uint64_t{1} << 60)), kInvalid,
       "malformed PullRequest"},
      {"pull: tensor name not UTF-8",
       raw(kPullMethod, Tag(1, 0) + Varint(1) + Tag(4, 2) + Varint(3) +
                            Tag(1, 2) + Varint(1) + "\xff"),
       kInvalid, "malformed PullRequest"},
      // Wrong payload lengths and types.
      {"push: payload one element short", push(PushBlock0(Floats({1, 1, 1}))),
       kInvalid, "payload has 12 bytes, expected 16 (4 FLOAT32 elements)"},
      {"push: payload one element long",
       push(PushBlock0(Floats({1, 1, 1, 1, 1}))), kInvalid,
       "payload has 20 bytes, expected 16"},
      {"push: payload not a whole number of elements",
       push(PushBlock0(std::string(15, '\0'))), kInvalid,
       "payload has 15 bytes"},
      {"push: empty payload", push(PushBlock0("")), kInvalid,
       "payload has 0 bytes"},
      {"push: fp32 bytes labelled fp16",
       push(PushBlock0(Floats({1, 1, 1, 1}), FLOAT16)), kInvalid,
       "expected 8 (4 FLOAT16 elements)"},
      {"push: top-k index past the block",
       push(PushBlock0(TopK({{1, 1.0f}, {4, 1.0f}}), TOPK_FLOAT32)), kInvalid,
       "TOPK_FLOAT32 index 1 is 4: indices must increase strictly and stay "
       "below 4"},
      {"push: top-k indices repeated",
       push(PushBlock0(TopK({{2, 1.0f}, {2, 1.0f}}), TOPK_FLOAT32)), kInvalid,
       "TOPK_FLOAT32 index 1 is 2"},
      {"push: top-k with more elements than the block",
       push(PushBlock0(
           TopK({{0, 1.0f}, {1, 1.0f}, {2, 1.0f}, {3, 1.0f}, {4, 1.0f}}),
           TOPK_FLOAT32)),
       kInvalid, "at most 4 elements"},
      {"push: top-k value NaN",
       push(PushBlock0(TopK({{0, 1.0f}, {3, NAN}}), TOPK_FLOAT32)), kInvalid,
       "gradient element 3 is NaN or infinite"},
      {"push: unknown wire type 7",
       push(PushBlock0(Floats({1, 1, 1, 1}), static_cast<DataType>(7))),
       kInvalid, "wire type 7 is not supported"},
      // Unknown names and block indices.
      {"push: unknown tensor",
       push([] {
         PushRequest p = Push(0, 1, 1.0f, {0});
         p.mutable_blocks(0)->set_tensor("v");
         return p;
       }()),
       kInvalid, "unknown tensor 'v'"},
      {"push: empty tensor name",
       push([] {
         PushRequest p = Push(0, 1, 1.0f, {0});
         p.mutable_blocks(0)->clear_tensor();
         return p;
       }()),
       kInvalid, "unknown tensor ''"},
      {"push: block index past the end", push(Push(0, 1, 1.0f, {2})), kInvalid,
       "tensor 'w' has blocks [0, 2), got block 2"},
      {"push: negative block index", push(Push(0, 1, 1.0f, {-1})), kInvalid,
       "got block -1"},
      {"push: block index 2^62", push(Push(0, 1, 1.0f, {int64_t{1} << 62})),
       kInvalid, "got block 4611686018427387904"},
      {"push: the same block twice", push(Push(0, 1, 1.0f, {1, 1})), kInvalid,
       "appears twice in one push"},
      {"pull: unknown tensor",
       pull([] {
         PullRequest p = Pull(0, 1);
         BlockRef* ref = p.add_blocks();
         ref->set_tensor("nope");
         return p;
       }()),
       kInvalid, "unknown tensor 'nope'"},
      {"pull: block index 2^40",
       pull([] {
         PullRequest p = Pull(0, 1);
         BlockRef* ref = p.add_blocks();
         ref->set_tensor("w");
         ref->set_block(int64_t{1} << 40);
         return p;
       }()),
       kInvalid, "got block 1099511627776"},
      {"pull: the same block twice",
       pull([] {
         PullRequest p = Pull(0, 1);
         for (int i = 0; i < 2; ++i) p.add_blocks()->set_tensor("w");
         return p;
       }()),
       kInvalid, "is requested twice"},
      // Huge claimed sizes.
      {"register: a tensor of 2^41 elements",
       [this] {
         ModelSchema huge = Schema();
         huge.mutable_dense(0)->set_shape(0, int64_t{1} << 41);
         return Register(0, huge, 0);
       },
       kInvalid, "at most 2^40 elements"},
      {"register: 2^30 x 2^30 elements (overflowing product)",
       [this] {
         ModelSchema huge = Schema();
         huge.mutable_dense(0)->set_shape(0, int64_t{1} << 30);
         huge.mutable_dense(0)->add_shape(int64_t{1} << 30);
         return Register(0, huge, 0);
       },
       kInvalid, "at most 2^40 elements"},
      {"register: block_elements 0",
       [this] {
         ModelSchema bad = Schema();
         bad.set_block_elements(0);
         return Register(0, bad, 0);
       },
       kInvalid, "block_elements must be >= 1"},
      // NaN and infinity.
      {"push: NaN gradient",
       push(PushBlock0(Floats({1, NAN, 1, 1}))), kInvalid,
       "gradient element 1 is NaN or infinite"},
      {"push: +inf gradient in block 1",
       push([] {
         PushRequest p = Push(0, 1, 1.0f);
         p.mutable_blocks(1)->set_data(Floats({1, 1, 1, INFINITY}));
         return p;
       }()),
       kInvalid, "gradient element 7 is NaN or infinite"},
      {"push: -inf in fp16",
       push([] {
         std::string half;
         EncodeFromFloat32(FLOAT16, {1, 1, -INFINITY, 1}, &half);
         return PushBlock0(half, FLOAT16);
       }()),
       kInvalid, "gradient element 2 is NaN or infinite"},
      {"push: fp16 overflow to inf (65536)",
       push([] {
         std::string half;
         EncodeFromFloat32(FLOAT16, {65536.0f, 1, 1, 1}, &half);
         return PushBlock0(half, FLOAT16);
       }()),
       kInvalid, "gradient element 0 is NaN or infinite"},
      // Negative and far-future steps.
      {"push: step -1", push(Push(0, -1, 1.0f)), kInvalid,
       "step must be in [0, 2^53), got -1"},
      {"push: step INT64_MIN", push(Push(0, kInt64Min, 1.0f)), kInvalid,
       "step must be in [0, 2^53), got -9223372036854775808"},
      {"push: next step (2) while the shard is at 1", push(Push(1, 2, 1.0f)),
       kPrecondition, "push for step 2 but tensor 'w' block 0 is at step 1"},
      {"push: step 2^40", push(Push(1, int64_t{1} << 40, 1.0f)), kPrecondition,
       "push for step 1099511627776"},
      {"push: step INT64_MAX",
       push(Push(1, std::numeric_limits<int64_t>::max(), 1.0f)), kInvalid,
       "step must be in [0, 2^53), got 9223372036854775807"},
      {"push: pulled version -1",
       push([] {
         PushRequest p = Push(1, 1, 1.0f);
         p.mutable_blocks(1)->set_version(-1);
         return p;
       }()),
       kInvalid, "pulled version must be >= 0, got -1"},
      {"pull: step -7", pull(Pull(0, -7)), kInvalid,
       "step must be in [0, 2^53), got -7"},
      {"pull: step 3 while the shard is at 1", pull(Pull(0, 3)),
       grpc::StatusCode::OUT_OF_RANGE, "a worker can be at most one step ahead"},
      {"pull: parameters asked as TOPK_FLOAT32",
       pull([] {
         PullRequest p = Pull(0, 1);
         p.set_dtype(TOPK_FLOAT32);
         return p;
       }()),
       kInvalid, "PullRequest dtype 3: the servers answer FLOAT32"},
      {"pull: parameters asked as dtype 77",
       pull([] {
         PullRequest p = Pull(0, 1);
         p.set_dtype(static_cast<DataType>(77));
         return p;
       }()),
       kInvalid, "PullRequest dtype 77"},
      {"pull: step INT64_MAX",
       pull(Pull(0, std::numeric_limits<int64_t>::max())), kInvalid,
       "step must be in [0, 2^53), got 9223372036854775807"},
      // A read meant for a backup never reaches a lone shard as a plain
      // pull (which would count the worker's push of the step as given).
      {"pull: a backup's read, to a shard without replicas",
       pull([] {
         PullRequest p = Pull(0, 1);
         p.set_replica_read(true);
         return p;
       }()),
       grpc::StatusCode::UNAVAILABLE,
       "a read from a backup, but this server is not replicated",
       /*rejected=*/0},  // a misdirected read, as a backup's refusal is
      // Worker ids out of range.
      {"push: worker -5", push(Push(-5, 1, 1.0f)), kInvalid,
       "worker_id must be in [0, 2), got -5"},
      {"push: worker 2^31-1", push(Push(kInt32Max, 1, 1.0f)), kInvalid,
       "got 2147483647"},
      {"push: worker -1 (an observer may not push)", push(Push(-1, 1, 1.0f)),
       kInvalid, "got -1"},
      {"push: worker 2 (= num_workers)", push(Push(2, 1, 1.0f)), kInvalid,
       "got 2"},
      {"push: worker id as a 64-bit varint (2^32 + 1 truncates to 1)",
       raw(kPushMethod,
           [] {
             // protobuf truncates an int32 to its low 32 bits: this is
             // worker 1, step 3, which is too far ahead.
             PushRequest p = Push(0, 3, 1.0f);
             p.clear_worker_id();
             return p.SerializeAsString() + Tag(2, 0) +
                    Varint((uint64_t{1} << 32) + 1);
           }()),
       kPrecondition, "push for step 3"},
      {"pull: worker -5", pull(Pull(-5, 1)), kInvalid,
       "or -1 for an observer, got -5"},
      {"pull: worker 2^31-1", pull(Pull(kInt32Max, 1)), kInvalid,
       "got 2147483647"},
      {"heartbeat: worker -5", [this] { return Heartbeat(0, -5); }, kInvalid,
       "got -5"},
      {"heartbeat: worker 2^31-1", [this] { return Heartbeat(0, kInt32Max); },
       kInvalid, "got 2147483647"},
      {"leave: worker -5", [this] { return Leave(0, -5); }, kInvalid,
       "got -5"},
      {"leave: worker 2^31-1", [this] { return Leave(0, kInt32Max); }, kInvalid,
       "got 2147483647"},
      {"register: worker -5", [this] { return Register(0, Schema(), -5); },
       kInvalid, "or -1 for an observer, got -5"},
      {"register: worker 2^31-1",
       [this] { return Register(0, Schema(), kInt32Max); }, kInvalid,
       "got 2147483647"},
      // Duplicate pushes: acknowledged, counted, not applied.
      {"push: worker 0 resends its step-1 gradient",
       [this] {
         PushResponse response;
         grpc::Status status = RawPush(0, Push(0, 1, 1.0f), &response);
         EXPECT_EQ(response.blocks_applied(), 0);
         EXPECT_EQ(response.blocks_duplicate(), 2);
         return status;
       },
       grpc::StatusCode::OK, "", /*rejected=*/0, /*duplicates=*/2},
      {"push: worker 0 resends step 1 with another value",
       [this] {
         PushResponse response;
         grpc::Status status = RawPush(0, Push(0, 1, 100.0f), &response);
         EXPECT_EQ(response.blocks_duplicate(), 2);
         return status;
       },
       grpc::StatusCode::OK, "", 0, 2},
      {"push: worker 1 resends its step-0 gradient (step over)",
       [this] {
         PushResponse response;
         grpc::Status status = RawPush(0, Push(1, 0, 3.0f, {1}), &response);
         EXPECT_EQ(response.blocks_duplicate(), 1);
         EXPECT_EQ(response.blocks_late(), 0);
         return status;
       },
       grpc::StatusCode::OK, "", 0, 1},
      // Schema mismatches.
      {"register: another shape",
       [this] {
         ModelSchema other = Schema();
         other.mutable_dense(0)->set_shape(0, 9);
         return Register(0, other, 0);
       },
       kPrecondition, "tensor 0 ('w'): shape [8] vs [9]"},
      {"register: another init",
       [this] {
         ModelSchema other = Schema();
         other.mutable_dense(0)->mutable_init()->set_value(2.0f);
         return Register(0, other, 0);
       },
       kPrecondition, "init {"},
      {"register: another seed",
       [this] {
         ModelSchema other = Schema();
         other.set_seed(6);
         return Register(0, other, 1);
       },
       kPrecondition, "seed 5 vs 6"},
      {"register: another tensor name",
       [this] {
         ModelSchema other = Schema();
         other.mutable_dense(0)->set_name("v");
         return Register(0, other, -1);
       },
       kPrecondition, "name 'w' vs 'v'"},
      {"register: an extra tensor",
       [this] {
         ModelSchema other = Schema();
         *other.add_dense() = other.dense(0);
         other.mutable_dense(1)->set_name("w2");
         return Register(0, other, -1);
       },
       kPrecondition, "tensor count 1 vs 2"},
      {"register: 3 shards", [this] { return Register(0, Schema(), 0,
                                                       kProtocolVersion, 3); },
       kPrecondition, "client expects 3 shards"},
      {"register: 5 workers",
       [this] {
         return Register(0, Schema(), 0, kProtocolVersion, 1, 5);
       },
       kPrecondition, "client expects 5 workers"},
      {"register: no tensors",
       [this] {
         ModelSchema empty = Schema();
         empty.clear_dense();
         return Register(0, empty, -1);
       },
       kInvalid, "schema has no tensors"},
      // Oversized messages: refused by gRPC (--max_message_mb=1) before the
      // server's code, so not counted in requests_rejected.
      {"push: 2 MiB message",
       push(PushBlock0(oversized_payload)), grpc::StatusCode::RESOURCE_EXHAUSTED,
       "larger than max", /*rejected=*/0},
      {"pull: 2 MiB message",
       raw(kPullMethod, Pull(0, 1).SerializeAsString() + Tag(15, 2) +
                            Varint(oversized_payload.size()) +
                            oversized_payload),
       grpc::StatusCode::RESOURCE_EXHAUSTED, "larger than max", 0},
      // Protocol versions.
      {"push: protocol version 2",
       push([] {
         PushRequest p = Push(0, 1, 1.0f);
         p.set_protocol_version(2);
         return p;
       }()),
       kPrecondition, "protocol version 2 is not supported; this server speaks 1"},
      {"push: protocol version 2^32-1",
       push([] {
         PushRequest p = Push(0, 1, 1.0f);
         p.set_protocol_version(0xffffffffu);
         return p;
       }()),
       kPrecondition, "protocol version 4294967295"},
      {"pull: protocol version 0",
       pull([] {
         PullRequest p = Pull(0, 1);
         p.clear_protocol_version();
         return p;
       }()),
       kPrecondition, "protocol version 0 is not supported"},
      {"register: protocol version 2",
       [this] { return Register(0, Schema(), 0, 2); }, kPrecondition,
       "protocol version 2 is not supported"},
      // Unparsable bytes, on every method that takes a message: each is
      // refused naming the message, as Push and Pull are.
      {"register: random garbage",
       raw("/pstrain.ParameterServer/RegisterModel", garbage), kInvalid,
       "malformed RegisterModelRequest"},
      {"sparse pull: random garbage",
       raw("/pstrain.ParameterServer/SparsePull", garbage), kInvalid,
       "malformed SparsePullRequest"},
      {"sparse push: random garbage",
       raw("/pstrain.ParameterServer/SparsePush", garbage), kInvalid,
       "malformed SparsePushRequest"},
      {"heartbeat: random garbage",
       raw("/pstrain.ParameterServer/Heartbeat", garbage), kInvalid,
       "malformed HeartbeatRequest"},
      {"leave: random garbage", raw("/pstrain.ParameterServer/Leave", garbage),
       kInvalid, "malformed LeaveRequest"},
      {"stats: random garbage", raw("/pstrain.ParameterServer/Stats", garbage),
       kInvalid, "malformed StatsRequest"},
      {"checkpoint: random garbage",
       raw("/pstrain.ParameterServer/Checkpoint", garbage), kInvalid,
       "malformed CheckpointRequest"},
      {"sparse changes: random garbage",
       raw("/pstrain.ParameterServer/SparseChanges", garbage), kInvalid,
       "malformed SparseChangesRequest"},
      {"leave: truncated varint",
       raw("/pstrain.ParameterServer/Leave", Tag(1, 0) + "\xff"), kInvalid,
       "malformed LeaveRequest"},
      // Names far longer than any status may quote: the answer quotes the
      // start of the name and its length, and comes at once (a status
      // quoting all of it was never sent: no answer until the deadline).
      {"push: a 70,000-character tensor name",
       [this, long_name] {
         PushRequest p = Push(0, 1, 1.0f, {0});
         p.mutable_blocks(0)->set_tensor(long_name);
         return Raw(0, kPushMethod, p.SerializeAsString(), nullptr,
                    absl::Seconds(5));
       },
       kInvalid, "unknown tensor 'nnnnnnnn"},
      {"push: the answer to a long name is short",
       [this, long_name] {
         PushRequest p = Push(0, 1, 1.0f, {0});
         p.mutable_blocks(0)->set_tensor(long_name);
         grpc::Status status = Raw(0, kPushMethod, p.SerializeAsString(),
                                   nullptr, absl::Seconds(5));
         EXPECT_LT(status.error_message().size(), 1024u);
         return status;
       },
       kInvalid, "...' (70000 bytes)"},
      {"pull: a 70,000-character tensor name in a BlockRef",
       [this, long_name] {
         PullRequest p = Pull(0, 1);
         BlockRef* ref = p.add_blocks();
         ref->set_tensor(long_name);
         return Raw(0, kPullMethod, p.SerializeAsString(), nullptr,
                    absl::Seconds(5));
       },
       kInvalid, "unknown tensor 'nnnnnnnn"},
      {"register: a schema whose tensor has a 70,000-character name",
       [this, long_name] {
         ModelSchema other = Schema();
         other.mutable_dense(0)->set_name(long_name);
         return Register(0, other, -1);
       },
       kPrecondition, "name 'w' vs 'nnnnnnnn"},
      {"sparse pull: a 70,000-character table name",
       [this, long_name] {
         SparsePullRequest request;
         request.set_protocol_version(kProtocolVersion);
         request.set_worker_id(-1);
         request.set_step(1);
         request.set_table(long_name);
         SparsePullResponse response;
         return stubs_[0]->SparsePull(Context().get(), request, &response);
       },
       kInvalid, "...' (70000 bytes)"},
      {"sparse push: a 70,000-character table name",
       [this, long_name] {
         SparsePushRequest request;
         request.set_protocol_version(kProtocolVersion);
         request.set_worker_id(0);
         request.set_step(1);
         request.set_table(long_name);
         SparsePushResponse response;
         return stubs_[0]->SparsePush(Context().get(), request, &response);
       },
       kInvalid, "unknown sparse table 'nnnnnnnn"},
      {"sparse changes: a table this model lacks",
       [this, long_name] {
         SparseChangesRequest request;
         request.set_protocol_version(kProtocolVersion);
         TableChangeMark* since = request.add_since();
         since->set_table(long_name);
         since->set_mark(1);
         SparseChangesResponse response;
         return stubs_[0]->SparseChanges(Context().get(), request, &response);
       },
       kInvalid, "changes request of 1 tables (this model has 0)"},
      {"sparse changes: a cursor past its tables",
       [this] {
         SparseChangesRequest request;
         request.set_protocol_version(kProtocolVersion);
         request.set_table_index(5);
         SparseChangesResponse response;
         return stubs_[0]->SparseChanges(Context().get(), request, &response);
       },
       kInvalid, "cursor at table 5"},
      {"sparse changes: a table asked twice",
       [this] {
         SparseChangesRequest request;
         request.set_protocol_version(kProtocolVersion);
         for (int i = 0; i < 2; ++i) {
           TableChangeMark* since = request.add_since();
           since->set_table("nope");
           since->set_mark(1);
         }
         SparseChangesResponse response;
         return stubs_[0]->SparseChanges(Context().get(), request, &response);
       },
       kInvalid, "changes request of 2 tables"},
      {"sparse changes: a negative page size",
       [this] {
         SparseChangesRequest request;
         request.set_protocol_version(kProtocolVersion);
         request.set_max_bytes(-1);
         SparseChangesResponse response;
         return stubs_[0]->SparseChanges(Context().get(), request, &response);
       },
       kInvalid, "page of -1 bytes"},
      {"sparse changes: protocol version 2",
       [this] {
         SparseChangesRequest request;
         request.set_protocol_version(2);
         SparseChangesResponse response;
         return stubs_[0]->SparseChanges(Context().get(), request, &response);
       },
       kPrecondition, "protocol version 2 is not supported"},
      // Not a method of the service.
      {"unknown method", raw("/pstrain.ParameterServer/Nope", valid_push),
       grpc::StatusCode::UNIMPLEMENTED, "", 0},
  };
  RunTable(cases, /*step=*/1, after_step0);

  // The job goes on exactly: worker 1's step-1 gradient (3) completes the
  // step with worker 0's (1) that every row above left in place.
  ASSERT_TRUE(RawPush(0, Push(1, 1, 3.0f), &pushed).ok());
  EXPECT_EQ(pushed.blocks_applied(), 2);
  EXPECT_EQ(PullModel(2), std::vector<float>(kElements, -0.5f));
  const StatsResponse stats = Stats(0);
  EXPECT_EQ(stats.version(), 2);
  EXPECT_EQ(stats.blocks_applied(), 8);  // 4 pushes of 2 blocks
  EXPECT_TRUE(cluster_->server(0).running());
}

// A call stream (PushStream/PullStream) answers its messages in order, each
// as the unary call would; a bad message ends the stream with the unary
// call's error and changes nothing, and a new stream carries on.
TEST_F(HostileInputTest, CallStreamsAnswerInOrderAndEndOnABadMessage) {
  Start(1, "sync");
  auto open = [this](grpc::ClientContext* context, const char* method) {
    return OpenCallStream(0, context, method);
  };
  auto bytes_of = [](const std::string& bytes) {
    grpc::Slice slice(bytes.data(), bytes.size());
    return grpc::ByteBuffer(&slice, 1);
  };
  auto string_of = [](const grpc::ByteBuffer& buffer) {
    std::vector<grpc::Slice> slices;
    EXPECT_TRUE(buffer.Dump(&slices).ok());
    std::string out;
    for (const grpc::Slice& s : slices) {
      out.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    return out;
  };

  grpc::ClientContext push_context;
  std::unique_ptr<CallStream> pushes =
      open(&push_context, "/pstrain.ParameterServer/PushStream");
  grpc::ByteBuffer reply;
  for (const PushRequest& push : {Push(0, 0, 1.0f), Push(1, 0, 3.0f)}) {
    ASSERT_TRUE(pushes->Write(bytes_of(push.SerializeAsString())));
    ASSERT_TRUE(pushes->Read(&reply));
    PushResponse response;
    ASSERT_TRUE(response.ParseFromString(string_of(reply)));
    EXPECT_EQ(response.blocks_applied(), 2);
  }
  const int64_t rejected = Stats(0).requests_rejected();
  ASSERT_TRUE(pushes->Write(bytes_of(std::string("\x07garbage", 8))));
  EXPECT_FALSE(pushes->Read(&reply));
  const grpc::Status ended = pushes->Finish();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(ended.error_message().find("malformed PushRequest"),
            std::string::npos)
      << ended.error_message();
  EXPECT_EQ(Stats(0).requests_rejected(), rejected + 1);

  // Step 0 was applied once (mean gradient 2), whatever came after.
  grpc::ClientContext pull_context;
  std::unique_ptr<CallStream> pulls =
      open(&pull_context, "/pstrain.ParameterServer/PullStream");
  ASSERT_TRUE(pulls->Write(bytes_of(Pull(-1, 1).SerializeAsString())));
  ASSERT_TRUE(pulls->Read(&reply));
  EXPECT_EQ(PullModel(1), std::vector<float>(kElements, 0.5f));
  EXPECT_EQ(Stats(0).version(), 1);
  pulls->WritesDone();
  EXPECT_TRUE(pulls->Finish().ok());
  EXPECT_TRUE(cluster_->server(0).running());
}

// A worker's call stream stays open between steps, waiting for its next
// request with no deadline of its own: SIGTERM must end it, not wait out
// the whole grace period.
TEST_F(HostileInputTest, ShutdownDoesNotWaitForOpenCallStreams) {
  Start(1, "sync", {"--shutdown_grace_s=60"});
  grpc::ClientContext context;
  std::unique_ptr<CallStream> pulls =
      OpenCallStream(0, &context, "/pstrain.ParameterServer/PullStream");
  const std::string pull = Pull(-1, 0).SerializeAsString();
  grpc::Slice slice(pull.data(), pull.size());
  ASSERT_TRUE(pulls->Write(grpc::ByteBuffer(&slice, 1)));
  grpc::ByteBuffer reply;
  ASSERT_TRUE(pulls->Read(&reply));
  const absl::Time start = absl::Now();
  const absl::Status stopped = cluster_->StopServer(0);  // waits up to 30 s
  EXPECT_TRUE(stopped.ok()) << stopped;
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_FALSE(pulls->Read(&reply));
  EXPECT_EQ(pulls->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

TEST_F(HostileInputTest, AsyncServerRefusesBadRequestsAndSkipsNonFinite) {
  // async, with non-finite gradients acknowledged and left out.
  Start(1, "async", {"--nonfinite_gradients=skip"});
  PushResponse pushed;
  ASSERT_TRUE(RawPush(0, Push(0, 0, 1.0f), &pushed).ok());
  ASSERT_TRUE(RawPush(0, Push(1, 0, 3.0f), &pushed).ok());
  // w = 1.5 - 0.5 * 1 - 0.5 * 3; each block at version 2.
  const std::vector<float> expected(kElements, -0.5f);
  ASSERT_EQ(PullModel(2), expected);

  const auto push = [this](PushRequest request) {
    return [this, request] { return RawPush(0, request); };
  };
  std::vector<Case> cases = {
      {"push: an older step of worker 0 (a retry)",
       [this] {
         PushResponse response;
         grpc::Status status = RawPush(0, Push(0, 0, 5.0f), &response);
         EXPECT_EQ(response.blocks_duplicate(), 2);
         return status;
       },
       grpc::StatusCode::OK, "", 0, 2},
      {"push: worker 1 repeats step 0",
       [this] {
         PushResponse response;
         grpc::Status status = RawPush(0, Push(1, 0, 3.0f), &response);
         EXPECT_EQ(response.blocks_duplicate(), 2);
         return status;
       },
       grpc::StatusCode::OK, "", 0, 2},
      {"push: negative step", push(Push(0, -2, 1.0f)),
       grpc::StatusCode::INVALID_ARGUMENT, "step must be in [0, 2^53), got -2"},
      {"push: worker 2^31-1", push(Push(kInt32Max, 1, 1.0f)),
       grpc::StatusCode::INVALID_ARGUMENT, "got 2147483647"},
      {"push: wrong length", push(PushBlock0(Floats({1, 2}))),
       grpc::StatusCode::INVALID_ARGUMENT, "payload has 8 bytes, expected 16"},
      {"push: oversized", push(PushBlock0(std::string(3 << 20, '\0'))),
       grpc::StatusCode::RESOURCE_EXHAUSTED, "larger than max", 0},
  };
  RunTable(cases, /*step=*/2, expected);

  // A NaN gradient is acknowledged as applied but left out of the update:
  // the values and the versions stay.
  const StatsResponse before = Stats(0);
  PushRequest nan = Push(0, 1, 1.0f);
  nan.mutable_blocks(0)->set_data(Floats({NAN, 1, 1, 1}));
  nan.mutable_blocks(1)->set_data(Floats({1, 1, INFINITY, 1}));
  ASSERT_TRUE(RawPush(0, nan, &pushed).ok());
  EXPECT_EQ(pushed.blocks_applied(), 2);
  const StatsResponse after = Stats(0);
  EXPECT_EQ(after.nonfinite_gradients_skipped(),
            before.nonfinite_gradients_skipped() + 2);
  EXPECT_EQ(after.version(), 2);
  EXPECT_EQ(PullModel(2), expected);
  // ... and worker 0's step 1 is taken: resending it is a duplicate.
  ASSERT_TRUE(RawPush(0, Push(0, 1, 1.0f), &pushed).ok());
  EXPECT_EQ(pushed.blocks_duplicate(), 2);
  EXPECT_EQ(PullModel(2), expected);
}

TEST_F(HostileInputTest, BlocksOfAnotherShardAreRefused) {
  Start(2, "sync");
  // Block 0 lives on shard 0, block 1 on shard 1.
  const std::vector<float> initial(kElements, 1.5f);
  ASSERT_EQ(PullModel(0), initial);
  std::vector<Case> cases = {
      {"pull: block 1 from shard 0",
       [this] {
         PullRequest p = Pull(0, 0);
         BlockRef* ref = p.add_blocks();
         ref->set_tensor("w");
         ref->set_block(1);
         return RawPull(0, p);
       },
       grpc::StatusCode::INVALID_ARGUMENT,
       "tensor 'w' block 1 lives on shard 1, this is shard 0"},
      {"push: blocks 0 and 1 to shard 0",
       [this] { return RawPush(0, Push(0, 0, 1.0f)); },
       grpc::StatusCode::INVALID_ARGUMENT,
       "tensor 'w' block 1 lives on shard 1, this is shard 0"},
      {"register: as if there were one shard",
       [this] { return Register(0, Schema(), 0, kProtocolVersion, 1); },
       grpc::StatusCode::FAILED_PRECONDITION,
       "client expects 1 shards but this server was started with "
       "--num_shards=2"},
  };
  RunTable(cases, /*step=*/0, initial);
  // The refused two-block push left nothing behind on shard 0: both
  // workers' block-0 gradients complete step 0 there, exactly.
  PushResponse pushed;
  ASSERT_TRUE(RawPush(0, Push(0, 0, 1.0f, {0}), &pushed).ok());
  ASSERT_TRUE(RawPush(0, Push(1, 0, 3.0f, {0}), &pushed).ok());
  EXPECT_EQ(Stats(0).version(), 1);
  EXPECT_EQ(Stats(1).version(), 0);
}

// Known problems, found while writing this test; disabled until fixed
// (run with --gtest_also_run_disabled_tests to see them fail).

// A pull is a read: it must not complete a sync step. Since 3c99641 a
// member's Pull(step s) counts its own step s-1 gradient as lost when a
// block lacks it, so a worker that pulls before it pushed (a client bug, a
// spoofed id) completes the step without its gradient, and the gradient it
// then sends is acknowledged as a duplicate and dropped.
TEST_F(HostileInputTest, APullNeverCompletesAStepWithoutTheGradient) {
  Start(1, "sync");
  PushResponse pushed;
  ASSERT_TRUE(RawPush(0, Push(0, 0, 1.0f), &pushed).ok());
  // Worker 1 has not pushed step 0: its pull must wait, not complete it.
  EXPECT_EQ(Raw(0, kPullMethod, Pull(1, 1).SerializeAsString(), nullptr,
                absl::Seconds(1))
                .error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(Stats(0).version(), 0);
  ASSERT_TRUE(RawPush(0, Push(1, 0, 3.0f), &pushed).ok());
  EXPECT_EQ(pushed.blocks_applied(), 2);
  EXPECT_EQ(pushed.blocks_duplicate(), 0);
  // 1.5 - 0.5 * mean(1, 3)
  EXPECT_EQ(PullModel(1), std::vector<float>(kElements, 0.5f));
}

// The first RegisterModel installs whatever valid schema it carries, up to
// 2^40 elements per tensor and with no bound on the total. Here one block
// of 2^40 floats (4 TiB): the allocation throws std::bad_alloc inside the
// handler, gRPC catches it and the client gets UNIMPLEMENTED with an empty
// message; the server survives only because the single allocation fails at
// once. The same model in 16 MiB blocks would be allocated block by block
// until the machine runs out of memory (not run here). It should be refused
// up front, with a status naming a configurable limit.
TEST_F(HostileInputTest, AHugeFirstRegistrationIsRefusedClearly) {
  Start(1, "async", {}, /*register_model=*/false);
  ModelSchema huge = Schema();
  huge.mutable_dense(0)->set_shape(0, int64_t{1} << 40);
  huge.set_block_elements(int64_t{1} << 40);
  const grpc::Status status = Register(0, huge, -1);
  EXPECT_TRUE(status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED ||
              status.error_code() == grpc::StatusCode::INVALID_ARGUMENT)
      << status.error_code() << ": '" << status.error_message() << "'";
  EXPECT_FALSE(status.error_message().empty());
  EXPECT_TRUE(cluster_->server(0).running()) << cluster_->server(0).Stderr();
  EXPECT_TRUE(Register(0, Schema(), -1).ok());
}

// Resident memory of a process, from /proc.
int64_t ResidentBytes(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (absl::StartsWith(line, "VmRSS:")) {
      int64_t kib = 0;
      std::istringstream(line.substr(6)) >> kib;
      return kib << 10;
    }
  }
  ADD_FAILURE() << "no VmRSS for process " << pid;
  return 0;
}

ModelSchema TinyBlocks(int64_t elements) {
  ModelSchema schema = Schema();
  schema.mutable_dense(0)->set_shape(0, elements);
  schema.set_block_elements(1);
  return schema;
}

// Issue 14: the guard counted only the floats, so a model in blocks of one
// element grew the server ~100x more than it was counted for, and the
// block layout of a huge model was built (for seconds, then failing with
// UNIMPLEMENTED and no message) before the guard ran.
TEST_F(HostileInputTest, TheMemoryGuardCountsBlocksAndAllocatesNothingFirst) {
  constexpr int64_t kLimitMiB = 100;
  const std::vector<std::string> flags = {"--max_shard_memory_gb=0.09765625"};
  Start(1, "sync", flags, /*register_model=*/false);
  const int64_t rss_before = ResidentBytes(cluster_->server(0).pid());

  // 400,000 floats are 3 MiB with their gradient sum; the blocks around
  // them are not.
  grpc::Status status = Register(0, TinyBlocks(400000), -1);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << status.error_message();
  EXPECT_NE(status.error_message().find("bookkeeping"), std::string::npos)
      << status.error_message();
  // 3e9 blocks: refused from the schema alone, at once.
  const absl::Time start = absl::Now();
  status = Register(0, TinyBlocks(3000000000), -1);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << status.error_message();
  EXPECT_NE(status.error_message().find("3000000000 blocks"), std::string::npos)
      << status.error_message();
  // Neither refusal allocated its model.
  EXPECT_LT(ResidentBytes(cluster_->server(0).pid()) - rss_before, 16 << 20);

  // What a block really costs: a model the guard admits, measured.
  constexpr int64_t kBlocks = 50000;
  ASSERT_TRUE(Register(0, TinyBlocks(kBlocks), -1).ok());
  const double bytes_per_block =
      static_cast<double>(ResidentBytes(cluster_->server(0).pid()) -
                          rss_before) /
      kBlocks;
  ASSERT_GT(bytes_per_block, 0);
  // At that cost the limit holds this many blocks; a fresh server must
  // refuse a model 10% bigger, so the guard counts at least what the memory
  // grows by.
  const int64_t fits =
      static_cast<int64_t>((kLimitMiB << 20) / bytes_per_block);
  cluster_->KillServer(0);
  ASSERT_TRUE(cluster_->RestartServer(0).ok());
  status = Register(0, TinyBlocks(fits + fits / 10), -1);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << bytes_per_block << " bytes per block measured; "
      << status.error_message();
  std::cout << "[ guard ] a block of 1 element costs " << bytes_per_block
            << " bytes of server memory; a model of " << fits + fits / 10
            << " such blocks is refused under " << kLimitMiB << " MiB\n";
  EXPECT_TRUE(Register(0, Schema(), -1).ok());
}

}  // namespace
}  // namespace pstrain
