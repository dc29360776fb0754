// ps_bench's parameter-server mode (ps_bench.h): (c) real ps_server
// processes (async, SGD, tiny learning rate) through PsClient, plaintext or
// with mutual TLS.
#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "bench/child_process.h"
#include "bench/transport/ps_bench.h"
#include "common/consistency_mode.h"
#include "common/partition.h"
#include "common/transport/grpc_tuning.h"
#include "common/transport/tensor_codec.h"
#include "common/transport/tls.h"
#include "common/transport/tls_stream.h"
#include "proto/ps.pb.h"
#include "worker/client/ps_client.h"

namespace pstrain::bench::ps_bench {

ModelSchema BenchSchema(int64_t size) {
  ModelSchema schema;
  schema.set_seed(1);
  DenseTensorSpec* tensor = schema.add_dense();
  tensor->set_name("bench");
  tensor->add_shape(size / 4);
  tensor->mutable_init()->set_kind(InitSpec::ZEROS);
  schema.set_block_elements(absl::GetFlag(FLAGS_block_elements));
  schema.set_block_elements(ResolvedBlockElements(schema));
  return schema;
}

namespace {

// One client thread's PS state: its own client, buffers and step counter.
struct PsWorker {
  std::unique_ptr<PsClient> client;
  std::vector<float> params;
  std::vector<float> grads;
  // The tensors as the calls take them: the float32 vectors above, or, for
  // a bfloat16 wire type, 16-bit copies handed over as they travel (what a
  // GPU worker that casts on its device gives the client).
  std::vector<uint16_t> params16, grads16;
  std::vector<PsClient::TensorRef> pull_into;
  std::vector<PsClient::ConstTensorRef> push_from;
  // Async servers reject a push whose step is not above the worker's last.
  int64_t next_step = 0;
};

// The options of every bench client: the worker's transport flags, with
// `security` deciding credentials and whether the data plane is used.
absl::StatusOr<PsClientOptions> ClientOptions(
    const std::vector<std::string>& hosts, Security security) {
  const absl::StatusOr<GrpcTuning> tuning = GrpcTuningFromFlags();
  if (!tuning.ok()) return tuning.status();
  PsClientOptions options;
  options.hosts = hosts;
  options.grpc_tuning = *tuning;
  options.call_streams = absl::GetFlag(FLAGS_call_streams);
  options.data_plane = absl::GetFlag(FLAGS_data_plane);
  if (security != Security::kPlain) {
    const std::string dir = absl::GetFlag(FLAGS_tls_dir);
    const ClientTlsFiles files = {dir + "/ca.pem", dir + "/client.pem",
                                  dir + "/client.key", ""};
    absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
        MakeChannelCredentials(files);
    if (!credentials.ok()) return credentials.status();
    options.credentials = *credentials;
    if (security == Security::kTlsDataPlane) {
      absl::StatusOr<std::shared_ptr<const TlsContext>> tls =
          TlsContext::ForClient(files, absl::GetFlag(FLAGS_ktls));
      if (!tls.ok()) return tls.status();
      options.data_plane_tls = *tls;
    } else {
      options.data_plane = false;
    }
  }
  options.connections_per_shard = absl::GetFlag(FLAGS_connections_per_shard);
  const absl::StatusOr<DataType> wire_type =
      ParseWireType(absl::GetFlag(FLAGS_gradient_wire_type));
  if (!wire_type.ok()) return wire_type.status();
  options.gradient_wire_type = *wire_type;
  const absl::StatusOr<DataType> parameter_type =
      ParseParameterWireType(absl::GetFlag(FLAGS_parameter_wire_type));
  if (!parameter_type.ok()) return parameter_type.status();
  options.parameter_wire_type = *parameter_type;
  options.gradient_topk_fraction = absl::GetFlag(FLAGS_gradient_topk_fraction);
  options.rpc_timeout = absl::Seconds(absl::GetFlag(FLAGS_io_timeout_s));
  options.connect_timeout = kStartTimeout;
  return options;
}

// Clients, registration and the three PS phases against running shards.
absl::Status RunPsPhases(const std::vector<std::string>& hosts, int clients,
                         Security security, int64_t size, PsPhases* out) {
  const int64_t elements = size / 4;
  const ModelSchema schema = BenchSchema(size);

  const absl::StatusOr<PsClientOptions> options =
      ClientOptions(hosts, security);
  if (!options.ok()) return options.status();
  std::vector<PsWorker> workers(clients);
  for (int c = 0; c < clients; ++c) {
    absl::StatusOr<std::unique_ptr<PsClient>> client =
        PsClient::Create(*options);
    if (!client.ok()) return client.status();
    absl::StatusOr<Registration> registration =
        (*client)->Register(schema, clients, /*worker_id=*/c);
    if (!registration.ok()) return registration.status();
    if (registration->mode != ConsistencyMode::kAsync) {
      return absl::FailedPreconditionError(absl::StrCat(
          "servers run mode '", ConsistencyModeName(registration->mode),
          "', expected async"));
    }
    PsWorker& w = workers[c];
    w.client = std::move(*client);
    w.params.assign(elements, 0.0f);
    // Small and finite: servers may reject non-finite gradients.
    w.grads.assign(elements, 1e-3f);
    if (w.client->PullWireType(0) == BFLOAT16) {
      w.params16.assign(elements, 0);
      w.pull_into = {{BFLOAT16, w.params16.data()}};
    } else {
      w.pull_into = {{FLOAT32, w.params.data()}};
    }
    if (w.client->PushWireType(0) == BFLOAT16) {
      w.grads16.assign(elements, FloatToBfloat16Bits(1e-3f));
      w.push_from = {{BFLOAT16, w.grads16.data()}};
    } else {
      w.push_from = {{FLOAT32, w.grads.data()}};
    }
  }
  auto push = [&](int c) -> absl::Status {
    PsWorker& w = workers[c];
    absl::StatusOr<PsClient::PushResult> pushed =
        w.client->PushTensors(w.next_step++, w.push_from);
    if (!pushed.ok()) return pushed.status();
    if (pushed->blocks_duplicate != 0) {
      return absl::InternalError(absl::StrCat(
          pushed->blocks_duplicate, " duplicate(s) reported for a fresh push"));
    }
    return absl::OkStatus();
  };
  auto pull = [&](int c) -> absl::Status {
    PsWorker& w = workers[c];
    return w.client->PullTensors(w.next_step, w.pull_into).status();
  };
  const std::string prefix = security == Security::kPlain ? "ps"
                             : security == Security::kTlsDataPlane
                                 ? "tls ps"
                                 : "tls-grpc ps";
  absl::StatusOr<PhaseResult> result =
      MeasurePhase(prefix + " push", size, clients, push);
  if (!result.ok()) return result.status();
  out->push = std::move(*result);
  result = MeasurePhase(prefix + " pull", size, clients, pull);
  if (!result.ok()) return result.status();
  out->pull = std::move(*result);
  result = MeasurePhase(prefix + " push+pull", size, clients, [&](int c) {
    absl::Status pushed = push(c);
    return pushed.ok() ? pull(c) : pushed;
  });
  if (!result.ok()) return result.status();
  out->pushpull = std::move(*result);
  result = MeasurePhase(prefix + " pushpull", size, clients, [&](int c) {
    PsWorker& w = workers[c];
    const int64_t step = w.next_step++;
    absl::StatusOr<PsClient::PushPullResult> done =
        w.client->PushPullTensors(step, w.push_from, w.next_step, w.pull_into);
    if (!done.ok()) return done.status();
    if (done->pushed.blocks_duplicate != 0) {
      return absl::InternalError(
          absl::StrCat(done->pushed.blocks_duplicate,
                       " duplicate(s) reported for a fresh push"));
    }
    return absl::OkStatus();
  });
  if (!result.ok()) return result.status();
  out->one_call = std::move(*result);
  return absl::OkStatus();
}

}  // namespace

// (c) the parameter server: fresh shards for every size and repeat, since a
// server accepts one schema for its lifetime.
absl::Status MeasurePs(const std::string& ps_server, const std::string& scratch,
                       int clients, Security security, int64_t size,
                       PsPhases* out) {
  // Names never reused within a run: a port file left by the previous
  // launch would otherwise hand out a dead server's port.
  static int launch = 0;
  ++launch;
  const int servers = absl::GetFlag(FLAGS_servers);
  std::vector<std::unique_ptr<ChildProcess>> shards;
  std::vector<std::string> port_files;
  for (int s = 0; s < servers; ++s) {
    const std::string base = absl::StrCat(scratch, "/ps_", launch, "_", s);
    port_files.push_back(absl::StrCat(base, ".port"));
    std::vector<std::string> argv = {
        ps_server,
        "--host=127.0.0.1",
        "--port=0",
        absl::StrCat("--port_file=", port_files[s]),
        absl::StrCat("--shard_id=", s),
        absl::StrCat("--num_shards=", servers),
        absl::StrCat("--num_workers=", clients),
        "--mode=async",
        "--optimizer=sgd",
        "--learning_rate=1e-9"};
    if (security != Security::kPlain) {
      const std::string dir = absl::GetFlag(FLAGS_tls_dir);
      argv.push_back("--tls_cert=" + dir + "/server.pem");
      argv.push_back("--tls_key=" + dir + "/server.key");
      argv.push_back("--tls_client_ca=" + dir + "/ca.pem");
      if (absl::GetFlag(FLAGS_ktls)) argv.push_back("--data_plane_ktls");
    }
    if (absl::StatusOr<GrpcTuning> tuning = GrpcTuningFromFlags();
        tuning.ok()) {
      for (std::string& arg : GrpcTuningArgs(*tuning)) {
        argv.push_back(std::move(arg));
      }
    }
    absl::StatusOr<std::unique_ptr<ChildProcess>> shard = ChildProcess::Start(
        absl::StrCat("ps_server shard ", s), argv, absl::StrCat(base, ".log"));
    if (!shard.ok()) return shard.status();
    shards.push_back(std::move(*shard));
  }
  std::vector<std::string> hosts;
  for (int s = 0; s < servers; ++s) {
    absl::StatusOr<int> port =
        shards[s]->WaitForPort(port_files[s], kStartTimeout);
    if (!port.ok()) return port.status();
    hosts.push_back(absl::StrCat("127.0.0.1:", *port));
  }
  // The clients are gone when this returns, so the servers see their
  // connections close before SIGTERM.
  absl::Status status = RunPsPhases(hosts, clients, security, size, out);
  if (!status.ok()) {
    // What the servers said is usually the explanation.
    std::string logs;
    for (int s = 0; s < servers; ++s) {
      absl::StrAppend(&logs, "\n--- shard ", s, " (", hosts[s], ", ",
                      shards[s]->Running() ? "running" : "exited",
                      ") log tail:\n", Tail(shards[s]->Log(), 1500));
    }
    status = absl::Status(status.code(), absl::StrCat(status.message(), logs));
  }
  for (std::unique_ptr<ChildProcess>& shard : shards) shard->Stop();
  return status;
}

}  // namespace pstrain::bench::ps_bench
