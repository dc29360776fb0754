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
#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
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
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/child_process.h"
#include "bench/transport/grpc_floor.h"
#include "common/cli.h"
#include "common/consistency_mode.h"
#include "common/partition.h"
#include "common/transport/grpc_tuning.h"
#include "common/transport/socket.h"
#include "common/transport/tensor_codec.h"
#include "common/transport/tls.h"
#include "common/transport/tls_stream.h"
#include "glog/logging.h"
#include "proto/ps.pb.h"
#include "tools/cpp/runfiles/runfiles.h"
#include "worker/client/ps_client.h"

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
          "rate.");
ABSL_FLAG(double, gradient_topk_fraction, 0.01,
          "With --gradient_wire_type=topk: the fraction of each block sent.");
ABSL_FLAG(int, clients, 1,
          "Client threads, each with its own PsClient and worker_id (and its "
          "own TCP connection and gRPC channel for the baselines); goodput is "
          "aggregated over them.");
ABSL_FLAG(int64_t, block_elements, pstrain::kDefaultBlockElements,
          "Schema block size in elements (the worker's --block_elements "
          "default).");
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

namespace pstrain::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr absl::Duration kStartTimeout = absl::Seconds(30);
constexpr int64_t kMinIterations = 10;
// Largest payload a peer accepts, so a corrupt header cannot make it
// allocate without bound.
constexpr uint64_t kMaxPayload = uint64_t{1} << 30;
constexpr int kMaxGrpcMessage = (1 << 30) + (1 << 20);
constexpr size_t kAckBytes = 16;

// The raw TCP protocol: a connection starts with one header; then for every
// N-byte message the peer reads, it answers N bytes (kModeEcho) or a 16-byte
// ack (kModeAck). Framing once per connection keeps the data path pure.
constexpr uint64_t kModeEcho = 1;
constexpr uint64_t kModeAck = 2;
struct TcpHeader {
  uint64_t mode;
  uint64_t bytes;
};

// ---------------------------------------------------------------------------
// Baseline peers.

// Starts this binary again in a peer role and waits until it serves.
absl::StatusOr<std::pair<std::unique_ptr<ChildProcess>, int>> StartPeer(
    const std::string& role, const std::string& scratch) {
  char self[4096];
  const ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (length <= 0) {
    return absl::InternalError(
        absl::StrCat("readlink /proc/self/exe: ", std::strerror(errno)));
  }
  self[length] = '\0';
  const std::string port_file = absl::StrCat(scratch, "/", role, ".port");
  absl::StatusOr<std::unique_ptr<ChildProcess>> peer =
      ChildProcess::Start(role,
                          {self, absl::StrCat("--role=", role),
                           absl::StrCat("--port_file=", port_file),
                           absl::StrCat("--tcp_buffer_bytes=",
                                        absl::GetFlag(FLAGS_tcp_buffer_bytes))},
                          absl::StrCat(scratch, "/", role, ".log"));
  if (!peer.ok()) return peer.status();
  absl::StatusOr<int> port = (*peer)->WaitForPort(port_file, kStartTimeout);
  if (!port.ok()) return port.status();
  return std::make_pair(std::move(*peer), *port);
}

// ---------------------------------------------------------------------------
// Sockets.

sockaddr_in Loopback(int port) {
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  return address;
}

// A connection to the tcp_peer, already told its mode and message size.
absl::StatusOr<ScopedFd> ConnectTcpPeer(int port, uint64_t mode,
                                        uint64_t bytes) {
  ScopedFd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return SocketError("socket", errno);
  absl::Status tuned =
      TuneSocket(fd.get(), absl::GetFlag(FLAGS_tcp_buffer_bytes),
                 absl::Seconds(absl::GetFlag(FLAGS_io_timeout_s)));
  if (!tuned.ok()) return tuned;
  const sockaddr_in address = Loopback(port);
  // Bounded by SO_SNDTIMEO; on loopback it succeeds or is refused at once.
  if (connect(fd.get(), reinterpret_cast<const sockaddr*>(&address),
              sizeof(address)) != 0) {
    return SocketError(absl::StrCat("connect 127.0.0.1:", port), errno);
  }
  const TcpHeader header = {mode, bytes};
  absl::Status sent =
      SendAll(fd.get(), reinterpret_cast<const char*>(&header), sizeof(header));
  if (!sent.ok()) return sent;
  return fd;
}

