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
// --shutdown_grace_s) and exits 0. The flags: ps_server/server_flags.cc;
// what they mean together: server_config.h; the server's life:
// server_run.h.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cli.h"
#include "common/cluster_spec.h"
#include "common/transport/grpc_tls_refusals.h"
#include "glog/logging.h"
#include "ps_server/server_config.h"
#include "ps_server/server_flags.h"
#include "ps_server/server_run.h"

int main(int argc, char** argv) {
  pstrain::InitProgram(argc, argv,
                       "ps_server: one shard of the parameter server");
  pstrain::CatchTerminationSignals();
  // gRPC's own log lines (a refused TLS handshake among them) into glog,
  // counted: before any gRPC object exists.
  pstrain::CountGrpcTlsRefusals();
  // The job's description sets the flags the command line leaves unset.
  absl::StatusOr<std::vector<pstrain::FlagSetting>> from_spec =
      pstrain::ApplyClusterSpec(pstrain::ClusterRole::kPs,
                                pstrain::ClusterSpecFlag(), argc, argv);
  pstrain::ExitOnFlagErrors({from_spec.status()});
  if (!from_spec->empty()) {
    std::vector<std::string> applied;
    for (const pstrain::FlagSetting& f : *from_spec) {
      applied.push_back(absl::StrCat("--", f.name, "=", f.value));
    }
    LOG(INFO) << "from the cluster spec: " << absl::StrJoin(applied, " ");
  }
  std::vector<absl::Status> problems;
  const pstrain::ServerConfig config =
      pstrain::ServerConfigFromFlags(&problems);
  for (absl::Status& problem : pstrain::ServerConfigProblems(config)) {
    problems.push_back(std::move(problem));
  }
  pstrain::ExitOnFlagErrors(problems);
  return pstrain::RunServer(config);
}
