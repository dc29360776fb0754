// Every option of the client, once: its type, its name (the worker flag's,
// the Python keyword's, the cluster description's worker_flags key), the
// ClientConfig member it sets, and its help. The worker's flags
// (worker/worker_flags.cc), the Python binding's keyword table
// (worker/python/c_api.cc) and the export tool's flags (worker/export_main.cc)
// are all expanded from these lists; the defaults are ClientConfig's member
// initialisers. Adding an option here adds it everywhere.
//
// X(type, name, member, help) for each option. Two lists: reaching the
// servers at all (what an observer such as the export tool needs), and how a
// worker trains over the connection.
#ifndef PSTRAIN_WORKER_CLIENT_CLIENT_OPTIONS_H_
#define PSTRAIN_WORKER_CLIENT_CLIENT_OPTIONS_H_

// clang-format off
#define PSTRAIN_CLIENT_CONNECTION_OPTIONS(X) \
  X(double, rpc_timeout_s, rpc_timeout_s, \
    "Deadline of each pull/push (a sync pull waits for all workers).") \
  X(double, connect_timeout_s, connect_timeout_s, \
    "How long to wait for the servers to come up.") \
  X(int, max_message_mb, max_message_mb, \
    "Largest message sent or received, in MiB.") \
  X(std::string, tls_ca, tls.ca, \
    "PEM CA bundle the servers' certificates must chain to; setting " \
    "any --tls_* flag turns TLS on (no --tls_ca: the system's roots).") \
  X(std::string, tls_cert, tls.cert, \
    "PEM client certificate for mutual TLS (with --tls_key).") \
  X(std::string, tls_key, tls.key, \
    "PEM private key of --tls_cert.") \
  X(std::string, tls_server_name, tls.server_name, \
    "Name to expect in the servers' certificates instead of the host " \
    "in --ps_hosts (e.g. when dialling an IP address).") \
  X(std::string, auth_token_file, auth_token_file, \
    "File holding the servers' shared token, sent as 'authorization: " \
    "Bearer <token>' on every call.")

#define PSTRAIN_CLIENT_TRAINING_OPTIONS(X) \
  X(int, connections_per_shard, connections_per_shard, \
    "TCP connections to each ps_server; a shard's RPCs are spread over " \
    "them. 0: by host, 4 to a server on this host (only the CPU binds " \
    "there) and one data-plane connection to a server elsewhere (more " \
    "let one worker's requests run ahead of the others' on a link that " \
    "binds, and a sync step waits for the slowest).") \
  X(bool, call_streams, call_streams, \
    "Send a push or pull that is one RPC (one shard, one block group) " \
    "as a message on a long-lived stream of its connection instead of " \
    "a unary call: a third less latency for small models. false: " \
    "always unary.") \
  X(int, data_requests_in_flight, data_requests_in_flight, \
    "Requests each data-plane connection sends ahead of their answers. " \
    "0: by host, all of them to a server on this host (only the CPU " \
    "binds there) and 1 to a server elsewhere, which keeps the workers' " \
    "pushes in step as a sync step on a link that binds needs, or, " \
    "where its round trip is over 1 ms, what the rest of the round trip " \
    "carries at 1 Gbit/s.") \
  X(bool, data_plane, data_plane, \
    "Push and pull dense tensors over the servers' data plane (framed " \
    "TCP beside gRPC; inside TLS with the --tls_* files when the " \
    "servers have TLS) where they announce one: about 1.5-2x the " \
    "throughput of gRPC for large tensors. false: gRPC only.") \
  X(std::string, pulls_from_backups, pulls_from_backups, \
    "Sync, with replicated shards (--replicas=2): read half the shards' " \
    "values from their backup (each worker its own half), so that the " \
    "primary's link carries its step records and fewer pulls. by_host: " \
    "for shards whose primary is on another host (on one host only the " \
    "CPU binds, and the extra request costs it); always; never. Falls " \
    "back to the primary for 30 s (doubling, up to 16 min) when a " \
    "backup cannot answer.") \
  X(bool, data_plane_ktls, data_plane_ktls, \
    "With TLS: let the kernel encrypt the data plane's records (kTLS) " \
    "where it can; OpenSSL does otherwise. Logged once.") \
  X(double, heartbeat_interval_s, heartbeat_interval_s, \
    "How often to renew this worker's lease on the servers (keep it " \
    "well under their --worker_lease_s).") \
  X(double, retry_window_s, retry_window_s, \
    "How long a failed pull or push is retried (server restarting, " \
    "peers slow) before the worker gives up.") \
  X(std::string, gradient_wire_type, gradient_wire_type, \
    "Gradients on the wire: fp32, or fp16/bf16 to halve the bytes " \
    "(servers decode to fp32), or topk: per block, only the " \
    "--gradient_topk_fraction largest-magnitude elements, the rest " \
    "carried into the next push (error feedback). Sparse-table rows " \
    "always go as fp32 under topk.") \
  X(std::string, parameter_wire_type, parameter_wire_type, \
    "Parameters pulled on the wire: fp32 (exact), or bf16/fp16 to " \
    "halve the bytes. The servers keep fp32 master weights and " \
    "optimizer state; only this worker's copy is rounded (state " \
    "tensors such as BatchNorm's running statistics stay fp32).") \
  X(double, gradient_topk_fraction, gradient_topk_fraction, \
    "With --gradient_wire_type=topk: the fraction of each block's " \
    "elements a push sends, in (0, 1].") \
  X(int, sparse_cache_steps, sparse_cache_steps, \
    "Embedding rows a pull got serve this worker's pulls of the next " \
    "this-many steps instead of being pulled again (a row then lags " \
    "the servers' by at most that many steps of updates). 0: every " \
    "pull goes to the servers.") \
  X(int, sparse_cache_mb, sparse_cache_mb, \
    "With --sparse_cache_steps: the most memory the cached rows take, " \
    "in MiB; when full, rows past their bound make room.") \
  X(double, inject_duplicate_push_probability, inject_duplicate_push_probability, \
    "Fault injection: resend a successful push with this probability " \
    "(the servers must not apply it twice).") \
  X(double, inject_push_jitter_ms, inject_push_jitter_ms, \
    "Fault injection: delay every push by a random time up to this " \
    "many ms, so gradients reach the servers in a different order " \
    "each run (sync results must not change).")

#define PSTRAIN_CLIENT_OPTIONS(X)      \
  PSTRAIN_CLIENT_CONNECTION_OPTIONS(X) \
  PSTRAIN_CLIENT_TRAINING_OPTIONS(X)
// clang-format on

#endif  // PSTRAIN_WORKER_CLIENT_CLIENT_OPTIONS_H_