int EffectiveBuffer(int fd, int option) {
  int value = 0;
  socklen_t length = sizeof(value);
  getsockopt(fd, SOL_SOCKET, option, &value, &length);
  return value;
}

// ---------------------------------------------------------------------------
// Peer roles (child processes; they serve until SIGTERM or the bench's
// death, which PR_SET_PDEATHSIG turns into SIGKILL).

void ServeTcpConnection(int raw_fd) {
  ScopedFd fd(raw_fd);
  TcpHeader header;
  absl::Status status =
      RecvAll(fd.get(), reinterpret_cast<char*>(&header), sizeof(header));
  if (!status.ok()) return;
  if ((header.mode != kModeEcho && header.mode != kModeAck) ||
      header.bytes == 0 || header.bytes > kMaxPayload) {
    LOG(ERROR) << "bad header: mode " << header.mode << ", " << header.bytes
               << " bytes";
    return;
  }
  std::vector<char> buffer(header.bytes);
  char ack[kAckBytes] = {};
  while (true) {
    status = RecvAll(fd.get(), buffer.data(), buffer.size());
    if (status.ok()) {
      status = header.mode == kModeEcho
                   ? SendAll(fd.get(), buffer.data(), buffer.size())
                   : SendAll(fd.get(), ack, sizeof(ack));
    }
    if (!status.ok()) break;
  }
  if (!absl::IsOutOfRange(status)) LOG(WARNING) << "connection: " << status;
}

int TcpPeerMain() {
  ScopedFd listener(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (listener.get() < 0) {
    LOG(ERROR) << SocketError("socket", errno);
    return 1;
  }
  const int one = 1;
  setsockopt(listener.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  // Accepted sockets inherit the buffer sizes set on the listener.
  absl::Status tuned =
      TuneSocket(listener.get(), absl::GetFlag(FLAGS_tcp_buffer_bytes),
                 absl::ZeroDuration());
  sockaddr_in address = Loopback(0);
  socklen_t length = sizeof(address);
  if (!tuned.ok() ||
      bind(listener.get(), reinterpret_cast<sockaddr*>(&address),
           sizeof(address)) != 0 ||
      listen(listener.get(), 64) != 0 ||
      getsockname(listener.get(), reinterpret_cast<sockaddr*>(&address),
                  &length) != 0) {
    LOG(ERROR) << "cannot listen on 127.0.0.1: " << tuned << " "
               << std::strerror(errno);
    return 1;
  }
  absl::Status written =
      WriteFileAtomically(absl::GetFlag(FLAGS_port_file),
                          absl::StrCat(ntohs(address.sin_port), "\n"));
  if (!written.ok()) {
    LOG(ERROR) << written;
    return 1;
  }
  while (true) {
    const int fd = accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      LOG(ERROR) << SocketError("accept", errno);
      return 1;
    }
    const int nodelay = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &nodelay, sizeof(nodelay));
    std::thread(ServeTcpConnection, fd).detach();
  }
}

int GrpcFloorMain() {
  GrpcFloorService service;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  builder.SetMaxReceiveMessageSize(kMaxGrpcMessage);
  builder.SetMaxSendMessageSize(kMaxGrpcMessage);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port <= 0) {
    LOG(ERROR) << "cannot serve gRPC on 127.0.0.1";
    return 1;
  }
  absl::Status written = WriteFileAtomically(absl::GetFlag(FLAGS_port_file),
                                             absl::StrCat(port, "\n"));
  if (!written.ok()) {
    LOG(ERROR) << written;
    return 1;
  }
  server->Wait();  // until SIGTERM (default action) or the bench's death
  return 0;
}

// ---------------------------------------------------------------------------
// Measurement.

struct PhaseResult {
  int64_t operations = 0;  // over all clients
  double seconds = 0;      // wall time, all clients started to last done
  std::vector<double> latencies_us;  // sorted, one per operation

