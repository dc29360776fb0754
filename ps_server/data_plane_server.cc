#include "ps_server/data_plane_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/transport/data_plane.h"
#include "glog/logging.h"
#include "ps_server/outbox.h"

namespace pstrain {
namespace {

using data_plane::Method;

// One connection's byte stream: the socket, through TLS when `tls` is set.
// A plaintext stream's answers go through `outbox`, whose hand-overs the
// reads wait for too; a TLS stream's are sent by the connection's thread
// (one TLS session is not to be written and read by two threads at once).
struct Stream {
  int fd = -1;
  TlsSession* tls = nullptr;
  std::shared_ptr<Outbox> outbox;
};

// Plaintext: waits until the socket has bytes to read, sending the
// outbox's stalled answers meanwhile; DEADLINE_EXCEEDED when nothing at all
// happened for kFrameTimeoutSeconds (as SO_RCVTIMEO on a TLS stream).
// While the connection has Outbox::kMaxOutstanding answers unsent it reads
// nothing, and looks again every 10 ms.
absl::Status AwaitReadable(const Stream& stream) {
  constexpr absl::Duration kQuiet =
      absl::Seconds(data_plane::kFrameTimeoutSeconds);
  const absl::Time quiet_until = absl::Now() + kQuiet;
  while (true) {
    const bool sending = stream.outbox->wants_write();
    const bool full = stream.outbox->outstanding() >= Outbox::kMaxOutstanding;
    const absl::Time check = stream.outbox->next_check(kQuiet);
    absl::Time wake = std::min(quiet_until, check);
    if (full) wake = std::min(wake, absl::Now() + absl::Milliseconds(10));
    pollfd waits[2] = {
        {stream.fd,
         static_cast<short>((full ? 0 : POLLIN) | (sending ? POLLOUT : 0)), 0},
        {stream.outbox->wake_fd(), POLLIN, 0}};
    const int ready =
        poll(waits, 2,
             static_cast<int>(std::max<int64_t>(
                 0, absl::ToInt64Milliseconds(wake - absl::Now()) + 1)));
    if (ready < 0) {
      if (errno == EINTR) continue;
      return SocketError("poll", errno);
    }
    // Only when there is something to send or to check: not a system call
    // and a lock for every request read.
    if ((waits[0].revents & POLLOUT) != 0 || waits[1].revents != 0 ||
        absl::Now() >= check) {
      if (absl::Status s = stream.outbox->OwnerFlush(kQuiet); !s.ok()) {
        return s;
      }
    }
    if ((waits[0].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
      return absl::OkStatus();
    }
    if (ready == 0 && !sending && !full && absl::Now() >= quiet_until) {
      return absl::DeadlineExceededError("no request within the frame timeout");
    }
  }
}

// Reads once into `buffer`, with room for at least `frame_bytes` from its
// front but at most 4 MiB beyond what has arrived, so a header claiming a
// huge body costs nothing until the body is sent. The socket's SO_RCVTIMEO
// bounds the wait (DEADLINE_EXCEEDED); OUT_OF_RANGE when the peer closed.
absl::Status ReadMore(const Stream& stream, size_t frame_bytes,
                      ReceiveBuffer* buffer) {
  constexpr size_t kGrowAhead = 4 << 20;
  buffer->MakeRoom(
      std::min(frame_bytes, buffer->available().size() + kGrowAhead));
  if (stream.tls != nullptr) {
    short want;
    absl::StatusOr<size_t> got =
        stream.tls->Read(buffer->free_begin(), buffer->free_bytes(), &want);
    if (!got.ok()) return got.status();
    // A blocking socket wants more only once SO_RCVTIMEO passed.
    if (*got == 0) return absl::DeadlineExceededError("TLS read timed out");
    buffer->Produced(*got);
    return absl::OkStatus();
  }
  while (true) {
    if (stream.outbox != nullptr) {
      if (absl::Status s = AwaitReadable(stream); !s.ok()) return s;
    }
    const ssize_t got =
        recv(stream.fd, buffer->free_begin(), buffer->free_bytes(),
             stream.outbox != nullptr ? MSG_DONTWAIT : 0);
    if (got > 0) {
      buffer->Produced(static_cast<size_t>(got));
      return absl::OkStatus();
    }
    if (got == 0) return absl::OutOfRangeError("connection closed");
    if (errno == EAGAIN && stream.outbox != nullptr) continue;
    if (errno != EINTR) return SocketError("recv", errno);
  }
}

// Sends `answer` in its turn: behind the answers still due on a plaintext
// connection, at once on a TLS one (whose thread waits for each answer).
absl::Status Send(const Stream& stream,
                  std::unique_ptr<Outbox::Answer> answer) {
  if (stream.outbox != nullptr) {
    stream.outbox->Complete(stream.outbox->Reserve(), std::move(answer));
    return absl::OkStatus();
  }
  absl::Status sent = stream.tls != nullptr
                          ? stream.tls->WriteAll(answer->pieces)
                          : SendAll(stream.fd, answer->pieces);
  if (sent.ok() && answer->after_sent) answer->after_sent();
  return sent;
}

absl::Status Answer(const Stream& stream, absl::StatusCode code,
                    absl::string_view body) {
  auto answer = std::make_unique<Outbox::Answer>();
  answer->owned = std::string(body);
  answer->Frame(code, {answer->owned});
  return Send(stream, std::move(answer));
}

absl::Status AnswerStatus(const Stream& stream, const absl::Status& status) {
  return Answer(stream, status.code(), status.message());
}

// "a.b.c.d:port" or "[v6]:port" of an accepted connection's peer.
std::string PeerName(const sockaddr_storage& address) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (address.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&address);
    inet_ntop(AF_INET, &v4->sin_addr, host, sizeof(host));
    port = ntohs(v4->sin_port);
    return absl::StrCat(host, ":", port);
  }
  if (address.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&address);
    inet_ntop(AF_INET6, &v6->sin6_addr, host, sizeof(host));
    port = ntohs(v6->sin6_port);
  }
  return absl::StrCat("[", host, "]:", port);
}

