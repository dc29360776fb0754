// The gRPC face of a shard, on gRPC's callback API: no thread is held while
// a sync pull waits for its step. Push and Pull are raw methods so tensor
// payloads are neither copied into nor out of protobuf strings: a push is
// decoded straight from the received slices into the shard, and a pull's
// response references the copied block values.
#ifndef PSTRAIN_PS_SERVER_SERVICE_H_
#define PSTRAIN_PS_SERVER_SERVICE_H_

#include "proto/ps.grpc.pb.h"
#include "ps_server/shard.h"

namespace pstrain {

using ParameterServerRawService = ParameterServer::WithRawCallbackMethod_Pull<
    ParameterServer::WithRawCallbackMethod_Push<
        ParameterServer::CallbackService>>;

class ParameterServerService final : public ParameterServerRawService {
 public:
  explicit ParameterServerService(Shard* shard) : shard_(shard) {}

  grpc::ServerUnaryReactor* RegisterModel(
      grpc::CallbackServerContext* context, const RegisterModelRequest* request,
      RegisterModelResponse* response) override;
  grpc::ServerUnaryReactor* Pull(grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Push(grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* context,
                                  const StatsRequest* request,
                                  StatsResponse* response) override;

 private:
  Shard* shard_;
};

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_SERVICE_H_
