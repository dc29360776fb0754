#include "ps_server/service.h"

#include "absl/time/clock.h"
#include "common/grpc_status.h"

namespace pstrain {

grpc::Status ParameterServerService::RegisterModel(
    grpc::ServerContext*, const RegisterModelRequest* request,
    RegisterModelResponse* response) {
  absl::StatusOr<RegisterModelResponse> result = shard_->Register(*request);
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = std::move(*result);
  return grpc::Status::OK;
}

grpc::Status ParameterServerService::Pull(grpc::ServerContext* context,
                                          const PullRequest* request,
                                          PullResponse* response) {
  // gRPC reports "no deadline" as the far future; Shard caps the wait anyway.
  const absl::Time deadline = absl::FromChrono(context->deadline());
  return ToGrpcStatus(shard_->Pull(*request, deadline, response, [context] {
    return context->IsCancelled();
  }));
}

grpc::Status ParameterServerService::Push(grpc::ServerContext*,
                                          const PushRequest* request,
                                          PushResponse* response) {
  return ToGrpcStatus(shard_->Push(*request, response));
}

grpc::Status ParameterServerService::Stats(grpc::ServerContext*,
                                           const StatsRequest*,
                                           StatsResponse* response) {
  *response = shard_->Stats();
  return grpc::Status::OK;
}

}  // namespace pstrain