// Refused and broken connections are logged with their peer, but at most
// kBurst lines a minute: a port scan or a misconfigured client retrying in
// a loop must not flood the log.
void LogRefusal(const std::string& line) {
  constexpr int kBurst = 20;
  static absl::Mutex mu(absl::kConstInit);
  static absl::Time window_start = absl::InfinitePast();
  static int lines = 0;
  static int64_t suppressed = 0;
  int64_t dropped = 0;
  {
    absl::MutexLock lock(&mu);
    const absl::Time now = absl::Now();
    if (now - window_start > absl::Minutes(1)) {
      window_start = now;
      lines = 0;
      dropped = suppressed;
      suppressed = 0;
    }
    if (++lines > kBurst) {
      ++suppressed;
      return;
    }
  }
  if (dropped > 0) {
    LOG(WARNING) << "data plane: " << dropped
                 << " more refusals were not logged in the last minute";
  }
  LOG(WARNING) << line;
}

// A PushPull's OK answer (common/transport/data_plane.h): the pull's answer
// `pull` with u32 + `push_response` before its PullResponse part. With payloads
// apart that part is the meta, whose length prefix grows to cover it.
// `push_length` and `meta_length` hold the new prefixes.
std::vector<absl::string_view> PrefixPushResponse(
    absl::string_view push_response, bool payloads_apart,
    absl::Span<const absl::string_view> pull,
    char push_length[data_plane::kLengthPrefixBytes],
    char meta_length[data_plane::kLengthPrefixBytes]) {
  data_plane::EncodeLengthPrefix(static_cast<uint32_t>(push_response.size()),
                                 push_length);
  std::vector<absl::string_view> answer;
  answer.reserve(pull.size() + 3);
  size_t skip = 0;  // bytes of `pull` already accounted for
  if (payloads_apart) {
    // The pull's own meta length, which may span pieces.
    char old_length[data_plane::kLengthPrefixBytes];
    for (absl::string_view piece : pull) {
      const size_t take =
          std::min(piece.size(), data_plane::kLengthPrefixBytes - skip);
      std::memcpy(old_length + skip, piece.data(), take);
      skip += take;
      if (skip == data_plane::kLengthPrefixBytes) break;
    }
    data_plane::EncodeLengthPrefix(
        data_plane::DecodeLengthPrefix(old_length) +
            static_cast<uint32_t>(data_plane::kLengthPrefixBytes +
                                  push_response.size()),
        meta_length);
    answer.emplace_back(meta_length, data_plane::kLengthPrefixBytes);
  }
  answer.emplace_back(push_length, data_plane::kLengthPrefixBytes);
  answer.push_back(push_response);
  for (absl::string_view piece : pull) {
    const size_t drop = std::min(skip, piece.size());
    skip -= drop;
    if (piece.size() > drop) answer.push_back(piece.substr(drop));
  }
  return answer;
}

