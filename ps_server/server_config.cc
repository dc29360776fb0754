#include "ps_server/server_config.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "common/cli.h"
#include "common/learning_rates.h"
#include "common/transport/tls.h"
#include "ps_server/optimizer.h"

namespace pstrain {
namespace {

using Problems = std::vector<absl::Status>;

absl::Status OneOf(const char* flag, const std::string& value,
                   std::initializer_list<const char*> choices) {
  std::string listed;
  for (const char* choice : choices) {
    if (value == choice) return absl::OkStatus();
    absl::StrAppend(&listed, listed.empty() ? "" : " or ", choice);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be ", listed, ", got '", value, "'"));
}

// The job, this shard's place in it, and its consistency rules.
void CheckJob(const ServerConfig& c, Problems& checks) {
  // The shard's identity, counts and optimizer are Shard::Create's to
  // check (ShardOptions); these are what it takes already parsed.
  checks.push_back(ParseConsistencyMode(c.mode).status());
  checks.push_back(
      OneOf("nonfinite_gradients", c.nonfinite_gradients, {"reject", "skip"}));
  checks.push_back(
      OneOf("sync_sum_order", c.sync_sum_order, {"worker_id", "arrival"}));
  checks.push_back(CheckPositive("max_pull_wait_s", c.max_pull_wait_s));
  checks.push_back(CheckPositive("worker_lease_s", c.worker_lease_s));
  checks.push_back(CheckPositive("startup_timeout_s", c.startup_timeout_s));
  if (!(c.sparse_memory_gb >= 0 && c.sparse_memory_gb < 1e6)) {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--sparse_memory_gb must be in [0, 1e6) (0: no limit), got ",
        c.sparse_memory_gb)));
  }
  if (c.sparse_max_rows < 0 || c.sparse_admit_after < 0) {
    checks.push_back(absl::InvalidArgumentError(
        "--sparse_max_rows and --sparse_admit_after must be >= 0"));
  }
  if (c.sparse_row_ttl != absl::InfiniteDuration()) {
    if (c.sparse_row_ttl < absl::Seconds(1)) {
      checks.push_back(absl::InvalidArgumentError(absl::StrCat(
          "--sparse_row_ttl must be at least 1s (inf: rows never expire), "
          "got ",
          absl::FormatDuration(c.sparse_row_ttl))));
    } else if (c.replicas > 1) {
      // Each replica would expire rows on its own clock: a failover could
      // bring back a row at its initial value that the primary still had.
      checks.push_back(absl::InvalidArgumentError(
          "--sparse_row_ttl cannot be used with --replicas > 1 (replicas "
          "would expire rows at different moments)"));
    }
  }
  if (c.sparse_row_ttl_steps != 0) {
    if (c.sparse_row_ttl_steps < 0) {
      checks.push_back(absl::InvalidArgumentError(absl::StrCat(
          "--sparse_row_ttl_steps must be >= 1 (0: rows never expire), got ",
          c.sparse_row_ttl_steps)));
    } else if (c.sparse_row_ttl != absl::InfiniteDuration()) {
      checks.push_back(absl::InvalidArgumentError(
          "--sparse_row_ttl_steps and --sparse_row_ttl: give one row TTL, "
          "in steps or in time"));
    } else if (c.mode != "sync") {
      checks.push_back(absl::InvalidArgumentError(absl::StrCat(
          "--sparse_row_ttl_steps counts the steps of sync tables; --mode=",
          c.mode, " has none the servers complete: use --sparse_row_ttl")));
    } else if (c.replicas > 1) {
      // Rows expire when their stripe is next touched, and only the
      // primary serves pulls.
      checks.push_back(absl::InvalidArgumentError(
          "--sparse_row_ttl_steps cannot be used with --replicas > 1 "
          "(replicas would expire rows at different moments)"));
    }
  }
  checks.push_back(OneOf("inject_crash_at", c.inject_crash_at,
                         {"", "register", "final_state", "record_window"}));
  const double drop = c.inject_drop_push_response_probability;
  if (!(drop >= 0 && drop <= 1)) {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--inject_drop_push_response_probability must be in [0, 1], got ",
        drop)));
  }
}

