#include "common/transport/data_link.h"

#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "common/handler_threads.h"
#include "glog/logging.h"

namespace pstrain {

using data_plane::kRequestHeaderBytes;
using data_plane::kResponseHeaderBytes;

// The exchanges of one link during RunExchanges: what is left to send, and
// where the answer being read stands.
class DataLinkIo {
 public:
  // `ended`: per exchange of the RunExchanges call, when it was answered or
  // failed (ns since the epoch; 0 while it is not), shared by every link.
  DataLinkIo(DataLink* link, std::vector<std::atomic<int64_t>>* ended)
      : link_(link), ended_(ended) {}

  DataLink* link() const { return link_; }
  // `index`: the exchange's in the RunExchanges span.
  void Add(DataExchange* exchange, size_t index) {
    queue_.push_back(exchange);
    indices_.push_back(index);
    timed_after_other_ |= exchange->after >= 0;
  }

  // The soonest an unanswered exchange's grace ends (DataExchange::after),
  // or InfiniteFuture when no such clock runs. `*waits_to_start`: some
  // clock has not started (the exchange it follows may end on another
  // thread, whose end this one's poll does not see).
  absl::Time GraceEnd(bool* waits_to_start) const {
    absl::Time soonest = absl::InfiniteFuture();
    if (!timed_after_other_) return soonest;
    for (size_t i = answered_; i < queue_.size(); ++i) {
      const DataExchange& e = *queue_[i];
      if (e.after < 0) continue;
      const int64_t other_ended = (*ended_)[e.after].load();
      if (other_ended == 0) {
        *waits_to_start = true;
        continue;
      }
      soonest = std::min(soonest, absl::FromUnixNanos(other_ended) + e.grace);
    }
    return soonest;
  }

  // Lays out every request as header + body pieces, in queue order.
  void Prepare() {
    headers_.resize(queue_.size() * kRequestHeaderBytes);
    request_ends_.reserve(queue_.size());
    for (size_t i = 0; i < queue_.size(); ++i) {
      DataExchange& e = *queue_[i];
      uint64_t body_bytes = 0;
      for (absl::string_view piece : e.body) body_bytes += piece.size();
      char* header = headers_.data() + i * kRequestHeaderBytes;
      data_plane::RequestHeader request;
      request.method = e.method;
      request.timeout_ms = timeout_ms_;
      request.body_bytes = body_bytes;
      request.payloads_apart = static_cast<bool>(e.place_payloads);
      data_plane::EncodeRequestHeader(request, header);
      iov_.push_back({header, kRequestHeaderBytes});
      for (absl::string_view piece : e.body) {
        if (!piece.empty()) {
          iov_.push_back({const_cast<char*>(piece.data()), piece.size()});
        }
      }
      request_ends_.push_back(
          (request_ends_.empty() ? 0 : request_ends_.back()) +
          kRequestHeaderBytes + body_bytes);
      if (body_bytes >= kHeavyBytes || e.place_payloads) heavy_ = true;
      bytes_ += body_bytes + e.answer_bytes;
    }
    if (link_->tls_ != nullptr) GatherSmallPieces();
  }
  void set_timeout(absl::Duration timeout) {
    timeout_ms_ = static_cast<uint32_t>(
        std::clamp<int64_t>(absl::ToInt64Milliseconds(timeout), 1, UINT32_MAX));
  }

  // At most this many requests of the link unanswered, and at most
  // `bytes` of them past the oldest one (see SendLimit).
  void set_window(size_t requests, uint64_t bytes = UINT64_MAX) {
    window_ = std::clamp<size_t>(requests, 1, SIZE_MAX / 2);
    window_bytes_ = bytes;
  }

  // Whether a request or its answer is large enough (a body of
  // kHeavyBytes, or payloads read into place) that sealing and opening it
  // costs more than starting a thread for it.
  bool heavy() const { return heavy_; }
  // The requests' bytes and the answers' as far as known
  // (DataExchange::answer_bytes).
  uint64_t bytes() const { return bytes_; }
  static constexpr uint64_t kHeavyBytes = 64 << 10;