// The shared state of one pull on a TLS connection: the shard may answer
// after the connection thread gave up waiting, so the answer lands here,
// not on its stack.
struct PullWait {
  absl::Notification done;
  std::unique_ptr<Outbox::Answer> answer;
};

// What a pull's answer is made from; copied into the shard's callback.
struct PullAnswerParts {
  Method method = Method::kPull;
  bool payloads_apart = false;
  std::string push_response;  // a PushPull's
  absl::Time arrived;         // the pull's
  uint64_t request_bytes = 0;
  // options.on_call, or null; it outlives every answer the server sends.
  const DataPlaneServerOptions::CallObserver* on_call = nullptr;
};

// The framed answer to a pull (the pull half of a PushPull behind its push
// response), on whichever thread the shard answers it.
std::unique_ptr<Outbox::Answer> MakePullAnswer(
    PullAnswerParts parts, absl::StatusOr<OutgoingBytes> result) {
  auto answer = std::make_unique<Outbox::Answer>();
  const absl::StatusCode code = result.status().code();
  uint64_t pull_bytes = 0;
  if (result.ok()) {
    for (absl::string_view piece : result->pieces) pull_bytes += piece.size();
    answer->keep_alive = std::move(result->keep_alive);
    if (parts.method == Method::kPushPull) {
      answer->owned = std::move(parts.push_response);
      answer->Frame(code,
                    PrefixPushResponse(answer->owned, parts.payloads_apart,
                                       result->pieces, answer->push_length,
                                       answer->meta_length));
    } else {
      answer->Frame(code, result->pieces);
    }
  } else {
    answer->owned = std::string(result.status().message());
    pull_bytes = answer->owned.size();
    answer->Frame(code, {answer->owned});
  }
  if (parts.on_call != nullptr) {
    answer->after_sent = [on_call = parts.on_call, code,
                          arrived = parts.arrived, in = parts.request_bytes,
                          pull_bytes] {
      (*on_call)(Method::kPull, code, absl::Now() - arrived, in, pull_bytes);
    };
  }
  return answer;
}

// One framed request, its body still in the connection's buffer.
struct Request {
  data_plane::RequestHeader header;
  absl::string_view body;
  absl::Time arrived;  // when its header was complete
};

// Reads the next whole request into `received`. The wait for its first
// byte has no deadline of its own on a greeted connection (`may_idle`): an
// idle connection is normal, and SO_RCVTIMEO only wakes the read now and
// then to notice `stopping`. Once a request has begun, every read of it must
// make progress within SO_RCVTIMEO. Not OK: the connection ends
// (OUT_OF_RANGE, not logged, when the peer closed or the server stops). A
// header that cannot be followed is counted, answered and ends it too.
absl::StatusOr<Request> ReadRequest(const Stream& stream, bool may_idle,
                                    uint64_t max_body_bytes,
                                    const std::atomic<bool>& stopping,
                                    DataPlaneHandler& handler,
                                    ReceiveBuffer& received) {
  absl::Status read;
  while (received.available().empty() && !stopping.load()) {
    read = ReadMore(stream, data_plane::kRequestHeaderBytes, &received);
    if (!absl::IsDeadlineExceeded(read) || !may_idle) break;
    read = absl::OkStatus();
  }
  if (!read.ok()) return read;
  if (stopping.load()) return absl::OutOfRangeError("server stopping");
  while (received.available().size() < data_plane::kRequestHeaderBytes) {
    read = ReadMore(stream, data_plane::kRequestHeaderBytes, &received);
    if (!read.ok()) return read;
  }
  absl::StatusOr<data_plane::RequestHeader> header =
      data_plane::DecodeRequestHeader(received.available().data(),
                                      max_body_bytes);
  if (!header.ok()) {
    // The stream can no longer be followed: answer and close.
    handler.CountRejected();
    AnswerStatus(stream, header.status()).IgnoreError();
    return header.status();
  }
  const absl::Time arrived = absl::Now();
  const size_t frame_bytes =
      data_plane::kRequestHeaderBytes + header->body_bytes;
  while (received.available().size() < frame_bytes) {
    read = ReadMore(stream, frame_bytes, &received);
    if (!read.ok()) return read;
  }
  return Request{*header,
                 received.available().substr(data_plane::kRequestHeaderBytes,
                                             header->body_bytes),
                 arrived};
}

