// The client half of the tensor data plane (common/transport/data_plane.h): a
// DataLink is one TCP connection to a shard's data port, and RunExchanges
// drives any number of requests over any number of links with non-blocking
// sockets and poll: a small call from the calling thread alone, with no
// hand-off; a large one over several links from a few threads at once,
// each driving its own links (the kernel copies a socket's bytes on the
// thread that sends or receives them; TLS's cipher runs there too).
#ifndef PSTRAIN_COMMON_TRANSPORT_DATA_LINK_H_
#define PSTRAIN_COMMON_TRANSPORT_DATA_LINK_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/transport/data_plane.h"
#include "common/transport/socket.h"
#include "common/transport/tls_stream.h"

namespace pstrain {

class DataLinkIo;

// Hellos a new link sends, one after another, to time its round trip.
inline constexpr int kHellosTimed = 5;

class DataLink {
 public:
  // Connects to host:port, runs the TLS handshake when `tls` is set (a
  // client context: the server's certificate must name `host` or the
  // context's server name), says Hello with `token` and waits for the
  // server's consent, all by `deadline`. Answers larger than
  // `max_body_bytes` are refused.
  static absl::StatusOr<std::unique_ptr<DataLink>> Open(
      const std::string& host, int port, absl::string_view token,
      uint64_t max_body_bytes, absl::Time deadline,
      std::shared_ptr<const TlsContext> tls = nullptr);

  // False once an exchange on it failed in a way that leaves the byte
  // stream out of step (lost connection, deadline, bad framing): open a new
  // link instead.
  bool usable() const { return usable_ && !aborted_.load(); }
  // From any thread: ends the connection under an exchange in progress,
  // which then fails at once, CANCELLED (PsClient::Interrupt, a replica set
  // ending its calls). The link is unusable afterwards, even when no
  // exchange was in progress.
  void Abort() const;
  const std::string& peer() const { return peer_; }
  // The server runs on this host (ConnectsToThisHost).
  bool same_host() const { return same_host_; }
  // The least time one of its kHellosTimed Hellos took to be answered: the
  // link's round trip as the application sees it (a proxy's or a WAN's
  // delay included).
  absl::Duration hello_round_trip() const { return hello_round_trip_; }
  // The TLS session, or null for a plaintext link.
  const TlsSession* tls() const { return tls_.get(); }

 private:
  friend class DataLinkIo;
  DataLink(ScopedFd fd, std::string peer, uint64_t max_body_bytes)
      : fd_(std::move(fd)),
        peer_(std::move(peer)),
        max_body_bytes_(max_body_bytes) {}