  bool done() const { return answered_ == queue_.size(); }
  // The requests' bytes not yet handed to the socket.
  uint64_t UnsentBytes() const {
    uint64_t unsent = 0;
    for (size_t i = iov_first_; i < iov_.size(); ++i) {
      unsent += iov_[i].iov_len;
    }
    return unsent;
  }
  bool sending() const {
    return (iov_first_ < iov_.size() && sent_bytes_ < SendLimit()) ||
           tls_flush_pending_;
  }
  // Moves the count of leading exchanges that may be sent (can_send) past
  // those whose can_send() turned true.
  void RefreshSendable() {
    while (sendable_ < queue_.size() &&
           (!queue_[sendable_]->can_send || queue_[sendable_]->can_send())) {
      ++sendable_;
    }
  }
  // The eventfd to watch while an exchange waits for can_send, or -1.
  int send_wake_fd() const {
    return sendable_ < queue_.size() ? queue_[sendable_]->send_wake_fd : -1;
  }
  int fd() const { return link_->fd_.get(); }

  // Sends what the socket takes without blocking.
  void Send() {
    if (link_->tls_ != nullptr) return SendTls();
    while (!done() && sending()) {
      // The iovecs up to the window's end, the last one cut there.
      const uint64_t allowed = SendLimit() - sent_bytes_;
      uint64_t bytes = 0;
      size_t count = 0;
      while (iov_first_ + count < iov_.size() && count < IOV_MAX &&
             bytes < allowed) {
        bytes += iov_[iov_first_ + count].iov_len;
        ++count;
      }
      iovec& last = iov_[iov_first_ + count - 1];
      const size_t cut = bytes > allowed ? bytes - allowed : 0;
      last.iov_len -= cut;
      msghdr message = {};
      message.msg_iov = iov_.data() + iov_first_;
      message.msg_iovlen = count;
      const ssize_t sent = sendmsg(fd(), &message, MSG_NOSIGNAL | MSG_DONTWAIT);
      last.iov_len += cut;
      if (sent < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        return Fail(SocketError(absl::StrCat("send to ", link_->peer_), errno));
      }
      sent_bytes_ += static_cast<uint64_t>(sent);
      ConsumeIovecs(static_cast<size_t>(sent), iov_, &iov_first_);
    }
  }

  // Reads what has arrived without blocking, finishing each answer whose
  // last byte is in.
  void Receive() {
    DataLink& l = *link_;
    while (!done()) {
      if (payload_left_ > 0) {
        if (!ReceivePayloads()) return;
        continue;
      }
      DataExchange& front = *queue_[answered_];
      // The answer at the front: how many bytes it takes, once its header
      // is in. Payloads apart are not read ahead: they go straight to
      // their place.
      bool apart = false;
      size_t frame_bytes = kResponseHeaderBytes;
      ReceiveBuffer& received = l.received_;
      const size_t available = received.available().size();
      const char* at = received.available().data();
      if (available >= kResponseHeaderBytes) {
        absl::StatusOr<data_plane::ResponseHeader> header =
            data_plane::DecodeResponseHeader(at, l.max_body_bytes_);
        if (!header.ok()) return Fail(header.status());
        apart = front.place_payloads && header->code == absl::StatusCode::kOk;
        if (!apart) {
          frame_bytes += header->body_bytes;
          if (available >= frame_bytes) {
            Complete(*header, absl::string_view(at + kResponseHeaderBytes,
                                                header->body_bytes));
            received.Consume(frame_bytes);
            continue;
          }
        } else {
          frame_bytes += data_plane::kLengthPrefixBytes;
          if (header->body_bytes < data_plane::kLengthPrefixBytes) {
            return Fail(absl::DataLossError("data-plane answer too short"));
          }
          if (available >= frame_bytes) {
            const uint32_t meta_bytes =
                data_plane::DecodeLengthPrefix(at + kResponseHeaderBytes);
            if (meta_bytes >
                header->body_bytes - data_plane::kLengthPrefixBytes) {
              return Fail(
                  absl::DataLossError("data-plane metadata past its answer"));
            }
            frame_bytes += meta_bytes;
            if (available >= frame_bytes) {
              if (!StartPayloads(
                      front, *header,
                      absl::string_view(at + frame_bytes - meta_bytes,
                                        meta_bytes))) {
                return;
              }
              received.Consume(frame_bytes);
              continue;
            }
          }
        }
      }
      received.MakeRoom(frame_bytes);
      const size_t room = apart || front.place_payloads
                              ? frame_bytes - available
                              : received.free_bytes();
      const ssize_t got = RecvSome(received.free_begin(), room);
      if (!Received(got)) return;
      received.Produced(static_cast<size_t>(got));
    }
  }

