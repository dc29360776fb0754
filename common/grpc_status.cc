#include "common/grpc_status.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace pstrain {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // Both enums use the canonical Google RPC code numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status,
                            absl::string_view context) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(context, ": ", status.error_message()));
}

}  // namespace pstrain
