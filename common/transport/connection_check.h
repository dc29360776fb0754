// Why a gRPC server cannot be reached. A client that waits for its servers
// (wait_for_ready) only ever sees "Deadline Exceeded", whatever the cause;
// one raw TCP probe of the address tells the common causes apart.
#ifndef PSTRAIN_COMMON_TRANSPORT_CONNECTION_CHECK_H_
#define PSTRAIN_COMMON_TRANSPORT_CONNECTION_CHECK_H_

#include <string>

#include "absl/time/time.h"

namespace pstrain {

// Probes `host_port` ("host:port") and says, in a phrase a person can act
// on, why a client dialling it with TLS (`client_tls`) or in plaintext
// fails: nothing listening, the name does not resolve, no answer, the
// server expects TLS, or the server serves plaintext. Empty when the probe
// finds the server speaking what the client speaks (the cause is elsewhere).
std::string DiagnoseConnection(const std::string& host_port, bool client_tls,
                               absl::Duration timeout);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_TRANSPORT_CONNECTION_CHECK_H_