  // Ends every exchange not yet answered with `status`; the link is left
  // out of step, so it is not used again.
  void Fail(const absl::Status& status) {
    // An Abort ends the connection: what the exchange then sees (the peer
    // closed, a reset) is not the server's doing. Whether its requests had
    // all left tells a stopped worker whether its push went in whole.
    absl::Status failed = status;
    if (link_->aborted_.load()) {
      const uint64_t unsent = UnsentBytes();
      failed = absl::CancelledError(absl::StrCat(
          "data-plane exchange with ", link_->peer_,
          " interrupted by this process ",
          unsent > 0 || tls_flush_pending_
              ? absl::StrCat("with ", unsent,
                             " bytes of its requests unsent (a push among "
                             "them did not go in whole)")
              : std::string("while waiting for its answer")));
    }
    for (; answered_ < queue_.size(); ++answered_) {
      queue_[answered_]->status = failed;
      MarkEnded(answered_);
    }
    link_->usable_ = false;
  }

 private:
  // TLS writes one buffer at a time, each at least one record and one
  // system call: runs of small pieces (headers, length prefixes, small
  // messages) are copied into one buffer so a small request is one record.
  void GatherSmallPieces() {
    constexpr size_t kSmall = 16 << 10;
    size_t small_bytes = 0;
    for (const iovec& v : iov_) {
      if (v.iov_len < kSmall) small_bytes += v.iov_len;
    }
    gathered_.clear();
    gathered_.reserve(small_bytes);  // no reallocation: iovecs point in
    std::vector<iovec> merged;
    size_t run_start = 0;  // where the current run begins in gathered_
    bool in_run = false;
    for (const iovec& v : iov_) {
      if (v.iov_len < kSmall) {
        if (!in_run) run_start = gathered_.size();
        gathered_.insert(gathered_.end(), static_cast<const char*>(v.iov_base),
                         static_cast<const char*>(v.iov_base) + v.iov_len);
        if (!in_run) {
          merged.push_back({nullptr, 0});
          in_run = true;
        }
        merged.back() = {gathered_.data() + run_start,
                         gathered_.size() - run_start};
      } else {
        merged.push_back(v);
        in_run = false;
      }
    }
    iov_ = std::move(merged);
  }

  void SendTls() {
    TlsSession& tls = *link_->tls_;
    short want;
    while (!done() && iov_first_ < iov_.size() && sent_bytes_ < SendLimit()) {
      const iovec& v = iov_[iov_first_];
      absl::StatusOr<size_t> sent = tls.Write(
          static_cast<const char*>(v.iov_base),
          std::min<uint64_t>(v.iov_len, SendLimit() - sent_bytes_), &want);
      if (!sent.ok()) return Fail(sent.status());
      if (*sent == 0) return;  // poll says when to go on
      sent_bytes_ += *sent;
      ConsumeIovecs(*sent, iov_, &iov_first_);
    }
    if (done()) return;
    // Records the session gathered are not on the wire until flushed.
    absl::StatusOr<bool> flushed = tls.Flush(&want);
    if (!flushed.ok()) return Fail(flushed.status());
    tls_flush_pending_ = !*flushed;
  }

  // recv without blocking, through TLS when the link has it: > 0 bytes,
  // 0 when the peer closed, -1 with errno (EAGAIN: nothing yet), or
  // kFailed when a TLS failure already failed the link.
  static constexpr ssize_t kFailed = -2;
  ssize_t RecvSome(char* data, size_t size) {
    if (link_->tls_ == nullptr) return recv(fd(), data, size, MSG_DONTWAIT);
    short want;
    absl::StatusOr<size_t> got = link_->tls_->Read(data, size, &want);
    if (absl::IsOutOfRange(got.status())) return 0;
    if (!got.ok()) {
      Fail(got.status());
      return kFailed;
    }
    if (*got == 0) {
      errno = EAGAIN;
      return -1;
    }
    return static_cast<ssize_t>(*got);
  }

  // False (the link failed, or nothing more has arrived) unless recv got
  // bytes.
  bool Received(ssize_t got) {
    if (got > 0) return true;
    if (got == kFailed) return false;
    if (got == 0) {
      Fail(absl::UnavailableError(absl::StrCat(
          "data-plane connection to ", link_->peer_,
          " closed by the server (restarting or shutting down?)")));
    } else if (errno == EINTR) {
      return false;  // Receive's caller polls again
    } else if (errno != EAGAIN && errno != EWOULDBLOCK) {
      Fail(SocketError(absl::StrCat("recv from ", link_->peer_), errno));
    }
    return false;
  }

