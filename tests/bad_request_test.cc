// One bad request of each kind, over real gRPC to a real ps_server: each
// gets its status code and a message naming the problem, and the server
// keeps serving good requests with its state unchanged.
#include <grpcpp/grpcpp.h>

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/protocol.h"
#include "common/transport/tensor_codec.h"
#include "gtest/gtest.h"
#include "proto/ps.grpc.pb.h"
#include "tests/test_cluster.h"

namespace pstrain {
namespace {

ModelSchema Schema() {
  ModelSchema schema;
  schema.set_seed(5);
  schema.set_block_elements(1024);
  DenseTensorSpec* w = schema.add_dense();
  w->set_name("w");
  w->add_shape(8);
  w->mutable_init()->set_kind(InitSpec::CONSTANT);
  w->mutable_init()->set_value(1.0f);
  return schema;
}

class BadRequestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::ClusterOptions options;
    options.num_shards = 1;
    options.num_workers = 2;
    options.mode = "sync";
    options.server_flags = {"--learning_rate=0.5", "--max_message_mb=1"};
    absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
        testing::TestCluster::Start(options, "bad_requests");
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(64 << 20);
    stub_ = ParameterServer::NewStub(grpc::CreateCustomChannel(
        cluster_->PsHosts(), grpc::InsecureChannelCredentials(), args));
  }

  template <typename Request, typename Response>
  grpc::Status Call(grpc::Status (ParameterServer::Stub::*method)(
                        grpc::ClientContext*, const Request&, Response*),
                    const Request& request, Response* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(10));
    return (stub_.get()->*method)(&context, request, response);
  }

  grpc::Status Register(const ModelSchema& schema, int num_shards = 1) {
    RegisterModelRequest request;
    request.set_protocol_version(kProtocolVersion);
    *request.mutable_schema() = schema;
    request.set_num_shards(num_shards);
    request.set_num_workers(2);
    RegisterModelResponse response;
    return Call(&ParameterServer::Stub::RegisterModel, request, &response);
  }

  static PushRequest Push(int worker, int64_t step, std::vector<float> grad) {
    PushRequest push;
    push.set_protocol_version(kProtocolVersion);
    push.set_worker_id(worker);
    push.set_step(step);
    TensorBlock* block = push.add_blocks();
    block->set_tensor("w");
    EncodeFloat32(grad, block->mutable_data());
    return push;
  }

  // The first weight after a pull at `step`, or NaN on error.
  float PullFirstWeight(int64_t step) {
    PullRequest pull;
    pull.set_protocol_version(kProtocolVersion);
    pull.set_step(step);
    PullResponse response;
    grpc::Status status = Call(&ParameterServer::Stub::Pull, pull, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    if (!status.ok() || response.blocks_size() != 1) return NAN;
    std::vector<float> w(8);
    EXPECT_TRUE(
        DecodeToFloat32(FLOAT32, response.blocks(0).data(), absl::MakeSpan(w))
            .ok());
    return w[0];
  }

  std::unique_ptr<testing::TestCluster> cluster_;
  std::unique_ptr<ParameterServer::Stub> stub_;
};

