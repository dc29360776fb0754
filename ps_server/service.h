// The gRPC face of a shard: converts between the wire and Shard's
// absl::Status API. Holds no state of its own.
#ifndef PSTRAIN_PS_SERVER_SERVICE_H_
#define PSTRAIN_PS_SERVER_SERVICE_H_

#include "proto/ps.grpc.pb.h"
#include "ps_server/shard.h"

namespace pstrain {

class ParameterServerService final : public ParameterServer::Service {
 public:
  explicit ParameterServerService(Shard* shard) : shard_(shard) {}

  grpc::Status RegisterModel(grpc::ServerContext* context,
                             const RegisterModelRequest* request,
                             RegisterModelResponse* response) override;
  grpc::Status Pull(grpc::ServerContext* context, const PullRequest* request,
                    PullResponse* response) override;
  grpc::Status Push(grpc::ServerContext* context, const PushRequest* request,
                    PushResponse* response) override;
  grpc::Status Stats(grpc::ServerContext* context, const StatsRequest* request,
                     StatsResponse* response) override;

 private:
  Shard* shard_;
};

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_SERVICE_H_