  ScopedFd fd_;
  // Declared after fd_: freed before the socket closes.
  std::unique_ptr<TlsSession> tls_;
  const std::string peer_;
  const uint64_t max_body_bytes_;
  bool same_host_ = false;
  absl::Duration hello_round_trip_;
  bool usable_ = true;
  // Abort was called: the connection's end is this process's doing, not
  // the server's.
  mutable std::atomic<bool> aborted_{false};
  // Answers as they arrive; kept from one call to the next.
  ReceiveBuffer received_;
};

// One request on a link and what to do with its answer.
struct DataExchange {
  DataLink* link = nullptr;
  data_plane::Method method = data_plane::Method::kPull;
  // The request body's pieces; the memory must stay unchanged until
  // RunExchanges returns.
  std::vector<absl::string_view> body;
  // Runs with an OK answer's body (valid only during the call) on the thread
  // that drives the link: the calling thread, or one RunExchanges starts
  // for a large exchange over several links (so exchanges' callbacks may run
  // at once); its status becomes the exchange's.
  std::function<absl::Status(absl::string_view)> on_response;
  // Optional, for a Pull of large blocks: asks for the payloads apart
  // (common/transport/data_plane.h) and says where they go. Called with an OK
  // answer's metadata (a PullResponse whose blocks carry no data), it
  // returns one destination per block, in order, whose sizes add up to the
  // payload bytes that follow; they are then read straight into place, and
  // `on_response` is not called.
  std::function<absl::StatusOr<std::vector<absl::Span<char>>>(
      absl::string_view meta)>
      place_payloads;
  // Optional: about how many bytes the answer brings (a pull's values), when
  // known. RunExchanges counts them with the requests' bytes when it decides
  // whether a call is large enough for threads of its own.
  uint64_t answer_bytes = 0;
  // Optional: the index, in RunExchanges' span, of an exchange on another
  // link whose end starts a shorter clock for this one: answered within
  // `grace` of it, or failed DEADLINE_EXCEEDED (its link with it) long
  // before the call's deadline. For a request that one server can answer
  // only after another answered (a backup's read, once its primary's
  // PushPull is answered, PsClient::PushPullReadingBackups): until then
  // the wait may be as long as a sync step's, after it only as long as the
  // transfer, and a server that went silent costs seconds, not the call.
  int after = -1;
  absl::Duration grace = absl::InfiniteDuration();
  // Optional: the request is sent only once can_send() is true, checked
  // again whenever `send_wake_fd` (an eventfd) becomes readable; a link's
  // requests go in order, so those behind it wait too. For a request whose
  // body is still being made (the pipelined step's gradients). Like the
  // other callbacks here, it runs on the thread that drives its link, at
  // the same time as other links' callbacks.
  std::function<bool()> can_send;
  int send_wake_fd = -1;
  // Optional: runs once an OK answer is in (after on_response, or once the
  // payloads are in place), on the thread running the exchanges.
  std::function<void()> on_ok;
  // Out: OK, the server's error, or the transport's (UNAVAILABLE for a lost
  // connection, DEADLINE_EXCEEDED past `deadline` or the grace).
  absl::Status status;
};

// Sends every exchange and reads every answer; a link's exchanges go in
// order, links proceed at once, and a link sends a request only while fewer
// than `requests_in_flight` of its earlier ones are unanswered
// (kWindowByHost: to a server on this host as many as fit in
// kSameHostBytesInFlight past the oldest unanswered one, to a server
// elsewhere as many as fit in WindowBytesForRoundTrip(the link's Hello
// round trip), the oldest always). Returns when all are
// answered or failed; nothing is left in flight past `deadline`.
//
// Why a window: in a sync step every worker's group k must be in before the
// shard answers any of them. A connection that runs ahead fills the shard's
// link with bytes no answer can use yet, and the slow connections' group k
// (which every answer waits for) arrives later; at the end of the step the
// answers then pile up. One request in flight per connection keeps the
// workers' pushes in step with each other: on 1 Gbit/s namespace links a
// sync step went from 1.34x to 1.04x the link-bound ideal (probe model,
// 2 shards x 4 workers, bench/results/netns_link_speed.txt).
//
// Where the round trip is long, one request at a time leaves the link idle
// for most of it: with 20 ms each way (the netns fault trials' delay20) a
// sync step took 3.4x as long as with the round trip's bytes in flight.
// A connection to another host therefore keeps in flight what its round
// trip beyond kShortRoundTrip carries at kAssumedLinkBytesPerSecond: none
// past the oldest request in a data centre or this lab (10-22 us), where a
// second 32 KiB request in flight made the 4-worker step 1.22x the ideal
// against 1.10x; megabytes across a WAN (bench/results/netns_link_speed.txt,
// section 11).
//
// On one host the opposite holds for small groups: nothing binds but the
// CPU, and each answer awaited before the next request is sent costs
// wakeups on both ends. With 32 KiB groups a window of one cost a loopback
// job 27%; all in flight costs nothing (the server answers from the thread
// that completes a step, ps_server/outbox.h;
// bench/results/block_size_tradeoff.txt). Large groups gain nothing from
// it, and a 5.8M-float model's exchange (512 KiB groups) looked slower
// with all in flight (noisy runs), so the bytes in flight are capped: one
// 512 KiB group at a time, as before; eight 32 KiB ones.
inline constexpr size_t kWindowByHost = 0;
inline constexpr uint64_t kSameHostBytesInFlight = 256 << 10;
// 1 Gbit/s: the slowest link a cluster is likely to have (on a faster one
// the window still fills the link better than one request would).
inline constexpr double kAssumedLinkBytesPerSecond = 125e6;
inline constexpr absl::Duration kShortRoundTrip = absl::Milliseconds(1);
uint64_t WindowBytesForRoundTrip(absl::Duration round_trip);
void RunExchanges(absl::Span<DataExchange> exchanges, absl::Time deadline,
                  size_t requests_in_flight = SIZE_MAX);

// Links of a call that carry large requests or answers are driven by a few
// threads beside the calling one (kept from call to call), so that the
// kernel's copies, made by the thread that sends or receives, are not all
// on one core: TLS links whenever two or more are heavy, plaintext ones
// when the call also moves at least this much (requests, and answers as
// far as DataExchange::answer_bytes says): between a 1 MiB pull through
// two servers, 10% slower on two threads than on one, and the 0.94 MB MLP's
// PushPull (1.9 MB), whose sync step was 10% faster on them
// (bench/results/plaintext_threads.txt).
inline constexpr uint64_t kPlaintextThreadsFromBytes = 3 << 19;  // 1.5 MiB

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_TRANSPORT_DATA_LINK_H_
