// One ps_server's life, from its config: the shard (restored from the
// newest checkpoint), the service, the tensor data plane, metrics, the gRPC
// port and the plaintext health port; then serving until SIGTERM or SIGINT,
// and the shutdown: NOT_SERVING, in-flight calls finished, a last
// checkpoint, one line saying how the shard ends.
#include "ps_server/server_run.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/impl/server_builder_plugin.h>

#include <algorithm>
#include <iostream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/cli.h"
#include "common/learning_rates.h"
#include "common/metrics.h"
#include "common/transport/socket.h"
#include "common/transport/tls.h"
#include "common/transport/tls_stream.h"
#include "glog/logging.h"
#include "ps_server/checkpointer.h"
#include "ps_server/data_plane_server.h"
#include "ps_server/replication.h"
#include "ps_server/service.h"
#include "ps_server/shard.h"

namespace pstrain {
namespace {

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

// A replicated sync shard's step records, per message: on a primary the
// mean ms from a message's newest record to its confirmation and the
// call's own ms; on a backup the mean ms applying one took.
std::string StepRecordTimesJson(const StatsResponse& stats) {
  auto mean_ms = [](double seconds, int64_t count) {
    return absl::StrFormat("%.4f", count > 0 ? 1e3 * seconds / count : 0.0);
  };
  std::string json;
  if (stats.step_record_sends() > 0) {
    absl::StrAppend(
        &json, ",\"step_record_sends\":", stats.step_record_sends(),
        ",\"step_record_confirm_ms\":",
        mean_ms(stats.step_record_confirm_seconds(), stats.step_record_sends()),
        ",\"step_record_send_ms\":",
        mean_ms(stats.step_record_send_seconds(), stats.step_record_sends()));
  }
  if (stats.step_record_applies() > 0) {
    absl::StrAppend(&json,
                    ",\"step_record_applies\":", stats.step_record_applies(),
                    ",\"step_record_apply_ms\":",
                    mean_ms(stats.step_record_apply_seconds(),
                            stats.step_record_applies()));
  }
  return json;
}

// {"event":"shard_final",...}: the step (sync) or update count (async) the
// shard ends at, and what weakened or lost steps, for a launcher's report
// of the job whatever its workers print. job_final_version: the version of
// the final model the workers reported (0: none did); behind: this shard's
// state is older than that (restored from a checkpoint taken before the
// job's last steps, after the workers had them), or was rebuilt up to it
// with losses after a worker had pulled it: those steps are lost.
std::string ShardFinalJson(const StatsResponse& stats, int64_t state_version,
                           int64_t skipped_to_step, bool final_rebuilt,
                           absl::string_view final_checkpoint) {
  const int64_t final_version = stats.job_final_version();
  const bool behind = final_version > 0 &&
                      ((state_version >= 0 && state_version < final_version) ||
                       skipped_to_step >= final_version || final_rebuilt);
  return absl::StrCat(
      "{\"event\":\"shard_final\",\"shard\":", stats.shard_id(),
      ",\"num_shards\":", stats.num_shards(), ",\"mode\":\"", stats.mode(),
      "\",\"model_registered\":", stats.model_registered() ? "true" : "false",
      ",\"version\":", state_version, ",\"steps_short\":", stats.steps_short(),
      ",\"steps_lost\":", stats.steps_lost(),
      ",\"updates_lost\":", stats.updates_lost(),
      ",\"late_gradients_dropped\":", stats.late_gradients_dropped(),
      ",\"job_final_version\":", stats.job_final_version(),
      ",\"behind\":", behind ? "true" : "false", ",\"final_checkpoint\":\"",
      final_checkpoint, "\"",
      // A replicated shard's every replica reports; a job's report takes
      // the primary's (deploy/local/job_report.sh).
      stats.replicas() > 1
          ? absl::StrCat(",\"replica\":", stats.replica_index(),
                         ",\"replica_role\":\"", stats.replica_role(), "\"",
                         StepRecordTimesJson(stats))
          : "",
      "}");
}

// The server's parts, built in order by Start and taken down in reverse by
// Stop. Each Start* returns false (having logged why) when a part cannot
// start: the server then exits 1.
class ServerRun {
 public:
  explicit ServerRun(const ServerConfig& config) : config_(config) {}

