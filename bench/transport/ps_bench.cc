// ps_bench: push/pull goodput and latency of the parameter server, next to
// the limits of the transport underneath, all measured in the same run:
//
//   ps_bench [--sizes=4096,...,67108864] [--servers=1] [--clients=1]
//
// For every size N (bytes; one float32 tensor of N/4 elements) it measures
//   (a) raw TCP between two processes on loopback: push+pull goodput
//       (write N, read N back: 2N / time) and the round trip of N bytes
//       answered by a 16-byte ack;
//   (b) the gRPC floor (grpc_floor.h): push then pull of N bytes through
//       plain gRPC at its best, with no parameter-server work (2N / time,
//       p50/p99);
//   (c) real ps_server processes (async, SGD, tiny learning rate) through
//       PsClient: Push, Pull and Push-then-Pull goodput, Push p50/p99, and
//       the same push and pull as one PushPull call (how a worker ends a
//       step).
// The baselines' peers are this binary re-executed with --role=tcp_peer or
// --role=grpc_floor, so they cost what a second process costs on this machine.
//
// Every child process dies with the bench: it is stopped on every return
// path, SIGKILLed by a guardian thread on SIGINT/SIGTERM or when --deadline_s
// runs out, and gets SIGKILL from the kernel (PR_SET_PDEATHSIG) should the
// bench die any other way. Every blocking call carries a deadline.
//
// The parts are listed in ps_bench.h.
#include "bench/transport/ps_bench.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "bench/child_process.h"
#include "bench/transport/grpc_floor.h"
#include "common/cli.h"
#include "common/partition.h"
#include "common/transport/socket.h"
#include "common/transport/tensor_codec.h"
#include "glog/logging.h"

ABSL_FLAG(std::vector<std::string>, sizes,
          std::vector<std::string>({"4096", "65536", "1048576", "4194304",
                                    "16777216", "67108864"}),
          "Payload sizes in bytes (multiples of 4: a float32 tensor of "
          "size/4 elements).");
ABSL_FLAG(int64_t, iterations, 0,
          "Measured operations per client and phase; 0 runs each phase for "
          "--phase_seconds (at least 10 operations).");
ABSL_FLAG(double, phase_seconds, 0.25,
          "With --iterations=0, how long each of the seven phases of a size "
          "runs (so a size takes about 7x this plus server start-up).");
ABSL_FLAG(int64_t, warmup, 2,
          "Unmeasured operations per client before every phase.");
ABSL_FLAG(int, repeats, 1,
          "Measure every size this many times, baselines and PS interleaved "
          "so that drift on a noisy machine hits both; the table shows "
          "medians (ratios: the median of the per-repeat ratios) and the "
          "min..max spread.");
ABSL_FLAG(int, servers, 1, "ps_server shards to start.");
ABSL_FLAG(bool, call_streams, true,
          "PsClient option: single-RPC pushes and pulls on a long-lived "
          "stream (the worker's --call_streams); false measures unary calls.");
ABSL_FLAG(bool, data_plane, true,
          "PsClient option: pushes and pulls on the servers' data plane (the "
          "worker's --data_plane); false measures them over gRPC.");
ABSL_FLAG(int, connections_per_shard, 4,
          "PsClient option: TCP connections from each client to each shard "
          "(the worker's --connections_per_shard).");
ABSL_FLAG(std::string, gradient_wire_type, "fp32",
          "PsClient option: pushed gradients as fp32, fp16, bf16 or topk "
          "(the worker's --gradient_wire_type); goodput still counts the "
          "dense float32 bytes, so a compressed push shows its effective "
          "rate. bf16 is handed to the client as bf16 bits, as a GPU "
          "worker that casts on its device does; fp16 and topk are "
          "converted by the client.");
ABSL_FLAG(std::string, parameter_wire_type, "fp32",
          "PsClient option: pulled parameters as fp32, fp16 or bf16 (the "
          "worker's --parameter_wire_type; bf16 taken as bf16 bits, as a "
          "GPU worker does); goodput counts float32 bytes.");
ABSL_FLAG(double, gradient_topk_fraction, 0.01,
          "With --gradient_wire_type=topk: the fraction of each block sent.");
ABSL_FLAG(int, clients, 1,
          "Client threads, each with its own PsClient and worker_id (and its "
          "own TCP connection and gRPC channel for the baselines); goodput is "
          "aggregated over them.");
ABSL_FLAG(int64_t, block_elements, pstrain::kBlockElementsByModel,
          "Schema block size in elements; 0 (the worker's --block_elements "
          "default): picked from each size as for a model of that size.");
