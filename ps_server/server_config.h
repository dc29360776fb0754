// The server as plain values: what ps_server's flags set
// (ps_server/server_flags.cc reads them), one validation naming every
// problem at once, and the options of the parts the server is assembled
// from (ps_server/server_run.h). The worker's twin is worker/worker_config.h.
#ifndef PSTRAIN_PS_SERVER_SERVER_CONFIG_H_
#define PSTRAIN_PS_SERVER_SERVER_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/protocol.h"
#include "common/transport/grpc_tuning.h"
#include "ps_server/checkpointer.h"
#include "ps_server/replication.h"
#include "ps_server/shard.h"

namespace pstrain {

// Where the server listens and how it talks.
struct ServerNetworkConfig {
  std::string host = "0.0.0.0";
  int port = 0;       // 0: a free one, written to port_file
  int data_port = 0;  // 0: a free one; -1: tensors over gRPC only
  std::string port_file;
  int health_port = 0;   // 0: health on --port only
  int metrics_port = 0;  // 0: off; -1: a free one (metrics_port_file)
  std::string metrics_host = "0.0.0.0";
  std::string metrics_port_file;
  int max_message_mb = kDefaultMaxMessageBytes >> 20;
  GrpcTuning grpc_tuning;
  double shutdown_grace_s = 5;
  // With TLS: the data plane's handshake bound, and kernel TLS.
  double data_plane_handshake_s = 10;
  bool data_plane_ktls = false;
};

struct ServerTlsConfig {
  std::string cert, key, client_ca;  // none: plaintext
  std::string auth_token_file;       // empty: no token
  // --replicas > 1 with TLS: what the other replicas' certificates must
  // chain to (empty: client_ca).
  std::string replica_ca;
};

struct ServerConfig {
  // The job and this shard's place in it.
  int shard_id = 0;
  int num_shards = 1;
  int num_workers = 1;
  int max_workers = 0;
  std::string mode = "sync";
  int staleness = 3;
  int replicas_to_aggregate = 0;
  std::string sync_sum_order = "worker_id";
  double worker_lease_s = 10;
  double startup_timeout_s = 600;
  int min_workers = 0;
  // The update rule of tensors that bring none of their own.
  std::string optimizer = "sgd";
  double learning_rate = 0;  // 0: the optimizer's default
  double weight_decay = 0;
  double momentum = 0.9;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_epsilon = 1e-8;
  std::string nonfinite_gradients = "reject";
  double max_pull_wait_s = 120;
  int64_t sparse_max_rows = 0;
  int sparse_admit_after = 0;
  absl::Duration sparse_row_ttl = absl::InfiniteDuration();
  int64_t sparse_row_ttl_steps = 0;
  double sparse_memory_gb = 0;
  double max_shard_memory_gb = 16;
  // The shard's replica set (ps_server/replication.h): how many server
  // processes hold it, this one's index, the gRPC address of each (by
  // index; this one's included), and how long a replica may be silent
  // before the next one takes over.
  int replicas = 1;
  int replica_index = 0;
  std::vector<std::string> replica_hosts;
  double replica_takeover_s = 2;
  int replica_catchup_chunk_kib =
      static_cast<int>(ReplicaOptions().catchup_chunk_bytes >> 10);
  // Checkpoints (none without a directory; with replicas, each writes its
  // own, under replica-<index>/ of it).
  std::string checkpoint_dir;
  int64_t checkpoint_every_steps = 0;
  double checkpoint_every_s = 0;
  int keep_checkpoints = 3;
  // How long a server waits for another process holding its shard's
  // checkpoints in checkpoint_dir (CheckpointDirLock) before it exits.
  double checkpoint_dir_wait_s = 30;
  ServerNetworkConfig network;
  ServerTlsConfig tls;
  // Fault injection: answer UNAVAILABLE after applying a push.
  double inject_drop_push_response_probability = 0;
  // Fault injection: die (SIGKILL) at "register" (a worker's first
  // RegisterModel) or "final_state" (a worker's first request for the job's
  // final state, CheckpointRequest.final_version); "": never.
  std::string inject_crash_at;
};

// Every problem with `config`, one status each, worded by the flag that
// sets it ("--port must be in [0, 65535], got 70000"). Reads the TLS and
// token files, as serving would.
std::vector<absl::Status> ServerConfigProblems(const ServerConfig& config);

// The options of the parts, from a config without problems.
ShardOptions ShardOptionsOf(const ServerConfig& config);
CheckpointerOptions CheckpointerOptionsOf(const ServerConfig& config);
ReplicaOptions ReplicaOptionsOf(const ServerConfig& config);

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_SERVER_CONFIG_H_
