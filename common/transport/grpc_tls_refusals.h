// gRPC refuses a failed TLS handshake on its own port and says so only in
// its own log ("Handshake failed with fatal error SSL_ERROR_SSL: ...: peer
// did not return a certificate"), without a count and, in this gRPC
// (1.51), without the peer's address. This routes gRPC's log lines through
// glog, so they land in the server's log like its own, and counts the
// refused handshakes (Stats.grpc_tls_refused,
// pstrain_shard_grpc_tls_refused_total).
#ifndef PSTRAIN_COMMON_TRANSPORT_GRPC_TLS_REFUSALS_H_
#define PSTRAIN_COMMON_TRANSPORT_GRPC_TLS_REFUSALS_H_

#include <cstdint>

namespace pstrain {

// Installs the log hook, once per process (later calls do nothing). Call
// before the gRPC server starts.
void CountGrpcTlsRefusals();

// TLS handshakes gRPC refused since the hook was installed.
int64_t GrpcTlsRefusals();

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_TRANSPORT_GRPC_TLS_REFUSALS_H_