  int Run() {
    ExitIfCannotListen();
    if (!StartShard() || !StartMetrics() || !StartDataPlane() || !StartGrpc() ||
        !StartHealth() || !StartReplicas() || !Announce()) {
      if (server_ != nullptr) server_->Shutdown();
      StopDataPlane();
      return 1;
    }
    const int reason = WaitForTerminationSignal();
    if (reason == kRestoreFailed) {
      Stop(/*final_checkpoint=*/false);
      return 1;
    }
    if (reason == kReplicaStale) {
      // Its state may hold what no other replica has, or lack what they
      // have: no final checkpoint of it.
      LOG(ERROR) << "this replica is stale: it exits with status "
                 << kStaleExitStatus
                 << " so that a restart (launch.sh --replica_restarts, a "
                    "Kubernetes pod restart, by hand) catches it up from "
                    "the primary";
      Stop(/*final_checkpoint=*/false);
      return kStaleExitStatus;
    }
    LOG(INFO) << "signal " << reason << ": shutting down";
    Stop(/*final_checkpoint=*/true);
    return 0;
  }

  // WaitForTerminationSignal's reason when this replica became stale.
  static constexpr int kReplicaStale = 200;
  // ... when its checkpoint, read at start, could not be installed.
  static constexpr int kRestoreFailed = 201;
  // EX_TEMPFAIL: started again, the process will do.
  static constexpr int kStaleExitStatus = 75;

 private:
  bool tls() const { return !config_.tls.cert.empty(); }

  // A --host/--port that cannot be listened on (a port in use, an address
  // not of this machine) ends the server at once, in one line, before a
  // restore and before gRPC's own multi-line dump. The probe is closed
  // before anything binds.
  void ExitIfCannotListen() {
    const ServerNetworkConfig& n = config_.network;
    int bound = 0;
    absl::StatusOr<ScopedFd> probe =
        ListenTcp(n.host, n.port, /*buffer_bytes=*/0, &bound);
    if (!probe.ok()) {
      ExitOnFlagErrors({absl::InvalidArgumentError(
          absl::StrCat("--host=", n.host, " --port=", n.port,
                       ": cannot listen there: ", probe.status().message()))});
    }
  }

