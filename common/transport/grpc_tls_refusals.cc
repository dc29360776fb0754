#include "common/transport/grpc_tls_refusals.h"

#include <grpc/support/log.h>

#include <atomic>
#include <cstring>

#include "glog/logging.h"

namespace pstrain {
namespace {

std::atomic<int64_t> refusals{0};

void LogThroughGlog(gpr_log_func_args* args) {
  // The message gRPC's TLS layer writes for every handshake it fails, on
  // either side; in a server process, a client it refused.
  const bool refused =
      std::strstr(args->message, "Handshake failed") != nullptr;
  if (refused) refusals.fetch_add(1, std::memory_order_relaxed);
  const google::LogSeverity severity = args->severity == GPR_LOG_SEVERITY_ERROR
                                           ? google::GLOG_ERROR
                                           : google::GLOG_INFO;
  google::LogMessage(args->file, args->line, severity).stream()
      << (refused ? "gRPC port: refused a TLS handshake (counted in "
                    "Stats.grpc_tls_refused): "
                  : "gRPC: ")
      << args->message;
}

}  // namespace

void CountGrpcTlsRefusals() {
  static const bool installed = [] {
    gpr_set_log_function(LogThroughGlog);
    return true;
  }();
  (void)installed;
}

int64_t GrpcTlsRefusals() { return refusals.load(std::memory_order_relaxed); }

}  // namespace pstrain
