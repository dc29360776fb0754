// ps_server's flags: where they are defined, with their help, and the one
// function that reads them into a ServerConfig (its defaults are the
// flags' defaults). Validation is ServerConfigProblems'.
#include "ps_server/server_flags.h"

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "common/protocol.h"

namespace {

const pstrain::ServerConfig& Default() {
  static const auto* config = new pstrain::ServerConfig;
  return *config;
}

}  // namespace

ABSL_FLAG(std::string, cluster_spec, "",
          "JSON file describing the job ({\"ps\": [host:port...], "
          "\"workers\": N, \"max_workers\": M, \"mode\": ..., \"task\": "
          "{\"type\": \"ps\", \"index\": i}, \"ps_flags\": {flag: "
          "value...}}); it sets --num_shards, --shard_id, --port, "
          "--num_workers, --max_workers, --mode and the ps_flags unless given "
          "on the command line. Empty: the JSON in $PSTRAIN_CLUSTER, if set.");
ABSL_FLAG(std::string, host, Default().network.host, "Address to listen on.");
ABSL_FLAG(int, port, Default().network.port,
          "Port to listen on; 0 picks a free one.");
ABSL_FLAG(int, data_port, Default().network.data_port,
          "Port of the tensor data plane (Push and Pull over plain TCP, "
          "announced to workers at registration); 0 picks a free one, -1 "
          "serves them over gRPC only. With --tls_cert it speaks TLS 1.3 "
          "with the gRPC port's certificates.");
ABSL_FLAG(std::string, port_file, Default().network.port_file,
          "If set, the chosen port is written here once serving (atomically).");
ABSL_FLAG(int, shard_id, Default().shard_id,
          "This server's shard, in [0, num_shards).");
ABSL_FLAG(int, num_shards, Default().num_shards,
          "Number of parameter-server shards.");
ABSL_FLAG(int, num_workers, Default().num_workers,
          "Number of workers in the job.");
ABSL_FLAG(std::string, mode, Default().mode,
          "Consistency: sync (bulk-synchronous), async (apply on arrival) or "
          "ssp (async with a bound on how far ahead a worker may run).");
ABSL_FLAG(int, staleness, Default().staleness,
          "ssp: a worker may be at most this many steps ahead of the slowest.");
ABSL_FLAG(int, max_workers, Default().max_workers,
          "Elastic jobs: worker ids may go up to max_workers - 1 and workers "
          "may join and leave at step boundaries (0: --num_workers, fixed).");
ABSL_FLAG(int, replicas_to_aggregate, Default().replicas_to_aggregate,
          "sync with backup workers: apply a step once this many gradients "
          "are in; later ones are dropped and counted (0: every worker).");
ABSL_FLAG(std::string, sync_sum_order, Default().sync_sum_order,
          "sync: the order a step's gradients are summed in. worker_id: "
          "ascending worker id, whatever order they arrive in, so the same "
          "job gives the same model bit for bit (gradients that come early "
          "are held until their turn; ps_server/ordered_sum.h). arrival: as "
          "they come, which float addition makes differ from run to run "
          "(a baseline for bench/sum_order_cost.sh).");
ABSL_FLAG(double, worker_lease_s, Default().worker_lease_s,
          "A worker not heard from (requests or heartbeats) for this long is "
          "dropped, and sync steps stop waiting for it. The lease starts at "
          "its first contact: a worker that never came is missing, not "
          "lapsed (see --startup_timeout_s).");
ABSL_FLAG(double, startup_timeout_s, Default().startup_timeout_s,
          "sync/ssp: no step completes before every worker in "
          "[0, num_workers) has registered. After this long the job starts "
          "with those that did if they are at least --min_workers, and "
          "otherwise fails: every worker is told which ids never came. "
          "Generous by default, for workers that wait for a GPU node, an "
          "image pull or a data set.");
ABSL_FLAG(int, min_workers, Default().min_workers,
          "sync/ssp: the fewest workers the job may start with once "
          "--startup_timeout_s has passed; the steps run without the "
          "missing ones are counted as short (0: --num_workers, all).");
ABSL_FLAG(double, inject_drop_push_response_probability,
          Default().inject_drop_push_response_probability,
          "Fault injection: after applying a push, answer UNAVAILABLE with "
          "this probability (the client retries; nothing may apply twice).");
