// absl::Status is the error type inside both binaries; grpc::Status exists
// only at the RPC boundary. These convert between them without losing the
// code or the message.
#ifndef PSTRAIN_COMMON_TRANSPORT_GRPC_STATUS_H_
#define PSTRAIN_COMMON_TRANSPORT_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace pstrain {

grpc::Status ToGrpcStatus(const absl::Status& status);

// `context` (e.g. "Pull from 127.0.0.1:4000") is prefixed to the message so
// a worker's error says which peer and call failed.
absl::Status FromGrpcStatus(const grpc::Status& status,
                            absl::string_view context);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_TRANSPORT_GRPC_STATUS_H_
