// The worker's view of the parameter servers: one logical model spread over
// every shard. Pull and Push move the model block by block: blocks are
// grouped into RPCs of about one block's bytes, spread over several
// connections per shard, and all of a call's RPCs are in flight at once.
// Payloads are not copied on the way out (gradient memory is sent as is) and
// are decoded straight from gRPC's buffers into the destination on the way
// in. Every RPC carries a deadline, so no call blocks forever.
//
// Not thread-safe: one PsClient per worker thread.
#ifndef PSTRAIN_WORKER_PS_CLIENT_H_
#define PSTRAIN_WORKER_PS_CLIENT_H_

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/partition.h"
#include "common/wire.h"
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
  // TCP connections to each shard; a shard's RPCs are spread over them.
  int connections_per_shard = 4;
  // Element type of pushed gradients on the wire (servers decode to fp32).
  DataType gradient_wire_type = FLOAT32;
};

class PsClient {
 public:
  static absl::StatusOr<std::unique_ptr<PsClient>> Create(
      const PsClientOptions& options);
  ~PsClient();

  // Registers the schema on every shard (idempotent) and fixes the block
  // layout used by Pull and Push. Returns the servers' consistency mode.
  absl::StatusOr<std::string> Register(const ModelSchema& schema,
                                       int num_workers);

  // Fills tensors[i] (host memory of schema.dense(i)'s element count) with
  // the model at `step` (sync: after exactly `step` updates; async: the
  // current one) and remembers each block's version for the next Push.
  absl::Status Pull(int worker_id, int64_t step,
                    const std::vector<float*>& tensors);

  // Sends the gradient of every tensor; the memory must stay unchanged until
  // Push returns. Returns the number of blocks the servers reported as
  // duplicates (already received, not applied again).
  absl::StatusOr<int64_t> Push(int worker_id, int64_t step,
                               const std::vector<const float*>& gradients);

  absl::StatusOr<std::vector<StatsResponse>> Stats();

  int num_shards() const { return static_cast<int>(options_.hosts.size()); }

 private:
  // One RPC's share of the model: some blocks of one shard.
  struct Group {
    int shard = 0;
    int connection = 0;
    std::vector<int> blocks;   // global block indices
    std::string pull_request;  // serialized PullRequest, step filled per call
  };
  struct Call;

  explicit PsClient(const PsClientOptions& options);

  // Starts `calls` of `method` ("Pull") at once and waits for all of them;
  // returns the first failure, naming the shard.
  absl::Status RunAll(const char* method, std::vector<Call>& calls,
                      absl::Duration timeout);
  grpc::GenericStub& Connection(int shard, int connection) {
    return *stubs_[shard * options_.connections_per_shard + connection];
  }
  absl::Status StoreBlocks(const Group& group, const WirePullResponse& response,
                           const std::vector<float*>& tensors);

  PsClientOptions options_;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs_;  // [shard][conn]
  std::vector<std::unique_ptr<ParameterServer::Stub>> control_;  // per shard
  std::unique_ptr<Partition> partition_;
  ModelSchema schema_;
  std::vector<Group> groups_;
  std::vector<int64_t> block_versions_;  // per global block, from Pull
  // Reused across steps: encoded gradients when the wire type is not fp32.
  std::vector<std::string> encoded_;
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_PS_CLIENT_H_
