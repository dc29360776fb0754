#include "worker/data_link.h"

#include <limits.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace pstrain {

using data_plane::kRequestHeaderBytes;
using data_plane::kResponseHeaderBytes;

void DataLink::MakeRoom(size_t bytes) {
  // Small answers get room for several, so reads can run ahead.
  constexpr size_t kMinimumBuffer = 256 << 10;
  if (buffer_capacity_ - received_begin_ >= bytes) return;
  const size_t kept = received_end_ - received_begin_;
  if (buffer_capacity_ >= bytes) {
    std::memmove(buffer_.get(), buffer_.get() + received_begin_, kept);
  } else {
    const size_t capacity = std::max(bytes, kMinimumBuffer);
    std::unique_ptr<char[]> bigger(new char[capacity]);
    if (kept > 0) {
      std::memcpy(bigger.get(), buffer_.get() + received_begin_, kept);
    }
    buffer_ = std::move(bigger);
    buffer_capacity_ = capacity;
  }
  received_begin_ = 0;
  received_end_ = kept;
}

// The exchanges of one link during RunExchanges: what is left to send, and
// where the answer being read stands.
class DataLinkIo {
 public:
  explicit DataLinkIo(DataLink* link) : link_(link) {}

  DataLink* link() const { return link_; }
  void Add(DataExchange* exchange) { queue_.push_back(exchange); }

  // Lays out every request as header + body pieces, in queue order.
  void Prepare() {
    headers_.resize(queue_.size() * kRequestHeaderBytes);
    for (size_t i = 0; i < queue_.size(); ++i) {
      DataExchange& e = *queue_[i];
      uint64_t body_bytes = 0;
      for (absl::string_view piece : e.body) body_bytes += piece.size();
      char* header = headers_.data() + i * kRequestHeaderBytes;
      data_plane::EncodeRequestHeader({e.method, timeout_ms_, body_bytes},
                                      header);
      iov_.push_back({header, kRequestHeaderBytes});
      for (absl::string_view piece : e.body) {
        if (!piece.empty()) {
          iov_.push_back({const_cast<char*>(piece.data()), piece.size()});
        }
      }
    }
  }
  void set_timeout(absl::Duration timeout) {
    timeout_ms_ = static_cast<uint32_t>(
        std::clamp<int64_t>(absl::ToInt64Milliseconds(timeout), 1, UINT32_MAX));
  }

  bool done() const { return answered_ == queue_.size(); }
  bool sending() const { return iov_first_ < iov_.size(); }
  int fd() const { return link_->fd_.get(); }