void CheckNetwork(const ServerConfig& c, Problems& checks) {
  const ServerNetworkConfig& n = c.network;
  checks.push_back(CheckPort("port", n.port));
  checks.push_back(CheckPort("data_port", n.data_port, -1));
  checks.push_back(CheckPort("metrics_port", n.metrics_port, -1));
  checks.push_back(CheckPort("health_port", n.health_port));
  checks.push_back(
      CheckPositive("data_plane_handshake_s", n.data_plane_handshake_s));
  checks.push_back(CheckPositive("shutdown_grace_s", n.shutdown_grace_s));
  if (n.max_message_mb < 1 || n.max_message_mb > 2047) {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--max_message_mb must be in [1, 2047], got ", n.max_message_mb)));
  }
  checks.push_back(ValidateGrpcTuning(n.grpc_tuning));
  checks.push_back(
      MakeServerCredentials({c.tls.cert, c.tls.key, c.tls.client_ca}).status());
  checks.push_back(ReadAuthToken(c.tls.auth_token_file).status());
}

void CheckReplicas(const ServerConfig& c, Problems& checks) {
  if (c.replicas < 1 || c.replicas > 5) {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--replicas must be in [1, 5], got ", c.replicas)));
    return;
  }
  if (c.replica_index < 0 || c.replica_index >= c.replicas) {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--replica_index must be in [0, --replicas=", c.replicas,
                     "), got ", c.replica_index)));
  }
  // A chunk is one message: the joiner refuses one over --max_message_mb
  // (a replica of a set only: alone, the flag has no use to refuse).
  const int max_chunk_kib = c.network.max_message_mb * 1024 / 2;
  if (c.replica_catchup_chunk_kib < 1 ||
      (c.replicas > 1 && c.replica_catchup_chunk_kib > max_chunk_kib)) {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--replica_catchup_chunk_kib must be in [1, ", max_chunk_kib,
        "] (half of --max_message_mb), got ", c.replica_catchup_chunk_kib)));
  }
  if (c.replicas == 1) return;
  if (static_cast<int>(c.replica_hosts.size()) != c.replicas) {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--replica_hosts must list the gRPC address of each of the shard's ",
        c.replicas, " replicas (--replicas), got ", c.replica_hosts.size())));
  }
  for (const std::string& host : c.replica_hosts) {
    if (host.empty() || host.find(':') == std::string::npos) {
      checks.push_back(absl::InvalidArgumentError(absl::StrCat(
          "--replica_hosts entries must be host:port, got '", host, "'")));
    }
  }
  checks.push_back(CheckPositive("replica_takeover_s", c.replica_takeover_s));
  if (c.sparse_max_rows > 0 || c.sparse_memory_gb > 0) {
    // A backup sees the pushes, not the pulls that also keep a row recent:
    // it would evict other rows than its primary, and a failover could
    // bring a row the primary kept back at its initial value.
    checks.push_back(absl::InvalidArgumentError(
        "--sparse_max_rows and --sparse_memory_gb cannot be used with "
        "--replicas > 1 yet: a backup does not see the pulls that keep rows "
        "in its primary's tables, so it would evict other rows"));
  }
  if (!c.tls.cert.empty() && c.tls.replica_ca.empty() &&
      c.tls.client_ca.empty()) {
    checks.push_back(absl::InvalidArgumentError(
        "--replicas > 1 with --tls_cert needs --replica_tls_ca (or "
        "--tls_client_ca): the CA the other replicas' certificates chain "
        "to, since the replicas call each other over TLS"));
  }
  if (c.tls.cert.empty() && !c.tls.replica_ca.empty()) {
    checks.push_back(absl::InvalidArgumentError(
        "--replica_tls_ca needs --tls_cert/--tls_key: replicas speak TLS to "
        "each other only when they serve TLS"));
  }
}

