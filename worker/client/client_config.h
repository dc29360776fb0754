// The worker's connection to the servers as plain values: what the worker
// binary's --ps_hosts, --rpc_timeout_s, --tls_*, --gradient_wire_type...
// flags set (worker/worker_flags.cc), what the Python binding
// (worker/python/c_api.cc) fills from its keyword options, and what the
// export tool's flags set. The options are listed once, in
// client_options.h; one set of defaults (these member initialisers), one
// validation, one way to the PsClientOptions all hand to PsClient::Create.
#ifndef PSTRAIN_WORKER_CLIENT_CLIENT_CONFIG_H_
#define PSTRAIN_WORKER_CLIENT_CLIENT_CONFIG_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/protocol.h"
#include "common/transport/grpc_tuning.h"
#include "common/transport/tls.h"
#include "worker/client/ps_client.h"

namespace pstrain {

struct ClientConfig {
  // host:port of every shard, in shard order (--ps_hosts, comma-separated).
  std::vector<std::string> hosts;
  // Deadline of each pull/push (a sync pull waits for all workers).
  double rpc_timeout_s = 120;
  // How long to wait for the servers to come up.
  double connect_timeout_s = 60;
  // Largest message sent or received, in MiB.
  int max_message_mb = kDefaultMaxMessageBytes >> 20;
  // TCP connections to each ps_server (0: by host).
  int connections_per_shard = 0;
  // A push or pull that is one RPC goes on a long-lived stream.
  bool call_streams = true;
  // Dense tensors over the servers' data plane where they announce one.
  bool data_plane = true;
  // Requests a data-plane connection sends ahead of their answers.
  int data_requests_in_flight = 0;
  // Sync with --replicas=2: half the shards' values come from backups:
  // by_host (where the primary is on another host), always or never.
  std::string pulls_from_backups = "by_host";
  // With TLS: the kernel encrypts the data plane's records where it can.
  bool data_plane_ktls = false;
  // How often to renew this worker's lease on the servers.
  double heartbeat_interval_s = 2;
  // How long a failed pull or push is retried before giving up.
  double retry_window_s = 120;
  // Gradients on the wire: fp32, fp16, bf16 or topk.
  std::string gradient_wire_type = "fp32";
  // Parameters pulled on the wire: fp32, fp16 or bf16.
  std::string parameter_wire_type = "fp32";
  // With topk: the fraction of each block's elements a push sends.
  double gradient_topk_fraction = 0.01;
  // Steps a pulled embedding row is reused for (0: no cache), and the
  // cache's memory in MiB.
  int sparse_cache_steps = 0;
  int sparse_cache_mb = 256;
  // Fault injection: resend a successful push with this probability.
  double inject_duplicate_push_probability = 0;
  // Fault injection: delay every push by a random time up to this.
  double inject_push_jitter_ms = 0;
  // --tls_ca, --tls_cert, --tls_key, --tls_server_name; any set: TLS.
  ClientTlsFiles tls;
  // The servers' shared token (empty: none).
  std::string auth_token_file;
  // HTTP/2 and socket settings (the --grpc_* flags,
  // common/transport/grpc_tuning.h).
  GrpcTuning grpc_tuning;
};

// Every problem with `config`, one status each, worded by the flag that
// sets it ("--rpc_timeout_s must be >= 0.001, got 0"). Reads the TLS and
// token files, as connecting would. No hosts at all is no problem here:
// whoever requires them says so (the worker unless --eval_only).
std::vector<absl::Status> ClientConfigProblems(const ClientConfig& config);

// The PsClientOptions `config` describes (TLS credentials and the token
// read from their files), or every problem at once (JoinProblems of
// ClientConfigProblems). `on_retry` is left for the caller.
absl::StatusOr<PsClientOptions> MakePsClientOptions(const ClientConfig& config);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_CLIENT_CLIENT_CONFIG_H_
