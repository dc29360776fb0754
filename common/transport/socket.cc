#include "common/transport/socket.h"

#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace pstrain {

ScopedFd& ScopedFd::operator=(ScopedFd&& other) {
  if (this != &other) {
    Reset();
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

void ScopedFd::Reset() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

absl::Status SocketError(absl::string_view what, int error) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(error));
  if (error == EAGAIN || error == EWOULDBLOCK || error == ETIMEDOUT) {
    return absl::DeadlineExceededError(message);
  }
  return absl::UnavailableError(message);
}

absl::Status TuneSocket(int fd, int buffer_bytes, absl::Duration timeout) {
  const int one = 1;
  if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) != 0) {
    return SocketError("TCP_NODELAY", errno);
  }
  if (buffer_bytes > 0) {
    for (int option : {SO_SNDBUF, SO_RCVBUF}) {
      if (setsockopt(fd, SOL_SOCKET, option, &buffer_bytes,
                     sizeof(buffer_bytes)) != 0) {
        return SocketError("SO_SNDBUF/SO_RCVBUF", errno);
      }
    }
  }
  if (timeout > absl::ZeroDuration()) {
    const timeval tv = absl::ToTimeval(timeout);
    for (int option : {SO_SNDTIMEO, SO_RCVTIMEO}) {
      if (setsockopt(fd, SOL_SOCKET, option, &tv, sizeof(tv)) != 0) {
        return SocketError("SO_SNDTIMEO/SO_RCVTIMEO", errno);
      }
    }
  }
  return absl::OkStatus();
}

void ReceiveBuffer::MakeRoom(size_t bytes) {
  constexpr size_t kMinimum = 256 << 10;
  if (capacity_ - begin_ >= bytes) return;
  const size_t kept = end_ - begin_;
  if (capacity_ >= bytes) {
    std::memmove(data_.get(), data_.get() + begin_, kept);
  } else {
    const size_t capacity =
        std::max({bytes, kMinimum, capacity_ + capacity_ / 2});
    std::unique_ptr<char[]> bigger(new char[capacity]);
    if (kept > 0) std::memcpy(bigger.get(), data_.get() + begin_, kept);
    data_ = std::move(bigger);
    capacity_ = capacity;
  }
  begin_ = 0;
  end_ = kept;
}

void ConsumeIovecs(size_t sent, std::vector<iovec>& iov, size_t* first) {
  while (*first < iov.size() && sent >= iov[*first].iov_len) {
    sent -= iov[*first].iov_len;
    ++*first;
  }
  if (*first < iov.size()) {
    iov[*first].iov_base = static_cast<char*>(iov[*first].iov_base) + sent;
    iov[*first].iov_len -= sent;
  }
}

absl::Status SendAll(int fd, absl::Span<const absl::string_view> pieces) {
  std::vector<iovec> iov;
  iov.reserve(pieces.size());
  for (absl::string_view piece : pieces) {
    if (!piece.empty()) {
      iov.push_back({const_cast<char*>(piece.data()), piece.size()});
    }
  }
  size_t first = 0;  // iov[first] is the first piece not wholly sent
  while (first < iov.size()) {
    msghdr message = {};
    message.msg_iov = iov.data() + first;
    message.msg_iovlen = std::min<size_t>(IOV_MAX, iov.size() - first);
    const ssize_t sent = sendmsg(fd, &message, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      return SocketError("send", errno);
    }
    ConsumeIovecs(static_cast<size_t>(sent), iov, &first);
  }
  return absl::OkStatus();
}

absl::Status SendAll(int fd, const char* data, size_t size) {
  const absl::string_view piece(data, size);
  return SendAll(fd, absl::MakeConstSpan(&piece, 1));
}

absl::Status RecvAll(int fd, char* data, size_t size) {
  size_t received = 0;
  while (received < size) {
    const ssize_t got = recv(fd, data + received, size - received, 0);
    if (got == 0) {
      if (received == 0) return absl::OutOfRangeError("connection closed");
      return absl::DataLossError(absl::StrCat(
          "connection closed after ", received, " of ", size, " bytes"));
    }
    if (got < 0) {
      if (errno == EINTR) continue;
      return SocketError("recv", errno);
    }
    received += static_cast<size_t>(got);
  }
  return absl::OkStatus();
}

bool ConnectsToThisHost(int fd) {
  sockaddr_storage local = {}, peer = {};
  socklen_t local_bytes = sizeof(local), peer_bytes = sizeof(peer);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_bytes) != 0 ||
      getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_bytes) != 0 ||
      local.ss_family != peer.ss_family) {
    return false;
  }
  if (local.ss_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(&local)->sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in*>(&peer)->sin_addr.s_addr;
  }
  if (local.ss_family == AF_INET6) {
    return std::memcmp(
               &reinterpret_cast<const sockaddr_in6*>(&local)->sin6_addr,
               &reinterpret_cast<const sockaddr_in6*>(&peer)->sin6_addr,
               sizeof(in6_addr)) == 0;
  }
  return false;
}

