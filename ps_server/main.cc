// ps_server: one shard of the parameter server.
//
//   ps_server --port=5000 --shard_id=0 --num_shards=2 --num_workers=4
//             --mode=sync --optimizer=adam --learning_rate=0.001
//   ps_server --cluster_spec=job.json --shard_id=1 --metrics_port=9100
//
// Serves the ParameterServer service, grpc.health.v1 (also on its own
// plaintext --health_port, for probes that cannot do TLS) and server
// reflection; Prometheus metrics on --metrics_port. Serves until SIGTERM or
// SIGINT, then reports NOT_SERVING, finishes in-flight calls (bounded by
// --shutdown_grace_s) and exits 0.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/server_builder_plugin.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/cli.h"
#include "common/cluster_spec.h"
#include "common/grpc_tls_refusals.h"
#include "common/grpc_tuning.h"
#include "common/learning_rates.h"
#include "common/metrics.h"
#include "common/protocol.h"
#include "common/tls.h"
#include "common/tls_stream.h"
#include "glog/logging.h"
#include "ps_server/checkpointer.h"
#include "ps_server/data_plane_server.h"
#include "ps_server/service.h"
#include "ps_server/shard.h"

ABSL_FLAG(std::string, cluster_spec, "",
          "JSON file describing the job ({\"ps\": [host:port...], "
          "\"workers\": N, \"max_workers\": M, \"mode\": ..., \"task\": "
          "{\"type\": \"ps\", \"index\": i}, \"ps_flags\": {flag: "
          "value...}}); it sets --num_shards, --shard_id, --port, "
          "--num_workers, --max_workers, --mode and the ps_flags unless given "
          "on the command line. Empty: the JSON in $PSTRAIN_CLUSTER, if set.");
ABSL_FLAG(std::string, host, "0.0.0.0", "Address to listen on.");
ABSL_FLAG(int, port, 0, "Port to listen on; 0 picks a free one.");
ABSL_FLAG(int, data_port, 0,
          "Port of the tensor data plane (Push and Pull over plain TCP, "
          "announced to workers at registration); 0 picks a free one, -1 "
          "serves them over gRPC only. With --tls_cert it speaks TLS 1.3 "
          "with the gRPC port's certificates.");
ABSL_FLAG(std::string, port_file, "",
          "If set, the chosen port is written here once serving (atomically).");
ABSL_FLAG(int, shard_id, 0, "This server's shard, in [0, num_shards).");
ABSL_FLAG(int, num_shards, 1, "Number of parameter-server shards.");
ABSL_FLAG(int, num_workers, 1, "Number of workers in the job.");
ABSL_FLAG(std::string, mode, "sync",
          "Consistency: sync (bulk-synchronous), async (apply on arrival) or "
          "ssp (async with a bound on how far ahead a worker may run).");
ABSL_FLAG(int, staleness, 3,
          "ssp: a worker may be at most this many steps ahead of the slowest.");
ABSL_FLAG(int, max_workers, 0,
          "Elastic jobs: worker ids may go up to max_workers - 1 and workers "
          "may join and leave at step boundaries (0: --num_workers, fixed).");
ABSL_FLAG(int, replicas_to_aggregate, 0,
          "sync with backup workers: apply a step once this many gradients "
          "are in; later ones are dropped and counted (0: every worker).");
ABSL_FLAG(std::string, sync_sum_order, "worker_id",
          "sync: the order a step's gradients are summed in. worker_id: "
          "ascending worker id, whatever order they arrive in, so the same "
          "job gives the same model bit for bit (gradients that come early "
          "are held until their turn; ps_server/ordered_sum.h). arrival: as "
          "they come, which float addition makes differ from run to run "
          "(a baseline for bench/sum_order_cost.sh).");
ABSL_FLAG(double, worker_lease_s, 10,
          "A worker not heard from (requests or heartbeats) for this long is "
          "dropped, and sync steps stop waiting for it. The lease starts at "
          "its first contact: a worker that never came is missing, not "
          "lapsed (see --startup_timeout_s).");
