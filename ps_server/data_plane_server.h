// Serves a shard's Push and Pull on the tensor data plane
// (common/transport/data_plane.h): a listening TCP socket, and one thread per
// connection that reads a request, answers it and reads the next, with
// blocking socket calls. Workers open a few connections per shard and keep
// them, so the thread count is the job's connection count; no request is
// handed between threads on its way, which is what this plane is for.
//
// With TLS (DataPlaneServerOptions::tls) each connection's thread first
// runs the handshake, bounded by handshake_timeout; a client the handshake
// refuses (no certificate or one the CA did not sign under mutual TLS, a
// plaintext data-plane client, garbage) is logged with its address,
// counted and closed before any frame is read.
#ifndef PSTRAIN_PS_SERVER_DATA_PLANE_SERVER_H_
#define PSTRAIN_PS_SERVER_DATA_PLANE_SERVER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/transport/data_plane.h"
#include "common/transport/socket.h"
#include "common/transport/tls_stream.h"

namespace pstrain {

// A response given as pieces that `keep_alive` owns (or references): the
// transport sends them as they are and drops `keep_alive` when done.
struct OutgoingBytes {
  std::vector<absl::string_view> pieces;
  std::shared_ptr<const void> keep_alive;
};

// What the data plane asks of the shard's service. Requests arrive as the
// same protobuf encodings gRPC's Push and Pull carry, possibly in pieces.
class DataPlaneHandler {
 public:
  virtual ~DataPlaneHandler() = default;
  // The encoded PushResponse, or the status to answer. A push the shard
  // would refuse as early (Shard::Push) may be held until `hold_until`.
  // `pull_after`: the PullRequest of a PushPull, answered with the push
  // once it is (empty for a plain Push).
  virtual absl::StatusOr<std::string> ServeDataPlanePush(
      absl::Span<const absl::string_view> request, absl::Time hold_until,
      absl::string_view pull_after) = 0;
  // Runs `done` exactly once, inline or later on another thread, by
  // `deadline` (capped by the shard), with the PullResponse's encoding, or
  // with `payloads_apart` its data-plane split form
  // (common/transport/data_plane.h). `follows_own_push`: the pull half of a
  // PushPull (Shard::Pull).
  using PullDone = std::function<void(absl::StatusOr<OutgoingBytes>)>;
  virtual void ServeDataPlanePull(absl::Span<const absl::string_view> request,
                                  absl::Time deadline, bool payloads_apart,
                                  bool follows_own_push, PullDone done) = 0;
  // A replica's forward (Method kForward): the encoded ReplicateResponse,
  // or the status to answer.
  virtual absl::StatusOr<std::string> ServeDataPlaneForward(
      absl::string_view body, absl::Time deadline) {
    return absl::UnimplementedError("this server takes no forwards");
  }
  // Whether `token` (a Hello's body) is the bearer token the server wants.
  virtual bool TokenAccepted(absl::string_view token) const = 0;
  // A request refused for its form (the shard's Stats.requests_rejected).
  virtual void CountRejected() = 0;
  // TLS only: a connection the handshake refused (or that stalled in it),
  // and one that completed it, with where its record layer runs.
  virtual void CountHandshakeRefused() {}
  virtual void CountTlsConnection(bool /*kernel_tls*/) {}
};

struct DataPlaneServerOptions {
  std::string host = "0.0.0.0";
  int port = 0;  // 0: the kernel picks one
  uint64_t max_body_bytes = 512 << 20;
  // Further connections are closed at once (each costs a thread).
  int max_connections = 1024;
  // The longest a pull waits for its step, whatever its client asks (the
  // shard caps it too).
  absl::Duration max_pull_wait = absl::Seconds(120);
  // Set: every connection speaks TLS (a server context from
  // TlsContext::ForServer); null: plaintext.
  std::shared_ptr<const TlsContext> tls;
  // How long a TLS handshake may take from accept, so a client that
  // connects and stalls holds its thread no longer than this.
  absl::Duration handshake_timeout = absl::Seconds(10);
  // Called after each Push or Pull is answered (for metrics): its status,
  // the time from its header's arrival to its answer sent, and the body
  // bytes each way. A PushPull is reported as its Push (applied or refused) and
  // its Pull (if it ran). May be empty.
  using CallObserver =
      std::function<void(data_plane::Method, absl::StatusCode, absl::Duration,
                         uint64_t request_bytes, uint64_t response_bytes)>;
  CallObserver on_call;
};

class DataPlaneServer {
 public:
  // Listens and starts accepting; `handler` must outlive the server.
  static absl::StatusOr<std::unique_ptr<DataPlaneServer>> Start(
      const DataPlaneServerOptions& options, DataPlaneHandler* handler);
  ~DataPlaneServer();

  int port() const { return port_; }
  bool tls() const { return options_.tls != nullptr; }

  // Stops accepting, cuts every connection (a client sees UNAVAILABLE and
  // retries elsewhere or later) and joins every thread. Call after
  // Shard::BeginShutdown, so that no pull is left waiting for a step.
  // Idempotent.
  void Shutdown();

 private:
  DataPlaneServer(const DataPlaneServerOptions& options,
                  DataPlaneHandler* handler, ScopedFd listener, int port);
  void AcceptLoop();
  // Serves one connection until the client closes it, it breaks the
  // framing, or Shutdown.
  void Serve(int64_t id, ScopedFd fd, std::string peer);
  // TLS: refuses a plaintext data-plane client in its own framing, then
  // runs the handshake. Null (logged and counted) when it failed.
  std::unique_ptr<TlsSession> Handshake(int fd, const std::string& peer);
  // Joins the threads of connections that have ended.
  void ReapFinished() ABSL_LOCKS_EXCLUDED(mu_);

  const DataPlaneServerOptions options_;
  DataPlaneHandler* const handler_;
  ScopedFd listener_;
  ScopedFd wake_;  // eventfd: Shutdown wakes the accept loop through it
  const int port_;
  std::thread accept_thread_;
  std::atomic<bool> stopping_{false};

  struct Connection {
    int fd = -1;  // owned by its thread; shut down (not closed) by Shutdown
    std::thread thread;
  };
  absl::Mutex mu_;
  absl::flat_hash_map<int64_t, Connection> live_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> finished_ ABSL_GUARDED_BY(mu_);
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pstrain

#endif  // PSTRAIN_PS_SERVER_DATA_PLANE_SERVER_H_