namespace {

struct Address {
  sockaddr_storage storage = {};
  socklen_t length = 0;
  int family = AF_UNSPEC;
  const sockaddr* get() const {
    return reinterpret_cast<const sockaddr*>(&storage);
  }
};

absl::StatusOr<std::vector<Address>> Resolve(const std::string& host, int port,
                                             bool passive) {
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* found = nullptr;
  const std::string service = absl::StrCat(port);
  // An IPv6 address as gRPC writes it ("[::1]"): getaddrinfo takes it bare.
  std::string name = host;
  if (name.size() >= 2 && name.front() == '[' && name.back() == ']') {
    name = name.substr(1, name.size() - 2);
  }
  const int rc = getaddrinfo(name.empty() ? nullptr : name.c_str(),
                             service.c_str(), &hints, &found);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  std::vector<Address> all;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_addrlen > sizeof(sockaddr_storage)) continue;
    Address& address = all.emplace_back();
    std::memcpy(&address.storage, a->ai_addr, a->ai_addrlen);
    address.length = a->ai_addrlen;
    address.family = a->ai_family;
  }
  freeaddrinfo(found);
  return all;
}

}  // namespace

absl::StatusOr<ScopedFd> ConnectTcp(const std::string& host, int port,
                                    int buffer_bytes, absl::Time deadline) {
  absl::StatusOr<std::vector<Address>> addresses =
      Resolve(host, port, /*passive=*/false);
  if (!addresses.ok()) return addresses.status();
  absl::Status last =
      absl::UnavailableError(absl::StrCat("no address for '", host, "'"));
  for (const Address& a : *addresses) {
    ScopedFd fd(
        socket(a.family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd.valid()) {
      last = SocketError("socket", errno);
      continue;
    }
    if (absl::Status s =
            TuneSocket(fd.get(), buffer_bytes, absl::ZeroDuration());
        !s.ok()) {
      return s;
    }
    const std::string where = absl::StrCat(host, ":", port);
    if (connect(fd.get(), a.get(), a.length) != 0) {
      if (errno != EINPROGRESS) {
        last = SocketError(absl::StrCat("connect ", where), errno);
        continue;
      }
      pollfd p = {fd.get(), POLLOUT, 0};
      const int64_t wait_ms = std::max<int64_t>(
          0, absl::ToInt64Milliseconds(deadline - absl::Now()));
      const int ready =
          poll(&p, 1, static_cast<int>(std::min<int64_t>(wait_ms, INT_MAX)));
      if (ready == 0) {
        last = absl::DeadlineExceededError(
            absl::StrCat("connect ", where, ": timed out"));
        continue;
      }
      int error = 0;
      socklen_t length = sizeof(error);
      if (ready < 0) {
        error = errno;
      } else if (getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &length) !=
                 0) {
        error = errno;
      }
      if (error != 0) {
        last = SocketError(absl::StrCat("connect ", where), error);
        continue;
      }
    }
    const int flags = fcntl(fd.get(), F_GETFL);
    if (flags < 0 || fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0) {
      return SocketError("fcntl", errno);
    }
    return fd;
  }
  return last;
}

absl::StatusOr<ScopedFd> ListenTcp(const std::string& host, int port,
                                   int buffer_bytes, int* bound_port) {
  absl::StatusOr<std::vector<Address>> addresses =
      Resolve(host, port, /*passive=*/true);
  if (!addresses.ok()) return addresses.status();
  absl::Status last =
      absl::UnavailableError(absl::StrCat("no address for '", host, "'"));
  for (const Address& a : *addresses) {
    ScopedFd fd(socket(a.family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd.valid()) {
      last = SocketError("socket", errno);
      continue;
    }
    const int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (absl::Status s =
            TuneSocket(fd.get(), buffer_bytes, absl::ZeroDuration());
        !s.ok()) {
      return s;
    }
    sockaddr_storage bound = {};
    socklen_t length = sizeof(bound);
    if (bind(fd.get(), a.get(), a.length) != 0 || listen(fd.get(), 128) != 0 ||
        getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &length) !=
            0) {
      last = SocketError(absl::StrCat("listen on ", host, ":", port), errno);
      continue;
    }
    *bound_port = ntohs(bound.ss_family == AF_INET6
                            ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    return fd;
  }
  return last;
}

absl::Status SplitHostPort(absl::string_view address, std::string* host,
                           int* port) {
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", address, "' is not host:port"));
  }
  absl::string_view name = address.substr(0, colon);
  if (name.size() >= 2 && name.front() == '[' && name.back() == ']') {
    name = name.substr(1, name.size() - 2);
  }
  if (!absl::SimpleAtoi(address.substr(colon + 1), port) || *port < 1 ||
      *port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", address, "' has no valid port"));
  }
  *host = std::string(name);
  return absl::OkStatus();
}

}  // namespace pstrain