ABSL_FLAG(std::string, tls_dir, "",
          "A directory from deploy/tls/make_certs.sh (ca.pem, server.pem/key, "
          "client.pem/key): also measure the PS with mutual TLS, on the TLS "
          "data plane and over gRPC+TLS (the path TLS clusters had before "
          "the data plane took TLS), beside the plaintext PS of the same "
          "run.");
ABSL_FLAG(bool, ktls, false,
          "With --tls_dir: servers and clients ask for kernel TLS "
          "(--data_plane_ktls); whether they got it is in the servers' "
          "logs.");
ABSL_FLAG(std::string, ps_server, "",
          "ps_server binary; default: the one in this binary's runfiles.");
ABSL_FLAG(std::string, json_out, "",
          "If set, the JSON lines are also written to this file.");
ABSL_FLAG(int, tcp_buffer_bytes, 4 << 20,
          "SO_SNDBUF/SO_RCVBUF of the raw TCP baseline's sockets (the kernel "
          "caps it at net.core.[rw]mem_max); 0 leaves kernel autotuning on.");
ABSL_FLAG(double, io_timeout_s, 120,
          "Deadline of every RPC and socket read/write.");
ABSL_FLAG(double, deadline_s, 1800,
          "The whole run's deadline: past it every child is killed and the "
          "bench exits 3.");
// Internal: how the bench re-executes itself as a baseline peer.
ABSL_FLAG(std::string, role, "bench", "bench, tcp_peer or grpc_floor.");
ABSL_FLAG(std::string, port_file, "",
          "Peer roles: where the chosen port is written once serving.");

