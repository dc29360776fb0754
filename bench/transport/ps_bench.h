// The parts of ps_bench (one binary, //bench/transport:ps_bench) and what
// they share. What the bench measures is described in ps_bench.cc.
//
//   ps_bench.cc                   the flags, their checks, the run over sizes
//                                 and repeats, main() and its roles
//   ps_bench_timing.cc            one operation run on client threads and
//                                 timed: the harness of every measurement
//   ps_bench_baselines.cc         the transport limits: raw TCP and the gRPC
//                                 floor, their peer processes and clients
//   ps_bench_parameter_server.cc  real ps_server processes through PsClient
//   ps_bench_report.cc            rows, medians over repeats, tables, JSON
#ifndef PSTRAIN_BENCH_TRANSPORT_PS_BENCH_H_
#define PSTRAIN_BENCH_TRANSPORT_PS_BENCH_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "bench/child_process.h"
#include "bench/transport/grpc_floor.h"
#include "common/transport/socket.h"
#include "proto/ps.pb.h"

// Defined in ps_bench.cc, with every other flag of the binary; these are
// read by the other parts too.
ABSL_DECLARE_FLAG(int64_t, iterations);
ABSL_DECLARE_FLAG(double, phase_seconds);
ABSL_DECLARE_FLAG(int64_t, warmup);
ABSL_DECLARE_FLAG(int, servers);
ABSL_DECLARE_FLAG(bool, call_streams);
ABSL_DECLARE_FLAG(bool, data_plane);
ABSL_DECLARE_FLAG(int, connections_per_shard);
ABSL_DECLARE_FLAG(std::string, gradient_wire_type);
ABSL_DECLARE_FLAG(std::string, parameter_wire_type);
ABSL_DECLARE_FLAG(double, gradient_topk_fraction);
ABSL_DECLARE_FLAG(int64_t, block_elements);
ABSL_DECLARE_FLAG(std::string, tls_dir);
ABSL_DECLARE_FLAG(bool, ktls);
ABSL_DECLARE_FLAG(int, tcp_buffer_bytes);
ABSL_DECLARE_FLAG(double, io_timeout_s);
ABSL_DECLARE_FLAG(std::string, port_file);

namespace pstrain::bench::ps_bench {

inline constexpr absl::Duration kStartTimeout = absl::Seconds(30);
inline constexpr int64_t kMinIterations = 10;
// Largest payload a peer accepts, so a corrupt header cannot make it
// allocate without bound.
inline constexpr uint64_t kMaxPayload = uint64_t{1} << 30;
inline constexpr size_t kAckBytes = 16;

// The raw TCP protocol: a connection starts with one header; then for every
// N-byte message the peer reads, it answers N bytes (kModeEcho) or a 16-byte
// ack (kModeAck). Framing once per connection keeps the data path pure.
inline constexpr uint64_t kModeEcho = 1;
inline constexpr uint64_t kModeAck = 2;

// ---------------------------------------------------------------------------
// Timing (ps_bench_timing.cc).

// What one phase (one operation, on every client) measured.
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

// Warm-up, then the measured run.
absl::StatusOr<PhaseResult> MeasurePhase(const std::string& name, int64_t size,
                                         int clients, const Operation& op);

// ---------------------------------------------------------------------------
// What one size measures.

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

// ---------------------------------------------------------------------------
// The baselines (ps_bench_baselines.cc).

// Starts this binary again in a peer role and waits until it serves.
absl::StatusOr<std::pair<std::unique_ptr<ChildProcess>, int>> StartPeer(
    const std::string& role, const std::string& scratch);

// A connection to the tcp_peer, already told its mode and message size.
absl::StatusOr<ScopedFd> ConnectTcpPeer(int port, uint64_t mode,
                                        uint64_t bytes);

// The buffer size the kernel gave `fd` for SO_SNDBUF or SO_RCVBUF.
int EffectiveBuffer(int fd, int option);

// The peer roles (child processes; they serve until SIGTERM or the bench's
// death, which PR_SET_PDEATHSIG turns into SIGKILL).
int TcpPeerMain();
int GrpcFloorMain();

// (a) raw TCP: one connection per client and mode.
absl::Status MeasureTcp(int port, int clients, SizeResult* out);

// (b) the gRPC floor: push then pull of N bytes, each client on its own
// connections, as many as a PsClient opens to a shard.
absl::Status MeasureGrpcFloor(
    const std::vector<std::unique_ptr<GrpcFloorClient>>& clients,
    SizeResult* out);

// ---------------------------------------------------------------------------
// The parameter server (ps_bench_parameter_server.cc).

// (c) the parameter server: fresh shards for every size and repeat, since a
// server accepts one schema for its lifetime.
absl::Status MeasurePs(const std::string& ps_server, const std::string& scratch,
                       int clients, Security security, int64_t size,
                       PsPhases* out);

// ---------------------------------------------------------------------------
// Reporting (ps_bench_report.cc).

// One line of the tables and one JSON line: a size's numbers from one
// repeat, or their medians over the repeats.
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

// Field by field median of the repeats of one size.
Row MedianRow(const std::vector<Row>& repeats);

// The one-tensor model of `size` bytes the PS phases register, in blocks of
// --block_elements (0: as a model of that size gets them).
ModelSchema BenchSchema(int64_t size);
// The rates, percentiles and ratios of one measured size and repeat.
Row MakeRow(const SizeResult& r);
std::string TableHeader();
std::string TableRow(const Row& r);
std::string JsonLine(const Row& r, int servers, int clients);
// The TLS table (--tls_dir).
std::string TlsTableHeader();
std::string TlsTableRow(const Row& r);
// min..max over the repeats of the numbers the goals are stated in.
std::string SpreadRow(const std::vector<Row>& repeats);

}  // namespace pstrain::bench::ps_bench

#endif  // PSTRAIN_BENCH_TRANSPORT_PS_BENCH_H_