// A Hello: the bearer token checked and answered. Not OK: the connection
// ends.
absl::Status Greet(const Stream& stream, DataPlaneHandler& handler,
                   absl::string_view token) {
  if (!handler.TokenAccepted(token)) {
    handler.CountRejected();
    AnswerStatus(
        stream, absl::UnauthenticatedError("missing or wrong bearer token (see "
                                           "--auth_token_file)"))
        .IgnoreError();
    return absl::UnauthenticatedError("bad token");
  }
  return Answer(stream, absl::StatusCode::kOk, "");
}

// One Push, Pull, PushPull or Forward of a greeted connection, served, and
// its answer sent or left to be sent by the thread that completes it
// (ps_server/outbox.h); options.on_call told of it. Not OK only when the
// connection must end: the answer could not be sent, or the shard broke its
// promise to answer a pull by its deadline.
absl::Status ServeCall(const Stream& stream, DataPlaneHandler& handler,
                       const DataPlaneServerOptions& options,
                       const Request& request) {
  const data_plane::RequestHeader& header = request.header;
  const bool pulls =
      header.method == Method::kPull || header.method == Method::kPushPull;
  absl::Status status;
  absl::StatusOr<std::string> pushed;
  absl::string_view pull_request = request.body;
  // A PushPull counts as the Push and the Pull it carries.
  absl::Time pull_arrived = request.arrived;
  // This connection's answers go in order anyway: a push that waits here
  // holds nothing a refusal would not.
  const absl::Time deadline =
      request.arrived +
      std::min(absl::Milliseconds(header.timeout_ms), options.max_pull_wait);
  if (header.method == Method::kPushPull) {
    absl::StatusOr<data_plane::LengthPrefixed> parts =
        data_plane::SplitLengthPrefixed(request.body, "PushPull request");
    if (parts.ok()) {
      pushed = handler.ServeDataPlanePush(absl::MakeConstSpan(&parts->head, 1),
                                          deadline, parts->rest);
      status = pushed.status();
      pull_request = parts->rest;
    } else {
      handler.CountRejected();
      status = parts.status();
    }
    pull_arrived = absl::Now();
    if (options.on_call) {
      options.on_call(Method::kPush, status.code(),
                      pull_arrived - request.arrived,
                      request.body.size() - pull_request.size(),
                      pushed.ok() ? pushed->size() : 0);
    }
  } else if (header.method == Method::kPush) {
    pushed = handler.ServeDataPlanePush(absl::MakeConstSpan(&request.body, 1),
                                        deadline, /*pull_after=*/{});
    status = pushed.status();
  } else if (header.method == Method::kForward) {
    pushed = handler.ServeDataPlaneForward(request.body, deadline);
    status = pushed.status();
  }
  if (!status.ok() || !pulls) {
    auto answer = std::make_unique<Outbox::Answer>();
    answer->owned =
        status.ok() ? std::move(*pushed) : std::string(status.message());
    answer->Frame(status.code(), {answer->owned});
    // A PushPull whose push failed was reported above; a Forward is not.
    if (options.on_call && header.method == Method::kPush) {
      answer->after_sent = [on_call = &options.on_call, code = status.code(),
                            arrived = request.arrived, in = header.body_bytes,
                            out = answer->owned.size()] {
        (*on_call)(Method::kPush, code, absl::Now() - arrived, in, out);
      };
    }
    return Send(stream, std::move(answer));
  }
  PullAnswerParts parts;
  parts.method = header.method;
  parts.payloads_apart = header.payloads_apart;
  if (header.method == Method::kPushPull) {
    parts.push_response = std::move(*pushed);
  }
  parts.arrived = pull_arrived;
  parts.request_bytes = pull_request.size();
  if (options.on_call) parts.on_call = &options.on_call;
  const bool follows_own_push = header.method == Method::kPushPull;
  if (stream.outbox != nullptr) {
    handler.ServeDataPlanePull(
        absl::MakeConstSpan(&pull_request, 1), deadline, header.payloads_apart,
        follows_own_push,
        [outbox = stream.outbox, seq = stream.outbox->Reserve(deadline),
         parts =
             std::move(parts)](absl::StatusOr<OutgoingBytes> result) mutable {
          // Called once: the parts are not needed again.
          outbox->Complete(seq,
                           MakePullAnswer(std::move(parts), std::move(result)));
        });
    return absl::OkStatus();
  }
  auto wait = std::make_shared<PullWait>();
  handler.ServeDataPlanePull(
      absl::MakeConstSpan(&pull_request, 1), deadline, header.payloads_apart,
      follows_own_push,
      [wait,
       parts = std::move(parts)](absl::StatusOr<OutgoingBytes> result) mutable {
        wait->answer = MakePullAnswer(std::move(parts), std::move(result));
        wait->done.Notify();
      });
  // The shard answers by the deadline; the margin only guards against a
  // handler that breaks that promise.
  if (!wait->done.WaitForNotificationWithDeadline(deadline +
                                                  absl::Seconds(5))) {
    absl::Status broken =
        absl::InternalError("pull not answered by its deadline");
    LOG(ERROR) << "data plane: " << broken;
    return broken;
  }
  return Send(stream, std::move(wait->answer));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataPlaneServer>> DataPlaneServer::Start(
    const DataPlaneServerOptions& options, DataPlaneHandler* handler) {
  int port = 0;
  absl::StatusOr<ScopedFd> listener = ListenTcp(
      options.host, options.port, data_plane::kSocketBufferBytes, &port);
  if (!listener.ok()) return listener.status();
  std::unique_ptr<DataPlaneServer> server(
      new DataPlaneServer(options, handler, std::move(*listener), port));
  if (!server->wake_.valid()) return SocketError("eventfd", errno);
  server->accept_thread_ = std::thread([s = server.get()] { s->AcceptLoop(); });
  return server;
}

DataPlaneServer::DataPlaneServer(const DataPlaneServerOptions& options,
                                 DataPlaneHandler* handler, ScopedFd listener,
                                 int port)
    : options_(options),
      handler_(handler),
      listener_(std::move(listener)),
      wake_(eventfd(0, EFD_CLOEXEC)),
      port_(port) {}

DataPlaneServer::~DataPlaneServer() { Shutdown(); }

void DataPlaneServer::AcceptLoop() {
  while (!stopping_.load()) {
    pollfd waits[2] = {{listener_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    // No timeout: Shutdown's eventfd write ends the wait.
    if (poll(waits, 2, -1) < 0) {
      if (errno == EINTR) continue;
      LOG(ERROR) << SocketError("data plane poll", errno);
      return;
    }
    if (waits[1].revents != 0 || stopping_.load()) return;
    sockaddr_storage address = {};
    socklen_t address_bytes = sizeof(address);
    ScopedFd fd(accept4(listener_.get(), reinterpret_cast<sockaddr*>(&address),
                        &address_bytes, SOCK_CLOEXEC));
    if (!fd.valid()) {
      const int error = errno;
      if (error != EINTR && error != ECONNABORTED && error != EAGAIN) {
        LOG_EVERY_N(WARNING, 100) << SocketError("data plane accept", error);
      }
      // Out of descriptors: the listener stays readable, so wait a little
      // instead of spinning until connections close.
      if (error == EMFILE || error == ENFILE || error == ENOMEM ||
          error == ENOBUFS) {
        pollfd wake = {wake_.get(), POLLIN, 0};
        poll(&wake, 1, 100);
      }
      continue;
    }
    ReapFinished();
    absl::Status tuned =
        TuneSocket(fd.get(), /*buffer_bytes=*/0, absl::ZeroDuration());
    const timeval frame_timeout = {data_plane::kFrameTimeoutSeconds, 0};
    setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &frame_timeout,
               sizeof(frame_timeout));
    setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &frame_timeout,
               sizeof(frame_timeout));
    absl::MutexLock lock(&mu_);
    if (!tuned.ok() ||
        static_cast<int>(live_.size()) >= options_.max_connections) {
      LOG_EVERY_N(WARNING, 100)
          << "data plane: refusing a connection ("
          << (tuned.ok() ? absl::StrCat(live_.size(), " open, the limit")
                         : tuned.ToString())
          << ")";
      continue;
    }
    const int64_t id = next_id_++;
    Connection& connection = live_[id];
    connection.fd = fd.get();
    // Started under mu_, so the thread's own exit (which takes mu_) finds
    // its std::thread already in place.
    auto owned = std::make_shared<ScopedFd>(std::move(fd));
    try {
      connection.thread =
          std::thread([this, id, owned, peer = PeerName(address)] {
            Serve(id, std::move(*owned), peer);
          });
    } catch (const std::system_error& e) {
      // Out of threads: this connection is closed, the server goes on.
      LOG_EVERY_N(WARNING, 100)
          << "data plane: no thread for a connection: " << e.what();
      live_.erase(id);
    }
  }
}

std::unique_ptr<TlsSession> DataPlaneServer::Handshake(
    int fd, const std::string& peer) {
  const absl::Time deadline = absl::Now() + options_.handshake_timeout;
  // A data-plane client that does not speak TLS (a plaintext worker, or
  // one from before TLS on this plane) opens with a request header: answer
  // it in its own framing, so it reads why instead of a TLS alert.
  pollfd wait = {fd, POLLIN, 0};
  char first[4];
  ssize_t peeked = -1;
  if (poll(&wait, 1,
           static_cast<int>(
               absl::ToInt64Milliseconds(options_.handshake_timeout))) > 0) {
    peeked = recv(fd, first, sizeof(first), MSG_PEEK | MSG_DONTWAIT);
  }
  if (peeked == static_cast<ssize_t>(sizeof(first)) &&
      data_plane::HasRequestMagic(absl::string_view(first, sizeof(first)))) {
    handler_->CountHandshakeRefused();
    AnswerStatus(Stream{fd, nullptr},
                 absl::FailedPreconditionError(
                     "this data port speaks TLS (the server has --tls_cert): "
                     "a plaintext data-plane client is refused"))
        .IgnoreError();
    LogRefusal(absl::StrCat("data plane: refused a plaintext client from ",
                            peer, " on the TLS data port"));
    return nullptr;
  }
  absl::StatusOr<std::unique_ptr<TlsSession>> session =
      TlsSession::Accept(options_.tls, fd, peer, deadline);
  if (!session.ok()) {
    if (stopping_.load()) return nullptr;
    handler_->CountHandshakeRefused();
    LogRefusal(absl::StrCat("data plane: refused the TLS handshake of ", peer,
                            ": ", session.status().ToString()));
    return nullptr;
  }
  const bool kernel = (*session)->ktls_send() || (*session)->ktls_recv();
  handler_->CountTlsConnection(kernel);
  std::string why_not_kernel;
  if (!kernel) {
    why_not_kernel =
        !options_.tls->ktls()
            ? " (kernel TLS off: --data_plane_ktls)"
            : absl::StrCat(" (kernel TLS unavailable: ",
                           KernelTlsUnavailableReason().empty()
                               ? "OpenSSL did not enable it for this cipher"
                               : KernelTlsUnavailableReason(),
                           ")");
  }
  LOG(INFO) << "data plane: TLS connection from " << peer << ": "
            << (*session)->Describe() << why_not_kernel;
  return std::move(*session);
}

void DataPlaneServer::Serve(int64_t id, ScopedFd fd, std::string peer) {
  ReceiveBuffer received;
  bool greeted = false;
  absl::Status ended;
  std::unique_ptr<TlsSession> tls;
  if (options_.tls != nullptr) {
    tls = Handshake(fd.get(), peer);
    if (tls == nullptr) ended = absl::OutOfRangeError("handshake refused");
  }
  Stream stream{fd.get(), tls.get(), nullptr};
  if (options_.tls == nullptr) {
    stream.outbox = std::make_shared<Outbox>(fd.get());
  }
  while (ended.ok()) {
    absl::StatusOr<Request> request =
        ReadRequest(stream, /*may_idle=*/greeted, options_.max_body_bytes,
                    stopping_, *handler_, received);
    if (!request.ok()) {
      ended = request.status();
      break;
    }
    // Taken once answered: the request views the buffer until then.
    absl::Cleanup consume = [&received, &request] {
      received.Consume(data_plane::kRequestHeaderBytes +
                       request->header.body_bytes);
    };
    if (request->header.method == Method::kHello) {
      ended = Greet(stream, *handler_, request->body);
      greeted = ended.ok();
    } else if (!greeted) {
      handler_->CountRejected();
      AnswerStatus(stream, absl::FailedPreconditionError(
                               "a data-plane connection must start with "
                               "Hello"))
          .IgnoreError();
      ended = absl::FailedPreconditionError("no Hello");
    } else {
      ended = ServeCall(stream, *handler_, options_, *request);
    }
    // Answers handed over while this thread served are sent now, not at
    // its next wait for a request.
    if (ended.ok() && stream.outbox != nullptr &&
        stream.outbox->wants_write()) {
      ended = stream.outbox->OwnerFlush(
          absl::Seconds(data_plane::kFrameTimeoutSeconds));
    }
  }
  if (stream.outbox != nullptr) {
    // Every request read is answered, as when this thread answered each
    // before reading the next (a peer that closed only its sending side
    // still reads them); not when the server stops, the peer stalled, or
    // the outbox itself gave up.
    if (!stopping_.load() && !absl::IsAborted(ended) &&
        !absl::IsInternal(ended) && !absl::IsDeadlineExceeded(ended)) {
      stream.outbox->FlushBeforeClose(
          absl::Now() + absl::Seconds(data_plane::kFrameTimeoutSeconds));
    }
    stream.outbox->Close();
    if (absl::Status sent = stream.outbox->error();
        !sent.ok() && !stopping_.load()) {
      LogRefusal(absl::StrCat("data plane: an answer to ", peer,
                              " could not be sent: ", sent.ToString()));
    }
  }
  if (!ended.ok() && !stopping_.load() && !absl::IsOutOfRange(ended)) {
    LogRefusal(absl::StrCat("data plane: closed the connection from ", peer,
                            ": ", ended.ToString()));
  }
  absl::MutexLock lock(&mu_);
  auto node = live_.extract(id);
  finished_.push_back(std::move(node.mapped().thread));
  // `fd` closes on return, after it left live_: Shutdown never shuts down a
  // descriptor number that a later socket may have reused.
}

void DataPlaneServer::ReapFinished() {
  std::vector<std::thread> done;
  {
    absl::MutexLock lock(&mu_);
    done.swap(finished_);
  }
  for (std::thread& t : done) t.join();
}

void DataPlaneServer::Shutdown() {
  if (stopping_.exchange(true)) return;
  const uint64_t one = 1;
  if (write(wake_.get(), &one, sizeof(one)) != sizeof(one)) {
    LOG(ERROR) << SocketError("eventfd write", errno);
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, connection] : live_) {
      shutdown(connection.fd, SHUT_RDWR);
    }
    // Ends: every connection thread is now failing its socket calls, and a
    // thread waiting for a pull waits no longer than that pull's deadline.
    mu_.Await(absl::Condition(
        +[](absl::flat_hash_map<int64_t, Connection>* live) {
          return live->empty();
        },
        &live_));
  }
  ReapFinished();
}

}  // namespace pstrain
