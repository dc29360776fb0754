#include "common/transport/grpc_status.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace pstrain {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // A message travels in the call's trailers, which gRPC bounds: one too
  // long is never sent and the client gets no answer. QuoteForStatus keeps
  // what a request contributes small; this keeps any message sendable.
  constexpr size_t kMaxMessageBytes = 8 << 10;
  std::string message(status.message());
  if (message.size() > kMaxMessageBytes) {
    const size_t cut = message.size() - kMaxMessageBytes;
    message.resize(kMaxMessageBytes);
    absl::StrAppend(&message, "... (", cut, " more bytes cut)");
  }
  // Both enums use the canonical Google RPC code numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::move(message));
}

absl::Status FromGrpcStatus(const grpc::Status& status,
                            absl::string_view context) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(context, ": ", status.error_message()));
}

}  // namespace pstrain
