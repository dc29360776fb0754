// Registering with servers that may not be up yet: while Register waits
// (gRPC's wait-for-ready says nothing until the deadline), the worker says
// every few seconds which shard it waits for, why and how long is left, in
// the log and on the progress bar.
#ifndef PSTRAIN_WORKER_CONNECT_WAIT_H_
#define PSTRAIN_WORKER_CONNECT_WAIT_H_

#include "absl/status/statusor.h"
#include "proto/ps.pb.h"
#include "worker/client/ps_client.h"
#include "worker/step_output.h"

namespace pstrain {

// client.Register(schema, num_workers, worker_id), showing the wait for the
// servers (reached through `options`' hosts, TLS and connect timeout) on
// `output` and in the log.
absl::StatusOr<Registration> RegisterShowingWait(
    PsClient& client, const PsClientOptions& options, StepOutput& output,
    const ModelSchema& schema, int num_workers, int worker_id);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_CONNECT_WAIT_H_