  // Goodput in GB/s (1e9 bytes/s) when every operation moves `bytes`.
  double Gbps(double bytes) const {
    return seconds > 0 ? operations * bytes / seconds / 1e9 : 0;
  }
  // Nearest-rank percentile.
  double PercentileUs(double q) const {
    if (latencies_us.empty()) return 0;
    const size_t rank = static_cast<size_t>(
        std::ceil(q / 100.0 * static_cast<double>(latencies_us.size())));
    return latencies_us[std::min(latencies_us.size() - 1,
                                 rank > 0 ? rank - 1 : 0)];
  }
};

// One operation of client `client` (each client's state is its own).
using Operation = std::function<absl::Status(int client)>;

// Runs `op` on `clients` threads at once, each `iterations` times or, with
// iterations == 0, until `min_seconds` have passed and kMinIterations are
// done. The clock starts once every thread is ready. Every operation is
// bounded by its own deadline, so the joins are too.
absl::StatusOr<PhaseResult> RunConcurrently(int clients, int64_t iterations,
                                            double min_seconds,
                                            const Operation& op) {
  struct PerClient {
    std::vector<double> latencies_us;
    absl::Status status;
    Clock::time_point end;
  };
  std::vector<PerClient> per_client(clients);
  absl::Mutex mu;
  int ready = 0;
  bool go = false;
  Clock::time_point start;
  const auto min_duration = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(min_seconds));
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      Clock::time_point begin;
      {
        absl::MutexLock lock(&mu);
        ++ready;
        mu.Await(absl::Condition(&go));
        begin = start;
      }
      PerClient& mine = per_client[c];
      if (iterations > 0) mine.latencies_us.reserve(iterations);
      for (int64_t i = 0;; ++i) {
        const Clock::time_point now = Clock::now();
        if (iterations > 0
                ? i >= iterations
                : i >= kMinIterations && now - begin >= min_duration) {
          break;
        }
        mine.status = op(c);
        const Clock::time_point done = Clock::now();
        if (!mine.status.ok()) break;
        mine.latencies_us.push_back(
            std::chrono::duration<double, std::micro>(done - now).count());
      }
      mine.end = Clock::now();
    });
  }
  {
    // Threads only start here, so this wait is short; the bound is for the
    // rule, and on expiry the threads are still released and joined.
    absl::MutexLock lock(&mu);
    const auto all_ready = [&]() { return ready == clients; };
    mu.AwaitWithTimeout(absl::Condition(&all_ready), kStartTimeout);
    start = Clock::now();
    go = true;
  }
  for (std::thread& thread : threads) thread.join();
  PhaseResult result;
  Clock::time_point last = start;
  for (PerClient& mine : per_client) {
    if (!mine.status.ok()) return mine.status;
    last = std::max(last, mine.end);
    result.operations += static_cast<int64_t>(mine.latencies_us.size());
    result.latencies_us.insert(result.latencies_us.end(),
                               mine.latencies_us.begin(),
                               mine.latencies_us.end());
  }
  result.seconds = std::chrono::duration<double>(last - start).count();
  std::sort(result.latencies_us.begin(), result.latencies_us.end());
  return result;
}

// Warm-up, then the measured run.
absl::StatusOr<PhaseResult> MeasurePhase(const std::string& name, int64_t size,
                                         int clients, const Operation& op) {
  const int64_t warmup = absl::GetFlag(FLAGS_warmup);
  if (warmup > 0) {
    absl::StatusOr<PhaseResult> warm = RunConcurrently(clients, warmup, 0, op);
    if (!warm.ok()) {
      return absl::Status(warm.status().code(),
                          absl::StrCat(name, " (warm-up, ", size,
                                       " bytes): ", warm.status().message()));
    }
  }
  absl::StatusOr<PhaseResult> result =
      RunConcurrently(clients, absl::GetFlag(FLAGS_iterations),
                      absl::GetFlag(FLAGS_phase_seconds), op);
  if (!result.ok()) {
    return absl::Status(
        result.status().code(),
        absl::StrCat(name, " (", size, " bytes): ", result.status().message()));
  }
  LOG(INFO) << absl::StrFormat("%-14s %10d B: %6d ops in %.3f s, p50 %.1f us",
                               name, size, result->operations, result->seconds,
                               result->PercentileUs(50));
  return result;
}

// The PS phases of one transport.
struct PsPhases {
  PhaseResult push, pull, pushpull, one_call;
};