  // The metadata of an answer with payloads apart is in: learns where the
  // payloads go. False when the link failed.
  bool StartPayloads(DataExchange& front,
                     const data_plane::ResponseHeader& header,
                     absl::string_view meta) {
    absl::StatusOr<std::vector<absl::Span<char>>> places =
        front.place_payloads(meta);
    if (!places.ok()) {
      // The payloads that follow cannot be placed: the stream is lost.
      Fail(places.status());
      return false;
    }
    uint64_t total = 0;
    for (absl::Span<char> place : *places) total += place.size();
    const uint64_t expected =
        header.body_bytes - data_plane::kLengthPrefixBytes - meta.size();
    if (total != expected) {
      Fail(absl::DataLossError(absl::StrCat("data-plane answer carries ",
                                            expected, " payload bytes for ",
                                            total, " bytes of blocks")));
      return false;
    }
    places_ = std::move(*places);
    place_ = 0;
    place_offset_ = 0;
    payload_left_ = total;
    if (payload_left_ == 0) FinishPayloads();
    return true;
  }

  // Reads payload bytes into their places: first any already buffered,
  // then straight from the socket. False when it must wait or failed.
  bool ReceivePayloads() {
    DataLink& l = *link_;
    const absl::string_view buffered = l.received_.available();
    if (!buffered.empty()) {
      Advance(buffered.data(),
              std::min<uint64_t>(buffered.size(), payload_left_));
      return true;
    }
    iovec iov[64];
    size_t n = 0;
    for (size_t p = place_; p < places_.size() && n < 64; ++p) {
      const size_t skip = p == place_ ? place_offset_ : 0;
      if (places_[p].size() == skip) continue;
      iov[n++] = {places_[p].data() + skip, places_[p].size() - skip};
    }
    msghdr message = {};
    message.msg_iov = iov;
    message.msg_iovlen = n;
    const ssize_t got =
        link_->tls_ != nullptr
            ? RecvSome(static_cast<char*>(iov[0].iov_base), iov[0].iov_len)
            : recvmsg(fd(), &message, MSG_DONTWAIT);
    if (!Received(got)) return false;
    Advance(nullptr, static_cast<size_t>(got));
    return true;
  }

  // `bytes` payload bytes have arrived: copied from `from` (buffered ones)
  // or already in place (from == nullptr).
  void Advance(const char* from, size_t bytes) {
    if (from != nullptr) link_->received_.Consume(bytes);
    payload_left_ -= bytes;
    while (bytes > 0) {
      absl::Span<char>& place = places_[place_];
      const size_t take = std::min(bytes, place.size() - place_offset_);
      if (from != nullptr) {
        std::memcpy(place.data() + place_offset_, from, take);
        from += take;
      }
      place_offset_ += take;
      bytes -= take;
      if (place_offset_ == place.size()) {
        ++place_;
        place_offset_ = 0;
      }
    }
    if (payload_left_ == 0) FinishPayloads();
  }

  void FinishPayloads() {
    DataExchange& e = *queue_[answered_];
    e.status = absl::OkStatus();
    MarkEnded(answered_++);
    places_.clear();
    if (e.on_ok) e.on_ok();
  }

  void MarkEnded(size_t position) {
    if (ended_ == nullptr) return;  // no exchange follows another
    (*ended_)[indices_[position]].store(absl::ToUnixNanos(absl::Now()));
  }

  void Complete(const data_plane::ResponseHeader& header,
                absl::string_view body) {
    MarkEnded(answered_);
    DataExchange& e = *queue_[answered_++];
    if (header.code == absl::StatusCode::kOk) {
      e.status = e.on_response ? e.on_response(body) : absl::OkStatus();
      if (e.status.ok() && e.on_ok) e.on_ok();
    } else {
      e.status = absl::Status(header.code, body);
    }
  }

  // The bytes that may be sent now: every request up to `window_` past
  // the oldest unanswered one, and of those only as many as end within
  // `window_bytes_` of it (the oldest always).
  uint64_t SendLimit() const {
    if (request_ends_.empty()) return 0;
    size_t allowed = std::min(answered_ + window_, request_ends_.size());
    allowed = std::min(allowed, sendable_);
    if (allowed == 0) return 0;
    if (window_bytes_ != UINT64_MAX) {
      const uint64_t answered_bytes =
          answered_ == 0 ? 0 : request_ends_[answered_ - 1];
      size_t within = answered_ + 1;
      while (within < allowed &&
             request_ends_[within] - answered_bytes <= window_bytes_) {
        ++within;
      }
      allowed = std::min(allowed, within);
    }
    return request_ends_[allowed - 1];
  }