ABSL_FLAG(double, startup_timeout_s, 600,
          "sync/ssp: no step completes before every worker in "
          "[0, num_workers) has registered. After this long the job starts "
          "with those that did if they are at least --min_workers, and "
          "otherwise fails: every worker is told which ids never came. "
          "Generous by default, for workers that wait for a GPU node, an "
          "image pull or a data set.");
ABSL_FLAG(int, min_workers, 0,
          "sync/ssp: the fewest workers the job may start with once "
          "--startup_timeout_s has passed; the steps run without the "
          "missing ones are counted as short (0: --num_workers, all).");
ABSL_FLAG(double, inject_drop_push_response_probability, 0,
          "Fault injection: after applying a push, answer UNAVAILABLE with "
          "this probability (the client retries; nothing may apply twice).");
ABSL_FLAG(std::string, optimizer, "sgd",
          "sgd, momentum, adam or adamw (torch.optim.AdamW: decoupled "
          "weight decay), for tensors that do not bring their own "
          "(pstrain.torch hands the servers the user's torch optimizer).");
ABSL_FLAG(double, weight_decay, 0,
          "L2 weight decay of --optimizer, as torch.optim's weight_decay: "
          "added to the gradient (sgd, momentum, adam) or decoupled "
          "(adamw: w *= 1 - lr * weight_decay).");
ABSL_FLAG(double, learning_rate, 0,
          "Optimizer learning rate. 0 (the default): the optimizer's own "
          "default, as PyTorch and Keras users know it: adam 0.001 "
          "(torch.optim.Adam and keras Adam), sgd 0.1 (torchvision's "
          "reference classification recipe; torch.optim.SGD has none), "
          "momentum 0.01 (keras SGD(momentum=0.9)). The rate in effect is "
          "logged at start and told to workers.");
ABSL_FLAG(double, momentum, 0.9,
          "Momentum coefficient (--optimizer=momentum).");
ABSL_FLAG(double, adam_beta1, 0.9, "Adam beta1.");
ABSL_FLAG(double, adam_beta2, 0.999, "Adam beta2.");
ABSL_FLAG(double, adam_epsilon, 1e-8, "Adam epsilon.");
ABSL_FLAG(std::string, nonfinite_gradients, "reject",
          "A gradient containing NaN/Inf: 'reject' the push with an error, or "
          "'skip' it (acknowledged, not applied, counted in stats).");
ABSL_FLAG(double, max_pull_wait_s, 120,
          "Longest a sync pull waits for its step before DEADLINE_EXCEEDED.");
ABSL_FLAG(int, max_message_mb, pstrain::kDefaultMaxMessageBytes >> 20,
          "Largest request or response accepted, in MiB.");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Directory for checkpoints, shared by every shard of the job. At "
          "start the newest valid checkpoint there is restored, also when it "
          "was written by a different number of shards (resharding).");
ABSL_FLAG(int64_t, checkpoint_every_steps, 0,
          "sync: checkpoint each time every block has done this many more "
          "steps (0: off).");
ABSL_FLAG(double, checkpoint_every_s, 0,
          "Checkpoint at least this often, in seconds (0: off).");
ABSL_FLAG(int64_t, sparse_max_rows, 0,
          "Rows kept per sparse table on this shard; beyond it the least "
          "recently used are evicted (0: unbounded).");
ABSL_FLAG(int, sparse_admit_after, 0,
          "A sparse row is created on the N-th sighting of its id (0 or 1: "
          "the first); until then pulls see its initial value, pushes are "
          "dropped and counted.");
ABSL_FLAG(double, max_shard_memory_gb, 16,
          "Refuse (RESOURCE_EXHAUSTED) a model whose parameters and "
          "optimizer state would take more memory than this on one shard.");
ABSL_FLAG(int, keep_checkpoints, 3, "Checkpoints kept per shard.");
ABSL_FLAG(double, shutdown_grace_s, 5,
          "On SIGTERM, how long in-flight calls may take to finish.");
