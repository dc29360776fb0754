#include "worker/client/client_config.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/cli.h"
#include "common/transport/tensor_codec.h"
#include "common/transport/tls_stream.h"

namespace pstrain {
namespace {

// The options `config` describes, as far as they can be made; every problem
// found on the way goes into `problems`.
PsClientOptions BuildOptions(const ClientConfig& config,
                             std::vector<absl::Status>* problems) {
  std::vector<absl::Status>& checks = *problems;
  checks.push_back(
      CheckAtLeast("heartbeat_interval_s", config.heartbeat_interval_s, 0));
  checks.push_back(CheckAtLeast("retry_window_s", config.retry_window_s, 0));
  const double duplicate_probability = config.inject_duplicate_push_probability;
  if (!(duplicate_probability >= 0 && duplicate_probability <= 1)) {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--inject_duplicate_push_probability must be in [0, 1], "
                     "got ",
                     duplicate_probability)));
  }
  checks.push_back(
      CheckAtLeast("inject_push_jitter_ms", config.inject_push_jitter_ms, 0));
  checks.push_back(CheckAtLeast("rpc_timeout_s", config.rpc_timeout_s, 0.001));
  checks.push_back(
      CheckAtLeast("connect_timeout_s", config.connect_timeout_s, 0.001));
  PsClientOptions options;
  if (config.max_message_mb < 1 || config.max_message_mb > 2047) {
    checks.push_back(absl::InvalidArgumentError(absl::StrCat(
        "--max_message_mb must be in [1, 2047], got ", config.max_message_mb)));
  } else {
    options.max_message_bytes = config.max_message_mb << 20;
  }
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      MakeChannelCredentials(config.tls);
  checks.push_back(credentials.status());
  absl::StatusOr<std::string> auth_token =
      ReadAuthToken(config.auth_token_file);
  checks.push_back(auth_token.status());
  checks.push_back(ValidateGrpcTuning(config.grpc_tuning));
  options.grpc_tuning = config.grpc_tuning;
  if (credentials.ok()) options.credentials = *credentials;
  absl::StatusOr<std::shared_ptr<const TlsContext>> data_plane_tls =
      TlsContext::ForClient(config.tls, config.data_plane_ktls);
  // Its files were checked above; a failure here is already reported.
  if (credentials.ok() && data_plane_tls.ok()) {
    options.data_plane_tls = *data_plane_tls;
  } else if (credentials.ok()) {
    checks.push_back(data_plane_tls.status());
  }
  if (auth_token.ok()) options.auth_token = *auth_token;
  options.hosts = config.hosts;
  options.rpc_timeout = absl::Seconds(config.rpc_timeout_s);
  options.connect_timeout = absl::Seconds(config.connect_timeout_s);
  options.connections_per_shard = config.connections_per_shard;
  options.call_streams = config.call_streams;
  options.data_plane = config.data_plane;
  options.data_requests_in_flight = config.data_requests_in_flight;
  if (config.pulls_from_backups == "by_host") {
    options.pulls_from_backups = PsClientOptions::BackupReads::kByHost;
  } else if (config.pulls_from_backups == "always") {
    options.pulls_from_backups = PsClientOptions::BackupReads::kAlways;
  } else if (config.pulls_from_backups == "never") {
    options.pulls_from_backups = PsClientOptions::BackupReads::kNever;
  } else {
    checks.push_back(absl::InvalidArgumentError(
        absl::StrCat("--pulls_from_backups must be by_host, always or never, "
                     "got '",
                     config.pulls_from_backups, "'")));
  }
  options.gradient_topk_fraction = config.gradient_topk_fraction;
  options.sparse_row_cache_steps = config.sparse_cache_steps;
  options.sparse_row_cache_bytes = int64_t{config.sparse_cache_mb} << 20;
  options.heartbeat_interval = absl::Seconds(config.heartbeat_interval_s);
  options.retry_window = absl::Seconds(config.retry_window_s);
  options.inject_duplicate_push_probability = duplicate_probability;
  options.inject_push_jitter =
      absl::Milliseconds(std::max(0.0, config.inject_push_jitter_ms));
  const absl::StatusOr<DataType> wire_type =
      ParseWireType(config.gradient_wire_type);
  checks.push_back(wire_type.status());
  if (wire_type.ok()) options.gradient_wire_type = *wire_type;
  const absl::StatusOr<DataType> parameter_type =
      ParseParameterWireType(config.parameter_wire_type);
  checks.push_back(parameter_type.status());
  if (parameter_type.ok()) options.parameter_wire_type = *parameter_type;
  // What PsClient::Create would refuse: the hosts' form, the connections,
  // the top-k fraction.
  for (absl::Status& problem : PsClientOptionsProblems(options)) {
    checks.push_back(std::move(problem));
  }
  return options;
}

}  // namespace

std::vector<absl::Status> ClientConfigProblems(const ClientConfig& config) {
  std::vector<absl::Status> problems;
  BuildOptions(config, &problems);
  std::vector<absl::Status> failed;
  for (absl::Status& problem : problems) {
    if (!problem.ok()) failed.push_back(std::move(problem));
  }
  return failed;
}

absl::StatusOr<PsClientOptions> MakePsClientOptions(
    const ClientConfig& config) {
  std::vector<absl::Status> problems;
  PsClientOptions options = BuildOptions(config, &problems);
  if (absl::Status joined = JoinProblems(problems); !joined.ok()) {
    return joined;
  }
  return options;
}

}  // namespace pstrain