  DataLink* link_;
  std::vector<std::atomic<int64_t>>* ended_;
  std::vector<DataExchange*> queue_;
  std::vector<size_t> indices_;  // queue_'s, in the RunExchanges span
  bool timed_after_other_ = false;
  size_t sendable_ = 0;                 // RefreshSendable
  std::vector<uint64_t> request_ends_;  // bytes up to each request's end
  uint64_t sent_bytes_ = 0;
  size_t window_ = SIZE_MAX / 2;
  uint64_t window_bytes_ = UINT64_MAX;
  uint32_t timeout_ms_ = 1;
  std::vector<char> headers_;
  std::vector<iovec> iov_;
  size_t iov_first_ = 0;
  std::vector<char> gathered_;      // TLS: small pieces copied together
  bool tls_flush_pending_ = false;  // TLS: records buffered, not yet sent
  bool heavy_ = false;
  uint64_t bytes_ = 0;
  size_t answered_ = 0;
  // The answer whose payloads are being read into place.
  std::vector<absl::Span<char>> places_;
  size_t place_ = 0;
  size_t place_offset_ = 0;
  uint64_t payload_left_ = 0;
};

void DataLink::Abort() const {
  aborted_.store(true);
  // shutdown, not close: the descriptor stays this link's until it is
  // destroyed, and a poll or recv on it returns at once.
  ::shutdown(fd_.get(), SHUT_RDWR);
}

namespace {

// Polls `links` and moves each along until all are done or `deadline`.
// When a streamed call's links are split over threads, the stream wakes
// one eventfd, which only the thread that reads it would see: the calling
// thread reads it and passes each wake-up on to every helper's own
// eventfd, and keeps doing so (its own links done or not) until every
// helper has said it is done on `helpers_done`, or the deadline.
struct WakeRelay {
  std::vector<int> helpers;  // each helper's eventfd
  int helpers_done = -1;     // an eventfd each helper adds 1 to as it ends
};

// Drives `links` until every exchange on them is answered or failed.
// `wake_fd`: the eventfd that says a streamed exchange may be sendable (-1:
// the one a waiting link's exchange names). `relay`: see WakeRelay.
void DriveLinks(absl::Span<DataLinkIo* const> links, absl::Time deadline,
                int wake_fd = -1, const WakeRelay* relay = nullptr) {
  std::vector<pollfd> waits;
  std::vector<DataLinkIo*> waiting;
  size_t helpers_left = relay != nullptr ? relay->helpers.size() : 0;
  while (true) {
    waits.clear();
    waiting.clear();
    int wake = wake_fd;
    for (DataLinkIo* io : links) {
      if (io->done()) continue;
      io->RefreshSendable();
      if (wake_fd < 0 && io->send_wake_fd() >= 0) wake = io->send_wake_fd();
      waits.push_back(
          {io->fd(), static_cast<short>(POLLIN | (io->sending() ? POLLOUT : 0)),
           0});
      waiting.push_back(io);
    }
    if (waits.empty() && helpers_left == 0) return;
    const size_t link_waits = waits.size();
    const size_t wake_wait = waits.size();
    if (wake >= 0) waits.push_back({wake, POLLIN, 0});
    const size_t done_wait = waits.size();
    if (helpers_left > 0) waits.push_back({relay->helpers_done, POLLIN, 0});
    const absl::Time now = absl::Now();
    if (deadline <= now) {
      for (DataLinkIo* io : waiting) {
        io->Fail(absl::DeadlineExceededError(
            absl::StrCat("no answer from the data plane of ",
                         io->link()->peer(), " by the deadline")));
      }
      // The helpers end by the same deadline (RunExchanges joins them);
      // nothing is left to relay.
      return;
    }
    absl::Time until = deadline;
    bool failed = false;
    bool waits_to_start = false;
    for (DataLinkIo* io : waiting) {
      const absl::Time grace_end = io->GraceEnd(&waits_to_start);
      if (grace_end <= now) {
        io->Fail(absl::DeadlineExceededError(absl::StrCat(
            "no answer from the data plane of ", io->link()->peer(),
            " within its grace after the answer it follows")));
        failed = true;
      }
      until = std::min(until, grace_end);
    }
    if (failed) continue;
    // A clock that has not started is looked at again every few ms (its
    // start is seen at once when the exchange it follows is on this thread).
    if (waits_to_start) until = std::min(until, now + absl::Milliseconds(20));
    const int timeout_ms = static_cast<int>(
        std::min<int64_t>(absl::ToInt64Milliseconds(
                              absl::Ceil(until - now, absl::Milliseconds(1))),
                          INT_MAX));
    const int ready = poll(waits.data(), waits.size(), timeout_ms);
    if (ready < 0) {
      if (errno == EINTR) continue;
      const absl::Status error = SocketError("poll", errno);
      for (DataLinkIo* io : waiting) io->Fail(error);
      return;  // helpers unrelayed end by the deadline
    }
    if (wake >= 0 && (waits[wake_wait].revents & POLLIN)) {
      uint64_t count;
      (void)!read(wake, &count, sizeof(count));
      if (relay != nullptr) {
        const uint64_t one = 1;
        for (int helper : relay->helpers) {
          (void)!write(helper, &one, sizeof(one));
        }
      }
      for (DataLinkIo* io : waiting) {
        io->RefreshSendable();
        io->Send();
      }
    }
    if (helpers_left > 0 && (waits[done_wait].revents & POLLIN)) {
      uint64_t ended = 0;
      if (read(relay->helpers_done, &ended, sizeof(ended)) == sizeof(ended)) {
        helpers_left -= std::min<uint64_t>(ended, helpers_left);
      }
    }
    for (size_t i = 0; i < link_waits; ++i) {
      if (waits[i].revents & POLLOUT) waiting[i]->Send();
      if (waits[i].revents & (POLLIN | POLLERR | POLLHUP)) {
        waiting[i]->Receive();
      }
    }
  }
}

// Threads that drive a call's links beside the calling thread, kept from
// call to call: starting a thread for each call cost tens of microseconds,
// a fifth of a 1 MiB pull through two servers. As many as TLS calls use
// (a thread per core) and a few more, for a push and a pull at once; a
// call that finds none to be had drives the rest of its links itself.
std::atomic<HandlerThreads*> exchange_helpers{nullptr};

HandlerThreads& ExchangeHelpers() {
  HandlerThreads* current = exchange_helpers.load(std::memory_order_acquire);
  if (current != nullptr) return *current;
  static absl::Mutex making(absl::kConstInit);
  absl::MutexLock lock(&making);
  current = exchange_helpers.load(std::memory_order_acquire);
  if (current == nullptr) {
    const int cores =
        static_cast<int>(std::max(2u, std::thread::hardware_concurrency()));
    // Never deleted: a call may run while the process exits.
    current = new HandlerThreads(/*max_threads=*/cores + 2);
    static const bool forgotten_in_children = [] {
      // A child made by fork (a PyTorch DataLoader's worker, say) has none
      // of its parent's threads: it makes helpers of its own.
      return pthread_atfork(nullptr, nullptr, [] {
               exchange_helpers.store(nullptr, std::memory_order_relaxed);
             }) == 0;
    }();
    (void)forgotten_in_children;
    exchange_helpers.store(current, std::memory_order_release);
  }
  return *current;
}

// Threads that drive TLS links at once (the calling thread is one).
size_t TlsThreads(size_t links) {
  const size_t cores = std::max(2u, std::thread::hardware_concurrency());
  return std::min(links, cores);
}

// Threads that drive plaintext links at once (the calling thread is one):
// a socket's bytes are copied by the thread that sends or receives them, so
// one thread driving every link of a large exchange copied all of it on one
// core. Half the cores at most (on one host the servers copy the other
// side), and no more than four (the copies share the memory bus).
size_t PlaintextThreads(size_t links) {
  // The cores this process may run on (a container's or taskset's), not
  // the machine's.
  cpu_set_t allowed;
  const size_t cores = sched_getaffinity(0, sizeof(allowed), &allowed) == 0
                           ? static_cast<size_t>(CPU_COUNT(&allowed))
                           : std::thread::hardware_concurrency();
  return std::min({links, std::max<size_t>(2, cores / 2), size_t{4}});
}

}  // namespace

uint64_t WindowBytesForRoundTrip(absl::Duration round_trip) {
  if (round_trip <= kShortRoundTrip) return 0;
  return static_cast<uint64_t>(
      absl::ToDoubleSeconds(round_trip - kShortRoundTrip) *
      kAssumedLinkBytesPerSecond);
}

void RunExchanges(absl::Span<DataExchange> exchanges, absl::Time deadline,
                  size_t requests_in_flight) {
  // When each exchange ended, only where one follows another (backup
  // reads): most calls, every step, need no clock and allocate none.
  const bool clocks =
      std::any_of(exchanges.begin(), exchanges.end(),
                  [](const DataExchange& e) { return e.after >= 0; });
  std::vector<std::atomic<int64_t>> ended(clocks ? exchanges.size() : 0);
  for (std::atomic<int64_t>& e : ended) e.store(0);
  std::vector<DataLinkIo> links;
  for (size_t i = 0; i < exchanges.size(); ++i) {
    DataExchange& e = exchanges[i];
    auto it =
        std::find_if(links.begin(), links.end(),
                     [&](const DataLinkIo& l) { return l.link() == e.link; });
    if (it == links.end()) {
      links.emplace_back(e.link, clocks ? &ended : nullptr);
      it = links.end() - 1;
    }
    it->Add(&e, i);
  }
  std::vector<DataLinkIo*> live;
  size_t tls_links = 0, heavy_plaintext_links = 0;
  uint64_t heavy_plaintext_bytes = 0;
  for (DataLinkIo& io : links) {
    if (!io.link()->usable()) {
      io.Fail(absl::UnavailableError(absl::StrCat(
          "data-plane connection to ", io.link()->peer(), " is broken")));
      continue;
    }
    io.set_timeout(deadline - absl::Now());
    if (requests_in_flight != kWindowByHost) {
      io.set_window(requests_in_flight);
    } else if (io.link()->same_host()) {
      io.set_window(SIZE_MAX, kSameHostBytesInFlight);
    } else {
      io.set_window(SIZE_MAX,
                    WindowBytesForRoundTrip(io.link()->hello_round_trip()));
    }
    io.Prepare();
    live.push_back(&io);
    if (io.heavy() && io.link()->tls() != nullptr) {
      ++tls_links;
    } else if (io.heavy()) {
      ++heavy_plaintext_links;
      heavy_plaintext_bytes += io.bytes();
    }
  }
  // TLS spends its time in the cipher (encrypting requests, decrypting
  // answers), which one thread does for one link after another: with
  // several TLS links carrying large requests or answers, each group of
  // links gets its own thread so their records are encrypted and decrypted
  // on every core at once. Plaintext spends it in the kernel's copies, made
  // by the thread that sends or receives: several heavy plaintext links get
  // a few threads too (a 22 MiB PushPull through 2 servers on 2 cores:
  // bench/results/plaintext_threads.txt). Smaller calls
  // (kPlaintextThreadsFromBytes), which would pay more for waking a helper
  // than they save, stay on the calling thread; so do exchanges that follow
  // another (whose clock a thread sees at once only for an exchange it drives),
  // and streamed ones woken by more than one eventfd (one is relayed:
  // WakeRelay).
  int stream_wake_fd = -1;
  bool one_wake_fd = true;
  for (const DataExchange& e : exchanges) {
    if (e.send_wake_fd < 0) continue;
    one_wake_fd =
        one_wake_fd && (stream_wake_fd < 0 || stream_wake_fd == e.send_wake_fd);
    stream_wake_fd = e.send_wake_fd;
  }
  size_t threads = 1;
  if (tls_links >= 2) {
    threads = TlsThreads(live.size());
  } else if (heavy_plaintext_links >= 2 && !clocks &&
             heavy_plaintext_bytes >= kPlaintextThreadsFromBytes) {
    threads = PlaintextThreads(live.size());
  }
  // A streamed call's wake-ups reach the helpers through eventfds of their
  // own (WakeRelay).
  std::vector<ScopedFd> helper_wakes;
  ScopedFd helpers_done;
  WakeRelay relay;
  if (threads > 1 && stream_wake_fd >= 0 && !one_wake_fd) threads = 1;
  if (threads > 1 && stream_wake_fd >= 0) {
    helpers_done = ScopedFd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    bool made = helpers_done.valid();
    for (size_t t = 1; made && t < threads; ++t) {
      helper_wakes.emplace_back(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
      made = helper_wakes.back().valid();
      relay.helpers.push_back(helper_wakes.back().get());
    }
    relay.helpers_done = helpers_done.get();
    if (!made) threads = 1;
  }
  if (threads <= 1) {
    for (DataLinkIo* io : live) {
      io->RefreshSendable();
      io->Send();  // most requests fit: no wait
    }
    DriveLinks(absl::MakeConstSpan(live), deadline);
    return;
  }
  std::vector<std::vector<DataLinkIo*>> shares(threads);
  for (size_t i = 0; i < live.size(); ++i) {
    shares[i % threads].push_back(live[i]);
  }
  const bool relayed = !relay.helpers.empty();
  auto drive = [deadline](const std::vector<DataLinkIo*>& share, int wake_fd,
                          const WakeRelay* relay) {
    for (DataLinkIo* io : share) {
      io->RefreshSendable();
      io->Send();
    }
    DriveLinks(absl::MakeConstSpan(share), deadline, wake_fd, relay);
  };
  // From the first share given until every helper is done, the helpers use
  // this frame (the shares, `drive`, the relay's eventfds): nothing may
  // unwind it before then, so an exception ends the process here (as a
  // joinable std::thread's destructor would).
  [&]() noexcept {
    // Counts the helpers given a share; each says when its links are done.
    absl::BlockingCounter helpers_running(static_cast<int>(threads - 1));
    size_t given = 1;
    for (; given < threads; ++given) {
      const int wake_fd = relayed ? relay.helpers[given - 1] : -1;
      const int done_fd = relayed ? relay.helpers_done : -1;
      const bool taken = ExchangeHelpers().TryRun(
          [&drive, &share = shares[given], wake_fd, done_fd, &helpers_running] {
            drive(share, wake_fd, nullptr);
            if (done_fd >= 0) {
              const uint64_t one = 1;
              (void)!write(done_fd, &one, sizeof(one));
            }
            helpers_running.DecrementCount();
          });
      if (!taken) break;
    }
    if (given < threads) {
      // No helper to be had for the rest: the calling thread drives the links
      // none took.
      for (size_t rest = given; rest < threads; ++rest) {
        shares[0].insert(shares[0].end(), shares[rest].begin(),
                         shares[rest].end());
        helpers_running.DecrementCount();
      }
      if (relayed) relay.helpers.resize(given - 1);
    }
    drive(shares[0], relayed ? stream_wake_fd : -1, relayed ? &relay : nullptr);
    // Each helper's links end by the deadline, as these did.
    helpers_running.Wait();
  }();
}

absl::StatusOr<std::unique_ptr<DataLink>> DataLink::Open(
    const std::string& host, int port, absl::string_view token,
    uint64_t max_body_bytes, absl::Time deadline,
    std::shared_ptr<const TlsContext> tls) {
  absl::StatusOr<ScopedFd> fd =
      ConnectTcp(host, port, data_plane::kSocketBufferBytes, deadline);
  if (!fd.ok()) return fd.status();
  const std::string peer = absl::StrCat(host, ":", port);
  std::unique_ptr<TlsSession> session;
  if (tls != nullptr) {
    absl::StatusOr<std::unique_ptr<TlsSession>> connected =
        TlsSession::Connect(tls, fd->get(), host, peer, deadline);
    if (!connected.ok()) return connected.status();
    session = std::move(*connected);
    // SSL_read/SSL_write take no MSG_DONTWAIT: the socket itself is.
    fcntl(fd->get(), F_SETFL, fcntl(fd->get(), F_GETFL) | O_NONBLOCK);
    const bool kernel = session->ktls_send() || session->ktls_recv();
    LOG_FIRST_N(INFO, 1) << "data plane: TLS to " << peer << ": "
                         << session->Describe()
                         << (kernel ? ""
                             : !tls->ktls()
                                 ? " (kernel TLS off: --data_plane_ktls)"
                                 : absl::StrCat(
                                       " (kernel TLS unavailable: ",
                                       KernelTlsUnavailableReason().empty()
                                           ? "OpenSSL did not enable it"
                                           : KernelTlsUnavailableReason(),
                                       ")"));
  }
  std::unique_ptr<DataLink> link(
      new DataLink(std::move(*fd), peer, max_body_bytes));
  link->tls_ = std::move(session);
  link->same_host_ = ConnectsToThisHost(link->fd_.get());
  DataExchange hello;
  hello.link = link.get();
  hello.method = data_plane::Method::kHello;
  hello.body = {token};
  // The least of a few Hellos: one alone, on a host busy starting a job,
  // came back in anything from 0.05 to 8 ms on the lab's 0.1 ms links.
  link->hello_round_trip_ = absl::InfiniteDuration();
  for (int i = 0; i < kHellosTimed; ++i) {
    const absl::Time sent = absl::Now();
    RunExchanges(absl::MakeSpan(&hello, 1), deadline);
    if (!hello.status.ok()) return hello.status;
    link->hello_round_trip_ =
        std::min(link->hello_round_trip_, absl::Now() - sent);
  }
  return link;
}

}  // namespace pstrain