ABSL_FLAG(int, metrics_port, 0,
          "Serve Prometheus metrics on http://<metrics_host>:PORT/metrics "
          "(0: off; -1: a free port, see --metrics_port_file).");
ABSL_FLAG(std::string, metrics_host, "0.0.0.0",
          "Address the metrics endpoint listens on.");
ABSL_FLAG(std::string, metrics_port_file, "",
          "If set, the metrics port is written here once serving.");
ABSL_FLAG(int, health_port, 0,
          "Also serve grpc.health.v1 alone, in plaintext, on this port (for "
          "Kubernetes grpc probes, which cannot do TLS); 0: off. Health is "
          "always served on --port as well.");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain: serve TLS (with --tls_key).");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: require client certificates signed by it (mutual "
          "TLS).");
ABSL_FLAG(bool, data_plane_ktls, false,
          "With TLS: let the kernel encrypt the data plane's records (kTLS, "
          "OpenSSL's SSL_OP_ENABLE_KTLS) where it can; records stay in "
          "OpenSSL otherwise. Which one ran is logged per connection and in "
          "/metrics.");
ABSL_FLAG(double, data_plane_handshake_s, 10,
          "With TLS: a data-plane connection must finish its handshake "
          "within this many seconds of arriving, or is closed.");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding a shared token: every call must carry "
          "'authorization: Bearer <token>' (health and reflection excepted).");

namespace pstrain {
namespace {

absl::Status CheckPositive(const char* flag, double value) {
  if (std::isfinite(value) && value > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be a positive number, got ", value));
}

// The metrics interceptor counts request bytes of these methods by reading
// their request as a grpc::ByteBuffer, which they must stay.
constexpr const char* kRawRequestMethods[] = {"/pstrain.ParameterServer/Push",
                                              "/pstrain.ParameterServer/Pull"};
using RawUnaryMethod = grpc::ServerUnaryReactor* (
    ParameterServerService::*)(grpc::CallbackServerContext*,
                               const grpc::ByteBuffer*, grpc::ByteBuffer*);
static_assert(
    std::is_same_v<decltype(&ParameterServerService::Push), RawUnaryMethod> &&
        std::is_same_v<decltype(&ParameterServerService::Pull), RawUnaryMethod>,
    "update kRawRequestMethods");

// Leaves server reflection out of a server: libgrpc++_reflection adds its
// plugin to every ServerBuilder when it loads, and the plaintext health port
// is for probes, not for describing the API to anyone who can reach it.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>*
                         plugins) override {
    plugins->erase(
        std::remove_if(plugins->begin(), plugins->end(),
                       [](const std::unique_ptr<grpc::ServerBuilderPlugin>& p) {
                         return p->name() == "proto_server_reflection";
                       }),
        plugins->end());
  }
};

// Lends gRPC a factory that the data plane also records into: gRPC wants
// to own its interceptor factories, and destroys them when it is done.
class SharedInterceptorFactory
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit SharedInterceptorFactory(
      std::shared_ptr<RpcMetricsInterceptorFactory> factory)
      : factory_(std::move(factory)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return factory_->CreateServerInterceptor(info);
  }

 private:
  std::shared_ptr<RpcMetricsInterceptorFactory> factory_;
};

absl::Status CheckPort(const char* flag, int port, int minimum = 0) {
  if (port >= minimum && port <= 65535) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--", flag, " must be in [", minimum, ", 65535], got ", port));
}

// Whether only this machine can reach `host` (--host): 127.0.0.0/8, ::1
// or localhost. Anything else, 0.0.0.0 and :: above all, is reachable from
// the network.
bool IsLoopbackHost(absl::string_view host) {
  absl::ConsumePrefix(&host, "[");
  absl::ConsumeSuffix(&host, "]");
  return host == "localhost" || host == "::1" ||
         absl::StartsWith(host, "127.") || host == "ip6-localhost";
}