  // Sends what the socket takes without blocking.
  void Send() {
    while (!done() && sending()) {
      msghdr message = {};
      message.msg_iov = iov_.data() + iov_first_;
      message.msg_iovlen = std::min<size_t>(IOV_MAX, iov_.size() - iov_first_);
      const ssize_t sent = sendmsg(fd(), &message, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (sent < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        return Fail(SocketError(absl::StrCat("send to ", link_->peer_), errno));
      }
      size_t left = static_cast<size_t>(sent);
      while (iov_first_ < iov_.size() && left >= iov_[iov_first_].iov_len) {
        left -= iov_[iov_first_].iov_len;
        ++iov_first_;
      }
      if (sending()) {
        iov_[iov_first_].iov_base =
            static_cast<char*>(iov_[iov_first_].iov_base) + left;
        iov_[iov_first_].iov_len -= left;
      }
    }
  }

  // Reads what has arrived without blocking, finishing each answer whose
  // last byte is in.
  void Receive() {
    DataLink& l = *link_;
    while (!done()) {
      // The answer at the front: how many bytes it takes, once its header
      // is in.
      size_t frame_bytes = kResponseHeaderBytes;
      const size_t available = l.received_end_ - l.received_begin_;
      if (available >= kResponseHeaderBytes) {
        absl::StatusOr<data_plane::ResponseHeader> header =
            data_plane::DecodeResponseHeader(
                l.buffer_.get() + l.received_begin_, l.max_body_bytes_);
        if (!header.ok()) return Fail(header.status());
        frame_bytes += header->body_bytes;
        if (available >= frame_bytes) {
          Complete(*header,
                   absl::string_view(l.buffer_.get() + l.received_begin_ +
                                         kResponseHeaderBytes,
                                     header->body_bytes));
          l.received_begin_ += frame_bytes;
          if (l.received_begin_ == l.received_end_) {
            l.received_begin_ = l.received_end_ = 0;
          }
          continue;
        }
      }
      l.MakeRoom(frame_bytes);
      const ssize_t got =
          recv(fd(), l.buffer_.get() + l.received_end_,
               l.buffer_capacity_ - l.received_end_, MSG_DONTWAIT);
      if (got == 0) {
        return Fail(absl::UnavailableError(absl::StrCat(
            "data-plane connection to ", l.peer_,
            " closed by the server (restarting or shutting down?)")));
      }
      if (got < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        return Fail(SocketError(absl::StrCat("recv from ", l.peer_), errno));
      }
      l.received_end_ += static_cast<size_t>(got);
    }
  }

  // Ends every exchange not yet answered with `status`; the link is left
  // out of step, so it is not used again.
  void Fail(const absl::Status& status) {
    for (; answered_ < queue_.size(); ++answered_) {
      queue_[answered_]->status = status;
    }
    link_->usable_ = false;
  }

 private:
  void Complete(const data_plane::ResponseHeader& header,
                absl::string_view body) {
    DataExchange& e = *queue_[answered_++];
    if (header.code == absl::StatusCode::kOk) {
      e.status = e.on_response ? e.on_response(body) : absl::OkStatus();
    } else {
      e.status = absl::Status(header.code, body);
    }
  }

  DataLink* link_;
  std::vector<DataExchange*> queue_;
  uint32_t timeout_ms_ = 1;
  std::vector<char> headers_;
  std::vector<iovec> iov_;
  size_t iov_first_ = 0;
  size_t answered_ = 0;
};

void RunExchanges(absl::Span<DataExchange> exchanges, absl::Time deadline) {
  std::vector<DataLinkIo> links;
  for (DataExchange& e : exchanges) {
    auto it =
        std::find_if(links.begin(), links.end(),
                     [&](const DataLinkIo& l) { return l.link() == e.link; });
    if (it == links.end()) {
      links.emplace_back(e.link);
      it = links.end() - 1;
    }
    it->Add(&e);
  }
  for (DataLinkIo& io : links) {
    if (!io.link()->usable()) {
      io.Fail(absl::UnavailableError(absl::StrCat(
          "data-plane connection to ", io.link()->peer(), " is broken")));
      continue;
    }
    io.set_timeout(deadline - absl::Now());
    io.Prepare();
    io.Send();  // most requests fit the socket buffer: no wait
  }
  std::vector<pollfd> waits;
  std::vector<DataLinkIo*> waiting;
  while (true) {
    waits.clear();
    waiting.clear();
    for (DataLinkIo& io : links) {
      if (io.done()) continue;
      waits.push_back(
          {io.fd(), static_cast<short>(POLLIN | (io.sending() ? POLLOUT : 0)),
           0});
      waiting.push_back(&io);
    }
    if (waits.empty()) return;
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      for (DataLinkIo* io : waiting) {
        io->Fail(absl::DeadlineExceededError(
            absl::StrCat("no answer from the data plane of ",
                         io->link()->peer(), " by the deadline")));
      }
      return;
    }
    const int timeout_ms = static_cast<int>(std::min<int64_t>(
        absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))),
        INT_MAX));
    const int ready = poll(waits.data(), waits.size(), timeout_ms);
    if (ready < 0) {
      if (errno == EINTR) continue;
      const absl::Status error = SocketError("poll", errno);
      for (DataLinkIo* io : waiting) io->Fail(error);
      return;
    }
    for (size_t i = 0; i < waits.size(); ++i) {
      if (waits[i].revents & POLLOUT) waiting[i]->Send();
      if (waits[i].revents & (POLLIN | POLLERR | POLLHUP)) {
        waiting[i]->Receive();
      }
    }
  }
}

absl::StatusOr<std::unique_ptr<DataLink>> DataLink::Open(
    const std::string& host, int port, absl::string_view token,
    uint64_t max_body_bytes, absl::Time deadline) {
  absl::StatusOr<ScopedFd> fd =
      ConnectTcp(host, port, data_plane::kSocketBufferBytes, deadline);
  if (!fd.ok()) return fd.status();
  std::unique_ptr<DataLink> link(new DataLink(
      std::move(*fd), absl::StrCat(host, ":", port), max_body_bytes));
  DataExchange hello;
  hello.link = link.get();
  hello.method = data_plane::Method::kHello;
  hello.body = {token};
  RunExchanges(absl::MakeSpan(&hello, 1), deadline);
  if (!hello.status.ok()) return hello.status;
  return link;
}

}  // namespace pstrain