namespace pstrain::bench::ps_bench {
namespace {

struct Config {
  std::vector<int64_t> sizes;
  int servers, clients, repeats;
};

absl::StatusOr<Config> ParseConfig() {
  Config config;
  std::vector<std::string> problems;
  for (const std::string& text : absl::GetFlag(FLAGS_sizes)) {
    int64_t size = 0;
    if (!absl::SimpleAtoi(text, &size) || size < 4 || size % 4 != 0 ||
        static_cast<uint64_t>(size) > kMaxPayload) {
      problems.push_back(absl::StrCat("--sizes: '", text,
                                      "' is not a multiple of 4 in [4, 2^30]"));
    } else {
      config.sizes.push_back(size);
    }
  }
  if (config.sizes.empty() && problems.empty()) {
    problems.push_back("--sizes is empty");
  }
  config.servers = absl::GetFlag(FLAGS_servers);
  config.clients = absl::GetFlag(FLAGS_clients);
  config.repeats = absl::GetFlag(FLAGS_repeats);
  if (config.repeats < 1) problems.push_back("--repeats must be >= 1");
  if (config.servers < 1) problems.push_back("--servers must be >= 1");
  if (config.clients < 1) problems.push_back("--clients must be >= 1");
  if (absl::GetFlag(FLAGS_iterations) < 0) {
    problems.push_back("--iterations must be >= 0");
  }
  if (absl::GetFlag(FLAGS_warmup) < 0) {
    problems.push_back("--warmup must be >= 0");
  }
  if (!(absl::GetFlag(FLAGS_phase_seconds) > 0)) {
    problems.push_back("--phase_seconds must be > 0");
  }
  if (absl::GetFlag(FLAGS_block_elements) < 0) {
    problems.push_back("--block_elements must be >= 0 (0: by model size)");
  }
  if (absl::GetFlag(FLAGS_tcp_buffer_bytes) < 0) {
    problems.push_back("--tcp_buffer_bytes must be >= 0");
  }
  if (!(absl::GetFlag(FLAGS_io_timeout_s) > 0)) {
    problems.push_back("--io_timeout_s must be > 0");
  }
  if (!(absl::GetFlag(FLAGS_deadline_s) > 0)) {
    problems.push_back("--deadline_s must be > 0");
  }
  if (!problems.empty()) {
    return absl::InvalidArgumentError(absl::StrJoin(problems, "; "));
  }
  return config;
}

// Measures every size --repeats times; `rows` (per size, per repeat) holds
// what was done when it fails.
absl::Status RunBench(const Config& config, const std::string& ps_server,
                      const std::string& scratch,
                      std::vector<std::vector<Row>>* rows) {
  absl::StatusOr<std::pair<std::unique_ptr<ChildProcess>, int>> tcp_peer =
      StartPeer("tcp_peer", scratch);
  if (!tcp_peer.ok()) return tcp_peer.status();
  absl::StatusOr<std::pair<std::unique_ptr<ChildProcess>, int>> floor_peer =
      StartPeer("grpc_floor", scratch);
  if (!floor_peer.ok()) return floor_peer.status();

  {
    absl::StatusOr<ScopedFd> probe =
        ConnectTcpPeer(tcp_peer->second, kModeAck, 4);
    if (!probe.ok()) return probe.status();
    std::printf("# tcp: TCP_NODELAY, SO_SNDBUF %d, SO_RCVBUF %d (effective)\n",
                EffectiveBuffer(probe->get(), SO_SNDBUF),
                EffectiveBuffer(probe->get(), SO_RCVBUF));
  }

  // Connections live across sizes (warm, as a trainer's would).
  std::vector<std::unique_ptr<GrpcFloorClient>> floor_clients;
  for (int c = 0; c < config.clients; ++c) {
    absl::StatusOr<std::unique_ptr<GrpcFloorClient>> client =
        GrpcFloorClient::Connect(
            absl::StrCat("127.0.0.1:", floor_peer->second),
            absl::GetFlag(FLAGS_connections_per_shard),
            absl::Seconds(absl::GetFlag(FLAGS_deadline_s)));
    if (!client.ok()) return client.status();
    floor_clients.push_back(std::move(*client));
  }

  for (int64_t size : config.sizes) {
    rows->emplace_back();
    for (int repeat = 0; repeat < config.repeats; ++repeat) {
      SizeResult result;
      result.size = size;
      absl::Status status =
          MeasureTcp(tcp_peer->second, config.clients, &result);
      if (status.ok()) status = MeasureGrpcFloor(floor_clients, &result);
      if (status.ok()) {
        status = MeasurePs(ps_server, scratch, config.clients, Security::kPlain,
                           size, &result.ps);
      }
      if (status.ok() && !absl::GetFlag(FLAGS_tls_dir).empty()) {
        status = MeasurePs(ps_server, scratch, config.clients,
                           Security::kTlsDataPlane, size, &result.tls);
        if (status.ok()) {
          status = MeasurePs(ps_server, scratch, config.clients,
                             Security::kTlsGrpc, size, &result.tls_grpc);
        }
      }
      if (!status.ok()) return status;
      rows->back().push_back(MakeRow(result));
      LOG(INFO) << "done (repeat " << repeat + 1 << "/" << config.repeats
                << "): "
                << JsonLine(rows->back().back(), config.servers,
                            config.clients);
    }
  }
  floor_clients.clear();  // closes their streams while the peer serves
  tcp_peer->first->Stop();
  floor_peer->first->Stop();
  return absl::OkStatus();
}

int BenchMain(const char* argv0) {
  absl::StatusOr<Config> config = ParseConfig();
  if (!config.ok()) {
    std::fprintf(stderr, "ps_bench: %s\n",
                 std::string(config.status().message()).c_str());
    return 2;
  }
  StartGuardian(absl::Seconds(absl::GetFlag(FLAGS_deadline_s)));

  absl::StatusOr<std::string> ps_server = FindPsServer(
      absl::GetFlag(FLAGS_ps_server), argv0, "//bench/transport:ps_bench");
  if (!ps_server.ok()) {
    LOG(ERROR) << ps_server.status();
    return 1;
  }
  const char* tmp = std::getenv("TEST_TMPDIR");
  if (tmp == nullptr) tmp = std::getenv("TMPDIR");
  std::string scratch =
      absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/ps_bench.XXXXXX");
  if (mkdtemp(scratch.data()) == nullptr) {
    LOG(ERROR) << "mkdtemp " << scratch << ": " << std::strerror(errno);
    return 1;
  }
  Leftovers::Get().SetScratchDir(scratch);

  const std::string iterations =
      absl::GetFlag(FLAGS_iterations) > 0
          ? absl::StrCat(absl::GetFlag(FLAGS_iterations))
          : absl::StrCat("auto (", absl::GetFlag(FLAGS_phase_seconds),
                         " s per phase, min ", kMinIterations, ")");
  std::printf("%s",
              absl::StrFormat("# ps_bench: servers %d, clients %d, "
                              "block_elements %d (0: by size), iterations %s, "
                              "warmup %d, repeats %d\n",
                              config->servers, config->clients,
                              absl::GetFlag(FLAGS_block_elements), iterations,
                              absl::GetFlag(FLAGS_warmup), config->repeats)
                  .c_str());
  std::printf("%s", MachineDescription().c_str());
  std::printf("# ps_server: %s\n", ps_server->c_str());
  std::fflush(stdout);

  std::vector<std::vector<Row>> per_size;
  const absl::Status status = RunBench(*config, *ps_server, scratch, &per_size);

  std::vector<Row> rows;
  for (const std::vector<Row>& repeats : per_size) {
    if (!repeats.empty()) rows.push_back(MedianRow(repeats));
  }
  std::printf(
      "\n# goodput GB/s = 1e9 bytes/s. TCP p+p and gRPC floor: 2N per round "
      "trip; PS push, pull: N per call; PS p+p: 2N per push then pull;\n"
      "# PS 1call: 2N per PushPull (the push and the pull in one call).\n"
      "# TCP RTT: N bytes out, 16-byte ack back.\n");
  if (config->repeats > 1) {
    std::printf("# medians over %d repeats\n", config->repeats);
  }
  std::printf("%s", TableHeader().c_str());
  for (const Row& row : rows) std::printf("%s", TableRow(row).c_str());
  std::printf("\n");
  if (config->repeats > 1) {
    std::printf(
        "# spread (min..max) over the repeats\n"
        "%8s | %15s %15s %15s | %13s %13s %13s | %13s %13s\n",
        "size", "TCP p+p GB/s", "TCP 1-way GB/s", "PS p+p GB/s", "p+p/TCP",
        "1call/TCP", "p+p/TCP 1-way", "TCP RTT p50", "PS push p50");
    for (const std::vector<Row>& repeats : per_size) {
      if (!repeats.empty()) std::printf("%s", SpreadRow(repeats).c_str());
    }
    std::printf("\n");
  }
  if (!absl::GetFlag(FLAGS_tls_dir).empty()) {
    std::printf(
        "# TLS (mutual, TLS 1.3): PushPull goodput (2N per call) on the "
        "plaintext data plane, the TLS data plane and gRPC+TLS (two calls), "
        "and push p50;\n# kernel TLS requested: %s\n",
        absl::GetFlag(FLAGS_ktls) ? "yes" : "no");
    std::printf("%s", TlsTableHeader().c_str());
    for (const Row& row : rows) std::printf("%s", TlsTableRow(row).c_str());
    std::printf("\n");
  }
  std::string json;
  for (const Row& row : rows) {
    absl::StrAppend(&json, JsonLine(row, config->servers, config->clients),
                    "\n");
  }
  std::printf("%s", json.c_str());
  std::printf("# load average at end: %s\n", LoadAverage().c_str());
  std::fflush(stdout);

  const std::string json_out = absl::GetFlag(FLAGS_json_out);
  absl::Status written = absl::OkStatus();
  if (!json_out.empty()) written = WriteFileAtomically(json_out, json);
  Leftovers::Get().RemoveScratch();
  if (!status.ok()) {
    LOG(ERROR) << "ps_bench failed: " << status;
    return 1;
  }
  if (!written.ok()) {
    LOG(ERROR) << written;
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace pstrain::bench::ps_bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Parameter-server push/pull goodput and latency against raw TCP and "
      "plain gRPC on loopback.\n  ps_bench [--sizes=4096,...] [--servers=1] "
      "[--clients=1] [--json_out=FILE]");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::fprintf(stderr, "ps_bench: unexpected argument '%s'\n", rest[1]);
    return 2;
  }
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  // As ps_server and worker do; every role moves big messages.
  pstrain::TuneForTransport();
  const std::string role = absl::GetFlag(FLAGS_role);
  if (role == "tcp_peer" || role == "grpc_floor") {
    if (absl::GetFlag(FLAGS_port_file).empty()) {
      std::fprintf(stderr, "ps_bench: --role=%s needs --port_file\n",
                   role.c_str());
      return 2;
    }
    return role == "tcp_peer" ? pstrain::bench::ps_bench::TcpPeerMain()
                              : pstrain::bench::ps_bench::GrpcFloorMain();
  }
  if (role != "bench") {
    std::fprintf(stderr,
                 "ps_bench: --role must be bench, tcp_peer or grpc_floor\n");
    return 2;
  }
  // Before anything starts: a bad wire type is the user's, said in one line.
  for (const absl::Status& status :
       {pstrain::ParseWireType(absl::GetFlag(FLAGS_gradient_wire_type))
            .status(),
        pstrain::ParseParameterWireType(
            absl::GetFlag(FLAGS_parameter_wire_type))
            .status()}) {
    if (!status.ok()) {
      std::fprintf(stderr, "ps_bench: %s\n",
                   std::string(status.message()).c_str());
      return 2;
    }
  }
  return pstrain::bench::ps_bench::BenchMain(argv[0]);
}