// One line, said at start by a server anyone on the network can drive: a
// fine default inside a cluster network, but never a silent one.
std::string OpenPortWarning(const std::string& host, int port, int data_port) {
  return absl::StrCat(
      "listening on ", host, ":", port,
      data_port > 0 ? absl::StrCat(" (data port ", data_port, ")") : "",
      " in plaintext with no token: anyone who can reach it can register a "
      "model, push gradients into the model (or overwrite it), read every "
      "parameter, and leave the job for any worker id. To close it: "
      "--host=127.0.0.1 (one machine), --auth_token_file (a shared token "
      "every call must carry), --tls_cert/--tls_key (TLS; with "
      "--tls_client_ca, clients need a certificate), or a firewall");
}

// {"event":"shard_final",...}: the step (sync) or update count (async) the
// shard ends at, and what weakened or lost steps, for a launcher's report
// of the job whatever its workers print.
std::string ShardFinalJson(const StatsResponse& stats,
                           absl::string_view final_checkpoint) {
  return absl::StrCat(
      "{\"event\":\"shard_final\",\"shard\":", stats.shard_id(),
      ",\"num_shards\":", stats.num_shards(), ",\"mode\":\"", stats.mode(),
      "\",\"model_registered\":", stats.model_registered() ? "true" : "false",
      ",\"version\":", stats.version(),
      ",\"steps_short\":", stats.steps_short(),
      ",\"steps_lost\":", stats.steps_lost(),
      ",\"updates_lost\":", stats.updates_lost(),
      ",\"late_gradients_dropped\":", stats.late_gradients_dropped(),
      ",\"final_checkpoint\":\"", final_checkpoint, "\"}");
}