ABSL_FLAG(std::string, inject_crash_at, Default().inject_crash_at,
          "Fault injection: die (SIGKILL) at a moment a test picks: "
          "'register' (a worker's first RegisterModel, before it is "
          "answered) or 'final_state' (a worker's first request for the "
          "job's final state: after the last step, before the final "
          "checkpoint) or 'record_window' (a replicated sync primary that "
          "never took over: it keeps the records of step 5 on, and dies at "
          "the first push of step 6, which its workers send once they read "
          "step 5's model, which its backups lack); empty: never.");
ABSL_FLAG(std::string, optimizer, Default().optimizer,
          "sgd, momentum, adam or adamw (torch.optim.AdamW: decoupled "
          "weight decay), for tensors that do not bring their own "
          "(pstrain.torch hands the servers the user's torch optimizer).");
ABSL_FLAG(double, weight_decay, Default().weight_decay,
          "L2 weight decay of --optimizer, as torch.optim's weight_decay: "
          "added to the gradient (sgd, momentum, adam) or decoupled "
          "(adamw: w *= 1 - lr * weight_decay).");
ABSL_FLAG(double, learning_rate, Default().learning_rate,
          "Optimizer learning rate. 0 (the default): the optimizer's own "
          "default, as PyTorch and Keras users know it: adam 0.001 "
          "(torch.optim.Adam and keras Adam), sgd 0.1 (torchvision's "
          "reference classification recipe; torch.optim.SGD has none), "
          "momentum 0.01 (keras SGD(momentum=0.9)). The rate in effect is "
          "logged at start and told to workers.");
ABSL_FLAG(double, momentum, Default().momentum,
          "Momentum coefficient (--optimizer=momentum).");
ABSL_FLAG(double, adam_beta1, Default().adam_beta1, "Adam beta1.");
ABSL_FLAG(double, adam_beta2, Default().adam_beta2, "Adam beta2.");
ABSL_FLAG(double, adam_epsilon, Default().adam_epsilon, "Adam epsilon.");
ABSL_FLAG(std::string, nonfinite_gradients, Default().nonfinite_gradients,
          "A gradient containing NaN/Inf: 'reject' the push with an error, or "
          "'skip' it (acknowledged, not applied, counted in stats).");
ABSL_FLAG(int, replicas, Default().replicas,
          "Server processes holding this shard (1: this one alone). The "
          "primary forwards every change to the others before it answers, "
          "and one takes over when it dies (ps_server/replication.h).");
ABSL_FLAG(int, replica_index, Default().replica_index,
          "This process's index in its shard's replica set; replica 0 starts "
          "as the primary.");
ABSL_FLAG(std::vector<std::string>, replica_hosts, Default().replica_hosts,
          "With --replicas > 1: the gRPC host:port of each of the shard's "
          "replicas, by index, this one's included (comma-separated).");
ABSL_FLAG(double, replica_takeover_s, Default().replica_takeover_s,
          "How long the primary may be silent (no answer, port not refusing "
          "either: a dead or cut-off host) before a backup takes over; a "
          "primary whose port refuses connections is replaced at once.");
ABSL_FLAG(int, replica_catchup_chunk_kib, Default().replica_catchup_chunk_kib,
          "A replica catching up is sent the state in chunks of this many "
          "KiB, three at a time.");
ABSL_FLAG(double, max_pull_wait_s, Default().max_pull_wait_s,
          "Longest a sync pull waits for its step before DEADLINE_EXCEEDED.");
ABSL_FLAG(int, max_message_mb, Default().network.max_message_mb,
          "Largest request or response accepted, in MiB.");
ABSL_FLAG(std::string, checkpoint_dir, Default().checkpoint_dir,
          "Directory for checkpoints, shared by every shard of the job. At "
          "start the newest valid checkpoint there is restored, also when it "
          "was written by a different number of shards (resharding).");
ABSL_FLAG(int64_t, checkpoint_every_steps, Default().checkpoint_every_steps,
          "sync: checkpoint each time every block has done this many more "
          "steps (0: off).");
ABSL_FLAG(double, checkpoint_every_s, Default().checkpoint_every_s,
          "Checkpoint at least this often, in seconds (0: off).");
ABSL_FLAG(int64_t, sparse_max_rows, Default().sparse_max_rows,
          "Rows kept per sparse table on this shard; beyond it the least "
          "recently used are evicted (0: unbounded).");
ABSL_FLAG(int, sparse_admit_after, Default().sparse_admit_after,
          "A sparse row is created on the N-th sighting of its id (0 or 1: "
          "the first); until then pulls see its initial value, pushes are "
          "dropped and counted.");
