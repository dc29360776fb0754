// Registering with servers that may not be up yet: while Register waits
// (gRPC's wait-for-ready says nothing until the deadline), a worker (the
// binary, or pstrain's Python client) says every few seconds which shard it
// waits for, why and how long is left, in the log and on the worker's
// progress bar.
#ifndef PSTRAIN_WORKER_CONNECT_WAIT_H_
#define PSTRAIN_WORKER_CONNECT_WAIT_H_

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "proto/ps.pb.h"
#include "worker/client/ps_client.h"

namespace pstrain {

// client.Register(schema, num_workers, worker_id), saying in the log how
// the wait for the servers (reached through `options`' hosts, TLS and
// connect timeout) goes; `show`, if set, gets each report's first line too.
absl::StatusOr<Registration> RegisterShowingWait(
    PsClient& client, const PsClientOptions& options, const ModelSchema& schema,
    int num_workers, int worker_id,
    std::function<void(const std::string&)> show = nullptr);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_CONNECT_WAIT_H_
