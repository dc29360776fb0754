// The worker's view of the parameter servers: one logical model spread over
// every shard. Each call fans out to all shards with every RPC in flight at
// once and returns when all have answered (every RPC carries a deadline, so
// no call blocks forever on a dead server).
#ifndef PSTRAIN_WORKER_PS_CLIENT_H_
#define PSTRAIN_WORKER_PS_CLIENT_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/partition.h"
#include "proto/ps.grpc.pb.h"

namespace pstrain {

struct PsClientOptions {
  // host:port of every shard, in shard order.
  std::vector<std::string> hosts;
  // Deadline of each Pull/Push RPC (a sync pull includes waiting for the
  // slowest worker's gradient).
  absl::Duration rpc_timeout = absl::Seconds(120);
  // How long Register waits for servers that are not up yet.
  absl::Duration connect_timeout = absl::Seconds(60);
  int max_message_bytes = 512 << 20;
};

class PsClient {
 public:
  static absl::StatusOr<std::unique_ptr<PsClient>> Create(
      const PsClientOptions& options);

  // Registers the schema on every shard (idempotent) and fixes the block
  // layout used by Pull and Push. Returns the servers' consistency mode.
  absl::StatusOr<std::string> Register(const ModelSchema& schema,
                                       int num_workers);

  // Fills tensors[i] (host memory of schema.dense(i)'s element count) with
  // the model at `step` (sync: after exactly `step` updates; async: the
  // current one) and remembers each shard's version for the next Push.
  absl::Status Pull(int worker_id, int64_t step,
                    const std::vector<float*>& tensors);

  // Sends the gradient of every tensor. Returns the number of shards that
  // reported the push as a duplicate (already received).
  absl::StatusOr<int> Push(int worker_id, int64_t step,
                           const std::vector<const float*>& gradients);

  absl::StatusOr<std::vector<StatsResponse>> Stats();

  int num_shards() const { return static_cast<int>(stubs_.size()); }

 private:
  explicit PsClient(const PsClientOptions& options);

  // Runs `start(shard, context, done)` for every shard at once and waits for
  // all `done` callbacks; returns the first failure, naming the shard.
  template <typename Start>
  absl::Status FanOut(absl::Duration timeout, bool wait_for_ready,
                      absl::string_view what, Start start);

  PsClientOptions options_;
  std::vector<std::unique_ptr<ParameterServer::Stub>> stubs_;
  std::unique_ptr<Partition> partition_;
  ModelSchema schema_;
  // Reused across steps so payload strings keep their capacity.
  std::vector<PushRequest> push_requests_;
  std::vector<PullResponse> pull_responses_;
  std::vector<int64_t> pulled_versions_;
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_PS_CLIENT_H_