void CheckCheckpoints(const ServerConfig& c, Problems& checks) {
  if (c.checkpoint_every_steps < 0 || c.checkpoint_every_s < 0 ||
      c.keep_checkpoints < 1) {
    checks.push_back(absl::InvalidArgumentError(
        "--checkpoint_every_steps and --checkpoint_every_s must be >= 0 and "
        "--keep_checkpoints >= 1"));
  }
  if (!(c.checkpoint_dir_wait_s >= 0 && c.checkpoint_dir_wait_s <= 3600)) {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--checkpoint_dir_wait_s must be in [0, 3600] seconds, got ",
        c.checkpoint_dir_wait_s)));
  }
  if (c.checkpoint_dir.empty() &&
      (c.checkpoint_every_steps > 0 || c.checkpoint_every_s > 0)) {
    checks.push_back(absl::InvalidArgumentError(
        "--checkpoint_every_steps/--checkpoint_every_s need --checkpoint_dir"));
  }
}

}  // namespace

std::vector<absl::Status> ServerConfigProblems(const ServerConfig& config) {
  Problems checks;
  CheckJob(config, checks);
  CheckNetwork(config, checks);
  CheckCheckpoints(config, checks);
  CheckReplicas(config, checks);
  Problems problems;
  for (absl::Status& s : checks) {
    if (!s.ok()) problems.push_back(std::move(s));
  }
  return problems;
}

ShardOptions ShardOptionsOf(const ServerConfig& c) {
  ShardOptions o;
  o.shard_id = c.shard_id;
  o.num_shards = c.num_shards;
  o.num_workers = c.num_workers;
  o.max_workers = c.max_workers;
  o.mode = ParseConsistencyMode(c.mode).value_or(ConsistencyMode::kSync);
  o.ssp_staleness = c.staleness;
  o.replicas_to_aggregate = c.replicas_to_aggregate;
  o.min_workers = c.min_workers;
  o.worker_lease = absl::Seconds(c.worker_lease_s);
  o.startup_timeout = absl::Seconds(c.startup_timeout_s);
  o.optimizer.name = c.optimizer;
  o.optimizer.learning_rate = static_cast<float>(EffectiveLearningRate(
      c.learning_rate, DefaultDenseLearningRate(c.optimizer)));
  o.optimizer.momentum = static_cast<float>(c.momentum);
  o.optimizer.beta1 = static_cast<float>(c.adam_beta1);
  o.optimizer.beta2 = static_cast<float>(c.adam_beta2);
  o.optimizer.epsilon = static_cast<float>(c.adam_epsilon);
  o.optimizer.weight_decay = static_cast<float>(c.weight_decay);
  o.skip_nonfinite_gradients = c.nonfinite_gradients == "skip";
  o.sum_in_arrival_order = c.sync_sum_order == "arrival";
  o.max_pull_wait = absl::Seconds(c.max_pull_wait_s);
  o.sparse_max_rows = c.sparse_max_rows;
  o.sparse_admit_after = c.sparse_admit_after;
  o.sparse_row_ttl = c.sparse_row_ttl;
  o.sparse_row_ttl_steps = c.sparse_row_ttl_steps;
  o.max_shard_bytes =
      static_cast<int64_t>(c.max_shard_memory_gb * (int64_t{1} << 30));
  o.sparse_memory_bytes =
      static_cast<int64_t>(c.sparse_memory_gb * (int64_t{1} << 30));
  o.record_steps = c.replicas > 1 && o.mode == ConsistencyMode::kSync;
  o.replicated = c.replicas > 1;
  return o;
}

CheckpointerOptions CheckpointerOptionsOf(const ServerConfig& c) {
  CheckpointerOptions o;
  o.dir = c.checkpoint_dir;
  if (c.replicas > 1 && !o.dir.empty()) {
    o.dir = absl::StrCat(o.dir, "/replica-", c.replica_index);
  }
  o.keep_last = c.keep_checkpoints;
  o.every_steps = c.checkpoint_every_steps;
  o.every = absl::Seconds(c.checkpoint_every_s);
  return o;
}

ReplicaOptions ReplicaOptionsOf(const ServerConfig& c) {
  ReplicaOptions o;
  o.shard_id = c.shard_id;
  o.replica_index = c.replica_index;
  o.addresses = c.replica_hosts;
  o.takeover_after_silence = absl::Seconds(c.replica_takeover_s);
  o.catchup_chunk_bytes = int64_t{c.replica_catchup_chunk_kib} << 10;
  return o;
}

}  // namespace pstrain
