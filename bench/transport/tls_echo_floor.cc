// The floor under a small push over the TLS data plane (issue 25's 4 KiB
// p50 goal): a loopback round trip of a --size request answered by a
// 16-byte reply, like a Push and its PushResponse, through the data plane's
// own TLS layer (common/transport/tls_stream.h: OpenSSL, TLS 1.3, mutual TLS
// with the certificates of deploy/tls/make_certs.sh) against the same round
// trip in plaintext, in one run. No framing and no parameter server: what TLS
// adds here is what any data plane built on OpenSSL's records pays.
//
//   tls_echo_floor --tls_dir=DIR [--size=4096] [--trips=20000] [--repeats=5]
//
// Prints the p50 and p99 of each mode per repeat, interleaved, and the
// median of the per-repeat p50 ratios.
#include <sys/socket.h>
#include <sys/time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/transport/socket.h"
#include "common/transport/tls_stream.h"

ABSL_FLAG(std::string, tls_dir, "",
          "A directory from deploy/tls/make_certs.sh (ca.pem, server.pem/key, "
          "client.pem/key).");
ABSL_FLAG(int, size, 4096, "Request bytes per round trip.");
ABSL_FLAG(int, trips, 20000, "Round trips per mode and repeat.");
ABSL_FLAG(int, repeats, 5, "Repeats; each runs plaintext, then TLS.");

namespace pstrain {
namespace {

constexpr size_t kReplyBytes = 16;

// One end of a connection: plaintext, or the data plane's TLS session.
class End {
 public:
  End(ScopedFd fd, std::unique_ptr<TlsSession> tls)
      : fd_(std::move(fd)), tls_(std::move(tls)) {}

  absl::Status Send(const char* data, size_t size) {
    if (tls_ == nullptr) return SendAll(fd_.get(), data, size);
    const absl::string_view piece(data, size);
    return tls_->WriteAll(absl::MakeSpan(&piece, 1));
  }

  absl::Status Receive(char* data, size_t size) {
    if (tls_ == nullptr) return RecvAll(fd_.get(), data, size);
    return tls_->ReadAll(data, size);
  }