ABSL_FLAG(absl::Duration, sparse_row_ttl, Default().sparse_row_ttl,
          "Sparse rows nobody pulled or pushed for this long (e.g. 30m, "
          "at least 1s) are removed and counted (rows_expired); inf: never.");
ABSL_FLAG(int64_t, sparse_row_ttl_steps, Default().sparse_row_ttl_steps,
          "Sparse rows nobody pulled or pushed in this many of the job's "
          "steps are removed and counted (rows_expired); 0: never. Not with "
          "--sparse_row_ttl.");
ABSL_FLAG(double, sparse_memory_gb, Default().sparse_memory_gb,
          "The embedding tables' memory on this server: tables without a "
          "budget of their own (max_bytes) share what the others' budgets "
          "leave of it, evicting least recently used rows (0: no limit).");
ABSL_FLAG(double, max_shard_memory_gb, Default().max_shard_memory_gb,
          "Refuse (RESOURCE_EXHAUSTED) a model whose parameters and "
          "optimizer state would take more memory than this on one shard.");
ABSL_FLAG(int, keep_checkpoints, Default().keep_checkpoints,
          "Checkpoints kept per shard.");
ABSL_FLAG(double, checkpoint_dir_wait_s, Default().checkpoint_dir_wait_s,
          "A live process that holds this shard's checkpoints in "
          "--checkpoint_dir (another job's server, or this shard's previous "
          "one still writing its last checkpoint) is waited for this long, "
          "in seconds; then the server exits 2 naming it.");
ABSL_FLAG(double, shutdown_grace_s, Default().network.shutdown_grace_s,
          "On SIGTERM, how long in-flight calls may take to finish.");
ABSL_FLAG(int, metrics_port, Default().network.metrics_port,
          "Serve Prometheus metrics on http://<metrics_host>:PORT/metrics "
          "(0: off; -1: a free port, see --metrics_port_file).");
ABSL_FLAG(std::string, metrics_host, Default().network.metrics_host,
          "Address the metrics endpoint listens on.");
ABSL_FLAG(std::string, metrics_port_file, Default().network.metrics_port_file,
          "If set, the metrics port is written here once serving.");
ABSL_FLAG(int, health_port, Default().network.health_port,
          "Also serve grpc.health.v1 alone, in plaintext, on this port (for "
          "Kubernetes grpc probes, which cannot do TLS); 0: off. Health is "
          "always served on --port as well.");
ABSL_FLAG(std::string, tls_cert, Default().tls.cert,
          "PEM certificate chain: serve TLS (with --tls_key).");
ABSL_FLAG(std::string, tls_key, Default().tls.key,
          "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, Default().tls.client_ca,
          "PEM CA bundle: require client certificates signed by it (mutual "
          "TLS).");
ABSL_FLAG(std::string, replica_tls_ca, Default().tls.replica_ca,
          "With TLS and --replicas > 1: PEM CA bundle the other replicas' "
          "server certificates must chain to (default: --tls_client_ca). "
          "A replica calls the others as a client presenting --tls_cert, "
          "which --tls_client_ca must then accept (deploy/tls/make_certs.sh "
          "makes server certificates good for both).");
ABSL_FLAG(bool, data_plane_ktls, Default().network.data_plane_ktls,
          "With TLS: let the kernel encrypt the data plane's records (kTLS, "
          "OpenSSL's SSL_OP_ENABLE_KTLS) where it can; records stay in "
          "OpenSSL otherwise. Which one ran is logged per connection and in "
          "/metrics.");
ABSL_FLAG(double, data_plane_handshake_s,
          Default().network.data_plane_handshake_s,
          "With TLS: a data-plane connection must finish its handshake "
          "within this many seconds of arriving, or is closed.");
ABSL_FLAG(std::string, auth_token_file, Default().tls.auth_token_file,
          "File holding a shared token: every call must carry "
          "'authorization: Bearer <token>' (health and reflection excepted).");