TEST_F(BadRequestTest, EachBadRequestGetsItsStatusAndTheServerKeepsServing) {
  {
    PullRequest pull;
    pull.set_protocol_version(kProtocolVersion);
    PullResponse response;
    grpc::Status status = Call(&ParameterServer::Stub::Pull, pull, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_NE(status.error_message().find("RegisterModel"), std::string::npos);
  }
  ModelSchema no_tensors = Schema();
  no_tensors.clear_dense();
  EXPECT_EQ(Register(no_tensors).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Register(Schema(), /*num_shards=*/3).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  ASSERT_TRUE(Register(Schema()).ok());
  ModelSchema other = Schema();
  other.mutable_dense(0)->set_shape(0, 9);
  grpc::Status mismatch = Register(other);
  EXPECT_EQ(mismatch.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(mismatch.error_message().find("shape [8] vs [9]"),
            std::string::npos)
      << mismatch.error_message();

  struct Case {
    std::string name;
    PushRequest push;
    grpc::StatusCode code;
    std::string message;
  };
  std::vector<Case> cases = {
      {"wrong length", Push(0, 0, std::vector<float>(7, 1.0f)),
       grpc::StatusCode::INVALID_ARGUMENT, "expected 32"},
      {"worker id", Push(5, 0, std::vector<float>(8, 1.0f)),
       grpc::StatusCode::INVALID_ARGUMENT, "worker_id"},
      {"negative step", Push(0, -3, std::vector<float>(8, 1.0f)),
       grpc::StatusCode::INVALID_ARGUMENT, "step must be in [0, 2^53)"},
      {"future step", Push(0, 4, std::vector<float>(8, 1.0f)),
       grpc::StatusCode::FAILED_PRECONDITION, "step 4"},
      {"nan", Push(0, 0, {1, 1, 1, NAN, 1, 1, 1, 1}),
       grpc::StatusCode::INVALID_ARGUMENT, "NaN"},
      {"oversized", Push(0, 0, std::vector<float>(1 << 19, 1.0f)),
       grpc::StatusCode::RESOURCE_EXHAUSTED, ""},
  };
  {
    PushRequest unknown = Push(0, 0, std::vector<float>(8, 1.0f));
    unknown.mutable_blocks(0)->set_tensor("v");
    cases.push_back({"unknown tensor", unknown,
                     grpc::StatusCode::INVALID_ARGUMENT, "unknown tensor 'v'"});
  }
  for (const Case& c : cases) {
    PushResponse response;
    grpc::Status status = Call(&ParameterServer::Stub::Push, c.push, &response);
    EXPECT_EQ(status.error_code(), c.code)
        << c.name << ": " << status.error_message();
    EXPECT_NE(status.error_message().find(c.message), std::string::npos)
        << c.name << ": " << status.error_message();
    // Still serving, state unchanged.
    EXPECT_FLOAT_EQ(PullFirstWeight(0), 1.0f) << c.name;
  }

  // The good pushes still make exactly one update: 1 - 0.5 * mean(1, 3).
  PushResponse response;
  ASSERT_TRUE(Call(&ParameterServer::Stub::Push,
                   Push(0, 0, std::vector<float>(8, 1.0f)), &response)
                  .ok());
  ASSERT_TRUE(Call(&ParameterServer::Stub::Push,
                   Push(1, 0, std::vector<float>(8, 3.0f)), &response)
                  .ok());
  EXPECT_EQ(response.blocks_applied(), 1);
  EXPECT_FLOAT_EQ(PullFirstWeight(1), 0.0f);
  EXPECT_TRUE(cluster_->server(0).running());
}

// A bad request for the job's final state is refused with its status and
// changes nothing: no job_final_version recorded, the model untouched.
TEST_F(BadRequestTest, BadFinalStateRequestsChangeNothing) {
  CheckpointRequest request;
  CheckpointResponse response;
  request.set_final_version(3);
  EXPECT_EQ(
      Call(&ParameterServer::Stub::Checkpoint, request, &response).error_code(),
      grpc::StatusCode::NOT_FOUND);  // no model yet: register first
  ASSERT_TRUE(Register(Schema()).ok());
  struct Case {
    std::string name;
    int64_t final_version;
    int worker_id;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"negative version", -1, 0, "final_version must be >= 0"},
      {"worker id", 3, 7, "worker_id"},
      {"version past 2^53", int64_t{1} << 53, 0, "step must be in"},
  };
  for (const Case& c : cases) {
    request.set_final_version(c.final_version);
    request.set_worker_id(c.worker_id);
    const grpc::Status status =
        Call(&ParameterServer::Stub::Checkpoint, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.name << ": " << status.error_message();
    EXPECT_NE(status.error_message().find(c.message), std::string::npos)
        << c.name << ": " << status.error_message();
  }
  absl::StatusOr<std::vector<StatsResponse>> stats = cluster_->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ((*stats)[0].job_final_version(), 0);
  EXPECT_FLOAT_EQ(PullFirstWeight(0), 1.0f);
  // A good one (an observer's, no --checkpoint_dir) answers the version.
  request.set_final_version(1);
  request.set_worker_id(-1);
  ASSERT_TRUE(
      Call(&ParameterServer::Stub::Checkpoint, request, &response).ok());
  EXPECT_EQ(response.version(), 0);
  EXPECT_FALSE(response.checkpointed());
  EXPECT_EQ(response.not_checkpointed_reason(), "no --checkpoint_dir");
}

}  // namespace
}  // namespace pstrain