  bool StartShard() {
    const ShardOptions options = ShardOptionsOf(config_);
    absl::StatusOr<std::unique_ptr<Shard>> shard = Shard::Create(options);
    ExitOnFlagErrors({shard.status()});
    shard_ = std::move(*shard);
    const std::string dir = CheckpointerOptionsOf(config_).dir;
    bool checkpoint_read = false;
    if (!dir.empty()) {
      // A directory that cannot take a checkpoint ends the server now (exit
      // 2), not after a job's worth of failed checkpoints.
      ExitOnFlagErrors({ProbeCheckpointDir(dir)});
      absl::StatusOr<std::unique_ptr<CheckpointDirLock>> lock =
          CheckpointDirLock::Acquire(
              dir, options.shard_id,
              absl::Seconds(config_.checkpoint_dir_wait_s));
      ExitOnFlagErrors({lock.status()});
      checkpoint_dir_lock_ = std::move(*lock);
      checkpointer_ = std::make_unique<Checkpointer>(
          shard_.get(), options.shard_id, options.num_shards,
          CheckpointerOptionsOf(config_));
      if (config_.replicas > 1) {
        // Installed once the replica set answers whether a running replica
        // holds newer state than this file (StartReplicas).
        absl::StatusOr<bool> loaded = checkpointer_->LoadRestore();
        if (!loaded.ok()) {
          LOG(ERROR) << "cannot restore from " << dir << ": "
                     << loaded.status();
          return false;
        }
        checkpoint_read = *loaded;
        if (*loaded) {
          LOG(INFO) << "read a checkpoint from " << dir
                    << ": installed if no other replica of the shard is "
                       "running, else dropped for a catch-up";
        } else {
          LOG(INFO) << "no checkpoint in " << dir << ": starting fresh";
        }
      } else {
        absl::StatusOr<std::string> restored = checkpointer_->Restore();
        if (!restored.ok()) {
          LOG(ERROR) << "cannot restore from " << dir << ": "
                     << restored.status();
          return false;
        }
        LOG(INFO) << (restored->empty() ? absl::StrCat("no checkpoint in ", dir,
                                                       ": starting fresh")
                                        : *restored);
      }
    }
    ServiceOptions service_options;
    service_options.drop_push_response_probability =
        config_.inject_drop_push_response_probability;
    service_options.crash_at = config_.inject_crash_at;
    service_options.auth_token = *ReadAuthToken(config_.tls.auth_token_file);
    auth_token_ = service_options.auth_token;
    service_ = std::make_unique<ParameterServerService>(
        shard_.get(), service_options, checkpointer_.get());
    if (config_.replicas > 1) {
      ReplicaOptions replica_options = ReplicaOptionsOf(config_);
      replica_options.auth_token = auth_token_;
      if (tls()) {
        // A replica calls the others as a client presenting its own
        // server certificate.
        const ClientTlsFiles files{config_.tls.replica_ca.empty()
                                       ? config_.tls.client_ca
                                       : config_.tls.replica_ca,
                                   config_.tls.cert, config_.tls.key, ""};
        absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
            MakeChannelCredentials(files);
        absl::StatusOr<std::shared_ptr<const TlsContext>> data_tls =
            TlsContext::ForClient(files, config_.network.data_plane_ktls);
        ExitOnFlagErrors({CheckClientAuthUsage("tls_cert", config_.tls.cert),
                          credentials.status(), data_tls.status()});
        replica_options.credentials = *credentials;
        replica_options.data_tls = *data_tls;
      }
      Shard* shard = shard_.get();
      replicas_ = std::make_unique<ReplicaSet>(
          replica_options, [shard] { return shard->HasModel(); });
      replicas_->set_on_stale([] { EndTerminationWait(kReplicaStale); });
      service_->set_replicas(replicas_.get());
      if (checkpointer_ != nullptr) {
        ReplicaSet* replicas = replicas_.get();
        checkpointer_->set_holds_state(
            [replicas] { return replicas->holds_state(); });
      }
      if (checkpoint_read) {
        Checkpointer* checkpointer = checkpointer_.get();
        replicas_->set_settle_restored([checkpointer](bool keep) {
          if (!keep) {
            checkpointer->DiscardRestore();
            return true;
          }
          absl::StatusOr<std::string> restored = checkpointer->InstallRestore();
          if (!restored.ok()) {
            // As a server with one replica: a restart would fail alike.
            LOG(ERROR) << "cannot install the checkpoint read: "
                       << restored.status();
            EndTerminationWait(kRestoreFailed);
            return false;
          }
          LOG(INFO) << *restored;
          return true;
        });
      }
    }
    return true;
  }

  bool StartMetrics() {
    const ServerNetworkConfig& n = config_.network;
    if (n.metrics_port != 0) {
      absl::StatusOr<std::unique_ptr<MetricsEndpoint>> started =
          MetricsEndpoint::Start(n.metrics_host, std::max(n.metrics_port, 0),
                                 n.metrics_port_file);
      if (!started.ok()) {
        LOG(ERROR) << started.status();
        return false;
      }
      metrics_ = std::move(*started);
      ParameterServerService* service = service_.get();
      metrics_->Add(std::make_shared<ShardStatsCollector>(
          [service] { return service->CurrentStats(); }));
      LOG(INFO) << "metrics on http://" << n.metrics_host << ":"
                << metrics_->port() << "/metrics";
    }
    if (checkpointer_ != nullptr) checkpointer_->Start();
    // An interceptor, not a wrapper around the service: it sees every call
    // (refused ones, health and reflection too) from arrival to status,
    // without the service knowing about metrics. The data plane records
    // into it too, so gRPC and the data plane share it.
    if (metrics_ != nullptr) {
      // Every method this server (and, with the same builder's plugins,
      // health and reflection) answers; anything else counts as "unknown".
      std::vector<std::string> known_methods =
          ServiceMethodNames("pstrain.ParameterServer");
      known_methods.insert(
          known_methods.end(),
          {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
           "/grpc.reflection.v1alpha.ServerReflection/"
           "ServerReflectionInfo"});
      rpc_metrics_ = std::make_shared<RpcMetricsInterceptorFactory>(
          metrics_->registry(), known_methods,
          absl::flat_hash_set<std::string>(std::begin(kRawRequestMethods),
                                           std::end(kRawRequestMethods)));
    }
    return true;
  }