// How the PS is reached: plaintext (data plane per --data_plane), mutual TLS
// on the TLS data plane, or mutual TLS over gRPC only.
enum class Security { kPlain, kTlsDataPlane, kTlsGrpc };

struct SizeResult {
  int64_t size = 0;
  PhaseResult tcp_pushpull, tcp_rtt, grpc_floor;
  PsPhases ps, tls, tls_grpc;
};

// (a) raw TCP: one connection per client and mode.
absl::Status MeasureTcp(int port, int clients, SizeResult* out) {
  const int64_t size = out->size;
  std::vector<std::vector<char>> buffers(clients, std::vector<char>(size, 'x'));
  for (uint64_t mode : {kModeEcho, kModeAck}) {
    std::vector<ScopedFd> fds;
    for (int c = 0; c < clients; ++c) {
      absl::StatusOr<ScopedFd> fd = ConnectTcpPeer(port, mode, size);
      if (!fd.ok()) return fd.status();
      fds.push_back(std::move(*fd));
    }
    if (mode == kModeEcho) {
      absl::StatusOr<PhaseResult> result =
          MeasurePhase("tcp push+pull", size, clients, [&](int c) {
            absl::Status sent = SendAll(fds[c].get(), buffers[c].data(), size);
            if (!sent.ok()) return sent;
            return RecvAll(fds[c].get(), buffers[c].data(), size);
          });
      if (!result.ok()) return result.status();
      out->tcp_pushpull = std::move(*result);
    } else {
      absl::StatusOr<PhaseResult> result =
          MeasurePhase("tcp rtt", size, clients, [&](int c) {
            absl::Status sent = SendAll(fds[c].get(), buffers[c].data(), size);
            if (!sent.ok()) return sent;
            char ack[kAckBytes];
            return RecvAll(fds[c].get(), ack, sizeof(ack));
          });
      if (!result.ok()) return result.status();
      out->tcp_rtt = std::move(*result);
    }
  }
  return absl::OkStatus();
}

// (b) the gRPC floor: push then pull of N bytes, each client on its own
// connections, as many as a PsClient opens to a shard.
absl::Status MeasureGrpcFloor(
    const std::vector<std::unique_ptr<GrpcFloorClient>>& clients,
    SizeResult* out) {
  const int64_t size = out->size;
  std::vector<std::vector<char>> tensors(clients.size(),
                                         std::vector<char>(size, 'g'));
  absl::StatusOr<PhaseResult> result = MeasurePhase(
      "grpc floor p+p", size, static_cast<int>(clients.size()), [&](int c) {
        absl::Status pushed = clients[c]->Push(tensors[c]);
        return pushed.ok() ? clients[c]->Pull(absl::MakeSpan(tensors[c]))
                           : pushed;
      });
  if (!result.ok()) return result.status();
  out->grpc_floor = std::move(*result);
  return absl::OkStatus();
}

// One client thread's PS state: its own client, buffers and step counter.
struct PsWorker {
  std::unique_ptr<PsClient> client;
  std::vector<float> params;
  std::vector<float> grads;
  // Async servers reject a push whose step is not above the worker's last.
  int64_t next_step = 0;
};