 private:
  ScopedFd fd_;
  std::unique_ptr<TlsSession> tls_;
};

struct Pair {
  std::unique_ptr<End> client, server;
};

// A loopback connection, in TLS when both contexts are given.
absl::StatusOr<Pair> Connect(std::shared_ptr<const TlsContext> server_context,
                             std::shared_ptr<const TlsContext> client_context) {
  int port = 0;
  absl::StatusOr<ScopedFd> listener = ListenTcp("127.0.0.1", 0, 0, &port);
  if (!listener.ok()) return listener.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::StatusOr<ScopedFd> client = ConnectTcp("127.0.0.1", port, 0, deadline);
  if (!client.ok()) return client.status();
  ScopedFd server(accept(listener->get(), nullptr, nullptr));
  if (server.get() < 0) return absl::InternalError("accept failed");
  // No wait without a deadline: a round trip whose peer stopped answering
  // ends the run with DEADLINE_EXCEEDED (RecvAll, TlsSession::ReadAll).
  const timeval timeout = {10, 0};
  for (int fd : {client->get(), server.get()}) {
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  }
  if (server_context == nullptr) {
    return Pair{std::make_unique<End>(*std::move(client), nullptr),
                std::make_unique<End>(std::move(server), nullptr)};
  }
  // Both handshakes at once: each waits on the other's messages.
  absl::StatusOr<std::unique_ptr<TlsSession>> accepted;
  std::thread accepting([&] {
    accepted =
        TlsSession::Accept(server_context, server.get(), "client", deadline);
  });
  absl::StatusOr<std::unique_ptr<TlsSession>> connected = TlsSession::Connect(
      client_context, client->get(), "127.0.0.1", "server", deadline);
  accepting.join();
  if (!connected.ok()) return connected.status();
  if (!accepted.ok()) return accepted.status();
  return Pair{std::make_unique<End>(*std::move(client), *std::move(connected)),
              std::make_unique<End>(std::move(server), *std::move(accepted))};
}

struct Latency {
  double p50_us, p99_us;
};

absl::StatusOr<Latency> RoundTrips(Pair& pair, int size, int trips) {
  absl::Status server_status;
  std::thread server([&] {
    std::vector<char> request(size), reply(kReplyBytes, 1);
    for (int t = 0; t < trips && server_status.ok(); ++t) {
      server_status = pair.server->Receive(request.data(), request.size());
      if (server_status.ok()) {
        server_status = pair.server->Send(reply.data(), reply.size());
      }
    }
  });
  std::vector<char> request(size, 2), reply(kReplyBytes);
  std::vector<double> us;
  us.reserve(trips);
  absl::Status status;
  for (int t = 0; t < trips && status.ok(); ++t) {
    const auto start = std::chrono::steady_clock::now();
    status = pair.client->Send(request.data(), request.size());
    if (status.ok()) status = pair.client->Receive(reply.data(), reply.size());
    us.push_back(std::chrono::duration<double, std::micro>(
                     std::chrono::steady_clock::now() - start)
                     .count());
  }
  server.join();
  if (!status.ok()) return status;
  if (!server_status.ok()) return server_status;
  std::sort(us.begin(), us.end());
  return Latency{us[us.size() / 2], us[us.size() * 99 / 100]};
}

int Run() {
  const std::string dir = absl::GetFlag(FLAGS_tls_dir);
  if (dir.empty()) {
    std::fprintf(stderr, "tls_echo_floor: --tls_dir is required\n");
    return 2;
  }
  const int size = absl::GetFlag(FLAGS_size);
  const int trips = absl::GetFlag(FLAGS_trips);
  const int repeats = absl::GetFlag(FLAGS_repeats);
  if (size <= 0 || trips <= 0 || repeats <= 0) {
    std::fprintf(stderr,
                 "tls_echo_floor: --size, --trips and --repeats must be "
                 "positive\n");
    return 2;
  }
  absl::StatusOr<std::shared_ptr<const TlsContext>> server_context =
      TlsContext::ForServer(
          {absl::StrCat(dir, "/server.pem"), absl::StrCat(dir, "/server.key"),
           absl::StrCat(dir, "/ca.pem")},
          /*ktls=*/false);
  absl::StatusOr<std::shared_ptr<const TlsContext>> client_context =
      TlsContext::ForClient(
          {absl::StrCat(dir, "/ca.pem"), absl::StrCat(dir, "/client.pem"),
           absl::StrCat(dir, "/client.key"), ""},
          /*ktls=*/false);
  if (!server_context.ok() || !client_context.ok()) {
    std::fprintf(stderr, "tls_echo_floor: %s\n",
                 (!server_context.ok() ? server_context.status()
                                       : client_context.status())
                     .ToString()
                     .c_str());
    return 1;
  }
  std::printf(
      "# tls_echo_floor: %d-byte request, %zu-byte reply, %d round trips per "
      "mode, loopback; TLS = common/transport/tls_stream (OpenSSL TLS 1.3, "
      "mutual)\n",
      size, kReplyBytes, trips);
  std::printf("%6s | %10s %10s | %10s %10s | %8s\n", "repeat", "plain p50",
              "plain p99", "TLS p50", "TLS p99", "TLS/");
  std::printf("%6s | %10s %10s | %10s %10s | %8s\n", "", "us", "us", "us", "us",
              "plain");
  std::vector<double> ratios;
  for (int r = 0; r < repeats; ++r) {
    Latency result[2];
    for (int tls = 0; tls < 2; ++tls) {
      absl::StatusOr<Pair> pair =
          tls ? Connect(*server_context, *client_context)
              : Connect(nullptr, nullptr);
      absl::StatusOr<Latency> latency =
          pair.ok() ? RoundTrips(*pair, size, trips)
                    : absl::StatusOr<Latency>(pair.status());
      if (!latency.ok()) {
        std::fprintf(stderr, "tls_echo_floor: %s\n",
                     latency.status().ToString().c_str());
        return 1;
      }
      result[tls] = *latency;
    }
    ratios.push_back(result[1].p50_us / result[0].p50_us);
    std::printf("%6d | %10.1f %10.1f | %10.1f %10.1f | %8.2f\n", r,
                result[0].p50_us, result[0].p99_us, result[1].p50_us,
                result[1].p99_us, ratios.back());
  }
  std::sort(ratios.begin(), ratios.end());
  std::printf("# median TLS/plain p50: %.2f\n", ratios[ratios.size() / 2]);
  return 0;
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pstrain::Run();
}