int Main(int argc, char** argv) {
  absl::StatusOr<std::vector<FlagSetting>> from_spec = ApplyClusterSpec(
      ClusterRole::kPs, absl::GetFlag(FLAGS_cluster_spec), argc, argv);
  ExitOnFlagErrors({from_spec.status()});
  if (!from_spec->empty()) {
    std::vector<std::string> applied;
    for (const FlagSetting& f : *from_spec) {
      applied.push_back(absl::StrCat("--", f.name, "=", f.value));
    }
    LOG(INFO) << "from the cluster spec: " << absl::StrJoin(applied, " ");
  }
  ShardOptions options;
  options.shard_id = absl::GetFlag(FLAGS_shard_id);
  options.num_shards = absl::GetFlag(FLAGS_num_shards);
  options.num_workers = absl::GetFlag(FLAGS_num_workers);
  options.max_workers = absl::GetFlag(FLAGS_max_workers);
  options.ssp_staleness = absl::GetFlag(FLAGS_staleness);
  options.replicas_to_aggregate = absl::GetFlag(FLAGS_replicas_to_aggregate);
  options.min_workers = absl::GetFlag(FLAGS_min_workers);
  options.optimizer.name = absl::GetFlag(FLAGS_optimizer);
  const double given_learning_rate = absl::GetFlag(FLAGS_learning_rate);
  const std::optional<DefaultLearningRate> default_learning_rate =
      DefaultDenseLearningRate(options.optimizer.name);
  options.optimizer.learning_rate =
      EffectiveLearningRate(given_learning_rate, default_learning_rate);
  options.optimizer.momentum = absl::GetFlag(FLAGS_momentum);
  options.optimizer.weight_decay =
      static_cast<float>(absl::GetFlag(FLAGS_weight_decay));
  options.optimizer.beta1 = absl::GetFlag(FLAGS_adam_beta1);
  options.optimizer.beta2 = absl::GetFlag(FLAGS_adam_beta2);
  options.optimizer.epsilon = absl::GetFlag(FLAGS_adam_epsilon);

  std::vector<absl::Status> checks;
  absl::StatusOr<ConsistencyMode> mode =
      ParseConsistencyMode(absl::GetFlag(FLAGS_mode));
  checks.push_back(mode.status());
  if (mode.ok()) options.mode = *mode;
  const std::string nonfinite = absl::GetFlag(FLAGS_nonfinite_gradients);
  if (nonfinite != "reject" && nonfinite != "skip") {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--nonfinite_gradients must be reject or skip, got '",
                     nonfinite, "'")));
  }
  options.skip_nonfinite_gradients = nonfinite == "skip";
  const std::string sum_order = absl::GetFlag(FLAGS_sync_sum_order);
  if (sum_order != "worker_id" && sum_order != "arrival") {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--sync_sum_order must be worker_id or arrival, got '",
                     sum_order, "'")));
  }
  options.sum_in_arrival_order = sum_order == "arrival";
  const int port = absl::GetFlag(FLAGS_port);
  checks.push_back(CheckPort("port", port));
  const int data_port = absl::GetFlag(FLAGS_data_port);
  checks.push_back(CheckPort("data_port", data_port, -1));
  const int metrics_port = absl::GetFlag(FLAGS_metrics_port);
  checks.push_back(CheckPort("metrics_port", metrics_port, -1));
  const int health_port = absl::GetFlag(FLAGS_health_port);
  checks.push_back(CheckPort("health_port", health_port));
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeServerCredentials({absl::GetFlag(FLAGS_tls_cert),
                             absl::GetFlag(FLAGS_tls_key),
                             absl::GetFlag(FLAGS_tls_client_ca)});
  checks.push_back(credentials.status());
  absl::StatusOr<std::string> auth_token =
      ReadAuthToken(absl::GetFlag(FLAGS_auth_token_file));
  checks.push_back(auth_token.status());
  const double max_pull_wait_s = absl::GetFlag(FLAGS_max_pull_wait_s);
  checks.push_back(CheckPositive("max_pull_wait_s", max_pull_wait_s));
  const double lease_s = absl::GetFlag(FLAGS_worker_lease_s);
  checks.push_back(CheckPositive("worker_lease_s", lease_s));
  const double startup_timeout_s = absl::GetFlag(FLAGS_startup_timeout_s);
  checks.push_back(CheckPositive("startup_timeout_s", startup_timeout_s));
  checks.push_back(CheckPositive("data_plane_handshake_s",
                                 absl::GetFlag(FLAGS_data_plane_handshake_s)));
  const double drop_probability =
      absl::GetFlag(FLAGS_inject_drop_push_response_probability);
  if (!(drop_probability >= 0 && drop_probability <= 1)) {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--inject_drop_push_response_probability must be in [0, 1], got ",
        drop_probability)));
  }
  checks.push_back(
      CheckPositive("shutdown_grace_s", absl::GetFlag(FLAGS_shutdown_grace_s)));
  const int max_message_mb = absl::GetFlag(FLAGS_max_message_mb);
  if (max_message_mb < 1 || max_message_mb > 2047) {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--max_message_mb must be in [1, 2047], got ", max_message_mb)));
  }
  const std::string checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  CheckpointerOptions checkpoint_options;
  checkpoint_options.dir = checkpoint_dir;
  checkpoint_options.keep_last = absl::GetFlag(FLAGS_keep_checkpoints);
  checkpoint_options.every_steps = absl::GetFlag(FLAGS_checkpoint_every_steps);
  checkpoint_options.every =
      absl::Seconds(absl::GetFlag(FLAGS_checkpoint_every_s));
  if (checkpoint_options.every_steps < 0 ||
      checkpoint_options.every < absl::ZeroDuration() ||
      checkpoint_options.keep_last < 1) {
    checks.push_back(absl::InvalidArgumentError(
        "--checkpoint_every_steps and --checkpoint_every_s must be >= 0 and "
        "--keep_checkpoints >= 1"));
  }
  if (checkpoint_dir.empty() &&
      (checkpoint_options.every_steps > 0 ||
       checkpoint_options.every > absl::ZeroDuration())) {
    checks.push_back(absl::InvalidArgumentError(
        "--checkpoint_every_steps/--checkpoint_every_s need --checkpoint_dir"));
  }
  const absl::StatusOr<GrpcTuning> grpc_tuning = GrpcTuningFromFlags();
  checks.push_back(grpc_tuning.status());
  ExitOnFlagErrors(checks);
  options.max_pull_wait = absl::Seconds(max_pull_wait_s);
  options.sparse_max_rows = absl::GetFlag(FLAGS_sparse_max_rows);
  options.sparse_admit_after = absl::GetFlag(FLAGS_sparse_admit_after);
  if (options.sparse_max_rows < 0 || options.sparse_admit_after < 0) {
    ExitOnFlagErrors({absl::InvalidArgumentError(
        "--sparse_max_rows and --sparse_admit_after must be >= 0")});
  }
  options.max_shard_bytes = static_cast<int64_t>(
      absl::GetFlag(FLAGS_max_shard_memory_gb) * (int64_t{1} << 30));
  options.worker_lease = absl::Seconds(lease_s);
  options.startup_timeout = absl::Seconds(startup_timeout_s);

  absl::StatusOr<std::unique_ptr<Shard>> shard = Shard::Create(options);
  ExitOnFlagErrors({shard.status()});

  std::unique_ptr<Checkpointer> checkpointer;
  if (!checkpoint_dir.empty()) {
    // A directory that cannot take a checkpoint ends the server now (exit
    // 2), not after a job's worth of failed checkpoints.
    ExitOnFlagErrors({ProbeCheckpointDir(checkpoint_dir)});
    checkpointer = std::make_unique<Checkpointer>(
        shard->get(), options.shard_id, options.num_shards, checkpoint_options);
    absl::StatusOr<std::string> restored = checkpointer->Restore();
    if (!restored.ok()) {
      LOG(ERROR) << "cannot restore from " << checkpoint_dir << ": "
                 << restored.status();
      return 1;
    }
    LOG(INFO) << (restored->empty()
                      ? absl::StrCat("no checkpoint in ", checkpoint_dir,
                                     ": starting fresh")
                      : *restored);
  }

  ServiceOptions service_options;
  service_options.drop_push_response_probability = drop_probability;
  service_options.auth_token = *auth_token;
  ParameterServerService service(shard->get(), service_options,
                                 checkpointer.get());
  std::unique_ptr<MetricsEndpoint> metrics;
  if (metrics_port != 0) {
    absl::StatusOr<std::unique_ptr<MetricsEndpoint>> started =
        MetricsEndpoint::Start(absl::GetFlag(FLAGS_metrics_host),
                               std::max(metrics_port, 0),
                               absl::GetFlag(FLAGS_metrics_port_file));
    if (!started.ok()) {
      LOG(ERROR) << started.status();
      return 1;
    }
    metrics = std::move(*started);
    metrics->Add(std::make_shared<ShardStatsCollector>(
        [&service] { return service.CurrentStats(); }));
    LOG(INFO) << "metrics on http://" << absl::GetFlag(FLAGS_metrics_host)
              << ":" << metrics->port() << "/metrics";
  }
  if (checkpointer != nullptr) checkpointer->Start();
  // An interceptor, not a wrapper around the service: it sees every call
  // (refused ones, health and reflection too) from arrival to status,
  // without the service knowing about metrics. The data plane records into
  // it too, so gRPC and the data plane share it.
  std::shared_ptr<RpcMetricsInterceptorFactory> rpc_metrics;
  if (metrics != nullptr) {
    // Every method this server (and, with the same builder's plugins,
    // health and reflection) answers; anything else counts as "unknown".
    std::vector<std::string> known_methods =
        ServiceMethodNames("pstrain.ParameterServer");
    known_methods.insert(
        known_methods.end(),
        {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
         "/grpc.reflection.v1alpha.ServerReflection/"
         "ServerReflectionInfo"});
    rpc_metrics = std::make_shared<RpcMetricsInterceptorFactory>(
        metrics->registry(), known_methods,
        absl::flat_hash_set<std::string>(std::begin(kRawRequestMethods),
                                         std::end(kRawRequestMethods)));
  }
  std::unique_ptr<DataPlaneServer> data_plane_server;
  const bool tls = !absl::GetFlag(FLAGS_tls_cert).empty();
  if (data_port >= 0) {
    DataPlaneServerOptions data_options;
    if (tls) {
      // The gRPC port's files, already checked by MakeServerCredentials.
      absl::StatusOr<std::shared_ptr<const TlsContext>> context =
          TlsContext::ForServer(
              {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
               absl::GetFlag(FLAGS_tls_client_ca)},
              absl::GetFlag(FLAGS_data_plane_ktls));
      if (!context.ok()) {
        LOG(ERROR) << "cannot serve the data plane with TLS: "
                   << context.status();
        return 1;
      }
      data_options.tls = *context;
      data_options.handshake_timeout =
          absl::Seconds(absl::GetFlag(FLAGS_data_plane_handshake_s));
    }
    data_options.host = absl::GetFlag(FLAGS_host);
    data_options.port = data_port;
    data_options.max_body_bytes = static_cast<uint64_t>(max_message_mb) << 20;
    data_options.max_pull_wait = absl::Seconds(max_pull_wait_s);
    if (rpc_metrics != nullptr) {
      data_options.on_call = [rpc_metrics](data_plane::Method method,
                                           absl::StatusCode code,
                                           absl::Duration elapsed,
                                           uint64_t request_bytes,
                                           uint64_t response_bytes) {
        // Only Push and Pull reach here (PushPull as its two parts).
        rpc_metrics->RecordCall(method == data_plane::Method::kPush
                                    ? "/pstrain.ParameterServer/Push"
                                    : "/pstrain.ParameterServer/Pull",
                                code, elapsed, request_bytes, response_bytes);
      };
    }
    absl::StatusOr<std::unique_ptr<DataPlaneServer>> started =
        DataPlaneServer::Start(data_options, &service);
    if (!started.ok()) {
      LOG(ERROR) << "cannot serve the data plane on "
                 << absl::GetFlag(FLAGS_host) << ":" << data_port
                 << " (--data_port): " << started.status();
      return 1;
    }
    data_plane_server = std::move(*started);
    service.set_data_port(data_plane_server->port(), tls);
  }
  // Before the gRPC server goes, on every path.
  auto stop_data_plane = [&data_plane_server] {
    if (data_plane_server != nullptr) data_plane_server->Shutdown();
  };
  // Global in gRPC: every server built from here on gets the health service
  // and (see WithoutReflection) reflection.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int selected_port = 0;
  const std::string address =
      absl::StrCat(absl::GetFlag(FLAGS_host), ":", port);
  builder.AddListeningPort(address, *credentials, &selected_port);
  builder.SetMaxReceiveMessageSize(max_message_mb << 20);
  builder.SetMaxSendMessageSize(max_message_mb << 20);
  ApplyGrpcTuning(*grpc_tuning, &builder);
  builder.RegisterService(&service);
  if (rpc_metrics != nullptr) {
    std::vector<
        std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
        interceptors;
    interceptors.push_back(
        std::make_unique<SharedInterceptorFactory>(rpc_metrics));
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || selected_port == 0) {
    LOG(ERROR) << "cannot listen on " << address
               << " (address in use or not local?)";
    stop_data_plane();
    return 1;
  }
  grpc::CallbackGenericService no_service;
  std::unique_ptr<grpc::Server> health_server;
  if (health_port != 0) {
    grpc::ServerBuilder health_builder;
    health_builder.SetOption(std::make_unique<WithoutReflection>());
    // gRPC refuses a server with no service of its own to poll for; this
    // one answers every method but health UNIMPLEMENTED, as none would.
    health_builder.RegisterCallbackGenericService(&no_service);
    int health_selected = 0;
    const std::string health_address =
        absl::StrCat(absl::GetFlag(FLAGS_host), ":", health_port);
    health_builder.AddListeningPort(
        health_address, grpc::InsecureServerCredentials(), &health_selected);
    health_server = health_builder.BuildAndStart();
    if (health_server == nullptr || health_selected == 0) {
      LOG(ERROR) << "cannot listen on " << health_address << " (--health_port)";
      server->Shutdown();
      stop_data_plane();
      return 1;
    }
  }
  // SERVING for the whole server ("") and the service by name, on both.
  auto set_serving = [&](bool serving) {
    for (grpc::Server* s : {server.get(), health_server.get()}) {
      if (s == nullptr) continue;
      s->GetHealthCheckService()->SetServingStatus(serving);
      s->GetHealthCheckService()->SetServingStatus("pstrain.ParameterServer",
                                                   serving);
    }
  };
  set_serving(true);
  LOG(INFO) << "ps_server shard " << options.shard_id << "/"
            << options.num_shards << " listening on "
            << absl::GetFlag(FLAGS_host) << ":" << selected_port << ", mode "
            << ConsistencyModeName(options.mode) << ", " << options.num_workers
            << " workers, optimizer " << options.optimizer.name
            << ", learning rate "
            << DescribeLearningRate(given_learning_rate, options.optimizer.name,
                                    default_learning_rate, "--learning_rate")
            << (absl::GetFlag(FLAGS_tls_cert).empty()        ? ", plaintext"
                : absl::GetFlag(FLAGS_tls_client_ca).empty() ? ", TLS"
                                                             : ", mutual TLS")
            << (auth_token->empty() ? "" : ", bearer token required")
            << (data_plane_server != nullptr
                    ? absl::StrCat(", tensors also on data port ",
                                   data_plane_server->port(),
                                   tls ? " (TLS)" : "")
                    : ", tensors over gRPC only")
            << (health_server ? absl::StrCat(", health on port ", health_port)
                              : "");
  if (!tls && auth_token->empty() &&
      !IsLoopbackHost(absl::GetFlag(FLAGS_host))) {
    LOG(WARNING) << OpenPortWarning(
        absl::GetFlag(FLAGS_host), selected_port,
        data_plane_server != nullptr ? data_plane_server->port() : 0);
  }
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty()) {
    absl::Status written =
        WriteFileAtomically(port_file, absl::StrCat(selected_port, "\n"));
    if (!written.ok()) {
      LOG(ERROR) << written;
      server->Shutdown();
      stop_data_plane();
      return 1;
    }
  }

  const int signal_number = WaitForTerminationSignal();
  LOG(INFO) << "signal " << signal_number << ": shutting down";
  set_serving(false);  // probes and balancers stop sending work first
  (*shard)->BeginShutdown();
  service.CancelCallStreams();
  stop_data_plane();
  server->Shutdown(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(
                       absl::GetFlag(FLAGS_shutdown_grace_s) * 1000)));
  if (health_server != nullptr) health_server->Shutdown();
  // Whether the state this shard ends with is on disk.
  const char* final_checkpoint = "none";
  if (checkpointer != nullptr) {
    final_checkpoint = "written";
    if (absl::Status s = checkpointer->Stop(); !s.ok()) {
      LOG(ERROR) << "final checkpoint failed: " << s;
      final_checkpoint = "failed";
    }
  }
  const StatsResponse stats = (*shard)->Stats();
  LOG(INFO) << "final stats: " << stats.ShortDebugString();
  // For whoever ran the job (deploy/local/launch.sh, pstrain.sbatch): what
  // the shard ends with, on stdout, one line.
  std::cout << ShardFinalJson(stats, final_checkpoint) << std::endl;
  return 0;
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  pstrain::InitProgram(argc, argv,
                       "ps_server: one shard of the parameter server");
  pstrain::CatchTerminationSignals();
  // gRPC's own log lines (a refused TLS handshake among them) into glog,
  // counted: before any gRPC object exists.
  pstrain::CountGrpcTlsRefusals();
  return pstrain::Main(argc, argv);
}