  bool StartDataPlane() {
    const ServerNetworkConfig& n = config_.network;
    if (n.data_port < 0) return true;
    DataPlaneServerOptions data_options;
    if (tls()) {
      // The gRPC port's files, already checked by ServerConfigProblems.
      absl::StatusOr<std::shared_ptr<const TlsContext>> context =
          TlsContext::ForServer(
              {config_.tls.cert, config_.tls.key, config_.tls.client_ca},
              n.data_plane_ktls);
      if (!context.ok()) {
        LOG(ERROR) << "cannot serve the data plane with TLS: "
                   << context.status();
        return false;
      }
      data_options.tls = *context;
      data_options.handshake_timeout = absl::Seconds(n.data_plane_handshake_s);
    }
    data_options.host = n.host;
    data_options.port = n.data_port;
    data_options.max_body_bytes = static_cast<uint64_t>(n.max_message_mb) << 20;
    data_options.max_pull_wait = absl::Seconds(config_.max_pull_wait_s);
    if (rpc_metrics_ != nullptr) {
      data_options.on_call = [metrics = rpc_metrics_](data_plane::Method method,
                                                      absl::StatusCode code,
                                                      absl::Duration elapsed,
                                                      uint64_t request_bytes,
                                                      uint64_t response_bytes) {
        // Only Push and Pull reach here (PushPull as its two parts).
        metrics->RecordCall(method == data_plane::Method::kPush
                                ? "/pstrain.ParameterServer/Push"
                                : "/pstrain.ParameterServer/Pull",
                            code, elapsed, request_bytes, response_bytes);
      };
    }
    absl::StatusOr<std::unique_ptr<DataPlaneServer>> started =
        DataPlaneServer::Start(data_options, service_.get());
    if (!started.ok()) {
      LOG(ERROR) << "cannot serve the data plane on " << n.host << ":"
                 << n.data_port << " (--data_port): " << started.status();
      return false;
    }
    data_plane_ = std::move(*started);
    service_->set_data_port(data_plane_->port(), tls());
    if (replicas_ != nullptr) replicas_->set_data_port(data_plane_->port());
    return true;
  }

  bool StartGrpc() {
    const ServerNetworkConfig& n = config_.network;
    // Global in gRPC: every server built from here on gets the health
    // service and (see WithoutReflection) reflection.
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    const std::string address = absl::StrCat(n.host, ":", n.port);
    builder.AddListeningPort(
        address,
        *MakeServerCredentials(
            {config_.tls.cert, config_.tls.key, config_.tls.client_ca}),
        &port_);
    builder.SetMaxReceiveMessageSize(n.max_message_mb << 20);
    builder.SetMaxSendMessageSize(n.max_message_mb << 20);
    // gRPC shares a port between processes by default (SO_REUSEPORT): a
    // second server on a port in use would silently take half its calls,
    // and a replica could answer for the dead one it should replace.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    ApplyGrpcTuning(n.grpc_tuning, &builder);
    builder.RegisterService(service_.get());
    if (rpc_metrics_ != nullptr) {
      std::vector<std::unique_ptr<
          grpc::experimental::ServerInterceptorFactoryInterface>>
          interceptors;
      interceptors.push_back(
          std::make_unique<SharedInterceptorFactory>(rpc_metrics_));
      builder.experimental().SetInterceptorCreators(std::move(interceptors));
    }
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port_ == 0) {
      LOG(ERROR) << "cannot listen on " << address
                 << " (address in use or not local?)";
      return false;
    }
    return true;
  }

  bool StartHealth() {
    const ServerNetworkConfig& n = config_.network;
    if (n.health_port == 0) return true;
    grpc::ServerBuilder builder;
    builder.SetOption(std::make_unique<WithoutReflection>());
    // gRPC refuses a server with no service of its own to poll for; this
    // one answers every method but health UNIMPLEMENTED, as none would.
    builder.RegisterCallbackGenericService(&no_service_);
    int selected = 0;
    const std::string address = absl::StrCat(n.host, ":", n.health_port);
    builder.AddListeningPort(address, grpc::InsecureServerCredentials(),
                             &selected);
    health_server_ = builder.BuildAndStart();
    if (health_server_ == nullptr || selected == 0) {
      LOG(ERROR) << "cannot listen on " << address << " (--health_port)";
      return false;
    }
    return true;
  }

  // Once peers can reach this one: its place in the shard's replica set.
  bool StartReplicas() {
    if (replicas_ != nullptr) replicas_->Start();
    return true;
  }

