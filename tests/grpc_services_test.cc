// ps_server's standard gRPC services: health checking (grpc.health.v1, on the
// main port and on the plaintext --health_port) and server reflection, as a
// Kubernetes grpc probe, grpcurl or grpc_cli would use them.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/ps.grpc.pb.h"
#include "tests/http_util.h"
#include "tests/proto/health.grpc.pb.h"
#include "tests/proto/reflection.grpc.pb.h"
#include "tests/test_cluster.h"

namespace pstrain {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;
using grpc::reflection::v1alpha::ServerReflection;
using grpc::reflection::v1alpha::ServerReflectionRequest;
using grpc::reflection::v1alpha::ServerReflectionResponse;
using ::testing::IsSupersetOf;

std::unique_ptr<grpc::ClientContext> Context() {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::seconds(10));
  return context;
}

struct Check {
  grpc::Status status;
  HealthCheckResponse::ServingStatus serving = HealthCheckResponse::UNKNOWN;
};

Check HealthCheck(const std::string& target, const std::string& service) {
  auto stub = Health::NewStub(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  HealthCheckRequest request;
  request.set_service(service);
  HealthCheckResponse response;
  Check check;
  check.status = stub->Check(Context().get(), request, &response);
  check.serving = response.status();
  return check;
}

class GrpcServicesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    health_port_ = testing::FreePort();
    testing::ClusterOptions options;
    options.server_flags = {absl::StrCat("--health_port=", health_port_)};
    absl::StatusOr<std::unique_ptr<testing::TestCluster>> cluster =
        testing::TestCluster::Start(options, "grpc_services");
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
  }

  int health_port_ = 0;
  std::unique_ptr<testing::TestCluster> cluster_;
};

TEST_F(GrpcServicesTest, HealthOnTheMainAndTheHealthPort) {
  for (const std::string& target :
       {cluster_->HostList()[0], absl::StrCat("127.0.0.1:", health_port_)}) {
    for (const char* service : {"", "pstrain.ParameterServer"}) {
      const Check check = HealthCheck(target, service);
      EXPECT_TRUE(check.status.ok())
          << target << " '" << service << "': " << check.status.error_message();
      EXPECT_EQ(check.serving, HealthCheckResponse::SERVING)
          << target << " '" << service << "'";
    }
    // A service the server does not have is NOT_FOUND, as the protocol says.
    EXPECT_EQ(HealthCheck(target, "no.such.Service").status.error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
}

TEST_F(GrpcServicesTest, ReflectionListsAndDescribesTheServices) {
  auto stub = ServerReflection::NewStub(grpc::CreateChannel(
      cluster_->HostList()[0], grpc::InsecureChannelCredentials()));
  auto context = Context();
  auto stream = stub->ServerReflectionInfo(context.get());
  ServerReflectionRequest list;
  list.set_list_services("");
  ASSERT_TRUE(stream->Write(list));
  ServerReflectionResponse response;
  ASSERT_TRUE(stream->Read(&response));
  std::vector<std::string> names;
  for (const auto& service : response.list_services_response().service()) {
    names.push_back(service.name());
  }
  EXPECT_THAT(names, IsSupersetOf(
                         {"pstrain.ParameterServer", "grpc.health.v1.Health"}));

  // The descriptor of the service: what grpcurl needs to call it.
  ServerReflectionRequest describe;
  describe.set_file_containing_symbol("pstrain.ParameterServer");
  ASSERT_TRUE(stream->Write(describe));
  ASSERT_TRUE(stream->Read(&response));
  ASSERT_GT(response.file_descriptor_response().file_descriptor_proto_size(), 0)
      << response.ShortDebugString();
  const std::string& file =
      response.file_descriptor_response().file_descriptor_proto(0);
  EXPECT_NE(file.find("ps.proto"), std::string::npos);
  EXPECT_NE(file.find("Push"), std::string::npos);

  // And of grpc.health.v1.Health, which libgrpc++ serves without a
  // descriptor: a reflection client (grpcurl ... grpc.health.v1.Health/Check)
  // resolves the method through it.
  auto health_context = Context();
  auto health_stream = stub->ServerReflectionInfo(health_context.get());
  describe.set_file_containing_symbol("grpc.health.v1.Health");
  ASSERT_TRUE(health_stream->Write(describe));
  ASSERT_TRUE(health_stream->Read(&response));
  health_stream->WritesDone();
  EXPECT_TRUE(health_stream->Finish().ok());
  ASSERT_GT(response.file_descriptor_response().file_descriptor_proto_size(), 0)
      << response.ShortDebugString();
  const std::string& health =
      response.file_descriptor_response().file_descriptor_proto(0);
  EXPECT_NE(health.find("grpc.health.v1"), std::string::npos)
      << response.ShortDebugString().substr(0, 400);
  EXPECT_NE(health.find("HealthCheckRequest"), std::string::npos);
  EXPECT_NE(health.find("Watch"), std::string::npos);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(GrpcServicesTest, HealthPortServesHealthAlone) {
  // Plaintext for probes, so nothing else: no reflection, no training API.
  const std::string target = absl::StrCat("127.0.0.1:", health_port_);
  auto reflection = ServerReflection::NewStub(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  auto context = Context();
  auto stream = reflection->ServerReflectionInfo(context.get());
  ServerReflectionRequest list;
  list.set_list_services("");
  stream->Write(list);
  ServerReflectionResponse response;
  EXPECT_FALSE(stream->Read(&response));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNIMPLEMENTED);
  auto ps = ParameterServer::NewStub(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  StatsResponse stats;
  EXPECT_EQ(ps->Stats(Context().get(), StatsRequest(), &stats).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
}

TEST_F(GrpcServicesTest, HealthIsNotAffectedByWorkers) {
  // A job runs; the shard stays SERVING throughout and after.
  absl::StatusOr<std::vector<std::string>> outputs = cluster_->RunWorkers(
      {{"--model=softmax", "--steps=20"}}, absl::Seconds(60));
  ASSERT_TRUE(outputs.ok()) << outputs.status();
  EXPECT_EQ(HealthCheck(absl::StrCat("127.0.0.1:", health_port_), "").serving,
            HealthCheckResponse::SERVING);
}

}  // namespace
}  // namespace pstrain