namespace pstrain {

std::string ClusterSpecFlag() { return absl::GetFlag(FLAGS_cluster_spec); }

ServerConfig ServerConfigFromFlags(std::vector<absl::Status>* problems) {
  ServerConfig c;
  c.shard_id = absl::GetFlag(FLAGS_shard_id);
  c.num_shards = absl::GetFlag(FLAGS_num_shards);
  c.num_workers = absl::GetFlag(FLAGS_num_workers);
  c.max_workers = absl::GetFlag(FLAGS_max_workers);
  c.mode = absl::GetFlag(FLAGS_mode);
  c.staleness = absl::GetFlag(FLAGS_staleness);
  c.replicas_to_aggregate = absl::GetFlag(FLAGS_replicas_to_aggregate);
  c.sync_sum_order = absl::GetFlag(FLAGS_sync_sum_order);
  c.worker_lease_s = absl::GetFlag(FLAGS_worker_lease_s);
  c.startup_timeout_s = absl::GetFlag(FLAGS_startup_timeout_s);
  c.min_workers = absl::GetFlag(FLAGS_min_workers);
  c.optimizer = absl::GetFlag(FLAGS_optimizer);
  c.learning_rate = absl::GetFlag(FLAGS_learning_rate);
  c.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  c.momentum = absl::GetFlag(FLAGS_momentum);
  c.adam_beta1 = absl::GetFlag(FLAGS_adam_beta1);
  c.adam_beta2 = absl::GetFlag(FLAGS_adam_beta2);
  c.adam_epsilon = absl::GetFlag(FLAGS_adam_epsilon);
  c.nonfinite_gradients = absl::GetFlag(FLAGS_nonfinite_gradients);
  c.max_pull_wait_s = absl::GetFlag(FLAGS_max_pull_wait_s);
  c.sparse_max_rows = absl::GetFlag(FLAGS_sparse_max_rows);
  c.sparse_admit_after = absl::GetFlag(FLAGS_sparse_admit_after);
  c.sparse_row_ttl = absl::GetFlag(FLAGS_sparse_row_ttl);
  c.sparse_row_ttl_steps = absl::GetFlag(FLAGS_sparse_row_ttl_steps);
  c.sparse_memory_gb = absl::GetFlag(FLAGS_sparse_memory_gb);
  c.max_shard_memory_gb = absl::GetFlag(FLAGS_max_shard_memory_gb);
  c.replicas = absl::GetFlag(FLAGS_replicas);
  c.replica_index = absl::GetFlag(FLAGS_replica_index);
  c.replica_hosts = absl::GetFlag(FLAGS_replica_hosts);
  c.replica_takeover_s = absl::GetFlag(FLAGS_replica_takeover_s);
  c.replica_catchup_chunk_kib = absl::GetFlag(FLAGS_replica_catchup_chunk_kib);
  c.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  c.checkpoint_every_steps = absl::GetFlag(FLAGS_checkpoint_every_steps);
  c.checkpoint_every_s = absl::GetFlag(FLAGS_checkpoint_every_s);
  c.keep_checkpoints = absl::GetFlag(FLAGS_keep_checkpoints);
  c.checkpoint_dir_wait_s = absl::GetFlag(FLAGS_checkpoint_dir_wait_s);
  c.inject_drop_push_response_probability =
      absl::GetFlag(FLAGS_inject_drop_push_response_probability);
  c.inject_crash_at = absl::GetFlag(FLAGS_inject_crash_at);
  ServerNetworkConfig& n = c.network;
  n.host = absl::GetFlag(FLAGS_host);
  n.port = absl::GetFlag(FLAGS_port);
  n.data_port = absl::GetFlag(FLAGS_data_port);
  n.port_file = absl::GetFlag(FLAGS_port_file);
  n.health_port = absl::GetFlag(FLAGS_health_port);
  n.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  n.metrics_host = absl::GetFlag(FLAGS_metrics_host);
  n.metrics_port_file = absl::GetFlag(FLAGS_metrics_port_file);
  n.max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  n.shutdown_grace_s = absl::GetFlag(FLAGS_shutdown_grace_s);
  n.data_plane_handshake_s = absl::GetFlag(FLAGS_data_plane_handshake_s);
  n.data_plane_ktls = absl::GetFlag(FLAGS_data_plane_ktls);
  absl::StatusOr<GrpcTuning> tuning = GrpcTuningFromFlags();
  if (tuning.ok()) {
    n.grpc_tuning = *tuning;
  } else {
    problems->push_back(tuning.status());
  }
  c.tls.cert = absl::GetFlag(FLAGS_tls_cert);
  c.tls.key = absl::GetFlag(FLAGS_tls_key);
  c.tls.client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  c.tls.replica_ca = absl::GetFlag(FLAGS_replica_tls_ca);
  c.tls.auth_token_file = absl::GetFlag(FLAGS_auth_token_file);
  return c;
}

}  // namespace pstrain