  // SERVING for the whole server ("") and the service by name, on both.
  void SetServing(bool serving) {
    for (grpc::Server* s : {server_.get(), health_server_.get()}) {
      if (s == nullptr) continue;
      s->GetHealthCheckService()->SetServingStatus(serving);
      s->GetHealthCheckService()->SetServingStatus("pstrain.ParameterServer",
                                                   serving);
    }
  }

  bool Announce() {
    SetServing(true);
    const ServerNetworkConfig& n = config_.network;
    LOG(INFO) << "ps_server shard " << config_.shard_id << "/"
              << config_.num_shards << " listening on " << n.host << ":"
              << port_ << ", mode " << config_.mode << ", "
              << config_.num_workers << " workers, optimizer "
              << config_.optimizer << ", learning rate "
              << DescribeLearningRate(
                     config_.learning_rate, config_.optimizer,
                     DefaultDenseLearningRate(config_.optimizer),
                     "--learning_rate")
              << (!tls()                          ? ", plaintext"
                  : config_.tls.client_ca.empty() ? ", TLS"
                                                  : ", mutual TLS")
              << (auth_token_.empty() ? "" : ", bearer token required")
              << (data_plane_ != nullptr
                      ? absl::StrCat(", tensors also on data port ",
                                     data_plane_->port(), tls() ? " (TLS)" : "")
                      : ", tensors over gRPC only")
              << (health_server_
                      ? absl::StrCat(", health on port ", n.health_port)
                      : "");
    if (!tls() && auth_token_.empty() && !IsLoopbackHost(n.host)) {
      LOG(WARNING) << OpenPortWarning(
          n.host, port_, data_plane_ != nullptr ? data_plane_->port() : 0);
    }
    if (!n.port_file.empty()) {
      absl::Status written =
          WriteFileAtomically(n.port_file, absl::StrCat(port_, "\n"));
      if (!written.ok()) {
        LOG(ERROR) << written;
        return false;
      }
    }
    return true;
  }

  void StopDataPlane() {
    if (data_plane_ != nullptr) data_plane_->Shutdown();
  }

  void Stop(bool final_checkpoint) {
    SetServing(false);  // probes and balancers stop sending work first
    if (replicas_ != nullptr) replicas_->Stop();
    shard_->BeginShutdown();
    service_->CancelCallStreams();
    StopDataPlane();  // before the gRPC server goes
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(static_cast<int64_t>(
                          config_.network.shutdown_grace_s * 1000)));
    if (health_server_ != nullptr) health_server_->Shutdown();
    // Whether the state this shard ends with is on disk.
    const char* checkpointed = "none";
    if (checkpointer_ != nullptr && final_checkpoint) {
      checkpointed = "written";
      if (absl::Status s = checkpointer_->Stop(); !s.ok()) {
        LOG(ERROR) << "final checkpoint failed: " << s;
        checkpointed = "failed";
      }
    }
    const StatsResponse stats = service_->CurrentStats();
    LOG(INFO) << "final stats: " << stats.ShortDebugString();
    // For whoever ran the job (deploy/local/launch.sh, pstrain.sbatch): what
    // the shard ends with, on stdout, one line.
    std::cout << ShardFinalJson(stats, shard_->StateVersion(),
                                shard_->SkippedToStep(),
                                shard_->FinalModelRebuilt(), checkpointed)
              << std::endl;
  }

  const ServerConfig& config_;
  std::unique_ptr<Shard> shard_;
  // Held while the checkpointer may write (declared before it: let go
  // after it stopped).
  std::unique_ptr<CheckpointDirLock> checkpoint_dir_lock_;
  std::unique_ptr<Checkpointer> checkpointer_;
  std::unique_ptr<ReplicaSet> replicas_;
  std::unique_ptr<ParameterServerService> service_;
  std::string auth_token_;
  std::unique_ptr<MetricsEndpoint> metrics_;
  std::shared_ptr<RpcMetricsInterceptorFactory> rpc_metrics_;
  std::unique_ptr<DataPlaneServer> data_plane_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  grpc::CallbackGenericService no_service_;
  std::unique_ptr<grpc::Server> health_server_;
};

}  // namespace

int RunServer(const ServerConfig& config) { return ServerRun(config).Run(); }

}  // namespace pstrain