// Clients, registration and the three PS phases against running shards.
absl::Status RunPsPhases(const std::vector<std::string>& hosts, int clients,
                         Security security, int64_t size, PsPhases* out) {
  const int64_t elements = size / 4;
  ModelSchema schema;
  schema.set_seed(1);
  schema.set_block_elements(absl::GetFlag(FLAGS_block_elements));
  DenseTensorSpec* tensor = schema.add_dense();
  tensor->set_name("bench");
  tensor->add_shape(elements);
  tensor->mutable_init()->set_kind(InitSpec::ZEROS);

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
  options.gradient_topk_fraction = absl::GetFlag(FLAGS_gradient_topk_fraction);
  options.rpc_timeout = absl::Seconds(absl::GetFlag(FLAGS_io_timeout_s));
  options.connect_timeout = kStartTimeout;
  std::vector<PsWorker> workers(clients);
  for (int c = 0; c < clients; ++c) {
    absl::StatusOr<std::unique_ptr<PsClient>> client =
        PsClient::Create(options);
    if (!client.ok()) return client.status();
    absl::StatusOr<Registration> registration =
        (*client)->Register(schema, clients, /*worker_id=*/c);
    if (!registration.ok()) return registration.status();
    if (registration->mode != ConsistencyMode::kAsync) {
      return absl::FailedPreconditionError(absl::StrCat(
          "servers run mode '", ConsistencyModeName(registration->mode),
          "', expected async"));
    }
    workers[c].client = std::move(*client);
    workers[c].params.assign(elements, 0.0f);
    // Small and finite: servers may reject non-finite gradients.
    workers[c].grads.assign(elements, 1e-3f);
  }
  auto push = [&](int c) -> absl::Status {
    PsWorker& w = workers[c];
    absl::StatusOr<PsClient::PushResult> pushed =
        w.client->Push(w.next_step++, {w.grads.data()});
    if (!pushed.ok()) return pushed.status();
    if (pushed->blocks_duplicate != 0) {
      return absl::InternalError(absl::StrCat(
          pushed->blocks_duplicate, " duplicate(s) reported for a fresh push"));
    }
    return absl::OkStatus();
  };
  auto pull = [&](int c) -> absl::Status {
    PsWorker& w = workers[c];
    return w.client->Pull(w.next_step, {w.params.data()}).status();
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
    absl::StatusOr<PsClient::PushPullResult> done = w.client->PushPull(
        step, {w.grads.data()}, w.next_step, {w.params.data()});
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

// ---------------------------------------------------------------------------
// Reporting.

std::string HumanSize(int64_t bytes) {
  if (bytes >= (1 << 20) && bytes % (1 << 20) == 0) {
    return absl::StrCat(bytes >> 20, " MiB");
  }
  if (bytes >= (1 << 10) && bytes % (1 << 10) == 0) {
    return absl::StrCat(bytes >> 10, " KiB");
  }
  return absl::StrCat(bytes, " B");
}

struct Row {
  int64_t size;
  double tcp_gbps, tcp_oneway_gbps, tcp_rtt_p50_us, tcp_rtt_p99_us;
  double grpc_floor_gbps, grpc_floor_p50_us, grpc_floor_p99_us;
  double ps_push_gbps, ps_pull_gbps, ps_pushpull_gbps, ps_one_call_gbps;
  double ps_push_p50_us, ps_push_p99_us;
  double ratio_pushpull_vs_tcp, ratio_pushpull_vs_tcp_oneway,
      ratio_pushpull_vs_grpc, ratio_push_p50_vs_tcp_rtt, ratio_one_call_vs_tcp;
  int64_t ps_pushpull_ops;  // summed over repeats
  int repeats = 1;
  // --tls_dir: PS 1call over the TLS data plane and over gRPC+TLS, push
  // p50s, and the issue-25 goal ratios (all 0 without --tls_dir).
  double tls_one_call_gbps = 0, tls_grpc_one_call_gbps = 0;
  double tls_push_p50_us = 0, tls_grpc_push_p50_us = 0;
  double ratio_tls_vs_plain_one_call = 0, ratio_tls_vs_tls_grpc_one_call = 0,
         ratio_tls_vs_plain_push_p50 = 0, ratio_tls_one_call_vs_tcp = 0;
};

// Every measured field of Row, for combining repeats.
constexpr double Row::*kRowFields[] = {
    &Row::tcp_gbps,
    &Row::tcp_oneway_gbps,
    &Row::tcp_rtt_p50_us,
    &Row::tcp_rtt_p99_us,
    &Row::grpc_floor_gbps,
    &Row::grpc_floor_p50_us,
    &Row::grpc_floor_p99_us,
    &Row::ps_push_gbps,
    &Row::ps_pull_gbps,
    &Row::ps_pushpull_gbps,
    &Row::ps_one_call_gbps,
    &Row::ps_push_p50_us,
    &Row::ps_push_p99_us,
    &Row::ratio_pushpull_vs_tcp,
    &Row::ratio_pushpull_vs_tcp_oneway,
    &Row::ratio_pushpull_vs_grpc,
    &Row::ratio_push_p50_vs_tcp_rtt,
    &Row::ratio_one_call_vs_tcp,
    &Row::tls_one_call_gbps,
    &Row::tls_grpc_one_call_gbps,
    &Row::tls_push_p50_us,
    &Row::tls_grpc_push_p50_us,
    &Row::ratio_tls_vs_plain_one_call,
    &Row::ratio_tls_vs_tls_grpc_one_call,
    &Row::ratio_tls_vs_plain_push_p50,
    &Row::ratio_tls_one_call_vs_tcp,
};

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  if (n == 0) return 0;
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

// Field by field median of the repeats of one size. Ratios too are medians
// of the per-repeat ratios (each from baselines measured next to the PS),
// not ratios of medians.
Row MedianRow(const std::vector<Row>& repeats) {
  Row row = repeats.front();
  for (double Row::*field : kRowFields) {
    std::vector<double> values;
    for (const Row& r : repeats) values.push_back(r.*field);
    row.*field = Median(std::move(values));
  }
  row.ps_pushpull_ops = 0;
  for (const Row& r : repeats) row.ps_pushpull_ops += r.ps_pushpull_ops;
  row.repeats = static_cast<int>(repeats.size());
  return row;
}

double Ratio(double a, double b) { return b > 0 ? a / b : 0; }

Row MakeRow(const SizeResult& r) {
  const double n = static_cast<double>(r.size);
  Row row;
  row.size = r.size;
  row.tcp_gbps = r.tcp_pushpull.Gbps(2 * n);
  // N out per round trip of the RTT phase: close to a one-way stream (what
  // iperf3 reports) once N dwarfs the ack.
  row.tcp_oneway_gbps = r.tcp_rtt.Gbps(n);
  row.tcp_rtt_p50_us = r.tcp_rtt.PercentileUs(50);
  row.tcp_rtt_p99_us = r.tcp_rtt.PercentileUs(99);
  row.grpc_floor_gbps = r.grpc_floor.Gbps(2 * n);
  row.grpc_floor_p50_us = r.grpc_floor.PercentileUs(50);
  row.grpc_floor_p99_us = r.grpc_floor.PercentileUs(99);
  row.ps_push_gbps = r.ps.push.Gbps(n);
  row.ps_pull_gbps = r.ps.pull.Gbps(n);
  row.ps_pushpull_gbps = r.ps.pushpull.Gbps(2 * n);
  row.ps_one_call_gbps = r.ps.one_call.Gbps(2 * n);
  row.ps_push_p50_us = r.ps.push.PercentileUs(50);
  row.ps_push_p99_us = r.ps.push.PercentileUs(99);
  if (r.tls.one_call.operations > 0) {
    row.tls_one_call_gbps = r.tls.one_call.Gbps(2 * n);
    row.tls_grpc_one_call_gbps = r.tls_grpc.one_call.Gbps(2 * n);
    row.tls_push_p50_us = r.tls.push.PercentileUs(50);
    row.tls_grpc_push_p50_us = r.tls_grpc.push.PercentileUs(50);
    row.ratio_tls_vs_plain_one_call =
        Ratio(row.tls_one_call_gbps, row.ps_one_call_gbps);
    row.ratio_tls_vs_tls_grpc_one_call =
        Ratio(row.tls_one_call_gbps, row.tls_grpc_one_call_gbps);
    row.ratio_tls_vs_plain_push_p50 =
        Ratio(row.tls_push_p50_us, row.ps_push_p50_us);
    row.ratio_tls_one_call_vs_tcp = Ratio(row.tls_one_call_gbps, row.tcp_gbps);
  }
  row.ratio_pushpull_vs_tcp = Ratio(row.ps_pushpull_gbps, row.tcp_gbps);
  row.ratio_pushpull_vs_tcp_oneway =
      Ratio(row.ps_pushpull_gbps, row.tcp_oneway_gbps);
  row.ratio_pushpull_vs_grpc = Ratio(row.ps_pushpull_gbps, row.grpc_floor_gbps);
  row.ratio_push_p50_vs_tcp_rtt = Ratio(row.ps_push_p50_us, row.tcp_rtt_p50_us);
  row.ratio_one_call_vs_tcp = Ratio(row.ps_one_call_gbps, row.tcp_gbps);
  row.ps_pushpull_ops = r.ps.pushpull.operations;
  return row;
}

std::string TableHeader() {
  return absl::StrFormat(
      "%8s | %8s %8s | %8s %8s %8s %8s | %7s %7s %7s | %17s %17s %17s | "
      "%7s\n"
      "%8s | %8s %8s | %8s %8s %8s %8s | %7s %7s %7s | %17s %17s %17s | "
      "%7s\n",
      "size", "TCP p+p", "gRPC", "PS push", "PS pull", "PS p+p", "PS 1call",
      "p+p/", "p+p/", "1call/", "TCP RTT", "gRPC floor p+p", "PS push", "push/",
      "", "GB/s", "floor", "GB/s", "GB/s", "GB/s", "GB/s", "TCP", "gRPC", "TCP",
      "p50/p99 us", "p50/p99 us", "p50/p99 us", "RTT p50");
}

std::string TableRow(const Row& r) {
  auto pair = [](double p50, double p99) {
    return absl::StrFormat("%.0f/%.0f", p50, p99);
  };
  return absl::StrFormat(
      "%8s | %8.3f %8.3f | %8.3f %8.3f %8.3f %8.3f | %7.3f %7.3f %7.3f | %17s "
      "%17s %17s | %7.2f\n",
      HumanSize(r.size), r.tcp_gbps, r.grpc_floor_gbps, r.ps_push_gbps,
      r.ps_pull_gbps, r.ps_pushpull_gbps, r.ps_one_call_gbps,
      r.ratio_pushpull_vs_tcp, r.ratio_pushpull_vs_grpc,
      r.ratio_one_call_vs_tcp, pair(r.tcp_rtt_p50_us, r.tcp_rtt_p99_us),
      pair(r.grpc_floor_p50_us, r.grpc_floor_p99_us),
      pair(r.ps_push_p50_us, r.ps_push_p99_us), r.ratio_push_p50_vs_tcp_rtt);
}

std::string JsonLine(const Row& r, int servers, int clients) {
  return absl::StrFormat(
      "{\"bench\":\"ps_bench\",\"size\":%d,\"servers\":%d,\"clients\":%d,"
      "\"block_elements\":%d,"
      "\"tcp_gbps\":%.4f,\"tcp_oneway_gbps\":%.4f,\"tcp_rtt_p50_us\":%.1f,"
      "\"tcp_rtt_p99_us\":%.1f,"
      "\"grpc_floor_gbps\":%.4f,\"grpc_floor_p50_us\":%.1f,"
      "\"grpc_floor_p99_us\":%.1f,"
      "\"ps_push_gbps\":%.4f,\"ps_pull_gbps\":%.4f,\"ps_pushpull_gbps\":%.4f,"
      "\"ps_push_p50_us\":%.1f,\"ps_push_p99_us\":%.1f,"
      "\"ratio_pushpull_vs_tcp\":%.4f,\"ratio_pushpull_vs_tcp_oneway\":%.4f,"
      "\"ratio_pushpull_vs_grpc\":%.4f,"
      "\"ratio_push_p50_vs_tcp_rtt\":%.4f,\"ps_pushpull_ops\":%d,"
      "\"ps_one_call_gbps\":%.4f,\"ratio_one_call_vs_tcp\":%.4f,"
      "\"repeats\":%d%s}",
      r.size, servers, clients, absl::GetFlag(FLAGS_block_elements), r.tcp_gbps,
      r.tcp_oneway_gbps, r.tcp_rtt_p50_us, r.tcp_rtt_p99_us, r.grpc_floor_gbps,
      r.grpc_floor_p50_us, r.grpc_floor_p99_us, r.ps_push_gbps, r.ps_pull_gbps,
      r.ps_pushpull_gbps, r.ps_push_p50_us, r.ps_push_p99_us,
      r.ratio_pushpull_vs_tcp, r.ratio_pushpull_vs_tcp_oneway,
      r.ratio_pushpull_vs_grpc, r.ratio_push_p50_vs_tcp_rtt, r.ps_pushpull_ops,
      r.ps_one_call_gbps, r.ratio_one_call_vs_tcp, r.repeats,
      r.tls_one_call_gbps > 0
          ? absl::StrFormat(
                ",\"tls_one_call_gbps\":%.4f,\"tls_grpc_one_call_gbps\":%.4f,"
                "\"tls_push_p50_us\":%.1f,\"tls_grpc_push_p50_us\":%.1f,"
                "\"ratio_tls_vs_plain_one_call\":%.4f,"
                "\"ratio_tls_vs_tls_grpc_one_call\":%.4f,"
                "\"ratio_tls_vs_plain_push_p50\":%.4f,"
                "\"ratio_tls_one_call_vs_tcp\":%.4f",
                r.tls_one_call_gbps, r.tls_grpc_one_call_gbps,
                r.tls_push_p50_us, r.tls_grpc_push_p50_us,
                r.ratio_tls_vs_plain_one_call, r.ratio_tls_vs_tls_grpc_one_call,
                r.ratio_tls_vs_plain_push_p50, r.ratio_tls_one_call_vs_tcp)
          : std::string());
}

// The TLS table (--tls_dir): PushPull on each transport and the ratios the
// goals of issue 25 are stated in.
std::string TlsTableHeader() {
  return absl::StrFormat(
      "%8s | %8s %8s %8s %8s | %8s %8s %8s | %8s %8s %8s | %8s\n"
      "%8s | %8s %8s %8s %8s | %8s %8s %8s | %8s %8s %8s | %8s\n",
      "size", "TCP p+p", "plain", "TLS", "gRPC+TLS", "push p50", "push p50",
      "push p50", "TLS/", "TLS/", "TLS/", "TLS p50/", "", "GB/s", "1call",
      "1call", "1call", "plain us", "TLS us", "g+TLS us", "plain", "gRPC+TLS",
      "TCP", "plain");
}

std::string TlsTableRow(const Row& r) {
  return absl::StrFormat(
      "%8s | %8.3f %8.3f %8.3f %8.3f | %8.0f %8.0f %8.0f | %8.3f %8.3f %8.3f "
      "| %8.2f\n",
      HumanSize(r.size), r.tcp_gbps, r.ps_one_call_gbps, r.tls_one_call_gbps,
      r.tls_grpc_one_call_gbps, r.ps_push_p50_us, r.tls_push_p50_us,
      r.tls_grpc_push_p50_us, r.ratio_tls_vs_plain_one_call,
      r.ratio_tls_vs_tls_grpc_one_call, r.ratio_tls_one_call_vs_tcp,
      r.ratio_tls_vs_plain_push_p50);
}

// min..max over the repeats of the numbers the goals are stated in.
std::string SpreadRow(const std::vector<Row>& repeats) {
  auto range = [&](double Row::*field, const char* format) {
    double lo = repeats.front().*field, hi = lo;
    for (const Row& r : repeats) {
      lo = std::min(lo, r.*field);
      hi = std::max(hi, r.*field);
    }
    return absl::StrCat(absl::StrFormat(absl::ParsedFormat<'f'>(format), lo),
                        "..",
                        absl::StrFormat(absl::ParsedFormat<'f'>(format), hi));
  };
  return absl::StrFormat(
      "%8s | %15s %15s %15s | %13s %13s %13s | %13s %13s\n",
      HumanSize(repeats.front().size), range(&Row::tcp_gbps, "%.3f"),
      range(&Row::tcp_oneway_gbps, "%.3f"),
      range(&Row::ps_pushpull_gbps, "%.3f"),
      range(&Row::ratio_pushpull_vs_tcp, "%.3f"),
      range(&Row::ratio_one_call_vs_tcp, "%.3f"),
      range(&Row::ratio_pushpull_vs_tcp_oneway, "%.3f"),
      range(&Row::tcp_rtt_p50_us, "%.0f"), range(&Row::ps_push_p50_us, "%.0f"));
}

// ---------------------------------------------------------------------------
// The bench.

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
  if (absl::GetFlag(FLAGS_block_elements) < 1) {
    problems.push_back("--block_elements must be >= 1");
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
                              "block_elements %d, iterations %s, "
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
}  // namespace pstrain::bench

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
    return role == "tcp_peer" ? pstrain::bench::TcpPeerMain()
                              : pstrain::bench::GrpcFloorMain();
  }
  if (role != "bench") {
    std::fprintf(stderr,
                 "ps_bench: --role must be bench, tcp_peer or grpc_floor\n");
    return 2;
  }
  return pstrain::bench::BenchMain(argv[0]);
}
